"""Scaled dot-product attention: one contract for MHA, GQA and MQA.

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("reference",)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int]:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4 ([B,T,N,H], [B,S,K,H], [B,S,K,H]); got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B,S,K,H]; got {k.shape} and {v.shape}")
    n, kh = q.shape[2], k.shape[2]
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [B,T,N,H] and k [B,S,K,H] disagree on B or H: {q.shape} vs {k.shape}")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={kh}")
    return n, kh


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
                          bias: jax.Array | None = None, scale: float | None = None,
                          return_weights: bool = False, backend: str = "reference"):
    """softmax(q·kᵀ·scale + bias, masked) · v.

    Args:
      q: [B,T,N,H] queries.
      k, v: [B,S,K,H] keys and values; N must be a multiple of K (K=N: MHA, K=1: MQA, else GQA).
      mask: boolean, True = may attend, broadcastable to [B,N,T,S].
      bias: additive logits bias (e.g. ALiBi), broadcastable to [B,N,T,S].
      scale: logits scale, default 1/sqrt(H).
      return_weights: also return the attention weights [B,N,T,S] (float32).
      backend: "reference" (the only one for now; issue F adds chunked/cuDNN/Pallas under this switch).

    Returns:
      [B,T,N,H] in q's dtype, and the weights [B,N,T,S] when asked. Logits and softmax are float32;
      masked logits take float32's most negative finite value; a query row whose keys are all masked
      returns zeros (and zero gradient), never NaN.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    n, kh = _check_shapes(q, k, v)
    b, t, _, h = q.shape
    s = k.shape[1]
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (b, n, t, s)).astype(jnp.float32).reshape(b, kh, g, t, s)
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
        mask = jnp.broadcast_to(mask, (b, n, t, s)).reshape(b, kh, g, t, s)
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)  # all-masked rows: uniform -> zeros
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights.astype(v.dtype), v).reshape(b, t, n, h)
    if return_weights:
        return out, weights.reshape(b, n, t, s)
    return out
