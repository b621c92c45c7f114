"""Where the wall time of `make run` goes: the quickstart's training command, end to end, split into phases.

  .venv/bin/python benchmarks/make_run.py [--runs 3] [--config configs/reverse.py] [--out STEM]

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
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PHASES = ("setup", "first_step", "steps", "eval", "checkpoint", "examples")


def one_run(config: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(Path(sys.executable).parent / "jaxformer"), "train", config, "--no-progress", "--workdir",
               f"{d}/run"]
        t = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
        rec = json.loads((Path(d) / "run/timings.jsonl").read_text().splitlines()[-1])
        accuracy = next((line for line in out.stdout.splitlines() if "exact-match accuracy" in line), "")
    rec["wall"] = wall
    rec["start + exit"] = wall - sum(rec[k] for k in PHASES)
    rec["result"] = accuracy.strip()
    return rec


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", default="configs/reverse.py")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/make_run"), help="path stem of .md and .json")
    a = p.parse_args(argv)
    from jaxformer.config import Config  # noqa: F401  (fail here, not in a child, if the package is missing)
    from jaxformer.configio import load_config_file
    from jaxformer.report import machine
    cfg = load_config_file(str(ROOT / a.config))
    runs = []
    for i in range(a.runs):
        runs.append(one_run(a.config))
        print(i, runs[-1], flush=True)
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
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    Path(a.out + ".json").write_text(json.dumps({"command": command, "machine": machine(), "runs": runs,
                                                 "stats": stats}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
