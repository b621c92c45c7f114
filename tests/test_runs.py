"""Run directories resume or recover whatever happened to them, and say what they did: corrupt or partial
checkpoints, failed first attempts, deleted checkpoints, a second trainer, signals, a diverging loss."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_LM, checkpoint_steps, cli_args, records, tiny_lm, train_losses

from jaxformer import platforms
from jaxformer.cli import main as cli_main
from jaxformer.data import build_task
from jaxformer.errors import CheckpointError, DataError, IncompatibleCheckpoint, NonFiniteLoss, RunDirError
from jaxformer.inference import load_model
from jaxformer.runs import RunDir
from jaxformer.train.loop import train
from jaxformer.train.step import init_state

# checkpoints at 2 and 4 (latest keeps both), an eval (and best) at 4 only; steps 3-4 logged after step 2;
# dropout on, so that a resume recomputes steps 3-4 bit for bit only if it continues the per-step dropout keys
LM = tiny_lm("train.steps=4", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=4",
             "train.keep_checkpoints=3", "model.runtime.dropout=0.1")


@pytest.fixture(scope="module")
def finished_lm(tmp_path_factory):
    """A finished 4-step LM run; tests copy it before touching it."""
    d = tmp_path_factory.mktemp("lm") / "run"
    train(LM, d, progress="none")
    assert checkpoint_steps(d) == [2, 4] and checkpoint_steps(d, "best") == [4]
    return d


def copy_run(src, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def truncate_arrays(step_dir: Path):
    for f in (step_dir / "model").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 3])


CORRUPTIONS = {
    "truncated-arrays": truncate_arrays,
    "deleted-metadata": lambda d: (d / "model" / "_METADATA").unlink(),
    "garbled-metadata": lambda d: (d / "opt" / "_METADATA").write_text("{not json"),
    "garbled-data-state": lambda d: (d / "data" / "metadata").write_text("{not json"),
    "missing-item": lambda d: shutil.rmtree(d / "opt"),
    "data-state-of-another-shape": lambda d: (d / "data" / "metadata").write_text('{"epoch": [1, 2]}'),
}


# the default lane keeps a corruption of the arrays and of the data state; the rest run slow
DEFAULT_CORRUPTIONS = ("truncated-arrays", "data-state-of-another-shape")


@pytest.mark.parametrize("kind", [k if k in DEFAULT_CORRUPTIONS else pytest.param(k, marks=pytest.mark.slow)
                                  for k in CORRUPTIONS])
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one_naming_the_bad_step(finished_lm, tmp_path,
                                                                                      kind, caplog):
    run = copy_run(finished_lm, tmp_path)
    before = train_losses(run)
    for which in ("latest", "best"):                     # step 4 exists in both managers
        CORRUPTIONS[kind](run / "checkpoints" / which / "4")
    with caplog.at_level(logging.WARNING, logger="jaxformer"):
        out = train(LM, run, progress="none")
    assert out["status"] == "completed" and out["step"] == 4
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoints/latest/4" in warned and "unreadable" in warned, warned
    assert train_losses(run) == before                  # steps 3-4 recomputed bit for bit, no duplicates
    assert checkpoint_steps(run) == [2, 4]              # step 4 saved anew ...
    attic = [p.name for p in (run / "attic").iterdir()]
    assert any("unreadable-latest-4" in n for n in attic), attic   # ... and the bad one kept aside
    assert len([r for r in records(run) if r["split"] == "eval"]) == 1


def test_no_readable_checkpoint_is_a_named_error_and_moves_nothing(finished_lm, tmp_path):
    run = copy_run(finished_lm, tmp_path)
    for which, step in (("latest", 2), ("latest", 4), ("best", 4)):
        truncate_arrays(run / "checkpoints" / which / str(step))
    with pytest.raises(CheckpointError, match=r"latest step 4.*latest step 2"):
        train(LM, run, progress="none")
    assert checkpoint_steps(run) == [2, 4] and not (run / "attic").exists()
    assert cli_main(["train", *cli_args("configs/alice.py", TINY_LM), "--workdir", str(run)]) == 2


def test_a_crash_after_the_last_checkpoint_leaves_one_history(finished_lm, tmp_path):
    """Metrics logged after the newest checkpoint (a crash before the next save) are recomputed, not
    appended a second time."""
    run = copy_run(finished_lm, tmp_path)
    before = records(run, timing=False)
    for which in ("latest", "best"):                     # as if the process died before saving step 4
        shutil.rmtree(run / "checkpoints" / which / "4")
    train(LM, run, progress="none")
    assert records(run, timing=False) == before and checkpoint_steps(run) == [2, 4]
    assert [r["from_step"] for r in levers_records(run)] == [0, 2]         # the resume's own levers record


def levers_records(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "levers.jsonl").read_text().splitlines()]


def test_a_training_run_records_its_platform_levers_and_eval_records_none(finished_lm, tmp_path, capsys):
    """RUN/levers.jsonl: one record per training attempt, the platform and every lever as the platform seam
    reports them (an override included); `jaxformer eval`, which traces programs too, adds nothing."""
    platform = platforms.current()
    assert levers_records(finished_lm) == [{"from_step": 0, "platform": platform,
                                            "levers": platforms.levers(platform)}]
    with platforms.override(weight_grad=not platforms.enabled("weight_grad")):
        assert platforms.in_force() == {"platform": platform, "levers": {
            **platforms.levers(platform), "weight_grad": not platforms.levers(platform)["weight_grad"]}}
    run = copy_run(finished_lm, tmp_path)
    assert cli_main(["eval", "--workdir", str(run)]) == 0, capsys.readouterr().out
    assert levers_records(run) == levers_records(finished_lm)


def test_a_failed_first_attempt_does_not_block_the_corrected_rerun(tmp_path):
    bad = tiny_lm("data.batch_size=4096", "train.steps=2")          # more than the training blocks
    with pytest.raises(DataError, match="training examples"):
        train(bad, tmp_path, progress="none")
    assert json.loads((tmp_path / "config.json").read_text())["data"]["batch_size"] == 4096
    out = train(tiny_lm("train.steps=2", "train.eval_every=2"), tmp_path, progress="none")
    assert out["status"] == "completed" and json.loads((tmp_path / "config.json").read_text())["data"][
        "batch_size"] == 8


@pytest.mark.slow          # default-lane budget (~5 s)
def test_deleted_checkpoints_restart_with_a_warning_and_keep_the_old_history(finished_lm, tmp_path, caplog):
    run = copy_run(finished_lm, tmp_path)
    old = records(run)
    shutil.rmtree(run / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="jaxformer"):
        train(LM, run, progress="none")
    assert "no checkpoint to resume from" in caplog.text
    kept = [p for p in (run / "attic").iterdir() if p.name.endswith("history")]
    assert len(kept) == 1 and records(kept[0]) == old and (kept[0] / "tb").is_dir()
    assert records(run, timing=False) == records(kept[0], timing=False)   # one history, recomputed alike


@pytest.mark.slow          # default-lane budget (~5 s)
def test_incompatible_checkpoint_dir_is_refused(finished_lm, tmp_path):
    run = copy_run(finished_lm, tmp_path)
    with pytest.raises(IncompatibleCheckpoint, match=r"model\.d_model: 16 -> 32"):
        train(tiny_lm("train.steps=4", "model.d_model=32"), run, progress="none")
    resumed = train(tiny_lm("train.steps=5", "train.eval_every=5", "model.runtime.dropout=0.1"), run,
                    progress="none")                                                      # train.* may change
    assert resumed["step"] == 5


def test_a_second_trainer_on_the_same_workdir_is_refused(tmp_path):
    with RunDir(tmp_path).lock():
        with pytest.raises(RunDirError, match=f"in use by another trainer \\(pid {os.getpid()}\\)"):
            train(LM, tmp_path, progress="none")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unusable_workdirs_are_named_errors(tmp_path, monkeypatch, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        train(LM, f, progress="none")
    assert cli_main(["train", *cli_args("configs/alice.py", TINY_LM), "--workdir", str(f)]) == 2
    assert "is a file" in capsys.readouterr().out
    real_open = os.open

    def read_only_fs(path, *a, **k):   # EROFS for anything under tmp_path/ro (root ignores chmod, so fake it)
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only_fs)
    with pytest.raises(RunDirError, match="cannot write to workdir .*Read-only file system"):
        train(LM, tmp_path / "ro", progress="none")


def test_an_io_error_in_the_run_directory_is_one_line_not_a_traceback(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()                  # e.g. a clobbered file: reading it raises OSError
    assert cli_main(["train", *cli_args("configs/alice.py", TINY_LM), "--workdir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("I/O error:") and "metrics.jsonl" in out and "Traceback" not in out


# ----------------------------------------------------------------------------- restoring for inference

def test_best_and_latest_restore_their_own_steps_and_fall_back_without_writing(tmp_path, caplog):
    """Best (min loss) is step 1, latest is step 2, and their parameters differ: each restores its own.
    With latest/ gone, --which latest falls back to best and says so; nothing is created."""
    cfg = tiny_lm()
    task = build_task(cfg.data)
    run = RunDir(tmp_path)
    from jaxformer.config import resolve_vocab
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    run.write(cfg, task.tokenizer)
    graphs, state = init_state(cfg)
    ck = run.checkpoints(cfg)
    ck.save(1, state, {}, {"loss": 0.5})
    state2 = dict(state, model=jax.tree.map(lambda x: x + 1.0, state["model"]))
    ck.save(2, state2, {}, {"loss": 0.9})
    ck.close()
    leaf = lambda m: np.asarray(jax.tree.leaves(nnx.state(m, nnx.Param))[0])
    best, latest = load_model(tmp_path, "best"), load_model(tmp_path, "latest")
    assert (best.step, best.which, latest.step, latest.which) == (1, "best", 2, "latest")
    np.testing.assert_array_equal(leaf(best.model), np.asarray(jax.tree.leaves(state["model"])[0]))
    np.testing.assert_array_equal(leaf(latest.model), leaf(best.model) + 1.0)
    shutil.rmtree(tmp_path / "checkpoints" / "latest")
    with caplog.at_level(logging.WARNING, logger="jaxformer"):
        fell = load_model(tmp_path, "latest")
    assert (fell.step, fell.which) == (1, "best") and "using the best one" in caplog.text
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_generate_and_eval_without_a_checkpoint_are_named_errors(tmp_path, capsys):
    cfg = tiny_lm()
    task = build_task(cfg.data)
    RunDir(tmp_path).write(cfg, task.tokenizer)
    for cmd in ("generate", "eval"):
        assert cli_main([cmd, "--workdir", str(tmp_path)]) == 2
        assert "has no checkpoint yet" in capsys.readouterr().out.replace("\n", " ")
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(CheckpointError):
        load_model(tmp_path, "latest")


# ----------------------------------------------------------------------------- divergence and signals

NAN = ["optim.name=sgd", "optim.lr=1e12", "optim.clip_norm=0", "optim.schedule=constant", "train.steps=20",
       "train.eval_every=1000"]


@pytest.mark.slow          # two trainings (~7 s); test_bad_inputs.py stops a run on a non-finite gradient
def test_nan_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLoss, match=r"at step \d+") as e:
        train(tiny_lm(*NAN, "train.checkpoint_every=1"), tmp_path, progress="none")
    bad = int(str(e.value).split("at step ")[1].split(";")[0])
    good = [s for s in [bad - 2] if s > 0]          # keep_checkpoints=2; bad - 1's weights gave the NaN: attic
    assert checkpoint_steps(tmp_path) == good
    assert (f"last good checkpoint: step {bad - 2} in {tmp_path / 'checkpoints' / 'latest'}" if good else
            "no good checkpoint was saved before it") in str(e.value)


def test_nan_loss_before_any_checkpoint_exits_3_saying_so(tmp_path, capsys):
    argv = ["train", *cli_args("configs/alice.py", TINY_LM + NAN + ["train.checkpoint_every=1000"]),
            "--workdir", str(tmp_path), "--no-progress"]
    assert cli_main(argv) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "training diverged: loss is nan at step" in out and "no checkpoint was saved before it" in out
    assert "None" not in out and "Traceback" not in out and checkpoint_steps(tmp_path) == []


def _endless_training(tmp_path, **popen):
    cmd = [sys.executable, "-m", "jaxformer.cli", "train",
           *cli_args("configs/alice.py", TINY_LM + ["train.steps=100000", "train.log_every=1",
                                                    "train.eval_every=100000"]),
           "--workdir", str(tmp_path), "--no-progress"]
    proc = subprocess.Popen(cmd, text=True, **popen)
    deadline = time.time() + 120
    while not train_losses_or_none(tmp_path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)   # poll for the loop to run (its handlers are installed before step 1's record)
    return proc


@pytest.mark.parametrize("sigs", [
    pytest.param((signal.SIGTERM,), marks=pytest.mark.slow, id="SIGTERM"),
    pytest.param((signal.SIGINT,), marks=pytest.mark.slow, id="SIGINT"),
    pytest.param((signal.SIGHUP, signal.SIGTERM, signal.SIGINT), marks=pytest.mark.slow, id="SIGHUP-then-two-more")])
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_signum(tmp_path, sigs):
    """SIGTERM (a scheduler), SIGINT (Ctrl-C) and SIGHUP (the terminal closed) stop at the current step with a
    checkpoint; signals that follow the first are held until it is written, so they cannot discard it."""
    proc = _endless_training(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.send_signal(signal.SIGSTOP)    # all land together on SIGCONT, inside the checkpoint's window whatever
    for sig in sigs:                    # this busy machine schedules; which one the main thread sees first is the
        proc.send_signal(sig)           # kernel's and the threads' race (CI once saw SIGINT before SIGHUP)
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    first = signal.Signals(proc.returncode - 128) if proc.returncode > 128 else None
    assert first in sigs, (proc.returncode, out)
    assert f"interrupted by {first.name}" in out and "decoded held-out examples" not in out   # exits promptly
    for later in set(sigs) - {first}:
        assert f"{later.name} received while stopping on {first.name}: held" in out
    last = max(train_losses(tmp_path))
    assert checkpoint_steps(tmp_path)[-1] == last       # saved at the step it stopped at
    assert not list((tmp_path / "checkpoints" / "latest").glob("*tmp*"))     # and completely written


def test_signals_after_the_first_are_held_not_raised():
    """`signals.Held` as the training loop holds it (the test above sends the signals to a training, slow): the
    first stop signal is recorded, later ones are noted on stderr and held, never raised into the checkpoint
    being written. In a child process that imports nothing heavy (~0.1 s), where an unheld SIGHUP ends it alone."""
    code = ("import signal\nfrom jaxformer.signals import Held\nwith Held('the test ends') as held:\n"
            "    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):\n        signal.raise_signal(s)\n"
            "print('received', held.received)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "received SIGHUP\n", (proc.returncode, proc.stdout, proc.stderr)
    for later in ("SIGTERM", "SIGINT"):
        assert f"{later} received while stopping on SIGHUP: held until the test ends" in proc.stderr, proc.stderr


@pytest.mark.slow          # a training subprocess (~12 s); the default lane holds signals: the test above
def test_closing_stdout_stops_like_sigterm_with_a_checkpoint(tmp_path):
    """`jaxformer train ... | head` (or a `less` that quits): the first failed write stops the run as SIGTERM
    would, with a checkpoint of its step and exit status 128 + SIGPIPE, and a line on stderr saying why."""
    proc = _endless_training(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                                 # the reader goes away
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE.value, err[-3000:]
    assert "stdout was closed: stopping at step" in err and "Traceback" not in err, err[-3000:]
    assert checkpoint_steps(tmp_path)[-1] == max(train_losses(tmp_path))


def train_losses_or_none(workdir):
    try:
        return train_losses(workdir)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
