"""Pipeline parallelism's bubble: the share of (iteration, stage) slots of the GPipe schedule that hold no
micro-batch, against the number of micro-batches M, for P = 2 and 4 stages; counted from the schedule the
pipeline runs (`jaxformer.nn.pipeline.schedule`), against (P-1)/(M+P-1); and what it costs: the train step's
median wall time under stage P × data 8/P over plain data parallelism's on the same 8 fake CPU devices (the same
useful work per device). The fake devices share the machine's cores, so wall time measures the work all devices
do, not a critical path: the bubbles' slots compute on stale activations, which costs (M+P-1)/M on the layers
(diluted by the embedding, head and optimizer, which every stage group runs), plus the pipeline's copies. (XLA's
cost analysis counts a loop body once, whatever its trips, so it cannot measure this.)

  .venv/bin/python benchmarks/pipeline_bubble.py [--out benchmarks/results]

The model: a decoder-only LM, D 256, 4 heads, F 1024, 8 layers, V 256, batch 64 × 64 tokens, float32, AdamW.
"""
from __future__ import annotations

import os

if __name__ == "__main__":        # 8 fake devices for a run; an import (tools/readme_tables.py) leaves JAX alone
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer.config import (Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig,  # noqa: E402
                              replaced)
from jaxformer.nn.pipeline import bubble_fraction, counted_bubble_fraction  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.train.step import init_state, make_train_step  # noqa: E402

MODEL = dict(arch="decoder_only", vocab_size=256, d_model=256, num_heads=4, d_ff=1024, num_decoder_layers=8,
             max_len=64, positional="rope", use_bias=False, pad_id=-1, norm__position="pre", norm__type="rmsnorm",
             runtime__dropout=0.0)
ROWS, LENGTH = 64, 64


def step_seconds(parallel: dict, steps: int) -> float:
    """The median wall seconds of a train step under `parallel` (after one compiling step)."""
    cfg = Config(model=replaced(ModelConfig(), **MODEL),
                 data=DataConfig(task="text", path="builtin:alice", block_size=LENGTH, batch_size=ROWS),
                 optim=OptimConfig(name="adamw", lr=1e-4, weight_decay=0.0),
                 train=TrainConfig(steps=100, eval_every=100, checkpoint_every=100, best_metric="loss",
                                   best_mode="min"), parallel=ParallelConfig(**parallel))
    plan = Plan(cfg.parallel)
    plan.check_pipeline(cfg)
    graphs, state = init_state(cfg, plan)
    tokens = np.random.default_rng(0).integers(0, 256, (ROWS, LENGTH)).astype(np.int32)
    batch = plan.global_batch({"inputs": tokens, "targets": tokens}, ROWS)
    step, times = make_train_step(graphs, cfg, plan), []
    with plan.use():
        for i in range(steps + 1):
            t0 = time.perf_counter()
            state, m = step(state, batch, jax.random.key(i))
            jax.block_until_ready(m["loss"])
            times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    from jaxformer.stats import machine
    base = step_seconds(dict(data=8), args.steps)
    rows = []
    for p, ms in ((2, (1, 2, 4, 8, 16)), (4, (1, 2, 4, 8, 16))):
        for m in ms:
            s = step_seconds(dict(stage=p, data=8 // p, microbatches=m), args.steps)
            rows.append({"stages": p, "microbatches": m, "bubble_formula": bubble_fraction(p, m),
                         "bubble_counted": counted_bubble_fraction(p, m), "step_s": s,
                         "time_over_data_parallel": s / base, "layers_bound": (m + p - 1) / m})
            print(json.dumps(rows[-1]), flush=True)
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "model": MODEL,
           "batch": [ROWS, LENGTH], "devices": 8, "steps": args.steps, "data_parallel_step_s": base, "rows": rows}
    out = Path(args.out)
    (out / "pipeline_bubble.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Pipeline parallelism: the GPipe bubble against micro-batches", "",
             f"`.venv/bin/python benchmarks/pipeline_bubble.py` on {res['machine']}, {res['date']} (8 fake CPU "
             f"devices sharing the cores: wall time = all devices' work; median of {res['steps']} steps). A decoder "
             f"LM D 256, 8 layers, batch 64 × 64, AdamW; data parallel: {res['data_parallel_step_s']:.3f} s a step.",
             "", table(res)]
    (out / "pipeline_bubble.md").write_text("\n".join(lines) + "\n")


def table(res: dict) -> str:
    out = ["| stages P | micro-batches M | bubble (P−1)/(M+P−1) | counted in the schedule run | step time ÷ "
           "data parallel's | (M+P−1)/M (the layers' work) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['stages']} | {r['microbatches']} | {r['bubble_formula']:.3f} | {r['bubble_counted']:.3f} | "
                   f"{r['time_over_data_parallel']:.2f} | {r['layers_bound']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
