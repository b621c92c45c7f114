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

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx, struct

from jaxformer.axes import contracted_axes  # noqa: F401 (re-exported: a projection's input axes)
from jaxformer.errors import ConfigError

MODES = ("int8", "int4", "w8a8")


@struct.dataclass
class Quantized:
    """A quantized weight: qwix's QArray (qvalue int8/int4, scale float32, same rank as the weight) and whether
    matmuls quantize their activations too (w8a8)."""
    array: qwix.QArray
    dynamic: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self):
        return self.array.qvalue.shape

    def __getitem__(self, key) -> "Quantized":
        """param[...] reads the weight whole; an index slices its leading axes (e.g. one layer)."""
        return self if key is Ellipsis else jax.tree.map(lambda a: a[key], self)

    def dequantize(self) -> jax.Array:
        return qwix.dequantize(self.array)

    def project(self, eq: str, x: jax.Array) -> jax.Array:
        """einsum(eq, x, self) -> x's dtype, as one 2-D matmul [M,K]·[K,N] (on XLA:CPU a 3-D int8 einsum lowers
        to a transposed dot; the 2-D form's decode: benchmarks/quantize.py; benchmarks/results/quantize.md,
        "Cached decoding per token"). eq must read "rows+inputs,inputs+outputs->rows+outputs" (every
        projection does); w8a8 also quantizes x per row."""
        xs, ws, out = _einsum_parts(eq)
        n_in = sum(c in ws for c in xs)
        rows = xs[:len(xs) - n_in]
        if xs[len(rows):] != ws[:n_in] or out != rows + ws[n_in:]:
            raise ValueError(f"project: {eq!r} is not rows+inputs,inputs+outputs->rows+outputs")
        lead, outs = x.shape[:len(rows)], self.shape[n_in:]
        m, k = math.prod(lead), math.prod(x.shape[len(rows):])
        x2, w2 = x.reshape(m, k), self.array.reshape(k, math.prod(outs))
        if self.dynamic:
            # XLA:CPU runs an int8 dot of a single row by converting the whole weight to int32 first; two rows
            # take its int8 kernel, so a one-row activation (batch-1 decoding) is doubled and the copy dropped
            if m == 1:
                x2 = jnp.concatenate([x2, x2])
            x2 = qwix.quantize(x2.astype(jnp.float32), jnp.int8, channelwise_axes=(0,))     # a scale per row
        return qwix.dot(x2, w2)[:m].reshape(*lead, *outs).astype(x.dtype)


def quantize_weight(w: jax.Array, names: tuple[str, ...], mode: str) -> Quantized:
    """One weight (with its logical axis names) -> Quantized."""
    inputs = contracted_axes(names)
    channels = tuple(i for i in range(w.ndim) if i not in inputs)
    tiles = None
    if mode == "int4" and len(inputs) == 1 and w.shape[inputs[0]] > 128 and w.shape[inputs[0]] % 128 == 0:
        tiles = {inputs[0]: 128}
    qtype = jnp.int4 if mode == "int4" else jnp.int8
    return Quantized(qwix.quantize(w, qtype, channelwise_axes=channels, tiled_axes=tiles), mode == "w8a8")


def quantizable(v) -> bool:
    """A parameter created with quantizable=True (the projections inside the layer stacks: not embeddings, the
    output head, norms or the MoE router)."""
    return isinstance(v, nnx.Param) and bool(v.get_metadata().get("quantizable"))


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


def frozen_base(model: nnx.Module, lora=None) -> nnx.Module:
    """A model with low-rank adapters (model.lora, or `lora` when given) with its frozen projections in
    lora.base, in place; returned: bfloat16 (cast) or int8 (weight-only, as `quantize_model` "int8") for every projection (the
    adapted weights' bases and the projections without an adapter; embeddings, head and norms stay as they
    are). Any other model (no adapters, or a float32 base) is returned as it is."""
    lora = model.cfg.lora if lora is None else lora
    if not lora.rank or lora.base == "float32":
        return model
    for _, v in nnx.iter_graph(model):
        if quantizable(v) and not isinstance(v.get_value(), Quantized):
            names = tuple(v.get_metadata().get("out_sharding") or ())
            w = v.get_value()
            v.set_value(w.astype(jnp.bfloat16) if lora.base == "bfloat16" else quantize_weight(w, names, "int8"))
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


def _einsum_parts(eq: str) -> tuple[str, str, str]:
    ins, out = eq.replace(" ", "").split("->")
    x, w = ins.split(",")
    return x, w, out


