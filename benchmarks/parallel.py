"""Scale-out on N fake CPU devices: per parallel strategy, losses against one device and per-device memory.

  .venv/bin/python benchmarks/parallel.py [--devices 8] [--steps 5]

1. Losses: the tiny reversal config of the tests (D32, 1+1 layers, 4 heads, vocab 16, batch 16, no dropout,
   AdamW at a constant 0.01), --steps train steps under each strategy and on one device (same data, same
   keys): the largest relative difference of the per-step losses.
2. Memory: configs/base.py (the 2017 base model: D512, 8 heads, F2048, 6+6 layers, vocab 32000; batch 32 of the
   reversal data, length 7) under each strategy, compiled but not run. Per device: the train step's arguments
   (parameters + optimizer state + batch, from XLA's memory analysis of the partitioned program), its temporary
   buffers, and the collectives in the program text (ops inside the scanned layer stack run once per layer).
Writes benchmarks/results/parallel.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={args.devices}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")     # fake CPU devices, also on a GPU machine

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer.config import resolve_vocab  # noqa: E402
from jaxformer.configio import apply_overrides, load_config_file  # noqa: E402
from jaxformer.data import build_task  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.train.step import abstract_state, init_state, make_train_step  # noqa: E402

n = args.devices
STRATEGIES = {
    "one device": ["parallel.data=1"],
    "data parallel": [f"parallel.data={n}"],
    "fsdp": ["parallel.data=1", f"parallel.fsdp={n}"],
    "data × tensor": [f"parallel.data={n // 4}", "parallel.tensor=4"],
    "fsdp × tensor": ["parallel.data=1", f"parallel.fsdp={n // 4}", "parallel.tensor=4"],
    "data × fsdp × tensor": [f"parallel.data={n // 4}", "parallel.fsdp=2", "parallel.tensor=2"],
    "shard_map (data)": ["parallel.mode=shard_map", f"parallel.data={n}"],
}
TINY = ["model.d_model=32", "model.d_ff=64", "model.num_heads=4", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "data.num_train=128", "data.num_eval=32", "data.batch_size=16",
        "model.vocab_size=16", "model.runtime.dropout=0.0", "optim.schedule=constant", "optim.lr=0.01",
        "optim.warmup_steps=0"]
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def plan_for(cfg):
    return Plan(cfg.parallel, jax.devices()[:1] if cfg.parallel.data == 1 and cfg.parallel.fsdp == 1
                and cfg.parallel.tensor == 1 else None)


def losses(overrides: list[str]) -> list[float]:
    cfg = apply_overrides(load_config_file(ROOT / "configs/reverse.py"), TINY + overrides)
    plan = plan_for(cfg)
    graphs, state = init_state(cfg, plan)
    rows = cfg.data.batch_size
    it = iter(build_task(cfg.data).train_dataset(rows, cfg.train.seed, plan.local_rows(rows)))
    step, key, out = make_train_step(graphs, cfg, plan), jax.random.key(cfg.train.seed), []
    with plan.use():
        for i in range(args.steps):
            state, m = step(state, plan.global_batch(next(it), rows), jax.random.fold_in(key, i))
            out.append(float(m["loss"]))
    return out


def memory(overrides: list[str]) -> dict:
    cfg = apply_overrides(load_config_file(ROOT / "configs/base.py"), ["data.batch_size=32",
                                                                       "model.runtime.dropout=0.0"]
                          + overrides)
    cfg = resolve_vocab(cfg, 13)
    plan = plan_for(cfg)
    graphs, abstract = abstract_state(cfg, plan)
    width = cfg.data.max_len + 1
    batch = {k: jax.ShapeDtypeStruct((cfg.data.batch_size, width), np.int32, sharding=plan.batch_sharding(2))
             for k in ("src", "tgt_in", "tgt_out")}
    t = time.perf_counter()
    with plan.use():
        compiled = make_train_step(graphs, cfg, plan).lower(abstract, batch, jax.random.key(0)).compile()
    mem, text = compiled.memory_analysis(), compiled.as_text()
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    return {"mesh": plan.sizes, "compile_s": time.perf_counter() - t, "state_bytes_total": state_bytes,
            "comm_bytes": comm_bytes(cfg, plan.sizes, width),
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "collectives": {c: len(re.findall(rf"= [^=]*? {c}(?:-start)?\(", text)) for c in COLLECTIVES}}


def comm_bytes(cfg, sizes: dict, length: int) -> float:
    """Bytes one device sends per train step by the shapes (ring collectives, float32), to first order:
    gradients all-reduced over data: 2(d-1)/d · 4P/(f·t); FSDP's weight all-gathers (forward and backward)
    and gradient reduce-scatter: 3(f-1)/f · 4P/t; tensor parallel's activation all-reduces, one after each
    attention-output and FFN projection in forward and backward: 2 · (2 L_enc + 3 L_dec) · 2(t-1)/t · B/(d·f)
    · T · D · 4. P = parameter count (biases and norms, replicated over tensor, are neglected)."""
    d, f, t = sizes["data"], sizes["fsdp"], sizes["tensor"]
    m = cfg.model
    params = sum(a.size for a in jax.tree.leaves(abstract_state(cfg)[1]["model"]))
    grads = 2 * (d - 1) / d * 4 * params / (f * t)
    fsdp = 3 * (f - 1) / f * 4 * params / t
    blocks = 2 * m.num_encoder_layers + 3 * m.num_decoder_layers
    tensor = 2 * blocks * 2 * (t - 1) / t * cfg.data.batch_size / (d * f) * length * m.d_model * 4
    return grads + fsdp + tensor


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    results = {"machine": {"platform": platform.machine(), "processor": cpu_name(),
                           "cpus": os.cpu_count(), "jax": jax.__version__, "devices": jax.device_count(),
                           "date": time.strftime("%Y-%m-%d")}, "strategies": {}}
    base = None
    for name, ov in STRATEGIES.items():
        ls = losses(ov)
        base = base or ls
        rel = max(abs(a - b) / abs(b) for a, b in zip(ls, base))
        results["strategies"][name] = {"losses": ls, "max_rel_diff": rel, "base_model": memory(ov)}
        print(name, f"max rel diff {rel:.2e}", results["strategies"][name]["base_model"], flush=True)
    out = ROOT / "benchmarks/results"
    (out / "parallel.json").write_text(json.dumps(results, indent=1))
    (out / "parallel.md").write_text(report(results))


def report(r: dict) -> str:
    m = r["machine"]
    mib = lambda b: f"{b / 2 ** 20:,.1f}"
    first, last = r["strategies"]["one device"]["losses"][0], r["strategies"]["one device"]["losses"][-1]
    one = r["strategies"]["one device"]["base_model"]
    lines = [
        "# Scale-out: strategies against one device", "",
        f"`benchmarks/parallel.py --devices {m['devices']} --steps {args.steps}` on {m['processor']}, "
        f"{m['platform']} ({m['cpus']} cores) with {m['devices']} fake CPU devices (`--xla_force_host_platform_device_count`), "
        f"jax {m['jax']}, {m['date']}. Written by the script.", "",
        "**Losses**: the tests' tiny reversal config (D32, 1+1 layers, 4 heads, vocab 16, batch 16, dropout 0, "
        f"AdamW at a constant 0.01), {args.steps} train steps, float32: largest relative difference of a step's "
        f"loss against one device (the loss falls from {first:.3f} to {last:.3f} over those steps).", "",
        "**Memory**: `configs/base.py` (D512, 8 heads, F2048, 6+6 layers, vocab 32000; "
        f"{mib(one['state_bytes_total'])} MiB of parameters + AdamW state in float32), batch 32 × length 7, "
        "compiled for the mesh and not run: XLA's memory analysis of the partitioned program, per device. "
        "Arguments = parameters + optimizer state + batch held by one device; temporaries = activations, "
        "gradients and gathered weights. Collectives: ops in the program text (those inside the scanned "
        "layer stack run once per layer).", "",
        "Communication: MiB one device sends per step by the shapes (`comm_bytes` in the script: ring "
        "collectives, gradients over data, FSDP's gathers and gradient scatter, tensor parallel's activation "
        "all-reduces), a first-order estimate, not a measurement.", "",
        "| strategy | mesh (data × fsdp × tensor) | max rel. loss diff | arguments MiB / device | vs one device "
        "| temporaries MiB / device | sends MiB / step (shapes) | all-reduce | all-gather | reduce-scatter |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["strategies"].items():
        b = s["base_model"]
        mesh = " × ".join(str(v) for v in b["mesh"].values())
        c = b["collectives"]
        lines.append(f"| {name} | {mesh} | {s['max_rel_diff']:.1e} | {mib(b['argument_bytes'])} | "
                     f"{b['argument_bytes'] / one['argument_bytes']:.3f} | {mib(b['temp_bytes'])} | "
                     f"{mib(b['comm_bytes'])} | {c['all-reduce']} | {c['all-gather']} | {c['reduce-scatter']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
