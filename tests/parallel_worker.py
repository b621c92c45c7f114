"""Runs in its own process with N fake CPU devices (the device count is fixed when JAX starts, so the rest of the
suite keeps its single device): `python tests/parallel_worker.py JOB.json OUT.json`. The assertions live in
tests/test_parallel.py; this file only computes and records.

JOB keys (all optional but "devices"):
  strategies {name: overrides}   5 train steps of the tiny reversal config under each plan (the train step alone,
                                 as train() runs it), plus the same on one device: losses, the PartitionSpec and
                                 logical axes of every state array, per-device bytes
  moe {name: overrides}          as strategies, for a Mixture-of-Experts model ("one device" = its baseline)
  lora {name: overrides}         the same, for low-rank adapters (model.lora; "... one device": a baseline)
  errors {name: overrides}       train() must refuse these with a named error before compiling anything
  configs [path, ...]            shipped configs: the plan each gives on these devices (nothing compiled)
  lm_decode {name: overrides}    a fresh tiny char LM decoded (generate_lm) under each mesh ("one" = one device)
  eval_tasks {train, workdir, meshes}
                                 a tiny char LM trained, then scored as eval-tasks scores under each mesh
  interp {name: overrides}       a fresh tiny char LM read and patched under each mesh ("one" = one device): captured
                                 sites (values and shardings) with a patch applied, the patching grid and the
                                 attribution map (jaxformer.patching)
  reshard {overrides, workdir, meshes {name: overrides}}
                                 train() under `overrides` (saving a checkpoint), then load that checkpoint onto
                                 each mesh: every parameter's values and greedy / beam outputs there
"""
from __future__ import annotations

import hashlib
import gc
import json
import os
import sys
import time
from pathlib import Path

job = json.loads(Path(sys.argv[1]).read_text())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={job['devices']}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"            # the fake devices are CPU devices, on a GPU machine too
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from helpers import GC_THRESHOLDS, tiny_lm, train_losses, tiny_reverse  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)
from jaxformer.config import resolve_vocab  # noqa: E402
from jaxformer.configio import load_config_file  # noqa: E402
from jaxformer.data import build_task  # noqa: E402
from jaxformer.decode import beam_search, generate_lm, generate_seq2seq  # noqa: E402
from jaxformer.errors import JaxformerError  # noqa: E402
from jaxformer.memory import shard_bytes  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.inference import load_model  # noqa: E402
from jaxformer.train.loop import train  # noqa: E402
from jaxformer.train.step import abstract_state, init_state, make_train_step  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: COMPILES.append(event) if event.endswith("backend_compile_duration") else None)


def specs(state) -> dict:
    """{path: PartitionSpec as a list} of every array of a state."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
            for p, x in flat}


def logical(state) -> dict:
    """{path: logical axis names} of every array (those without are absent)."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for p, v in leaves:
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        if names:
            out[jax.tree_util.keystr(p) + ".value"] = list(names)
    return out


def steps(overrides: list[str], devices=None, n: int = 5) -> dict:
    cfg = tiny_reverse(*overrides)
    plan = Plan(cfg.parallel, devices)
    graphs, state = init_state(cfg, plan)
    task = build_task(cfg.data)
    rows, out = cfg.data.batch_size, {"mesh": plan.sizes, "specs": specs(state), "logical": logical(state),
                                      "bytes": {k: shard_bytes(state[k]) for k in ("model", "opt")},
                                      "array_bytes": {p: shard_bytes(a) for p, a in
                                                      zip(specs(state), jax.tree.leaves(state))}}
    it = iter(task.train_dataset(rows, cfg.train.seed, plan.local_rows(rows)))
    step, key, losses, moe = make_train_step(graphs, cfg, plan), jax.random.key(cfg.train.seed), [], {}
    with plan.use():
        for i in range(n):
            state, m = step(state, plan.global_batch(next(it), rows), jax.random.fold_in(key, i))
            losses.append(float(m["loss"]))
            for k in (k for k in m if k.startswith("moe_")):           # a MoE model's router metrics
                moe.setdefault(k, []).append(np.asarray(m[k]).tolist())
    out["losses"], out["moe"] = losses, moe
    return out


def refused(overrides: list[str]) -> dict:
    before = len(COMPILES)
    try:
        train(tiny_reverse(*overrides), Path(job["tmp"]) / "refused", progress="none")
    except JaxformerError as e:
        return {"error": type(e).__name__, "message": str(e), "compiled": len(COMPILES) - before}
    return {"error": None}


def reshard(spec: dict) -> dict:
    """Train under spec["overrides"] in two sittings (stopped at step 2, then resumed on the same mesh), then
    restore the final checkpoint onto each of spec["meshes"]."""
    cfg = tiny_reverse(*spec["overrides"])
    train(cfg, spec["workdir"], progress="none", stop_after=2)
    train(cfg, spec["workdir"], progress="none")
    src = np.array([[3, 4, 5, 6, 2, 0, 0], [9, 8, 7, 2, 0, 0, 0], [5, 5, 6, 7, 8, 2, 0], [4, 3, 2, 0, 0, 0, 0]] * 2,
                   np.int32)
    out = {"losses": train_losses(spec["workdir"])}
    for name, overrides in spec["meshes"].items():
        cfg = tiny_reverse(*overrides)
        plan = Plan(cfg.parallel, jax.devices()[:1] if name == "one" else None)
        loaded = load_model(spec["workdir"], "latest", plan)
        state = nnx.state(loaded.model)
        with plan.use():
            seg = (src != 0).astype(np.int32)                     # the padding, said explicitly
            greedy = generate_seq2seq(loaded.model, src, max_new=7, bos_id=1, eos_id=2, segment_ids=seg)
            beam = beam_search(loaded.model, src, max_new=7, bos_id=1, eos_id=2, beam=3, segment_ids=seg)
        out[name] = {"specs": specs(state), "greedy": np.asarray(greedy).tolist(), "beam": np.asarray(beam).tolist(),
                     "values": {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest()     # bitwise equality
                                for k, v in zip(specs(state), jax.tree.leaves(state))}}
    return out


def eval_tasks(spec: dict) -> dict:
    """A tiny char LM trained on one device into spec["workdir"], then loaded under each of spec["meshes"]
    ({name: overrides}; "one": one device) and scored as `jaxformer eval-tasks` scores: log-likelihoods of
    (context, continuation) pairs and greedy generations."""
    from jaxformer.inference.tasks import HarnessModel, _Request
    train(tiny_lm(*spec["train"]), spec["workdir"], progress="none")
    pairs = [("Alice was", " beginning"), ("the", " rabbit"), ("Alice", " said"), ("down the ", "rabbit-hole")]
    out = {}
    for name, overrides in spec["meshes"].items():
        plan = Plan(tiny_lm(*overrides).parallel, jax.devices()[:1] if name == "one" else None)
        with plan.use():
            hm = HarnessModel(load_model(spec["workdir"], "latest", plan), batch_rows=8)
            ll = hm.loglikelihood([_Request(c, x) for c, x in pairs])
            gen = hm.generate_until([_Request(c, {"until": ["\n"], "max_gen_toks": 6}) for c, _ in pairs])
        out[name] = {"loglikelihood": [[float(a), bool(b)] for a, b in ll], "generated": gen}
    return out


def _fresh_lm(name: str, overrides: list[str]):
    """A freshly initialised tiny char LM (the tests' TINY_LM) under the mesh of `overrides` ("one": one device)
    -> (plan, graphs, state, model)."""
    cfg = resolve_vocab(tiny_lm(*overrides), 32)
    plan = Plan(cfg.parallel, jax.devices()[:1] if name == "one" else None)
    graphs, state = init_state(cfg, plan)
    return plan, graphs, state, nnx.merge(graphs.model, state["model"])


def lm_decode(meshes: dict) -> dict:
    """A freshly initialised tiny char LM (the tests' TINY_LM) decoded under each mesh: greedy and sampled
    continuations of ragged, left-padded prompts."""
    out = {}
    prompts = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 0, 0, 0, 3, 4], [7, 7, 7, 7, 7, 7]] * 2,
                       np.int32)
    for name, overrides in meshes.items():
        plan, graphs, state, model = _fresh_lm(name, overrides)
        with plan.use():
            seg = (prompts != 0).astype(np.int32)                 # the padding, said explicitly
            greedy = generate_lm(model, prompts, max_new=8, segment_ids=seg)
            sampled = generate_lm(model, prompts, max_new=8, temperature=1.0, key=jax.random.key(3), segment_ids=seg)
        out[name] = {"greedy": np.asarray(greedy).tolist(), "sampled": np.asarray(sampled).tolist()}
    return out


def _logit_diff(logits):
    return jnp.mean(logits[:, -1, 3] - logits[:, -1, 4])


def interp(meshes: dict) -> dict:
    """Capture, patch, the patching grid and attribution patching of a fresh tiny char LM under each mesh."""
    from jaxformer.patching import attribution_patching, patching_grid
    out = {}
    tokens = np.random.default_rng(0).integers(1, 32, (8, 10)).astype(np.int32)
    corrupt = tokens.copy()
    corrupt[:, 4] = corrupt[:, 4] % 31 + 1
    for name, overrides in meshes.items():
        plan, graphs, state, model = _fresh_lm(name, overrides)
        with plan.use():
            @jax.jit
            def read(state, tokens):
                steer = {"resid_mid": lambda v, at: v + 0.5 * (at == 1)}          # a steering patch at layer 1
                return nnx.merge(graphs.model, state)(tokens, capture=("resid_post", "z"), patch=steer)
            logits, aux = read(state["model"], tokens)
            grid = patching_grid(model, (tokens,), (corrupt,), "resid_pre", _logit_diff)
            est = attribution_patching(model, (tokens,), (corrupt,), "z", _logit_diff, over="head")
        cap = aux["captured"]
        out[name] = {"logits": np.asarray(logits).tolist(), "grid": np.asarray(grid).tolist(),
                     "attribution": np.asarray(est).tolist(),
                     **{site: np.asarray(v).tolist() for site, v in cap.items()},
                     "specs": {site: [list(a) if isinstance(a, tuple) else a for a in v.sharding.spec]
                               for site, v in cap.items()}, "mesh": plan.sizes}
    return out


def shipped(path: str) -> dict:
    """A shipped parallel config: its plan on these devices, and that every parameter fits the plan."""
    cfg = resolve_vocab(load_config_file(path), 13)
    plan = Plan(cfg.parallel)
    plan.check_pipeline(cfg)
    abstract_state(cfg, plan)
    return {"mesh": plan.sizes, "mode": plan.mode}


results: dict = {"devices": jax.device_count(), "strategies": {}, "errors": {}, "configs": {}, "seconds": {}}
_t = time.perf_counter()


def _lap(what: str) -> None:
    """Wall seconds of each part, so that the suite's budget can be split by what costs."""
    global _t
    results["seconds"][what] = round(time.perf_counter() - _t, 1)
    _t = time.perf_counter()


for path in job.get("configs", []):
    results["configs"][Path(path).stem] = shipped(path)
_lap("configs")
for name, overrides in job.get("strategies", {}).items():
    results["strategies"][name] = steps(overrides)
    _lap(name)
if job.get("strategies"):
    results["strategies"]["one device"] = steps(job["baseline"], jax.devices()[:1])
    _lap("one device")
for name, overrides in job.get("moe", {}).items():
    results.setdefault("moe", {})[name] = steps(overrides, jax.devices()[:1] if name == "one device" else None)
    _lap(f"moe {name}")
for name, overrides in job.get("lora", {}).items():
    results.setdefault("lora", {})[name] = steps(overrides, jax.devices()[:1] if name.endswith("one device") else None)
    _lap(f"lora {name}")
for name, overrides in job.get("errors", {}).items():
    results["errors"][name] = refused(overrides)
_lap("errors")
if "lm_decode" in job:
    results["lm_decode"] = lm_decode(job["lm_decode"])
    _lap("lm_decode")
if "interp" in job:
    results["interp"] = interp(job["interp"])
    _lap("interp")
if "eval_tasks" in job:
    results["eval_tasks"] = eval_tasks(job["eval_tasks"])
    _lap("eval_tasks")
if "reshard" in job:
    results["reshard"] = reshard(job["reshard"])
    _lap("reshard")
Path(sys.argv[2]).write_text(json.dumps(results))
