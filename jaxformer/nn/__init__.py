"""Thin Flax NNX modules over jaxformer.ops; the models own their KV cache and their cached step."""
from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.cache import KVCache, LayerKV, Memory, QuantizedKV
from jaxformer.nn.layers import Context, DecoderBlock, EncoderBlock, FeedForward, Norm
from jaxformer.nn.build import build_model, count_params
from jaxformer.nn.models import Decoder, Encoder, Transformer, TransformerLM
from jaxformer.nn.stack import LayerStack

__all__ = ["MultiHeadAttention", "KVCache", "LayerKV", "Memory", "QuantizedKV", "Context", "DecoderBlock",
           "EncoderBlock", "FeedForward", "Norm", "Decoder", "Encoder", "Transformer", "TransformerLM", "build_model",
           "count_params", "LayerStack"]
