"""Optimizers and schedules from optax (Lion, Muon, AdamW; warmup-stable-decay) and gradient accumulation:
k micro-batches weighted by target tokens equal one batch exactly; each optimizer overfits a tiny batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_lm, tiny_reverse
from jaxformer.config import ConfigError, OptimConfig, resolve_vocab, replaced
from jaxformer.data import build_task
from jaxformer.nn import build_model
from jaxformer.nn.params import muon_dims
from jaxformer.train.optim import schedule
from jaxformer.train.step import init_state, make_train_step


def prepared(cfg):
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    return cfg, task, graphs, state


@pytest.mark.slow          # ~13 s; the default lane accumulates in test_moe_model (repeated rows, MoE)
def test_accumulated_micro_batches_equal_one_batch():
    """Reversal rows of different lengths: the two micro-batches hold different numbers of target tokens, so
    averaging their mean losses (equal weights) would differ from the batch; summing token-weighted does not."""
    steps = {}
    for k in (1, 2):                                                # k = 4: the slow lane's test below
        cfg, task, graphs, state = prepared(tiny_reverse("model.runtime.dropout=0.0", "data.batch_size=8",
                                                         f"optim.accumulate={k}", "data.min_len=1", "data.max_len=9"))
        batch = {name: jnp.asarray(v[:8]) for name, v in task.train.items()}
        new, m = make_train_step(graphs, cfg)(state, batch, jax.random.key(0))
        steps[k] = ([np.asarray(x) for x in jax.tree.leaves(new["model"])], m)
    counts = (np.asarray(batch["tgt_out"]) != 0).reshape(4, 2, -1).swapaxes(0, 1).sum((1, 2))
    assert counts[0] != counts[1]                                  # the micro-batches' token counts differ
    for k in (2,):
        for a, b in zip(steps[1][0], steps[k][0]):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
        for name in ("loss", "token_accuracy", "tokens", "grad_norm"):
            np.testing.assert_allclose(float(steps[k][1][name]), float(steps[1][1][name]), rtol=2e-5)


@pytest.mark.slow        # ~12 s each; the default lane builds Muon's state under a plan (below)
@pytest.mark.parametrize("name,schedule", [("lion", "constant"), ("muon", "constant"), ("adamw", "wsd"),
                                           ("schedule_free", "constant")])
def test_each_optimizer_overfits_a_tiny_batch(name, schedule):
    lr = {"lion": "3e-4", "muon": "2e-2", "adamw": "3e-3", "schedule_free": "3e-3"}[name]
    cfg, task, graphs, state = prepared(tiny_reverse("model.runtime.dropout=0.0", f"optim.name={name}",
                                                     f"optim.schedule={schedule}", f"optim.lr={lr}",
                                                     "optim.warmup_steps=10", "train.steps=150"))
    step = make_train_step(graphs, cfg)
    batch = {k: v[:4] for k, v in task.train.items()}
    losses = []
    for i in range(150):
        state, m = step(state, batch, jax.random.key(i))
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.2 * losses[0], (name, losses[0], losses[-1])


def test_muon_takes_the_projections_with_their_matrix_axes_and_adam_the_rest():
    import dataclasses
    model = build_model(dataclasses.replace(tiny_lm().model, vocab_size=20, tie_embeddings=False))
    leaves = jax.tree_util.tree_flatten_with_path(
        muon_dims(model), is_leaf=lambda x: x is None or type(x).__name__ == "MuonDimensionNumbers")[0]
    dims = {"/".join(str(getattr(k, "key", k)) for k in path): d for path, d in leaves}
    pick = lambda end: next(d for name, d in dims.items() if name.endswith(end))          # noqa: E731
    assert tuple(pick("self_attn/wq")) == ((1,), (2, 3))          # [L, D | N, H]
    assert tuple(pick("self_attn/wo")) == ((1, 2), (3,))          # [L, N, H | D]
    assert tuple(pick("ffn/w2")) == ((1,), (2,))                  # [L, F | D]
    for adam in ("embed/tokens", "embed/head", "ffn/b1", "res_ffn/norm/scale"):
        assert pick(adam) is None, adam


def test_wsd_warms_up_holds_and_decays_linearly_to_zero():
    sched = schedule(OptimConfig(schedule="wsd", lr=1.0, warmup_steps=10, decay_fraction=0.25), 100)
    lr = np.asarray([float(sched(s)) for s in range(101)])
    np.testing.assert_allclose(lr[:10], (np.arange(10) + 1) / 10)
    assert (lr[10:75] == 1.0).all()
    np.testing.assert_allclose(lr[75:], (100 - np.arange(75, 101)) / 25, atol=1e-6)


def test_bad_optimizer_settings_are_named_errors():
    for extra, message in ((("optim.accumulate=3",), "optim.accumulate=3 does not divide data.batch_size=8"),
                           (("optim.accumulate=2", "parallel.mode=shard_map"), "shard_map"),
                           (("optim.name=adafactor",), "optim.name='adafactor'"),
                           (("optim.schedule=wsd", "optim.decay_fraction=0"), "optim.decay_fraction")):
        with pytest.raises(ConfigError, match=message):
            tiny_lm(*extra)


def test_the_log_line_carries_mfu_from_flops_per_token_and_the_peak(tmp_path):
    import json
    from jaxformer.nn import count_params
    from jaxformer.train.flops import flops_per_token, measure_peak_flops
    from jaxformer.train.loop import train
    cfg = tiny_lm("train.steps=2", "train.log_every=1", "train.eval_every=2", "train.checkpoint_every=2",
                  "train.peak_flops=1e9")
    train(cfg, tmp_path / "run", progress="none")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in rows if r["split"] == "train"][-1]
    resolved = resolve_vocab(cfg, build_task(cfg.data).tokenizer.vocab_size)
    p = count_params(build_model(resolved.model))["total"]
    m = resolved.model
    fpt = 6 * p + 12 * m.num_decoder_layers * m.num_heads * m.head_size * resolved.data.block_size
    assert flops_per_token(resolved, p) == fpt
    assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * fpt / 1e9, rel=1e-6)
    assert measure_peak_flops(n=256, reps=2) > 1e6
    assert rec["grad_norm/decoder/0"] > 0 and "grad_norm/decoder/1" not in rec          # one layer


@pytest.mark.slow          # ~9 s cold; the logged per-layer norms' presence: the test above
def test_layer_gradient_norms_are_each_layers_own_and_add_up_to_the_global_norm():
    import dataclasses
    import optax
    from flax import nnx
    from jaxformer.train.step import layer_grad_norms
    cfg = replaced(tiny_lm().model, vocab_size=20, num_decoder_layers=4, ffn="moe", moe__num_experts=2,
                              moe__every=2)
    model = build_model(cfg, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 20, (2, 6)))
    grads = nnx.jit(nnx.grad(lambda m: (m(tokens)[0] ** 2).mean()))(model)
    norms = np.asarray(layer_grad_norms(grads)["decoder_grad_norm"])
    assert norms.shape == (4,)
    stack = grads["decoder"]["layers"]["blocks"]
    for layer in range(4):                      # layer i: kind i % 2, row i // 2
        kind = stack[layer % 2]
        want = np.sqrt(sum(float(jnp.sum(jnp.square(g[layer // 2]))) for g in jax.tree.leaves(kind)))
        np.testing.assert_allclose(norms[layer], want, rtol=1e-5)
    rest = [g for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
            if getattr(path[0], "key", None) != "decoder" or getattr(path[1], "key", None) != "layers"]
    total = float(optax.global_norm(grads))
    np.testing.assert_allclose(np.sqrt((norms ** 2).sum() + sum(float(jnp.sum(g ** 2)) for g in rest)), total,
                               rtol=1e-5)


@pytest.mark.slow          # three more compiled steps (~10 s)
def test_four_accumulated_micro_batches_equal_one_batch():
    cfg, task, graphs, state = prepared(tiny_reverse("model.runtime.dropout=0.0", "data.batch_size=8",
                                                     "optim.accumulate=4",
                                                     "data.min_len=1", "data.max_len=9"))
    one_cfg, _, one_graphs, one_state = prepared(tiny_reverse("model.runtime.dropout=0.0", "data.batch_size=8",
                                                              "data.min_len=1", "data.max_len=9"))
    batch = {name: jnp.asarray(v[:8]) for name, v in task.train.items()}
    a, ma = make_train_step(graphs, cfg)(state, batch, jax.random.key(0))
    b, mb = make_train_step(one_graphs, one_cfg)(one_state, batch, jax.random.key(0))
    for x, y in zip(jax.tree.leaves(a["model"]), jax.tree.leaves(b["model"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=2e-5)


def test_muon_and_the_ema_build_their_state_in_a_plans_shardings():
    """Muon's state holds optax MaskedNodes (empty) where Adam takes a parameter: the plan's shardings must leave
    them be (the CLI always trains under a plan; the steps above run without one)."""
    from jaxformer.parallel import Plan
    cfg = resolve_vocab(tiny_lm("optim.name=muon", "optim.clip_norm=1.0", "optim.ema=0.9"), 60)
    graphs, state = init_state(cfg, Plan(cfg.parallel))
    assert "ema" in state["opt"]["opt_state"]
