"""Norm and residual variants (model.norm.position): post, pre, sandwich, deepnorm, rezero against float64
NumPy formulas written here; DeepNet's α and β; each variant under jit and grad and in cached decoding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_lm
from jaxformer.config import ConfigError, replaced
from jaxformer.nn import build_model
from jaxformer.nn.init import deepnorm
from jaxformer.nn.layers import Residual

KINDS = ("post", "pre", "sandwich", "deepnorm", "rezero")


def _ln(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps) * g + b


@pytest.mark.parametrize("kind", KINDS)
def test_each_residual_equals_its_formula(kind):
    cfg = replaced(tiny_lm().model, vocab_size=20, norm__position=kind, d_model=8, num_heads=2,
                              num_decoder_layers=6, runtime__dropout=0.0)
    res = Residual(cfg, rngs=nnx.Rngs(params=0))
    rng = np.random.default_rng(0)
    for name in ("norm", "post_norm"):                       # random scales and biases: not the identity
        if hasattr(res, name):
            getattr(res, name).scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)
            getattr(res, name).bias[...] = jnp.asarray(rng.normal(0, 0.3, 8), jnp.float32)
    if kind == "rezero":
        res.gate[...] = jnp.asarray(0.3, jnp.float32)
    w, c = rng.normal(0, 0.5, (8, 8)), rng.normal(0, 0.5, 8)
    x = rng.normal(0, 1, (2, 3, 8))
    got, _ = jax.jit(lambda m, a: m(a, lambda y: (y @ jnp.asarray(w, jnp.float32) + c, {}), None))(
        res, jnp.asarray(x, jnp.float32))
    f = lambda y: y @ w + c                                     # noqa: E731
    n1 = (lambda y: _ln(y, np.asarray(res.norm.scale[...]), np.asarray(res.norm.bias[...]))) \
        if hasattr(res, "norm") else None
    alpha = (2 * 6) ** 0.25
    want = {"post": lambda: n1(x + f(x)), "pre": lambda: x + f(n1(x)),
            "sandwich": lambda: x + _ln(f(n1(x)), np.asarray(res.post_norm.scale[...]),
                                        np.asarray(res.post_norm.bias[...])),
            "deepnorm": lambda: n1(alpha * x + f(x)), "rezero": lambda: x + 0.3 * f(x)}[kind]()
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_deepnorm_constants_and_beta_scaled_init():
    lm = replaced(tiny_lm().model, vocab_size=20, num_decoder_layers=6, norm__position="deepnorm")
    assert deepnorm(lm, "decoder") == pytest.approx((12 ** 0.25, 48 ** -0.25))
    s2s = dataclasses.replace(lm, arch="encoder_decoder", num_encoder_layers=6)
    assert deepnorm(s2s, "encoder") == pytest.approx((0.81 * (6 ** 5) ** (1 / 16), 0.87 * (6 ** 5) ** (-1 / 16)))
    assert deepnorm(s2s, "decoder") == pytest.approx((18 ** 0.25, 72 ** -0.25))
    post = nnx.state(build_model(replaced(lm, norm__position="post"), seed=0), nnx.Param)
    deep = nnx.state(build_model(lm, seed=0), nnx.Param)
    blk = lambda s, *k: np.asarray(s["decoder"]["layers"]["blocks"][k[0]][k[1]][...])     # noqa: E731
    beta = 48 ** -0.25
    for scaled in (("self_attn", "wv"), ("self_attn", "wo"), ("ffn", "w1"), ("ffn", "w2")):
        np.testing.assert_allclose(blk(deep, *scaled), beta * blk(post, *scaled), rtol=1e-6)
    for kept in (("self_attn", "wq"), ("self_attn", "wk")):
        np.testing.assert_array_equal(blk(deep, *kept), blk(post, *kept))


def test_an_encoder_decoders_deepnorm_gives_each_stack_its_own_alpha_and_beta():
    """N = 2 encoder and M = 3 decoder layers (N != M, so that swapping them shows): encoder
    α = 0.81·(N⁴M)^(1/16), β = 0.87·(N⁴M)^(−1/16); decoder α = (3M)^¼, β = (12M)^(−¼), read off one encoder
    block and one decoder block as built: α of each residual, β as the ratio of the v, o and FFN weights to
    post-LN's from the same keys (q and k unscaled). Whole models: tests/test_train_pins.py (slow)."""
    from helpers import tiny_reverse
    from jaxformer.nn.layers import DecoderBlock, EncoderBlock
    n, m = 2, 3
    want = {"encoder": (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)),
            "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25)}
    deep = dataclasses.replace(tiny_reverse("model.norm.position=deepnorm", f"model.num_encoder_layers={n}",
                                            f"model.num_decoder_layers={m}").model, vocab_size=20)
    make = {"encoder": lambda c: EncoderBlock(c, rngs=nnx.Rngs(0)),
            "decoder": lambda c: DecoderBlock(c, cross=True, rngs=nnx.Rngs(0))}
    residuals = {"encoder": ("res_attn", "res_ffn"), "decoder": ("res_self", "res_cross", "res_ffn")}
    for stack, (alpha, beta) in want.items():
        block, post = make[stack](deep), make[stack](replaced(deep, norm__position="post"))
        for r in residuals[stack]:
            assert getattr(block, r).alpha == pytest.approx(alpha, rel=1e-12), (stack, r)
        attn = ("self_attn", "cross_attn") if stack == "decoder" else ("self_attn",)
        w = lambda b, sub, name: np.asarray(getattr(getattr(b, sub), name)[...])     # noqa: E731
        for sub, name in [(a, x) for a in attn for x in ("wv", "wo")] + [("ffn", "w1"), ("ffn", "w2")]:
            np.testing.assert_allclose(w(block, sub, name), beta * w(post, sub, name), rtol=1e-6,
                                       err_msg=f"{stack} {sub}.{name}")
        for sub, name in [(a, x) for a in attn for x in ("wq", "wk")]:
            np.testing.assert_array_equal(w(block, sub, name), w(post, sub, name), err_msg=f"{stack} {sub}.{name}")
    assert abs(want["encoder"][0] - want["decoder"][0]) > 0.1 and abs(want["encoder"][1] - want["decoder"][1]) > 0.1


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in ("post", "pre", "sandwich") else k
                                  for k in KINDS])  # post, pre: everywhere; sandwich: its formula test stays
def test_each_variant_decodes_like_the_full_forward_and_has_gradients(kind):
    cfg = replaced(tiny_lm("model.positional=rope", "model.runtime.dropout=0.0").model, vocab_size=20,
                              norm__position=kind, num_decoder_layers=2)
    model = build_model(cfg, seed=1)
    if kind == "rezero":                                   # from 0 every block is the identity: move off it
        model.decoder.layers.blocks.res_self.gate[...] = jnp.full((2,), 0.5)
        model.decoder.layers.blocks.res_ffn.gate[...] = jnp.full((2,), -0.7)
    tokens = jnp.asarray(np.random.default_rng(4).integers(1, 20, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

    @nnx.jit                                              # one program, not the calls op by op
    def both(m, tokens, pos):
        first, out = m(tokens[:, :6], pos[:, :6], cache=m.init_cache(2, 7), mode="prefill")
        last, _ = m(tokens[:, 6:], pos[:, 6:], cache=out["cache"], mode="decode")
        return m(tokens)[0], jnp.concatenate([first, last], 1)
    full, cached = both(model, tokens, pos)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-5, atol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m: m(tokens)[0].mean()))(model)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    if kind == "rezero":
        assert np.abs(np.asarray(grads.decoder.layers.blocks.res_ffn.gate[...])).max() > 0


def test_rezero_starts_as_the_identity_and_bad_placements_are_named():
    cfg = replaced(tiny_lm("model.runtime.dropout=0.0").model, vocab_size=20, norm__position="rezero",
                              num_decoder_layers=2, norm__final=False, tie_embeddings=True, scale_embeddings=False,
                              positional="none")
    model = build_model(cfg, seed=2)
    tokens = jnp.asarray([[3, 4, 5]])
    emb = np.asarray(model.embed.tokens[...])
    np.testing.assert_allclose(np.asarray(model(tokens)[0])[0], emb[[3, 4, 5]] @ emb.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="model.norm.position='middle'"):
        tiny_lm("model.norm.position=middle")
