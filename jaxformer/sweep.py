"""Sweeps: a grid (or an explicit list) of config values × seeds, each run a normal, resumable training run.

A sweep file is a Python file with `get_sweep() -> Sweep` (configs/sweeps/ has the shipped ablations):

    from jaxformer.sweep import Sweep
    def get_sweep():
        return Sweep(name="norm", base="configs/alice.py", set=("train.steps=300",),
                     grid={"model.norm.position": ("post", "pre"), "model.num_decoder_layers": (2, 6)},
                     seeds=(0, 1, 2), metrics={"held-out loss": "eval/loss"})

Runs live in ROOT/NAME/ARM/seed-S (ROOT default runs/sweeps). Each is `jaxformer train BASE --set ...
--workdir DIR`, followed by the sweep's extra held-out evaluations (`evals`), and ends by writing DIR/sweep.json
(its status, evaluations and sizes: what the report reads); a run with that file (completed, or diverged: a
non-finite loss) is finished and skipped on rerun, any other run resumes from its checkpoints. `jaxformer sweep
FILE --run I` runs one run, which is also what `--jobs N` launches and what `--print-commands` prints for a
scheduler (a SLURM job array: `--run $SLURM_ARRAY_TASK_ID`).
SIGINT/SIGTERM/SIGHUP stop a sweep within seconds: no further run starts, the running ones (sent the signal,
under --jobs) stop with a checkpoint, and the command exits 128 + the signal's number; rerun it to go on.
`jaxformer report FILE` aggregates the runs (jaxformer.report).

Small runs spend most of their time compiling, and the runs of one arm compile the same programs (the seed is
an argument of each, not a constant): unless JAX already has a persistent compilation cache configured, a
sweep uses ROOT/.jax-cache, so every seed after the first, and every rerun, loads its programs from disk.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from jaxformer import compile_cache
from jaxformer.config import SECTIONED, Config
from jaxformer.configio import apply_overrides, load_config_file, load_python
from jaxformer.errors import ConfigError, Interrupted, JaxformerError, NonFiniteLoss, SweepError
from jaxformer.runs import RunDir
from jaxformer.scaling import AXES, Scaling
from jaxformer.signals import Held
from jaxformer.signals import pending as signal_pending

FINISHED = ("completed", "diverged")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep: the base config, what varies, the seeds, and what the report shows.

    grid: config key -> values; every combination is an arm. arms: an explicit list of arms, each a dict of
    config key -> value (plus an optional "name"); with both, every explicit arm is crossed with the grid.
    set: overrides common to every run. evals: extra held-out evaluations of each trained run, name ->
    overrides of data.* (e.g. longer test strings); one that the model cannot run (e.g. positions past a
    table's end) is recorded with its reason. metrics: report label -> spec (jaxformer.report.metric_value):
    "SPLIT/KEY" (last logged value), "SPLIT/KEY<X" or ">X" (first step that crosses X), "evals:NAME/KEY",
    "diverged". curves: "SPLIT/KEY" learning curves to plot; panels: a grid key, one subplot per value.
    scaling: power-law fits of a metric against the runs' sizes (jaxformer.scaling.Scaling), each a section,
    a plot and OUT/NAME_scaling.json of the report.
    summary(report) and extra(report) return Markdown for the report (a verdict computed from the numbers;
    extra figures)."""
    name: str
    base: str
    seeds: tuple[int, ...] = (0, 1, 2)
    grid: dict[str, tuple] = dataclasses.field(default_factory=dict)
    arms: tuple[dict, ...] = ()
    set: tuple[str, ...] = ()
    evals: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    metrics: dict[str, str] = dataclasses.field(default_factory=lambda: {"held-out loss": "eval/loss"})
    curves: tuple[str, ...] = ("train/loss",)
    panels: str | None = None
    title: str = ""
    doc: str = ""
    summary: Callable[[Any], str] | None = None
    extra: Callable[[Any], str] | None = None
    scaling: tuple = ()
    source: str = ""                       # the sweep file (set by load_sweep)

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"sweep name={self.name!r} must be a non-empty file-name-safe string")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"sweep seeds={self.seeds!r} must be a non-empty list of distinct integers")
        for k, vs in self.grid.items():
            if isinstance(vs, (str, bytes)) or not len(vs):
                raise ConfigError(f"sweep grid[{k!r}]={vs!r} must be a non-empty list of values")
        for i, sc in enumerate(self.scaling):
            if not isinstance(sc, Scaling):
                raise ConfigError(f"sweep scaling[{i}]={sc!r} must be a jaxformer.scaling.Scaling")
            if sc.metric not in self.metrics:
                raise ConfigError(f"sweep scaling[{i}].metric={sc.metric!r} is not a label of the sweep's metrics "
                                  f"({list(self.metrics)})")
        if self.panels is not None and self.panels not in self.grid:
            raise ConfigError(f"sweep panels={self.panels!r} is not a grid key ({list(self.grid)})")


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str                    # "norm_position=pre, num_decoder_layers=6"
    values: dict                 # config key -> value

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name.replace(", ", "__")) or "base"


@dataclasses.dataclass(frozen=True)
class Run:
    index: int
    arm: Arm
    seed: int
    workdir: Path
    overrides: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.arm.slug}/seed-{self.seed}"


def _fmt(v) -> str:
    return json.dumps(v) if isinstance(v, (tuple, list, dict)) or v is None else str(v)


_FLAT = {f"model.{new}": old for old, new in SECTIONED.items()}


def short_name(key: str) -> str:
    """An override key as arm names spell it: its last component (optim.lr -> lr), a model section's field by
    its flat name (model.norm.position -> norm_position, model.runtime.init -> init): unambiguous within the
    model, and the name recorded runs carry."""
    return _FLAT.get(key, key.split(".")[-1])


def arms(sweep: Sweep) -> list[Arm]:
    """Every arm of the sweep, in order (explicit arms outermost, then the grid in key order)."""
    explicit = [dict(a) for a in sweep.arms] or [{}]
    keys = list(sweep.grid)
    out = []
    for a in explicit:
        for combo in itertools.product(*(sweep.grid[k] for k in keys)):
            values = {k: v for k, v in a.items() if k != "name"} | dict(zip(keys, combo))
            parts = ([a["name"]] if "name" in a else [f"{short_name(k)}={_fmt(v)}" for k, v in a.items()])
            parts += [f"{short_name(k)}={_fmt(v)}" for k, v in zip(keys, combo)]
            out.append(Arm(", ".join(parts) or "base", values))
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"sweep {sweep.name}: two arms share a name ({names}); give explicit arms a 'name'")
    return out


def runs(sweep: Sweep, root: str | Path = "runs/sweeps") -> list[Run]:
    """Every run: arms × seeds, arm-major."""
    out = []
    for arm in arms(sweep):
        for seed in sweep.seeds:
            ov = tuple(sweep.set) + tuple(f"{k}={_fmt(v)}" for k, v in arm.values.items()) + (f"train.seed={seed}",)
            out.append(Run(len(out), arm, seed, Path(root) / sweep.name / arm.slug / f"seed-{seed}", ov))
    return out


def load_sweep(path: str | Path) -> Sweep:
    """Import a sweep file and call its get_sweep(). Named errors for a missing or broken file."""
    sweep = load_python(path, "get_sweep", "sweep file", SweepError)
    if not isinstance(sweep, Sweep):
        raise SweepError(f"get_sweep() in {str(path)!r} returned {type(sweep).__name__}, not a jaxformer Sweep")
    return dataclasses.replace(sweep, source=str(path))


def base_config(sweep: Sweep) -> Config:
    """The base config: its path as given, else relative to a directory above the sweep file (a sweep in
    configs/sweeps/ may name configs/alice.py from any working directory)."""
    path = Path(sweep.base)
    if not path.is_absolute() and not path.exists() and sweep.source:
        for up in Path(sweep.source).resolve().parents:
            if (up / path).exists():
                path = up / path
                break
    return load_config_file(path)


def check(sweep: Sweep, all_runs: list[Run]) -> None:
    """Resolve every run's config once, up front: a bad key or value names the arm before anything trains."""
    base = base_config(sweep)
    for r in all_runs:
        try:
            apply_overrides(base, list(r.overrides))
        except ConfigError as e:
            raise ConfigError(f"sweep {sweep.name}, arm {r.arm.name!r}: {e}") from None


def read_status(run: Run) -> dict | None:
    return RunDir(run.workdir).read_sweep_status()


def recorded_sizes(status: dict) -> dict[str, float] | None:
    """A finished run's sizes (scaling.AXES -> number) as its sweep.json records them (`run_one`); None for a
    record without them all (written before sweeps kept sizes, or before an axis was added)."""
    sizes = status.get("sizes")
    ok = isinstance(sizes, dict) and all(isinstance(sizes.get(k), (int, float)) for k in AXES)
    return {k: float(sizes[k]) for k in AXES} if ok else None


def computed_sizes(run: Run) -> dict[str, float]:
    """A run's sizes (AXES) from its resolved config.json (`train.flops.run_size`): what `run_one` records, and
    a report's fallback for a run recorded without them (a rerun of `jaxformer sweep` skips finished runs, so
    would not record them). The one place a report reaches the model code, imported only here."""
    from jaxformer.train.flops import run_size
    return run_size(RunDir(run.workdir).read_config())


def finished(run: Run) -> bool:
    """The run has its sweep.json (completed or diverged). SweepError if that run was made with other
    overrides: the sweep file changed under finished runs, whose results would otherwise be mixed in."""
    st = read_status(run)
    if st is None or st.get("status") not in FINISHED:
        return False
    if st.get("overrides") != list(run.overrides):
        raise SweepError(f"{run.workdir} was run with other overrides than the sweep file now gives "
                         f"({' '.join(st.get('overrides', []))} vs {' '.join(run.overrides)}); rename the sweep or "
                         f"move its runs away")
    return True


def run_one(sweep: Sweep, run: Run) -> dict:
    """Train one run (resuming if it has checkpoints), then its extra evaluations; write RUN/sweep.json.
    A non-finite loss finishes the run as "diverged". Returns the status dict, with "signal": the stop signal
    that training received (its name; None if none), also when that came at the last step (completed)."""
    from jaxformer.train.loop import train
    if finished(run):
        return read_status(run)
    cfg = apply_overrides(base_config(sweep), list(run.overrides))
    t0 = time.perf_counter()
    signame = None
    try:
        out = train(cfg, run.workdir, progress="none")
        status = {"status": "completed" if out["status"] == "completed" else "interrupted", "step": out["step"],
                  "eval": out["eval"]}
        signame = out["signal"]
    except NonFiniteLoss as e:
        status = {"status": "diverged", "error": str(e), "eval": {}}
    if status["status"] == "completed":
        status["evals"] = {name: _extra_eval(run, ov) for name, ov in sweep.evals.items()}
    status.update(arm=run.arm.name, seed=run.seed, overrides=list(run.overrides),
                  wall_s=time.perf_counter() - t0 + _earlier_wall(run))
    if status["status"] == "interrupted":       # resumed later: its wall time so far counts then
        RunDir(run.workdir).write_partial_wall(status["wall_s"])
    else:
        status["sizes"] = computed_sizes(run)     # read by the report (scaling fits) without the model code
        RunDir(run.workdir).write_sweep_status(status)
    return status | {"signal": signame}


def _earlier_wall(run: Run) -> float:
    """Wall time of earlier, interrupted attempts (kept in RUN/sweep.partial)."""
    return RunDir(run.workdir).read_partial_wall()


def _extra_eval(run: Run, overrides: tuple[str, ...]) -> dict:
    """Evaluate the run's final model on a changed held-out set (data.* overrides)."""
    from jaxformer.data import build_task
    from jaxformer.inference import evaluate, load_model
    try:
        loaded = load_model(run.workdir, "latest")
        cfg = apply_overrides(loaded.cfg, list(overrides))
        task = build_task(cfg.data, loaded.tokenizer)
        return evaluate(cfg, task, loaded.model)
    except JaxformerError as e:                 # e.g. no position past model.max_len: a result, not a crash
        return {"error": str(e)}


def command(sweep: Sweep, run: Run) -> str:
    return shlex.join(["jaxformer", "sweep", sweep.source, "--run", str(run.index), "--root",
                       str(run.workdir.parents[2])])


def select(all_runs: list[Run], which: list[str]) -> list[Run]:
    """--run values: an index (0-based) or a run id ARM/seed-S. A run named twice (by index and id alike) is
    selected once: run twice, it would be trained twice at once under --jobs, and counted twice."""
    out = []
    for w in which:
        hit = [r for r in all_runs if (w.isdigit() and r.index == int(w)) or r.id == w]
        if not hit:
            raise SweepError(f"--run {w!r} is neither an index in [0, {len(all_runs)}) nor a run id of this sweep")
        out += [r for r in hit if r not in out]
    return out


def use_compilation_cache(root: str | Path) -> None:
    """Point JAX's persistent compilation cache at ROOT/.jax-cache unless one is configured already."""
    compile_cache.enable(Path(root) / ".jax-cache")


def run_sweep(sweep: Sweep, root: str | Path = "runs/sweeps", jobs: int = 1, only: list[str] | None = None,
              echo: Callable[[str], None] = print) -> dict[str, int]:
    """Run every unfinished run (or the selected ones), one after another in this process, or `jobs` at a
    time as child processes (`jaxformer sweep FILE --run I`, output in RUN/sweep.log). Returns counts per
    status ("skipped" = finished before). SweepError at the end if any run failed. A stop signal
    (SIGINT/SIGTERM/SIGHUP) starts no further run, stops the running ones with their checkpoints (sent on to
    the children) and raises Interrupted, exit code 128 + the signal's number; the same call resumes."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs {jobs} must be at least 1 (1: one run after another in this process)")
    all_runs = runs(sweep, root)
    check(sweep, all_runs)
    use_compilation_cache(root)
    todo = select(all_runs, only) if only else all_runs
    counts: dict[str, int] = {}
    left = []
    for r in todo:
        if finished(r):
            counts["skipped"] = counts.get("skipped", 0) + 1
        else:
            left.append(r)
    echo(f"sweep {sweep.name}: {len(all_runs)} runs, {len(todo) - len(left)} finished before, "
         f"{len(left)} to run" + (f", {jobs} at a time" if jobs > 1 else ""))
    failed = []
    if jobs <= 1:
        for i, r in enumerate(left):
            if signal_pending():            # between runs (e.g. during the last one's extra evaluations)
                raise interrupted(sweep, signal_pending(), [], len(left) - i)
            echo(f"[{r.index + 1}/{len(all_runs)}] {r.id}")
            try:
                st = run_one(sweep, r)
            except JaxformerError as e:           # this run cannot go on; the others still can (as with --jobs)
                echo(f"{r.id}: failed: {e}")
                counts["failed"] = counts.get("failed", 0) + 1
                failed.append(r)
                continue
            counts[st["status"]] = counts.get(st["status"], 0) + 1
            if st.get("signal"):              # stopped with a checkpoint (or at its last step: finished)
                raise interrupted(sweep, st["signal"], [r] if st["status"] == "interrupted" else [],
                                  len(left) - i - 1)
    else:
        def done(r: Run, rc: int) -> None:
            st = read_status(r)
            status = st["status"] if st else "interrupted" if rc > 128 else "failed"
            counts[status] = counts.get(status, 0) + 1
            echo(f"{r.id}: {status}" + (f" (exit {rc}, see {r.workdir / 'sweep.log'})" if rc else ""))
            if status not in FINISHED:
                failed.append(r)
        with Held("the running runs have stopped, each with its checkpoint") as sig:
            signame, stopped, unstarted = run_children(left, lambda r: _start_child(sweep, root, r), jobs,
                                                       lambda: sig.received, done)
        if signame is not None:                   # those that ended with it, finished, are not "stopped"
            raise interrupted(sweep, signame, [r for r in stopped if r in failed], unstarted)
    echo("sweep " + sweep.name + ": " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if failed:
        raise SweepError(f"{len(failed)} run(s) did not finish: " + ", ".join(r.id for r in failed))
    return counts


def _start_child(sweep: Sweep, root: str | Path, r: Run) -> subprocess.Popen:
    """`jaxformer sweep FILE --run I` in a process of its own, its output appended to RUN/sweep.log."""
    r.workdir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "jaxformer.cli", "sweep", sweep.source, "--run", str(r.index), "--root", str(root)]
    with open(r.workdir / "sweep.log", "a") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def run_children(left: list[Run], start: Callable[[Run], Any], jobs: int, stop: Callable[[], str | None],
                 done: Callable[[Run, int], None], poll_s: float = 0.1) -> tuple[str | None, list[Run], int]:
    """Run `left` in order, `jobs` at a time: start(run) -> a child (a subprocess.Popen, or anything with
    poll(), send_signal(signum), wait()); done(run, returncode) as each one ends. stop() -> the name of a stop
    signal received ("SIGTERM"), or None; once it names one, no further child starts, the signal is sent to
    each running child and this waits until they have ended (each stops with a checkpoint). An error here
    (e.g. stdout closed) stops the running children likewise, with SIGTERM, before it propagates.
    -> (that signal's name or None, the runs that were running when it came, how many never started)."""
    queue, live, signame = list(left), [], None
    try:
        while (queue or live) and signame is None:
            while queue and len(live) < jobs and stop() is None:
                r = queue.pop(0)
                live.append((r, start(r)))
            for r, child in list(live):
                rc = child.poll()
                if rc is not None:
                    live.remove((r, child))
                    done(r, rc)
            if live and stop() is None:
                time.sleep(poll_s)
            signame = stop()
    except BaseException:
        _stop_children(live, "SIGTERM", lambda r, rc: None)
        raise
    _stop_children(live, signame, done)
    return signame, [r for r, _ in live], len(queue)


def _stop_children(live: list[tuple[Run, Any]], signame: str | None, done: Callable[[Run, int], None]) -> None:
    """Send each running child the signal, then wait for each to end (done(run, returncode))."""
    for _, child in live if signame else ():
        child.send_signal(signal.Signals[signame])
    for r, child in live:
        done(r, child.wait())


def interrupted(sweep: Sweep, signame: str, stopped: list[Run], unstarted: int) -> Interrupted:
    """The sweep's Interrupted error: which runs were stopped, how many never started, how to resume; its
    exit_code is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP)."""
    ran = (f"stopped {', '.join(r.id for r in stopped)} (each keeps its checkpoints)" if stopped
           else "no run was stopped mid-way")
    return Interrupted(f"sweep {sweep.name} stopped on {signame}: {ran}, {unstarted} run(s) not started; the same "
                       f"`jaxformer sweep` command resumes the grid (finished runs are skipped, stopped ones resume "
                       f"from their checkpoints)", signame)
