"""Published verdicts follow from their own data: every sweep report's verdict is rebuilt from its committed CSVs
and must equal the committed text; the statistics deciding them are checked against scipy; the metric specs
that smooth a single batch away are checked on synthetic histories."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from helpers import ROOT
from jaxformer.report import metric_value
from jaxformer.stats import Stat, difference, equivalence, paired_difference, within
from jaxformer.sweep import load_sweep
from jaxformer.verdicts import committed_verdict, verdict_from_csv

SWEEPS = sorted((ROOT / "configs" / "sweeps").glob("*.py"))


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_each_published_verdict_is_what_its_committed_csv_gives(path: Path):
    """A summary() changed without regenerating the report, a CSV edited by hand, or a verdict written by hand
    fails here (regenerate with `jaxformer report SWEEP --verdict-only`)."""
    sweep = load_sweep(path)
    assert verdict_from_csv(sweep, ROOT / "docs" / "ablations") == committed_verdict(sweep, ROOT / "docs" / "ablations")


def test_difference_is_welchs_interval():
    a, b = [2.17, 2.15, 2.19], [2.21, 2.18, 2.25]
    d = difference(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert d.mean == pytest.approx(np.mean(a) - np.mean(b), rel=1e-12)
    assert (d.lo, d.hi) == (pytest.approx(ref.low, rel=1e-9), pytest.approx(ref.high, rel=1e-9))
    assert difference([1.0], b) is None and difference(a, [1.0, math.nan]) is None


def test_paired_difference_is_the_paired_t_interval():
    """Against scipy's paired t-test; and pairing is what removes a drift both programs share: the same values
    unpaired (Welch) give an interval that cannot tell them apart."""
    rng = np.random.default_rng(0)
    drift = np.linspace(0.0, 0.3, 12)                             # the machine slows down over the run
    a = list(2.00 + drift + 0.002 * rng.standard_normal(12))
    b = list(2.02 + drift + 0.002 * rng.standard_normal(12))
    d = paired_difference(a, b)
    ref = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert d.mean == pytest.approx(np.mean(np.subtract(a, b)), rel=1e-12)
    assert (d.lo, d.hi) == (pytest.approx(ref.low, rel=1e-9), pytest.approx(ref.high, rel=1e-9))
    assert d.hi < 0 and equivalence(d, 0.01).startswith("lower by more than the margin")
    assert equivalence(difference(a, b), 0.01).startswith("not resolved")
    assert paired_difference([1.0], [2.0]) is None and paired_difference([1.0, math.nan], [2.0, 3.0]) is None
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0, 2.0], [1.0])


@pytest.mark.parametrize("a, b, margin, verdict", [
    ([2.000, 2.001, 1.999], [2.002, 2.000, 2.001], 0.05, "equivalent"),
    ([2.0, 2.1, 1.9], [2.05, 2.15, 1.95], 0.05, "not resolved"),     # intervals overlap: still not equality
    ([2.00, 2.01, 1.99], [2.04, 2.05, 2.03], 0.05, "lower ("),       # excludes 0, inside the margin's reach
    ([2.00, 2.01, 1.99], [2.20, 2.21, 2.19], 0.05, "lower by more than the margin"),
    ([2.20, 2.21, 2.19], [2.00, 2.01, 1.99], 0.05, "higher by more than the margin"),
])
def test_equivalence_decides_on_the_interval_of_the_difference(a, b, margin, verdict):
    got = equivalence(difference(a, b), margin)
    assert got.startswith(verdict), got
    if verdict == "not resolved":                      # the old rule ("the 95% intervals overlap") said equal
        sa, sb = stats.t.interval(0.95, 2, np.mean(a), stats.sem(a)), stats.t.interval(0.95, 2, np.mean(b), stats.sem(b))
        assert sa[0] <= sb[1] and sb[0] <= sa[1]


def _records(losses, every=10):
    return [{"step": every * (i + 1), "split": "train", "loss": v} for i, v in enumerate(losses)]


def test_tail_mean_and_smoothed_crossing_ignore_one_lucky_batch():
    done = {"status": "completed"}
    losses = [1.0, 0.5, 0.09, 0.3, 0.2, 0.12, 0.08, 0.07, 0.06, 0.05]
    rec = _records(losses)
    assert metric_value("train/loss<0.1", done, rec) == 30.0                      # one batch
    assert metric_value("train/loss<0.1~3", done, rec) == 80.0                    # mean(0.12, 0.08, 0.07)
    assert metric_value("train/loss@tail:4", done, rec) == pytest.approx(np.mean(losses[-4:]))
    assert metric_value("train/loss@tail:11", done, rec) is None                  # fewer values than asked
    assert metric_value("train/loss<0.01~3", done, rec) is None                   # never
    assert metric_value("train/loss@tail:2", {"status": "diverged"}, rec) is None


def test_readme_tables_are_the_rendering_of_the_results_files():
    """README figures rendered from benchmarks/results/*.json: a hand edit, or a results file rewritten
    without re-rendering, fails here (`python tools/readme_tables.py` re-renders)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "tools" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    counted = 0
    for page in tables.pages():
        text = (ROOT / page).read_text(encoding="utf-8")
        counted += text.count("<!-- table:")
        assert tables.render(text, page) == text, page
    assert counted >= 15 and "<!-- table:claims" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_claims_table_figures_follow_their_results_files(tmp_path, monkeypatch):
    """Every measured figure of the claims table is read from a results file: change a report's CSV, a run's
    outcome or a benchmark's JSON in a copy and the rendered row changes with it."""
    import csv
    import importlib.util
    import json
    import shutil
    for d in ("docs", "benchmarks/results", "configs/sweeps"):
        shutil.copytree(ROOT / d, tmp_path / d)
    spec = importlib.util.spec_from_file_location("claims_table", ROOT / "tools" / "claims_table.py")
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    committed = ct.claims()
    assert committed in (ROOT / "README.md").read_text(encoding="utf-8")
    assert committed.count("\n| 000: ") + committed.count("\n| 004: ") == 28          # every claim has its row
    path = tmp_path / "docs/ablations/width_arms.csv"
    rows = list(csv.reader(path.open(encoding="utf-8")))
    for r in rows:
        if r[:2] == ["D=64", "train loss (last epoch)"]:
            r[4] = "1.9"
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    runs = tmp_path / "docs/ablations/norm_placement_runs.csv"
    text = runs.read_text(encoding="utf-8").splitlines()
    first_failed = next(i for i, line in enumerate(text) if ",post,12," in line and line.endswith(",1.0,0.0"))
    text[first_failed] = text[first_failed][: -len(",1.0,0.0")] + ",0.0,0.0"
    runs.write_text("\n".join(text) + "\n", encoding="utf-8")
    decode = json.loads((tmp_path / "benchmarks/results/decode.json").read_text())
    next(r for r in decode["rows"] if (r["size"], r["batch"], r["context"]) == ("base", 1, 64))["speedup"] = 4.4
    (tmp_path / "benchmarks/results/decode.json").write_text(json.dumps(decode))
    monkeypatch.setattr(ct, "ROOT", tmp_path)
    monkeypatch.setattr(ct, "ABLATIONS", tmp_path / "docs/ablations")
    for f in (ct._arms, ct.runs, ct.result):
        f.cache_clear()
    changed = ct.claims()
    assert "train loss over the last epoch 1.90 ± 0.03" in changed and "1.76 ± 0.03" not in changed
    assert "Post-LN failed 17/24 runs at 6 and 12 layers (11 of 12 at 12 layers" in changed
    assert "at context 64 (4.4×)" in changed and "holds in size (4.4× at 64" in changed


def test_the_quoted_ffn_parameter_count_is_the_models_and_the_formula():
    """The docs quote 2,099,712 FFN parameters per layer at D=512, F=2048 (seed 004: "nearly 2M"): it must be
    what the model builds (abstractly: nothing is allocated) and the formula 2·D·F + F + D (weights and biases)."""
    import json

    import jax
    from flax import nnx

    from jaxformer.configio import load_config_file
    from jaxformer.nn import build_model
    base = load_config_file(ROOT / "configs" / "base.py").model
    params = nnx.state(nnx.eval_shape(lambda: build_model(base)), nnx.Param)
    ffn = sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
              if "['encoder']" in jax.tree_util.keystr(path) and "['ffn']" in jax.tree_util.keystr(path))
    per_layer = ffn // base.num_encoder_layers
    assert per_layer == 2 * 512 * 2048 + 2048 + 512 == 2_099_712
    assert json.loads((ROOT / "docs" / "claims.json").read_text())["ffn_params_per_layer_d512_f2048"] == per_layer
    for doc in ("README.md", "docs/claims.md"):
        assert f"{per_layer:,} per layer, {6 * per_layer:,} for six" in (ROOT / doc).read_text(encoding="utf-8")


@pytest.mark.parametrize("lo, hi, verdict", [(1.70, 1.80, "holds"), (1.50, 1.70, "not resolved"),
                                             (1.30, 1.50, "does not hold"), (2.00, 2.10, "does not hold")])
def test_within_decides_a_tolerance_claim_on_the_whole_interval(lo, hi, verdict):
    """Seed 000's "loss ≈ 1.8" with ±10% ([1.62, 1.98]): an interval that merely touches the range is not a
    verdict either way (the old width rule called it "holds")."""
    assert within(Stat(3, 3, (lo + hi) / 2, 0.1, lo, hi), 1.62, 1.98) == verdict


@pytest.mark.parametrize("lo, hi, at_least, under", [(0.55, 0.9, "holds", "does not hold"),
                                                     (0.1, 0.45, "does not hold", "holds"),
                                                     (0.4, 0.6, "not resolved", "not resolved"),
                                                     (0.5, 0.7, "holds", "does not hold")])
def test_threshold_verdicts_use_the_whole_interval(lo, hi, at_least, under):
    """A threshold claim (exact match ≥ 50%, loss below x) holds or fails only when the whole 95% interval of the
    mean is on one side: a mean on the right side with an interval across the line is "not resolved"."""
    from jaxformer.stats import above, below
    st = Stat(3, 3, (lo + hi) / 2, 0.1, lo, hi)
    assert above(st, 0.5) == at_least and below(st, 0.5) == under
    assert above(None, 0.5) == below(None, 0.5) == "not resolved"


def test_more_often_is_a_one_sided_fisher_exact_test():
    """Post-LN failing 18/24 runs against Pre-LN's 0/24 is decided by Fisher's exact test (scipy's, computed here
    by hand from the hypergeometric tail as well), not by comparing the two counts."""
    import math

    from jaxformer.stats import more_often

    def tail(k1, n1, k2, n2):          # P(X >= k1), X ~ hypergeometric(n1 + n2, k1 + k2, n1)
        total, events = n1 + n2, k1 + k2
        return sum(math.comb(events, x) * math.comb(total - events, n1 - x)
                   for x in range(k1, min(events, n1) + 1)) / math.comb(total, n1)
    verdict, p = more_often(18, 24, 0, 24)
    assert verdict == "holds" and p == pytest.approx(tail(18, 24, 0, 24), rel=1e-9) and p < 1e-6
    assert more_often(2, 3, 0, 3)[0] == "not resolved"              # 2/3 vs 0/3: p = 0.2, too few runs
    assert more_often(1, 12, 1, 12)[0] == more_often(0, 12, 3, 12)[0] == "does not hold"
