"""Unit tests of the pure ops (jaxformer.ops): attention, masks, norms, activations, positional encodings.

Axis legend: B batch, T query length, S key length, D width, N query heads, K kv heads, H head dim.
References are straightforward NumPy float64 implementations.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from jaxformer import ops
from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import EncoderBlock
from jaxformer.nn.layers import Context
from jaxformer.ops import activations, norms, positional
from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.masks import causal_mask, combine_masks, padding_mask, position_causal_mask


# ----------------------------------------------------------------------------- helpers

def rand(seed, shape, dtype=np.float32, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def ref_attention(q, k, v, mask=None, bias=None, scale=None):
    """NumPy float64 reference: softmax(q kᵀ · scale + bias, masked) v, GQA by repeating kv heads.

    Returns (out [B,T,N,H], weights [B,N,T,S]); fully masked rows give zero weights and zero output."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    k = np.repeat(k, g, axis=2)   # query head i uses kv head i // g
    v = np.repeat(v, g, axis=2)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.broadcast_to(np.asarray(bias, np.float64), logits.shape)
    m = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask), logits.shape)
    logits = np.where(m, logits, -np.inf)
    mx = logits.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m, np.exp(logits - mx), 0.0)
    den = e.sum(-1, keepdims=True)
    w = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)
    return np.einsum("bnts,bsnh->btnh", w, v), w


def qkv(seed, b=2, t=5, s=6, n=4, kh=2, h=8, dtype=np.float32, scale=1.0):
    return (rand(seed, (b, t, n, h), dtype, scale), rand(seed + 1, (b, s, kh, h), dtype, scale),
            rand(seed + 2, (b, s, kh, h), dtype, scale))


def random_mask(seed, shape, p=0.6, dead_rows=((0, 0, 1),)):
    """Random bool mask [B,N|1,T,S] with the (b, n, t) rows listed in dead_rows fully masked."""
    m = np.random.default_rng(seed).random(shape) < p
    for b, n, t in dead_rows:
        m[b, n, t, :] = False
    return m


# ----------------------------------------------------------------------------- attention: values

@pytest.mark.parametrize("n,kh", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_numpy_reference(n, kh, masked):
    q, k, v = qkv(0, n=n, kh=kh)
    mask = random_mask(7, (2, n, 5, 6)) if masked else None
    out = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                mask=None if mask is None else jnp.asarray(mask)).out
    ref, _ = ref_attention(q, k, v, mask)
    assert out.shape == (2, 5, n, 8) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_attention_with_bias_scale_and_broadcast_mask_matches_reference():
    q, k, v = qkv(3, n=4, kh=2)
    bias = rand(4, (1, 4, 5, 6))                 # broadcast over B
    mask = np.tril(np.ones((5, 6), bool), k=1)    # [T,S] broadcast over B and N
    out = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask),
                                bias=jnp.asarray(bias), scale=0.3).out
    ref, _ = ref_attention(q, k, v, mask, bias, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_attention_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(5, h=16)
    a = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)).out
    b = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.25).out
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    c = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=1.0).out
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-3


def test_attention_weights_shape_dtype_and_row_sums():
    q, k, v = qkv(11, n=4, kh=1)
    mask = random_mask(12, (2, 1, 5, 6), dead_rows=((1, 0, 3),))
    out, w, _ = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask),
                                   return_probs=True)
    assert w.shape == (2, 4, 5, 6) and w.dtype == jnp.float32
    w = np.asarray(w)
    full = np.broadcast_to(mask, w.shape)
    expected = np.where(full.any(-1), 1.0, 0.0)
    np.testing.assert_allclose(w.sum(-1), expected, atol=1e-6)
    assert (w[~full] == 0).all()
    assert (w >= 0).all()
    _, ref_w = ref_attention(q, k, v, mask)
    np.testing.assert_allclose(w, ref_w, atol=1e-6)
    # out == weights · v (with GQA head mapping)
    np.testing.assert_allclose(np.asarray(out), np.einsum("bnts,bsnh->btnh", w, np.repeat(v, 4, axis=2)),
                               atol=1e-5)


def test_mqa_equals_mha_with_repeated_kv_heads():
    q, k, v = qkv(21, n=4, kh=1)
    a = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)).out
    b = dot_product_attention(jnp.asarray(q), jnp.asarray(np.repeat(k, 4, 2)), jnp.asarray(np.repeat(v, 4, 2))).out
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


# ----------------------------------------------------------------------------- attention: precision, masking

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_keep_dtype_and_match_reference(dtype):
    q, k, v = qkv(31, n=4, kh=2)
    mask = random_mask(32, (2, 4, 5, 6), dead_rows=((0, 1, 2), (1, 3, 0)))
    out, w, _ = dot_product_attention(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                   mask=jnp.asarray(mask), return_probs=True)
    assert out.dtype == dtype and w.dtype == jnp.float32
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    qd, kd, vd = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, k, v))
    ref, _ = ref_attention(qd, kd, vd, mask)
    np.testing.assert_allclose(out, ref, atol=5e-2, rtol=5e-2)
    assert (out[0, 2, 1] == 0).all() and (out[1, 0, 3] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_large_logits_do_not_overflow(dtype):
    """|q·k| ~ 1e5 exceeds float16's max (65504): logits/softmax must be float32, output finite."""
    h = 16
    q = np.full((1, 3, 2, h), 80.0, np.float32)
    k = np.full((1, 4, 2, h), 80.0, np.float32)
    k[:, 1] = -80.0
    v = rand(41, (1, 4, 2, h))
    mask = np.ones((1, 2, 3, 4), bool)
    mask[0, 0, 2] = False                        # one fully masked row
    out, w, _ = dot_product_attention(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                   mask=jnp.asarray(mask), return_probs=True)
    out32 = np.asarray(out.astype(jnp.float32))
    w = np.asarray(w)
    assert np.isfinite(out32).all() and np.isfinite(w).all()
    assert (out32[0, 2, 0] == 0).all()
    ref, ref_w = ref_attention(q, k, np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)), mask)
    np.testing.assert_allclose(w, ref_w, atol=1e-3)
    np.testing.assert_allclose(out32, ref, atol=5e-2, rtol=5e-2)


def test_bf16_attention_logits_and_softmax_are_float32():
    """Discriminating by construction: logits q·k·scale ≈ 200 that differ by 0.25, while bfloat16's spacing in
    [128, 256) is 1.0. q, k (small integers, 32 and 25) are exact in bfloat16 and q·k is an exact integer, so
    float32 logits are exact and the float32 weights match the float64 reference to float32 rounding; logits held
    in bfloat16 (e.g. a bf16-output einsum) collapse neighbours and move weights by ~0.1 (premise asserted)."""
    import ml_dtypes
    rng = np.random.default_rng(35)
    b, t, s, n, kh, h = 2, 3, 8, 4, 2, 16                 # scale = 1/sqrt(16) = 0.25, exact
    q = np.zeros((b, t, n, h), np.float32)
    k = np.zeros((b, s, kh, h), np.float32)
    q[..., 0], k[..., 0] = 32.0, 25.0                     # common part: 32·25·0.25 = 200
    q[..., 1] = rng.choice([-1.0, 1.0], (b, t, n))
    for bi in range(b):
        for ki in range(kh):
            k[bi, :, ki, 1] = rng.permutation(s)          # distinct offsets 0..7 -> logits 200 ± 0.25·j
    q[..., 2:4] = rng.integers(-2, 3, (b, t, n, 2))       # a little more integer structure per head
    k[..., 2:4] = rng.integers(-1, 2, (b, s, kh, 2))
    v = rng.integers(-8, 9, (b, s, kh, h)).astype(np.float32)
    for a in (q, k, v):                                   # premise: inputs exactly representable in bf16
        np.testing.assert_array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a)
    ref, ref_w = ref_attention(q, k, v)
    logits = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), np.repeat(k, n // kh, 2).astype(np.float64)) / 4
    assert 190 < logits.min() and logits.max() < 256                       # bf16 spacing there: 1.0 (>= 128)
    lb = logits.astype(ml_dtypes.bfloat16).astype(np.float64)
    wb = np.exp(lb - lb.max(-1, keepdims=True))
    wb /= wb.sum(-1, keepdims=True)
    tol = 1e-4            # float32 softmax of exact logits: ~1e-7; bf16 weights alone would be off by up to 2^-10
    assert np.abs(wb - ref_w).max() > 300 * tol                            # premise: bf16 logits are far off
    out, w, _ = dot_product_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                                   jnp.asarray(v, jnp.bfloat16), return_probs=True)
    assert out.dtype == jnp.bfloat16 and w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=0, atol=tol)
    # out = weights (cast to bf16) · v, rounded to bf16: a few bf16 ulps (2^-8 relative) of max|v|
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=0, atol=2 ** -6 * np.abs(v).max())


def test_fully_masked_rows_are_zero_with_zero_gradient():
    q, k, v = qkv(51, n=4, kh=2)
    mask = random_mask(52, (2, 4, 5, 6), dead_rows=((0, 1, 2), (1, 0, 4)))
    mask[0, :, 3, :] = False                     # a query position masked in every head
    mask = jnp.asarray(mask)
    out = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask).out
    out = np.asarray(out)
    assert np.isfinite(out).all()
    assert (out[0, 2, 1] == 0).all() and (out[1, 4, 0] == 0).all() and (out[0, 3] == 0).all()

    def dead_loss(q, k, v):
        o = dot_product_attention(q, k, v, mask=mask).out
        return (o[0, 2, 1] ** 2).sum() + (o[1, 4, 0] ** 2).sum() + o[0, 3].sum()

    grads = jax.grad(dead_loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
        assert (np.asarray(g) == 0).all()

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, mask=mask).out ** 2)

    gq, gk, gv = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    gq = np.asarray(gq)
    assert all(np.isfinite(np.asarray(g)).all() for g in (gq, gk, gv))
    assert (gq[0, 2, 1] == 0).all() and (gq[0, 3] == 0).all()
    assert np.abs(gq).max() > 0                  # live rows do get gradient


def test_fully_masked_everything_is_zero_not_nan():
    q, k, v = qkv(61)
    mask = jnp.zeros((2, 1, 5, 6), bool)
    out, w, _ = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask, return_probs=True)
    assert (np.asarray(out) == 0).all() and (np.asarray(w) == 0).all()


@pytest.mark.parametrize("bad", [np.int32, np.float32, np.uint8])
def test_non_bool_mask_raises_type_error(bad):
    q, k, v = qkv(71)
    with pytest.raises(TypeError, match="bool"):
        dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.ones((5, 6), bad)).out


@pytest.mark.parametrize("shapes", [
    ((2, 5, 4, 8), (2, 6, 2, 8), (2, 6, 2)),          # v rank 3
    ((5, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)),          # q rank 3
    ((2, 5, 4, 8), (2, 6, 2, 8), (2, 7, 2, 8)),       # k/v disagree on S
    ((2, 5, 4, 8), (3, 6, 2, 8), (3, 6, 2, 8)),       # B mismatch
    ((2, 5, 4, 8), (2, 6, 2, 4), (2, 6, 2, 4)),       # H mismatch
])
def test_bad_shapes_raise_value_error(shapes):
    q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError):
        dot_product_attention(q, k, v).out


@pytest.mark.parametrize("n,kh", [(4, 3), (6, 4), (2, 4)])
def test_heads_not_multiple_of_kv_heads_raises(n, kh):
    q = jnp.zeros((1, 3, n, 8))
    k = jnp.zeros((1, 3, kh, 8))
    with pytest.raises(ValueError, match=f"N={n}.*K={kh}"):
        dot_product_attention(q, k, k).out


def test_unknown_backend_raises():
    q, k, v = (jnp.asarray(a) for a in qkv(81))
    with pytest.raises(ValueError, match="backend"):
        dot_product_attention(q, k, v, backend="flash9000").out


@pytest.mark.parametrize("cuts", [(2,), (1, 4), (0, 6), (3, 3)])
def test_attention_over_key_segments_equals_concatenated_keys(cuts):
    """k/v given as segments along S (a cache + new keys) are the same attention as their concatenation,
    including weights, bias, masks with dead rows, and gradients with respect to every segment."""
    q, k, v = (jnp.asarray(a) for a in qkv(111, n=4, kh=2))
    mask = jnp.asarray(random_mask(112, (2, 4, 5, 6)))
    bias = jnp.asarray(np.random.default_rng(113).normal(size=(1, 4, 5, 6)), jnp.float32)
    bounds = (0, *cuts, 6)
    split = lambda a: tuple(a[:, i:j] for i, j in zip(bounds[:-1], bounds[1:]))  # noqa: E731
    whole, w_whole, _ = dot_product_attention(q, k, v, mask=mask, bias=bias, return_probs=True)
    seg, w_seg, _ = dot_product_attention(q, split(k), list(split(v)), mask=mask, bias=bias, return_probs=True)
    np.testing.assert_allclose(np.asarray(seg), np.asarray(whole), atol=1e-6)
    np.testing.assert_allclose(np.asarray(w_seg), np.asarray(w_whole), atol=1e-7)
    loss = lambda k, v: jnp.sum(jnp.sin(dot_product_attention(q, split(k), split(v), mask=mask).out))  # noqa: E731
    ref = lambda k, v: jnp.sum(jnp.sin(dot_product_attention(q, k, v, mask=mask).out))  # noqa: E731
    for g_seg, g_ref in zip(jax.jit(jax.grad(loss, (0, 1)))(k, v), jax.grad(ref, (0, 1))(k, v)):
        np.testing.assert_allclose(np.asarray(g_seg), np.asarray(g_ref), atol=1e-6)


@pytest.mark.parametrize("n,kh", [(4, 4), (4, 2), (4, 1), (32, 8)])
def test_single_query_path_matches_reference_values_and_gradients(n, kh):
    """T=1 with N <= 16 heads contracts over the cache's own layout (all heads + diagonal); N=32 takes the
    per-head path. Both must equal the NumPy reference, with masks, bias and a cache + new-key segment split."""
    q, k, v = qkv(131, b=3, t=1, s=7, n=n, kh=kh)
    mask = np.random.default_rng(132).random((3, 1, 1, 7)) < 0.7
    mask[0] = False                                                  # a fully-masked row
    bias = np.random.default_rng(133).normal(size=(1, n, 1, 7)).astype(np.float32)
    want, _ = ref_attention(q, k, v, mask, bias)
    args = [jnp.asarray(a) for a in (q, k, v)]
    got = dot_product_attention(*args, mask=jnp.asarray(mask), bias=jnp.asarray(bias)).out
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    seg = lambda a: (a[:, :6], a[:, 6:])  # noqa: E731
    got_seg = jax.jit(lambda q, k, v: dot_product_attention(q, seg(k), seg(v), mask=jnp.asarray(mask)).out)(*args)
    np.testing.assert_allclose(np.asarray(got_seg), ref_attention(q, k, v, mask)[0], atol=1e-5)
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=jnp.asarray(mask), bias=jnp.asarray(bias)).out  # noqa: E731
    check_grads(jax.jit(f), args, order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("t,n,kh", [(1, 4, 4), (1, 4, 2), (5, 4, 1), (1, 32, 8)])
def test_heads_major_kv_layout_matches_reference_values_and_gradients(backend, t, n, kh):
    """kv_layout="BKSH" (a per-layer decoding cache [B,K,S,H], given as a cache + new-key segment pair) is the
    same attention as [B,S,K,H]: values against the float64 reference and gradients against the BSKH call.
    Wrong layouts this catches: S and K read swapped (K=S shapes are avoided, so a swap also fails the shape
    check), heads-major segments concatenated along the wrong axis, a backend that ignores the layout."""
    q, k, v = qkv(141, b=3, t=t, s=7, n=n, kh=kh)
    mask = np.random.default_rng(142).random((3, 1, t, 7)) < 0.7
    mask[0, :, 0] = False                                            # a fully-masked row
    want, _ = ref_attention(q, k, v, mask)
    hm = lambda a: jnp.swapaxes(a, 1, 2)                              # noqa: E731  [B,S,K,H] -> [B,K,S,H]
    seg = lambda a: (hm(a)[:, :, :6], hm(a)[:, :, 6:])                # noqa: E731
    f = lambda q, k, v, layout: dot_product_attention(                # noqa: E731
        q, *((seg(k), seg(v)) if layout == "BKSH" else (k, v)), mask=jnp.asarray(mask), kv_layout=layout,
        backend=backend, block_size=4).out
    args = [jnp.asarray(a) for a in (q, k, v)]
    got = jax.jit(f, static_argnums=3)(*args, "BKSH")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    loss = lambda layout: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a, layout))), (0, 1, 2))(*args)  # noqa: E731
    for a, b in zip(loss("BKSH"), loss("BSKH")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    with pytest.raises(ValueError, match="kv_layout='BSHK'"):
        dot_product_attention(*args, kv_layout="BSHK")
    with pytest.raises(ValueError, match="disagree on B, K or H"):                  # checked in its own layout
        dot_product_attention(args[0], hm(args[1])[..., :4], hm(args[2])[..., :4], kv_layout="BKSH")


def test_attention_segment_errors_are_named():
    q, k, v = (jnp.asarray(a) for a in qkv(121))
    with pytest.raises(ValueError, match="same number of segments"):
        dot_product_attention(q, (k[:, :2], k[:, 2:]), v).out
    with pytest.raises(ValueError, match="non-empty"):
        dot_product_attention(q, (), ()).out
    with pytest.raises(ValueError, match="disagree on B, K or H"):
        dot_product_attention(q, (k, k[:, :, :1]), (v, v[:, :, :1])).out


# ----------------------------------------------------------------------------- attention: transforms

def test_attention_jit_equals_eager_and_vmap_equals_loop():
    q, k, v = qkv(91, n=4, kh=2)
    mask = jnp.asarray(random_mask(92, (2, 4, 5, 6)))
    f = lambda q, k, v, m: dot_product_attention(q, k, v, mask=m).out  # noqa: E731
    eager = f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
    jitted = jax.jit(f)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6)
    want, _ = ref_attention(q, k, v, mask=np.asarray(mask))          # and each equals the float64 reference
    for got in (eager, jitted):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)

    # vmap over an extra leading axis E=3 equals a Python loop
    qs, ks, vs = (jnp.asarray(np.stack([a, a * 0.5 + 1, -a])) for a in (q, k, v))
    ms = jnp.stack([mask, ~mask, jnp.ones_like(mask)])
    batched = jax.vmap(f)(qs, ks, vs, ms)
    assert batched.shape == (3, 2, 5, 4, 8)
    for e in range(3):
        np.testing.assert_allclose(np.asarray(batched[e]), np.asarray(f(qs[e], ks[e], vs[e], ms[e])), atol=1e-6)
        ref, _ = ref_attention(np.asarray(qs[e]), np.asarray(ks[e]), np.asarray(vs[e]), np.asarray(ms[e]))
        np.testing.assert_allclose(np.asarray(batched[e]), ref, atol=1e-5)


def test_check_grads_attention_with_mask():
    q, k, v = (jnp.asarray(a) for a in qkv(101, b=1, t=3, s=4, n=2, kh=1, h=4))
    mask = jnp.asarray(np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]], bool))  # row 1 fully masked
    f = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask).out)
    check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- masks

def test_causal_mask_square_is_lower_triangular():
    m = causal_mask(5)
    assert m.shape == (5, 5) and m.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(m), np.tril(np.ones((5, 5), bool)))


@pytest.mark.parametrize("t,s", [(1, 1), (1, 6), (3, 6), (4, 5), (6, 6)])
def test_causal_mask_with_fewer_queries_than_keys(t, s):
    m = np.asarray(causal_mask(t, s))
    assert m.shape == (t, s)
    for i in range(t):
        for j in range(s):
            assert m[i, j] == (j <= s - t + i), (i, j)
    np.testing.assert_array_equal(m, np.tril(np.ones((t, s), bool), k=s - t))
    assert m[-1].all()                           # the last query sees every key


def test_causal_mask_more_queries_than_keys_raises():
    with pytest.raises(ValueError):
        causal_mask(5, 3)


def test_padding_mask_shape_and_values():
    tokens = jnp.asarray([[5, 3, 0, 0], [0, 2, 9, 1]])
    m = padding_mask(tokens, 0)
    assert m.shape == (2, 1, 1, 4) and m.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(m[:, 0, 0]), [[1, 1, 0, 0], [0, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(padding_mask(tokens, 9)[:, 0, 0]), [[1, 1, 1, 1], [1, 1, 0, 1]])
    with pytest.raises(ValueError):
        padding_mask(jnp.zeros((4,), jnp.int32), 0)


def test_position_causal_mask_matches_numpy():
    rng = np.random.default_rng(3)
    qp = rng.integers(0, 8, (2, 3))
    kp = rng.integers(0, 8, (2, 5))
    valid = rng.random((2, 5)) < 0.7
    m = np.asarray(position_causal_mask(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(valid)))
    assert m.shape == (2, 1, 3, 5)
    ref = (kp[:, None, :] <= qp[:, :, None]) & valid[:, None, :]
    np.testing.assert_array_equal(m[:, 0], ref)
    m2 = np.asarray(position_causal_mask(jnp.asarray(qp), jnp.asarray(kp)))
    np.testing.assert_array_equal(m2[:, 0], kp[:, None, :] <= qp[:, :, None])
    # with arange positions it is the plain causal mask
    pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
    np.testing.assert_array_equal(np.asarray(position_causal_mask(pos, pos))[:, 0],
                                  np.broadcast_to(np.asarray(causal_mask(4)), (2, 4, 4)))


def test_combine_masks_is_and_ignoring_none():
    tokens = jnp.asarray([[4, 0, 2], [1, 1, 0]])
    c = causal_mask(3)
    p = padding_mask(tokens, 0)
    m = combine_masks(None, c, None, p)
    assert m.shape == (2, 1, 3, 3) and m.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(m), np.asarray(c)[None, None] & np.asarray(p))
    assert combine_masks() is None and combine_masks(None, None) is None
    assert combine_masks(None, c) is c
    a = np.random.default_rng(0).random((2, 1, 3, 3)) < 0.5
    b = np.random.default_rng(1).random((1, 2, 3, 3)) < 0.5
    np.testing.assert_array_equal(np.asarray(combine_masks(jnp.asarray(a), jnp.asarray(b), c)), a & b & np.asarray(c))
    with pytest.raises(TypeError):
        combine_masks(c, jnp.ones((3, 3), jnp.int32))


# ----------------------------------------------------------------------------- norms and activations

def np_layer_norm(x, scale, bias, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return y * (1 if scale is None else scale) + (0 if bias is None else bias)


def np_rms_norm(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * (1 if scale is None else scale)


def test_layer_norm_matches_numpy():
    x = rand(111, (2, 3, 16), scale=3.0) + 5.0
    scale, bias = rand(112, (16,)), rand(113, (16,))
    y = norms.layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), 1e-5)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np_layer_norm(x, scale, bias, 1e-5), atol=1e-5, rtol=1e-5)
    y0 = np.asarray(norms.layer_norm(jnp.asarray(x), None, None, 1e-5))
    np.testing.assert_allclose(y0, np_layer_norm(x, None, None, 1e-5), atol=1e-5)
    np.testing.assert_allclose(y0.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(y0.std(-1), 1, atol=1e-4)


def test_rms_norm_matches_numpy():
    x = rand(121, (2, 3, 16), scale=3.0)
    scale = rand(122, (16,))
    y = norms.rms_norm(jnp.asarray(x), jnp.asarray(scale), 1e-6)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np_rms_norm(x, scale, 1e-6), atol=1e-5, rtol=1e-5)
    y0 = np.asarray(norms.rms_norm(jnp.asarray(x), None))
    np.testing.assert_allclose(np.sqrt((y0 ** 2).mean(-1)), 1, atol=1e-5)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_norms_keep_low_precision_dtype(fn):
    x = rand(131, (2, 16), scale=100.0)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = norms.layer_norm(xb, None, None) if fn == "layer_norm" else norms.rms_norm(xb, None)
    assert y.dtype == jnp.bfloat16
    xr = np.asarray(xb.astype(jnp.float32))
    ref = np_layer_norm(xr, None, None, 1e-5) if fn == "layer_norm" else np_rms_norm(xr, None, 1e-6)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, atol=3e-2, rtol=2e-2)


def test_bf16_layer_norm_mean_is_float32():
    """Discriminating by construction: rows ≈ 1000 + a small spread, every value exact in bfloat16 (spacing 4 in
    [512, 1024), 8 above), whose mean is NOT representable in bfloat16. Holding the mean in bfloat16 shifts every
    output by |bf16(mean) - mean| / std, asserted >= 0.1 here, far above the bf16 output tolerance (2 ulps, 2^-7)."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(191)
    rows = []
    while len(rows) < 6:
        r = 1000.0 + 4.0 * rng.integers(-4, 5, 16)        # 984 .. 1016, exact in bf16
        mu, sd = r.mean(), r.std()
        if sd > 0 and abs(float(np.float64(mu).astype(bf16)) - mu) / sd >= 0.1:
            rows.append(r)
    x = np.stack(rows).reshape(2, 3, 16)
    np.testing.assert_array_equal(x.astype(bf16).astype(np.float64), x)                 # premise: exact inputs
    mu = x.mean(-1)
    shift = np.abs(mu.astype(bf16).astype(np.float64) - mu) / x.std(-1)
    assert (shift >= 0.1).all() and 0.1 > 4 * 2 ** -7                                   # premise: bf16 mean is off
    scale = np.array([2.0, -0.5, 1.0, 0.75] * 4)          # exact in bf16
    bias = np.array([0.5, 0.0, -1.0, 0.25] * 4)
    y = norms.layer_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale, jnp.bfloat16),
                         jnp.asarray(bias, jnp.bfloat16), 1e-5)
    assert y.dtype == jnp.bfloat16
    ref = np_layer_norm(x, scale, bias, 1e-5)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_fp16_norm_statistics_do_not_overflow(fn):
    """|x| ≈ 300: x² ≈ 9e4 overflows float16 (max 65504), so statistics held in float16 give inf (outputs 0 or
    NaN); in float32 they are finite and the output matches the float64 reference within float16 rounding."""
    rng = np.random.default_rng(201)
    x = (rng.choice([-1.0, 1.0], (2, 3, 16)) * rng.uniform(280, 320, (2, 3, 16))).astype(np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(np.square(x)).any() and np.isinf(np.square(x - x.mean(-1, keepdims=True))).any()  # premise
    xf = x.astype(np.float64)
    if fn == "layer_norm":
        y, ref = norms.layer_norm(jnp.asarray(x), None, None, 1e-5), np_layer_norm(xf, None, None, 1e-5)
    else:
        y, ref = norms.rms_norm(jnp.asarray(x), None, 1e-6), np_rms_norm(xf, None, 1e-6)
    assert y.dtype == jnp.float16
    y = np.asarray(y.astype(jnp.float32))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=2 ** -9, atol=2 ** -9)        # 2 ulps of float16 (2^-10 relative)


def test_check_grads_layer_norm_and_rms_norm():
    x = jnp.asarray(rand(141, (2, 8)))
    scale, bias = jnp.asarray(rand(142, (8,))), jnp.asarray(rand(143, (8,)))
    check_grads(jax.jit(lambda x, s, b: norms.layer_norm(x, s, b)), (x, scale, bias), order=1, modes=["rev"],
                eps=1e-2, atol=1e-2, rtol=1e-2)
    check_grads(jax.jit(lambda x, s: norms.rms_norm(x, s)), (x, scale), order=1, modes=["rev"],
                eps=1e-2, atol=1e-2, rtol=1e-2)


def test_gelu_is_float32_exact_over_its_range_and_uses_erf():
    """Exact GELU against float64 (erfc form, accurate in the tail) on [-12, 12]: error within a few float32 ulps
    of max(1, |x|), value and gradient. Catches the tanh approximation, x/2 for x/√2, a lost 0.5; and the jaxpr
    check catches a return to jax.nn.gelu(approximate=False), whose erfc XLA:CPU evaluates at ~2.7× the cost
    (ops.activations.gelu's docstring; benchmarks/results/levers.md, gelu_erf)."""
    xs = np.linspace(-12, 12, 20001).astype(np.float32)
    xd = xs.astype(np.float64)
    cdf = 0.5 * np.vectorize(math.erfc)(-xd / math.sqrt(2))
    scale = 4 * float(np.finfo(np.float32).eps) * np.maximum(1.0, np.abs(xd))
    y = np.asarray(jax.jit(activations.gelu)(jnp.asarray(xs)), np.float64)
    assert np.all(np.abs(y - xd * cdf) <= scale)
    dy = np.asarray(jax.jit(jax.grad(lambda x: activations.gelu(x).sum()))(jnp.asarray(xs)), np.float64)
    assert np.all(np.abs(dy - (cdf + xd * np.exp(-0.5 * xd ** 2) / math.sqrt(2 * math.pi))) <= scale)
    prims = {e.primitive.name for e in jax.make_jaxpr(activations.gelu)(jnp.ones(3)).jaxpr.eqns}
    assert "erf" in prims and "erfc" not in prims, prims
    assert activations.gelu(jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16


def test_activations_match_numpy():
    x = rand(151, (3, 7), scale=3.0)
    xd = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(activations.relu(jnp.asarray(x))), np.maximum(xd, 0))
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(np.asarray(activations.gelu(jnp.asarray(x))), 0.5 * xd * (1 + erf(xd / math.sqrt(2))),
                               atol=1e-6, rtol=1e-5)   # exact (erf) GELU, not the tanh approximation
    g, u = rand(152, (3, 7)), rand(153, (3, 7))
    gd = g.astype(np.float64)
    np.testing.assert_allclose(np.asarray(activations.swiglu(jnp.asarray(g), jnp.asarray(u))),
                               gd / (1 + np.exp(-gd)) * u, atol=1e-6, rtol=1e-5)
    tanh_gelu = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))   # GPT-2's gelu_new
    np.testing.assert_allclose(np.asarray(activations.gelu_tanh(jnp.asarray(x))), tanh_gelu, atol=1e-6, rtol=1e-5)
    assert np.abs(tanh_gelu - 0.5 * xd * (1 + erf(xd / math.sqrt(2)))).max() > 1e-4     # the two GELUs differ
    ud = u.astype(np.float64)
    np.testing.assert_allclose(np.asarray(activations.geglu(jnp.asarray(g), jnp.asarray(u))),
                               0.5 * gd * (1 + erf(gd / math.sqrt(2))) * ud, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(activations.geglu_tanh(jnp.asarray(g), jnp.asarray(u))),
                               0.5 * gd * (1 + np.tanh(math.sqrt(2 / math.pi) * (gd + 0.044715 * gd ** 3))) * ud,
                               atol=1e-6, rtol=1e-5)
    assert set(activations.NAMES) == {"relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh"}


# ----------------------------------------------------------------------------- EncoderBlock gradient

@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_check_grads_encoder_block_wrt_input(norm_position):
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=11, d_model=16, num_heads=4, num_kv_heads=2, d_ff=32,
                      num_decoder_layers=1, max_len=8, runtime__dropout=0.0, norm__position=norm_position,
                      positional="rope", activation="gelu")
    block = EncoderBlock(cfg, rngs=nnx.Rngs(params=0))
    x = jnp.asarray(rand(161, (1, 4, 16)))
    mask = jnp.asarray(np.array([[[[1, 1, 1, 0]]]], bool))
    pos = jnp.arange(4)[None]
    f = jax.jit(lambda x: block(x, Context(pos, mask), layer=0)[0])  # parameters are closed-over constants
    assert f(x).shape == x.shape
    check_grads(f, (x,), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- positional

def test_apply_rope_preserves_pair_norms_and_position_zero_is_identity():
    x = rand(171, (2, 5, 3, 8))
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 5)))
    y = np.asarray(positional.apply_rope(jnp.asarray(x), pos))
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # half-split convention: (x[i], x[i+H/2]) is one rotated pair, so each pair's norm is preserved too
    pair = lambda a: a[..., :4] ** 2 + a[..., 4:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair(y), pair(x), rtol=1e-4, atol=1e-5)
    y0 = positional.apply_rope(jnp.asarray(x), jnp.zeros((5,), jnp.int32))
    np.testing.assert_allclose(np.asarray(y0), x, atol=1e-7)
    assert np.abs(y - x).max() > 1e-2


def test_apply_rope_matches_numpy_and_accepts_t_positions():
    x = rand(181, (2, 4, 2, 8))
    pos = np.arange(4) + 3
    y = np.asarray(positional.apply_rope(jnp.asarray(x), jnp.asarray(pos), base=100.0))
    inv = 100.0 ** (-np.arange(0, 8, 2) / 8)
    ang = pos[:, None] * inv                               # [T,H/2]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    np.testing.assert_allclose(y, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1), atol=1e-5)
    yb = positional.apply_rope(jnp.asarray(x), jnp.broadcast_to(jnp.asarray(pos), (2, 4)), base=100.0)
    np.testing.assert_allclose(np.asarray(yb), y, atol=1e-7)
    with pytest.raises(TypeError):
        positional.apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.float32))
    with pytest.raises(ValueError):
        positional.apply_rope(jnp.zeros((1, 2, 1, 5)), jnp.arange(2))


def test_sinusoidal_table_formula_shape_dtype():
    pe = positional.sinusoidal_table(50, 16)
    assert pe.shape == (50, 16) and pe.dtype == jnp.float32
    p, i = np.arange(50)[:, None], np.arange(8)[None]
    ang = p / 10000.0 ** (2 * i / 16)
    np.testing.assert_allclose(np.asarray(pe)[:, 0::2], np.sin(ang), atol=1e-6)
    np.testing.assert_allclose(np.asarray(pe)[:, 1::2], np.cos(ang), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pe)[0, 0::2], 0)
    np.testing.assert_array_equal(np.asarray(pe)[0, 1::2], 1)
    assert positional.sinusoidal_table(7, 5).shape == (7, 5)   # odd D
    assert positional.sinusoidal_table(4, 8, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError):
        positional.sinusoidal_table(0, 8)


def test_sinusoidal_table_is_float64_accurate_at_large_positions():
    """Computed in float64 then cast: within float32 rounding of the float64 table at positions up to 10^4.

    Documented observation: a naive float32 computation (as in many reimplementations) is off by ~1e-3
    at these positions, because p·ω is rounded to float32 before sin/cos."""
    max_len, d = 10000, 32
    ours = np.asarray(positional.sinusoidal_table(max_len, d)).astype(np.float64)
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d, 2, dtype=np.float64) * (-math.log(10000.0) / d))
    ref = np.zeros((max_len, d))
    ref[:, 0::2], ref[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    err_ours = np.abs(ours - ref).max()
    assert err_ours <= 2 ** -24                    # within float32 rounding of values in [-1, 1]

    pos32 = np.arange(max_len, dtype=np.float32)[:, None]
    div32 = np.exp(np.arange(0, d, 2, dtype=np.float32) * np.float32(-math.log(10000.0) / d))
    naive = np.zeros((max_len, d), np.float32)
    naive[:, 0::2], naive[:, 1::2] = np.sin(pos32 * div32), np.cos(pos32 * div32)
    err_naive = np.abs(naive.astype(np.float64) - ref).max()
    assert err_naive > 1e-4
    assert err_ours * 100 < err_naive


def test_alibi_slopes_and_bias():
    np.testing.assert_allclose(np.asarray(positional.alibi_slopes(8)), 2.0 ** -np.arange(1, 9), rtol=1e-7)
    np.testing.assert_allclose(np.asarray(positional.alibi_slopes(4)), 2.0 ** (-2.0 * np.arange(1, 5)), rtol=1e-7)
    # non-power of two (paper's code): the 4 slopes of n=4, then every other slope of n=8
    np.testing.assert_allclose(np.asarray(positional.alibi_slopes(6)),
                               [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-7)
    qp = jnp.asarray([[2, 3]])
    kp = jnp.asarray([[0, 1, 2, 3]])
    b = np.asarray(positional.alibi_bias(2, qp, kp))
    assert b.shape == (1, 2, 2, 4) and b.dtype == np.float32
    slopes = np.asarray(positional.alibi_slopes(2))
    dist = np.abs(np.array([2, 3])[:, None] - np.arange(4)[None])
    np.testing.assert_allclose(b[0], -slopes[:, None, None] * dist[None])


def test_ops_package_exports():
    assert ops.dot_product_attention is dot_product_attention
    assert ops.causal_mask is causal_mask and ops.padding_mask is padding_mask
    assert ops.combine_masks is combine_masks and ops.position_causal_mask is position_causal_mask


def test_attention_softmax_backward_against_float64():
    """The attention's softmax (a custom VJP whose row sums are a GEMV) has softmax's gradient: vjp against the
    float64 formula w·(g − Σ w·g), with masked (most-negative) logits and a fully masked row."""
    from jaxformer.ops.attention import _softmax
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    x[0, 0, 1, 2:] = np.finfo(np.float32).min                                      # masked keys
    x[1, 2, 3, :] = np.finfo(np.float32).min                                       # a fully masked row
    g = rng.standard_normal(x.shape).astype(np.float32)
    w64 = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    w64 /= w64.sum(-1, keepdims=True)
    want = w64 * (g - (w64 * g).sum(-1, keepdims=True))
    out, vjp = jax.vjp(_softmax, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), w64, rtol=0, atol=8 * np.finfo(np.float32).eps)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(g))[0]), want, rtol=0,
                               atol=32 * np.finfo(np.float32).eps * np.abs(g).max())


def test_mean_nll_is_the_weighted_mean_cross_entropy():
    """ops.losses.mean_nll against float64 NumPy: the weights' positions only; 0 (not NaN) when none is kept."""
    from jaxformer.ops.losses import mean_nll
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(2, 5, 7)), rng.integers(0, 7, (2, 5))
    w = rng.integers(0, 2, (2, 5)).astype(float)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    got = mean_nll(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(w))
    np.testing.assert_allclose(float(got), (nll * w).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(mean_nll(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))), nll.mean(),
                               rtol=1e-5)
    assert float(mean_nll(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.zeros((2, 5)))) == 0.0
