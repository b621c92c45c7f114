"""Scaled dot-product attention: one contract for MHA, GQA and MQA, four backends.

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.ops import flash, fused
from jaxformer.ops.fused import BackendError
from jaxformer.ops.masks import materialized_mask

# reference: materialises the [B,N,T,S] logits (XLA fuses what it can) | chunked: online softmax over tiles with
# a recomputing backward, O(T + S) memory, any platform | cudnn: cuDNN flash attention (GPU, bf16/fp16) |
# pallas: JAX's Pallas flash-attention kernel (GPU/TPU; interpret mode on CPU)
BACKENDS = ("reference", "chunked", "cudnn", "pallas")
KV_LAYOUTS = ("BSKH", "BKSH")    # k/v [B,S,K,H] (the contract) or heads-major [B,K,S,H] (a per-layer decode cache)


class Attention(NamedTuple):
    """What `dot_product_attention` returns, always: the output, and the probabilities / log-sum-exp when asked.

    Attributes:
      out: [B, T, N, H] the attention output, in q's dtype.
      probs: [B, N, T, S] float32 attention probabilities with `return_probs=True`, else None.
      lse: [B, N, T] float32 per-row log-sum-exp of the logits with `return_lse=True` (−inf for a row with no
        visible key), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import causal_mask, dot_product_attention
      >>> q = jnp.ones((1, 2, 1, 4))
      >>> res = dot_product_attention(q, q, q, mask=causal_mask(2), return_lse=True)
      >>> res.out.shape, res.probs, res.lse.shape
      ((1, 2, 1, 4), None, (1, 1, 2))
    """
    out: jax.Array                  # [B,T,N,H] in q's dtype
    probs: jax.Array | None         # [B,N,T,S] float32 with return_probs=True, else None
    lse: jax.Array | None           # [B,N,T] float32 with return_lse=True (−inf for a row with no visible key)


def _segments(x, name: str) -> tuple[jax.Array, ...]:
    segs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not segs:
        raise ValueError(f"{name} must be an array or a non-empty sequence of segments")
    return segs


def _bskh(xs: tuple) -> tuple:
    """Heads-major segments' shapes as [B,S,K,H] stand-ins, for the shape checks (nothing is transposed)."""
    return tuple(jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]) if x.ndim == 4 else x.shape,
                                      x.dtype) for x in xs)


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


def _scores(qg: jax.Array, k: jax.Array, single: bool, heads_major: bool = False) -> jax.Array:
    """qg [B,T,K,G,H], k [B,S,K,H] (heads_major: [B,K,S,H]) -> float32 logits [B,K,G,T,S]."""
    if heads_major:
        return jnp.einsum("BTKGH,BKSH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    if not single:
        return jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    full = jnp.einsum("BSJH,BKGH->BSJKG", k, qg[:, 0], preferred_element_type=jnp.float32)
    return jnp.transpose(jnp.diagonal(full, axis1=2, axis2=3), (0, 3, 2, 1))[:, :, :, None, :]  # [B,S,G,K]->


def _mix(w: jax.Array, v: jax.Array, single: bool, heads_major: bool = False) -> jax.Array:
    """probs [B,K,G,T,S], v [B,S,K,H] (heads_major: [B,K,S,H]) -> [B,K,G,T,H]."""
    if heads_major:
        return jnp.einsum("BKGTS,BKSH->BKGTH", w, v)
    if not single:
        return jnp.einsum("BKGTS,BSKH->BKGTH", w, v)   # this output order gives XLA:CPU a transpose-free dot
    full = jnp.einsum("BKGTS,BSJH->BKGTJH", w, v)
    return jnp.transpose(jnp.diagonal(full, axis1=1, axis2=4), (0, 4, 1, 2, 3))           # [B,G,T,H,K]->


def _materialized_bias(bias):
    return bias.materialize() if hasattr(bias, "materialize") else bias


def _check_mask(mask) -> None:
    if mask is not None and not hasattr(mask, "materialize") and mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")


def dot_product_attention(q: jax.Array, k, v, *, mask=None, bias=None, scale: float | None = None,
                          return_probs: bool = False, return_lse: bool = False, backend: str = "reference",
                          mask_value: float | None = None, block_size: int = 512,
                          softcap: float = 0.0, kv_layout: str = "BSKH", softmax_grad: str = "jax",
                          score_mod=None) -> Attention:
    """softmax(cap(q·kᵀ·scale) + bias, masked) · v, cap(x) = softcap · tanh(x / softcap) when softcap > 0.

    One contract for MHA, GQA and MQA (N must be a multiple of K: K=N is MHA, K=1 MQA, else GQA) and four
    backends (`BACKENDS`). Logits and softmax are float32; a query row whose keys are all masked returns zeros
    (and zero gradient), never NaN.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys. May also be a sequence of segments [B, S_i, K, H] that stand for their
        concatenation along S (S = sum S_i) without materializing it: a KV cache followed by the current step's
        keys costs no copy of the cache ("reference"; the other backends concatenate).
      v: [B, S, K, H] values, or a sequence of segments [B, S_i, K, H] matching k's.
      mask: boolean, True = may attend, broadcastable to [B, N, T, S]; or a lazy `ops.masks.CausalMask` (causal
        over positions, optionally within segments and a sliding window), which "chunked" builds tile by tile
        (the others materialise it).
      bias: additive logits bias broadcastable to [B, N, T, S], or a lazy `ops.positional.AlibiBias`.
      scale: logits scale, default 1/sqrt(H): a number, or a traced float scalar (a per-layer scale,
        `nn.per_layer`; "reference" and "chunked" only).
      return_probs: also return the attention probabilities [B, N, T, S] (float32). The non-reference backends
        recompute them from q, k and their own log-sum-exp (`attention_probs`): the output is still theirs.
      return_lse: also return the per-row log-sum-exp of the logits [B, N, T] (float32; −inf for a row with no
        visible key).
      backend: one of BACKENDS. Every backend meets this contract within float32 rounding, except where
        ops.fused documents a narrower one; a call a backend cannot run raises BackendError while tracing.
      mask_value: for ablations only ("reference" only). None (always, otherwise): masked logits take
        float32's most negative finite value and masked probabilities are exactly 0. A float: masked logits
        take that value and keep their softmax weight (seed 004's masked_fill(..., 0) leaks this way).
      block_size: "chunked" tile edge (queries and keys).
      softcap: attention-logit soft-capping (Gemma 2 uses 50): 0 = off; "reference" and "chunked" only. A
        number, or a traced float scalar (a per-layer cap, `nn.per_layer`; where it is <= 0, no cap).
      kv_layout: "BSKH" (k, v and their segments as above) or "BKSH" (every segment stored heads-major
        [B, K, S, H], as a per-layer decoding cache is: `nn.cache.KVCache.unstacked`); "reference" contracts
        that layout as it is (a one-token query then reads each head's cache block contiguously), the other
        backends transpose it first.
      softmax_grad: the "reference" softmax's backward: "jax" (jax.nn.softmax's own) or "gemv" (the same
        gradient, its row sums Σ_s w·g taken as a matmul with a ones vector; the "softmax_gemv" lever of
        `jaxformer.platforms`, which the model passes where it is on).
      score_mod: ("reference" only) a function of the logits [B, N, T, S] float32 (scaled, capped, biased;
        before the mask, which applies to what it returns) -> logits [B, N, T, S]: the `attn_scores` site
        (`nn.sites`).

    Returns:
      `Attention(out, probs, lse)`: out [B, T, N, H] in q's dtype; probs [B, N, T, S] float32 with
        return_probs, else None; lse [B, N, T] float32 with return_lse, else None.

    Raises:
      ValueError: an unknown backend, softmax_grad or kv_layout; q, k, v not rank 4 or disagreeing on B, K or
        H; k and v of different shapes or segment counts; N not a multiple of K; an empty sequence of segments.
      TypeError: a mask array that is not boolean.
      BackendError: an option the backend does not offer (softcap, a traced scale, mask_value, score_mod), or
        an input its kernel cannot run (`ops.fused.problem`), raised while tracing.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import causal_mask, dot_product_attention
      >>> q, k = jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 2, 8))     # GQA: N=4 query heads, K=2 kv heads
      >>> res = dot_product_attention(q, k, k, mask=causal_mask(2), return_probs=True)
      >>> res.out.shape, res.probs.shape
      ((1, 2, 4, 8), (1, 4, 2, 2))
      >>> res.probs[0, 0].tolist()                                  # head 0: query 0 sees key 0 only
      [[1.0, 0.0], [0.5, 0.5]]
    """
    _check_options(backend, softmax_grad, kv_layout, softcap, mask_value, score_mod, scale)
    ks, vs = _segments(k, "k"), _segments(v, "v")
    heads_major = kv_layout == "BKSH"
    if heads_major and backend != "reference":
        ks, vs = tuple(jnp.swapaxes(x, 1, 2) for x in ks), tuple(jnp.swapaxes(x, 1, 2) for x in vs)
        heads_major = False
    _check_shapes(q, *((_bskh(ks), _bskh(vs)) if heads_major else (ks, vs)))
    _check_mask(mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "reference":
        out, probs, lse = _reference(q, ks, vs, materialized_mask(mask), _materialized_bias(bias), scale,
                                     mask_value, return_probs or return_lse, softcap, heads_major, softmax_grad,
                                     score_mod)
    else:
        kc = ks[0] if len(ks) == 1 else jnp.concatenate(ks, axis=1)
        vc = vs[0] if len(vs) == 1 else jnp.concatenate(vs, axis=1)
        out, lse = _other_backend(backend, q, kc, vc, mask, bias, scale, block_size, softcap,
                                  want_lse=return_probs or return_lse)
        probs = (attention_probs(q, kc, lse, mask=mask, bias=bias, scale=scale, softcap=softcap)
                 if return_probs else None)
    return Attention(out, probs if return_probs else None, lse if return_lse else None)


def _check_options(backend: str, softmax_grad: str, kv_layout: str, softcap: float, mask_value,
                   score_mod=None, scale=None) -> None:
    """ValueError for an option that does not exist; BackendError for one the backend does not offer."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if softmax_grad not in ("jax", "gemv"):
        raise ValueError(f"softmax_grad={softmax_grad!r} is not 'jax' or 'gemv'")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not one of {KV_LAYOUTS}")
    if flash.capped(softcap) and backend not in ("reference", "chunked"):
        raise BackendError(f"attention soft-capping runs on the 'reference' and 'chunked' backends, not {backend!r}")
    if not (scale is None or isinstance(scale, (int, float))) and backend not in ("reference", "chunked"):
        raise BackendError(f"a traced (per-layer) logit scale runs on the 'reference' and 'chunked' backends, not "
                           f"{backend!r}, whose kernel takes a constant")
    if mask_value is not None and backend != "reference":
        raise BackendError(f"mask_value (an ablation) exists only in the 'reference' backend, not {backend!r}")
    if score_mod is not None and backend != "reference":
        raise BackendError(f"score_mod (the attn_scores site) exists only in the 'reference' backend, not {backend!r}")


def _other_backend(backend: str, q, k, v, mask, bias, scale: float, block_size: int, softcap: float, *,
                   want_lse: bool) -> tuple[jax.Array, jax.Array | None]:
    """(out [B,T,N,H], lse [B,N,T] or None) of the chunked, cudnn or pallas backend over whole k, v [B,S,K,H]."""
    if backend == "chunked":
        return flash.chunked_attention(q, k, v, mask, bias, scale=scale, block_q=block_size, block_k=block_size,
                                       softcap=softcap)
    if backend == "cudnn":
        return fused.cudnn_attention(q, k, v, mask, bias, scale=scale, want_lse=want_lse)
    return fused.pallas_attention(q, k, v, mask, bias, scale=scale, want_lse=want_lse)


def attention_probs(q: jax.Array, k, lse: jax.Array, *, mask=None, bias=None, scale: float | None = None,
                      rows: jax.Array | None = None, softcap: float = 0.0) -> jax.Array:
    """Attention probabilities recomputed from q, k and a saved log-sum-exp: exp(q·kᵀ·scale + bias − lse), 0 where
    masked. What a fused backend's heatmap needs without its [T,S] matrix ever having been stored.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys (or a sequence of segments [B, S_i, K, H], as for `dot_product_attention`).
      lse: [B, N, T] per-row log-sum-exp of the logits (`dot_product_attention(..., return_lse=True)`).
      mask: as for `dot_product_attention`: boolean broadcastable to [B, N, T, S] or a lazy `CausalMask`.
      bias: as for `dot_product_attention`: additive, broadcastable to [B, N, T, S], or a lazy `AlibiBias`.
      scale: logits scale, default 1/sqrt(H).
      rows: optional int [R] query indices (default all T).
      softcap: attention-logit soft-capping, as for `dot_product_attention` (0 = off).

    Returns:
      [B, N, R, S] float32 probabilities (rows sum to 1; a row with no visible key is 0).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import attention_probs, causal_mask, dot_product_attention
      >>> q = jnp.ones((1, 2, 1, 4))
      >>> lse = dot_product_attention(q, q, q, mask=causal_mask(2), return_lse=True).lse
      >>> print(attention_probs(q, q, lse, mask=causal_mask(2), rows=jnp.array([1])))
      [[[[0.5 0.5]]]]
    """
    ks = _segments(k, "k")
    kc = ks[0] if len(ks) == 1 else jnp.concatenate(ks, axis=1)
    b, t, n, h = q.shape
    s, kh = kc.shape[1], kc.shape[2]
    scale = h ** -0.5 if scale is None else scale
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(b, t, kh, n // kh, h), kc,
                        preferred_element_type=jnp.float32).reshape(b, n, t, s) * scale
    if flash.capped(softcap):
        logits = flash.soft_cap(logits, softcap)[0]
    bias, mask = _materialized_bias(bias), materialized_mask(mask)
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (b, n, t, s)).astype(jnp.float32)
    keep = jnp.ones((b, n, t, s), bool) if mask is None else jnp.broadcast_to(mask, (b, n, t, s))
    if rows is not None:
        logits, keep, lse = logits[:, :, rows], keep[:, :, rows], lse[:, :, rows]
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)[..., None]
    return jnp.where(keep, jnp.exp(logits - lse), 0.0)


@jax.custom_vjp
def _softmax(x: jax.Array) -> jax.Array:
    """jax.nn.softmax over the last axis, with a backward whose row sums Σ_s w·g are a matmul with a ones
    vector (softmax_grad="gemv"): XLA:CPU's reduction of the same [B,K,G,T,S] product was the slowest op of a
    small model's train step (benchmarks/results/step_profile.md)."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x):
    w = jax.nn.softmax(x, axis=-1)
    return w, w


def _softmax_bwd(w, g):
    rows = jnp.matmul(g * w, jnp.ones((w.shape[-1], 1), w.dtype))          # [..., 1]: Σ_s w·g, as one GEMV
    return (w * (g - rows),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _reference(q, ks, vs, mask, bias, scale, mask_value, want_lse, softcap=0.0, heads_major=False,
               softmax_grad="jax", score_mod=None):
    """The materialising backend: -> (out, probs [B,N,T,S], lse [B,N,T] or None)."""
    n, kh = q.shape[2], ks[0].shape[1 if heads_major else 2]
    b, t, _, h = q.shape
    sizes = [x.shape[2 if heads_major else 1] for x in ks]
    s = sum(sizes)
    g = n // kh
    qg = q.reshape(b, t, kh, g, h)
    single = t == 1 and n <= _SINGLE_QUERY_MAX_HEADS and not heads_major
    logits = jnp.concatenate([_scores(qg, x, single, heads_major) for x in ks], axis=-1)
    logits = logits.astype(jnp.float32) * scale
    if flash.capped(softcap):
        logits = flash.soft_cap(logits, softcap)[0]
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (b, n, t, s)).astype(jnp.float32).reshape(b, kh, g, t, s)
    if score_mod is not None:
        logits = score_mod(logits.reshape(b, n, t, s)).astype(jnp.float32).reshape(b, kh, g, t, s)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, n, t, s)).reshape(b, kh, g, t, s)
        fill = jnp.finfo(jnp.float32).min if mask_value is None else mask_value
        logits = jnp.where(mask, logits, jnp.float32(fill))
    probs = _softmax(logits) if softmax_grad == "gemv" else jax.nn.softmax(logits, axis=-1)
    lse = None
    if want_lse:
        lse = jax.nn.logsumexp(logits, axis=-1)
        if mask is not None and mask_value is None:
            lse = jnp.where(mask.any(-1), lse, -jnp.inf)
        lse = lse.reshape(b, n, t)
    if mask is not None and mask_value is None:
        probs = jnp.where(mask, probs, 0.0)  # all-masked rows: uniform -> zeros
    out, start = 0.0, 0
    for x, size in zip(vs, sizes):
        w = jax.lax.slice_in_dim(probs, start, start + size, axis=-1).astype(x.dtype)
        out = out + _mix(w, x, single, heads_major)
        start += size
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(q.dtype)   # BKGTH -> BTKGH
    return out, probs.reshape(b, n, t, s), lse
