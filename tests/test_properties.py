"""Property-based tests (hypothesis) of the models and positional encodings.

Axis legend: B batch, T target/query length, S source length, D width, N heads, K kv heads, V vocab.
Models are tiny (D=16, N=4, F=32, L=2, V=17), built once per module and jitted once per shape; all
forward passes are deterministic (dropout=0, no dropout rng).
"""
from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

from jaxformer import ops
from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import Transformer, TransformerLM, build_model
from jaxformer.nn.layers import Context
from jaxformer.ops import positional

V, D, N, F, L = 17, 16, 4, 32, 2
B, T, S = 2, 8, 7
PAD = 0

COMMON = dict(vocab_size=V, d_model=D, num_heads=N, d_ff=F, max_len=16, runtime__dropout=0.0, pad_id=PAD)
LM_CONFIGS = {
    "rope-pre": dict(positional="rope", norm__position="pre", num_kv_heads=2),
    "alibi-post": dict(positional="alibi", norm__position="post", norm__type="rmsnorm", activation="gelu"),
    "learned-pre": dict(positional="learned", norm__position="pre", norm__type="rmsnorm", activation="swiglu",
                        num_kv_heads=1, tie_embeddings=False),
    "sinusoidal-post": dict(positional="sinusoidal", norm__position="post"),
}
ED_CONFIGS = {
    "ed-sinusoidal-post": dict(positional="sinusoidal", norm__position="post"),
    "ed-rope-pre": dict(positional="rope", norm__position="pre", num_kv_heads=2, norm__type="rmsnorm",
                        activation="swiglu"),
}
# Examples per property. Each example after the first costs milliseconds (one compiled program per config and
# shape), so the count is about coverage of the drawn inputs, not time. The "ci" profile (tests/conftest.py)
# supplies derandomize, deadline and database; these decorators set only max_examples.
SETTINGS = settings(max_examples=12)


def positions_of(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def segments(tokens):
    """The drawn arrays' padding as segment ids (1 = a real token, 0 = id 0 here): what a batch carries."""
    return (tokens != PAD).astype(jnp.int32)


def explicit(src, tgt):
    """An encoder-decoder call's attention inputs for drawn arrays: segment ids, positions 0..T-1."""
    return {"src_segment_ids": segments(src), "tgt_segment_ids": segments(tgt), "src_positions": positions_of(src),
            "tgt_positions": positions_of(tgt)}


class LM:
    """A TransformerLM split into (graphdef, state) with two jitted pure functions over it: the forward pass, and
    one analysis program (logits as a function of the input embeddings, and their Jacobian) compiled once per
    config and shared by every gradient property."""

    def __init__(self, name):
        self.cfg = replaced(ModelConfig(), arch="decoder_only", num_decoder_layers=L, **COMMON, **LM_CONFIGS[name])
        model = build_model(self.cfg, seed=1)
        assert isinstance(model, TransformerLM)
        self.model = model
        gd, self.state = nnx.split(model)

        def forward(state, tokens, positions):        # the drawn arrays' padding (id 0), said explicitly
            return nnx.merge(gd, state)(tokens, positions=positions, segment_ids=segments(tokens))[0]

        def analyze(state, tokens, w):
            """-> (logits [B,T,V] as TransformerLM.__call__ but a function of the input embeddings x [B,T,D],
            J [B,T,B,T,D] = d (logits · w)[b, t] / d x[b', t', :])."""
            m = nnx.merge(gd, state)
            pos, seg = positions_of(tokens), segments(tokens)
            mask = ops.position_causal_mask(pos, pos, seg != 0, q_segments=seg, k_segments=seg)
            from_x = lambda x: m.embed.logits(m.decoder(x, Context(pos, mask))[0])  # noqa: E731
            x = m.embed(tokens, pos)
            return from_x(x), jax.jacrev(lambda x: from_x(x) @ w)(x)

        self._forward = jax.jit(forward)
        self._analyze = jax.jit(analyze)

    def __call__(self, tokens, positions=None):
        tokens = jnp.asarray(tokens)
        positions = positions_of(tokens) if positions is None else jnp.asarray(positions, jnp.int32)
        return np.asarray(self._forward(self.state, tokens, positions))

    def analyze(self, tokens, w):
        logits, jac = self._analyze(self.state, jnp.asarray(tokens), w)
        return np.asarray(logits), np.asarray(jac)


class ED:
    """An encoder-decoder Transformer split into (graphdef, state) with two jitted pure functions: the forward
    pass, and one analysis program (compiled once per config, shared by the source and target properties)."""

    def __init__(self, name):
        self.cfg = replaced(ModelConfig(), arch="encoder_decoder", num_encoder_layers=L, num_decoder_layers=L, **COMMON,
                               **ED_CONFIGS[name])
        model = build_model(self.cfg, seed=2)
        assert isinstance(model, Transformer)
        self.model = model
        gd, self.state = nnx.split(model)

        def forward(state, src, tgt):
            return nnx.merge(gd, state)(src, tgt, **explicit(src, tgt))[0]

        def analyze(state, src, tgt, w, noise):
            """As Transformer.__call__, but a function of the source embeddings xs [B,S,D] and the decoder input
            embeddings y [B,T,D]. -> (logits [B,T,V], logits with xs replaced by `noise` at pad sources,
            d(logits·w)/dxs [B,T,B,S,D], d(logits·w)/dy [B,T,B,T,D])."""
            m = nnx.merge(gd, state)
            ps, pt, ss, st_ = positions_of(src), positions_of(tgt), segments(src), segments(tgt)
            src_mask = ops.segment_mask(ss, ss)
            tgt_mask = ops.position_causal_mask(pt, pt, st_ != 0, q_segments=st_, k_segments=st_)

            def from_xy(xs, y):
                memory = m.encoder(xs, Context(ps, src_mask)).x
                out = m.decoder(y, Context(pt, tgt_mask, memory=memory, memory_mask=ops.segment_mask(st_, ss)))
                return m.embed.logits(out.x)

            xs, y = m.embed(src, ps), m.embed(tgt, pt)
            jxs, jy = jax.jacrev(lambda xs, y: from_xy(xs, y) @ w, argnums=(0, 1))(xs, y)
            perturbed = from_xy(jnp.where((src == PAD)[..., None], noise, xs), y)
            return from_xy(xs, y), perturbed, jxs, jy

        self._forward = jax.jit(forward)
        self._analyze = jax.jit(analyze)

    def __call__(self, src, tgt):
        return np.asarray(self._forward(self.state, jnp.asarray(src), jnp.asarray(tgt)))

    def analyze(self, src, tgt, w, noise=None):
        noise = jnp.zeros((B, S, D), jnp.float32) if noise is None else jnp.asarray(noise)
        return tuple(np.asarray(a) for a in self._analyze(self.state, jnp.asarray(src), jnp.asarray(tgt), w, noise))


@functools.lru_cache(maxsize=None)
def lm(name) -> LM:
    return LM(name)


@functools.lru_cache(maxsize=None)
def ed(name) -> ED:
    return ED(name)


def token_arrays(shape, pad_weight=True):
    """Integer token arrays with pads (id 0) appearing often."""
    elem = st.one_of(st.just(PAD), st.integers(1, V - 1)) if pad_weight else st.integers(1, V - 1)
    return hnp.arrays(np.int32, shape, elements=elem)


def assert_causal_gradient_pattern(mag, toks):
    """mag [B,T,B,T]: |d out[b,t] / d in[b2,t2]|. Zero across rows, from the future and from earlier pads;
    positive on the residual path (t2 == t) and from every visible (non-pad, earlier) token. A padding query
    (segment 0) sees no key: only its own residual path."""
    for b in range(B):
        for t in range(T):
            for b2 in range(B):
                for t2 in range(T):
                    hidden = t2 < t and (toks[b, t2] == PAD or toks[b, t] == PAD)
                    if b2 != b or t2 > t or hidden:
                        assert mag[b, t, b2, t2] == 0, (b, t, b2, t2)
                    else:
                        assert mag[b, t, b2, t2] > 0, (b, t, b2, t2)


def readout(seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(V), jnp.float32)


# ----------------------------------------------------------------------------- (a) causality: decoder-only

@pytest.mark.parametrize("name", list(LM_CONFIGS))
def test_lm_past_tokens_do_influence_later_logits(name):
    """Sanity for the causality properties below: the model is not constant in its inputs."""
    m = lm(name)
    tokens = np.arange(1, T + 1)[None].repeat(B, 0).astype(np.int32)
    other = tokens.copy()
    other[:, 0] = 9
    a, b = m(tokens), m(other)
    assert a.shape == (B, T, V) and a.dtype == np.float32
    assert np.isfinite(a).all()
    assert np.abs(a[:, -1] - b[:, -1]).max() > 1e-4


@pytest.mark.parametrize("name", list(LM_CONFIGS))
@SETTINGS
@given(tokens=token_arrays((B, T)), other=token_arrays((B, T)), t=st.integers(0, T - 1))
def test_lm_future_tokens_never_change_past_logits(name, tokens, other, t):
    m = lm(name)
    changed = tokens.copy()
    changed[:, t + 1:] = other[:, t + 1:]
    a, b = m(tokens), m(changed)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(b[:, : t + 1], a[:, : t + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(LM_CONFIGS))
@SETTINGS
@given(tokens=token_arrays((B, T)), seed=st.integers(0, 2 ** 16))
def test_lm_logit_gradients_wrt_future_and_pad_embeddings_are_exactly_zero(name, tokens, seed):
    """J[b,t,b',t'] = d(logits·w)[b,t]/dx[b',t'] is exactly 0 for t' > t, for b' != b, and for pad keys t' < t;
    it is non-zero for the position itself and for visible (non-pad, earlier) keys."""
    m = lm(name)
    logits, jac = m.analyze(tokens, readout(seed))
    np.testing.assert_allclose(logits, m(tokens), atol=1e-5)
    assert jac.shape == (B, T, B, T, D)
    assert_causal_gradient_pattern(np.abs(jac).max(-1), tokens)


# ----------------------------------------------------------------------------- (a) causality: encoder-decoder

@pytest.mark.parametrize("name", list(ED_CONFIGS))
@SETTINGS
@given(src=token_arrays((B, S)), tgt=token_arrays((B, T)), other=token_arrays((B, T)), t=st.integers(0, T - 1))
def test_ed_future_target_tokens_never_change_past_logits(name, src, tgt, other, t):
    m = ed(name)
    changed = tgt.copy()
    changed[:, t + 1:] = other[:, t + 1:]
    a, b = m(src, tgt), m(src, changed)
    assert a.shape == (B, T, V) and np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(b[:, : t + 1], a[:, : t + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(ED_CONFIGS))
@SETTINGS
@given(src=token_arrays((B, S)), tgt=token_arrays((B, T)), seed=st.integers(0, 2 ** 16))
def test_ed_decoder_gradients_wrt_future_target_embeddings_are_exactly_zero(name, src, tgt, seed):
    m = ed(name)
    logits, _, _, jac = m.analyze(src, tgt, readout(seed))
    np.testing.assert_allclose(logits, m(src, tgt), atol=1e-5)
    assert jac.shape == (B, T, B, T, D)
    assert_causal_gradient_pattern(np.abs(jac).max(-1), tgt)                                 # [B,T,B,T]


def test_ed_past_target_and_source_do_influence_logits():
    m = ed("ed-sinusoidal-post")
    src = np.arange(1, S + 1)[None].repeat(B, 0).astype(np.int32)
    tgt = np.arange(2, T + 2)[None].repeat(B, 0).astype(np.int32)
    a = m(src, tgt)
    t2 = tgt.copy()
    t2[:, 0] = 11
    s2 = src.copy()
    s2[:, -1] = 11
    assert np.abs(m(src, t2)[:, -1] - a[:, -1]).max() > 1e-4
    assert np.abs(m(s2, tgt) - a).max() > 1e-4


# ----------------------------------------------------------------------------- (b) padding

@st.composite
def right_padded_sources(draw):
    lengths = draw(st.lists(st.integers(1, S), min_size=B, max_size=B))
    body = draw(token_arrays((B, S), pad_weight=False))
    for b, n in enumerate(lengths):
        body[b, n:] = PAD
    return body


@pytest.mark.parametrize("name", list(ED_CONFIGS))
@SETTINGS
@given(src=token_arrays((B, S)), tgt=token_arrays((B, T)), seed=st.integers(0, 2 ** 16))
def test_ed_source_pad_positions_never_influence_logits(name, src, tgt, seed):
    """Whatever vector sits at a padded source position (the pad embedding or arbitrary noise), the logits are
    unchanged, and their gradient with respect to it is exactly zero. A real target sees every real source
    token; a padding target (segment 0) sees none."""
    m = ed(name)
    noise = 30.0 * np.random.default_rng(seed).standard_normal((B, S, D)).astype(np.float32)
    base, perturbed, jac, _ = m.analyze(src, tgt, readout(seed), noise)
    np.testing.assert_allclose(base, m(src, tgt), atol=1e-5)
    np.testing.assert_allclose(perturbed, base, rtol=0, atol=1e-6)
    assert jac.shape == (B, T, B, S, D)
    mag = np.abs(jac).max(-1)                                                                  # [B,T,B,S]
    for b in range(B):
        for b2 in range(B):
            for s in range(S):
                real_t = tgt[b] != PAD
                if b2 != b or src[b2, s] == PAD:
                    assert (mag[b, :, b2, s] == 0).all(), (b, b2, s)
                else:
                    assert (mag[b, real_t, b2, s] > 0).all() and (mag[b, ~real_t, b2, s] == 0).all(), (b, b2, s)


@pytest.mark.parametrize("name", list(ED_CONFIGS))
@settings(max_examples=10)
@given(src=right_padded_sources(), tgt=token_arrays((B, T)), extra=st.sampled_from([1, 3]))
def test_ed_appending_source_padding_never_changes_logits(name, src, tgt, extra):
    m = ed(name)
    longer = np.concatenate([src, np.full((B, extra), PAD, np.int32)], axis=1)
    np.testing.assert_allclose(m(longer, tgt), m(src, tgt), rtol=1e-5, atol=1e-5)


@st.composite
def left_pad_cases(draw):
    k = draw(st.integers(1, T - 1))
    seq = draw(token_arrays((B, T - k), pad_weight=False))
    return k, seq


@pytest.mark.parametrize("name", list(LM_CONFIGS))
@SETTINGS
@given(case=left_pad_cases())
def test_lm_left_padding_with_shifted_positions_matches_right_padding(name, case):
    """TransformerLM's docstring: left-padded rows with shifted positions work unchanged. A sequence right-padded
    (default positions) and the same sequence left-padded (positions 0.. starting at the first real token, pads
    at position 0) give the same logits at the real tokens."""
    k, seq = case
    m = lm(name)
    pads = np.full((B, k), PAD, np.int32)
    right = np.concatenate([seq, pads], 1)
    left = np.concatenate([pads, seq], 1)
    left_pos = np.concatenate([np.zeros((B, k), np.int32), np.arange(T - k, dtype=np.int32)[None].repeat(B, 0)], 1)
    a = m(right)[:, : T - k]
    b = m(left, left_pos)
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b[:, k:], a, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- (c) sinusoidal shift = rotation

@functools.lru_cache(maxsize=None)
def sin_table(d):
    return np.asarray(positional.sinusoidal_table(1024, d)).astype(np.float64)


def shift_matrix(k, d):
    """M_k [D,D]: block-diagonal 2x2 rotations acting on (sin(pω_i), cos(pω_i)) pairs; independent of p."""
    omega = np.exp(np.arange(0, d, 2) * (-np.log(10000.0) / d))
    m = np.zeros((d, d))
    for i, w in enumerate(omega):
        c, s = np.cos(k * w), np.sin(k * w)
        # sin((p+k)w) = sin(pw) cos(kw) + cos(pw) sin(kw);  cos((p+k)w) = cos(pw) cos(kw) - sin(pw) sin(kw)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, s
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = -s, c
    return m


@settings(max_examples=20)
@given(k=st.integers(0, 600), d=st.sampled_from([16, 32]))
def test_sinusoidal_shift_is_a_fixed_linear_map(k, d):
    pe = sin_table(d)
    mk = shift_matrix(k, d)
    np.testing.assert_allclose(mk @ mk.T, np.eye(d), atol=1e-12)                 # a rotation
    n = pe.shape[0] - k
    np.testing.assert_allclose(pe[:n] @ mk.T, pe[k:k + n], rtol=0, atol=2e-6)      # PE(p+k) = M_k PE(p), all p
    if k > 0:
        assert np.abs(pe[:n] - pe[k:k + n]).max() > 1e-3                           # and M_k is not the identity


# ----------------------------------------------------------------------------- (d) RoPE relative positions

@settings(max_examples=20)
@given(seed=st.integers(0, 2 ** 16), offset=st.integers(-64, 256), base=st.sampled_from([100.0, 10000.0]))
def test_rope_scores_depend_only_on_position_difference(seed, offset, base):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    pq = rng.integers(64, 128, (1, 6))
    pk = rng.integers(64, 128, (1, 6))

    def scores(pq, pk):
        rq = positional.apply_rope(jnp.asarray(q), jnp.asarray(pq, jnp.int32), base)
        rk = positional.apply_rope(jnp.asarray(k), jnp.asarray(pk, jnp.int32), base)
        return np.asarray(jnp.einsum("btnh,bsnh->bnts", rq, rk))

    a, b = scores(pq, pk), scores(pq + offset, pk + offset)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    if offset != 0:   # and they do depend on the difference: shifting only the keys changes them
        assert np.abs(scores(pq, pk + offset) - a).max() > 1e-3


@pytest.mark.parametrize("name", ["rope-pre", "alibi-post"])
@SETTINGS
@given(tokens=token_arrays((B, T)), offset=st.integers(1, 200))
def test_relative_position_lms_are_invariant_to_a_global_position_shift(name, tokens, offset):
    m = lm(name)
    pos = np.arange(T, dtype=np.int32)[None].repeat(B, 0)
    np.testing.assert_allclose(m(tokens, pos + offset), m(tokens), rtol=1e-4, atol=1e-4)


def test_absolute_position_lm_is_not_shift_invariant():
    """Contrast for the test above (so that it can fail): learned positions change with a shift."""
    m = lm("learned-pre")
    tokens = np.arange(1, T + 1)[None].repeat(B, 0).astype(np.int32)
    pos = np.arange(T, dtype=np.int32)[None].repeat(B, 0)
    assert np.abs(m(tokens, pos + 3) - m(tokens)).max() > 1e-4


# ----------------------------------------------------------------------------- (e) attention never NaN

@functools.lru_cache(maxsize=None)
def attention_and_grads(dtype):
    def f(q, k, v, mask, bias, ct):
        def loss(q, k, v):
            out = ops.dot_product_attention(q, k, v, mask=mask, bias=bias).out
            return jnp.sum(out.astype(jnp.float32) * ct), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    return jax.jit(f)


@settings(max_examples=25)
@given(mask=hnp.arrays(np.bool_, (2, 4, 4, 5)),
       dead=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 3)), max_size=4),
       seed=st.integers(0, 2 ** 16), scale=st.sampled_from([1.0, 30.0]), bias_scale=st.sampled_from([0.0, 1e4]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_attention_output_and_grads_never_nan_for_any_mask(mask, dead, seed, scale, bias_scale, dtype):
    mask = mask.copy()
    for b, n, t in dead:
        mask[b, n, t] = False                       # force some all-False rows
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((2, 4, 4, 8)) * scale, dt)
    k = jnp.asarray(rng.standard_normal((2, 5, 2, 8)) * scale, dt)
    v = jnp.asarray(rng.standard_normal((2, 5, 2, 8)), dt)
    bias = jnp.asarray(rng.standard_normal((1, 4, 4, 5)) * bias_scale, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((2, 4, 4, 8)), jnp.float32)
    out, (gq, gk, gv) = attention_and_grads(dtype)(q, k, v, jnp.asarray(mask), bias, ct)
    out = np.asarray(out.astype(jnp.float32))
    gq = np.asarray(gq.astype(jnp.float32))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    for g in (gq, gk, gv):
        assert np.isfinite(np.asarray(g.astype(jnp.float32))).all()
    dead_rows = ~mask.any(-1)                       # [B,N,T]
    for b, n, t in zip(*np.nonzero(dead_rows)):
        assert (out[b, t, n] == 0).all()
        assert (gq[b, t, n] == 0).all()
    if dtype == "float32" and bias_scale == 0.0:
        np.testing.assert_allclose(out, ref_attention(np.asarray(q), np.asarray(k), np.asarray(v), mask),
                                   rtol=1e-4, atol=1e-4)


def ref_attention(q, k, v, mask):
    """NumPy float64 masked softmax attention with GQA (kv heads repeated); dead rows give zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    mx = logits.max(-1, keepdims=True)
    e = np.where(mask, np.exp(logits - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    w = e / np.where(den > 0, den, 1.0)
    return np.einsum("bnts,bsnh->btnh", w, v)


@pytest.mark.parametrize("name", ["rope-pre", "sinusoidal-post"])
def test_lm_all_pad_rows_give_finite_logits_and_grads(name):
    """Every query of an all-pad row is fully masked: finite logits and finite, zero cross-row gradients."""
    m = lm(name)
    tokens = np.zeros((B, T), np.int32)
    tokens[1] = np.arange(1, T + 1)
    assert np.isfinite(m(tokens)).all()
    logits, jac = m.analyze(tokens, readout(0))
    assert np.isfinite(logits).all() and np.isfinite(jac).all()
    mag = np.abs(jac).max(-1)
    off_diag = ~np.eye(T, dtype=bool)
    assert (mag[0, :, 0][off_diag] == 0).all() and (mag[0, :, 1] == 0).all()


# ----------------------------------------------------------------------------- (f) jit == op by op
# The compiled program against the same model run op by op with jit disabled: the layer scans become Python
# loops and no op is fused, so the two share only the ops' definitions (which tests/test_ops.py checks against
# float64 NumPy): a model that reads Python state at trace time, or whose scan carry is wrong, differs here.

@settings(max_examples=4)      # each example runs op by op (~0.5 s)
@given(tokens=token_arrays((B, T)))
def test_lm_jit_equals_eager(tokens):
    m = lm("rope-pre")
    with jax.disable_jit():
        x = jnp.asarray(tokens)
        eager = np.asarray(m.model(x, positions=positions_of(x), segment_ids=segments(x))[0])
    np.testing.assert_allclose(m(tokens), eager, rtol=1e-5, atol=1e-5)
    assert np.isfinite(eager).all()


def test_ed_jit_equals_eager():
    """One example only: an op-by-op encoder-decoder call takes seconds on CPU."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, V, (B, S)).astype(np.int32)
    tgt = rng.integers(0, V, (B, T)).astype(np.int32)
    src[0, -2:] = PAD
    tgt[1, -3:] = PAD
    m = ed("ed-sinusoidal-post")
    with jax.disable_jit():
        eager = np.asarray(m.model(jnp.asarray(src), jnp.asarray(tgt), **explicit(jnp.asarray(src),
                                                                                 jnp.asarray(tgt)))[0])
    assert np.isfinite(eager).all()
    np.testing.assert_allclose(m(src, tgt), eager, rtol=1e-5, atol=1e-5)
