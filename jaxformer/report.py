"""`jaxformer report SWEEP.py`: aggregate a sweep's runs into CSV, a Markdown table (per arm: mean ± std and a
95% Student-t interval over seeds), learning curves with seed bands, final-metric bars with intervals, and
TensorBoard's HParams view. Writes OUT/NAME.md + OUT/NAME_*.png + OUT/NAME_runs.csv + OUT/NAME_arms.csv (OUT
default docs/ablations) and ROOT/NAME/hparams/ (TensorBoard).

Metric specs (a sweep's `metrics`, label -> spec):
  "SPLIT/KEY"          the last logged value (e.g. "eval/loss", "train/loss"); none for a diverged run
  "SPLIT/KEY@first"    the first logged value (e.g. the loss before training has done much)
  "SPLIT/KEY@min", "@max"  the smallest (largest) logged value, e.g. the best held-out loss before overfitting
  "SPLIT/KEY@median"   the median logged value (e.g. throughput, robust to a few disturbed intervals)
  "SPLIT/KEY@tail:N"   the mean of the last N logged values (e.g. the training loss over the last epoch's
                       batches instead of the last batch alone)
  "SPLIT/KEY<X", ">X"  the first logged step at which the value is below (above) X; none if never
  "SPLIT/KEY<X~W"      the same for the mean of the last W logged values (a smoothed crossing: one lucky
                       batch does not count)
  "evals:NAME/KEY"     a key of the sweep's extra evaluation NAME; an evaluation that could not run is "n/a"
  "diverged"           1 if the run stopped on a non-finite loss, else 0 (its mean is the divergence rate)
  "failed:SPLIT/KEY>X" 1 if the run diverged or its last value is above (<: below) X, else 0 (a failure rate)
"""
from __future__ import annotations

import csv
import json
import math
import re
import statistics
import time
from pathlib import Path

from jaxformer.errors import SweepError
from jaxformer.runs import read_metrics
from jaxformer.stats import Stat, machine, stat
from jaxformer.sweep import (Arm, Run, Sweep, computed_sizes, finished, read_status, recorded_sizes, runs,
                             short_name)

_SPEC = re.compile(r"^(?P<split>[A-Za-z_]+)/(?P<key>[A-Za-z_0-9.]+)(?:(?P<op>[<>])(?P<x>[-+0-9.eE]+)(?:~(?P<w>\d+))?"
                   r"|@(?P<at>first|min|max|median|tail:(?P<n>\d+)))?$")


def metric_value(spec: str, status: dict | None, records: list[dict]):
    """One run's value of a metric spec (module docstring): a float, None (missing), or a str (why n/a)."""
    if status is None:
        return None
    if spec == "diverged":
        return 1.0 if status["status"] == "diverged" else 0.0
    if spec.startswith("failed:"):
        m = _SPEC.match(spec[len("failed:"):])
        if m is None or m["op"] is None:
            raise SweepError(f"metric spec {spec!r} must look like failed:SPLIT/KEY>X or failed:SPLIT/KEY<X")
        if status["status"] == "diverged":
            return 1.0
        last = metric_value(f"{m['split']}/{m['key']}", status, records)
        if last is None:
            return None
        return float(last > float(m["x"]) if m["op"] == ">" else last < float(m["x"]))
    if spec.startswith("evals:"):
        name, _, key = spec[len("evals:"):].partition("/")
        ev = status.get("evals", {}).get(name)
        if ev is None:
            return None
        return ev["error"] if "error" in ev else ev.get(key)
    m = _SPEC.match(spec)
    if m is None:
        raise SweepError(f"metric spec {spec!r} is not SPLIT/KEY, SPLIT/KEY<X, SPLIT/KEY>X, evals:NAME/KEY "
                         f"or diverged")
    rows = [r for r in records if r["split"] == m["split"] and m["key"] in r]
    if m["n"]:
        if status["status"] != "completed" or len(rows) < int(m["n"]):
            return None
        return statistics.fmean(r[m["key"]] for r in rows[-int(m["n"]):])
    if m["at"]:
        vals = [r[m["key"]] for r in rows if math.isfinite(r[m["key"]])]
        if not vals:
            return None
        return {"first": vals[0], "min": min(vals), "max": max(vals), "median": statistics.median(vals)}[m["at"]]
    if m["op"] is None:
        return rows[-1][m["key"]] if rows and status["status"] == "completed" else None
    x, w = float(m["x"]), int(m["w"] or 1)
    for i in range(w - 1, len(rows)):
        v = statistics.fmean(r[m["key"]] for r in rows[i - w + 1:i + 1])
        if v < x if m["op"] == "<" else v > x:
            return float(rows[i]["step"])
    return None


class Report:
    """A sweep's runs, read once: statuses, metric histories, per-arm values and statistics."""

    def __init__(self, sweep: Sweep, root: str | Path = "runs/sweeps", out: str | Path = "docs/ablations"):
        self.sweep, self.root, self.out = sweep, Path(root), Path(out)
        self.runs: list[Run] = runs(sweep, root)
        self.arms: list[Arm] = _unique_arms(self.runs)
        self.status = {r.id: read_status(r) if finished(r) else None for r in self.runs}
        self.records = {r.id: read_metrics(r.workdir / "metrics.jsonl") for r in self.runs}
        missing = [r.id for r in self.runs if self.status[r.id] is None]
        if len(missing) == len(self.runs):
            raise SweepError(f"sweep {sweep.name} has no finished run under {self.root / sweep.name}; run "
                             f"`jaxformer sweep {sweep.source}` first")
        self.missing = missing
        self.info = None          # a summary may keep what it measured besides the runs here (NAME_info.json)

    def runs_of(self, arm: Arm) -> list[Run]:
        return [r for r in self.runs if r.arm == arm]

    def values(self, label: str, arm: Arm) -> list:
        spec = self.sweep.metrics.get(label, label)
        return [metric_value(spec, self.status[r.id], self.records[r.id]) for r in self.runs_of(arm)]

    def stat(self, label: str, arm: Arm) -> Stat | None:
        return stat(self.values(label, arm), len(self.runs_of(arm)))

    def select(self, **short) -> list[Arm]:
        """Arms whose values match, keys as arm names spell them (`sweep.short_name`):
        select(norm_position="pre", num_decoder_layers=6)."""
        def ok(arm):
            vals = {short_name(k): v for k, v in arm.values.items()}
            return all(vals.get(k) == v for k, v in short.items())
        return [a for a in self.arms if ok(a)]

    def figure(self, suffix: str) -> tuple[Path, str]:
        """(path to write, Markdown image link) of a figure of this report."""
        name = f"{self.sweep.name}_{suffix}.png"
        return self.out / name, f"![{suffix}]({name})"

    def sizes(self, axis: str, arm: Arm) -> list:
        """Each run's size (jaxformer.scaling.AXES: params, tokens, ...) as its sweep.json records it; None for a
        run that has not finished. A run recorded before sweeps kept sizes has its sizes computed from its config
        (`sweep.computed_sizes`, once per arm: its runs differ only in the seed)."""
        cache = self.__dict__.setdefault("_sizes", {})
        out = []
        for r in self.runs_of(arm):
            st = self.status[r.id]
            sizes = None if st is None else recorded_sizes(st)
            if st is not None and sizes is None:
                sizes = cache[arm.name] = cache.get(arm.name) or computed_sizes(r)
            out.append(None if sizes is None else sizes[axis])
        return out

    def wall_s(self) -> float:
        return sum(st.get("wall_s", 0.0) for st in self.status.values() if st)


def _unique_arms(all_runs: list[Run]) -> list[Arm]:
    seen, out = set(), []
    for r in all_runs:
        if r.arm.name not in seen:
            seen.add(r.arm.name)
            out.append(r.arm)
    return out


def _cell(rep: Report, label: str, arm: Arm) -> str:
    vals = rep.values(label, arm)
    errs = [v for v in vals if isinstance(v, str)]
    if errs:
        return "n/a: " + errs[0].split(";")[0].replace("|", "/")
    st = stat(vals, len(vals))
    spec = rep.sweep.metrics.get(label, label)
    if st is None:
        return "never" if re.search(r"[<>]", spec) else "—"
    if spec == "diverged" or spec.startswith("failed:"):
        return f"{st.mean * st.n:.0f}/{st.n}"
    return st.fmt()


def markdown_table(rep: Report) -> str:
    labels = list(rep.sweep.metrics)
    lines = ["| arm | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for arm in rep.arms:
        lines.append(f"| {arm.name} | " + " | ".join(_cell(rep, lab, arm) for lab in labels) + " |")
    return "\n".join(lines)


def write_csv(rep: Report) -> list[Path]:
    keys = list(dict.fromkeys(k for a in rep.arms for k in a.values))
    labels = list(rep.sweep.metrics)
    axes = sorted({s.x for s in rep.sweep.scaling}, key=str)          # sizes the fits need, as columns
    p_runs, p_arms = rep.out / f"{rep.sweep.name}_runs.csv", rep.out / f"{rep.sweep.name}_arms.csv"
    with p_runs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", *keys, "seed", "status", "wall_s", *labels, *axes])
        sizes = {ax: {r.id: v for a in rep.arms for r, v in zip(rep.runs_of(a), rep.sizes(ax, a))} for ax in axes}
        for r in rep.runs:
            st = rep.status[r.id] or {}
            vals = [metric_value(rep.sweep.metrics[lab], rep.status[r.id], rep.records[r.id]) for lab in labels]
            vals += [sizes[ax][r.id] for ax in axes]
            w.writerow([r.arm.name, *(r.arm.values.get(k, "") for k in keys), r.seed, st.get("status", "missing"),
                        f"{st.get('wall_s', 0):.1f}", *("" if v is None else v for v in vals)])
    with p_arms.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "metric", "n", "runs", "mean", "std", "ci95_lo", "ci95_hi"])
        for arm in rep.arms:
            for lab in labels:
                s = rep.stat(lab, arm)
                w.writerow([arm.name, lab, *(("", len(rep.runs_of(arm)), "", "", "", "") if s is None else
                                             (s.n, s.total, s.mean, s.std, s.lo, s.hi))])
    return [p_runs, p_arms]


def plot_curves(rep: Report, spec: str) -> str:
    """Mean over seeds per arm, band = min–max over seeds; one panel per value of the sweep's `panels` key."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    split, key = spec.split("/")
    pk = rep.sweep.panels
    groups = {None: rep.arms} if pk is None else {v: [a for a in rep.arms if a.values.get(pk) == v]
                                                  for v in rep.sweep.grid[pk]}
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10" if max(len(g) for g in groups.values()) <= 10 else "tab20")
    top = None
    for ax, (pv, arms_) in zip(axes[0], groups.items()):
        for i, arm in enumerate(arms_):
            series = {}
            for r in rep.runs_of(arm):
                for rec in rep.records[r.id]:
                    if rec["split"] == split and key in rec and math.isfinite(rec[key]):
                        series.setdefault(rec["step"], []).append(rec[key])
            if not series:
                continue
            steps = sorted(series)
            mean = [statistics.fmean(series[s]) for s in steps]
            label = arm.name if pk is None else ", ".join(p for p in arm.name.split(", ")
                                                          if not p.startswith(pk.split(".")[-1] + "="))
            ax.plot(steps, mean, color=cmap(i % cmap.N), label=label or arm.name, lw=1.4)
            ax.fill_between(steps, [min(series[s]) for s in steps], [max(series[s]) for s in steps],
                            color=cmap(i % cmap.N), alpha=0.18, lw=0)
            top = max(top or mean[0], mean[0])
        ax.set_xlabel("step")
        ax.set_title(f"{pk.split('.')[-1]}={pv}" if pk else spec)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(spec)
    if top is not None and split in ("train", "eval") and "loss" in key:
        axes[0][0].set_ylim(top=top * 1.05)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{rep.sweep.name}: {spec}, mean over seeds {list(rep.sweep.seeds)}, band = min–max")
    fig.tight_layout()
    path, link = rep.figure(f"curve_{split}_{key}")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return link


def plot_bars(rep: Report) -> str | None:
    """One panel per numeric metric: arm means with 95% intervals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [lab for lab in rep.sweep.metrics if rep.sweep.metrics[lab] != "diverged"
              and not rep.sweep.metrics[lab].startswith("failed:")
              and any(rep.stat(lab, a) for a in rep.arms)]
    if not labels:
        return None
    h = max(2.5, 0.28 * len(rep.arms) + 1)
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels) + 2.5, h), squeeze=False, sharey=True)
    ys = list(range(len(rep.arms)))
    for ax, lab in zip(axes[0], labels):
        stats = [rep.stat(lab, a) for a in rep.arms]
        mean = [s.mean if s else float("nan") for s in stats]
        err = [[s.mean - s.lo if s else 0 for s in stats], [s.hi - s.mean if s else 0 for s in stats]]
        ax.barh(ys, mean, xerr=err, color="tab:blue", alpha=0.75, ecolor="black", capsize=2)
        ax.set_title(lab, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(ys, [a.name for a in rep.arms], fontsize=7)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{rep.sweep.name}: mean over seeds, 95% interval")
    fig.tight_layout()
    path, link = rep.figure("final")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return link


def write_hparams(rep: Report) -> Path:
    """One TensorBoard HParams entry per finished run: the arm's values and seed -> its metrics."""
    from tensorboardX import SummaryWriter
    base = rep.root / rep.sweep.name / "hparams"
    for r in rep.runs:
        if rep.status[r.id] is None:
            continue
        hp = {k.split(".")[-1]: (v if isinstance(v, (bool, int, float, str)) else str(v))
              for k, v in r.arm.values.items()}
        hp["seed"] = r.seed
        vals = {lab: metric_value(spec, rep.status[r.id], rep.records[r.id]) for lab, spec in rep.sweep.metrics.items()}
        metrics = {f"sweep/{lab}": float(v) for lab, v in vals.items() if isinstance(v, (int, float))}
        with SummaryWriter(str(base / r.id)) as w:
            w.add_hparams(hp, metrics, name=".")
    return base


def write_report(sweep: Sweep, root: str | Path = "runs/sweeps", out: str | Path = "docs/ablations") -> Path:
    """Write the report files (module docstring); returns the Markdown path."""
    rep = Report(sweep, root, out)
    rep.out.mkdir(parents=True, exist_ok=True)
    write_csv(rep)
    curves = [plot_curves(rep, c) for c in sweep.curves]
    bars = plot_bars(rep)
    hp = write_hparams(rep)
    n_done = len(rep.runs) - len(rep.missing)
    lines = [f"# {sweep.title or sweep.name}", ""]
    if sweep.doc:
        lines += [sweep.doc.strip(), ""]
    lines += [f"Regenerate: `jaxformer sweep {sweep.source} && jaxformer report {sweep.source}` (finished runs "
              f"are skipped; add `--jobs N` to run N at a time). Written {time.strftime('%Y-%m-%d')} on "
              f"{machine()}. Compute: {n_done} runs, {rep.wall_s() / 60:.1f} min of wall time in all "
              f"(training, evaluations and compilation, summed over runs).", "",
              f"Base config `{sweep.base}`" + (", with " + ", ".join(f"`{s}`" for s in sweep.set) if sweep.set else "")
              + f"; seeds {list(sweep.seeds)} (`train.seed`: initialisation, dropout and data order)."]
    if rep.missing:
        lines += ["", f"**Incomplete**: {len(rep.missing)} of {len(rep.runs)} runs have not finished: "
                  + ", ".join(rep.missing[:8]) + (" …" if len(rep.missing) > 8 else "")]
    if sweep.summary is not None:
        lines += ["", "## Verdict", "", sweep.summary(rep).strip()]
        if getattr(rep, "info", None) is not None:        # what the summary measured besides the runs
            (rep.out / f"{sweep.name}_info.json").write_text(json.dumps(rep.info, indent=1) + "\n")
    lines += ["", "## Results", "", "Per arm: mean ± std over seeds [95% Student-t interval of the mean]; "
              "(k/n) when only k of n runs have the value.", "", markdown_table(rep), ""]
    lines += [link for link in curves] + ([bars] if bars else [])
    if sweep.scaling:
        from jaxformer.scaling import section
        lines += ["", section(rep).strip()]
    if sweep.extra is not None:
        lines += ["", sweep.extra(rep).strip()]
    lines += ["", f"Data: `{sweep.name}_runs.csv` (one row per run), `{sweep.name}_arms.csv` (per arm and metric). "
              f"TensorBoard HParams: `tensorboard --logdir {hp}`.", ""]
    path = rep.out / f"{sweep.name}.md"
    path.write_text("\n".join(lines))
    return path

