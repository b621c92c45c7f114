"""Fused attention kernels behind `ops.dot_product_attention`: "cudnn" (cuDNN flash attention through
`jax.nn.dot_product_attention`) and "pallas" (JAX's Pallas flash-attention kernels: Triton on GPU, Mosaic on TPU;
on CPU the GPU kernel runs in Pallas interpret mode: correct, slow, for tests).

Each kernel takes a subset of the op's contract. What it cannot run is refused by name while tracing (before
anything compiles), never replaced by another backend: see `problem`.

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.errors import BackendError
from jaxformer.ops import masks as masks_lib


def platform() -> str:
    """The platform of this process's default JAX backend.

    Returns:
      "cpu", "gpu" or "tpu" (`jax.default_backend()`).

    Examples:
      >>> from jaxformer.ops.fused import platform
      >>> platform() in ("cpu", "gpu", "tpu")
      True
    """
    return jax.default_backend()


def problem(backend: str, *, dtype=None, where: str | None = None, bias: bool = False,
            cross: bool = False, window: bool = False, softcap: bool = False) -> str | None:
    """Why `backend` cannot run, or None: the one capability check of the attention backends (the config checks
    it with where="any", the model again on this machine before compiling; the kernels' per-call checks of
    masks and shapes happen while tracing).

    Args:
      backend: the attention backend, one of `ops.attention.BACKENDS`.
      dtype: the activations' dtype (None: not checked).
      where: the platform ("cpu" | "gpu" | "tpu"; default this process's, "any" skips the platform checks).
      bias: an additive bias such as ALiBi is needed.
      cross: cross-attention (an encoder-decoder) is needed.
      window: sliding-window attention is needed.
      softcap: attention-logit soft-capping is needed.

    Returns:
      The reason, a message naming the backend and what to use instead, or None when the backend can run.

    Examples:
      >>> from jaxformer.ops.fused import problem
      >>> problem("cudnn", where="cpu")
      "attention backend 'cudnn' needs an NVIDIA GPU; this process runs on 'cpu'"
      >>> problem("pallas", where="any", bias=True) is None, problem("chunked", where="any", bias=True) is None
      (False, True)
    """
    plat = where or platform()
    if softcap and backend in ("cudnn", "pallas"):
        return (f"attention backend {backend!r} takes no attention-logit soft-capping (model.attention.softcap); "
                f"use 'chunked' or 'reference'")
    if backend == "cudnn":
        if plat not in ("gpu", "any"):
            return f"attention backend 'cudnn' needs an NVIDIA GPU; this process runs on {plat!r}"
        if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return (f"attention backend 'cudnn' (cuDNN flash attention) takes bfloat16 or float16 activations; "
                    f"got {jnp.dtype(dtype).name} (set model.runtime.dtype='bfloat16')")
    if backend == "pallas":
        if bias:
            return ("attention backend 'pallas' takes no additive bias (ALiBi or a custom bias); model.positional="
                    "'alibi' needs 'chunked' or 'reference'")
        if window:
            return ("attention backend 'pallas' takes no sliding window (model.attention.windows); use 'chunked' or "
                    "'reference'")
        if cross:
            return ("attention backend 'pallas' runs self-attention only (JAX's Pallas GPU kernel shares one "
                    "segment-id array between queries and keys); an encoder-decoder's cross-attention needs "
                    "'chunked', 'cudnn' or 'reference'")
    return None


def _segment_ids(mask, b: int, t: int, s: int):
    """-> (ids [B,S] int32 | None, causal: bool) when the mask is key padding, self-attention causal, and/or
    packed documents (the forms the Pallas kernels take: a query sees keys of its own id; 0 = padding), else
    raise BackendError."""
    if mask is None:
        return None, False
    if isinstance(mask, masks_lib.CausalMask):
        if t != s or mask.q_positions is not mask.k_positions:
            raise BackendError("attention backend 'pallas' takes a causal mask only in self-attention over one "
                               "sequence (queries and keys at the same positions); decode steps against a KV "
                               "cache need 'chunked' or 'reference'")
        if mask.window is not None:
            raise BackendError(problem("pallas", window=True))
        valid = jnp.ones((b, s), bool) if mask.k_valid is None else mask.k_valid
        if mask.q_segments is None:
            return (None if mask.k_valid is None else valid.astype(jnp.int32)), True
        if mask.q_segments is not mask.k_segments:
            raise BackendError("attention backend 'pallas' takes packed documents only in self-attention (one "
                               "segment-id array for queries and keys)")
        return jnp.where(valid, mask.k_segments, 0).astype(jnp.int32), True
    if mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:           # [B|1,1,1,S]: key padding
        return jnp.broadcast_to(mask[:, 0, 0, :], (b, s)).astype(jnp.int32), False
    raise BackendError(f"attention backend 'pallas' takes key-padding masks [B,1,1,S] or a causal "
                       f"ops.masks.CausalMask; got a dense mask of shape {mask.shape}")


def pallas_attention(q, k, v, mask, bias, *, scale: float, want_lse: bool = False):
    """Attention by JAX's Pallas flash-attention kernels (Triton on GPU, Mosaic on TPU; on CPU the GPU kernel in
    interpret mode: correct, slow, for tests). Key padding and self-attention causality only; no bias (use
    'chunked' for ALiBi). Query rows at padded positions are not those of 'reference' (the GPU kernel shares one
    segment-id array between queries and keys); every other row is.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys (GQA/MQA: repeated to N heads for the kernels).
      v: [B, S, K, H] values.
      mask: None, a key-padding mask [B|1, 1, 1, S] bool, or a causal `ops.masks.CausalMask` over one sequence
        (queries and keys at the same positions; packed documents with one segment-id array; no window).
      bias: must be None.
      scale: the logits scale, a constant.
      want_lse: also return the log-sum-exp.

    Returns:
      out: [B, T, N, H].
      lse: [B, N, T] float32 with want_lse, else None (the kernel's lse output is not differentiable, so it comes
        from a second, gradient-free call).

    Raises:
      BackendError: a bias, a mask of another form, or (GPU kernel) T or S not a multiple of 16 (a length
        under 16 is taken whole), or key padding in cross-attention.

    Examples:
      What it cannot run is refused by name while tracing, never run by another backend (a call it can run,
      `pallas_attention(q, q, q, None, None, scale=0.5)`, returns `(out [1, 2, 1, 4], None)`; on CPU through
      the interpreter, slowly):

      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.fused import pallas_attention
      >>> q = jnp.ones((1, 2, 1, 4))
      >>> pallas_attention(q, q, q, None, jnp.zeros((1, 1, 2, 2)), scale=0.5)
      Traceback (most recent call last):
      ...
      jaxformer.errors.BackendError: attention backend 'pallas' takes no additive bias (ALiBi or a custom bias); ...
    """
    b, t, n, h = q.shape
    s = k.shape[1]
    why = problem("pallas", bias=bias is not None)
    if why:
        raise BackendError(why)
    ids, causal = _segment_ids(mask, b, t, s)
    g = n // k.shape[2]
    k, v = (jnp.repeat(x, g, axis=2) if g > 1 else x for x in (k, v))   # GQA/MQA: the kernels take N kv heads
    if platform() == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu
        q_ids = None if ids is None else (ids if t == s else jnp.ones((b, t), jnp.int32))
        seg = None if ids is None else tpu.SegmentIds(q_ids, ids)
        out = tpu.flash_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), segment_ids=seg, causal=causal,
                                  sm_scale=scale)
        return jnp.swapaxes(out, 1, 2), _lse(q, k, ids, causal, scale) if want_lse else None
    from jax.experimental.pallas.ops.gpu import attention as gpu
    if ids is not None and t != s:
        raise BackendError("attention backend 'pallas' (GPU kernel) takes key padding only in self-attention "
                           f"(T == S); got T={t}, S={s}")
    bq, bk = _block(t, "T"), _block(s, "S")
    block = gpu.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=min(bq, 32), block_kv_dkv=min(bk, 32),
                           block_q_dq=min(bq, 32), block_kv_dq=min(bk, 32))
    run = lambda residuals, *a: gpu.mha(*a, ids, sm_scale=scale, causal=causal, block_sizes=block,
                                        interpret=platform() == "cpu", return_residuals=residuals)
    out, lse = run(False, q, k, v), None
    if want_lse:
        lse = run(True, *jax.lax.stop_gradient((q, k, v)))[1] * math.log(2.0)   # the kernel's lse is in base 2
    if ids is not None:                                # rows of padded queries: zeros, like an all-masked row
        out = jnp.where(ids[:, :, None, None] != 0, out, 0).astype(q.dtype)
    return out, lse


def _block(length: int, name: str) -> int:
    """The GPU kernel's tile along a length: the largest of 64, 32, 16 dividing it (a shorter length whole)."""
    for b in (64, 32, 16):
        if length % b == 0:
            return b
    if length < 16:
        return length
    raise BackendError(f"attention backend 'pallas' (GPU kernel) needs {name}={length} to be a multiple of 16")


def _lse(q, k, ids, causal, scale):
    """Per-row log-sum-exp [B,N,T] for kernels that do not return one (the chunked forward over q and k), under
    the kernel's own masking: key ids [B,S] (0 = padding; a query of id i sees keys of id i), causal or not."""
    from jaxformer.ops.flash import chunked_attention
    mask = None
    if ids is not None or causal:
        pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        valid = None if ids is None else ids != 0
        segs = None if ids is None or q.shape[1] != k.shape[1] else ids
        mask = (masks_lib.CausalMask(pos, pos, valid, segs, segs) if causal else
                masks_lib.segment_mask(segs, ids) if segs is not None else valid[:, None, None, :])
    return chunked_attention(q, k, k, mask, None, scale=scale)[1]


def residual_lse(residual: jax.Array) -> jax.Array:
    """The log-sum-exp residual of `jax.nn.dot_product_attention(..., return_residual=True)`, [B,T,N] for every
    implementation (the cuDNN path transposes its kernel's [B,N,T]; pinned on CPU with implementation="xla")
    -> [B,N,T] float32, the layout every backend here returns.

    Args:
      residual: [B, T, N] the log-sum-exp residual.

    Returns:
      [B, N, T] float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.fused import residual_lse
      >>> residual_lse(jnp.zeros((1, 3, 2), jnp.bfloat16)).shape
      (1, 2, 3)
    """
    return jnp.swapaxes(residual, 1, 2).astype(jnp.float32)


def cudnn_attention(q, k, v, mask, bias, *, scale: float, want_lse: bool = False):
    """Attention by cuDNN flash attention (`jax.nn.dot_product_attention(..., implementation="cudnn")`), GQA
    native. Masks and bias are passed dense; a row with no visible key returns zeros, as with every backend.

    Args:
      q: [B, T, N, H] queries, bfloat16 or float16.
      k: [B, S, K, H] keys.
      v: [B, S, K, H] values.
      mask: boolean broadcastable to [B, N, T, S] (or a lazy `CausalMask`, materialised), or None.
      bias: additive, broadcastable to [B, N, T, S] (or a lazy `AlibiBias`, materialised), or None.
      scale: the logits scale.
      want_lse: also return the log-sum-exp.

    Returns:
      out: [B, T, N, H].
      lse: [B, N, T] float32 with want_lse (from a second, gradient-free call), else None.

    Raises:
      BackendError: not on an NVIDIA GPU, or activations neither bfloat16 nor float16 (`problem`).

    Examples:
      Refused by name where it cannot run (here: a CPU, or float32 activations on a GPU), never replaced by
      another backend:

      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.fused import cudnn_attention
      >>> q = jnp.ones((1, 2, 1, 4))
      >>> cudnn_attention(q, q, q, None, None, scale=0.5)
      Traceback (most recent call last):
      ...
      jaxformer.errors.BackendError: attention backend 'cudnn' ...
    """
    why = problem("cudnn", dtype=q.dtype)
    if why:
        raise BackendError(why)
    b, t, n, _ = q.shape
    s = k.shape[1]
    mask = masks_lib.materialized_mask(mask)
    bias = bias.materialize() if hasattr(bias, "materialize") else bias
    mask4 = None if mask is None else jnp.broadcast_to(mask, (b, mask.shape[-3] if mask.ndim >= 3 else 1, t, s))
    bias4 = None if bias is None else jnp.broadcast_to(bias, (b, n, t, s)).astype(q.dtype)
    run = lambda residual, *a: jax.nn.dot_product_attention(*a, bias4, mask4, scale=scale, implementation="cudnn",
                                                            return_residual=residual)
    out, lse = run(False, q, k, v), None
    if want_lse:
        lse = residual_lse(run(True, *jax.lax.stop_gradient((q, k, v)))[1])
    if mask4 is not None:
        seen = jnp.any(mask4, axis=-1)                                            # [B,1|N,T]
        out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0).astype(q.dtype)
        lse = None if lse is None else jnp.where(seen, lse, -jnp.inf)
    return out, lse
