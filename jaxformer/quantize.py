"""Post-training weight quantization with qwix: a trained model's projection weights (attention q/k/v/o, the FFN,
MoE experts) become int8 or int4 values with float32 scales, chosen when a run is loaded for inference.

Modes (`quantize_model(model, mode)`):
  int8   weight-only: int8 values, one float32 scale per output channel (and per layer); matmuls dequantize the
         weight and multiply in the activations' dtype.
  int4   weight-only: int4 values (packed two per byte in device memory; 1 byte per value when converted to
         numpy, e.g. in an .npy file), one scale per output channel and per block of 128 inputs where the input
         width is a multiple of 128 above 128, else per output channel.
  w8a8   int8 weights as int8, and each matmul also quantizes its activations to int8 per token (a dynamic scale),
         so the dot itself runs int8 × int8 -> int32, then rescales.
Attention logits and softmax, norms, embeddings, the output head and the MoE router stay as they were (float32).

A quantized weight stays in its nnx.Param, stacked over layers like the float one (a `Quantized` pytree of qwix's
QArray), so the layer scan, the KV-cached decoder and beam search run unchanged. It brings its own matmul
(`Quantized.project`, which `jaxformer.nn.params.project` calls) and dequantization, so the modules never import
this one; what may be quantized is parameter metadata set where each parameter is created (quantizable=True).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxformer.axes import contracted_axes  # noqa: F401 (re-exported: a projection's input axes)
from jaxformer.errors import ConfigError
from jaxformer.nn.weights import Quantized, quantizable, quantize_weight  # noqa: F401 (the kinds, re-exported)

MODES = ("int8", "int4", "w8a8")


def quantize_model(model: nnx.Module, mode: str) -> nnx.Module:
    """Quantize `model`'s projection weights in place (see the module doc) and return it. ConfigError for an
    unknown mode."""
    if mode not in MODES:
        raise ConfigError(f"quantize={mode!r} is not one of {MODES}")
    for path, v in nnx.iter_graph(model):
        if quantizable(v) and not isinstance(v.get_value(), Quantized):     # an int8 LoRA base stays as it is
            names = tuple(v.get_metadata().get("out_sharding") or ())
            v.set_value(quantize_weight(v.get_value(), names, mode))
    return model


def weight_bytes(model: nnx.Module) -> dict[str, int]:
    """Bytes of the model's parameters: {"quantized": int8/int4 values (int4 counted at half a byte, as packed in
    device memory) + their scales, "float": every other parameter, "total"}."""
    q = f = 0
    for _, v in nnx.iter_graph(model):
        if not isinstance(v, nnx.Param):
            continue
        val = v.get_value()
        if isinstance(val, Quantized):
            bits = 4 if val.array.qvalue.dtype == jnp.int4 else 8
            q += val.array.qvalue.size * bits // 8 + val.array.scale.size * val.array.scale.dtype.itemsize
        else:
            f += val.size * val.dtype.itemsize
    return {"quantized": q, "float": f, "total": q + f}
