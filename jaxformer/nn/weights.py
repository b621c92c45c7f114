"""Weight kinds: what a projection parameter may hold besides a float array, each bringing its own matmul
(`project(eq, x)`, which `nn.params.project` calls) so that the modules that use a weight never name its kind.

Today: `Quantized` (qwix's int8/int4 values with float32 scales: post-training quantization, `jaxformer.quantize`,
and a frozen int8 base under low-rank adapters, `frozen_base`); the decoding layout's kinds (`nn.layout`): `OutIn`
(a weight stored [out,in]) and `Fused` (projections of one input as one matrix, the others of its group `Within`).
Low-rank adapters are a kind of their own (`nn.lora.LoraWeight`). A frozen base is part of what a configured model
is (`nn.build.configured`), so its kinds live here, with the model; `jaxformer.quantize` applies them to a trained
model for inference.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx, struct

from jaxformer.axes import contracted_axes
from jaxformer.nn.params import contract, together


@struct.dataclass
class Quantized:
    """A quantized weight, bringing its own matmul (`project`).

    Attributes:
      array: qwix's QArray (qvalue int8/int4, scale float32, same rank as the weight).
      dynamic: whether matmuls quantize their activations too (w8a8).
      shape: the weight's shape (a property).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.weights import quantize_weight
      >>> q = quantize_weight(jnp.arange(12.0).reshape(4, 3) / 12, ("embed", "mlp"), "int8")   # w [D, F]
      >>> q.shape, q.array.qvalue.dtype, q.array.scale.shape, q.dynamic
      ((4, 3), dtype('int8'), (1, 3), False)
      >>> round(float(q.project("bd,df->bf", jnp.ones((1, 4)))[0, 2]), 2)      # x·w = 2.17 in float
      2.16
    """
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
    """Quantize one weight, a scale per output channel (int4: per tile of 128 inputs where the one input axis is
    a multiple of 128 above 128).

    Args:
      w: the float weight, e.g. [D, F] or [L, D, N, H].
      names: its logical axis names (`jaxformer.axes`), which say the contracted (input) axes.
      mode: "int8" (weight-only), "w8a8" (int8, activations quantized too) or "int4".

    Returns:
      `Quantized` of w's shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.weights import quantize_weight
      >>> q = quantize_weight(jnp.ones((2, 16, 4)), ("layers", "embed", "mlp"), "int4")       # [L, D, F]
      >>> q.array.qvalue.dtype, q.array.scale.shape
      (dtype(int4), (2, 1, 4))
    """
    inputs = contracted_axes(names)
    channels = tuple(i for i in range(w.ndim) if i not in inputs)
    tiles = None
    if mode == "int4" and len(inputs) == 1 and w.shape[inputs[0]] > 128 and w.shape[inputs[0]] % 128 == 0:
        tiles = {inputs[0]: 128}
    qtype = jnp.int4 if mode == "int4" else jnp.int8
    return Quantized(qwix.quantize(w, qtype, channelwise_axes=channels, tiled_axes=tiles), mode == "w8a8")


def quantizable(v) -> bool:
    """Whether v is a parameter created with quantizable=True (the projections inside the layer stacks: not
    embeddings, the output head, norms or the MoE router).

    Args:
      v: any value of a model's graph.

    Returns:
      True for an nnx.Param whose metadata has quantizable=True.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.nn.weights import quantizable
      >>> quantizable(nnx.Param(jnp.ones(2), quantizable=True)), quantizable(nnx.Param(jnp.ones(2)))
      (True, False)
    """
    return isinstance(v, nnx.Param) and bool(v.get_metadata().get("quantizable"))


def frozen_base(model: nnx.Module, lora=None) -> nnx.Module:
    """A model with low-rank adapters with its frozen projections in lora.base, in place: bfloat16 (cast) or int8
    (weight-only, as `quantize_model` "int8") for every projection (the adapted weights' bases and the
    projections without an adapter; embeddings, head and norms stay as they are).

    Args:
      model: a built model (any nnx.Module whose projections are marked quantizable).
      lora: a `LoraConfig` (None: model.cfg.lora).

    Returns:
      The model; any other one (lora rank 0, or a float32 base) as it is.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import LoraConfig
      >>> from jaxformer.nn.params import param
      >>> from jaxformer.nn.weights import frozen_base
      >>> class Proj(nnx.Module):                         # a projection w [D, F] and a bias
      ...     def __init__(self, rngs):
      ...         self.w = param(rngs, nnx.initializers.ones, (4, 3), ("embed", "mlp"), quantizable=True)
      ...         self.b = param(rngs, nnx.initializers.zeros, (3,), ("mlp",))
      >>> m = Proj(nnx.Rngs(0))
      >>> frozen_base(m, LoraConfig()) is m               # lora rank 0: nothing frozen
      True
      >>> m = frozen_base(m, LoraConfig(rank=2, base="int8"))
      >>> type(m.w.get_value()).__name__, m.b.get_value().dtype
      ('Quantized', dtype('float32'))
    """
    lora = model.cfg.lora if lora is None else lora
    if not lora.rank or lora.base == "float32":
        return model
    for _, v in nnx.iter_graph(model):
        if quantizable(v) and not isinstance(v.get_value(), Quantized):
            names = tuple(v.get_metadata().get("out_sharding") or ())
            w = v.get_value()
            v.set_value(w.astype(jnp.bfloat16) if lora.base == "bfloat16" else quantize_weight(w, names, "int8"))
    return model


def _einsum_parts(eq: str) -> tuple[str, str, str]:
    ins, out = eq.replace(" ", "").split("->")
    x, w = ins.split(",")
    return x, w, out


@struct.dataclass
class OutIn:
    """A projection weight [in..., out...] stored in [out..., in...] order: its matmul contracts the inputs on the
    array's last axes. A token loop's layout of a weight whose input is wider than its output (`nn.layout`:
    XLA:CPU's matrix-vector product reads it faster in this order).

    Attributes:
      array: [out..., in...] the stored weight.
      inputs: how many input axes the weight has (default 1).
      shape: the weight's own shape [in..., out...] (a property).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.weights import OutIn
      >>> w = jnp.arange(6.0).reshape(3, 2)                   # [F, D]
      >>> o = OutIn(w.T)
      >>> o.shape, bool((o.dequantize() == w).all()), o.project("bf,fd->bd", jnp.ones((1, 3))).tolist()
      ((3, 2), True, [[6.0, 9.0]])
    """
    array: jax.Array
    inputs: int = struct.field(pytree_node=False, default=1)

    @property
    def shape(self):
        """The weight's own shape [in..., out...]."""
        s = self.array.shape
        return s[len(s) - self.inputs:] + s[:len(s) - self.inputs]

    def __getitem__(self, key) -> "OutIn":
        return _whole(self, key)

    def dequantize(self) -> jax.Array:
        """The weight as a float array in its own order [in..., out...]."""
        n = self.array.ndim
        return jnp.transpose(self.array, [*range(n - self.inputs, n), *range(n - self.inputs)])

    def project(self, eq: str, x: jax.Array) -> jax.Array:
        """einsum(eq, x, weight) -> x's dtype, eq "rows+inputs,inputs+outputs->rows+outputs" as every projection
        reads; contracted against the stored [out..., in...] array."""
        xs, ws, out = _einsum_parts(eq)
        stored = ws[self.inputs:] + ws[:self.inputs]
        return contract(f"{xs},{stored}->{out}", x, self.array.astype(x.dtype))


@struct.dataclass
class Fused:
    """Projections that read the same input laid out as one matrix, so that the group projects in one matmul
    (`project_each`). Held by the group's first weight; the others hold `Within`.

    Attributes:
      array: [I, O₁+O₂+…] each weight of `shapes` flattened to its input I and outputs Oᵢ, side by side.
      shapes: the group's weights' own shapes.
      shape: the first weight's shape (a property).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.weights import Fused, Within
      >>> f = Fused(jnp.ones((2, 5)), ((2, 3), (2, 2)))        # w₁ [D, 3] and w₂ [D, 2] side by side
      >>> a, b = f.project_each(("bd,df->bf", "bd,df->bf"), jnp.ones((1, 2)), (Within((2, 2)),))
      >>> f.shape, a.tolist(), b.tolist()
      ((2, 3), [[2.0, 2.0, 2.0]], [[2.0, 2.0]])
    """
    array: jax.Array
    shapes: tuple = struct.field(pytree_node=False)

    @property
    def shape(self):
        return self.shapes[0]

    def __getitem__(self, key) -> "Fused":
        return _whole(self, key)

    def project_each(self, eqs: tuple[str, ...], x: jax.Array, others: tuple) -> tuple[jax.Array, ...]:
        """The group's projections of x (`nn.params.project_each`): others, the group's other weights, hold
        `Within`."""
        if len(eqs) != len(self.shapes) or len(others) != len(self.shapes) - 1 or \
                not all(isinstance(w, Within) for w in others):
            raise ValueError(f"a fused weight of {len(self.shapes)} projections projects with its group; got "
                             f"{len(eqs)} equations and {[type(w).__name__ for w in others]}")
        return together(eqs, x, self.array, self.shapes)

    def project(self, eq: str, x: jax.Array) -> jax.Array:
        raise ValueError("a fused weight projects with its group (nn.params.project_each), not alone")


@struct.dataclass
class Within:
    """A weight laid out inside its group's `Fused` matrix (held by the group's first weight): no array here.

    Attributes:
      shape: the weight's own shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.weights import Within
      >>> Within((2, 3)).project("bd,df->bf", jnp.ones((1, 2)))
      Traceback (most recent call last):
      ...
      ValueError: this weight is laid out inside its group's fused matrix: ...
    """
    shape: tuple = struct.field(pytree_node=False)

    def __getitem__(self, key) -> "Within":
        return _whole(self, key)

    def project(self, eq: str, x: jax.Array) -> jax.Array:
        raise ValueError("this weight is laid out inside its group's fused matrix: project the group "
                         "(nn.params.project_each)")


def _whole(w, key):
    """param[...] of a laid-out weight: the weight itself (it is one layer's; no index into it)."""
    if key is not Ellipsis:
        raise TypeError(f"a {type(w).__name__} weight is read whole: w[...]")
    return w

