"""Scaled dot-product attention: one contract for MHA, GQA and MQA.

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("reference",)


def _segments(x, name: str) -> tuple[jax.Array, ...]:
    segs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not segs:
        raise ValueError(f"{name} must be an array or a non-empty sequence of segments")
    return segs


def _check_shapes(q: jax.Array, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...]) -> tuple[int, int]:
    if len(ks) != len(vs):
        raise ValueError(f"k and v must have the same number of segments; got {len(ks)} and {len(vs)}")
    if q.ndim != 4 or any(x.ndim != 4 for x in ks + vs):
        raise ValueError(f"q, k, v must be rank 4 ([B,T,N,H], [B,S,K,H], [B,S,K,H]); got shapes "
                         f"{q.shape}, {[x.shape for x in ks]}, {[x.shape for x in vs]}")
    for k, v in zip(ks, vs):
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape [B,S,K,H]; got {k.shape} and {v.shape}")
        if k.shape[0] != q.shape[0] or k.shape[2:] != ks[0].shape[2:] or k.shape[3] != q.shape[3]:
            raise ValueError(f"q [B,T,N,H] and k [B,S,K,H] disagree on B, K or H: {q.shape} vs "
                             f"{[x.shape for x in ks]}")
    n, kh = q.shape[2], ks[0].shape[2]
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={kh}")
    return n, kh


# One query position (a decode step) against a long [B,S,K,H] cache: a per-head dot would make XLA:CPU
# transpose the whole cache to [B,K,S,H] first. Contracting over all K cache heads at once reads the cache in
# its own layout (one matmul [S*K,H] x [H,N]) and keeps the K diagonal blocks: K times the flops of a
# memory-bound step, so only for few heads (benchmarks/cache_layout.py measures it).
_SINGLE_QUERY_MAX_HEADS = 16


def _scores(qg: jax.Array, k: jax.Array, single: bool) -> jax.Array:
    """qg [B,T,K,G,H], k [B,S,K,H] -> float32 logits [B,K,G,T,S]."""
    if not single:
        return jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    full = jnp.einsum("BSJH,BKGH->BSJKG", k, qg[:, 0], preferred_element_type=jnp.float32)
    return jnp.transpose(jnp.diagonal(full, axis1=2, axis2=3), (0, 3, 2, 1))[:, :, :, None, :]  # [B,S,G,K]->


def _mix(w: jax.Array, v: jax.Array, single: bool) -> jax.Array:
    """weights [B,K,G,T,S], v [B,S,K,H] -> [B,K,G,T,H]."""
    if not single:
        return jnp.einsum("BKGTS,BSKH->BKGTH", w, v)   # this output order gives XLA:CPU a transpose-free dot
    full = jnp.einsum("BKGTS,BSJH->BKGTJH", w, v)
    return jnp.transpose(jnp.diagonal(full, axis1=1, axis2=4), (0, 4, 1, 2, 3))           # [B,G,T,H,K]->


def dot_product_attention(q: jax.Array, k, v, *, mask: jax.Array | None = None,
                          bias: jax.Array | None = None, scale: float | None = None,
                          return_weights: bool = False, backend: str = "reference",
                          mask_value: float | None = None):
    """softmax(q·kᵀ·scale + bias, masked) · v.

    Args:
      q: [B,T,N,H] queries.
      k, v: [B,S,K,H] keys and values; N must be a multiple of K (K=N: MHA, K=1: MQA, else GQA). Either may
        also be a sequence of segments [B,S_i,K,H] that stand for their concatenation along S (S = sum S_i)
        without materializing it: a KV cache followed by the current step's keys costs no copy of the cache.
      mask: boolean, True = may attend, broadcastable to [B,N,T,S].
      bias: additive logits bias (e.g. ALiBi), broadcastable to [B,N,T,S].
      scale: logits scale, default 1/sqrt(H).
      return_weights: also return the attention weights [B,N,T,S] (float32).
      backend: "reference" (materialises the [B,N,T,S] logits; the one backend so far).
      mask_value: for ablations only. None (always, otherwise): masked logits take float32's most negative
        finite value and masked weights are exactly 0. A float: masked logits take that value and keep their
        softmax weight (seed 004's masked_fill(..., 0) leaks this way).

    Returns:
      [B,T,N,H] in q's dtype, and the weights [B,N,T,S] when asked. Logits and softmax are float32;
      masked logits take float32's most negative finite value; a query row whose keys are all masked
      returns zeros (and zero gradient), never NaN.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    ks, vs = _segments(k, "k"), _segments(v, "v")
    n, kh = _check_shapes(q, ks, vs)
    b, t, _, h = q.shape
    sizes = [x.shape[1] for x in ks]
    s = sum(sizes)
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, g, h)
    single = t == 1 and n <= _SINGLE_QUERY_MAX_HEADS
    logits = jnp.concatenate([_scores(qg, x, single) for x in ks], axis=-1)
    logits = logits.astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (b, n, t, s)).astype(jnp.float32).reshape(b, kh, g, t, s)
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
        mask = jnp.broadcast_to(mask, (b, n, t, s)).reshape(b, kh, g, t, s)
        fill = jnp.finfo(jnp.float32).min if mask_value is None else mask_value
        logits = jnp.where(mask, logits, jnp.float32(fill))
    weights = jax.nn.softmax(logits, axis=-1)
    if mask is not None and mask_value is None:
        weights = jnp.where(mask, weights, 0.0)  # all-masked rows: uniform -> zeros
    out, start = 0.0, 0
    for x, size in zip(vs, sizes):
        w = jax.lax.slice_in_dim(weights, start, start + size, axis=-1).astype(x.dtype)
        out = out + _mix(w, x, single)
        start += size
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(q.dtype)   # BKGTH -> BTKGH
    if return_weights:
        return out, weights.reshape(b, n, t, s)
    return out
