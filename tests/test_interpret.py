"""Research instruments (`jaxformer.interpret`): the logit lens, head ablation and a linear probe, each against an
independent computation (activation patching: tests/test_patching.py).

Wrong implementations these catch: a lens read before each layer instead of after it, or past the final norm
(row l compared with the same weights cut to l layers); an ablation table with layers and heads swapped or the
wrong head zeroed (compared with zeroing that head's slice of the output projection), or a mean ablation that
averages each position apart instead of over the batch and positions; a probe fitted on its test rows (random labels would
then be learned).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError
from jaxformer.interpret import head_ablation, linear_probe, logit_lens
from jaxformer.ops.losses import mean_nll as token_losses
from jaxformer.nn import build_model

L, N = 3, 4
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 10)))
TARGETS = jnp.roll(TOKENS, -1, axis=1)


def lm(layers=L, **kw):
    kw = {"norm__position": "pre", **kw}
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=40, d_model=32, num_heads=N, num_kv_heads=2,
                   d_ff=48, num_decoder_layers=layers, max_len=16, positional="rope", activation="swiglu",
                   runtime__dropout=0.0, **kw)
    return build_model(cfg)


def _first_layers(m, k):
    """The same weights cut to the first k layers (stacked params [L, ...] sliced)."""
    cut = lm(layers=k, norm__position=m.cfg.norm.position)
    graph, state = nnx.split(cut)
    full = nnx.state(m)
    sliced = jax.tree.map(lambda a, b: a[:k] if a.ndim == b.ndim and a.shape[0] == L and b.shape[0] == k
                          and a.shape != b.shape else a, full, state)
    return nnx.merge(graph, sliced)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_logit_lens_row_l_is_the_model_cut_after_l_layers(position):
    m = lm(norm__position=position)
    lens = logit_lens(m, TOKENS)
    assert lens.shape == (L + 1, 2, 10, 40)
    np.testing.assert_allclose(lens[L], m(TOKENS)[0], rtol=1e-5, atol=1e-5)
    for k in (1, 2):
        np.testing.assert_allclose(lens[k], _first_layers(m, k)(TOKENS)[0], rtol=1e-4, atol=1e-4)
    head = m.embed.head_fn()
    x = m(TOKENS, capture=("embed",))[1]["captured"]["embed"]
    want = head(m.decoder.final_norm(x)) if m.decoder.final_norm is not None else head(x)
    np.testing.assert_allclose(lens[0], want, rtol=1e-5, atol=1e-5)


def test_head_ablation_is_zeroing_that_heads_output_projection():
    m = lm()
    table = head_ablation(m, TOKENS, targets=TARGETS)
    assert table.shape == (L, N)
    clean = token_losses(m(TOKENS)[0], TARGETS)
    for layer, head in ((0, 3), (2, 1)):
        cut = nnx.clone(m)
        wo = cut.decoder.layers.blocks.self_attn.wo
        wo.set_value(wo[...].at[layer, head].set(0.0))                        # wo [L,N,H,D]
        assert float(table[layer, head]) == pytest.approx(float(token_losses(cut(TOKENS)[0], TARGETS) - clean),
                                                         abs=2e-5)
    assert len(np.unique(np.round(np.asarray(table), 6))) == L * N              # every cell its own head
    mean = head_ablation(m, TOKENS, targets=TARGETS, how="mean")
    assert not np.allclose(mean, table, atol=1e-4)
    # how="mean": the head's output replaced by one vector, its mean over the batch and the positions
    layer, head = 1, 2
    z = np.asarray(m(TOKENS, capture=("z",))[1]["captured"]["z"], np.float64)      # [L,B,T,N,H]
    fill = jnp.asarray(z[layer, :, :, head].mean((0, 1)), jnp.float32)
    ablated = m(TOKENS, patch={"z": lambda v, i: jnp.where(i == layer, v.at[:, :, head].set(fill), v)})[0]
    assert float(mean[layer, head]) == pytest.approx(float(token_losses(ablated, TARGETS) - clean), abs=2e-5)
    with pytest.raises(ConfigError, match="how='max'"):
        head_ablation(m, TOKENS, targets=TARGETS, how="max")


def test_an_encoder_decoders_three_head_tables_zero_their_own_output_projections():
    """site="encoder.z" / "cross_z" / "z": each cell equals zeroing that head's slice of the encoder's
    self-attention, the decoder's cross-attention or its self-attention output projection (a table read from
    the wrong stack, or the wrong layer count, fails)."""
    cfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=40, d_model=32, num_heads=N, d_ff=48,
                   num_encoder_layers=2, num_decoder_layers=3, max_len=16, norm__position="pre",
                   runtime__dropout=0.0)
    m = build_model(cfg)
    src = TOKENS[:, ::-1]
    clean = token_losses(m(src, TOKENS)[0], TARGETS)
    for site, layers, path in (("encoder.z", 2, ("encoder", "self_attn")), ("cross_z", 3, ("decoder", "cross_attn")),
                               ("z", 3, ("decoder", "self_attn"))):
        table = head_ablation(m, src, TOKENS, targets=TARGETS, site=site)
        assert table.shape == (layers, N), site
        layer, head = layers - 1, 2
        cut = nnx.clone(m)
        wo = getattr(getattr(cut, path[0]).layers.blocks, path[1]).wo
        wo.set_value(wo[...].at[layer, head].set(0.0))
        assert float(table[layer, head]) == pytest.approx(float(token_losses(cut(src, TOKENS)[0], TARGETS) - clean),
                                                         abs=2e-5), site
    with pytest.raises(ConfigError, match="site='cross_z' is not a head-wise site of this model"):
        head_ablation(lm(), TOKENS, targets=TARGETS, site="cross_z")


def test_linear_probe_is_ridge_regression_scored_on_held_out_rows():
    rng = np.random.default_rng(0)
    r, d, k = 400, 48, 3              # 48 features, 120 training rows: a probe can fit noise it cannot predict
    labels = rng.integers(0, k, r)
    centers = rng.standard_normal((k, d)) * 0.5
    informative = centers[labels] + rng.standard_normal((r, d))
    noise = rng.standard_normal((r, d))
    train = np.arange(r) < 120
    acc = np.asarray(linear_probe(jnp.asarray(np.stack([informative, noise]), jnp.float32), jnp.asarray(labels),
                                  jnp.asarray(train), l2=1e-3))
    x = informative
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
    xs = np.concatenate([(x - mu) / sd, np.ones((r, 1))], 1)
    pen = 1e-3 * 120 * np.eye(d + 1)
    pen[-1, -1] = 0
    w = np.linalg.solve(xs[train].T @ xs[train] + pen, xs[train].T @ np.eye(k)[labels[train]])
    ref = np.mean(np.argmax(xs[~train] @ w, 1) == labels[~train])
    assert acc[0] == pytest.approx(ref, abs=1e-6) and ref > 0.8
    assert acc[1] < 0.45                                              # chance is 1/3: nothing to read
