"""Optimizers and schedules from optax (Lion, Muon, AdamW; warmup-stable-decay) and gradient accumulation:
k micro-batches weighted by target tokens equal one batch exactly; each optimizer overfits a tiny batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_lm, tiny_reverse
from jaxformer.config import ConfigError, OptimConfig, resolve_vocab
from jaxformer.data import build_task
from jaxformer.nn import build_model
from jaxformer.nn.params import muon_dims
from jaxformer.train.step import init_state, make_train_step, schedule


def prepared(cfg):
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    return cfg, task, graphs, state


def test_accumulated_micro_batches_equal_one_batch():
    """Reversal rows of different lengths: the two micro-batches hold different numbers of target tokens, so
    averaging their mean losses (equal weights) would differ from the batch; summing token-weighted does not."""
    steps = {}
    for k in (1, 2, 4):
        cfg, task, graphs, state = prepared(tiny_reverse("model.dropout=0.0", "data.batch_size=8",
                                                         f"optim.accumulate={k}", "data.min_len=1", "data.max_len=9"))
        batch = {name: jnp.asarray(v[:8]) for name, v in task.train.items()}
        new, m = make_train_step(graphs, cfg)(state, batch, jax.random.key(0))
        steps[k] = ([np.asarray(x) for x in jax.tree.leaves(new["model"])], m)
    counts = (np.asarray(batch["tgt_out"]) != 0).reshape(4, 2, -1).swapaxes(0, 1).sum((1, 2))
    assert counts[0] != counts[1]                                  # the micro-batches' token counts differ
    for k in (2, 4):
        for a, b in zip(steps[1][0], steps[k][0]):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
        for name in ("loss", "token_accuracy", "tokens", "grad_norm"):
            np.testing.assert_allclose(float(steps[k][1][name]), float(steps[1][1][name]), rtol=2e-5)


@pytest.mark.parametrize("name,schedule", [("lion", "constant"), ("muon", "constant"), ("adamw", "wsd")])
def test_each_optimizer_overfits_a_tiny_batch(name, schedule):
    lr = {"lion": "3e-4", "muon": "2e-2", "adamw": "3e-3"}[name]
    cfg, task, graphs, state = prepared(tiny_reverse("model.dropout=0.0", f"optim.name={name}",
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
