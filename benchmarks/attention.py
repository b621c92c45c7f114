"""Attention memory and time: the "reference" backend (materialises [B,N,T,S]) against "chunked" (online softmax
over tiles, recomputing backward), and a whole train step with and without remat.

  .venv/bin/python benchmarks/attention.py [--lengths 1024 2048 4096 8192 16384] [--reps 3] [--heads 8]

Attention: forward + backward (gradients of q, k, v) of self-attention, batch 1, N heads of H=64, float32, causal
(the mask lazy, `ops.masks.CausalMask`: "reference" materialises it, "chunked" builds it per tile and skips tiles
above the diagonal) and without a mask (up to --full-up-to). For every backend and length T = S:
  peak     the compiled program's own memory analysis: arguments + outputs + temporaries (nothing runs);
  RSS      confirmation: the growth of the resident set (ru_maxrss) of a fresh child process that compiles and
           runs the same program once, over that process's resident set just before the call;
  time     median and min–max of --reps runs after a warm-up, in the same child process. A program whose
           compiled peak exceeds 80% of this machine's available memory is not run ("does not fit").
Train step: the GPT-style decoder (pre-LN, GELU, learned positions) at D512, 6 layers, 8 heads, T=1024, batch 4,
AdamW: reference attention with remat none / dots / full, chunked with none / full; compiled peak, RSS, time.
With a GPU present the "cudnn" and "pallas" backends run too (bfloat16 for cudnn).
Writes benchmarks/results/attention.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxformer import ops  # noqa: E402
from jaxformer.stats import machine  # noqa: E402

H = 64


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) * 1024
    return 0


def attention_program(backend: str, length: int, heads: int, causal: bool, dtype=jnp.float32):
    """-> (compiled fwd+bwd, args)."""
    shape = jax.ShapeDtypeStruct((1, length, heads, H), dtype)

    def loss(q, k, v):
        pos = jnp.arange(length)[None]
        mask = ops.CausalMask(pos, pos) if causal else None
        out = ops.dot_product_attention(q, k, v, mask=mask, backend=backend).out
        return jnp.sum(out.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    args = [jax.random.normal(jax.random.key(i), shape.shape, dtype) for i in range(3)]
    return compiled, args


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(kind: str, backend: str, length: int, heads: int, reps: int) -> dict:
    """One measurement in this (fresh) process: compiled peak, RSS growth of one run, times.
    kind: "causal" | "full" (attention with or without the causal mask) | "train:REMAT" (backend's train step)."""
    if kind in ("causal", "full"):
        dtype = jnp.bfloat16 if backend == "cudnn" else jnp.float32
        compiled, args = attention_program(backend, length, heads, kind == "causal", dtype)
        run = lambda: compiled(*args)
    else:
        compiled, run = train_step_program(backend, kind.split(":")[1])
    peak = peak_bytes(compiled)
    res = {"peak_bytes": peak}
    if peak > 0.8 * available_bytes():
        return res | {"fits": False}
    before = rss_bytes()
    jax.block_until_ready(run())
    res["rss_growth_bytes"] = rss_bytes() - before
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run())
        ts.append(time.perf_counter() - t)
    return res | {"fits": True, "times_s": ts, "median_s": statistics.median(ts)}


def train_step_program(backend: str, remat: str):
    """The GPT-style char model's jitted train step at D512 L6 T1024 B4 with model.runtime.remat=remat."""
    from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, replaced
    from jaxformer.train.step import init_state, make_train_step
    cfg = Config(model=replaced(ModelConfig(), arch="decoder_only", vocab_size=256, d_model=512, num_heads=8, d_ff=2048,
                                   num_decoder_layers=6, max_len=1024, runtime__dropout=0.0, norm__position="pre",
                                   positional="learned", activation="gelu", runtime__remat=remat,
                                   runtime__attention_backend=backend),
                 data=DataConfig(task="text", path="builtin:alice", block_size=1024, batch_size=4),
                 optim=OptimConfig(), train=TrainConfig(steps=10, best_metric="loss"))
    graphs, state = init_state(cfg)
    step = make_train_step(graphs, cfg)
    batch = {"inputs": jnp.ones((4, 1024), jnp.int32), "targets": jnp.ones((4, 1024), jnp.int32)}
    rng = jax.random.key(0)
    compiled = step.lower(state, batch, rng).compile()
    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], batch, rng)
        return metrics
    return compiled, run


def measure(kind: str, backend: str, length: int, heads: int, reps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, backend, str(length), str(heads), str(reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(b) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def fmt_time(r: dict) -> str:
    if "error" in r:
        return "error"
    if not r.get("fits"):
        return "does not fit"
    ts = r["times_s"]
    return f"{r['median_s']:.2f} s ({min(ts):.2f}–{max(ts):.2f})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--full-up-to", type=int, default=8192, help="longest length also run without a mask")
    p.add_argument("--no-train-step", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/attention"))
    p.add_argument("--child", nargs=5, metavar=("KIND", "BACKEND", "LENGTH", "HEADS", "REPS"))
    a = p.parse_args(argv)
    if a.child:
        kind, backend, length, heads, reps = a.child
        print(json.dumps(child(kind, backend, int(length), int(heads), int(reps))))
        return
    backends = ["reference", "chunked"] + (["cudnn", "pallas"] if jax.default_backend() == "gpu" else [])
    rows = []
    for mask in ("causal", "full"):
        for length in a.lengths if mask == "causal" else [x for x in a.lengths if x <= a.full_up_to]:
            for backend in backends:
                r = measure(mask, backend, length, a.heads, a.reps)
                rows.append({"mask": mask, "backend": backend, "length": length} | r)
                print(rows[-1], flush=True)
    train = []
    if not a.no_train_step:
        for backend, remat in (("reference", "none"), ("reference", "dots"), ("reference", "full"),
                               ("chunked", "none"), ("chunked", "full")):
            r = measure(f"train:{remat}", backend, 1024, 8, a.reps)
            train.append({"backend": backend, "remat": remat} | r)
            print(train[-1], flush=True)
    write(a, rows, train)


def write(a, rows, train) -> None:
    cmd = "python benchmarks/attention.py" + ("" if a.lengths == [1024, 2048, 4096, 8192, 16384] else
                                              " --lengths " + " ".join(map(str, a.lengths)))
    by = {(r["mask"], r["backend"], r["length"]): r for r in rows}
    lines = [
        "# Attention memory and time: reference vs chunked", "",
        f"Machine: {machine()}. Command: `{cmd}` (--reps {a.reps}).", "",
        f"Forward + backward (gradients of q, k, v) of self-attention, batch 1, {a.heads} heads of 64, float32 "
        "(cudnn: bfloat16), T = S = the length. Peak: the compiled program's memory analysis (arguments + "
        "outputs + temporaries). RSS: growth of a fresh process's resident set over one run (confirms the "
        f"peak). Time: median (min–max) of {a.reps} runs after a warm-up. A program whose compiled peak exceeds "
        "80% of the machine's available memory is not run.", "",
        "Causal: the mask is `ops.masks.CausalMask`; reference materialises it, chunked builds it per tile and "
        "skips the tiles above the diagonal (about half). Full: no mask, nothing to skip.", ""]
    for mask in ("causal", "full"):
        lines += [f"## {mask.capitalize()} self-attention", "",
                  "| length | backend | compiled peak | RSS growth | time | peak / reference | time / reference |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["mask"] == mask):
            ref = by.get((mask, "reference", r["length"]), {})
            ratio = (f"{r['peak_bytes'] / ref['peak_bytes']:.1%}" if "peak_bytes" in r and "peak_bytes" in ref
                     else "")
            speed = (f"{r['median_s'] / ref['median_s']:.2f}×" if r.get("fits") and ref.get("fits") else "")
            rss = gib(r["rss_growth_bytes"]) if "rss_growth_bytes" in r else "—"
            peak = gib(r["peak_bytes"]) if "peak_bytes" in r else r.get("error", "")
            lines.append(f"| {r['length']} | {r['backend']} | {peak} | {rss} | {fmt_time(r)} | {ratio} | {speed} |")
        lines.append("")
    if train:
        lines += ["## A whole train step with and without remat", "",
                  "GPT-style decoder (pre-LN, GELU, learned positions), D512, 6 layers, 8 heads, F2048, V256, "
                  "T=1024, batch 4, AdamW, float32.", "",
                  "| attention | remat | compiled peak | RSS growth | step time |", "|---|---|---:|---:|---:|"]
        for r in train:
            rss = gib(r["rss_growth_bytes"]) if "rss_growth_bytes" in r else "—"
            lines.append(f"| {r['backend']} | {r['remat']} | "
                         f"{gib(r['peak_bytes']) if 'peak_bytes' in r else r.get('error')} | {rss} | {fmt_time(r)} |")
    out = Path(a.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "command": cmd, "heads": a.heads,
                                                    "head_dim": H, "attention": rows, "train_step": train},
                                                   indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
