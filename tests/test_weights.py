"""The weights a run evaluates besides the ones it steps: schedule-free AdamW's averaged iterate and an EMA,
each against a NumPy reference written here, through the training loop and back from a checkpoint."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import records, tiny_lm
from jaxformer.config import ConfigError, OptimConfig, resolve_vocab
from jaxformer.data import build_task
from jaxformer.ops.losses import token_losses
from jaxformer.train.step import forward, init_state, make_train_step
from jaxformer.inference.weights import evaluated


def _setup(*extra):
    """No key bias: its gradient is zero up to rounding, which Adam-type updates amplify to ±lr."""
    cfg = tiny_lm("model.runtime.dropout=0.0", "optim.clip_norm=0", "model.biases=q,v,o,ffn", *extra)
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    return cfg, task, graphs, state


def _params(graphs, model_state) -> list[np.ndarray]:
    model = nnx.merge(graphs.model, model_state)
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def _grads(graphs, model_state, batch, pad) -> list[np.ndarray]:
    def loss(m):
        logits, targets, _ = forward(m, batch)
        t = token_losses(logits, targets, pad)
        return t["objective"] / t["count"]
    g = nnx.grad(loss)(nnx.merge(graphs.model, model_state))
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.to_pure_dict(g))]


@pytest.mark.slow          # ~8 s cold: an optimizer arm, not the default recipe
def test_schedule_free_adamw_steps_y_and_evaluates_x_as_the_paper_writes_them():
    """Defazio et al. 2024: gradients at y = (1−β1)·z + β1·x; z ← z − γ_t·(g/(√v̂ + ε) + λ·y); x ← (1 − c)·x + c·z
    with c = γ_t² / Σγ²; the run evaluates x, not y. Wrong versions this catches: evaluating y, an x from β1
    swapped, momentum left in the base optimizer, and evaluating overwriting the training weights."""
    lr, warm, wd, b1, b2, eps = 1e-2, 2, 0.1, 0.9, 0.98, 1e-8
    cfg, task, graphs, state = _setup("optim.name=schedule_free", "optim.schedule=constant", f"optim.lr={lr}",
                                      f"optim.warmup_steps={warm}", f"optim.weight_decay={wd}",
                                      "optim.weight_decay_mask=all", "optim.b2=0.98")
    step = make_train_step(graphs, cfg)
    batches = [{k: jnp.asarray(v[8 * i:8 * i + 8]) for k, v in task.train.items()} for i in range(4)]
    y = _params(graphs, state["model"])
    x, z, v = list(y), list(y), [np.zeros_like(p) for p in y]
    max_lr, wsum = 0.0, 0.0
    for c, batch in enumerate(batches):
        g = _grads(graphs, state["model"], batch, cfg.model.pad_id)
        state, _ = step(state, batch, jax.random.key(c))
        gamma = lr * min(c / warm, 1.0)
        max_lr = max(max_lr, lr * min((c + 1) / warm, 1.0))    # optax weighs by the lr one count ahead
        wsum += max_lr ** 2
        ck = max_lr ** 2 / wsum if wsum else 0.0
        for i in range(len(y)):
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            z[i] = z[i] - gamma * (g[i] / (np.sqrt(v[i] / (1 - b2 ** (c + 1))) + eps) + wd * y[i])
            x[i] = (1 - ck) * x[i] + ck * z[i]
            y[i] = b1 * x[i] + (1 - b1) * z[i]
    before = _params(graphs, state["model"])
    for got, want in zip(before, y):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    ev = _params(graphs, evaluated(cfg.optim, graphs.model, state["model"], state["opt"])["eval"])
    assert max(np.abs(a - b).max() for a, b in zip(ev, before)) > 1e-4          # x is not y
    for got, want in zip(ev, x):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    for a, b in zip(_params(graphs, state["model"]), before):                     # the training weights stay
        np.testing.assert_array_equal(a, b)
    step(state, batches[0], jax.random.key(9))                                   # and can still be donated


def test_schedule_free_evaluates_x_from_y_and_z_and_leaves_the_training_state():
    """The default lane's cheap check of what the slow test above follows step by step (no train step compiled):
    with the trained iterate y moved off z (z = y at init), the evaluated weights are x = (y − (1 − β1)·z) / β1
    (float64 NumPy), not y, and evaluating leaves the training state's Variables as they were."""
    cfg, _, graphs, state = _setup("optim.name=schedule_free", "optim.schedule=constant")
    z = _params(graphs, state["model"])
    moved = jax.tree.map(lambda a: a + 0.05 if jnp.issubdtype(a.dtype, jnp.floating) else a, state["model"])
    y = _params(graphs, moved)
    b1 = cfg.optim.b1
    ev = _params(graphs, evaluated(cfg.optim, graphs.model, moved, state["opt"])["eval"])
    for got, yi, zi in zip(ev, y, z):
        np.testing.assert_allclose(got, (yi - (1 - b1) * zi) / b1, rtol=1e-5, atol=1e-6)
    for a, b in zip(_params(graphs, moved), y):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def ema_run():
    """Three updates with optim.ema = 0.7 -> (cfg, task, graphs, state, the EMA recomputed here: float64 leaves
    of every nnx.Param, the compiled step). Tests must not donate `state` to the step (they step a copy)."""
    d = 0.7
    cfg, task, graphs, state = _setup("optim.ema=0.7", "optim.lr=1e-2", "optim.warmup_steps=0")
    step = make_train_step(graphs, cfg)
    ema = _params(graphs, state["model"])
    for c in range(3):
        state, _ = step(state, {k: jnp.asarray(v[8 * c:8 * c + 8]) for k, v in task.train.items()},
                        jax.random.key(c))
        ema = [d * e + (1 - d) * p for e, p in zip(ema, _params(graphs, state["model"]))]
    return cfg, task, graphs, state, ema, step


def test_the_ema_averages_the_weights_after_each_update_from_the_initial_ones(ema_run):
    """EMA ← d·EMA + (1 − d)·θ_t after every update, starting at θ_0. Wrong versions this catches: the weights
    before the update (one step late), d and 1 − d swapped, starting from zeros, and overwriting the model."""
    cfg, task, graphs, state, ema, step = ema_run
    out = evaluated(cfg.optim, graphs.model, state["model"], state["opt"])
    for got, want in zip(_params(graphs, out["eval_ema"]), ema):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert out["eval"] is state["model"]
    step(jax.tree.map(jnp.copy, state), {k: jnp.asarray(v[:8]) for k, v in task.train.items()}, jax.random.key(5))


def test_a_checkpoint_holds_the_ema_as_its_own_item_and_weights_ema_reads_it(ema_run):
    """What a checkpoint saves (`checkpoint_items`) and what `load_model(weights=...)` restores (`item_for`): the
    EMA as item "eval_ema" (not the trained "model"); schedule-free's averaged iterate as "eval"; a checkpoint
    saved before those items: the EMA computed from its optimizer state as saved, not its model item. (Whole
    runs saved and loaded: tests/test_one_loader.py, slow.)"""
    from jaxformer.inference.restore import _restore_item
    from jaxformer.inference.weights import checkpoint_items, item_for
    cfg, _, graphs, state, ema, _ = ema_run
    items = checkpoint_items(cfg.optim, graphs.model, state)
    assert set(items) == {"model", "opt", "eval_ema"}
    for got, want in zip(_params(graphs, items["eval_ema"]), ema):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert max(np.abs(a - b).max() for a, b in zip(ema, _params(graphs, state["model"]))) > 1e-4
    assert (item_for(cfg.optim, "ema"), item_for(cfg.optim, "trained")) == ("eval_ema", "model")
    sf = OptimConfig(name="schedule_free", schedule="constant")
    assert (item_for(sf, "trained"), item_for(OptimConfig(), "trained")) == ("eval", "model")

    class Legacy:                                    # a checkpoint with the items "model" and "opt" only
        steps = staticmethod(lambda kind: [3])
        has_item = staticmethod(lambda kind, step, item: item in ("model", "opt"))
        restore = staticmethod(lambda target, kinds: type("R", (), {"step": 3, "items": {
            "model": state["model"], "opt": nnx.to_pure_dict(state["opt"])}}))
    got, step = _restore_item(Legacy, "latest", "eval_ema", cfg, graphs.model, state["model"], [])
    assert step == 3
    for g, want in zip(_params(graphs, got), ema):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_weights_ema_of_a_run_without_an_ema_is_a_named_error(ema_run, tmp_path):
    import dataclasses
    from jaxformer.inference import load_model
    from jaxformer.runs import RunDir
    cfg, task, *_ = ema_run
    run = RunDir(tmp_path)
    run.write(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, ema=0.0)), task.tokenizer)
    with pytest.raises(ConfigError, match="trained without an EMA"):
        load_model(tmp_path, "latest", weights="ema")


@pytest.mark.slow          # a training run (~10 s); the default lane checks the EMA itself above
def test_a_run_logs_both_evaluations_and_restores_either_weights(tmp_path):
    from jaxformer.inference import evaluate_run
    from jaxformer.train.loop import train
    cfg = tiny_lm("optim.ema=0.9", "train.steps=6", "train.eval_every=3", "train.log_every=3",
                  "train.checkpoint_every=6", "train.num_examples=0")
    train(cfg, tmp_path, progress="none")
    last = {r["split"]: r for r in records(tmp_path) if r["step"] == 6}
    assert set(last) >= {"train", "eval", "eval_ema"}
    assert last["eval"]["loss"] != last["eval_ema"]["loss"]
    for weights, split in (("trained", "eval"), ("ema", "eval_ema")):
        got = evaluate_run(tmp_path, "latest", weights=weights)["eval"]["loss"]
        np.testing.assert_allclose(got, last[split]["loss"], rtol=1e-6)


@pytest.mark.slow
def test_a_schedule_free_run_reports_and_restores_its_averaged_iterate(tmp_path):
    from jaxformer.inference import evaluate_run, load_model
    from jaxformer.train.loop import train
    cfg = tiny_lm("optim.name=schedule_free", "optim.schedule=constant", "optim.lr=3e-3", "optim.warmup_steps=2",
                  "train.steps=6", "train.eval_every=6", "train.checkpoint_every=6", "train.num_examples=0")
    train(cfg, tmp_path, progress="none")
    logged = next(r for r in records(tmp_path) if r["split"] == "eval" and r["step"] == 6)["loss"]
    np.testing.assert_allclose(evaluate_run(tmp_path, "latest")["eval"]["loss"], logged, rtol=1e-6)
    with pytest.raises(ConfigError, match="without an EMA"):
        load_model(tmp_path, "latest", weights="ema")


def test_bad_averaging_settings_are_named_errors():
    for extra, message in ((("optim.ema=1.0",), r"optim.ema=1.0 must be in \[0, 1\)"),
                           (("optim.ema=-0.1",), "optim.ema=-0.1"),
                           (("optim.name=schedule_free", "optim.schedule=warmup_cosine"),
                            "set optim.schedule=constant"),
                           (("optim.name=schedule_free", "optim.schedule=constant", "optim.ema=0.9"),
                            "already evaluates an average")):
        with pytest.raises(ConfigError, match=message):
            tiny_lm(*extra)
