"""Sweeps and reports: a 2x2-arm x 2-seed grid on a tiny config, resumed and reported; named errors."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import textwrap

import pytest

from helpers import ROOT, TINY_LM, records
from jaxformer.cli import main
from jaxformer.errors import ConfigError, SweepError
from jaxformer.report import metric_value, write_report
from jaxformer.stats import stat
from jaxformer.sweep import load_sweep, run_sweep, runs
from jaxformer.train.loop import train

STEPS = 6


def _sweep_file(tmp_path, name="grid", grid=None, extra="", evals=None):
    grid = grid or {"optim.lr": (1e-3, 3e-3), "model.norm.position": ("post", "pre")}
    common = tuple(TINY_LM) + (f"train.steps={STEPS}", "train.log_every=2", f"train.eval_every={STEPS}",
                                f"train.checkpoint_every={STEPS}", "train.num_examples=0",
                                "train.eval_batch_size=8")     # one eval batch shape for every held-out set
    text = textwrap.dedent(f"""
        from jaxformer.sweep import Sweep
        def get_sweep():
            return Sweep(name={name!r}, base={str(ROOT / 'configs/alice.py')!r}, set={common!r}, grid={grid!r},
                         seeds=(0, 1), evals={evals or {}!r},
                         panels={"model.norm.position" if "model.norm.position" in grid else None!r},
                         metrics={{"loss": "eval/loss", "steps to < 9": "train/loss<9", "first": "train/loss@first",
                                   "diverged": "diverged", "failed": "failed:train/loss>9"{extra}}})
        """)
    p = tmp_path / f"{name}.py"
    p.write_text(text)
    return p


@pytest.mark.slow          # a 2 x 2 grid trained, resumed, skipped and reported: ~45 s
def test_grid_runs_resume_skip_and_report(tmp_path, capsys):
    path = _sweep_file(tmp_path, evals={"half": ("data.eval_fraction=0.5",), "long": ("data.block_size=200",)},
                       extra=', "half": "evals:half/loss", "long": "evals:long/loss"')
    sweep, root = load_sweep(path), tmp_path / "runs"
    rs = runs(sweep, root)
    assert len(rs) == 8 and len({r.workdir for r in rs}) == 8
    assert [r.arm.name for r in rs[:2]] == ["lr=0.001, norm_position=post"] * 2 and [r.seed for r in rs[:2]] == [0, 1]
    # a run interrupted before the sweep: the sweep resumes it from its checkpoint instead of restarting it
    from jaxformer.configio import apply_overrides, load_config_file
    cfg = apply_overrides(load_config_file(sweep.base), list(rs[3].overrides))
    train(cfg, rs[3].workdir, stop_after=2, progress="none")
    # two runs first (as a job array would), then the whole sweep: the two are skipped
    assert main(["sweep", str(path), "--root", str(root), "--run", "0", "--run", rs[1].id]) == 0
    counts = run_sweep(sweep, root, echo=lambda m: None)
    assert counts == {"skipped": 2, "completed": 6}
    assert run_sweep(sweep, root, echo=lambda m: None) == {"skipped": 8}
    steps3 = [r["step"] for r in records(rs[3].workdir) if r["split"] == "train"]
    assert steps3 == [2, 4, 6], steps3                    # one history: resumed at step 2, not restarted
    for r in rs:
        st = json.loads((r.workdir / "sweep.json").read_text())
        assert st["status"] == "completed" and st["seed"] == r.seed and math.isfinite(st["evals"]["half"]["loss"])
        assert f"train.seed={r.seed}" in st["overrides"] and st["sizes"]["params"] > 0    # for scaling fits
    # seeds differ, arms differ: the runs are not copies of each other
    losses = [json.loads((r.workdir / "sweep.json").read_text())["eval"]["loss"] for r in rs]
    assert len(set(losses)) == 8

    out = tmp_path / "docs"
    md = write_report(sweep, root, out)
    text = md.read_text()
    assert f"jaxformer sweep {path}" in text and "cores" in text and "8 runs" in text
    for arm in ("lr=0.001, norm_position=post", "lr=0.003, norm_position=pre"):
        assert f"| {arm} |" in text
    assert "n/a: data length 200 exceeds model.max_len=100" in text      # a table PE past its end: reported
    assert (out / "grid_curve_train_loss.png").stat().st_size > 1000 and (out / "grid_final.png").exists()
    rows = list(csv.DictReader((out / "grid_runs.csv").open()))
    assert len(rows) == 8 and {r["status"] for r in rows} == {"completed"}
    arms = list(csv.DictReader((out / "grid_arms.csv").open()))
    loss0 = [r for r in arms if r["arm"] == "lr=0.001, norm_position=post" and r["metric"] == "loss"][0]
    vals = [float(r["loss"]) for r in rows if r["arm"] == "lr=0.001, norm_position=post"]
    assert float(loss0["mean"]) == pytest.approx(sum(vals) / 2) and int(loss0["n"]) == 2
    assert float(loss0["ci95_lo"]) < float(loss0["mean"]) < float(loss0["ci95_hi"])
    events = list((root / "grid" / "hparams").rglob("events.out.tfevents*"))
    assert len(events) >= 8                                     # one HParams entry per run
    # the sweep file changes under finished runs: refused, naming the run, rather than mixing results
    path.write_text(path.read_text().replace("train.log_every=2", "train.log_every=3"))
    with pytest.raises(SweepError, match="other overrides"):
        run_sweep(load_sweep(path), root, echo=lambda m: None)


def _printed_commands(path, root, capsys) -> list[str]:
    assert main(["sweep", str(path), "--root", str(root), "--print-commands"]) == 0
    cmds = capsys.readouterr().out.strip().splitlines()
    assert all(c.startswith(f"jaxformer sweep {path} --run ") and c.endswith(f"--root {root}") for c in cmds), cmds
    return cmds


def test_print_commands_and_list_run_nothing(tmp_path, capsys):
    path = _sweep_file(tmp_path, name="cmds")
    root = tmp_path / "runs"
    cmds = _printed_commands(path, root, capsys)
    assert [c.split()[4] for c in cmds] == [str(i) for i in range(8)]
    assert main(["sweep", str(path), "--root", str(root), "--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == 8 and all("not finished" in x and "train.seed=" in x for x in listed)
    assert "lr=0.003__norm_position=pre/seed-1" in listed[-1] and not root.exists()


@pytest.mark.slow
def test_jobs_run_as_child_processes(tmp_path, capsys):
    path = _sweep_file(tmp_path, name="jobs", grid={"optim.lr": (1e-3,)})
    sweep, root = load_sweep(path), tmp_path / "runs"
    cmds = _printed_commands(path, root, capsys)
    assert len(cmds) == 2
    assert run_sweep(sweep, root, jobs=2, echo=lambda m: None) == {"completed": 2}
    assert all((r.workdir / "sweep.log").exists() for r in runs(sweep, root))
    # the pool ran exactly the printed command lines (python -m jaxformer.cli = the jaxformer script)
    logs = [(r.workdir / "sweep.log").read_text() for r in runs(sweep, root)]
    assert all("0 finished before, 1 to run" in t and "1 completed" in t for t in logs), logs
    argv = cmds[0].split()
    assert argv[1:4] == ["sweep", str(path), "--run"] and argv[-2:] == ["--root", str(root)]
    assert main(argv[1:]) == 0 and "1 finished before, 0 to run" in capsys.readouterr().out


def test_metric_specs_and_statistics():
    recs = [{"step": 2, "split": "train", "loss": 4.0}, {"step": 4, "split": "train", "loss": 2.0},
            {"step": 4, "split": "eval", "loss": 2.5}]
    done, bad = {"status": "completed", "evals": {"x": {"loss": 1.0}, "y": {"error": "too long"}}}, {"status": "diverged"}
    assert metric_value("train/loss", done, recs) == 2.0 and metric_value("train/loss@first", done, recs) == 4.0
    assert metric_value("train/loss@min", done, recs) == 2.0 and metric_value("train/loss@max", done, recs) == 4.0
    assert metric_value("train/loss@median", done, recs) == 3.0
    assert metric_value("train/loss<3", done, recs) == 4.0 and metric_value("train/loss<1", done, recs) is None
    assert metric_value("evals:x/loss", done, recs) == 1.0 and metric_value("evals:y/loss", done, recs) == "too long"
    assert metric_value("train/loss", bad, recs) is None and metric_value("diverged", bad, recs) == 1.0
    assert metric_value("failed:train/loss>3", bad, recs) == 1.0 and metric_value("failed:train/loss>3", done, recs) == 0
    assert metric_value("eval/loss", None, recs) is None
    with pytest.raises(SweepError, match="not SPLIT/KEY"):
        metric_value("loss", done, recs)
    s = stat([1.0, 2.0, 3.0, None])
    # mean 2, std 1, t(0.975, 2) = 4.303: interval 2 ± 4.303/sqrt(3)
    assert (s.n, s.total, s.mean, s.std) == (3, 4, 2.0, 1.0)
    assert s.hi - s.mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5) and s.mean - s.lo == pytest.approx(s.hi - s.mean)
    assert stat([None, float("nan")]) is None and stat([5.0]).lo == 5.0


def test_bad_sweeps_are_named_errors(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def get_sweep(:\n")
    (tmp_path / "nothing.py").write_text("x = 1\n")
    for f, msg in (("missing.py", "does not exist"), ("broken.py", "SyntaxError"), ("nothing.py", "no get_sweep")):
        assert main(["sweep", str(tmp_path / f)]) == 2
        assert msg in capsys.readouterr().out
    bad = _sweep_file(tmp_path, name="bad", grid={"model.d_model": (31,)})
    assert main(["sweep", str(bad), "--root", str(tmp_path / "r")]) == 2
    out = capsys.readouterr().out
    assert "arm 'd_model=31'" in out and "model.d_model=31" in out and not (tmp_path / "r").exists()
    ok = _sweep_file(tmp_path, name="ok", grid={"optim.lr": (1e-3,)})
    assert main(["sweep", str(ok), "--root", str(tmp_path / "r"), "--run", "7"]) == 2
    assert "--run '7'" in capsys.readouterr().out
    assert main(["report", str(ok), "--root", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 2
    assert "no finished run" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="seeds"):
        from jaxformer.sweep import Sweep
        Sweep(name="x", base="b", seeds=())
    with pytest.raises(ConfigError, match="panels"):
        Sweep(name="x", base="b", grid={"optim.lr": (1,)}, panels="model.d_model")


def test_shipped_sweeps_load_and_resolve():
    """Every shipped sweep file loads and every one of its runs has a valid config (nothing trains)."""
    from jaxformer.sweep import check
    files = sorted((ROOT / "configs/sweeps").glob("*.py"))
    assert len(files) >= 6
    for f in files:
        sweep = load_sweep(f)
        rs = runs(sweep)
        assert len(sweep.seeds) >= 3 and rs
        check(sweep, rs)


def test_a_finished_run_records_its_sizes_for_the_report(tmp_path, monkeypatch):
    """run_one writes the run's sizes (scaling.AXES, by train.flops.run_size from the resolved config.json that
    training wrote) into its sweep.json, completed or diverged: the report reads them there, without the model
    code. Training is faked (it writes the config, then finishes or diverges). Before: no sizes recorded."""
    import jaxformer.train.loop as loop
    from jaxformer.config import to_dict
    from jaxformer.configio import apply_overrides
    from jaxformer.errors import NonFiniteLoss
    from jaxformer.sweep import recorded_sizes, run_one
    from jaxformer.train.flops import run_size
    sweep = load_sweep(_sweep_file(tmp_path, name="sized", grid={"model.d_model": (16, 24)}))
    resolved = {}

    def fake_train(cfg, workdir, progress):
        cfg = resolved[str(workdir)] = apply_overrides(cfg, ["model.vocab_size=40"])    # as the data resolves it
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(to_dict(cfg)))
        if cfg.model.d_model == 24:
            raise NonFiniteLoss("loss nan at step 3")
        return {"status": "completed", "step": STEPS, "eval": {"loss": 2.0}, "signal": None}
    monkeypatch.setattr(loop, "train", fake_train)
    for r in runs(sweep, tmp_path / "runs")[::2]:
        st = run_one(sweep, r)
        written = json.loads((r.workdir / "sweep.json").read_text())
        assert written["status"] == st["status"] == ("completed" if "d_model=16" in r.id else "diverged")
        assert recorded_sizes(written) == written["sizes"] == run_size(resolved[str(r.workdir)])
    assert recorded_sizes({"sizes": {"params": 1.0}}) is None      # an axis missing: computed, not a KeyError


def test_torn_and_non_utf8_metric_lines_are_skipped_by_runs_and_report(tmp_path):
    from jaxformer.report import Report
    from jaxformer.runs import RunDir, read_metrics
    sweep, root = load_sweep(_sweep_file(tmp_path, name="torn", grid={"optim.lr": (1e-3,)})), tmp_path / "runs"
    good = [{"step": 2, "split": "train", "loss": 4.0}, {"step": 4, "split": "eval", "loss": 2.5}]
    text = (json.dumps(good[0]).encode() + b"\n\xff\xfe{\"step\": 3}\n"                # not UTF-8
            + b'{"step": 4, "split": "train", "loss": \xff}\n[1, 2]\n{"split": "train"}\n{"step": true}\n\n'
            + json.dumps(good[1]).encode() + b'\n{"step": 6, "split": "tr')          # torn last line
    for r in runs(sweep, root):
        r.workdir.mkdir(parents=True)
        (r.workdir / "metrics.jsonl").write_bytes(text)
        (r.workdir / "sweep.json").write_text(json.dumps({"status": "completed", "overrides": list(r.overrides),
                                                          "evals": {}, "wall_s": 1.0}))
    r = runs(sweep, root)[0]
    assert read_metrics(r.workdir / "metrics.jsonl") == good == RunDir(r.workdir).read_metrics()
    assert read_metrics(tmp_path / "none.jsonl") == []
    rep = Report(sweep, root, tmp_path / "out")
    assert rep.records[r.id] == good and rep.values("loss", r.arm) == [2.5, 2.5]


@pytest.mark.slow          # three tiny trainings (~6 s)
def test_a_sequential_sweep_goes_on_past_a_failing_run(tmp_path):
    """One run's data cannot serve its batch size (a DataError at train time): the sequential sweep records it
    as failed, runs the others, and names the failure at the end (as --jobs does)."""
    from jaxformer.errors import SweepError
    path = _sweep_file(tmp_path, name="mixed", grid={"data.batch_size": (100000, 8)})
    sweep, root = load_sweep(path), tmp_path / "runs"
    sweep = dataclasses.replace(sweep, seeds=(0,))
    with pytest.raises(SweepError, match="did not finish"):
        run_sweep(sweep, root, echo=lambda m: None)
    assert [r.arm.name for r in runs(sweep, root) if (r.workdir / "sweep.json").exists()] == ["batch_size=8"]
