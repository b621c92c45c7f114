"""Runs in its own process with 8 fake CPU devices: context-parallel attention (`jaxformer.ops.context`) under
jax.shard_map over a "context" axis of 8, against `dot_product_attention` of the whole sequence on one device.
`python tests/context_worker.py OUT.json [train | train-all] [resume]`; the assertions live in tests/test_context_parallel.py.

train (one device and ring x zigzag) / train-all (every plan): 4 steps of a tiny char LM (block 16, two packed documents a row where the data has them) under context
plans (all-gathered or ring attention, contiguous or zigzag order, with data and FSDP), each against one device:
losses and the final parameters. resume: train() under a ring × zigzag plan stopped at step 3, resumed under plain
data parallelism (and the reverse), against an uninterrupted data-parallel run (train() takes every device)."""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import GC_THRESHOLDS, tiny_lm, train_losses  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)
from jaxformer.config import resolve_vocab  # noqa: E402
from jaxformer.data import build_task  # noqa: E402
from jaxformer.ops import dot_product_attention  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.train.loop import train  # noqa: E402
from jaxformer.train.step import init_state, make_train_step  # noqa: E402
from jaxformer.ops.context import context_parallel_attention, ring_attention, unzigzag, zigzag  # noqa: E402
from jaxformer.ops.masks import CausalMask  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
C, B, T, N, K, H = 8, 2, 64, 4, 2, 8
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
segments = jnp.asarray(np.repeat([[1] * 40 + [2] * 20 + [0] * 4], B, 0), jnp.int32)        # two docs + padding
positions = jnp.asarray(np.where(segments == 1, np.arange(T), np.arange(T) - 40) * (segments != 0), jnp.int32)
mesh = jax.make_mesh((C,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))


def reference(q, k, v):
    mask = CausalMask(positions, positions, segments != 0, segments, segments)
    return dot_product_attention(q, k, v, mask=mask).out


def sharded(q, k, v, pos, seg, backend):
    def local(q, k, v, pos, seg):
        mask = CausalMask(pos, pos, seg != 0, seg, seg)
        if backend == "ring":                               # key/value blocks round the ring, tiles of 3 (pads)
            return ring_attention(q, k, v, mask, axis="context", block_size=3)
        return context_parallel_attention(q, k, v, mask, axis="context", backend=backend, block_size=8)
    spec = P(None, "context")
    # the chunked backend's scan carries start as constants, which shard_map's varying-axes check refuses
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec,
                         check_vma=backend == "reference")(q, k, v, pos, seg)


def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * (segments != 0)[..., None, None])


want = reference(q, k, v)
want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
out = {}
CASES = ()      # train-all: all six (the default lane checks them on 4 devices: tests/test_context_devices.py)
for order in ("contiguous", "zigzag"):
    for backend in ("reference", "chunked", "ring"):
        if f"{order} {backend}" not in CASES and "train-all" not in sys.argv[2:]:
            continue
        z = (lambda x: zigzag(x, C)) if order == "zigzag" else (lambda x: x)
        back = (lambda x: unzigzag(x, C)) if order == "zigzag" else (lambda x: x)

        def fn(q, k, v, backend=backend, z=z, back=back):
            return back(jax.jit(sharded, static_argnums=5)(z(q), z(k), z(v), z(positions), z(segments), backend))
        got = fn(q, k, v)
        grads = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
        out[f"{order} {backend}"] = {
            "out": float(jnp.max(jnp.abs(got - want))),
            "grads": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, want_grads)),
            "scale": float(jnp.max(jnp.abs(want)))}
# a sliding window and a soft-cap travel round the ring too
wmask = CausalMask(positions, positions, segments != 0, segments, segments, jnp.int32(5))
capped = lambda q, k, v: dot_product_attention(q, k, v, mask=wmask, softcap=2.0).out  # noqa: E731


def ring_capped(q, k, v):
    def local(q, k, v, pos, seg):
        return ring_attention(q, k, v, CausalMask(pos, pos, seg != 0, seg, seg, jnp.int32(5)), softcap=2.0,
                              block_size=4)
    spec = P(None, "context")
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)(
        q, k, v, positions, segments)


if "train-all" in sys.argv[2:]:
    g_want = jax.grad(loss(capped), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(loss(jax.jit(ring_capped)), argnums=(0, 1, 2))(q, k, v)
    out["ring window softcap"] = {"out": float(jnp.max(jnp.abs(jax.jit(ring_capped)(q, k, v) - capped(q, k, v)))),
                                  "grads": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_got, g_want)),
                                  "scale": float(jnp.max(jnp.abs(capped(q, k, v))))}
# the ring's program passes blocks (collective-permute) and never gathers the sequence
hlo = jax.jit(jax.grad(loss(ring_capped), argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
out["ring collectives"] = {"all-gather": hlo.count("all-gather("), "collective-permute": hlo.count("collective-permute(")}
# the causal load balance: visible (query, key) pairs per device, contiguous against zigzag
for order in ("contiguous", "zigzag"):
    pos = zigzag(jnp.arange(T)[None], C)[0] if order == "zigzag" else jnp.arange(T)
    per = pos.reshape(C, -1)
    out[f"pairs {order}"] = [int(jnp.sum(per[d][:, None] >= jnp.arange(T)[None, :])) for d in range(C)]

LM = ["data.block_size=16", "model.num_heads=4", "model.runtime.dropout=0.0", "optim.schedule=constant",
      "optim.lr=0.01", "optim.warmup_steps=0", "model.runtime.attention_block=4"]
PLANS = {"one": ["parallel.data=1"],
         "data x context ring": ["parallel.data=2", "parallel.context=4", "parallel.context_attention=ring"],
         "data x context ring zigzag": ["parallel.data=2", "parallel.context=4", "parallel.context_attention=ring",
                                        "parallel.context_order=zigzag"],
         "fsdp x context gather zigzag": ["parallel.data=1", "parallel.fsdp=2", "parallel.context=4",
                                          "parallel.context_order=zigzag"],
         "context ring zigzag": ["parallel.data=1", "parallel.context=8", "parallel.context_attention=ring",
                                 "parallel.context_order=zigzag"],
         "fsdp x context ring": ["parallel.data=1", "parallel.fsdp=2", "parallel.context=4",
                                 "parallel.context_attention=ring"]}


def lm_steps(overrides: list[str], n: int = 4) -> dict:
    cfg = resolve_vocab(tiny_lm(*LM, *overrides), 64)
    plan = Plan(cfg.parallel, jax.devices()[:1] if overrides == PLANS["one"] else None)
    graphs, state = init_state(cfg, plan)
    rows, task = cfg.data.batch_size, build_task(cfg.data)
    it = iter(task.train_dataset(rows, cfg.train.seed, plan.local_rows(rows)))
    step, losses = make_train_step(graphs, cfg, plan), []
    with plan.use():
        batch = plan.global_batch(next(it), rows)
        hlo = step.lower(state, batch, jax.random.key(0)).compile().as_text()
        for i in range(n):
            state, m = step(state, batch if i == 0 else plan.global_batch(next(it), rows), jax.random.key(i))
            losses.append(float(m["loss"]))
    flat = jax.tree_util.tree_flatten_with_path(state["model"])[0]
    return {"losses": losses, "params": {jax.tree_util.keystr(p): np.asarray(a, np.float64).ravel().tolist()
                                         for p, a in flat},
            "collective-permute": hlo.count("collective-permute("), "mesh": plan.sizes, "describe": plan.describe()}


def resumed(tmp: Path) -> dict:
    """{name: train losses by step}: uninterrupted data parallel, and stopped at step 3 under one plan then
    resumed under another."""
    steps = ["train.steps=6", "train.eval_every=6", "train.checkpoint_every=3", "train.log_every=1"]
    runs = {"data": [["parallel.data=8"]], "ring zigzag -> data": [PLANS["context ring zigzag"], ["parallel.data=8"]],
            "data -> ring zigzag": [["parallel.data=8"], PLANS["context ring zigzag"]]}
    got = {}
    for name, plans in runs.items():
        for i, plan in enumerate(plans):
            cfg = tiny_lm(*LM, *steps, *plan)
            train(cfg, tmp / name, progress="none", stop_after=3 if i == 0 and len(plans) > 1 else None)
        got[name] = train_losses(tmp / name)
    return got


DEFAULT_PLANS = ("one", "data x context ring zigzag")
if {"train", "train-all"} & set(sys.argv[2:]):
    out["train"] = {name: lm_steps(o) for name, o in PLANS.items()
                    if "train-all" in sys.argv[2:] or name in DEFAULT_PLANS}
if "resume" in sys.argv[2:]:
    import tempfile
    out["resume"] = resumed(Path(tempfile.mkdtemp()))
Path(sys.argv[1]).write_text(json.dumps(out))
