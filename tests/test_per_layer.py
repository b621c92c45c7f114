"""Per-layer settings (`nn.per_layer`): NoPE layers (model.rope.nope_every), every k-th self-attention layer
without RoPE (SmolLM3, Llama 4), computed from the layer index every block is given, in the scanned stack and in
cached decoding alike.

Sliding windows (model.attention.windows): a pattern repeated over the layers, each layer's attention masked to
its own window.

Wrong implementations these tests catch: every layer skipping RoPE, or none; the NoPE layers counted from 0
(layers 0, k, 2k: SmolLM3 drops layers k-1, 2k-1, ...); RoPE skipped on q but not k (or k only); cached decoding
told another layer's index (the cached logits then differ from the uncached call's); an encoder stack left
rotating; a NoPE model exported as a plain Llama (`jaxformer.hf.expressing` compares every field); a window
pattern whose last entry extends over the remaining layers instead of repeating.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.nn import build_model, per_layer
from helpers import cached_and_full

V = 17


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="decoder_only", num_encoder_layers=0, vocab_size=V, d_model=16, num_heads=2, d_ff=32,
                num_decoder_layers=4, max_len=16, positional="rope", norm__position="pre", runtime__dropout=0.0)
    return replaced(ModelConfig(), **{**base, **kw})


def test_the_nope_layers_are_the_kth_counted_from_one():
    """nope_every=k: layers k-1, 2k-1, ... skip RoPE (SmolLM3's `(layer_idx + 1) % interval != 0` rotates); 0:
    every layer rotates (settings say None: nothing to select)."""
    cfg = _cfg(rope__nope_every=2)
    assert [bool(per_layer.settings(cfg, i).rope) for i in range(4)] == [True, False, True, False]
    assert [bool(per_layer.settings(cfg, jnp.int32(i)).rope) for i in range(4)] == [True, False, True, False]
    assert per_layer.settings(_cfg(), 1).rope is None


def test_every_layer_nope_is_the_model_without_positions():
    """nope_every=1 (no layer rotates) is, on the same weights, the model with positional='none'; nope_every=2
    is neither it nor the plain RoPE model."""
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 1, V)
    logits = {k: np.asarray(build_model(_cfg(**kw), seed=1)(tokens)[0]) for k, kw in (
        ("none", dict(positional="none")), ("all", dict(rope__nope_every=1)), ("half", dict(rope__nope_every=2)),
        ("rope", {}))}
    np.testing.assert_allclose(logits["all"], logits["none"], rtol=1e-5, atol=1e-5)
    for other in ("none", "rope"):
        assert not np.allclose(logits["half"], logits[other], atol=1e-3), other


def test_a_nope_layer_leaves_q_and_k_unrotated_and_a_rope_layer_rotates_both():
    """Layer by layer, the q and k sites of nope_every=2 are the rotated projections of the layer's input at
    layers 0 and 2, the projections themselves at layers 1 and 3 (q and k alike)."""
    from jaxformer.ops import positional
    model = build_model(_cfg(rope__nope_every=2), seed=2)
    tokens = jax.random.randint(jax.random.key(3), (1, 6), 1, V)
    pos = jnp.arange(6)[None]
    _, out = model(tokens, capture=("attn_in", "q", "k"))
    got = out["captured"]
    for i in range(4):
        attn = model.decoder.layers.layer(i).self_attn
        q, kv = attn.project_q(got["attn_in"][i]), attn.project_kv(got["attn_in"][i])
        for name, plain in (("q", q), ("k", kv.k)):
            want = plain if i % 2 else positional.apply_rope(plain, pos, 10000.0)
            np.testing.assert_allclose(np.asarray(got[name][i]), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} of layer {i}")


@pytest.mark.parametrize("windows, layers, want", [((3, 0), 4, (3, 0, 3, 0)), ((2, 0, 4), 6, (2, 0, 4, 2, 0, 4))])
def test_each_layer_attends_within_its_own_window_of_the_repeated_pattern(windows, layers, want):
    """model.attention.windows is a pattern repeated over the layers: each layer's captured attention pattern puts
    weight on exactly the keys its window allows (a NumPy causal mask with q − k < w, w = 0 global): none beyond
    it, some on every key within it (a softmax). Catches a pattern whose last entry extends over the remaining
    layers ((3, 0) over 4 layers as 3, 0, 0, 0), and layers that read another layer's window."""
    t = 8
    model = build_model(_cfg(num_decoder_layers=layers, attention__windows=windows), seed=6)
    tokens = jax.random.randint(jax.random.key(5), (2, t), 1, V)
    pattern = np.asarray(model(tokens, capture=("pattern",))[1]["captured"]["pattern"], np.float64)  # [L,B,N,T,S]
    assert pattern.shape == (layers, 2, 2, t, t)
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    for i, w in enumerate(want):
        visible = (k <= q) & ((q - k < w) | (w == 0))
        np.testing.assert_array_equal(pattern[i] > 0, np.broadcast_to(visible, pattern[i].shape),
                                      err_msg=f"layer {i}, window {w}")
        np.testing.assert_allclose(pattern[i].sum(-1), 1.0, rtol=1e-5)


def test_cached_decoding_of_nope_layers_equals_the_uncached_call():
    """A prompt prefilled then decoded a token at a time gives the uncached call's logits with NoPE layers and
    windows together (a decoding layer told another's index rotates where the scan did not)."""
    cfg = _cfg(rope__nope_every=2, attention__windows=(3, 0))
    model = build_model(cfg, seed=4)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
    got, want, _ = cached_and_full(model, tokens, 3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_an_encoder_decoder_drops_rope_in_both_stacks():
    """Both stacks' self-attentions follow nope_every (their own layer indices): with nope_every=1 the
    encoder-decoder is, on the same weights, the one with positional='none'."""
    kw = dict(arch="encoder_decoder", num_encoder_layers=2, num_decoder_layers=2)
    src = jax.random.randint(jax.random.key(0), (2, 5), 1, V)
    tgt = jax.random.randint(jax.random.key(1), (2, 4), 1, V)
    a = build_model(_cfg(**kw, rope__nope_every=1), seed=5)(src, tgt)[0]
    b = build_model(_cfg(**kw, positional="none"), seed=5)(src, tgt)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, field", [(dict(rope__nope_every=-1), "model.rope.nope_every=-1"),
                                       (dict(rope__nope_every=2, positional="learned"), "model.rope.nope_every=2")])
def test_bad_nope_settings_are_named(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _cfg(**kw)


@pytest.mark.parametrize("setting", ["softcap", "scale"])
def test_a_per_layer_rule_gives_each_layer_its_own_softcap_or_scale(monkeypatch, setting):
    """A rule that gives each layer its own soft-cap (0 = none) or logit scale reaches each layer's attention
    traced: layer i of the rule's model computes what layer i of a model with that number in its config computes
    (model.attention.softcap=c_i; model.attention.scale_dim=d_i for the scale 1/√d_i; the same weights), in the
    scan and in cached decoding."""
    from jaxformer.nn.inputs import decoder_self_mask
    from jaxformer.nn.layers import Context
    values = {"softcap": (2.0, 0.0, 0.5), "scale": (0.5, 0.25, 0.125)}[setting]
    fields = {"softcap": lambda c: {"attention__softcap": c}, "scale": lambda c: {"attention__scale_dim": round(c ** -2)}}
    rule = ModelConfig.per_layer
    monkeypatch.setattr(ModelConfig, "per_layer", lambda self, stack="decoder": {
        **rule(self, stack), setting: values})
    cfg = _cfg(num_decoder_layers=3)
    model = build_model(cfg, seed=7)
    tokens = jax.random.randint(jax.random.key(3), (2, 6), 1, V)
    logits, out = model(tokens, capture=("resid_pre", "resid_post"))
    pre, post = out["captured"]["resid_pre"], out["captured"]["resid_post"]
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    monkeypatch.setattr(ModelConfig, "per_layer", rule)
    for i, c in enumerate(values):                     # layer i alone, its number in its config, on its input
        fixed = build_model(replaced(cfg, **fields[setting](c)), seed=7)
        ctx = Context(positions=positions, mask=decoder_self_mask(fixed.cfg, positions, positions),
                      valid=jnp.ones((2, 6), bool))
        got = fixed.decoder.layers.layer(i)(pre[i], ctx, layer=i).x
        np.testing.assert_allclose(np.asarray(got), np.asarray(post[i]), rtol=1e-5, atol=1e-5, err_msg=f"layer {i}")
    uncapped = build_model(cfg, seed=7)(tokens)[0]                      # the rule changes what the model computes
    assert np.abs(np.asarray(uncapped) - np.asarray(logits)).max() > 1e-3
    monkeypatch.setattr(ModelConfig, "per_layer", lambda self, stack="decoder": {
        **rule(self, stack), setting: values})
    got, want, _ = cached_and_full(build_model(cfg, seed=7), tokens, 3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
