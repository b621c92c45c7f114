"""Stop signals to `jaxformer sweep` (issue R4): SIGINT/SIGTERM/SIGHUP start no further run, are sent on to the
running children (--jobs N), which stop with their checkpoints, and the sweep exits 128 + the signal's number
with one named line; the same command resumes the grid. Before, the parent held the signal until the whole grid
had finished (starting the queued runs meanwhile), and --jobs 1 exited 130 on any signal, unnamed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, checkpoint_steps, train_losses
from test_sweep import _sweep_file

import jaxformer.sweep as sw
from jaxformer.cli import main
from jaxformer.errors import Interrupted
from jaxformer.sweep import load_sweep, run_children, run_sweep, runs

SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


class FakeChild:
    """A Popen stand-in that runs until it is sent a signal, then ends with 128 + its number (as training does,
    after its checkpoint)."""

    def __init__(self, run, on_poll=None):
        self.run, self.on_poll, self.signals, self.returncode = run, on_poll, [], None

    def poll(self):
        if self.on_poll is not None:
            self.on_poll()
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)
        self.returncode = 128 + sig

    def wait(self):
        assert self.returncode is not None, f"{self.run} waited on without a signal: it would never end"
        return self.returncode


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_after_a_stop_signal_no_child_starts_and_the_running_ones_get_it(sig):
    """Before: a thread pool ran every run to its end whatever arrived."""
    started, ended, polls = [], [], []

    def start(r):
        started.append(FakeChild(r))
        return started[-1]

    def stop():
        polls.append(1)
        return sig.name if len(polls) > 3 else None
    got = run_children(list("abcde"), start, 2, stop, lambda r, rc: ended.append((r, rc)), poll_s=0)
    assert got == (sig.name, ["a", "b"], 3)
    assert [c.run for c in started] == ["a", "b"] and all(c.signals == [sig] for c in started)
    assert ended == [("a", 128 + sig), ("b", 128 + sig)]


def test_children_run_jobs_at_a_time_in_order_without_a_signal():
    started, ended = [], []

    class Quick(FakeChild):
        def poll(self):
            self.returncode = 0
            return 0

    def start(r):
        assert len(started) - len(ended) < 2, "more than jobs=2 children at once"
        started.append(r)
        return Quick(r)
    assert run_children(list("abcde"), start, 2, lambda: None, lambda r, rc: ended.append(r), poll_s=0) == \
        (None, [], 0)
    assert started == ended == list("abcde")


def test_an_error_in_the_parent_stops_the_running_children_first():
    """E.g. the parent's stdout closed while it reports a run: the children are not left running unattended."""
    kids = []

    def start(r):
        kids.append(FakeChild(r, on_poll=(lambda: None) if r == "a" else _raise))
        return kids[-1]
    with pytest.raises(BrokenPipeError):
        run_children(list("abc"), start, 2, lambda: None, lambda r, rc: None, poll_s=0)
    assert [k.signals for k in kids] == [[signal.SIGTERM], [signal.SIGTERM]]


def _raise():
    raise BrokenPipeError


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_real_signal_to_a_jobs_sweep_exits_128_plus_signum_naming_the_runs(tmp_path, capsys, monkeypatch, sig):
    """The command line with --jobs 2, children faked: a signal to this process while two runs run (the first
    child's poll sends it) stops both, starts none of the other six, and exits 128 + signum with one line.
    Before: the signal was held until every run of the grid had run (the slow test below sees it)."""
    kids = []

    def start(sweep, root, r):
        kids.append(FakeChild(r, on_poll=(lambda: os.kill(os.getpid(), sig)) if not kids else None))
        return kids[-1]
    monkeypatch.setattr(sw, "_start_child", start)
    path, root = _sweep_file(tmp_path, name="sig"), tmp_path / "runs"
    rc = main(["sweep", str(path), "--root", str(root), "--jobs", "2"])
    out = " ".join(capsys.readouterr().out.split())
    rs = runs(load_sweep(path), root)
    assert rc == 128 + sig, out
    assert [k.run for k in kids] == rs[:2] and all(k.signals == [sig] for k in kids)
    assert (f"interrupted: sweep sig stopped on {sig.name}: stopped {rs[0].id}, {rs[1].id} (each keeps its "
            f"checkpoints), 6 run(s) not started; the same `jaxformer sweep` command resumes the grid") in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_sequential_sweep_stops_at_the_interrupted_run_with_its_signals_exit_code(tmp_path, monkeypatch, sig):
    """--jobs 1: the run that training stopped (checkpoint saved) ends the sweep; no later run starts.
    Before: KeyboardInterrupt, exit 130 for every signal, with a bare "interrupted"."""
    done = []

    def run_one(sweep, r):
        done.append(r)
        return {"status": "interrupted" if len(done) == 2 else "completed", "signal": sig.name if len(done) == 2
                else None}
    monkeypatch.setattr(sw, "run_one", run_one)
    sweep = load_sweep(_sweep_file(tmp_path, name="seq"))
    with pytest.raises(Interrupted, match=f"stopped on {sig.name}: stopped .*seed-1 .*, 6 run") as e:
        run_sweep(sweep, tmp_path / "runs", echo=lambda m: None)
    assert e.value.exit_code == 128 + sig and len(done) == 2


def test_a_signal_between_sequential_runs_starts_no_further_run(tmp_path, monkeypatch):
    """A signal the process holds (e.g. one that came during a run's extra evaluations, or at its last step)
    starts no next run. Before: the next run started (and stopped at its first step)."""
    done, held = [], []
    monkeypatch.setattr(sw, "run_one", lambda sweep, r: done.append(r) or held.append("SIGTERM") or
                        {"status": "completed", "signal": None})
    monkeypatch.setattr(sw, "signal_pending", lambda: held[-1] if held else None)
    with pytest.raises(Interrupted, match="stopped on SIGTERM: no run was stopped mid-way, 7 run") as e:
        run_sweep(load_sweep(_sweep_file(tmp_path, name="between")), tmp_path / "runs", echo=lambda m: None)
    assert e.value.exit_code == 143 and len(done) == 1
    # a signal that training received at a run's last step: that run is finished, the sweep stops after it
    monkeypatch.setattr(sw, "signal_pending", lambda: None)
    monkeypatch.setattr(sw, "run_one", lambda sweep, r: done.append(r) or {"status": "completed", "signal": "SIGINT"})
    with pytest.raises(Interrupted, match="stopped on SIGINT: no run was stopped mid-way, 7 run") as e:
        run_sweep(load_sweep(_sweep_file(tmp_path, name="last")), tmp_path / "runs", echo=lambda m: None)
    assert e.value.exit_code == 130 and len(done) == 2


# ------------------------------------------------------------------------------- real processes (slow lane)

def _endless_grid(tmp_path):
    """A sweep of 3 arms x 2 seeds whose first arm's runs are finished (their sweep.json written here, as a
    finished run writes it) and whose other runs never finish. -> (sweep file, root, runs)."""
    path = _sweep_file(tmp_path, name="endless", grid={"train.steps": (6, 100000, 100001), "train.log_every": (1,)})
    root = tmp_path / "runs"
    rs = runs(load_sweep(path), root)
    for r in rs[:2]:
        r.workdir.mkdir(parents=True)
        (r.workdir / "sweep.json").write_text(json.dumps({"status": "completed", "overrides": list(r.overrides),
                                                          "evals": {}, "wall_s": 1.0}))
    return path, root, rs


def _sweep_process(path, root, *flags):
    return subprocess.Popen([sys.executable, "-m", "jaxformer", "sweep", str(path), "--root", str(root), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)      # its children too can be killed if it hangs


def _when_training(proc, rs, after: dict | None = None, limit=240):
    """Wait until each run of `rs` has logged a train step (past `after[run]`, if given)."""
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        steps = [max(_losses(r.workdir), default=0) for r in rs]
        if all(s > (after or {}).get(r.id, 0) for r, s in zip(rs, steps)):
            return
        time.sleep(0.1)
    raise AssertionError(f"the runs never trained (rc {proc.poll()}): " + "".join(
        (r.workdir / "sweep.log").read_text()[-1500:] for r in rs if (r.workdir / "sweep.log").exists()))


def _losses(workdir):
    try:
        return train_losses(workdir)
    except (FileNotFoundError, ValueError):       # not yet written, or a line being written
        return {}


def _stop(proc, sig, within=60) -> tuple[int, str, float]:
    t = time.time()
    proc.send_signal(sig)
    try:
        out = proc.communicate(timeout=within)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        raise AssertionError(f"no exit within {within} s of {sig.name}: " + out[-2000:]) from None
    return proc.returncode, " ".join(out.split()), time.time() - t


def _kept_checkpoint(r) -> int:
    """The run stopped with a checkpoint of the step it had logged last; -> that step."""
    last = max(train_losses(r.workdir))            # one history: no step logged twice (resumed, not restarted)
    assert checkpoint_steps(r.workdir)[-1] == last, (r.id, checkpoint_steps(r.workdir), last)
    assert not (r.workdir / "sweep.json").exists()
    return last


@pytest.mark.slow          # two sweeps of child processes, each stopped (~50 s)
def test_sigterm_to_a_jobs_sweep_stops_the_children_and_the_same_command_resumes(tmp_path):
    """Before: the parent held SIGTERM until the grid finished (here: never), starting the queued runs."""
    path, root, rs = _endless_grid(tmp_path)
    proc = _sweep_process(path, root, "--jobs", "2")
    try:
        _when_training(proc, rs[2:4])                  # two runs training, two queued
        rc, out, took = _stop(proc, signal.SIGTERM)
        assert rc == 143 and took < 45 and "Traceback" not in out, (rc, took, out[-3000:])
        assert (f"interrupted: sweep endless stopped on SIGTERM: stopped {rs[2].id}, {rs[3].id} (each keeps its "
                f"checkpoints), 2 run(s) not started") in out, out[-3000:]
        assert "6 runs, 2 finished before, 4 to run, 2 at a time" in out
        assert not any(r.workdir.exists() for r in rs[4:])          # no run started after the signal
        kept = {r.id: _kept_checkpoint(r) for r in rs[2:4]}
        # the same command again: the finished runs skipped, the stopped ones resumed from their checkpoints
        proc = _sweep_process(path, root, "--jobs", "2")
        _when_training(proc, rs[2:4], after=kept)
        rc, out, took = _stop(proc, signal.SIGINT)
        assert rc == 130 and "6 runs, 2 finished before, 4 to run" in out and "Traceback" not in out, out[-3000:]
        assert f"stopped on SIGINT: stopped {rs[2].id}, {rs[3].id}" in out and not any(r.workdir.exists()
                                                                                      for r in rs[4:])
        assert all(_kept_checkpoint(r) > kept[r.id] for r in rs[2:4])
        assert all(min(set(train_losses(r.workdir)) - set(range(1, kept[r.id] + 1))) == kept[r.id] + 1
                   for r in rs[2:4])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow          # a sequential sweep stopped twice (~30 s)
def test_sighup_to_a_sequential_sweep_exits_129_and_the_same_command_resumes(tmp_path):
    """--jobs 1 (runs in the process). Before: exit 130 with a bare "interrupted" for every signal."""
    path, root, rs = _endless_grid(tmp_path)
    proc = _sweep_process(path, root)
    try:
        _when_training(proc, rs[2:3])
        rc, out, _ = _stop(proc, signal.SIGHUP)
        assert rc == 129 and "2 finished before, 4 to run" in out and "Traceback" not in out, out[-3000:]
        assert f"stopped on SIGHUP: stopped {rs[2].id} (each keeps its checkpoints), 3 run(s) not started" in out
        assert not any(r.workdir.exists() for r in rs[3:])
        kept = _kept_checkpoint(rs[2])
        proc = _sweep_process(path, root)
        _when_training(proc, rs[2:3], after={rs[2].id: kept})
        rc, out, _ = _stop(proc, signal.SIGTERM)
        assert rc == 143 and "2 finished before, 4 to run" in out and f"stopped {rs[2].id}" in out, out[-3000:]
        assert _kept_checkpoint(rs[2]) > kept and not any(r.workdir.exists() for r in rs[3:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("signame,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129), (None, 130)])
def test_every_interrupted_command_exits_128_plus_the_signals_number(signame, code):
    """One rule for every command that stops on a signal (sweep, eval-tasks, export-hf, import-hf, data
    prepare): the shell's 128 + signum. Before: 130 for SIGTERM everywhere but the sweep."""
    from jaxformer.errors import Interrupted
    assert Interrupted("stopped", signame).exit_code == code
