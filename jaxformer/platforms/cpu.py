"""Layout help for XLA:CPU's code generation: `materialize`, an identity that ends a fusion.

XLA:CPU fuses elementwise producers into the transposing copy a weight-gradient dot needs (its operand with
the contracted rows last), and emits that fusion slower than its parts run apart (the elementwise work and a
plain transpose, against the two in one fusion: benchmarks/kernels.py; benchmarks/results/kernels.md, "Layout
copies"). jax.lax.optimization_barrier does not stop it (XLA:CPU removes barriers before fusing). It also
keeps an explicit transpose from being folded back into the dot that reads it: `nn.params._weight_grad`
transposes the smaller operand of each weight gradient itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sharded() -> bool:
    """Whether the code being traced runs under a mesh of more than one device (`jax.set_mesh`, as
    `parallel.Plan.use` sets): the layout tricks here and in `nn.params._weight_grad` then step aside."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def materialize(x: jax.Array) -> jax.Array:
    """x, unchanged, computed into a buffer of its own on CPU, so that no consumer fuses x's producers into
    itself; on other platforms x as is (a conditional there may wait on the device; lax.platform_dependent).

    How: a lax.cond whose predicate is always true (x's first element is finite, NaN or infinite), which the
    compiler cannot fold; its true branch returns x. Any shape and dtype; jit, grad (identity) and vmap. Under
    a mesh of more than one device (jax.set_mesh, as `parallel.Plan.use` sets) x is returned as is: reading one
    element of a sharded x would add a collective to every call (benchmarks/parallel.py counts them)."""
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.floating) or sharded():
        return x

    def on_cpu(a):
        v = a.reshape(-1)[0]
        always = jnp.isfinite(v) | jnp.isnan(v) | jnp.isinf(v)
        return jax.lax.cond(always, lambda a: a, lambda a: -a, a)

    return jax.lax.platform_dependent(x, cpu=on_cpu, default=lambda a: a)


TILE = 32           # the square tile `transpose` moves at a time
TILED_MIN = 2 ** 16  # elements: a smaller matrix is transposed as it is


def transpose(x: jax.Array) -> jax.Array:
    """x [M,K] -> x.T [K,M], tile by tile: as a [M/32,32,K/32,32] array whose tile axes are swapped along with its
    tile-row axes, the same values as x.T: the "tiled_transpose" lever (`jaxformer.platforms`), which XLA:CPU's
    own 2-D transpose is timed against in the train step by benchmarks/levers.py (`tiled_transpose`;
    benchmarks/results/levers.md, rows `tiled_transpose`), and alone, each form in a program of its own, by
    benchmarks/kernels.py (benchmarks/results/kernels.md, "Layout copies"). Below TILED_MIN elements (the tiny
    config's [320,128] and [320,64]), or with a side not a multiple of the tile: x.T. Any dtype; jit, grad and
    vmap (a reshape and a transpose)."""
    m, k = x.shape
    if m % TILE or k % TILE or x.size < TILED_MIN:
        return x.T
    return x.reshape(m // TILE, TILE, k // TILE, TILE).transpose(2, 3, 0, 1).reshape(k, m)
