"""Parameter creation with logical axis names (what sharding rules map onto mesh axes), weight-decay and
quantization marks, and `project`, the one matmul every projection goes through.

Logical axes: "vocab" V, "embed" D, "q_heads" N, "kv_heads" K, "head_dim" H, "mlp" F, "expert" E, "layers" L
(the last is prepended by the layer stack).
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import platforms
from jaxformer.platforms import cpu as layout

Init = jax.nn.initializers.Initializer
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}   # model.runtime.dtype -> jnp


def param(rngs: nnx.Rngs, init: Init, shape: tuple[int, ...], axes: tuple[str, ...], dtype=jnp.float32, *,
          matrix: bool = False, quantizable: bool = False, hidden: bool | None = None) -> nnx.Param:
    """An nnx.Param whose metadata `out_sharding` holds its logical axis names (not applied eagerly).
    matrix=True marks a weight matrix (a projection), as opposed to a bias, a norm scale or an embedding
    table: AdamW decays only these by default (optim.weight_decay_mask='matrices'). quantizable=True marks a
    projection that post-training quantization may replace (its matmul goes through `project`). hidden: a
    matrix whose fan-in grows with the width and whose update µP scales by 1/m (`hidden_mask`); default
    quantizable."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False, matrix=matrix,
                     quantizable=quantizable, hidden=quantizable if hidden is None else hidden)


def project(eq: str, x: jax.Array, w) -> jax.Array:
    """einsum(eq, x, w) for a projection weight w -> x's dtype. w is a float array (cast to x's dtype) or any
    weight that brings its own matmul (`w.project(eq, x)`, e.g. a quantized weight), so modules never import
    a quantizer."""
    if hasattr(w, "project"):
        return w.project(eq, x)
    return contract(eq, x, w.astype(x.dtype))


def project_each(eqs: tuple[str, ...], x: jax.Array, ws: tuple, then: tuple) -> tuple[jax.Array, ...]:
    """`then[i](project(eq, x, w))` for each (eq, w) of projections that read the same x (a self-attention's q, k
    and v; a gated FFN's gate and input) -> their outputs (then: what each output goes through next, e.g. its
    bias). One matmul where the weights allow: a group laid out as one matrix (its first weight a
    kind with `project_each`, e.g. `nn.weights.Fused` of the decoding layout, `nn.layout`), or, with lever
    `fused_projections` (`jaxformer.platforms`), float arrays concatenated at this call (not weights that bring
    their own matmul: quantized, adapted). Each eq reads "rows+inputs,inputs+outputs->rows+outputs" with the
    same rows and inputs."""
    if hasattr(ws[0], "project_each"):
        return tuple(f(y) for f, y in zip(then, ws[0].project_each(eqs, x, ws[1:])))
    if lever("fused_projections") and not any(hasattr(w, "project") for w in ws):
        ys = together(eqs, x, side_by_side(ws), tuple(w.shape for w in ws))
        return tuple(f(y) for f, y in zip(then, ys))
    return tuple(f(project(eq, x, w)) for f, eq, w in zip(then, eqs, ws))


def side_by_side(ws) -> jax.Array:
    """Weights [I, outputs...] that read the same input, as one matrix [I, O₁+O₂+…] (each flattened to its
    outputs): what `together` projects with (a `fused_projections` call's, a decoding layout's `Fused`)."""
    return jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1)


def together(eqs: tuple[str, ...], x: jax.Array, w: jax.Array, shapes: tuple) -> tuple[jax.Array, ...]:
    """The projections `eqs` of x by weights of `shapes` laid side by side in w [I, O₁+O₂+…] (each flattened
    to its inputs I and outputs Oᵢ), as one matmul, split and shaped as each eq's output."""
    inputs = _inputs(eqs[0])
    xs = eqs[0].split(",")[0]
    if len(inputs) != 1 or any(_inputs(eq) != inputs or eq.split(",")[0] != xs for eq in eqs):
        raise ValueError(f"project_each: {eqs} do not read one input axis of the same x")
    rows = xs[:-1]
    letter = next(c for c in "EZYXWVU" if c not in xs)
    y = project(f"{xs},{inputs}{letter}->{rows}{letter}", x, w)
    ends = list(itertools.accumulate(math.prod(s[1:]) for s in shapes))
    parts = jnp.split(y, ends[:-1], axis=-1)
    return tuple(p.reshape(*p.shape[:-1], *s[1:]) for p, s in zip(parts, shapes))


def _inputs(eq: str) -> str:
    """The contracted letters of a projection's equation "rows+inputs,inputs+outputs->rows+outputs"."""
    xs, ws = eq.split("->")[0].split(",")
    return "".join(c for c in ws if c in xs)


def weight(w, rngs: nnx.Rngs | None = None):
    """A projection parameter's value as `project` takes it: w[...]; for a weight with a low-rank adapter in a
    training call (rngs: its dropout stream), the adapter's input dropout keyed from rngs (`nn.lora.Adapted`)."""
    adapted = rngs is not None and not isinstance(w, nnx.Variable) and hasattr(w, "weight")
    return w.weight(rngs) if adapted else w[...]


def contract(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(eq, x, w) for a two-operand equation without batch letters ("BTNH,NHD->BTD"), as one dot_general
    whose contracting dimensions follow w's order. jnp.einsum may order them otherwise (here H before N), and
    XLA:CPU then copies w into that order at every call: the whole wo weight, per layer and step, forward and
    backward (the copies per decoded token: benchmarks/decode_profile.py; benchmarks/results/decode_profile.md,
    "transposes/copies"). An equation with batch letters goes
    to jnp.einsum, and so does every equation where the "weight_order_dot" lever is off (`jaxformer.platforms`).
    Its backward takes the weight gradient as `_weight_grad` computes it where the "weight_grad" lever is on."""
    ins, out = eq.split("->")
    xs, ws = ins.split(",")
    con = [c for c in ws if c in xs and c not in out]
    if any(c in ws and c in out for c in xs) or not lever("weight_order_dot"):
        return jnp.einsum(eq, x, w)
    free = [c for c in xs if c not in con] + [c for c in ws if c not in con]
    dot = _dot if lever("weight_grad") else jax.lax.dot_general
    y = dot(x, w, ((tuple(xs.index(c) for c in con), tuple(ws.index(c) for c in con)), ((), ())))
    return y if free == list(out) else jnp.transpose(y, [free.index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot(x: jax.Array, w: jax.Array, dims) -> jax.Array:
    """jax.lax.dot_general(x, w, dims), whose backward takes the weight gradient from `_weight_grad` (the
    "weight_grad" lever of `jaxformer.platforms`)."""
    return jax.lax.dot_general(x, w, dims)


def _dot_fwd(x, w, dims):
    return jax.lax.dot_general(x, w, dims), (x, w)


def _dot_bwd(dims, res, g):
    x, w = res
    _, vjp = jax.vjp(lambda x: jax.lax.dot_general(x, w, dims), x)
    return vjp(g)[0], _weight_grad(dims, x, w, g)


_dot.defvjp(_dot_fwd, _dot_bwd)


def _weight_grad(dims, x: jax.Array, w: jax.Array, g: jax.Array) -> jax.Array:
    """dL/dw of y = dot_general(x, w, dims) (no batch dims) from g = dL/dy, in w's shape and dtype.

    The sum over the tokens (x's free axes, M of them flattened) is one matmul in standard form [a,M]·[M,b] whose
    transposed operand is the smaller one: x's contracted axes moved first ([Kin,M], when w's input size Kin is at
    most its output size Kout), else g's ([Kout,M]; the [Kout,Kin] product is then transposed back, a weight-sized
    copy). Each transpose is materialized (`platforms.cpu.materialize`), or XLA would fold it back into the dot.
    Left to itself (jax's transpose of the dot), XLA:CPU transposes g even where x is the smaller operand (the
    FFN's input projection: [M,F] rather than [M,D]) and runs a dot with both operands transposed, slower than
    the standard form. benchmarks/levers.py (`weight_grad`) measures the step against that form (g materialized
    first, as it was). Under a mesh of more than one device: jax's own form (flattening the token axes would
    merge sharded axes)."""
    (xc, wc), _ = dims
    if layout.sharded():
        return jax.vjp(lambda w: jax.lax.dot_general(x, w, dims), w)[1](g)[0]
    xf = [i for i in range(x.ndim) if i not in xc]
    wf = [i for i in range(w.ndim) if i not in wc]
    m = math.prod(x.shape[i] for i in xf)
    k_in, k_out = math.prod(x.shape[i] for i in xc), math.prod(w.shape[i] for i in wf)
    g2 = g.reshape(m, k_out)                                         # g's axes: x's free axes, then w's free axes
    x2 = jnp.transpose(x, [*xf, *xc]).reshape(m, k_in)             # free when x's contracted axes are last
    if k_in <= k_out:
        d = jnp.matmul(layout.materialize(_transpose(x2)), g2)                          # [Kin, Kout]
    else:
        d = jnp.matmul(layout.materialize(_transpose(g2)), x2).T
    d = d.reshape([w.shape[i] for i in wc] + [w.shape[i] for i in wf])             # axes wc then wf
    axes = [*wc, *wf]
    return jnp.transpose(d, [axes.index(i) for i in range(w.ndim)]).astype(w.dtype)


def lever(name: str) -> bool:
    """Whether the platform lever `name` is on where the model is being traced: the model's one door to
    `jaxformer.platforms` (the other nn modules ask here)."""
    return platforms.enabled(name)


def _transpose(x: jax.Array) -> jax.Array:
    """x [M,K] -> x.T, tile by tile where the "tiled_transpose" lever is on (`jaxformer.platforms`)."""
    return layout.transpose(x) if lever("tiled_transpose") else x.T


def dequantized(w) -> jax.Array:
    """A weight's value as a float array: a weight that brings its own matmul is dequantized (`w.dequantize()`);
    for code that needs the array itself (e.g. grouped expert matmuls)."""
    return w.dequantize() if hasattr(w, "dequantize") else w


def dense_init(in_axes: int | tuple[int, ...], out_axes: int | tuple[int, ...],
               batch_axes: int | tuple[int, ...] = ()) -> Init:
    """Glorot-uniform over grouped fan-in/fan-out axes (as PyTorch's MHA in_proj / the paper); batch_axes (e.g.
    MoE experts E) are independent matrices, counted in neither fan."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=in_axes, out_axis=out_axes,
                                                batch_axis=batch_axes)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def matrix_mask(module: nnx.Module, wrt=nnx.Param) -> nnx.State:
    """nnx.state(module, wrt) (the parameters trained) with each replaced by True for weight matrices (see
    `param`)."""
    return jax.tree.map(lambda v: bool(v.get_metadata().get("matrix", False)), nnx.state(module, wrt),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def hidden_mask(module: nnx.Module, wrt=nnx.Param) -> nnx.State:
    """nnx.state(module, wrt) with True for the hidden matrices (`param(hidden=True)`: the attention and FFN
    projections, whose fan-in and fan-out both grow with the width, and the MoE router, whose fan-in does: µP
    scales their Adam update by 1/m so that the change of their outputs, a sum over the width, stays of one
    size), False for the rest (embeddings, the output head, biases, norms, adapters)."""
    return jax.tree.map(lambda v: bool(v.get_metadata().get("hidden", False)), nnx.state(module, wrt),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def muon_dims(module: nnx.Module, wrt=nnx.Param) -> nnx.State:
    """Per parameter: Muon's matrix axes (optax.contrib.MuonDimensionNumbers: reduction = the input axes,
    output = the rest; "layers" and "expert" axes are batch) for the projections (quantizable=True: attention
    and FFN matrices), None (Adam) for the rest: embeddings, the output head, the router, biases and norms."""
    from optax.contrib import MuonDimensionNumbers

    def dims(v):
        if not v.get_metadata().get("quantizable", False):
            return None
        axes = v.get_metadata()["out_sharding"]
        own = [i for i, a in enumerate(axes) if a not in ("layers", "expert")]
        red = own[:1] if axes[own[0]] == "embed" else own[:-1]
        return MuonDimensionNumbers(tuple(red), tuple(i for i in own if i not in red))
    return jax.tree.map(dims, nnx.state(module, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))
