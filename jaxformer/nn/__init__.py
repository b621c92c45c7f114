"""Thin Flax NNX modules over jaxformer.ops."""
from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.layers import DecoderBlock, EncoderBlock, FeedForward, Norm
from jaxformer.nn.models import Decoder, Encoder, Transformer, TransformerLM, build_model, count_params
from jaxformer.nn.stack import LayerStack

__all__ = ["MultiHeadAttention", "DecoderBlock", "EncoderBlock", "FeedForward", "Norm", "Decoder", "Encoder",
           "Transformer", "TransformerLM", "build_model", "count_params", "LayerStack"]
