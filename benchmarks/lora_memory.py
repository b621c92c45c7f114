"""Low-rank adapters against full fine-tuning: what trains, what the training state holds, and what XLA's compiled
train step needs, per arm (model.lora: rank, targets, the frozen base's precision).

  .venv/bin/python benchmarks/lora_memory.py [--out benchmarks/results]

The model is a Qwen2.5-0.5B-shaped decoder scaled down to compile quickly on a CPU (D 896, 14 query heads of 64,
2 kv heads, F 4864, 6 layers, V 32000, untied head, RoPE, pre-RMSNorm, SwiGLU; 1 of Qwen's 24 layers in 4), AdamW,
batch 8 × 512 tokens, float32 compute. Per arm: trainable parameters; the training state's bytes (model and
optimizer state, exactly: the arrays' sizes); and from the train step compiled ahead of time (nothing runs),
XLA's memory analysis: argument bytes (the state and the batch), temporaries (activations, gradients, the
update), and their sum as the step's peak estimate. On a GPU the temporaries differ with fusion and remat; the
state bytes do not.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, replaced
from jaxformer.train.step import abstract_state, make_train_step

MODEL = dict(arch="decoder_only", vocab_size=32000, d_model=896, num_heads=14, num_kv_heads=2, head_dim=64,
             d_ff=4864, num_decoder_layers=6, max_len=512, positional="rope", activation="swiglu", use_bias=False,
             tie_embeddings=False, scale_embeddings=False, pad_id=-1, norm__position="pre", norm__type="rmsnorm",
             runtime__dropout=0.0)
ALL = "q,k,v,o,gate,up,down"
ARMS = [("full fine-tuning", {}),
        ("LoRA r=16 q,v", dict(lora__rank=16, lora__targets=("q", "v"))),
        ("LoRA r=16 all", dict(lora__rank=16, lora__targets=tuple(ALL.split(",")))),
        ("LoRA r=16 all, base bf16", dict(lora__rank=16, lora__targets=tuple(ALL.split(",")),
                                          lora__base="bfloat16")),
        ("LoRA r=16 all, base int8", dict(lora__rank=16, lora__targets=tuple(ALL.split(",")), lora__base="int8"))]


def config(**lora) -> Config:
    model = replaced(ModelConfig(), **MODEL, **lora)
    return Config(model=model, data=DataConfig(task="text", path="builtin:alice", block_size=512, batch_size=8),
                  optim=OptimConfig(name="adamw", lr=1e-4, weight_decay=0.0),
                  train=TrainConfig(steps=100, eval_every=100, checkpoint_every=100, best_metric="loss",
                                    best_mode="min"))


def nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(name: str, lora: dict) -> dict:
    from flax import nnx
    cfg = config(**lora)
    graphs, state = abstract_state(cfg)
    model = nnx.merge(graphs.model, state["model"])
    from jaxformer.nn.lora import trainable
    trained = nnx.state(model, trainable(cfg.model))
    batch = {k: jax.ShapeDtypeStruct((8, 512), jnp.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    t0 = time.perf_counter()
    compiled = make_train_step(graphs, cfg).lower(state, batch, jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    row = {"arm": name, "trainable": sum(x.size for x in jax.tree.leaves(trained)),
           "params": sum(x.size for x in jax.tree.leaves(state["model"])),
           "model_bytes": nbytes(state["model"]), "opt_bytes": nbytes(state["opt"]),
           "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
           "compile_s": round(time.perf_counter() - t0, 1)}
    row["peak_bytes"] = row["argument_bytes"] + row["temp_bytes"]
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    from jaxformer.stats import machine
    rows = [measure(n, lora) for n, lora in ARMS]
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "model": MODEL,
           "batch": [8, 512], "rows": rows}
    out = Path(args.out)
    (out / "lora_memory.json").write_text(json.dumps(res, indent=1) + "\n")
    full = rows[0]
    mib = lambda b: f"{b / 2**20:,.0f}"                                              # noqa: E731
    lines = ["# LoRA against full fine-tuning: trainable parameters and train-step memory", "",
             f"`.venv/bin/python benchmarks/lora_memory.py` on {res['machine']}, {res['date']}. "
             "A Qwen2.5-0.5B-shaped decoder with 6 layers (D 896, 14×64 query heads, 2 kv heads, F 4864, V 32000, "
             "untied head), AdamW, batch 8 × 512, float32 compute; the train step compiled ahead of time (XLA:CPU's "
             "memory analysis: arguments = state + batch; temporaries = activations, gradients, update).", "",
             "| arm | trainable params | % of model | model MiB | optimizer MiB | XLA arguments MiB | XLA temporaries "
             "MiB | peak MiB | peak vs full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['trainable']:,} | {100 * r['trainable'] / r['params']:.2f} | "
                     f"{mib(r['model_bytes'])} | {mib(r['opt_bytes'])} | {mib(r['argument_bytes'])} | "
                     f"{mib(r['temp_bytes'])} | {mib(r['peak_bytes'])} | {r['peak_bytes'] / full['peak_bytes']:.2f}× |")
    lines += ["", "The embedding and the head (32000 × 896 each) stay float32 in every arm: a frozen base in bf16/int8 "
              "covers the layer stack's projections only."]
    (out / "lora_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
