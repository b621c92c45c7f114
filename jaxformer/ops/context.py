"""Context parallelism's attention: a sequence split over the devices of a mesh axis, each device's queries
attending to every device's keys.

Axis legend: B batch, T the local query length (T·C globally, C the devices of the axis), S = T·C keys, N query
heads, K kv heads, H head dim.

Called inside `jax.shard_map` with the T axis of q, k, v and of the mask's positions/segments split over `axis`.
Keys and values (and the key side of the mask: positions, validity, segment ids) are all-gathered along the axis,
so each device computes its own queries' rows of the full attention; the mask is built from the tokens' global
positions, never from where they sit, so any order of the tokens over the devices gives the same result. That is
what the causal load balance needs: with a causal mask the last chunk of a sequence has the most keys to read,
so `zigzag` hands device i the chunks i and 2C−1−i (each device then holds as much of the triangle as any other,
as MaxText and torchtitan do) and `unzigzag` puts the outputs back. The memory of the keys and values is that of
the whole sequence on every device (all-gather); the activations of every other layer are 1/C. The "chunked"
backend runs under shard_map with check_vma=False (its scan carries start as constants, which the varying-axes
check refuses); "reference" runs with the check on.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.masks import CausalMask


def _gather(x, axis: str):
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask, *,
                               axis: str = "context", **attention_kw) -> jax.Array:
    """q [B,T,N,H], k/v [B,T,K,H], mask a `CausalMask` over this device's T tokens (q and k positions, k_valid,
    segments: the local slices), inside a shard_map splitting T over `axis` -> this device's output [B,T,N,H],
    equal to its rows of `dot_product_attention` over the whole sequence. attention_kw: the rest of
    dot_product_attention's options (backend, scale, softcap, ...)."""
    keys = mask._replace(k_positions=_gather(mask.k_positions, axis), k_valid=_gather(mask.k_valid, axis),
                         k_segments=_gather(mask.k_segments, axis))
    return dot_product_attention(q, _gather(k, axis), _gather(v, axis), mask=keys, **attention_kw).out


def zigzag_order(length: int, devices: int) -> jax.Array:
    """The token order that balances causal attention over `devices`: the sequence cut into 2·devices chunks,
    device i (the i-th contiguous block of the reordered sequence) holding chunks i and 2·devices−1−i. -> [T·C]
    int32 indices into the sequence. ValueError unless length is a multiple of 2·devices."""
    if length % (2 * devices):
        raise ValueError(f"zigzag: length {length} is not a multiple of 2 x {devices} devices")
    chunks = jnp.arange(length, dtype=jnp.int32).reshape(2 * devices, -1)
    return jnp.concatenate([jnp.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


def zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """x with its sequence axis put in `zigzag_order` (before sharding it over the devices)."""
    return jnp.take(x, zigzag_order(x.shape[axis], devices), axis=axis)


def unzigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: the sequence axis back in its original order."""
    return jnp.take(x, jnp.argsort(zigzag_order(x.shape[axis], devices)), axis=axis)
