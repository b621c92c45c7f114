"""ms/token: naive full recomputation vs one KV-cached step, same model, same run; plus time to first token.

  .venv/bin/python benchmarks/decode.py [--sizes tiny base] [--contexts 32 64 128 256 512 1024] [--reps 5]

naive(c)  = one jitted full forward over c tokens (what each new token costs without a cache at context c);
cached(c) = one jitted decoder_step of 1 token against a cache holding c tokens;
ttft(c)   = the prefill of a c-token prompt (one pass). Medians of --reps runs after a warm-up.
Writes benchmarks/results/decode.md and .json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.decode import decoder_step, init_cache
from jaxformer.nn import build_model

SIZES = {"tiny": dict(d_model=64, num_heads=4, d_ff=256, num_decoder_layers=2),
         "base": dict(d_model=512, num_heads=8, d_ff=2048, num_decoder_layers=6)}


def median_ms(fn, reps):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)


def bench(size, batch, contexts, reps):
    cfg = ModelConfig(arch="decoder_only", vocab_size=256, max_len=max(contexts) + 1, positional="rope",
                      norm_position="pre", dropout=0.0, **SIZES[size])
    graphdef, state = nnx.split(build_model(cfg))
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[:, -1])
    prefill = jax.jit(lambda s, c, t, p, v: decoder_step(nnx.merge(graphdef, s), c, t, p, v))
    step = jax.jit(lambda s, c, t, p, v: decoder_step(nnx.merge(graphdef, s), c, t, p, v))
    rows = []
    for c in contexts:
        toks = jax.random.randint(jax.random.key(c), (batch, c), 1, 256)
        pos = jnp.broadcast_to(jnp.arange(c), (batch, c))
        ones = jnp.ones((batch, c), bool)
        cache = init_cache(cfg, batch, c + 1)
        naive = median_ms(lambda: fwd(state, toks), reps)
        ttft = median_ms(lambda: prefill(state, cache, toks, pos, ones), reps)
        _, filled = prefill(state, cache, toks, pos, ones)
        one = (toks[:, :1], jnp.full((batch, 1), c), jnp.ones((batch, 1), bool))
        cached = median_ms(lambda: step(state, filled, *one), reps)
        rows.append({"size": size, "batch": batch, "context": c, "naive_ms": naive, "cached_ms": cached,
                     "speedup": naive / cached, "ttft_ms": ttft})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["tiny", "base"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    machine = f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} device(s), jax {jax.__version__}"
    rows = [r for s in args.sizes for b in args.batches for r in bench(s, b, args.contexts, args.reps)]
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [f"# Decode: naive recomputation vs KV cache", "",
             f"`benchmarks/decode.py --sizes {' '.join(args.sizes)} --batches {' '.join(map(str, args.batches))} "
             f"--contexts {' '.join(map(str, args.contexts))} --reps {args.reps}` on {machine}, "
             f"{time.strftime('%Y-%m-%d')}. Decoder-only, RoPE, pre-LN, float32; tiny = D64/2 layers, "
             "base = D512/N8/F2048/6 layers. Medians; written by the script.", "",
             "| size | batch | context | naive ms/token | cached ms/token | speed-up | TTFT (prefill) ms |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['batch']} | {r['context']} | {r['naive_ms']:.2f} | {r['cached_ms']:.3f} | "
              f"{r['speedup']:.1f}× | {r['ttft_ms']:.2f} |" for r in rows]
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
