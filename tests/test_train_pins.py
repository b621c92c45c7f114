"""Pins on training behaviour no other default-lane test sets, each against a reference written here (NumPy
recursions, or gradients of an objective spelled out by hand), and each seen to fail on a planted wrong
implementation (tests/mutants.py names them):

- optimizer sub-options: Muon's optim.muon_adam_lr (the AdamW part's lr) apart from optim.lr (the matrices'),
  Muon's weight decay; Lion's b1/b2, clipping and weight-decay mask over three steps; schedule-free AdamW's b1,
  b2, clipping (inside its base) and weight-decay mask over three steps;
- a MoE model's router losses are per group of routed tokens and averaged over the groups: the micro-batches of
  optim.accumulate, and the devices of parallel.mode=shard_map (two fake CPU devices in a subprocess);
- the EMA a run restores (`inference.load_model(weights="ema")`) is the EMA of its per-step weights, and a
  run without one refuses weights="ema" by name;
- DeepNorm in an encoder-decoder model: each stack its own DeepNet α (read off the built residuals) and β (the
  scale of its v, o and FFN initialisations), with N != M layers so that swapping them shows.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import ROOT, tiny_lm, tiny_reverse
from jaxformer.config import ConfigError, OptimConfig, resolve_vocab, replaced
from jaxformer.data import build_task
from jaxformer.nn import build_model
from jaxformer.nn.params import matrix_mask, muon_dims
from jaxformer.ops.losses import token_losses
from jaxformer.train.optim import optimizer
from jaxformer.train.step import forward, init_state, make_train_step

def _flat(tree) -> dict[str, np.ndarray]:
    """{"a/b/c": float64 array} of an nnx.State or a plain dict of arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(x, np.float64)
            for p, x in leaves}


def _steps(tx, params, grads: list):
    """The parameters after each of len(grads) updates of `tx` (as float64 dicts)."""
    @jax.jit
    def one(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    state, out = tx.init(params), []
    for g in grads:
        params, state = one(params, state, g)
        out.append(_flat(params))
    return out


def _clipped(g: dict, c: float) -> dict:
    norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
    return {k: x * min(1.0, c / norm) for k, x in g.items()} if c else g


# A synthetic parameter tree: one matrix (decayed under weight_decay_mask="matrices") and two vectors (not).
SHAPES = {"w": (16, 12), "b": (12,), "scale": (12,)}
MATRICES = {"w": True, "b": False, "scale": False}


def _synthetic(seed: int, norms=(10.0, 0.3, 4.0)):
    """Parameters and one gradient per norm (random directions: their global norms are `norms`), as float64
    NumPy and float32 JAX dicts."""
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(0, 1, s) for k, s in SHAPES.items()}
    grads = []
    for n in norms:
        g = {k: rng.normal(0, 1, s) for k, s in SHAPES.items()}
        total = np.sqrt(sum((x ** 2).sum() for x in g.values()))
        grads.append({k: x * n / total for k, x in g.items()})
    as32 = lambda t: {k: jnp.asarray(x, jnp.float32) for k, x in t.items()}          # noqa: E731
    return ({k: np.asarray(as32(params)[k], np.float64) for k in params}, as32(params),
            [{k: np.asarray(as32(g)[k], np.float64) for k in g} for g in grads], [as32(g) for g in grads])


# ---------------------------------------------------------------------------------------------------- optimizers

def test_lion_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps():
    """Chen et al. 2023: c = β1·m + (1−β1)·g; θ ← θ − lr·(sign(c) + λ·θ) (matrices only); m ← β2·m + (1−β2)·g,
    g clipped to global norm optim.clip_norm. β1 = 0.8, β2 = 0.5 weigh the last gradient against the older ones
    (in c at step 2: (1−β1)·g2 + β1·(1−β2)·g1 = 0.2·g2 + 0.4·g1) far from optax's defaults 0.9, 0.99 (0.1, 0.009)
    and from β1, β2 swapped (0.5, 0.1); gradients of norms 10, 0.3, 4 around a clip of 1: each of those settings
    changes some signs."""
    lr, wd, b1, b2, clip = 0.1, 0.3, 0.8, 0.5, 1.0
    p, p32, gs, gs32 = _synthetic(0)
    tx = optimizer(OptimConfig(name="lion", lr=lr, b1=b1, b2=b2, weight_decay=wd, clip_norm=clip,
                               schedule="constant", warmup_steps=0), 10, MATRICES)
    got = _steps(tx, p32, gs32)
    m = {k: np.zeros_like(x) for k, x in p.items()}
    for step, g in enumerate(gs):
        g = _clipped(g, clip)
        for k in p:
            c = b1 * m[k] + (1 - b1) * g[k]
            p[k] = p[k] - lr * (np.sign(c) + wd * MATRICES[k] * p[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
            np.testing.assert_allclose(got[step][k], p[k], rtol=1e-5, atol=1e-6, err_msg=f"step {step + 1} {k}")


def test_schedule_free_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps():
    """Defazio et al. 2024, constant lr γ: z ← z − γ·(g/(√v̂ + ε) + λ·y) (λ on matrices only), v the RMS of the
    clipped g (decay β2, bias-corrected); x ← (1 − 1/t)·x + z/t; y = β1·x + (1 − β1)·z, the parameters the
    gradients are taken at. Non-default β1 = 0.5, β2 = 0.9, and gradient norms 10, 0.3, 4 around a clip of 1
    (Adam-type steps are scale-free at the first step only)."""
    lr, wd, b1, b2, clip, eps = 0.1, 0.2, 0.5, 0.9, 1.0, 1e-8
    p, p32, gs, gs32 = _synthetic(1)
    tx = optimizer(OptimConfig(name="schedule_free", lr=lr, b1=b1, b2=b2, weight_decay=wd, clip_norm=clip,
                               schedule="constant", warmup_steps=0), 10, MATRICES)
    got = _steps(tx, p32, gs32)
    x, z, y, v = dict(p), dict(p), dict(p), {k: np.zeros_like(a) for k, a in p.items()}
    for t, g in enumerate(gs, start=1):
        g = _clipped(g, clip)
        for k in p:
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            z[k] = z[k] - lr * (g[k] / (np.sqrt(v[k] / (1 - b2 ** t)) + eps) + wd * MATRICES[k] * y[k])
            x[k] = (1 - 1 / t) * x[k] + z[k] / t
            y[k] = b1 * x[k] + (1 - b1) * z[k]
            np.testing.assert_allclose(got[t - 1][k], y[k], rtol=1e-5, atol=1e-6, err_msg=f"step {t} {k}")


def _lm_params():
    """A tiny LM (untied head) and its parameters."""
    model = build_model(dataclasses.replace(tiny_lm().model, vocab_size=20, tie_embeddings=False), seed=0)
    return model, nnx.state(model, nnx.Param)


# Muon's matrices, by name (independently of nn.params.muon_dims): [L, in..., out...] with the split below.
MUON_IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w1": 1, "w2": 1}      # input axes after the layer axis


def test_muon_steps_its_matrices_by_lr_and_the_rest_by_muon_adam_lr():
    """One step from zero state on random gradients, no weight decay. The Adam part (embeddings, head, norms,
    biases) moves by muon_adam_lr·g/(|g| + ε) (β1 = 0: the first Adam step, Nesterov or not); each layer's
    projection moves by lr times an orthogonalised matrix (Newton-Schulz: its largest singular value in
    [0.6, 1.2]) times Muon's width factor √max(1, fan_out/fan_in). lr and muon_adam_lr 100× apart."""
    lr, adam_lr = 1e-2, 1e-4
    model, params = _lm_params()
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(2)
    grads = jax.tree.unflatten(tree, [jnp.asarray(rng.normal(0, 1, x.shape), jnp.float32) for x in leaves])
    tx = optimizer(OptimConfig(name="muon", lr=lr, muon_adam_lr=adam_lr, b1=0.0, weight_decay=0.0, clip_norm=0.0,
                               schedule="constant", warmup_steps=0), 10, matrix_mask(model), muon_dims(model))
    updates = _flat(jax.jit(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads))
    g = _flat(grads)
    assert {k.split("/")[-1] for k in g} >= {"tokens", "head", "scale", "b1", "wq", "wo", "w1", "w2"}
    for name, u in updates.items():
        last = name.split("/")[-1]
        if last not in MUON_IN_AXES or name.startswith("embed"):
            np.testing.assert_allclose(u, -adam_lr * g[name] / (np.abs(g[name]) + 1e-8), rtol=1e-5, err_msg=name)
            continue
        cut = 1 + MUON_IN_AXES[last]
        fan_in, fan_out = int(np.prod(u.shape[1:cut])), int(np.prod(u.shape[cut:]))
        mats = u.reshape(u.shape[0], fan_in, fan_out) / (-lr * np.sqrt(max(1.0, fan_out / fan_in)))
        top = np.linalg.svd(mats, compute_uv=False)[:, 0]
        assert ((0.6 < top) & (top < 1.2)).all(), (name, top)
        assert np.abs(u).max() > 3 * adam_lr, name                      # not an Adam step at muon_adam_lr


def _decay_updates(name: str, **kw):
    """One update of zero gradients: pure decoupled weight decay (λ = 0.5) -> ({name: update}, {name: param})."""
    model, params = _lm_params()
    cfg = OptimConfig(name=name, lr=0.1, weight_decay=0.5, clip_norm=0.0, schedule="constant", warmup_steps=0,
                      **kw)
    tx = optimizer(cfg, 10, matrix_mask(model), muon_dims(model) if name == "muon" else None)
    updates = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])(params)
    return _flat(updates), _flat(params)


def test_muon_decays_its_matrices_by_lr_and_the_head_by_muon_adam_lr():
    """Zero gradients: Muon's projections shrink by lr·λ, the untied head (a matrix Adam takes) by muon_adam_lr·λ."""
    updates, params = _decay_updates("muon", muon_adam_lr=0.02)
    for name, u in updates.items():
        last = name.split("/")[-1]
        if last in MUON_IN_AXES or last == "head":
            np.testing.assert_allclose(u, -(0.02 if last == "head" else 0.1) * 0.5 * params[name], rtol=1e-6,
                                       err_msg=name)


def test_muon_leaves_norm_scales_and_embeddings_undecayed():
    """optax.contrib.muon decays every parameter of its AdamW part (adam_weight_decay takes no mask): before,
    with optim.name=muon, norm scales and the embedding table decayed although optim.weight_decay_mask=
    'matrices' says only matrices do."""
    updates, params = _decay_updates("muon")
    for name in ("embed/tokens", "decoder/layers/blocks/res_ffn/norm/scale"):
        assert np.abs(params[name]).max() > 0
        np.testing.assert_array_equal(updates[name], 0.0, err_msg=name)


# ------------------------------------------------------------------------------------------ MoE router losses

# Dropless top-2 routing over 4 experts in both layers, no dropout, router-loss weights large enough that their
# gradients are not lost in rounding; SGD at lr 1 without clipping: the step's update is minus the gradient.
MOE_SGD = ["model.ffn=moe", "model.moe.num_experts=4", "model.moe.top_k=2", "model.runtime.moe_capacity_factor=0",
           "model.num_decoder_layers=2", "model.runtime.dropout=0.0", "optim.moe_balance_weight=1.0",
           "optim.moe_z_weight=0.1", "optim.name=sgd", "optim.lr=1.0", "optim.schedule=constant",
           "optim.warmup_steps=0", "optim.clip_norm=0", "data.batch_size=8"]


def _moe_reference(cfg, graphs, model_state, groups: list[dict]):
    """Gradients (pure dict) of the objective written out: Σ_groups token objective / all target tokens
    + mean over groups of (α·balance + β·z), each group routed on its own and the router losses averaged over
    the MoE layers; and per group (balance, z)."""
    m = cfg.model

    def objective(model):
        tokens, router, stats = 0.0, 0.0, []
        total = sum(float((np.asarray(g["targets"]) != m.pad_id).sum()) for g in groups)
        for g in groups:
            logits, targets, aux = forward(model, g, nnx.Rngs(dropout=jax.random.key(0)))
            tokens = tokens + token_losses(logits, targets, m.pad_id)["objective"]
            bal, z = jnp.mean(aux["moe"].balance), jnp.mean(aux["moe"].z)
            router = router + cfg.optim.moe_balance_weight * bal + cfg.optim.moe_z_weight * z
            stats.append((bal, z))
        return tokens / total + router / len(groups), stats

    grads, stats = nnx.jit(nnx.grad(objective, has_aux=True))(nnx.merge(graphs.model, model_state))
    return _flat(grads), [(float(b), float(z)) for b, z in stats]


def _sgd_moved(graphs, before, after) -> dict:
    """-(after - before) per parameter: the gradient an SGD step at lr 1 applied."""
    p = lambda st: _flat(nnx.state(nnx.merge(graphs.model, st), nnx.Param))   # noqa: E731
    b, a = p(before), p(after)
    return {k: b[k] - a[k] for k in b}


def _assert_grads(got: dict, want: dict):
    assert set(got) == set(want)
    scale = max(np.abs(w).max() for w in want.values())
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * scale, err_msg=k)


@pytest.mark.slow          # ~5 s; the router losses' plain value: tests/test_moe_model.py
def test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged():
    """optim.accumulate=2: micro-batch i holds rows i, i+2, ... and is routed on its own; the gradient is that of
    Σ_i token objective_i / batch tokens + mean_i (α·balance_i + β·z_i), and the logged moe_balance / moe_z are
    the micro-batches' means. The two micro-batches' balance losses differ, so neither the whole batch's routing,
    nor contiguous halves, nor summing the micro-batches' router losses (k× too heavy) meets this (each moves
    some gradient by ~3% of the largest, the tolerance is 1e-5 of it)."""
    cfg = tiny_lm(*MOE_SGD, "optim.accumulate=2")
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    batch = {k: jnp.asarray(v[:8]) for k, v in task.train.items()}
    before = jax.tree.map(jnp.copy, state["model"])
    want, stats = _moe_reference(cfg, graphs, before, [{k: v[i::2] for k, v in batch.items()} for i in (0, 1)])
    new, m = make_train_step(graphs, cfg)(state, batch, jax.random.key(0))
    assert abs(stats[0][0] - stats[1][0]) > 1e-3, stats                # the groups route differently
    _assert_grads(_sgd_moved(graphs, before, new["model"]), want)
    np.testing.assert_allclose(float(m["moe_balance"]), np.mean([b for b, _ in stats]), rtol=1e-5)
    np.testing.assert_allclose(float(m["moe_z"]), np.mean([z for _, z in stats]), rtol=1e-5)


def shard_map_worker(out: str) -> None:
    """Run in a subprocess with two fake CPU devices (see the test below): one shard_map data-parallel step of
    MOE_SGD, and the hand-written objective's gradients with device d's rows (4d .. 4d+3) as a group."""
    from jaxformer.parallel import Plan
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 2, jax.devices()
    cfg = tiny_lm(*MOE_SGD, "parallel.mode=shard_map", "parallel.data=2")
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    plan = Plan(cfg.parallel)
    graphs, state = init_state(cfg, plan)
    batch = {k: np.asarray(v[:8]) for k, v in task.train.items()}
    before = jax.device_get(state["model"])
    want, stats = _moe_reference(cfg, graphs, before, [{k: jnp.asarray(v[4 * d:4 * d + 4]) for k, v in batch.items()}
                                                       for d in (0, 1)])
    new, m = make_train_step(graphs, cfg, plan)(state, plan.global_batch(batch, 8), jax.random.key(0))
    got = _sgd_moved(graphs, before, jax.device_get(new["model"]))
    Path(out).write_text(json.dumps({"got": {k: v.tolist() for k, v in got.items()},
                                     "want": {k: v.tolist() for k, v in want.items()}, "stats": stats,
                                     "moe_balance": float(m["moe_balance"]), "moe_z": float(m["moe_z"])}))


@pytest.mark.slow      # a subprocess with two fake devices: ~8 s warm, ~13 s with a cold compilation cache
def test_moe_router_losses_under_shard_map_are_each_devices_averaged(tmp_path):
    """parallel.mode=shard_map on two devices: each device routes its own rows; the all-reduced gradient is that
    of Σ_d token objective_d / batch tokens + mean_d (α·balance_d + β·z_d), and the logged router losses are the
    devices' means (not their sum, nor the losses of one device's rows)."""
    out = tmp_path / "out.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_train_pins as t; "
            "t.shard_map_worker(sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests"), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(out.read_text())
    stats = r["stats"]
    assert abs(stats[0][0] - stats[1][0]) > 1e-3, stats
    _assert_grads({k: np.asarray(v) for k, v in r["got"].items()}, {k: np.asarray(v) for k, v in r["want"].items()})
    np.testing.assert_allclose(r["moe_balance"], np.mean([b for b, _ in stats]), rtol=1e-5)
    np.testing.assert_allclose(r["moe_z"], np.mean([z for _, z in stats]), rtol=1e-5)


# ----------------------------------------------------------------------------------------- restoring the EMA

@pytest.mark.slow          # ~8 s; the EMA, its checkpoint item and its refusal: tests/test_weights.py
def test_a_run_restores_the_ema_of_its_saved_per_step_weights(tmp_path):
    """Two steps with optim.ema = d = 0.6, a checkpoint after each: weights="ema" restores
    d²·θ0 + (1−d)·(d·θ1 + θ2) (θ0 the initial weights, θt read from step t's checkpoint), not θ2; and
    weights="ema" of a run without an EMA is a named ConfigError."""
    import orbax.checkpoint as ocp
    from jaxformer.parallel import Plan
    from jaxformer.runs import RunDir
    from jaxformer.train.loop import train
    from jaxformer.train.step import abstract_state
    from jaxformer.inference import load_model
    d = 0.6
    cfg = tiny_lm(f"optim.ema={d}", "optim.lr=1e-2", "train.steps=2", "train.checkpoint_every=1",
                  "train.keep_checkpoints=2", "train.eval_every=2", "train.log_every=2", "train.num_examples=0",
                  "train.peak_flops=1e9")
    train(cfg, tmp_path / "run", progress="none")
    ema = load_model(tmp_path / "run", "latest", weights="ema")
    trained = load_model(tmp_path / "run", "latest", weights="trained")
    assert ema.step == trained.step == 2
    graphs, abstract = abstract_state(ema.cfg)
    params = lambda st: _flat(nnx.state(nnx.merge(graphs.model, st), nnx.Param))  # noqa: E731
    thetas = [params(init_state(ema.cfg, Plan(ema.cfg.parallel))[1]["model"])]      # as the loop starts
    ckpt = RunDir(tmp_path / "run").checkpoints(ema.cfg, read_only=True)
    try:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract["model"])
        for step in (1, 2):
            items = ckpt.managers["latest"].restore(step, args=ocp.args.Composite(
                model=ocp.args.StandardRestore(target)))
            thetas.append(params(items["model"]))
    finally:
        ckpt.close()
    got, last = _flat(nnx.state(ema.model, nnx.Param)), _flat(nnx.state(trained.model, nnx.Param))
    assert set(got) == set(thetas[0])
    for k in got:
        want = d ** 2 * thetas[0][k] + (1 - d) * (d * thetas[1][k] + thetas[2][k])
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_array_equal(last[k], thetas[2][k], err_msg=k)
    assert max(np.abs(got[k] - last[k]).max() for k in got) > 1e-3          # the EMA is not the trained weights
    plain = RunDir(tmp_path / "plain")
    plain.path.mkdir()
    plain.write(dataclasses.replace(ema.cfg, optim=dataclasses.replace(ema.cfg.optim, ema=0.0)), ema.tokenizer)
    with pytest.raises(ConfigError, match="trained without an EMA"):
        load_model(plain.path, "latest", weights="ema")


# ------------------------------------------------------------------------------------ DeepNorm per stack

@pytest.mark.slow          # ~4 s; DeepNorm's formula and init: tests/test_residuals.py
def test_deepnorm_gives_each_stack_of_an_encoder_decoder_its_own_alpha_and_beta():
    """DeepNet (Wang et al. 2022), N = 2 encoder and M = 3 decoder layers: encoder α = 0.81·(N⁴M)^(1/16),
    β = 0.87·(N⁴M)^(−1/16); decoder α = (3M)^(1/4), β = (12M)^(−1/4). α read off every residual of the built
    model; β as the ratio of each stack's v, o and FFN initial weights (the decoder's cross-attention too) to
    the same model's with post-LN, same seed; q and k are not scaled."""
    n, m = 2, 3
    want = {"encoder": (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)),
            "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25)}
    cfg = dataclasses.replace(tiny_reverse("model.norm.position=deepnorm", f"model.num_encoder_layers={n}",
                                           f"model.num_decoder_layers={m}").model, vocab_size=20)
    init = jax.jit(lambda c: nnx.to_pure_dict(nnx.state(build_model(c, seed=0), nnx.Param)), static_argnums=0)
    deep, post = _flat(init(cfg)), _flat(init(replaced(cfg, norm__position="post")))
    model = nnx.eval_shape(lambda: build_model(cfg, seed=0))
    residuals = {"encoder": ("res_attn", "res_ffn"), "decoder": ("res_self", "res_cross", "res_ffn")}
    for stack, names in residuals.items():
        blocks = getattr(model, stack).layers.blocks
        for r in names:
            assert getattr(blocks, r).alpha == pytest.approx(want[stack][0], rel=1e-12), (stack, r)
        attn = ("self_attn", "cross_attn") if stack == "decoder" else ("self_attn",)
        for sub, w in [(a, w) for a in attn for w in ("wv", "wo")] + [("ffn", "w1"), ("ffn", "w2")]:
            k = f"{stack}/layers/blocks/{sub}/{w}"
            np.testing.assert_allclose(deep[k], want[stack][1] * post[k], rtol=1e-5, atol=1e-8, err_msg=k)
        for sub, w in [(a, w) for a in attn for w in ("wq", "wk")]:
            k = f"{stack}/layers/blocks/{sub}/{w}"
            np.testing.assert_array_equal(deep[k], post[k], err_msg=k)
    assert abs(want["encoder"][0] - want["decoder"][0]) > 0.1 and abs(want["encoder"][1] - want["decoder"][1]) > 0.1
