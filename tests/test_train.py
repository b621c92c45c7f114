"""Training: the step learns, pads are inert, resume is bitwise, signals save, NaN stops, configs are checked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError, apply_overrides, load_config_file
from jaxformer.train.checkpoint import IncompatibleCheckpoint
from jaxformer.train.loop import NonFiniteLoss, evaluate_run, setup, train
from jaxformer.train.step import forward, make_train_step, schedule, token_losses

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.d_ff=64", "model.num_heads=2", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "data.num_train=128", "data.num_eval=32", "data.batch_size=16",
        "train.eval_batch_size=32", "train.num_examples=2"]


def tiny(*extra):
    return apply_overrides(load_config_file(ROOT / "configs/reverse.py"), TINY + list(extra))


def train_losses(workdir):
    rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def test_step_lowers_loss_and_overfits_a_tiny_batch():
    cfg = tiny("model.dropout=0.0", "optim.schedule=constant", "optim.lr=3e-3")
    cfg, task, graphdef, state = setup(cfg, None)
    step = make_train_step(graphdef, cfg)
    batch = {k: v[:4] for k, v in task.train.items()}
    losses = []
    for i in range(300):
        state, m = step(state, batch, jax.random.key(i))
        losses.append(float(m["loss"]))
    assert losses[10] < losses[0]
    assert losses[-1] < 0.02, losses[-1]


def test_pad_tokens_change_neither_loss_nor_gradients():
    cfg = tiny("model.dropout=0.0")
    cfg, task, graphdef, state = setup(cfg, None)
    model = nnx.merge(graphdef, state)[0]
    batch = {k: jnp.asarray(v[:8]) for k, v in task.train.items()}
    padded = {k: jnp.pad(v, ((0, 0), (0, 3))) for k, v in batch.items()}  # three more pad columns

    def loss(m, b):
        logits, targets = forward(m, b)
        s = token_losses(logits, targets, cfg.model.pad_id)
        return s["nll"] / s["count"]

    l1, g1 = nnx.value_and_grad(loss)(model, batch)
    l2, g2 = nnx.value_and_grad(loss)(model, padded)
    np.testing.assert_allclose(l1, l2, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_resume_is_bitwise_equal(tmp_path):
    cfg = tiny("train.steps=12", "train.log_every=1", "train.checkpoint_every=4", "train.eval_every=100")
    full = train(cfg, tmp_path / "full", progress=False)
    part = train(cfg, tmp_path / "resumed", stop_after=6, progress=False)
    assert part["status"].startswith("interrupted")
    rest = train(cfg, tmp_path / "resumed", progress=False)
    assert full["status"] == rest["status"] == "completed"
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}  # bitwise


def test_nan_loss_stops_with_the_step_named_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny("optim.name=sgd", "optim.lr=1e12", "optim.clip_norm=0", "optim.schedule=constant",
               "train.steps=20", "train.checkpoint_every=1", "train.eval_every=100")
    with pytest.raises(NonFiniteLoss, match=r"at step \d+") as e:
        train(cfg, tmp_path, progress=False)
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints/latest").iterdir() if p.name.isdigit())
    bad = int(str(e.value).split("at step ")[1].split(";")[0])
    assert saved and max(saved) == bad - 1


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "jaxformer.cli", "train", str(ROOT / "configs/reverse.py"), "--workdir",
           str(tmp_path), "--no-progress"] + [a for o in TINY + ["train.steps=100000", "train.log_every=1"]
                                              for a in ("--set", o)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.5)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "interrupted (SIGTERM)" in out
    steps = [int(p.name) for p in (tmp_path / "checkpoints/latest").iterdir() if p.name.isdigit()]
    assert steps and max(steps) == max(train_losses(tmp_path))


def test_incompatible_checkpoint_dir_is_refused(tmp_path):
    train(tiny("train.steps=2", "train.eval_every=100"), tmp_path, progress=False)
    with pytest.raises(IncompatibleCheckpoint, match=r"model\.d_model: 32 -> 48"):
        train(tiny("train.steps=2", "model.d_model=48"), tmp_path, progress=False)


def test_eval_run_restores_best_checkpoint(tmp_path):
    out = train(tiny("train.steps=4", "train.eval_every=2"), tmp_path, progress=False)
    ev = evaluate_run(tmp_path, "latest")
    assert ev["step"] == 4 and ev["eval"]["loss"] == pytest.approx(out["eval"]["loss"], rel=1e-6)


@pytest.mark.parametrize("override, key", [
    ("model.d_modl=64", "model.d_modl"),            # unknown key
    ("optim.lr=fast", "optim.lr"),                  # wrong type
    ("model.d_model=33", "model.d_model=33"),       # impossible value (not a multiple of heads)
    ("data.task=sort", "data.task"),
    ("train.best_metric=bleu", "train.best_metric"),
    ("model.max_len=4", "model.max_len=4"),         # data needs length 7
])
def test_bad_overrides_are_rejected_naming_the_key(override, key, capsys):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny(override)
    assert cli_main(["train", str(ROOT / "configs/reverse.py"), "--set", override]) == 2
    assert key in capsys.readouterr().out.replace("\n", "")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_every_config_file_loads_and_builds(path):
    from jaxformer.data import build_task
    from jaxformer.nn import build_model
    from jaxformer.train.loop import resolve
    cfg = load_config_file(path)
    if cfg.data.task == "text" and not Path(cfg.data.path).is_absolute():
        cfg = apply_overrides(cfg, [f"data.path={ROOT / cfg.data.path}"])
        if not Path(cfg.data.path).exists():
            pytest.skip(f"corpus {cfg.data.path} absent")
    cfg = resolve(cfg, build_task(cfg.data).tokenizer)
    abstract = nnx.eval_shape(lambda: build_model(cfg.model))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n > 0


def test_schedules():
    from jaxformer.config import OptimConfig
    noam = schedule(OptimConfig(lr=1.0, schedule="noam", warmup_steps=100), 1000)
    assert float(noam(49)) == pytest.approx(0.5) and float(noam(99)) == pytest.approx(1.0)
    assert float(noam(399)) == pytest.approx(0.5)
    cos = schedule(OptimConfig(lr=1.0, schedule="warmup_cosine", warmup_steps=10), 110)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1.0) and float(cos(110)) < 1e-6


def test_label_smoothing_objective():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 7))
    t = jnp.array([[1, 2, 0], [3, 0, 0]])
    a, b = token_losses(logits, t, 0, 0.0), token_losses(logits, t, 0, 0.1)
    assert a["count"] == 3 and a["objective"] == a["nll"] and b["nll"] == a["nll"] and b["objective"] != a["objective"]
