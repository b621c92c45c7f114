"""Context parallelism's attention: a sequence split over the devices of a mesh axis, each device's queries
attending to every device's keys, by all-gathered keys/values (`context_parallel_attention`) or by passing key/value
blocks round a ring (`ring_attention`).

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

`ring_attention` never holds more than two devices' keys/values: at each of C steps a device attends its queries
to the block it holds (the chunked backend's tiles, `ops.flash`, so no [T,S] matrix either), merges the partial
outputs by their log-sum-exps, and passes the block (with its positions, validity and segment ids) to the next
device (`jax.lax.ppermute`). Its backward pass (a custom VJP, Liu et al. 2023's ring attention with
FlashAttention-2's backward per block) sends the blocks round again with their key/value gradients, which arrive
back at their owner after C steps; it saves only the local q, k, v, output and log-sum-exp. Tiles with no visible
key are skipped, so the zigzag order also balances the ring's compute.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.ops import flash
from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.masks import CausalMask


def _gather(x, axis: str):
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask, *,
                               axis: str = "context", **attention_kw) -> jax.Array:
    """Context-parallel attention by all-gathered keys and values: this device's output, equal to its rows of
    `dot_product_attention` over the whole sequence. Called inside a `jax.shard_map` splitting T over `axis`.

    Args:
      q: [B, T, N, H] this device's queries.
      k: [B, T, K, H] this device's keys.
      v: [B, T, K, H] this device's values.
      mask: a `CausalMask` over this device's T tokens (q and k positions, k_valid, segments: the local slices).
      axis: the mesh axis T is split over.
      **attention_kw: the rest of dot_product_attention's options (backend, scale, softcap, ...).

    Returns:
      [B, T, N, H] this device's output.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxformer.ops import CausalMask
      >>> from jaxformer.ops.context import context_parallel_attention
      >>> mesh = jax.make_mesh((1,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))   # C = 1 here
      >>> def local(q, k, v, pos):
      ...     return context_parallel_attention(q, k, v, CausalMask(pos, pos), axis="context")
      >>> spec = P(None, "context")
      >>> run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> run(q, q, q, jnp.arange(4)[None]).shape
      (1, 4, 2, 8)
    """
    keys = mask._replace(k_positions=_gather(mask.k_positions, axis), k_valid=_gather(mask.k_valid, axis),
                         k_segments=_gather(mask.k_segments, axis))
    return dot_product_attention(q, _gather(k, axis), _gather(v, axis), mask=keys, **attention_kw).out


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask, *, axis: str = "context",
                   scale: float | None = None, softcap: float = 0.0, block_size: int = 512) -> jax.Array:
    """Ring attention: this device's output, equal to its rows of `dot_product_attention` over the whole sequence
    (softmax in float32; a query with no visible key gets zeros), inside a `jax.shard_map` splitting T over
    `axis`. Keys/values travel round the ring, so each device holds its own block and the one passing through.
    Differentiable in q, k, v (custom VJP).

    Args:
      q: [B, T, N, H] this device's queries.
      k: [B, T, K, H] this device's keys.
      v: [B, T, K, H] this device's values.
      mask: a `CausalMask` over this device's T tokens (the local slices of positions, validity, segments).
      axis: the mesh axis T is split over.
      scale: of the logits (None: 1/√H).
      softcap: as the chunked backend's (0 = off).
      block_size: the chunked backend's tile.

    Returns:
      [B, T, N, H] this device's output, in q's dtype.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxformer.ops import CausalMask
      >>> from jaxformer.ops.context import ring_attention
      >>> mesh = jax.make_mesh((1,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))   # C = 1 here
      >>> def local(q, k, v, pos):
      ...     return ring_attention(q, k, v, CausalMask(pos, pos), axis="context")
      >>> spec = P(None, "context")
      >>> run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False))
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> run(q, q, q, jnp.arange(4)[None]).shape
      (1, 4, 2, 8)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    valid = mask.k_valid if mask.k_valid is not None else jnp.ones(mask.k_positions.shape, bool)
    keys = (mask.k_positions, valid, mask.k_segments)
    return _ring(q, k, v, mask._replace(k_positions=None, k_valid=None, k_segments=None), keys,
                 axis, float(scale), float(softcap), int(block_size))


def _rotate(tree, axis: str):
    """Every device's arrays to the next device of the ring (the last's to the first)."""
    c = jax.lax.axis_size(axis)
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % c) for i in range(c)])


def _block_mask(queries: CausalMask, keys) -> CausalMask:
    return queries._replace(k_positions=keys[0], k_valid=keys[1], k_segments=keys[2])


def _merge(out, lse, out_b, lse_b):
    """Two partial softmax results over disjoint keys (out [B,K,G,T,H] normalised, lse [B,K,G,T]) -> their
    union's; rows with no visible key keep lse −inf and output 0."""
    top = jnp.maximum(lse, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    wa, wb = jnp.exp(lse - top), jnp.exp(lse_b - top)
    total = wa + wb
    seen = total > 0
    out = jnp.where(seen[..., None], (out * wa[..., None] + out_b * wb[..., None])
                    / jnp.where(seen, total, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def _ring_forward(q, k, v, queries, keys, axis, scale, softcap, block):
    """-> (out [B,K,G,Tp,H] float32, lse [B,K,G,Tp], the spec of the padded local problem)."""
    sp = flash._Spec(q, k, scale, block, block, softcap)

    def step(carry, _):
        kb, vb, kk, out, lse = carry
        _, q_, k_, v_, m_, _ = flash._prepare(q, kb, vb, _block_mask(queries, kk), None, block, block, scale,
                                              softcap)
        out, lse = _merge(out, lse, *flash._forward(sp, q_, k_, v_, m_, None))
        return (*_rotate((kb, vb, kk), axis), out, lse), None

    init = (k, v, keys, jnp.zeros((sp.b, sp.kh, sp.g, sp.tp, sp.h), jnp.float32),
            jnp.full((sp.b, sp.kh, sp.g, sp.tp), -jnp.inf, jnp.float32))
    (_, _, _, out, lse), _ = jax.lax.scan(step, init, None, length=jax.lax.axis_size(axis))
    return out, lse, sp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, queries, keys, axis, scale, softcap, block):
    out, lse, sp = _ring_forward(q, k, v, queries, keys, axis, scale, softcap, block)
    return flash._finish(sp, out, lse, q.dtype)[0]


def _ring_fwd(q, k, v, queries, keys, axis, scale, softcap, block):
    out, lse, sp = _ring_forward(q, k, v, queries, keys, axis, scale, softcap, block)
    return flash._finish(sp, out, lse, q.dtype)[0], (q, k, v, queries, keys, out, lse)


def _ring_bwd(axis, scale, softcap, block, res, dout):
    q, k, v, queries, keys, out, lse = res
    sp = flash._Spec(q, k, scale, block, block, softcap)
    do = jnp.pad(dout.astype(jnp.float32), [(0, 0), (0, sp.tp - sp.t), (0, 0), (0, 0)])
    do = jnp.transpose(do.reshape(sp.b, sp.tp, sp.kh, sp.g, sp.h), (0, 2, 3, 1, 4)).astype(q.dtype)

    def step(carry, _):
        kb, vb, kk, dk, dv, dq = carry
        _, q_, k_, v_, m_, _ = flash._prepare(q, kb, vb, _block_mask(queries, kk), None, block, block, scale,
                                              softcap)
        dq_b, dk_b, dv_b, _ = flash._backward(sp, q_, k_, v_, m_, None, out, lse, do, False)
        return (*_rotate((kb, vb, kk, dk + dk_b, dv + dv_b), axis), dq + dq_b), None

    zeros = jnp.zeros((sp.b, sp.sp, sp.kh, sp.h), jnp.float32)
    init = (k, v, keys, zeros, zeros, jnp.zeros((sp.b, sp.tp, sp.n, sp.h), jnp.float32))
    (_, _, _, dk, dv, dq), _ = jax.lax.scan(step, init, None, length=jax.lax.axis_size(axis))
    cast = lambda d, x: d[:, :x.shape[1]].astype(x.dtype)          # noqa: E731
    return cast(dq, q), cast(dk, k), cast(dv, v), None, None       # positions, validity, segments: no gradient


_ring.defvjp(_ring_fwd, _ring_bwd)


def zigzag_order(length: int, devices: int) -> jax.Array:
    """The token order that balances causal attention over `devices`: the sequence cut into 2·devices chunks,
    device i (the i-th contiguous block of the reordered sequence) holding chunks i and 2·devices−1−i.

    Args:
      length: the sequence length T·C, a multiple of 2·devices.
      devices: the number of devices C.

    Returns:
      [T·C] int32 indices into the sequence.

    Raises:
      ValueError: length is not a multiple of 2·devices.

    Examples:
      >>> from jaxformer.ops.context import zigzag_order
      >>> zigzag_order(8, 2).tolist()                   # device 0: chunks 0 and 3; device 1: chunks 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if length % (2 * devices):
        raise ValueError(f"zigzag: length {length} is not a multiple of 2 x {devices} devices")
    chunks = jnp.arange(length, dtype=jnp.int32).reshape(2 * devices, -1)
    return jnp.concatenate([jnp.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


def zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """x with its sequence axis put in `zigzag_order` (before sharding it over the devices).

    Args:
      x: an array whose `axis` has length a multiple of 2·devices (e.g. [B, T·C, ...]).
      devices: the number of devices C.
      axis: the sequence axis.

    Returns:
      x reordered along `axis`, same shape.

    Raises:
      ValueError: the sequence length is not a multiple of 2·devices.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.context import zigzag
      >>> zigzag(jnp.arange(8)[None], 2).tolist()
      [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return jnp.take(x, zigzag_order(x.shape[axis], devices), axis=axis)


def unzigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: the sequence axis back in its original order.

    Args:
      x: an array whose `axis` is in `zigzag_order`.
      devices: the number of devices C.
      axis: the sequence axis.

    Returns:
      x in the original order along `axis`, same shape.

    Raises:
      ValueError: the sequence length is not a multiple of 2·devices.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.context import unzigzag, zigzag
      >>> unzigzag(zigzag(jnp.arange(8)[None], 2), 2).tolist()
      [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    return jnp.take(x, jnp.argsort(zigzag_order(x.shape[axis], devices)), axis=axis)
