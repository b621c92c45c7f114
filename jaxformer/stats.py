"""The ground floor of the statistics, shared by reports, sweeps' verdicts, benchmarks and the scaling fits: the
summary of a metric over seeds (`Stat`, `stat`), the verdicts that follow from its 95% interval (`within`,
`above`, `below`, `equivalence`, `more_often`), intervals of a difference (`difference`: Welch, unpaired;
`paired_difference`, `paired_ratio`: pairs measured together), the bootstrap resampler (`resample`,
`resampled`), and the line naming the machine a result was measured on (`machine`). numpy, scipy and the
standard library only: no model code, no I/O (`machine` reads /proc/cpuinfo and asks jax for its devices, both
when called).

A bootstrap resample of m seeds has (m − 1)/m of their variance, so a group's resampled mean varies less than its
standard error says (with 3 seeds, a third less) and intervals come out too narrow. `resampled` rescales each
resample's spread about its group's mean by √(m/(m − 1)) (in log space: losses are positive) to undo that.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
from importlib.metadata import version
from pathlib import Path

import numpy as np


def machine() -> str:
    """CPU model, cores, OS and library versions: the line every report and benchmark names."""
    import jax
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    where = f"{jax.device_count()} {dev.platform} device(s)" + ("" if dev.platform == "cpu" else f" ({dev.device_kind})")
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, {where}, "
            f"jax {jax.__version__}, flax {version('flax')}")


@dataclasses.dataclass(frozen=True)
class Stat:
    """Summary of one metric over an arm's seeds (values that exist)."""
    n: int              # values present
    total: int          # runs in the arm
    mean: float
    std: float          # sample standard deviation (0 for one value)
    lo: float           # 95% Student-t interval of the mean (= mean for one value)
    hi: float

    def fmt(self, digits: int = 3) -> str:
        f = lambda v: f"{v:.{digits}g}"
        s = f"{f(self.mean)} ± {f(self.std)}" + (f" [{f(self.lo)}, {f(self.hi)}]" if self.n > 1 else "")
        return s + (f" ({self.n}/{self.total})" if self.n < self.total else "")


def stat(values: list, total: int | None = None) -> Stat | None:
    """values (numbers; None, strings and non-finite numbers are left out) -> their mean, sample standard
    deviation and 95% Student-t interval of the mean (n − 1 degrees of freedom); None with no value. `total`
    (default len(values)): the runs the values came from."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return None
    m = statistics.fmean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    if len(xs) > 1:
        from scipy.stats import t
        h = float(t.ppf(0.975, len(xs) - 1)) * s / math.sqrt(len(xs))
    else:
        h = 0.0
    return Stat(len(xs), total if total is not None else len(values), m, s, m - h, m + h)


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


def paired_ratio(num: list, den: list) -> dict | None:
    """num/den from paired rounds (round i of each measured together, e.g. two programs' wall times): the
    geometric mean of the per-round ratios with the 95% Student-t interval of the mean log ratio
    (`paired_difference` of the logs) -> {ratio, lo, hi, rounds}; None under two rounds."""
    d = paired_difference([math.log(x) for x in num], [math.log(x) for x in den])
    return None if d is None else {"ratio": math.exp(d.mean), "lo": math.exp(d.lo), "hi": math.exp(d.hi),
                                   "rounds": d.n}


def against(r: dict, target: float) -> str:
    """A paired ratio ({lo, hi}: `paired_ratio`) against the target "ratio >= target": "met" when its whole
    interval is at or above it, "missed" when all of it is below, else "not resolved"."""
    return "met" if r["lo"] >= target else "missed" if r["hi"] < target else "not resolved"


def resample(groups, rng: np.random.Generator) -> np.ndarray:
    """Indices of one stratified resample: for each group (in order of first appearance), len(group) of its
    indices drawn with replacement."""
    return _draw(_members(groups), rng)


def _members(groups) -> list[np.ndarray]:
    """Each group's indices, groups in order of first appearance."""
    groups = np.asarray(groups)
    return [np.flatnonzero(groups == g) for g in dict.fromkeys(groups.tolist())]


def _draw(members: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([rng.choice(i, size=len(i), replace=True) for i in members])


def resampled(y, groups, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One stratified resample of positive values y [n] or [n, ...] (rows resampled whole, so what a row's
    columns share, one seed's runs at several learning rates, stays paired): -> (order, y'), y'[i] standing for
    row order[i]. Within each group of m rows, m drawn with replacement, their deviations from the group's mean
    log y scaled by √(m/(m−1)) (module docstring); NaN entries (runs not finished) stay NaN and are left out of
    the means. Many resamples of the same y: `resampler(y, groups)`, which draws the same ones."""
    return resampler(y, groups)(rng)


def resampler(y, groups):
    """rng -> `resampled(y, groups, rng)`, with what every resample shares (log y, the groups' means, their
    rescaling, the groups' indices) computed once."""
    ly, members = np.log(np.asarray(y, np.float64)), _members(groups)
    order = np.concatenate(members)
    with np.errstate(invalid="ignore"):
        means = [np.nanmean(ly[i], axis=0) if np.isfinite(ly[i]).any() else np.full(ly.shape[1:], np.nan)
                 for i in members]
    mean = np.concatenate([np.broadcast_to(mu, (len(i),) + ly.shape[1:]) for mu, i in zip(means, members)])
    m = np.concatenate([np.full(len(i), len(i), np.float64) for i in members]).reshape((-1,) + (1,) * (ly.ndim - 1))
    scale = np.sqrt(m / np.maximum(m - 1, 1))

    def draw(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return order, np.exp(mean + scale * (ly[_draw(members, rng)] - mean))
    return draw
