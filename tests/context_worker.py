"""Runs in its own process with 8 fake CPU devices: context-parallel attention (`jaxformer.ops.context`) under
jax.shard_map over a "context" axis of 8, against `dot_product_attention` of the whole sequence on one device.
`python tests/context_worker.py OUT.json`; the assertions live in tests/test_context_parallel.py."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxformer.ops import dot_product_attention  # noqa: E402
from jaxformer.ops.context import context_parallel_attention, unzigzag, zigzag  # noqa: E402
from jaxformer.ops.masks import CausalMask  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
C, B, T, N, K, H = 8, 2, 64, 4, 2, 8
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
segments = jnp.asarray(np.repeat([[1] * 40 + [2] * 20 + [0] * 4], B, 0), jnp.int32)        # two docs + padding
positions = jnp.asarray(np.where(segments == 1, np.arange(T), np.arange(T) - 40) * (segments != 0), jnp.int32)
mesh = jax.make_mesh((C,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))


def reference(q, k, v):
    mask = CausalMask(positions, positions, segments != 0, segments, segments)
    return dot_product_attention(q, k, v, mask=mask).out


def sharded(q, k, v, pos, seg, backend):
    def local(q, k, v, pos, seg):
        mask = CausalMask(pos, pos, seg != 0, seg, seg)
        return context_parallel_attention(q, k, v, mask, axis="context", backend=backend, block_size=8)
    spec = P(None, "context")
    # the chunked backend's scan carries start as constants, which shard_map's varying-axes check refuses
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec,
                         check_vma=backend == "reference")(q, k, v, pos, seg)


def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * (segments != 0)[..., None, None])


want = reference(q, k, v)
want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
out = {}
for order in ("contiguous", "zigzag"):
    for backend in ("reference", "chunked"):
        z = (lambda x: zigzag(x, C)) if order == "zigzag" else (lambda x: x)
        back = (lambda x: unzigzag(x, C)) if order == "zigzag" else (lambda x: x)

        def fn(q, k, v, backend=backend, z=z, back=back):
            return back(jax.jit(sharded, static_argnums=5)(z(q), z(k), z(v), z(positions), z(segments), backend))
        got = fn(q, k, v)
        grads = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
        out[f"{order} {backend}"] = {
            "out": float(jnp.max(jnp.abs(got - want))),
            "grads": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, want_grads)),
            "scale": float(jnp.max(jnp.abs(want)))}
# the causal load balance: visible (query, key) pairs per device, contiguous against zigzag
for order in ("contiguous", "zigzag"):
    pos = zigzag(jnp.arange(T)[None], C)[0] if order == "zigzag" else jnp.arange(T)
    per = pos.reshape(C, -1)
    out[f"pairs {order}"] = [int(jnp.sum(per[d][:, None] >= jnp.arange(T)[None, :])) for d in range(C)]
Path(sys.argv[1]).write_text(json.dumps(out))
