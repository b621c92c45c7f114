"""Runs in its own process with N fake CPU devices (the device count is fixed when JAX starts):
`python tests/pipeline_worker.py JOB.json OUT.json`. The assertions live in tests/test_pipeline.py; this file only
computes and records.

JOB keys (all optional but "devices"):
  runs {name: overrides}         n train steps (the train step alone, as train() runs it) of the tiny reversal config
                                 under each plan ("... one device": on one device): losses, final parameters, and
                                 each stacked layer array's shape and per-device shard shape
  steps                          n (default 3)
  errors {name: overrides}       train() must refuse these with a named error before compiling anything
  resume {name: {first, then, workdir}}
                                 train() under `first` stopped after step 2, resumed under `then`; and an
                                 uninterrupted run under `first` (in workdir + "-whole"): both runs' losses and
                                 final parameters
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

job = json.loads(Path(sys.argv[1]).read_text())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={job['devices']}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"            # the fake devices are CPU devices, on a GPU machine too
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from helpers import GC_THRESHOLDS, train_losses, tiny_reverse  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)
from jaxformer.data import build_task  # noqa: E402
from jaxformer.errors import JaxformerError  # noqa: E402
from jaxformer.inference import load_model  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.train.loop import train  # noqa: E402
from jaxformer.train.step import init_state, make_train_step  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: COMPILES.append(event) if event.endswith("backend_compile_duration") else None)


def values(state) -> dict:
    """{path: the array's values as a nested list} of every float array of a state."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): np.asarray(x).tolist() for p, x in flat
            if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)}


def layer_shards(state) -> dict:
    """{path: [shape, shard shape, spec]} of every array of logical axes starting with "layers"."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for p, v in leaves:
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        if names and names[0] == "layers":
            a = v.get_value()
            out[jax.tree_util.keystr(p)] = [list(a.shape), list(a.sharding.shard_shape(a.shape)),
                                            [list(s) if isinstance(s, tuple) else s for s in a.sharding.spec],
                                            sorted({s.data.shape[0] for s in a.addressable_shards})]
    return out


def steps(overrides: list[str], devices=None, n: int = 3) -> dict:
    cfg = tiny_reverse(*overrides)
    plan = Plan(cfg.parallel, devices)
    graphs, state = init_state(cfg, plan)
    task = build_task(cfg.data)
    rows, out = cfg.data.batch_size, {"mesh": plan.sizes, "describe": plan.describe()}
    it = iter(task.train_dataset(rows, cfg.train.seed, plan.local_rows(rows)))
    step, key, losses = make_train_step(graphs, cfg, plan), jax.random.key(cfg.train.seed), []
    with plan.use():
        for i in range(n):
            state, m = step(state, plan.global_batch(next(it), rows), jax.random.fold_in(key, i))
            losses.append(float(m["loss"]))
    out.update(losses=losses, params=values(state["model"]),
               shards={k: layer_shards(state[k]) for k in ("model", "opt")})
    return out


def refused(overrides: list[str]) -> dict:
    before = len(COMPILES)
    try:
        train(tiny_reverse(*overrides), Path(job["tmp"]) / "refused", progress="none")
    except JaxformerError as e:
        return {"error": type(e).__name__, "message": str(e), "compiled": len(COMPILES) - before}
    return {"error": None}


def resume(spec: dict) -> dict:
    """train() under spec["first"] for 2 steps, then resumed under spec["then"]; an uninterrupted run under
    spec["first"]: {"resumed", "whole"}: losses and final parameters of each."""
    first, then = tiny_reverse(*spec["first"]), tiny_reverse(*spec["then"])
    out = {}
    for name, workdir, sittings in (("resumed", spec["workdir"], ((first, 2), (then, None))),
                                    ("whole", spec["workdir"] + "-whole", ((first, None),))):
        for cfg, stop in sittings:
            train(cfg, workdir, progress="none", **({"stop_after": stop} if stop else {}))
        plan = Plan(tiny_reverse("parallel.data=1").parallel, jax.devices()[:1])
        model = load_model(workdir, "latest", plan).model
        out[name] = {"losses": train_losses(workdir), "params": values(nnx.state(model))}
    return out


results: dict = {"devices": jax.device_count(), "runs": {}, "errors": {}, "resume": {}}
for name, overrides in job.get("runs", {}).items():
    results["runs"][name] = steps(overrides, jax.devices()[:1] if name.endswith("one device") else None,
                                  job.get("steps", 3))
for name, overrides in job.get("errors", {}).items():
    results["errors"][name] = refused(overrides)
for name, spec in job.get("resume", {}).items():
    results["resume"][name] = resume(spec)
Path(sys.argv[2]).write_text(json.dumps(results))
