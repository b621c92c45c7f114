"""Lay a published report's runs back out as finished run records, for the arms a change did not touch, so that
`jaxformer report SWEEP` can rebuild the report from them and the arms that were rerun:

    python tools/runs_from_csv.py configs/sweeps/mup_transfer.py --step 300 --arm "sp, " --arm "mup, D=64,"

Each run of the sweep whose arm name starts with one of the --arm prefixes, and that has no finished record under
--root yet, gets ROOT/NAME/ARM/seed-S/sweep.json (its status, wall time and metrics, as the committed
docs/ablations/NAME_runs.csv gives them, marked "restored_from") and a metrics.jsonl of its last evaluation. Only
metrics of the form "eval/KEY" (the last held-out value) can be restored; anything else is refused. Checkpoints
and curves are not restored: use it only for arms whose code did not change, and say so where the report is used.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from jaxformer.sweep import finished, load_sweep, runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep")
    p.add_argument("--arm", action="append", required=True, help="an arm-name prefix (repeatable)")
    p.add_argument("--root", default="runs/sweeps")
    p.add_argument("--csv-dir", default="docs/ablations")
    p.add_argument("--step", type=int, required=True, help="the step the runs' last evaluation was logged at")
    args = p.parse_args(argv)
    sweep = load_sweep(args.sweep)
    bad = [m for m, spec in sweep.metrics.items() if not spec.startswith("eval/")]
    if bad:
        print(f"metrics {bad} are not last held-out values (eval/KEY): they cannot be restored", file=sys.stderr)
        return 2
    path = Path(args.csv_dir) / f"{sweep.name}_runs.csv"
    with path.open(newline="", encoding="utf-8") as f:
        rows = {(r["arm"], int(r["seed"])): r for r in csv.DictReader(f)}
    laid = 0
    for run in runs(sweep, args.root):
        row = rows.get((run.arm.name, run.seed))
        if not any(run.arm.name.startswith(a) for a in args.arm) or finished(run) or row is None:
            continue
        if row["status"] != "completed":
            continue
        run.workdir.mkdir(parents=True, exist_ok=True)
        metrics = {spec.split("/", 1)[1]: float(row[label]) for label, spec in sweep.metrics.items()}
        record = {"status": "completed", "step": args.step, "eval": metrics, "evals": {}, "arm": run.arm.name, "seed": run.seed,
                  "overrides": list(run.overrides), "wall_s": float(row["wall_s"] or 0),
                  "restored_from": str(path)}
        (run.workdir / "sweep.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        (run.workdir / "metrics.jsonl").write_text(json.dumps({"step": args.step, "split": "eval", **metrics}) + "\n",
                                                   encoding="utf-8")
        laid += 1
    print(f"restored {laid} finished run record(s) of {sweep.name} from {path} under {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
