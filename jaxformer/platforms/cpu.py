"""Layout help for XLA:CPU's code generation: `materialize`, an identity that ends a fusion.

XLA:CPU fuses elementwise producers into the transposing copy a weight-gradient dot needs (its operand with
the contracted rows last), and emits that fusion far slower than its parts: on a [1024,2048] float32 array
5.3× the time of the elementwise work and a plain transpose run apart (benchmarks/kernels.py, "Layout
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
    tile-row axes, the same values as x.T. XLA:CPU's own 2-D transpose runs slower than this form at the train
    step's sizes (one program of 8 transposes on a 2-core AMD EPYC, µs each: [768,128] 68-77 vs 27-32, [768,512]
    403 vs 190, [1024,2048] 1429 vs 996; benchmarks/levers.py `tiled_transpose` times the step; alone, each in a
    program of its own, the two take the same time: benchmarks/kernels.py "Layout copies"). Below TILED_MIN
    elements, or with a side not a multiple of the tile: x.T (at the tiny config's [320,128] and [320,64] the two
    forms took the same time alone, and the tiled one made its step 1-2% slower). Any dtype; jit, grad and vmap
    (a reshape and a transpose)."""
    m, k = x.shape
    if m % TILE or k % TILE or x.size < TILED_MIN:
        return x.T
    return x.reshape(m // TILE, TILE, k // TILE, TILE).transpose(2, 3, 0, 1).reshape(k, m)
