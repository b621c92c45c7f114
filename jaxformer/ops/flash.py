"""Memory-efficient attention in pure JAX: the "chunked" backend of `ops.dot_product_attention`.

Online softmax over key blocks (Rabe & Staats 2021; FlashAttention, Dao et al. 2022) inside a loop over query
blocks, with a custom VJP (FlashAttention-2's backward) that recomputes each [bq,bk] tile of probabilities from
the saved per-row log-sum-exp. Neither pass ever holds the [T,S] matrix: the largest temporary is one tile of
logits [B,N,bq,bk] (float32) plus the inputs, outputs and their gradients. Runs on every platform.

Masks and biases are taken tile by tile: a boolean array broadcastable to [B,N,T,S] is sliced per tile (it is
the one input that may itself be O(T·S)), and a lazy mask or bias (an object with `tile(q0, tq, k0, tk)` and
`pad(t, s)`, e.g. `ops.masks.CausalMask`, `ops.positional.AlibiBias`) is built per tile from positions, so a
causal decoder at 16k keys never holds a [T,S] array at all. Tiles with no visible key are skipped.

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, G = N/K, H head dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

_MIN = float(jnp.finfo(jnp.float32).min)


def _as4(x):
    """A dense mask/bias as rank 4 [B|1, N|1, T|1, S|1]; lazy objects pass through."""
    if x is None or hasattr(x, "tile"):
        return x
    return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def _pad(x, t: int, s: int, tp: int, sp: int):
    """Grow the T and S axes of a mask/bias (those not of size 1) to tp, sp. Pad content is never read as a
    valid key: the kernel masks key indices >= S itself."""
    if x is None or (tp == t and sp == s):
        return x
    if hasattr(x, "pad"):
        return x.pad(tp, sp)
    widths = [(0, 0), (0, 0), (0, tp - t if x.shape[2] != 1 else 0), (0, sp - s if x.shape[3] != 1 else 0)]
    return jnp.pad(x, widths)


def _tile(x, q0, tq: int, k0, tk: int):
    """The [.., tq|1, tk|1] tile of a mask/bias starting at query q0 and key k0."""
    if x is None or hasattr(x, "tile"):
        return None if x is None else x.tile(q0, tq, k0, tk)
    if x.shape[2] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, q0, tq, axis=2)
    if x.shape[3] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, k0, tk, axis=3)
    return x


def _kg(x, kh: int, g: int):
    """[B|1, N|1, a, b] -> [B|1, K|1, G|1, a, b] to meet logits [B,K,G,T,S]."""
    return x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], kh, g, *x.shape[2:])


def capped(softcap) -> bool:
    """Whether `softcap` caps anything: a traced scalar always may (a per-layer cap, 0 at some layers); a number
    when it is not 0.

    Args:
      softcap: the attention-logit soft-cap: a Python number, or a (traced) scalar array.

    Returns:
      A Python bool: False only for a number equal to 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.flash import capped
      >>> capped(0.0), capped(50.0), capped(jnp.float32(0.0))       # an array may be a traced per-layer cap
      (False, True, True)
    """
    return not isinstance(softcap, (int, float)) or softcap != 0


def soft_cap(x: jax.Array, softcap) -> tuple[jax.Array, jax.Array]:
    """Attention-logit soft-capping: x [...] float32 -> (softcap · tanh(x / softcap), its slope 1 − tanh²).

    Args:
      x: [...] float32 logits.
      softcap: a number (> 0), or a traced scalar (per layer: where it is <= 0, x and slope 1, no cap).

    Returns:
      capped: [...] float32, the capped logits softcap · tanh(x / softcap).
      slope: [...] float32, d(capped)/dx = 1 − tanh².

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.flash import soft_cap
      >>> y, slope = soft_cap(jnp.array([0.0, 100.0]), 50.0)
      >>> [round(v, 3) for v in y.tolist()], [round(v, 3) for v in slope.tolist()]
      ([0.0, 48.201], [1.0, 0.071])
    """
    if isinstance(softcap, (int, float)):
        th = jnp.tanh(x / softcap)
        return softcap * th, 1.0 - th * th
    on = softcap > 0
    cap = jnp.where(on, softcap, 1.0).astype(jnp.float32)            # no 0/0 in the branch not taken
    th = jnp.tanh(x / cap)
    return jnp.where(on, cap * th, x), jnp.where(on, 1.0 - th * th, 1.0)


class _Spec:
    """Static facts of one call: sizes, block sizes and padding (and the soft-cap: a number, or a traced
    scalar)."""

    def __init__(self, q, k, scale, block_q, block_k, softcap=0.0):
        self.b, self.t, self.n, self.h = q.shape
        self.s, self.kh = k.shape[1], k.shape[2]
        self.g = self.n // self.kh
        self.scale, self.softcap = scale, softcap
        self.bq, self.bk = min(block_q, self.t), min(block_k, self.s)
        self.tp = -(-self.t // self.bq) * self.bq
        self.sp = -(-self.s // self.bk) * self.bk
        self.nq, self.nk = self.tp // self.bq, self.sp // self.bk


def _tile_logits(sp: _Spec, qb, k, mask, bias, q0, j, *, slope: bool = False):
    """Logits of one tile, masked: qb [B,bq,K,G,H], key block j -> (s [B,K,G,bq,bk] f32, ok bool, k0), and
    with slope=True also d(capped)/d(raw) of the soft-cap (1 - tanh², or None without a cap)."""
    k0 = j * sp.bk
    kb = jax.lax.dynamic_slice_in_dim(k, k0, sp.bk, axis=1)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qb, kb, preferred_element_type=jnp.float32) * sp.scale
    dcap = None
    if capped(sp.softcap):
        s, dcap = soft_cap(s, sp.softcap)
    if bias is not None:
        s = s + _kg(_tile(bias, q0, sp.bq, k0, sp.bk).astype(jnp.float32), sp.kh, sp.g)
    ok = (k0 + jnp.arange(sp.bk) < sp.s)[None, None, None, None, :]          # padded keys are never valid
    if mask is not None:
        ok = ok & _kg(_tile(mask, q0, sp.bq, k0, sp.bk), sp.kh, sp.g)
    ok = jnp.broadcast_to(ok, s.shape)
    if slope:
        return jnp.where(ok, s, _MIN), ok, k0, dcap
    return jnp.where(ok, s, _MIN), ok, k0


def _when(pred, fn, carry):
    """fn(carry) if pred else carry, as a while loop of 0 or 1 trips. Not `lax.cond`, and no tile computed
    outside fn: under a differentiated `lax.scan` (the layer stack) JAX kept every tile of this forward that a
    cond read (logits and mask, O(T·S) memory) as residuals (benchmarks/context_memory.py found it)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros((), bool), fn(c[1])), (pred, carry))[1]


def _visible(sp: _Spec, mask, q0, j):
    """Whether the tile at query q0, key block j has a visible key (its mask, no logits)."""
    k0 = j * sp.bk
    ok = (k0 + jnp.arange(sp.bk) < sp.s)[None, None, None, :]
    return jnp.any(ok if mask is None else ok & _tile(mask, q0, sp.bq, k0, sp.bk))


def _q_blocks(sp: _Spec, x, width):
    """[B,Tp,...] -> [nq, B, bq, ...]."""
    return jnp.moveaxis(x.reshape(sp.b, sp.nq, sp.bq, *width), 1, 0)


def _forward(sp: _Spec, q, k, v, mask, bias):
    """Padded inputs -> out [B,K,G,Tp,H] float32, lse [B,K,G,Tp] (−inf on rows with no visible key)."""
    qg = _q_blocks(sp, q.reshape(sp.b, sp.tp, sp.kh, sp.g, sp.h), (sp.kh, sp.g, sp.h))

    def one_q_block(args):
        i, qb = args
        q0 = i * sp.bq

        def body(carry, j):
            def update(carry):                          # the tile computed inside: no tile escapes the loop
                s, ok, k0 = _tile_logits(sp, qb, k, mask, bias, q0, j)
                m, l, acc = carry
                vb = jax.lax.dynamic_slice_in_dim(v, k0, sp.bk, axis=1)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                acc = acc * corr[..., None] + jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(v.dtype), vb,
                                                         preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc

            return _when(_visible(sp, mask, q0, j), update, carry), None

        shape = (sp.b, sp.kh, sp.g, sp.bq)
        init = (jnp.full(shape, _MIN, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (sp.h,), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(body, init, jnp.arange(sp.nk))
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)

    out, lse = jax.lax.map(one_q_block, (jnp.arange(sp.nq), qg))        # [nq,B,K,G,bq,(H)]
    out = jnp.moveaxis(out, 0, 3).reshape(sp.b, sp.kh, sp.g, sp.tp, sp.h)
    return out, jnp.moveaxis(lse, 0, 3).reshape(sp.b, sp.kh, sp.g, sp.tp)


def _backward(sp: _Spec, q, k, v, mask, bias, out, lse, dout, want_dbias):
    """FlashAttention-2 backward from the saved lse: -> dq, dk, dv (padded shapes), dbias tiles or None."""
    delta = jnp.sum(dout * out, axis=-1)                                   # [B,K,G,Tp]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)                 # rows with no key: p = 0
    qg = _q_blocks(sp, q.reshape(sp.b, sp.tp, sp.kh, sp.g, sp.h), (sp.kh, sp.g, sp.h))
    per_row = lambda x, w: jnp.moveaxis(x.reshape(sp.b, sp.kh, sp.g, sp.nq, sp.bq, *w), 3, 0)
    do_b, lse_b, delta_b = per_row(dout, (sp.h,)), per_row(lse_safe, ()), per_row(delta, ())

    def one_q_block(carry, args):
        dk, dv = carry
        i, qb, dob, lb, db = args
        q0 = i * sp.bq

        def body(dq, j):
            s, ok, k0, dcap = _tile_logits(sp, qb, k, mask, bias, q0, j, slope=True)

            def grads(dq):
                kb = jax.lax.dynamic_slice_in_dim(k, k0, sp.bk, axis=1)
                vb = jax.lax.dynamic_slice_in_dim(v, k0, sp.bk, axis=1)
                p = jnp.where(ok, jnp.exp(s - lb[..., None]), 0.0)
                dv_j = jnp.einsum("BKGTS,BKGTH->BSKH", p.astype(dob.dtype), dob,
                                  preferred_element_type=jnp.float32)
                dp = jnp.einsum("BKGTH,BSKH->BKGTS", dob, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - db[..., None])                  # d(loss)/d(logit): the bias's gradient
                dr = ds if dcap is None else ds * dcap          # through the soft-cap, to q·k·scale
                dq = dq + jnp.einsum("BKGTS,BSKH->BKGTH", dr, kb, preferred_element_type=jnp.float32) * sp.scale
                dk_j = jnp.einsum("BKGTS,BTKGH->BSKH", dr, qb, preferred_element_type=jnp.float32) * sp.scale
                return dq, (dk_j, dv_j, ds if want_dbias else None)

            def skip(dq):                                       # a tile with no visible key adds nothing
                zeros = jnp.zeros((sp.b, sp.bk, sp.kh, sp.h), jnp.float32)
                return dq, (zeros, zeros, jnp.zeros(s.shape, jnp.float32) if want_dbias else None)

            return jax.lax.cond(ok.any(), grads, skip, dq)

        dq, (dk_j, dv_j, ds) = jax.lax.scan(body, jnp.zeros(dob.shape, jnp.float32), jnp.arange(sp.nk))
        to_keys = lambda x: jnp.moveaxis(x, 0, 1).reshape(sp.b, sp.sp, sp.kh, sp.h)   # [nk,B,bk,K,H] ->
        return (dk + to_keys(dk_j), dv + to_keys(dv_j)), (dq, ds)

    zeros = jnp.zeros((sp.b, sp.sp, sp.kh, sp.h), jnp.float32)
    (dk, dv), (dq, ds) = jax.lax.scan(one_q_block, (zeros, zeros),
                                      (jnp.arange(sp.nq), qg, do_b, lse_b, delta_b))
    dq = jnp.moveaxis(dq, 0, 3).reshape(sp.b, sp.kh, sp.g, sp.tp, sp.h)   # [nq,B,K,G,bq,H] -> [B,K,G,Tp,H]
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).reshape(sp.b, sp.tp, sp.n, sp.h)
    if ds is not None:                                                     # [nq,nk,B,K,G,bq,bk] -> [B,N,Tp,Sp]
        ds = jnp.transpose(ds, (2, 3, 4, 0, 5, 1, 6)).reshape(sp.b, sp.n, sp.tp, sp.sp)
    return dq, dk, dv, ds


def _prepare(q, k, v, mask, bias, block_q, block_k, scale, softcap):
    sp = _Spec(q, k, scale, block_q, block_k, softcap)
    pad = lambda x, n, to: x if to == n else jnp.pad(x, [(0, 0), (0, to - n)] + [(0, 0)] * (x.ndim - 2))
    mask, bias = _pad(_as4(mask), sp.t, sp.s, sp.tp, sp.sp), _pad(_as4(bias), sp.t, sp.s, sp.tp, sp.sp)
    return sp, pad(q, sp.t, sp.tp), pad(k, sp.s, sp.sp), pad(v, sp.s, sp.sp), mask, bias


def _finish(sp: _Spec, out, lse, dtype):
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(sp.b, sp.tp, sp.n, sp.h)[:, :sp.t].astype(dtype)
    return out, lse.reshape(sp.b, sp.n, sp.tp)[..., :sp.t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention(q, k, v, mask, bias, traced, scale, block_q, block_k, softcap):
    """traced: (scale, soft-cap), each a traced scalar (a per-layer number: not differentiated) or None, where
    the static `scale` / `softcap` holds the number."""
    sp, q_, k_, v_, mask_, bias_ = _prepare(q, k, v, mask, bias, block_q, block_k, *_numbers(traced, scale, softcap))
    return _finish(sp, *_forward(sp, q_, k_, v_, mask_, bias_), q.dtype)


def _numbers(traced, scale, softcap):
    """(scale, softcap): each the traced one where given, else the static number."""
    return tuple(s if t is None else t for t, s in zip(traced, (scale, softcap)))


def _attention_fwd(q, k, v, mask, bias, traced, scale, block_q, block_k, softcap):
    is_primal = lambda a: isinstance(a, CustomVJPPrimal)
    value = lambda t: jax.tree.map(lambda a: a.value, t, is_leaf=is_primal)
    want_dbias = bias is not None and any(a.perturbed for a in jax.tree.leaves(bias, is_leaf=is_primal))
    q, k, v, mask, bias, traced = value((q, k, v, mask, bias, traced))
    sp, q_, k_, v_, mask_, bias_ = _prepare(q, k, v, mask, bias, block_q, block_k, *_numbers(traced, scale, softcap))
    out, lse = _forward(sp, q_, k_, v_, mask_, bias_)
    flag = jnp.zeros((0,)) if want_dbias else None                       # static, carried as pytree structure
    return _finish(sp, out, lse, q.dtype), (q, k, v, mask, bias, traced, out, lse, flag)


def _attention_bwd(scale, block_q, block_k, softcap, res, cts):
    q, k, v, mask, bias, traced, out, lse, flag = res
    dout = cts[0]
    if isinstance(dout, SymbolicZero):
        return None, None, None, None, None, (None, None)
    sp, q_, k_, v_, mask_, bias_ = _prepare(q, k, v, mask, bias, block_q, block_k, *_numbers(traced, scale, softcap))
    do = jnp.pad(dout.astype(jnp.float32), [(0, 0), (0, sp.tp - sp.t), (0, 0), (0, 0)])
    do = jnp.transpose(do.reshape(sp.b, sp.tp, sp.kh, sp.g, sp.h), (0, 2, 3, 1, 4))   # [B,K,G,Tp,H]
    dq, dk, dv, ds = _backward(sp, q_, k_, v_, mask_, bias_, out, lse, do.astype(q.dtype), flag is not None)
    dbias = None
    if ds is not None:                    # sum over the axes the bias was broadcast along, back to its shape
        ds = ds[:, :, :sp.t, :sp.s]
        b4 = _as4(bias)
        ds = jnp.sum(ds, axis=tuple(a for a in range(4) if b4.shape[a] == 1), keepdims=True)
        dbias = ds.reshape(bias.shape).astype(bias.dtype)
    cast = lambda d, x: d[:, :x.shape[1]].astype(x.dtype)
    return cast(dq, q), cast(dk, k), cast(dv, v), None, dbias, (None, None)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask=None, bias=None, *, scale: float | jax.Array,
                      block_q: int = 512, block_k: int = 512,
                      softcap: float | jax.Array = 0.0) -> tuple[jax.Array, jax.Array]:
    """Memory-efficient softmax(q·kᵀ·scale + bias, masked)·v with its per-row log-sum-exp; with softcap > 0
    the scaled q·kᵀ is soft-capped first (softcap · tanh(x / softcap), Gemma 2), in the backward pass too.
    scale and softcap may be traced scalars (per-layer numbers; a cap <= 0: none); neither is differentiated.

    Lengths need not divide the block sizes. Differentiable in q, k, v and a dense bias.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys (N a multiple of K).
      v: [B, S, K, H] values.
      mask: boolean (True = may attend): an array broadcastable to [B, N, T, S] or a lazy object with
        `tile(q0, tq, k0, tk)` and `pad(t, s)` (see the module docstring), or None.
      bias: additive logits bias: an array broadcastable to [B, N, T, S] or a lazy object (`AlibiBias`), or None.
      scale: the logits scale: a number or a traced scalar.
      block_q: query tile edge.
      block_k: key tile edge.
      softcap: attention-logit soft-cap: a number or a traced scalar (0, or <= 0 when traced: no cap).

    Returns:
      out: [B, T, N, H] in q's dtype.
      lse: [B, N, T] float32: log Σ_s exp(logit), −inf for a row with no visible key, whose output is 0.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import causal_mask
      >>> from jaxformer.ops.flash import chunked_attention
      >>> q = jnp.ones((1, 3, 2, 4))
      >>> attend = jax.jit(chunked_attention, static_argnames=("block_q", "block_k"))
      >>> out, lse = attend(q, q, q, causal_mask(3), scale=0.5, block_q=2, block_k=2)       # 2x2 tiles
      >>> out.shape, [round(x, 4) for x in lse[0, 0].tolist()]      # log(1), log(2), log(3) above logit 2
      ((1, 3, 2, 4), [2.0, 2.6931, 3.0986])
    """
    numbers = (scale, softcap)
    traced = tuple(None if isinstance(n, (int, float)) else jnp.asarray(n, jnp.float32) for n in numbers)
    scale, softcap = (float(n) if t is None else 0.0 for n, t in zip(numbers, traced))
    return _attention(q, k, v, mask, bias, traced, scale, int(block_q), int(block_k), softcap)
