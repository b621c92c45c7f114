"""The patching grid in one program and attribution patching (`jaxformer.patching`), against independent
computations: the grid against a Python loop of single patches (each written as an index assignment, one call per
cell), attribution against the derivative of each single patch by its own scalar (and by central differences)
and against real patching where the metric is linear in the site.

Wrong implementations these catch: cells patched at every layer or position at once, or with the corrupted run's
own value; layers and heads swapped, or a pattern's query axis taken for its head axis; a grid that is not
normalised by the clean − corrupt difference, or (grid or attribution) by its absolute value (the sign lost where
the corruption raises the metric); an attribution with the gradient at the clean run, without the (clean − corrupt)
factor, or summed over the wrong axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError, DataError
from jaxformer.nn import build_model
from jaxformer.patching import attribution_patching, patching_grid

L, N, T = 2, 4, 6
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, T)))
C = 3                                                          # the corrupted position
CORRUPT = TOKENS.at[:, C].set((TOKENS[:, C] + 7) % 40)
RIGHT, WRONG = int(TOKENS[0, -1]), int(TOKENS[0, -1] + 1) % 40


def metric(logits):
    return jnp.mean(logits[:, -1, RIGHT] - logits[:, -1, WRONG])


def lm(**kw):
    kw = {"norm__position": "pre", **kw}
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=40, d_model=32, num_heads=N, num_kv_heads=2,
                   d_ff=48, num_decoder_layers=L, max_len=16, positional="rope", runtime__dropout=0.0, **kw)
    return build_model(cfg, seed=1)


@pytest.fixture(scope="module")
def model():
    return lm()


def _index(site, p, h):
    """The cell (position p, head h; None = all) of one layer's value, as an index tuple."""
    every = slice(None)
    if site.endswith("pattern"):                               # [B,N,T,S]
        return (every, every if h is None else h, every if p is None else p)
    return (every, every if p is None else p) + (() if h is None else (h,))


def _loop(m, site, over):
    """The reference: one patched call per cell, the clean value written in by index assignment."""
    saved = m(TOKENS, capture=(site,))[1]["captured"][site]
    base, top = metric(m(CORRUPT)[0]), metric(m(TOKENS)[0])
    cells = {"position": [(lay, p, None) for lay in range(L) for p in range(T)],
             "head": [(lay, None, h) for lay in range(L) for h in range(saved.shape[3 if site != "pattern" else 2])],
             "both": [(lay, p, h) for lay in range(L) for p in range(T) for h in range(N)]}[over]

    @jax.jit
    def one(lay, p, h):                         # p, h: traced ints, or None (all of that axis)
        idx = _index(site, p, h)

        def fn(value, at):
            return jnp.where(at == lay, value.at[idx].set(saved[lay][idx].astype(value.dtype)), value)
        return metric(m(CORRUPT, patch={site: fn})[0])
    return np.asarray([(one(lay, p, h) - base) / (top - base) for lay, p, h in cells])


@pytest.mark.parametrize("site, over", [("resid_pre", "position"), ("z", "both"), ("pattern", "head"),
                                        pytest.param("attn_out", "position", marks=pytest.mark.slow),
                                        pytest.param("pattern", "both", marks=pytest.mark.slow),
                                        pytest.param("k", "head", marks=pytest.mark.slow)])
def test_the_grid_is_the_loop_of_single_patches(model, site, over):
    grid = np.asarray(patching_grid(model, (TOKENS,), (CORRUPT,), site, metric, over=over, batch=4))
    want = _loop(model, site, over)
    assert grid.shape[0] == L and grid.size == want.size
    np.testing.assert_allclose(grid.reshape(-1), want, rtol=1e-4, atol=1e-5)


def test_a_one_token_corruption_is_restored_at_its_position_before_layer_0(model):
    grid = np.asarray(patching_grid(model, (TOKENS,), (CORRUPT,), "resid_pre", metric))
    assert grid[0, C] == pytest.approx(1.0, abs=1e-5)                 # layer 0's input is the embedding alone
    np.testing.assert_allclose(np.delete(grid[0], C), 0.0, atol=1e-6)
    np.testing.assert_allclose(grid[:, :C], 0.0, atol=1e-6)           # causal: before C, clean == corrupt
    raw = np.asarray(patching_grid(model, (TOKENS,), (CORRUPT,), "resid_pre", metric, normalize=False))
    gap = float(metric(model(TOKENS)[0]) - metric(model(CORRUPT)[0]))
    np.testing.assert_allclose(raw, grid * gap, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("site, over", [("resid_mid", "position"), ("z", "head"), ("pattern", "both")])
def test_attribution_is_each_patchs_directional_derivative(model, site, over):
    """Each cell's estimate is d/dα metric(corrupt + α·(clean − corrupt) on that cell) at α = 0: the gradient of
    that one patch's scalar α (not the site's whole gradient summed per cell), and its central difference."""
    got = np.asarray(attribution_patching(model, (TOKENS,), (CORRUPT,), site, metric, over=over,
                                          normalize=False))
    saved = model(TOKENS, capture=(site,))[1]["captured"][site]
    was = model(CORRUPT, capture=(site,))[1]["captured"][site]
    heads = saved.shape[2 if site == "pattern" else 3]
    cells = {"position": [(lay, p, None) for lay in range(L) for p in range(T)],
             "head": [(lay, None, h) for lay in range(L) for h in range(heads)],
             "both": [(lay, p, h) for lay in range(L) for p in range(T) for h in range(heads)]}[over]

    @jax.jit
    def slope(direction):
        def f(alpha):
            return metric(model(CORRUPT, patch={site: lambda v, at: v + alpha * direction[at].astype(v.dtype)})[0])
        return jax.grad(f)(0.0), (f(1e-2) - f(-1e-2)) / 2e-2
    want, differences = [], []
    for lay, p, h in cells:
        idx = _index(site, p, h)
        direction = jnp.zeros_like(saved).at[(lay, *idx)].set((saved - was)[(lay, *idx)])
        d, fd = slope(direction)
        want.append(float(d))
        differences.append(float(fd))
    np.testing.assert_allclose(got.reshape(-1), want, rtol=2e-3, atol=2e-5)
    np.testing.assert_allclose(got.reshape(-1), differences, rtol=0.05, atol=5e-3)   # no autodiff at all


def test_attribution_equals_patching_where_the_metric_is_linear_in_the_site():
    """Post-LN has no final norm: the last layer's resid_post reaches the logits linearly, so its row of the
    estimate is the real patching row; earlier rows are estimates only."""
    m = lm(norm__position="post")
    real = np.asarray(patching_grid(m, (TOKENS,), (CORRUPT,), "resid_post", metric))
    est = np.asarray(attribution_patching(m, (TOKENS,), (CORRUPT,), "resid_post", metric))
    np.testing.assert_allclose(est[L - 1], real[L - 1], rtol=1e-4, atol=1e-5)


def negated(logits):
    return -metric(logits)


def test_normalised_cells_keep_their_sign_whichever_way_the_corruption_moves_the_metric():
    """Normalised, a cell is (patched − corrupt) / (clean − corrupt): negating the metric negates both, so the grid
    and the estimate are unchanged, and the cell that restores the clean logits outright is +1 whether the
    corruption lowers the metric or raises it. Post-LN has no final norm: the last position's logits are the last
    layer's resid_post there times the head, so patching that one cell gives the clean metric exactly (and the
    estimate is exact, the metric being linear in it). Catches a normalisation by |clean − corrupt| (in the grid
    or in attribution patching): -1 and a flipped grid where the corruption raises the metric."""
    m = lm(norm__position="post")
    gaps = [float(f(m(TOKENS)[0]) - f(m(CORRUPT)[0])) for f in (metric, negated)]
    assert gaps[0] * gaps[1] < 0 and min(map(abs, gaps)) > 1e-3, gaps          # one lowers, one raises
    for fn in (patching_grid, attribution_patching):
        up, down = (np.asarray(fn(m, (TOKENS,), (CORRUPT,), "resid_post", f)) for f in (metric, negated))
        for got in (up, down):
            assert got[L - 1, T - 1] == pytest.approx(1.0, abs=1e-4), (fn.__name__, got[L - 1])
            np.testing.assert_allclose(got[L - 1, :T - 1], 0.0, atol=1e-5, err_msg=fn.__name__)
        np.testing.assert_allclose(down, up, rtol=1e-4, atol=1e-5, err_msg=fn.__name__)


@pytest.mark.parametrize("fn", [patching_grid, attribution_patching])
@pytest.mark.parametrize("site, over, message", [
    ("resid_pre", "head", r"over='head': site 'resid_pre' \(2, 6, 32\) has no head axis"),
    ("nope", "position", "activation site 'nope' does not exist"),
    ("embed", "position", "'embed' is model-level"),
    ("z", "layer", r"over='layer' is not one of \('position', 'head', 'both'\)")])
def test_bad_requests_are_named(model, fn, site, over, message):
    with pytest.raises(ConfigError, match=message):
        fn(model, (TOKENS,), (CORRUPT,), site, metric, over=over)


def test_saturated_attention_blinds_the_estimate_at_the_scores_not_at_the_pattern():
    """AtP*'s known failure (Kramár et al. 2024): with q scaled ×30 the softmax saturates (a query's largest
    probability ~0.96), so the gradient through it is ~0 and attribution at `attn_scores` misses a patch that
    real patching shows; patching a row of scores and patching that row's probabilities are the same patch
    (equal grids), and estimated at `pattern`, past the softmax, the same cell is found."""
    m = lm()
    att = m.decoder.layers.blocks.self_attn
    att.wq[...] = att.wq[...] * 30.0
    scores = np.asarray(patching_grid(m, (TOKENS,), (CORRUPT,), "attn_scores", metric))
    pattern = np.asarray(patching_grid(m, (TOKENS,), (CORRUPT,), "pattern", metric))
    np.testing.assert_allclose(scores, pattern, atol=1e-4)
    cell = np.unravel_index(np.argmax(np.abs(scores)), scores.shape)
    at_scores = np.asarray(attribution_patching(m, (TOKENS,), (CORRUPT,), "attn_scores", metric))[cell]
    at_pattern = np.asarray(attribution_patching(m, (TOKENS,), (CORRUPT,), "pattern", metric))[cell]
    assert abs(scores[cell]) > 0.5, scores                          # a patch that matters (1.03 when written)
    assert abs(at_scores) < 0.1 * abs(scores[cell]), (at_scores, scores[cell])              # 0.037: blind
    assert abs(at_pattern - scores[cell]) < 0.25 * abs(scores[cell]), (at_pattern, scores[cell])  # 0.92

# --------------------------------------------------------------------------- where the setting above hides a bug
# The patching grid and attribution patching (`jaxformer.patching`) where the main tests' setting hides a bug:
# more layers than rows (an L read from the batch axis), batch=1, an integer metric (the grid takes one), a metric
# finite on one run only, the calls traced under the user's own jax.jit (inputs and metrics not read on the
# host), learned position tables, and the named errors' words (which run, which field). The mutants of
# tests/mutation_scores.json's patching row that these kill are listed with each test.

E_TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 40, (2, T)))
E_CORRUPT = E_TOKENS.at[:, 2].set((E_TOKENS[:, 2] + 5) % 40)


def gap12(logits):
    return jnp.mean(logits[:, -1, 1] - logits[:, -1, 2])


def edge_lm(layers=3, **kw):
    kw = {"positional": "rope", **kw}
    cfg = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, vocab_size=40, d_model=16,
                   num_heads=2, d_ff=16, num_decoder_layers=layers, max_len=8, runtime__dropout=0.0,
                   norm__position="pre", **kw)
    return build_model(cfg, seed=2)


@pytest.fixture(scope="module")
def three():
    return edge_lm()


def test_the_grid_has_one_row_per_layer_and_batch_1_is_batch_none(three):
    """3 layers, 2 rows: the grid is [L=3, T] (not [B, T]: _cells_10), and batch=1 is accepted and is the cells
    one at a time (_batch_6, _batch_7), equal to batch=None."""
    one = np.asarray(patching_grid(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", gap12, batch=1))
    assert one.shape == (3, T)
    whole = patching_grid(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", gap12)
    np.testing.assert_allclose(one, np.asarray(whole), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one[0, 2], 1.0, atol=1e-5)           # the corrupted token restored before layer 0
    np.testing.assert_allclose(one[0, [0, 1, 3, 4, 5]], 0.0, atol=1e-6)


def test_the_grid_takes_an_integer_metric(three):
    """A count (argmax hits) is a real scalar the grid may difference (only attribution differentiates):
    refused with grad=True as _scalar's default (_scalar_1) or a dtype test that never holds (_scalar_13..16).
    The grid of the count equals the grid of the same count as float32, and the count's own patched values."""
    count = lambda logits: jnp.sum(jnp.argmax(logits[:, -1], -1) == 1)              # noqa: E731
    grid = np.asarray(patching_grid(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", count, normalize=False))
    as_float = lambda logits: count(logits).astype(jnp.float32)                    # noqa: E731
    np.testing.assert_array_equal(grid, np.asarray(
        patching_grid(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", as_float, normalize=False)))
    # restoring the corrupted token before layer 0 gives the clean run's count
    assert grid[0, 2] == int(count(three(E_TOKENS)[0])) - int(count(three(E_CORRUPT)[0]))


@pytest.mark.parametrize("fn", [patching_grid, attribution_patching])
def test_a_metric_finite_on_the_clean_run_only_is_named(three, fn):
    """inf on the corrupted run, finite on the clean one: refused (the `and` of the two finiteness tests:
    _normalized_16), as an inf on both is."""
    clean, corrupt = (np.asarray(three(x)[0][:, -1]) for x in (E_TOKENS, E_CORRUPT))
    v = int(np.argmax(np.abs(clean - corrupt).max(0)))                # the logit the corruption moves most
    r = int(np.argmax(np.abs(clean[:, v] - corrupt[:, v])))
    mid = float(clean[r, v] + corrupt[r, v]) / 2
    up = corrupt[r, v] > clean[r, v]
    bad = lambda logits: jnp.where((logits[r, -1, v] > mid) == up, jnp.inf, 0.0) + logits[r, -1, v]  # noqa: E731
    with pytest.raises(DataError, match=r"metric\(clean\) = \S+, metric\(corrupt\) = inf: a metric that is not "
                                        r"finite"):
        fn(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", bad)


@pytest.mark.parametrize("fn", [patching_grid, attribution_patching])
def test_the_calls_trace_under_a_users_jit(three, fn):
    """Inside the user's jax.jit the inputs and the metric's values are tracers: nothing of them is read on the
    host (_inputs_94, _normalized_1: a host read of a tracer), and the result is the eager one."""
    traced = jax.jit(lambda c, k: fn(three, (c,), (k,), "resid_pre", gap12))(E_TOKENS, E_CORRUPT)
    eager = fn(three, (E_TOKENS,), (E_CORRUPT,), "resid_pre", gap12)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [patching_grid, attribution_patching])
def test_concrete_positions_are_checked_when_the_tokens_are_traced(fn):
    """The tokens traced, the positions a concrete array: the positions are still checked (a `break` at the
    first traced input would skip them: _inputs_96), in a learned table (_inputs_63, _inputs_64)."""
    m = edge_lm(layers=1, positional="learned")
    positions = jnp.broadcast_to(jnp.arange(T), (2, T)) + 3            # 8 is past model.max_len=8
    with pytest.raises(DataError, match=r"clean input 1 \[2, 6\]: row 0, position 5 holds 8, outside the position "
                                        r"table \[0, 8\) \(model.max_len\)"):
        jax.jit(lambda c, k: fn(m, (c, positions), (k, positions), "resid_pre", gap12))(E_TOKENS, E_CORRUPT)


@pytest.mark.parametrize("fn", [patching_grid, attribution_patching])
@pytest.mark.parametrize("clean, corrupt, says", [
    ((E_TOKENS,), 5, r"^corrupt must be a tuple of the model's inputs, .*; got a int$"),
    ((E_TOKENS,), [E_CORRUPT[0]], r"^corrupt input 0 is \[6\]"),
    ((E_TOKENS,), (E_CORRUPT.at[1, 4].set(40),), r"^corrupt input 0 \[2, 6\]: row 1, position 4 holds 40, outside the "
                                              r"vocabulary \[0, 40\) \(model.vocab_size\)$")])
def test_the_named_errors_name_the_run_and_the_field(three, fn, clean, corrupt, says):
    """Which run ("corrupt", _inputs_17/18/46/47), what was passed (a int, not "an array []": _inputs_22/31), the
    id equal to vocab_size refused (not only past it: _inputs_104), the field (_inputs_69/70)."""
    with pytest.raises(DataError, match=says):
        fn(three, clean, corrupt, "resid_pre", gap12)


def test_values_another_process_holds_are_not_read():
    """On many hosts the metric's values are global arrays this process holds part of: the finiteness and
    zero-difference checks read values this process holds only (an attribute misnamed or read off the wrong
    object would read a global array: _normalized_3, _9, _10)."""
    from jaxformer import patching

    class Remote:                       # a global array's face: not fully addressable, not to be read
        is_fully_addressable = False

        def __float__(self):
            raise AssertionError("read a value another process holds")
    effect = jnp.ones(3)
    assert patching._normalized(effect, Remote(), Remote(), True) is effect
    with pytest.raises(DataError, match="normalize=True divides by their difference"):
        patching._normalized(effect, jnp.float32(1.0), jnp.float32(1.0), True)
