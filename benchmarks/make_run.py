"""Where the wall time of `make run` goes: the quickstart's training command, end to end, split into phases.

  .venv/bin/python benchmarks/make_run.py [--runs 3] [--config configs/reverse.py] [--against REV] [--out STEM]

Each run is a fresh process of exactly what `make run` executes (`jaxformer train CONFIG`, here with
--no-progress and a new temporary --workdir), so nothing is cached between runs. The process's own wall time
is measured from outside; the phases come from the run's RUN/timings.jsonl, which the training loop writes
(jaxformer/train/loop.py, `train()`'s timings):
  setup        config, data, building the initial state;
  first step   tracing and XLA compilation of the train step, plus the step itself;
  steps        every later train step, including the loop's periodic host reads (metrics, NaN check);
  eval         held-out evaluation at each eval step (its first call compiles the eval step and the decoder);
  checkpoint   saving (each save returns once it is written);
  examples     decoding the final examples printed at the end;
  start + exit the rest: interpreter start, imports, printing, shutdown.
Medians and min–max over --runs. Writes benchmarks/results/make_run.md and .json (or --out STEM.md/.json).

--against REV: is this tree's `make run` slower than commit REV's, on this machine, today? REV is checked out into
a temporary git worktree and each of the --runs rounds runs both trees, one after the other, in alternating order
(REV's package first on the child's PYTHONPATH, started through REV's own `jaxformer` entry point, with this
environment's installed dependencies). Per phase: the ratio this tree / REV with the 95% interval of the mean
paired log ratio (benchmarks/levers.py's `paired`). Comparing two results files written on different days says
little on a VM whose speed drifts by more than the effect.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
PHASES = ("setup", "first_step", "steps", "eval", "checkpoint", "examples")


def entry(tree: Path) -> list[str]:
    """The `jaxformer` command of a source tree: the installed script for this one, else the tree's own entry
    point (pyproject's [project.scripts]) run by this interpreter."""
    if tree == ROOT:
        return [str(Path(sys.executable).parent / "jaxformer")]
    mod, fn = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["jaxformer"].split(":")
    return [sys.executable, "-c", f"import sys; from {mod} import {fn}; sys.exit({fn}())"]


def one_run(config: str, tree: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [*entry(tree), "train", config, "--no-progress", "--workdir", f"{d}/run"]
        env = None if tree == ROOT else {**os.environ, "PYTHONPATH": str(tree)}
        t = time.perf_counter()
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
        rec = json.loads((Path(d) / "run/timings.jsonl").read_text().splitlines()[-1])
        accuracy = next((line for line in out.stdout.splitlines() if "exact-match accuracy" in line), "")
    rec["wall"] = wall
    rec["start + exit"] = wall - sum(rec[k] for k in PHASES)
    rec["result"] = accuracy.strip()
    return rec


@contextlib.contextmanager
def worktree(rev: str | None):
    """A temporary detached git worktree of commit REV (None: no tree), removed afterwards."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as d:
        tree = Path(d) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def compare(rev: str, runs: list[dict], theirs: list[dict]) -> dict | None:
    """Per phase, this tree / REV over the rounds where both runs succeeded -> {"phases": {phase: paired ratio,
    medians}, "commit", "subject"}; None with fewer than two such rounds."""
    from levers import paired
    pairs = [(m, t) for m, t in zip(runs, theirs) if "error" not in m and "error" not in t]
    if len(pairs) < 2:
        return None
    log = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h%x00%s", rev], capture_output=True,
                         text=True).stdout.strip().split("\0")
    phases = {}
    for k in ("wall", "first_step", "steps"):
        mine, rev_s = [m[k] for m, _ in pairs], [t[k] for _, t in pairs]
        phases[k] = {**paired(rev_s, mine), "this": statistics.median(mine), "rev": statistics.median(rev_s)}
    return {"commit": log[0], "subject": log[-1][:100], "phases": phases}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", default="configs/reverse.py")
    p.add_argument("--against", metavar="REV", help="also run commit REV's tree, alternating (see the docstring)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/make_run"), help="path stem of .md and .json")
    a = p.parse_args(argv)
    if a.against and subprocess.run(["git", "-C", str(ROOT), "rev-parse", "-q", "--verify", f"{a.against}^{{commit}}"],
                                    capture_output=True).returncode:
        p.error(f"--against {a.against!r}: not a commit of this repository")
    from jaxformer.config import Config  # noqa: F401  (fail here, not in a child, if the package is missing)
    from jaxformer.configio import load_config_file
    from jaxformer.stats import machine
    cfg = load_config_file(str(ROOT / a.config))
    runs, theirs = [], []
    with worktree(a.against) as other:
        for i in range(a.runs):
            for tree in ((ROOT, other) if i % 2 == 0 else (other, ROOT)) if other else (ROOT,):
                side = runs if tree == ROOT else theirs
                side.append(one_run(a.config, tree))
                print(i, "this tree" if tree == ROOT else a.against, side[-1], flush=True)
    ok = [r for r in runs if "error" not in r]
    cols = (*PHASES, "start + exit", "wall")
    stats = {k: {"median": statistics.median(r[k] for r in ok), "min": min(r[k] for r in ok),
                 "max": max(r[k] for r in ok)} for k in cols} if ok else {}
    command = shlex.join(["python", "benchmarks/make_run.py", *argv])
    tc = cfg.train
    lines = ["# `make run`, end to end", "", f"`{command}`", "", f"Machine: {machine()}", "",
             f"Config {a.config}: {tc.steps} steps of batch {cfg.data.batch_size}, evaluation every "
             f"{tc.eval_every} steps, a checkpoint every {tc.checkpoint_every}; {len(ok)} of {len(runs)} runs "
             "succeeded.", "", __doc__.split("\n\n")[2].split("Medians")[0].strip(), "",
             "| phase | median s | min–max s | share of wall |", "|---|---:|---:|---:|"]
    for k in cols:
        if k in stats:
            s = stats[k]
            lines.append(f"| {k.replace('_', ' ')} | {s['median']:.2f} | {s['min']:.2f}–{s['max']:.2f} | "
                         f"{s['median'] / stats['wall']['median']:.0%} |")
    if ok:
        steps_s = stats["steps"]["median"] / max(tc.steps - 1, 1)
        lines += ["", f"Train steps after the first: {1e3 * steps_s:.2f} ms each. Results printed: "
                  + "; ".join(sorted({r['result'] for r in ok}))]
    lines += ["", "Errors: " + "; ".join(r["error"] for r in runs if "error" in r)] if len(ok) < len(runs) else []
    against = compare(a.against, runs, theirs) if a.against else None
    if against:
        lines += ["", f"## Against {a.against} ({against['commit']}: {against['subject']})", "",
                  f"The same {a.runs} rounds, each running this tree and {a.against} in alternating order "
                  "(--against in this script's docstring). Ratio this tree / REV, the 95% interval of the mean "
                  "paired log ratio, and its verdict (a change under 2% counts as none).", "",
                  "| phase | this tree median s | REV median s | this / REV [95%] | verdict |",
                  "|---|---:|---:|---|---|"]
        for k, r in against["phases"].items():
            lines.append(f"| {k.replace('_', ' ')} | {r['this']:.2f} | {r['rev']:.2f} | {r['ratio']:.3f} "
                         f"[{r['lo']:.3f}, {r['hi']:.3f}] ({r['pairs']} pairs) | {r['verdict']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    Path(a.out + ".json").write_text(json.dumps({"command": command, "machine": machine(), "runs": runs,
                                                 "stats": stats, "against": against}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
