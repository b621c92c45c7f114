"""Stability switches: final-logit soft-capping (model.logit_softcap) and PaLM's output z-loss (optim.z_loss),
against float64 NumPy written here; under jit and grad, in cached decoding, logged, refused when out of range."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import records, tiny_lm
from jaxformer.config import ConfigError, replaced
from jaxformer.nn import build_model
from jaxformer.ops.losses import token_losses
from jaxformer.train.loop import train


def _reference_losses(logits, targets, pad, z):
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    nll = log_z - np.take_along_axis(x, targets[..., None], -1)[..., 0]
    w = targets != pad
    return (((nll + z * log_z ** 2) * w).sum(), (nll * w).sum(), (log_z ** 2 * w).sum())


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_z_loss_adds_log_z_squared_per_target_token(z):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 5, 7)) * 4 + 3).astype(np.float32)       # log Z far from 0
    targets = rng.integers(1, 7, (2, 5))
    targets[1, 3:] = 0                                                           # padding: excluded
    s = jax.jit(lambda a: token_losses(a, jnp.asarray(targets), 0, 0.0, z))(jnp.asarray(logits))
    want = _reference_losses(logits, targets, 0, z)
    np.testing.assert_allclose([float(s["objective"]), float(s["nll"]), float(s["log_z2"])], want, rtol=1e-5)
    g = jax.grad(lambda a: token_losses(a, jnp.asarray(targets), 0, 0.0, z)["objective"])(jnp.asarray(logits))
    assert np.abs(np.asarray(g)[1, 3:]).max() == 0.0                              # no gradient from padding
    if z:                                                                        # the z term pulls log Z to 0
        g0 = jax.grad(lambda a: token_losses(a, jnp.asarray(targets), 0)["objective"])(jnp.asarray(logits))
        log_z = np.log(np.exp(logits[0].astype(np.float64)).sum(-1))          # d(z·logZ²)/dx sums to 2z·logZ
        np.testing.assert_allclose(np.asarray(g - g0).sum(-1)[0], 2 * z * log_z, rtol=1e-4)


def test_logit_softcap_is_cap_tanh_of_the_uncapped_logits_and_decodes_the_same(tmp_path):
    base = dataclasses.replace(tiny_lm("model.norm.position=pre", "model.runtime.dropout=0.0").model, vocab_size=20)
    capped = build_model(dataclasses.replace(base, logit_softcap=2.0), seed=3)
    plain = build_model(base, seed=3)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 20, (2, 9)))
    forward = nnx.jit(lambda m, t: m(t)[0])                  # compiled: one program per model, not op by op
    raw = np.asarray(forward(plain, tokens), np.float64)
    got = np.asarray(forward(capped, tokens))
    np.testing.assert_allclose(got, 2.0 * np.tanh(raw / 2.0), rtol=1e-5, atol=1e-6)
    assert np.abs(got).max() < 2.0 < np.abs(raw).max()
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    step_logits = nnx.jit(lambda m, t, p: m(t, p, cache=m.init_cache(2, 12), mode="prefill")[0])(capped, tokens, pos)
    np.testing.assert_allclose(np.asarray(step_logits), got, rtol=1e-5, atol=1e-6)   # the cached call: capped too
    grads = nnx.jit(nnx.grad(lambda m: m(tokens)[0].sum()))(capped)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))


def test_z_loss_is_logged_and_bad_values_are_named(tmp_path):
    train(tiny_lm("optim.z_loss=1e-3", "train.steps=2", "train.log_every=1", "train.eval_every=2",
                  "train.checkpoint_every=2"), tmp_path / "run", progress="none")
    rows = [r for r in records(tmp_path / "run") if r["split"] == "train"]
    assert rows and all(r["log_z2"] > 0 for r in rows)
    for key, value in (("model.logit_softcap", "-1.0"), ("optim.z_loss", "-0.1")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_lm(f"{key}={value}")


def _np_capped_attention(q, k, v, mask, cap, scale):
    """float64 NumPy: softmax(cap·tanh(q·kᵀ·scale / cap), masked)·v, MHA."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = cap * np.tanh(logits / cap)
    logits = np.where(mask, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", w, v), w


def test_attention_softcap_equals_numpy_and_chunked_equals_reference_with_gradients():
    from jaxformer import ops
    rng = np.random.default_rng(2)
    b, t, n, h = 2, 11, 2, 8
    q, k, v = (rng.standard_normal((b, t, n, h)).astype(np.float32) * 3 for _ in range(3))
    causal = np.tril(np.ones((t, t), bool))[None, None]
    want, want_w = _np_capped_attention(q, k, v, causal, 1.5, h ** -0.5)
    for backend in ("reference", "chunked"):
        res = ops.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(causal),
                                        backend=backend, block_size=4, softcap=1.5, return_probs=True)
        np.testing.assert_allclose(np.asarray(res.out), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(res.probs), want_w, rtol=2e-5, atol=2e-6)
    plain, _ = _np_capped_attention(q, k, v, causal, 1e9, h ** -0.5)
    assert np.abs(plain - want).max() > 1e-2                                    # the cap changes the output

    bias = jnp.asarray(rng.standard_normal((1, n, t, t)).astype(np.float32))

    def loss(backend, q, k, v, bias):
        out = ops.dot_product_attention(q, k, v, mask=jnp.asarray(causal), bias=bias, backend=backend,
                                        block_size=4, softcap=1.5).out
        return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum()
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bias)
    ref = jax.jit(jax.grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2, 3)))(*args)
    got = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2, 3)))(*args)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_attention_softcap_decodes_like_the_full_forward_and_fused_backends_refuse_it():
    from jaxformer.errors import BackendError
    from jaxformer import ops
    cfg = dataclasses.replace(tiny_lm("model.norm.position=pre", "model.runtime.dropout=0.0", "model.positional=rope",
                                      "model.attention.softcap=0.5").model, vocab_size=20)
    model = build_model(cfg, seed=1)
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 20, (2, 8)))
    full = np.asarray(model(tokens)[0])
    cache = model.init_cache(2, 8)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    first, out = model(tokens[:, :5], pos[:, :5], cache=cache, mode="prefill")
    rest = [model(tokens[:, i:i + 1], pos[:, i:i + 1], cache=out["cache"], mode="decode")[0] for i in range(5, 6)]
    np.testing.assert_allclose(np.asarray(first), full[:, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rest[0])[:, 0], full[:, 5], rtol=1e-5, atol=1e-5)
    plain = build_model(replaced(cfg, attention__softcap=0.0), seed=1)
    assert np.abs(np.asarray(plain(tokens)[0]) - full).max() > 1e-3
    with pytest.raises(BackendError, match="soft-capping"):
        x = jnp.zeros((1, 4, 2, 8))
        ops.dot_product_attention(x, x, x, backend="pallas", softcap=1.0)
    with pytest.raises(ConfigError, match="model.attention.softcap"):
        tiny_lm("model.runtime.attention_backend=pallas", "model.attention.softcap=50")


def test_a_traced_softcap_is_the_numbers_own_in_both_backends_and_zero_caps_nothing():
    """A per-layer soft-cap reaches the ops traced (`nn.per_layer`): under jit, for each backend that caps, the
    output and the q/k/v gradients with softcap a traced 1.5 equal those with the number 1.5, a traced 0 equals
    no cap (finite gradients: no 0/0 in the branch not taken), and vmap over several caps gives each cap's own."""
    from jaxformer import ops
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 8)).astype(np.float32) * 3) for _ in range(3))
    causal = jnp.asarray(np.tril(np.ones((9, 9), bool))[None, None])

    def loss(backend, cap, q, k, v):
        out = ops.dot_product_attention(q, k, v, mask=causal, backend=backend, block_size=4, softcap=cap).out
        return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum(), out

    grads = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True), static_argnums=0)
    for backend in ("reference", "chunked"):
        number = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True), static_argnums=(0, 1))
        for cap in (1.5, 0.0):
            (_, want), want_g = number(backend, cap, q, k, v)
            (_, got), got_g = grads(backend, jnp.float32(cap), q, k, v)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
            for g, w in zip(got_g, want_g):
                assert np.isfinite(np.asarray(g)).all()
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        each = jax.jit(jax.vmap(lambda c: loss(backend, c, q, k, v)[1]))(jnp.asarray([0.0, 1.5]))
        for i, cap in enumerate((0.0, 1.5)):
            np.testing.assert_allclose(np.asarray(each[i]), np.asarray(number(backend, cap, q, k, v)[0][1]),
                                       rtol=1e-5, atol=1e-5)
    from jaxformer.errors import BackendError
    with pytest.raises(BackendError, match="soft-capping"):
        jax.jit(lambda c: ops.dot_product_attention(q, k, v, backend="pallas", softcap=c).out)(jnp.float32(1.0))


def test_a_traced_logit_scale_is_the_numbers_own_and_kernels_that_need_a_constant_refuse_it():
    """A per-layer logit scale reaches the ops traced: values and q/k/v gradients equal the number's in the
    reference and chunked backends (with a soft-cap too); cudnn and pallas, whose kernels take a constant,
    refuse a traced one by name."""
    from jaxformer import ops
    from jaxformer.errors import BackendError
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 8)).astype(np.float32)) for _ in range(3))
    causal = jnp.asarray(np.tril(np.ones((9, 9), bool))[None, None])

    def loss(backend, scale, q, k, v):
        out = ops.dot_product_attention(q, k, v, mask=causal, backend=backend, block_size=4, scale=scale,
                                        softcap=2.0).out
        return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum(), out

    grads = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True), static_argnums=0)
    number = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True), static_argnums=(0, 1))
    for backend in ("reference", "chunked"):
        (_, want), want_g = number(backend, 0.7, q, k, v)
        (_, got), got_g = grads(backend, jnp.float32(0.7), q, k, v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        for g, w in zip(got_g, want_g):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(number("reference", 0.3, q, k, v)[0][1]) - np.asarray(want)).max() > 1e-3
    for backend in ("cudnn", "pallas"):
        with pytest.raises(BackendError, match="traced .per-layer. logit scale"):
            jax.jit(lambda s: ops.dot_product_attention(q, k, v, backend=backend, scale=s).out)(jnp.float32(0.5))
