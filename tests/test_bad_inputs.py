"""Inputs a user can get wrong are refused by name (a named error, exit 2, no traceback), and a diverging run
never saves a poisoned checkpoint. Each case was accepted (or crashed) before it was refused here."""
import dataclasses
import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, cli_args, tiny_lm, tiny_reverse

from jaxformer.cli import main as cli_main
from jaxformer.configio import apply_overrides
from jaxformer.data import DataError, resolve
from jaxformer.data.tokenizers import DigitTokenizer
from jaxformer.errors import CheckpointError, ConfigError, NonFiniteLoss
from jaxformer.inference import generate_text, prompt_ids
from jaxformer.train.loop import train


@pytest.mark.parametrize("override,field", [
    ("data.seed=-1", "data.seed"), ("train.seed=-3", "train.seed"), (f"train.seed={2 ** 40}", "train.seed"),
    ("optim.b1=1.5", "optim.b1"), ("optim.b2=nan", "optim.b2"), ("optim.b1=-0.1", "optim.b1"),
    ("parallel.process_id=1", "parallel.process_id"), ("parallel.rules=[abc", "parallel.rules"),
    ("model.pad_id=5", "model.pad_id"),
])
def test_nonsense_config_values_are_named(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(apply_overrides(tiny_reverse(), [override]))


def test_superscript_digits_are_not_digits():
    with pytest.raises(DataError, match="digits 0-9"):
        prompt_ids(DigitTokenizer(), "²³")
    np.testing.assert_array_equal(prompt_ids(DigitTokenizer(), "12"), DigitTokenizer().encode([1, 2]))


@pytest.mark.parametrize("kw,what", [({"beam": 0}, "beam"), ({"beam": -3}, "beam"), ({"seed": 2 ** 70}, "seed"),
                                     ({"seed": -1}, "seed")])
def test_decoding_arguments_are_checked_before_anything_runs(kw, what):
    run = types.SimpleNamespace()                     # never read: the arguments are refused first
    with pytest.raises(ConfigError, match=what):
        generate_text(run, ["123"], **kw)


def test_an_empty_workdir_is_refused(capsys):
    assert cli_main(["train", *cli_args("configs/reverse.py", []), "--workdir", ""]) == 2
    assert cli_main(["generate", "--workdir", ""]) == 2
    out = capsys.readouterr().out
    assert "--workdir ''" in out and "Traceback" not in out


def test_a_non_finite_gradient_stops_the_run_before_its_checkpoint_is_saved(tmp_path):
    """AdamW at lr 1e6 without clipping: the gradient norm turns non-finite while the loss is still finite, so
    that step's parameters are poisoned. The run stops naming that step; the checkpoint it names as good holds
    finite arrays, and the one before the bad step (whose weights gave it) is moved to the attic."""
    from jaxformer.inference import load_model
    cfg = tiny_lm("optim.lr=1e6", "optim.clip_norm=0", "optim.schedule=constant", "train.steps=30",
                  "train.checkpoint_every=1", "train.keep_checkpoints=30", "train.eval_every=1000")
    with pytest.raises(NonFiniteLoss, match=r"at step (\d+)") as e:
        train(cfg, tmp_path, progress="none")
    bad = int(str(e.value).split("at step ")[1].split(";")[0])
    good = load_model(tmp_path, "latest")
    assert good.step == bad - 2 and f"last good checkpoint: step {bad - 2}" in str(e.value)
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(nnx.state(good.model)))
    assert "new --workdir" in str(e.value) and f"step {bad - 1}" in str(e.value)
    assert str(e.value).startswith("gradient norm is")        # seen at its own step, while the loss is finite
    assert list((tmp_path / "attic").glob(f"*-non-finite-latest-{bad - 1}/{bad - 1}"))       # kept, set aside


@pytest.mark.slow          # a divergence, an evaluation and a fine-tuning (~13 s)
def test_the_checkpoint_named_good_after_divergence_evaluates_and_fine_tunes(tmp_path):
    """The issue's case: lr 1e3 without clipping, a checkpoint every step. Before, the guard named the step
    before the bad one, whose weights had just given the non-finite loss: it evaluated to nan and a run started
    from it (train.init_from) diverged at its first step. The named checkpoint's own forward pass was finite."""
    from jaxformer.inference import evaluate_run
    steps = ["optim.clip_norm=0", "optim.schedule=constant", "train.steps=60", "train.checkpoint_every=1",
             "train.eval_every=1000", "model.runtime.dropout=0.0"]
    with pytest.raises(NonFiniteLoss, match=r"at step (\d+)") as e:
        train(tiny_lm("optim.lr=1e3", *steps), tmp_path / "a", progress="none")
    named = int(re.search(r"last good checkpoint: step (\d+)", str(e.value)).group(1))
    out = evaluate_run(tmp_path / "a", "latest")
    assert out["step"] == named and np.isfinite(out["eval"]["loss"])
    fine = train(tiny_lm("optim.lr=1e-4", *steps[:-5], "train.steps=3", f"train.init_from={tmp_path / 'a'}"),
                 tmp_path / "b", progress="none")
    assert fine["status"] == "completed" and np.isfinite(fine["eval"]["loss"])


@pytest.mark.slow          # four divergences and four evaluations (~30 s)
@pytest.mark.parametrize("extra", [("optim.ema=0.9",), ("optim.accumulate=2",), ("optim.name=lion",),
                                   ("optim.name=muon",)])
def test_the_checkpoint_named_good_is_finite_in_use_for_every_optimizer(tmp_path, extra):
    """The issue saw the same bad naming with EMA and accumulation, and with lion/muon a NaN next gradient."""
    from jaxformer.inference import evaluate_run
    steps = ["optim.lr=1e3", "optim.clip_norm=0", "optim.schedule=constant", "train.steps=60",
             "train.checkpoint_every=1", "train.eval_every=1000", "model.runtime.dropout=0.0", *extra]
    with pytest.raises(NonFiniteLoss) as e:
        train(tiny_lm(*steps), tmp_path, progress="none")
    m = re.search(r"last good checkpoint: step (\d+)", str(e.value))
    assert m is not None, str(e.value)
    out = evaluate_run(tmp_path, "latest")
    assert out["step"] == int(m.group(1)) and np.isfinite(out["eval"]["loss"])


@pytest.mark.slow          # a training with evaluations (~7 s)
def test_a_non_finite_held_out_loss_stops_the_run_before_that_step_is_saved(tmp_path, monkeypatch):
    """Weights whose training loss was finite but whose held-out loss is not are as bad: the run stops at that
    evaluation, saves nothing of it (no NaN in `best`) and names the checkpoint before it."""
    import jaxformer.train.loop as loop
    real, calls = loop.evaluate, []

    def nan_at_step_4(*a, **kw):
        calls.append(1)
        out = real(*a, **kw)
        return {**out, "loss": float("nan")} if len(calls) == 2 else out
    monkeypatch.setattr(loop, "evaluate", nan_at_step_4)
    with pytest.raises(NonFiniteLoss, match=r"held-out eval loss is nan at step 4; last good checkpoint: step 3"):
        train(tiny_lm("train.steps=8", "train.eval_every=2", "train.checkpoint_every=1"), tmp_path,
              progress="none")
    from helpers import checkpoint_steps
    assert checkpoint_steps(tmp_path) == [2, 3] and checkpoint_steps(tmp_path, "best") == [2]


@pytest.mark.slow          # three short trainings (~12 s)
def test_init_from_refuses_a_run_whose_tokenizer_maps_other_characters_to_the_same_ids(tmp_path):
    """Two texts with as many distinct characters: the same vocabulary size, other characters behind the ids.
    Before, train.init_from compared sizes only and fine-tuned a model that read every id as another char."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abcdefgh " * 300)
    b.write_text("abcdefgz " * 300)
    steps = ["train.steps=1", "train.eval_every=1", "train.checkpoint_every=1"]
    train(tiny_lm(*steps, f"data.path={a}"), tmp_path / "ra", progress="none")
    with pytest.raises(ConfigError, match=r"another tokenizer .*id 9 is 'h' there, 'z' here"):
        train(tiny_lm(*steps, f"data.path={b}", f"train.init_from={tmp_path / 'ra'}"), tmp_path / "rb",
              progress="none")
    out = train(tiny_lm(*steps, f"data.path={a}", f"train.init_from={tmp_path / 'ra'}"), tmp_path / "rc",
                progress="none")                                       # the same text: accepted
    assert out["status"] == "completed"


def test_eval_stride_without_data_is_refused(tmp_path, capsys):
    assert cli_main(["eval", "--workdir", str(tmp_path), "--stride", "4"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "--stride 4 needs --data FILE" in out and "Traceback" not in out


def test_text_paths_that_are_not_text_files_are_named(tmp_path):
    import os

    from jaxformer.data import load_text
    with pytest.raises(DataError, match="is a directory"):
        load_text(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        load_text(fifo)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 4096)
    with pytest.raises(DataError, match="NUL"):
        load_text(nul, gutenberg=False)


def test_an_unresolvable_coordinator_fails_at_once():
    from jaxformer.config import ParallelConfig
    from jaxformer.distributed import initialize
    for address, what in (("no-such-host.invalid:1234", "does not resolve"), ("hostonly", "HOST:PORT")):
        with pytest.raises(ConfigError, match=what):
            initialize(ParallelConfig(coordinator=address, num_processes=2, process_id=1))


def test_resume_refuses_a_changed_corpus_at_the_same_path(tmp_path):
    from jaxformer.errors import IncompatibleCheckpoint
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = tiny_lm(f"data.path={corpus}", "data.gutenberg=False", "data.num_chars=None", "train.steps=4",
                  "train.checkpoint_every=2", "train.eval_every=100", "train.num_examples=0")
    train(cfg, tmp_path / "run", stop_after=2, progress="none")
    corpus.write_text("the quick brown fox jumps over the lazy cat. " * 40)      # same characters, other text
    with pytest.raises(IncompatibleCheckpoint, match="other text"):
        train(cfg, tmp_path / "run", progress="none")


@pytest.fixture
def small_disk(tmp_path):
    """A 600 kB tmpfs (root only: mounting needs it): room for a tiny run's first checkpoints, not for many."""
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (a full disk is simulated with one)")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.slow          # two trainings into a small tmpfs (~8 s)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning",       # pytest's own hooks
                            "ignore::pytest.PytestUnhandledThreadExceptionWarning",   # replace the ones the
                            "ignore:coroutine:RuntimeWarning")                        # CLI process quiets
def test_a_full_disk_is_one_named_error_and_the_run_resumes_once_there_is_room(small_disk, capfd):
    """Before: ~600 lines of orbax/tensorstore/asyncio/tensorboardX tracebacks, and the I/O error of a
    TensorBoard flush in place of the checkpoint's. Now: one CheckpointError naming the step, the reason and the
    checkpoint that is kept, one warning about TensorBoard, and nothing else."""
    cfg = tiny_lm("train.steps=60", "train.log_every=1", "train.checkpoint_every=1", "train.eval_every=1000",
                  "train.keep_checkpoints=100", "train.num_examples=0")
    with pytest.raises(CheckpointError) as e:
        train(cfg, small_disk / "run", progress="none")
    m = re.search(r"checkpoint of step (\d+) .*: No space left on device\. The newest complete checkpoint is "
                  r"step (\d+) \(kept\)", str(e.value))
    assert m and int(m[2]) == int(m[1]) - 1, str(e.value)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err and "ERROR" not in err, err[-3000:]
    subprocess.run(["mount", "-o", "remount,size=50M", str(small_disk)], check=True)
    out = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=int(m[1]) + 1)),
                small_disk / "run", progress="none")
    assert out["status"] == "completed" and out["step"] == int(m[1]) + 1


def test_a_model_that_cannot_fit_in_memory_is_named_before_anything_is_allocated(tmp_path):
    """d_model 2^16 with d_ff 2^18 is ~770 GiB of float32 training state: before, XLA's allocator failed (or
    the OOM killer ended the process) while building it; now a ConfigError names the sizes."""
    cfg = tiny_lm("model.d_model=65536", "model.d_ff=262144", "model.num_heads=2")
    with pytest.raises(ConfigError, match=r"the model \(model.d_model=65536, model.d_ff=262144, .*\) needs at "
                                          r"least [\d,.]+ GiB for its parameters .*make it smaller"):
        train(cfg, tmp_path / "run", progress="none")
    cfg = tiny_lm("model.d_model=12288", "model.d_ff=12288", "model.num_heads=2", "model.num_decoder_layers=2")
    from jaxformer.memory import _free_bytes, min_param_bytes
    if not min_param_bytes(cfg.model)[0] < _free_bytes(jax.devices()[0]) < 4 * min_param_bytes(cfg.model)[0]:
        pytest.skip("this machine's memory does not put 6.8 GiB of parameters between fitting and training")
    with pytest.raises(ConfigError, match=r"the training state needs at least [\d.]+ GiB of host memory \("
                                          r"parameters .*gradients .*optimizer state .*is free: make the model smaller"):
        train(cfg, tmp_path / "run", progress="none")
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists() or not any(
        (tmp_path / "run" / "checkpoints" / "latest").iterdir())


@pytest.mark.slow          # default-lane budget
def test_a_platform_this_machine_lacks_is_a_named_error():
    """JAX_PLATFORMS=cuda on a machine without a GPU: before, an AssertionError traceback from inside JAX."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: JAX_PLATFORMS=cuda works here")
    env = dict(os.environ, JAX_PLATFORMS="cuda")
    proc = subprocess.run([sys.executable, "-m", "jaxformer.cli", "params", "configs/reverse.py"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "platform error: JAX cannot start the platform JAX_PLATFORMS='cuda'" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
