"""Parameter creation with logical axis names (what sharding rules map onto mesh axes) and weight-decay marks.

Logical axes: "vocab" V, "embed" D, "q_heads" N, "kv_heads" K, "head_dim" H, "mlp" F, "expert" E, "layers" L
(the last is prepended by the layer stack).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Init = jax.nn.initializers.Initializer


def param(rngs: nnx.Rngs, init: Init, shape: tuple[int, ...], axes: tuple[str, ...], dtype=jnp.float32, *,
          matrix: bool = False) -> nnx.Param:
    """An nnx.Param whose metadata `out_sharding` holds its logical axis names (not applied eagerly).
    matrix=True marks a weight matrix (a projection), as opposed to a bias, a norm scale or an embedding
    table: AdamW decays only these by default (optim.weight_decay_mask='matrices')."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False, matrix=matrix)


def dense_init(in_axes: int | tuple[int, ...], out_axes: int | tuple[int, ...],
               batch_axes: int | tuple[int, ...] = ()) -> Init:
    """Glorot-uniform over grouped fan-in/fan-out axes (as PyTorch's MHA in_proj / the paper); batch_axes (e.g.
    MoE experts E) are independent matrices, counted in neither fan."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=in_axes, out_axis=out_axes,
                                                batch_axis=batch_axes)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def matrix_mask(module: nnx.Module) -> nnx.State:
    """nnx.state(module, nnx.Param) with each parameter replaced by True for weight matrices (see `param`)."""
    return jax.tree.map(lambda v: bool(v.get_metadata().get("matrix", False)), nnx.state(module, nnx.Param),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def logical_axes(module: nnx.Module) -> dict:
    """{path: logical axis names} of every parameter (stacked ones carry "layers" first)."""
    return {path: tuple(v.get_metadata().get("out_sharding") or ())
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
