"""µP (`jaxformer.mup`): at its base width µP is SP bit for bit; away from it each rule is what the table says,
checked on the model's own captured activations (embedding multiplier √D₀, attention logits · √H₀/H, output
logits / m) and on one optimizer update (hidden matrices' Adam step / m, the rest unchanged); the coordinate
check separates them: SP's activations grow with width after a few Adam steps, µP's stay flat.

Wrong implementations these catch: µP's learning-rate factor on every parameter (the embedding's update would
shrink too) or on none; the output multiplier m instead of 1/m; the attention scale 1/H without √H₀ (not SP at
the base width) or left at 1/√H; an embedding multiplier that still grows as √D; an untied head under
runtime.init=pytorch at SP's fan-in (the width) instead of the base width's; a base width that changes a
model under SP.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import tiny_lm, tiny_reverse
from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError
from jaxformer.mup import slopes, verdict
from jaxformer.nn import build_model
from jaxformer.train.step import init_state, make_train_step

D0, M = 16, 4


def _cfg(d=D0 * M, par="mup", base=D0, *extra):
    return tiny_lm("model.vocab_size=40", f"model.d_model={d}", f"model.d_ff={2 * d}", "model.num_heads=2",
                   "model.num_decoder_layers=2", "model.positional=rope", "model.norm.position=pre",
                   "model.tie_embeddings=false", f"model.parametrization={par}",
                   f"model.base_width={base if par == 'mup' else 0}", "model.runtime.dropout=0.0", *extra)


def _batch(seed=0, rows=8, t=12):
    x = jax.random.randint(jax.random.key(seed), (rows, t + 1), 1, 40)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def test_mup_at_its_base_width_is_sp_bit_for_bit():
    sp, mup = _cfg(D0, "sp"), _cfg(D0, "mup", D0)
    assert mup.model.width_mult == 1.0
    states = []
    for cfg in (sp, mup):
        graphs, state = init_state(cfg)
        step = make_train_step(graphs, cfg)
        for i in range(3):
            state, _ = step(state, _batch(i), jax.random.key(0))
        states.append(state["model"])
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_mup_rule_on_the_models_own_activations():
    """Embedding × √D₀ from an N(0, 1/D₀) table; attention probabilities softmax(q·k · √H₀/H); logits = the
    head's input · W / m."""
    cfg = _cfg()
    model = build_model(cfg.model)
    x = _batch()["inputs"]
    logits, aux = model(x, capture=("embed", "q", "k", "pattern", "final_norm"))
    cap = aux["captured"]
    table = model.embed.tokens[...]
    assert float(jnp.std(table)) == pytest.approx(D0 ** -0.5, rel=0.05)
    np.testing.assert_allclose(cap["embed"], table[x] * math.sqrt(D0), rtol=1e-6)
    h, h0 = cfg.model.head_size, D0 // 2
    q, k = cap["q"][0].astype(jnp.float32), cap["k"][0].astype(jnp.float32)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * math.sqrt(h0) / h
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    want = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    np.testing.assert_allclose(cap["pattern"][0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, cap["final_norm"] @ model.embed.head[...] / M, rtol=1e-5, atol=1e-6)
    # the untied readout starts as at the base width (microsoft/mup's MuReadout: SP's init × √m), not SP's 1/√D
    assert float(jnp.std(model.embed.head[...])) == pytest.approx(D0 ** -0.5, rel=0.05)


def test_mup_untied_head_under_pytorch_init_is_the_base_widths_kaiming_uniform():
    """runtime.init=pytorch: SP's untied head is PyTorch's nn.Linear(D, V) default, kaiming-uniform(a=√5) =
    U(±1/√D); µP's MuReadout multiplies SP's init by √m (m = D/D₀), i.e. U(±1/√D₀): the same bound at every
    width (measured on built models at m = 2 and 4, std 1/√(3·D₀), none past the bound), while SP's shrinks
    as 1/√D. Catches µP's head taking SP's fan-in (the model width D) instead of the base width's."""
    def head(d, par):
        cfg = _cfg(d, par, D0, "model.runtime.init=pytorch").model
        return np.asarray(build_model(cfg).embed.head[...], np.float64)
    for m in (2, 4):
        d = D0 * m
        for par, fan_in in (("mup", D0), ("sp", d)):
            w = head(d, par)
            bound = 1.0 / math.sqrt(fan_in)                           # U(-b, b): std b/√3
            assert np.abs(w).max() <= bound * (1 + 1e-6), (par, d)
            assert np.abs(w).max() > 0.95 * bound, (par, d)             # thousands of draws reach near the bound
            assert w.std() == pytest.approx(bound / math.sqrt(3.0), rel=0.05), (par, d)


def test_mup_scales_a_tied_head_too():
    """A tied head reads the embedding table (N(0, 1/D₀) under µP) and its logits are × 1/m like an untied one's."""
    cfg = _cfg(D0 * M, "mup", D0, "model.tie_embeddings=true")
    model = build_model(cfg.model)
    logits, aux = model(_batch()["inputs"], capture=("final_norm",))
    table = model.embed.tokens[...]
    np.testing.assert_allclose(logits, aux["captured"]["final_norm"] @ table.T / M, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ffn", [(), pytest.param(("model.ffn=moe", "model.moe.num_experts=4", "model.moe.top_k=2"),
                                                  marks=pytest.mark.slow)], ids=["dense", "moe"])    # ~4 s each
def test_mup_scales_the_hidden_matrices_updates_by_one_over_m(ffn):
    """One step of the same gradients: µP's update of an attention or FFN matrix (an expert's too) and of the
    MoE router (its fan-in is the width: its logits sum over it) is SP's / m; of the embedding, the head and
    the norms, SP's."""
    ups = {}
    for par in ("sp", "mup"):
        cfg = _cfg(D0 * M, par, D0, *ffn, "optim.weight_decay=0.0")    # the head's init differs (µP's readout)
        graphs, state = init_state(cfg)
        model = nnx.merge(graphs.model, state["model"])
        opt = nnx.merge(graphs.opt, state["opt"])
        grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, nnx.state(model, nnx.Param))
        before = nnx.state(model, nnx.Param)
        before = jax.tree.map(lambda a: np.asarray(a), before)
        opt.update(model, grads)
        ups[par] = jax.tree.map(lambda a, b: np.asarray(a) - b, nnx.state(model, nnx.Param), before)
    flat_sp, flat_mup = nnx.to_flat_state(ups["sp"]), nnx.to_flat_state(ups["mup"])
    seen, routers = set(), 0
    for (path, a), (_, b) in zip(flat_sp, flat_mup):
        name = "/".join(str(p) for p in path)
        hidden = any(w in name for w in ("/wq", "/wk", "/wv", "/wo", "/w1", "/w2", "/wg", "/router"))
        seen.add(hidden)
        routers += "/router" in name
        np.testing.assert_allclose(b[...], a[...] / (M if hidden else 1), rtol=1e-5, atol=1e-7, err_msg=name)
    assert seen == {True, False} and routers == (1 if ffn else 0)


def test_every_matrix_whose_fan_in_grows_with_the_width_is_hidden():
    """The default lane's cheap check of the slow MoE case above: µP scales an update by 1/m where a parameter is
    marked hidden (`nn.params.param`), so every matrix whose fan-in is D or F, the MoE router and the experts
    included, is marked, and the embedding, the head and the norms are not."""
    cfg = _cfg(D0 * M, "mup", D0, "model.ffn=moe", "model.moe.num_experts=4", "model.moe.top_k=2").model
    flat = nnx.to_flat_state(nnx.state(build_model(cfg), nnx.Param))
    marks = {"/".join(str(p) for p in path): bool(v.get_metadata().get("hidden")) for path, v in flat}
    for name, hidden in marks.items():
        want = any(w in name for w in ("/wq", "/wk", "/wv", "/wo", "/w1", "/w2", "/wg", "/router"))
        assert hidden == want, name
    assert any("/router" in n for n in marks) and any("/w1" in n for n in marks)


def test_mup_refuses_what_it_does_not_cover():
    with pytest.raises(ConfigError, match="model.base_width=32 means nothing"):
        tiny_lm("model.base_width=32")
    with pytest.raises(ConfigError, match="optim.name='sgd'"):
        _cfg(64, "mup", 16, "optim.name=sgd")
    with pytest.raises(ConfigError, match="model.parametrization='mop'"):
        tiny_lm("model.parametrization=mop")


def test_an_export_refuses_mup_away_from_its_base_width():
    """No transformers config has µP's multipliers: exporting would write another model. At its base width µP
    is SP, and exports as such."""
    from jaxformer.hf import HFError
    from jaxformer.hf.expressing import check_family, family_for
    llama = ("model.norm.type=rmsnorm", "model.activation=swiglu", "model.use_bias=false",
             "model.scale_embeddings=false")
    with pytest.raises(HFError, match="model.parametrization='mup' .a llama config gives 'sp'"):
        check_family(_cfg(64, "mup", 16, *llama).model, "llama")
    base = _cfg(D0, "mup", D0, *llama).model
    assert family_for(base) == "llama"
    check_family(base, "llama")


def test_verdict_is_decided_by_the_slopes():
    widths = [64, 128, 256]
    grow = {"widths": widths, "sites": ["a", "b"], "sp": {"a": [[1, 2, 4]], "b": [[1, 1, 1]]},
            "mup": {"a": [[1, 1.05, 1.1]], "b": [[2, 2, 2]]}}
    assert slopes(grow, "sp")["a"] == pytest.approx(1.0) and slopes(grow, "mup")["b"] == pytest.approx(0.0)
    assert verdict(grow, "sp").startswith("grows (steepest: a, slope +1.00")
    assert verdict(grow, "mup").startswith("flat")


def test_the_optimum_and_its_shift_from_a_grid_of_learning_rates():
    """A loss that is a parabola in log2 lr: the vertex through the best grid point and its neighbours is exact;
    a best rate at the grid's edge is unbracketed (±inf); the shift of a parabola moved by one factor of 2 is −1,
    its bootstrap interval excludes 0, and a width against itself gives 0; the other width may have its own grid."""
    from jaxformer.mup import lr_optimum, optimum_shift, shift_text, transfer_verdict
    lrs = [2.0 ** k for k in range(-3, 4)]
    rng = np.random.default_rng(0)
    curve = lambda c, noise: [[(math.log2(lr) - c) ** 2 + 2.0 + noise * rng.standard_normal() for lr in lrs]  # noqa: E731
                              for _ in range(3)]
    assert lr_optimum(lrs, curve(0.3, 0.0)) == pytest.approx(0.3)
    assert lr_optimum(lrs, curve(-2.9, 0.0)) == -np.inf and lr_optimum(lrs, curve(5.0, 0.0)) == np.inf
    unfinished = np.asarray(curve(0.3, 0.0))
    unfinished[1:, 3] = np.nan                                      # two seeds of one rate still running
    assert lr_optimum(lrs, unfinished) == pytest.approx(0.3)
    unfinished[:, 2] = np.nan                                       # the best rate's neighbour: no run yet
    assert np.isnan(lr_optimum(lrs, unfinished)) and np.isnan(lr_optimum(lrs, np.full((3, 7), np.nan)))
    base, moved = curve(0.4, 0.05), curve(-0.6, 0.05)
    shift, lo, hi = optimum_shift(lrs, base, moved, n=500)
    assert shift == pytest.approx(-1.0, abs=0.15) and lo < shift < hi < -0.5
    same = optimum_shift(lrs, base, base, n=500)
    assert same[0] == 0.0 and same[1] < 0 < same[2]
    # another width on its own, shorter grid: a bracketed optimum is still exact; a best rate at the edge of a grid
    # that stops short counts with the range it can lie in (beyond the edge's neighbour), not as a point at ±inf
    near = [2.0 ** k for k in (-2, -1, 0, 1)]
    own = lambda c: [[(math.log2(lr) - c) ** 2 for lr in near]] * 3          # noqa: E731
    assert optimum_shift(lrs, base, own(-0.6), n=200, other_lrs=near)[0] == pytest.approx(-1.0, abs=0.15)
    low = [2.0 ** k for k in (-3, -2, -1)]
    below = optimum_shift(lrs, base, [[(math.log2(lr) + 5) ** 2 for lr in low]] * 3, n=200, other_lrs=low)
    assert below[0] == -np.inf and below[1] == -np.inf and below[2] == pytest.approx(-2.0 - 0.4, abs=0.2)
    assert transfer_verdict(*below[1:]) == "does not hold"
    assert shift_text(*below) == f"below its grid [-inf, {below[2]:+.2f}]"
    assert shift_text(-0.456, -0.68, -0.3) == "-0.46 [-0.68, -0.30]" and shift_text(np.nan, np.nan, np.nan) == "not measured"
    rising = optimum_shift(lrs, base, [[(math.log2(lr) - 5) ** 2 for lr in low]] * 3, n=200, other_lrs=low)
    assert rising[0] == np.inf and rising[1] == pytest.approx(-2.0 - 0.4, abs=0.2) and rising[2] == np.inf
    assert transfer_verdict(*rising[1:]) == "not resolved"          # above −2.4 factors of 2: anything from there
    assert transfer_verdict(-0.3, 0.2) == "holds" and transfer_verdict(-1.2, -0.7) == "does not hold"
    assert transfer_verdict(-np.inf, -np.inf) == "does not hold" and transfer_verdict(-np.inf, 0.1) == "not resolved"
    assert transfer_verdict(float("nan"), 0.1) == "not resolved"


@pytest.mark.slow          # 2 parametrizations × 3 widths × 4 steps of a 2-layer model (~40 s)
def test_mup_check_flat_under_mup_growing_under_sp(tmp_path, capsys):
    import json
    from helpers import ROOT
    args = ["mup-check", str(ROOT / "configs/alice.py"), "--set", "model.norm.position=pre",     # built-in text
            "--set", "optim.lr=0.01", "--set", "model.d_ff=128", "--widths", "64", "128", "256", "--steps", "4",
            "--out", str(tmp_path)]
    assert cli_main(args) == 0
    r = json.loads((tmp_path / "mup_check.json").read_text())
    assert r["verdict"]["mup"].startswith("flat") and r["verdict"]["sp"].startswith("grows"), r["verdict"]
    assert max(r["slopes"]["sp"].values()) > 0.5
    assert (tmp_path / "mup_check.png").read_bytes()[:4] == b"\x89PNG"
    assert "µP: flat" in capsys.readouterr().out
    assert cli_main(["mup-check", str(ROOT / "configs/alice.py"), "--widths", "30", "64"]) != 0
    captured = capsys.readouterr()
    assert "mup-check width 30 is not a multiple of model.num_heads=4" in captured.out + captured.err


@pytest.mark.slow          # 2 parametrizations × 2 widths × 2 steps (~10 s); the site's sizes: tests/test_r4_inputs.py
def test_the_coordinate_checks_logit_update_is_what_training_moved_the_correct_logit():
    """mup-check's learned site: 0 at initialisation, then |z_t − z_0| of the correct token's logit on the
    first batch, which Adam's first step moves (a measure from the previous step, or of |z_t|, would not be 0
    at step 0 or would not grow from it)."""
    from jaxformer.mup import LEARNED, coord_check
    r = coord_check(tiny_lm("model.vocab_size=0", "data.batch_size=2", "data.block_size=8"), (D0, 2 * D0), steps=2)
    for par in ("sp", "mup"):
        first, second, third = r[par][LEARNED]
        assert first == [0.0, 0.0] and all(0 < a < b for a, b in zip(second, third)), r[par][LEARNED]


def test_the_coordinate_check_plot_draws_every_site_and_step_against_width(tmp_path, monkeypatch):
    """`mup.plot` (mup-check's mup_check.png): SP's panels above µP's, one per site, titled; in each, one line of
    mean |x| against width per step (x log base 2, y log), markers, a colour from blue (step 0) to red (the last);
    grids on both tick sets; the width label under the bottom row, the size label left of the first column, the
    steps' legend in the top-right panel; the title gives the learning rate and each verdict's first word. The
    figure is checked as drawn, not its PNG (savefig intercepted). `log2_widths`: the doubling widths."""
    from matplotlib.figure import Figure
    from jaxformer.mup import log2_widths, plot
    assert log2_widths(8, 64) == (8, 16, 32, 64) and log2_widths(8, 100) == (8, 16, 32, 64)
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    widths = [8, 16, 32]
    result = {"widths": widths, "steps": 2, "sites": ["embed", "logits", "memory"], "lr": 0.01,   # SP's embed
              "sp": {"embed": [[1, 2, 4], [1.5, 3, 6], [2, 4, 8]], "logits": [[1, 1, 1]] * 3,     # grows, µP's
                     "memory": [[2, 2, 2]] * 3},                                                  # stay flat
              "mup": {"embed": [[1, 1.01, 1.02]] * 3, "logits": [[3, 3, 3], [2, 2, 2], [1, 1, 1]],
                      "memory": [[1, 1, 1]] * 3}}
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: saved.append((self, path, kw)))
    plot(result, tmp_path / "check.png")
    (fig, path, kw), = saved
    assert path == tmp_path / "check.png" and kw == {"dpi": 80} and list(fig.get_size_inches()) == [9.0, 5.4]
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    assert fig._suptitle.get_text() == "coordinate check at lr 0.01: SP grows, µP flat"
    assert fig._suptitle.get_fontsize() == 10
    assert len(fig.axes) == 6
    for i, ax in enumerate(fig.axes):
        par, site = ("sp", "mup")[i // 3], result["sites"][i % 3]
        assert ax.get_title() == f"{'µP' if par == 'mup' else 'SP'}: {site}" and ax.title.get_fontsize() == 9
        assert (ax.get_xscale(), ax.xaxis.get_transform().base, ax.get_yscale()) == ("log", 2, "log")
        lines = ax.get_lines()
        assert [list(x.get_xdata()) for x in lines] == [widths] * 3
        assert [list(x.get_ydata()) for x in lines] == result[par][site]
        assert [x.get_label() for x in lines] == ["step 0", "step 1", "step 2"]
        assert all((x.get_marker(), x.get_markersize(), x.get_linewidth()) == ("o", 3, 1.2) for x in lines)
        assert [x.get_color() for x in lines] == [(0.15, 0.3, 0.6), (0.5, 0.3, 0.6), (0.85, 0.3, 0.6)]
        for ticks in (ax.xaxis.get_major_ticks(), ax.yaxis.get_minor_ticks()):
            assert ticks and all(t.gridline.get_visible() and t.gridline.get_alpha() == 0.3 for t in ticks)
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("width D" if i >= 3 else "", "mean |x|" if i % 3 == 0 else "")
        assert all(label.get_fontsize() == 8 for label in (ax.xaxis.label, ax.yaxis.label) if label.get_text())
        legend = ax.get_legend()
        assert (legend is not None) == (i == 2)
    texts = fig.axes[2].get_legend().get_texts()
    assert [t.get_text() for t in texts] == ["step 0", "step 1", "step 2"] and texts[0].get_fontsize() == 6
    one = {"widths": [8, 16], "steps": 1, "sites": ["embed"], "lr": 0.1,               # one site, one step
           "sp": {"embed": [[1, 2], [1, 2]]}, "mup": {"embed": [[1, 1], [1, 1]]}}
    plot(one, tmp_path / "one.png")
    fig = saved[-1][0]
    assert [ax.get_title() for ax in fig.axes] == ["SP: embed", "µP: embed"]
    assert [x.get_color() for x in fig.axes[0].get_lines()] == [(0.15, 0.3, 0.6), (0.85, 0.3, 0.6)]


def test_the_verdict_names_the_steepest_site_its_direction_and_whether_the_slope_has_an_interval():
    """`mup.verdict`: the site of the largest |slope|; "flat" up to ±FLAT inclusive (a slope of exactly 0.15 is
    flat), "grows" or "shrinks" past it; from two widths it says the slope is a line through two points."""
    shrinking = {"widths": [8, 16, 32], "sites": ["a", "b"], "sp": {"a": [[1.0, 1.0, 1.0]], "b": [[4.0, 2.0, 1.0]]}}
    assert verdict(shrinking, "sp") == "shrinks (steepest: b, slope -1.00 per log width; flat is within ±0.15)"
    growing = {"widths": [8, 16], "sites": ["a"], "sp": {"a": [[1.0, 2.0]]}}
    assert verdict(growing, "sp") == ("grows (steepest: a, slope +1.00 per log width; flat is within ±0.15; from 2 "
                                      "widths: a line through two points, with no interval (give 3 or more widths "
                                      "for one))")
    edge = {"widths": [1, 4], "sites": ["a"], "sp": {"a": [[1.0, 4.0 ** 0.15]]}}
    assert slopes(edge, "sp")["a"] == 0.15 and verdict(edge, "sp").startswith("flat (steepest: a, slope +0.15")


def test_the_optimum_is_the_vertex_numpy_fits_through_the_best_rate_and_its_neighbours():
    """On an uneven grid of rates (log2 steps of 1.5, 0.5, 2, ...) and losses that are no parabola: the vertex of
    numpy's degree-2 fit through the best mean loss and its two neighbours, wherever the best sits (next to
    either edge too); grids scored together (`_optima`, the bootstrap's resamples) as each alone; no numpy
    warning from the grids whose best is at an edge (their vertex is not read)."""
    import warnings
    from jaxformer.mup import _optima, lr_optimum
    x = np.array([-3.0, -1.5, -1.0, 1.0, 1.5, 4.0])
    lrs = list(2.0 ** x)
    grids = [np.abs(x - c) ** 1.5 + 0.1 * np.sin(3 * x) for c in (-1.6, -0.9, 0.8, 1.6)]   # best at 1, 2, 3, 4
    for y in grids:
        i = int(np.argmin(y))
        a, b, _ = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
        assert lr_optimum(lrs, [y, y]) == pytest.approx(-b / (2 * a), rel=1e-9, abs=1e-12)
    stacked = np.stack([[y] * 2 for y in grids] + [[np.full(6, 2.0)] * 2])       # [R=5, seeds, rates]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        together = _optima(lrs, stacked)
        assert lr_optimum(lrs, [np.full(6, 2.0)]) == -np.inf                # flat: the lowest rate is the best
    assert list(together) == [lr_optimum(lrs, g) for g in stacked]


def test_widths_must_be_positive():
    with pytest.raises(ConfigError, match=r"widths=\[0, 8\]: give at least two distinct positive widths"):
        slopes({"widths": [8, 0], "sites": ["a"], "sp": {"a": [[1.0, 1.0]]}}, "sp")
    with pytest.raises(ConfigError, match="positive"):
        slopes({"widths": [-2, 8], "sites": ["a"], "sp": {"a": [[1.0, 1.0]]}}, "sp")
    assert slopes({"widths": [1, 2], "sites": ["a"], "sp": {"a": [[1.0, 2.0]]}}, "sp")["a"] == pytest.approx(1.0)


def test_shift_text_and_the_transfer_verdict_at_their_edges():
    """An optimum above its grid is written so; the verdict's tolerance is inclusive (a shift interval reaching
    exactly ±0.5 holds), and an interval that only touches the far side of it is not resolved."""
    from jaxformer.mup import shift_text, transfer_verdict
    assert shift_text(np.inf, -2.4, np.inf) == "above its grid [-2.40, +inf]"
    assert transfer_verdict(-0.5, 0.5) == "holds"
    assert transfer_verdict(-1.0, -0.5) == transfer_verdict(0.5, 1.0) == "not resolved"
    assert transfer_verdict(-1.0, -0.51) == transfer_verdict(0.51, 1.0) == "does not hold"


def test_the_shift_interval_is_the_bootstraps_2_5_and_97_5_percent_order_statistics(monkeypatch):
    """optimum_shift's interval: the 2.5% lower and 97.5% higher order statistics of the resampled shifts (each
    draw's other-width optimum minus its base optimum), by default over 2000 draws from seed 0 (reproducible).
    The resampler is replaced by one whose k-th draw puts the other width's optimum at k/100 and the base's at
    0, so the shifts are known."""
    from jaxformer import mup
    lrs = list(2.0 ** np.arange(-3.0, 4.0))
    x = np.log2(lrs)
    at = lambda c: np.array([(x - c) ** 2])                                 # noqa: E731  one seed, vertex c
    n = 200

    def fake(y, groups):
        k = iter(range(10 ** 6))
        moved = y[0][3] != at(0.0)[0][3]                                   # the other width's grid
        return lambda rng: (None, at((next(k) % n) / 100 if moved else 0.0))
    monkeypatch.setattr(mup, "resampler", fake)
    shift, lo, hi = mup.optimum_shift(lrs, at(0.0), at(0.37), n=n)
    shifts = np.sort(np.arange(n) / 100)
    assert shift == pytest.approx(0.37)
    assert lo == pytest.approx(shifts[int(np.floor(0.025 * (n - 1)))])    # 0.04
    assert hi == pytest.approx(shifts[int(np.ceil(0.975 * (n - 1)))])     # 1.95
    monkeypatch.undo()
    c = np.random.default_rng(0).normal(0.0, 0.3, (2, 8))                   # each of 8 seeds its own optimum
    base, moved = [[(v - 0.4 - d) ** 2 for v in x] for d in c[0]], [[(v + 0.6 - d) ** 2 for v in x] for d in c[1]]
    default = mup.optimum_shift(lrs, base, moved)
    assert default == mup.optimum_shift(lrs, base, moved) == mup.optimum_shift(lrs, base, moved, n=2000, seed=0)
    assert default != mup.optimum_shift(lrs, base, moved, n=2000, seed=1)
    assert default != mup.optimum_shift(lrs, base, moved, n=2001, seed=0)


def test_the_sizes_call_the_model_with_the_batchs_positions_and_segments():
    """`_forward_args`: a language model's batch -> (inputs,), its positions and segment ids by the model's own
    keyword names; an encoder-decoder's -> (src, tgt_in), each side's positions and segment ids."""
    import inspect
    from jaxformer.mup import _forward_args
    from jaxformer.nn import build_model
    lm = {"inputs": "I", "positions": "P", "segment_ids": "S", "targets": "T"}
    assert _forward_args(lm) == (("I",), {"positions": "P", "segment_ids": "S"})
    ed = {"src": "s", "tgt_in": "t", "src_positions": "sp", "src_segment_ids": "ss", "tgt_positions": "tp",
          "tgt_segment_ids": "ts", "tgt_out": "o"}
    assert _forward_args(ed) == (("s", "t"), {"src_positions": "sp", "src_segment_ids": "ss", "tgt_positions": "tp",
                                              "tgt_segment_ids": "ts"})
    for cfg, kw in ((tiny_lm(), lm), (tiny_reverse(), ed)):
        params = inspect.signature(type(nnx.eval_shape(lambda: build_model(cfg.model))).__call__).parameters
        assert set(_forward_args(kw)[1]) <= set(params)
