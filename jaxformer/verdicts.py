"""Verdicts that follow from the statistics, and published reports checked against their own data.

`difference` and `equivalence` decide an equality claim on Welch's 95% interval of the difference against a
declared margin; `CSVReport` reads a report back from its committed CSV, so that `verdict_from_csv` can recompute
the verdict a published report states (`jaxformer report SWEEP --verdict-only`; tests/test_reports.py).
"""
from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path

from jaxformer.errors import SweepError
from jaxformer.report import Report, Stat, _unique_arms
from jaxformer.sweep import Arm, Sweep, runs


class CSVReport(Report):
    """A report read back from its committed OUT/NAME_runs.csv (and OUT/NAME_info.json, what a summary measured
    besides the runs) instead of the run directories: the verdict of a published report can be recomputed, and
    checked, from the files it was written from."""

    def __init__(self, sweep: Sweep, out: str | Path = "docs/ablations"):
        self.sweep, self.root, self.out = sweep, Path("<csv>"), Path(out)
        self.runs = runs(sweep, self.root)
        self.arms = _unique_arms(self.runs)
        path = self.out / f"{sweep.name}_runs.csv"
        if not path.is_file():
            raise SweepError(f"{path} not found: `jaxformer report {sweep.source}` writes it")
        with path.open(newline="", encoding="utf-8") as f:
            rows = {(r["arm"], int(r["seed"])): r for r in csv.DictReader(f)}
        self._rows = {r.id: rows.get((r.arm.name, r.seed)) for r in self.runs}
        self.status = {i: ({"status": row["status"], "wall_s": float(row["wall_s"] or 0)}
                           if row and row["status"] != "missing" else None) for i, row in self._rows.items()}
        self.records = {}
        self.missing = [i for i, st in self.status.items() if st is None]
        info = self.out / f"{sweep.name}_info.json"
        self.info = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else None

    def sizes(self, axis: str, arm: Arm) -> list:
        """Each run's size from its CSV column (written when the sweep has scaling fits)."""
        return self.values(axis, arm)

    def values(self, label: str, arm: Arm) -> list:
        out = []
        for r in self.runs_of(arm):
            row = self._rows[r.id]
            if row is None or label not in row:
                raise SweepError(f"{self.out / self.sweep.name}_runs.csv has no column {label!r} for {r.id}: "
                                 f"the report predates this metric; rerun the sweep's report")
            cell = row[label]
            try:
                out.append(None if cell == "" else float(cell))
            except ValueError:
                out.append(cell)                           # "n/a" reasons of extra evaluations
        return out


def difference(a: list, b: list) -> Stat | None:
    """mean(a) − mean(b) with Welch's 95% Student-t interval (unequal variances; Welch–Satterthwaite degrees of
    freedom). The `total`/`n` fields count a's values. None when either side has fewer than two values."""
    xs = [float(v) for v in a if isinstance(v, (int, float)) and math.isfinite(v)]
    ys = [float(v) for v in b if isinstance(v, (int, float)) and math.isfinite(v)]
    if len(xs) < 2 or len(ys) < 2:
        return None
    from scipy.stats import t
    va, vb = statistics.variance(xs) / len(xs), statistics.variance(ys) / len(ys)
    d, se = statistics.fmean(xs) - statistics.fmean(ys), math.sqrt(va + vb)
    if se == 0:
        return Stat(len(xs), len(a), d, 0.0, d, d)
    df = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(ys) - 1))
    h = float(t.ppf(0.975, df)) * se
    return Stat(len(xs), len(a), d, se, d - h, d + h)


def paired_difference(a: list, b: list) -> Stat | None:
    """mean(a_i − b_i) over pairs measured together (e.g. two programs timed in alternating blocks), with the
    95% Student-t interval of that mean (n − 1 degrees of freedom). Pairing removes what the two share (a
    machine's drift between pairs), which `difference` (Welch, unpaired) would count as noise. None with fewer
    than two pairs. Raises ValueError when a and b differ in length."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths; got {len(a)} and {len(b)}")
    ds = [float(x) - float(y) for x, y in zip(a, b) if math.isfinite(float(x)) and math.isfinite(float(y))]
    if len(ds) < 2:
        return None
    from scipy.stats import t
    m, s = statistics.fmean(ds), statistics.stdev(ds)
    h = float(t.ppf(0.975, len(ds) - 1)) * s / math.sqrt(len(ds))
    return Stat(len(ds), len(a), m, s, m - h, m + h)


def within(st: Stat, lo: float, hi: float) -> str:
    """The verdict on a threshold or tolerance claim ("the mean lies in [lo, hi]") from the 95% interval of the
    mean: "holds" when the interval lies inside, "does not hold" when it lies wholly outside, else "not
    resolved"."""
    if lo <= st.lo and st.hi <= hi:
        return "holds"
    if st.hi < lo or st.lo > hi:
        return "does not hold"
    return "not resolved"


def above(st: Stat | None, x: float) -> str:
    """The verdict on "the mean is at least x" from its 95% interval: "holds" when the whole interval is ≥ x,
    "does not hold" when it lies wholly below, else "not resolved" (also with no values)."""
    if st is None:
        return "not resolved"
    return "holds" if st.lo >= x else "does not hold" if st.hi < x else "not resolved"


def below(st: Stat | None, x: float) -> str:
    """The verdict on "the mean is below x" from its 95% interval (the mirror of `above`)."""
    if st is None:
        return "not resolved"
    return "holds" if st.hi < x else "does not hold" if st.lo >= x else "not resolved"


def more_often(k1: int, n1: int, k2: int, n2: int) -> tuple[str, float]:
    """Does an event happen more often in group 1 (k1 of n1 runs) than in group 2 (k2 of n2)? One-sided Fisher
    exact test -> ("holds" when p < 0.05, else "not resolved"; "does not hold" when group 1's rate is not
    higher at all, p)."""
    from scipy.stats import fisher_exact
    p = float(fisher_exact([[k1, n1 - k1], [k2, n2 - k2]], alternative="greater").pvalue)
    if k1 * n2 <= k2 * n1:
        return "does not hold", p
    return ("holds" if p < 0.05 else "not resolved"), p


def equivalence(diff: Stat | None, margin: float) -> str:
    """The verdict on "a equals b" from the 95% interval of their difference a − b and a declared margin (a
    difference smaller than `margin` is one we call negligible). It starts with one of: "equivalent" (the whole
    interval lies within ±margin); "lower" / "higher" (the interval excludes 0; "by more than the margin" when
    it lies wholly beyond it); "not resolved" (neither: more seeds would tell). Overlapping intervals of a and b
    alone are no evidence of equality."""
    if diff is None:
        return "not resolved (fewer than two values per arm)"
    ci = f"difference {diff.mean:+.3g}, 95% interval [{diff.lo:+.3g}, {diff.hi:+.3g}], margin ±{margin:g}"
    if -margin < diff.lo and diff.hi < margin:
        return f"equivalent ({ci})"
    if diff.hi < 0 or diff.lo > 0:
        word = "lower" if diff.hi < 0 else "higher"
        beyond = diff.hi <= -margin or diff.lo >= margin
        return f"{word}{' by more than the margin' if beyond else ''} ({ci})"
    return f"not resolved ({ci})"


_VERDICT = re.compile(r"(?ms)^## Verdict\n\n(.*?)\n\n## ")


def committed_verdict(sweep: Sweep, out: str | Path = "docs/ablations") -> str:
    """The verdict section of the published OUT/NAME.md."""
    path = Path(out) / f"{sweep.name}.md"
    m = _VERDICT.search(path.read_text(encoding="utf-8")) if path.is_file() else None
    if m is None:
        raise SweepError(f"{path} has no '## Verdict' section")
    return m.group(1).strip()


def verdict_from_csv(sweep: Sweep, out: str | Path = "docs/ablations") -> str:
    """The verdict that `sweep.summary` computes from the committed CSVs (CSVReport)."""
    if sweep.summary is None:
        raise SweepError(f"sweep {sweep.name} has no summary()")
    return sweep.summary(CSVReport(sweep, out)).strip()


def rewrite_verdict(sweep: Sweep, out: str | Path = "docs/ablations") -> Path:
    """Recompute OUT/NAME.md's verdict from its CSVs and write it in place (the rest of the report stays): for
    a change to how a sweep's verdict is decided, without its runs."""
    path = Path(out) / f"{sweep.name}.md"
    committed_verdict(sweep, out)
    text = path.read_text(encoding="utf-8")
    new = verdict_from_csv(sweep, out)
    path.write_text(_VERDICT.sub(lambda m: f"## Verdict\n\n{new}\n\n## ", text, count=1), encoding="utf-8")
    return path
