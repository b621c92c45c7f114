"""The attention part of a decode step over a [L,B,S,K,H] KV cache: three ways to contract one query per head.

  .venv/bin/python benchmarks/cache_layout.py [--slots 128 1089] [--batches 1 8] [--reps 7]

  per-head   einsum over [B,S,K,H] with K as a batch dim: XLA:CPU first transposes the cache to [B,K,S,H];
  all-heads  one matmul over all K cache heads in the cache's own layout, keeping the K diagonal blocks
             (K times the flops; what ops.dot_product_attention does for T=1 and N <= 16 over a [B,S,K,H]
             cache: the stacked, scanned `model.step`);
  [B,K,S,H]  the per-head einsum on a cache stored kv-heads first, transpose-free: the layout of a cache laid
             out for decoding (`nn.cache.KVCache`, kv_layout="BKSH"), which the decode programs use.
Each variant runs a jitted fori_loop of --steps decode steps; each step scans over L layers, attends over the
cache plus the new key (two segments, as the model's cached step does) and writes the new k/v into the donated
cache in place. Base-model attention shapes: L=6, K=N=8 heads, H=64, float32. Medians of --reps runs.
Writes benchmarks/results/cache_layout.md and .json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from timing import median_ms  # benchmarks/timing.py (the script's folder is on sys.path)

L, K, H = 6, 8, 64


def _attend(q, kl, vl, kn, vn, valid, variant):
    """q/kn/vn [B,K,H] (one new position), kl/vl the layer cache -> [B,K,H]."""
    if variant == "BKSH":
        lg = jnp.einsum("BKH,BKSH->BKS", q, kl)
    elif variant == "per_head":
        lg = jnp.einsum("BKH,BSKH->BKS", q, kl)
    else:
        lg = jnp.swapaxes(jnp.diagonal(jnp.einsum("BSJH,BKH->BSJK", kl, q), axis1=2, axis2=3), 1, 2)
    lg = jnp.concatenate([lg, jnp.sum(q * kn, -1)[..., None]], -1) * H ** -0.5
    w = jax.nn.softmax(jnp.where(valid, lg, jnp.finfo(jnp.float32).min), -1)
    wc, wn = w[..., :-1], w[..., -1:]
    if variant == "BKSH":
        out = jnp.einsum("BKS,BKSH->BKH", wc, vl)
    elif variant == "per_head":
        out = jnp.einsum("BKS,BSKH->BKH", wc, vl)
    else:
        out = jnp.diagonal(jnp.einsum("BKS,BSJH->BKJH", wc, vl), axis1=1, axis2=2).transpose(0, 2, 1)
    return out + wn * vn


def decode_loop(variant: str, steps: int):
    s_axis = 3 if variant == "BKSH" else 2              # S axis of the [L,B,...] cache

    def run(ck, cv, x):
        s = ck.shape[s_axis]

        def step(i, c):
            ck, cv, x = c
            valid = (jnp.arange(s + 1) < s - steps) | (jnp.arange(s + 1) == s)   # filled slots + the new key

            def layer(h, kv):
                o = _attend(h, *kv, h, 2 * h, valid, variant)
                new = h[:, :, None] if variant == "BKSH" else h[:, None]
                return o + h, (new, 2 * new)
            x, (kn, vn) = jax.lax.scan(layer, x, (ck, cv))
            write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, s - steps + i, s_axis)  # noqa: E731
            return write(ck, kn), write(cv, vn), x
        return jax.lax.fori_loop(0, steps, step, (ck, cv, x))           # returns the cache: donation aliases it
    return jax.jit(run, donate_argnums=(0, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, nargs="+", default=[128, 1089])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rows = []
    for b in args.batches:
        for s in args.slots:
            x = jnp.full((b, K, H), 0.01)
            row = {"batch": b, "slots": s}
            for variant in ("per_head", "all_heads", "BKSH"):
                shape = (L, b, K, s, H) if variant == "BKSH" else (L, b, s, K, H)
                make = lambda: (jnp.zeros(shape), jnp.zeros(shape), x)  # noqa: E731
                row[variant + "_ms"] = median_ms(decode_loop(variant, args.steps), args.reps, make) / args.steps
            rows.append(row)
            print(row, flush=True)
    from jaxformer.stats import machine as describe_machine
    machine = describe_machine()                     # the CPU model, cores, OS, devices, library versions
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "cache_layout.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = ["# Attention of one decode step over the KV cache (6 layers, 8 heads, H=64, float32)", "",
             f"`benchmarks/cache_layout.py --slots {' '.join(map(str, args.slots))} --batches "
             f"{' '.join(map(str, args.batches))} --steps {args.steps} --reps {args.reps}` on {machine}, "
             f"{time.strftime('%Y-%m-%d')}. ms per step (all 6 layers), medians; written by the script. "
             "per-head / all-heads: the stacked [L,B,S,K,H] cache (all-heads: the scanned `model.step`); "
             "[B,K,S,H]: a kv-heads-first cache (the decode programs' per-layer layout).", "",
             "| batch | cache slots | per-head einsum | all-heads matmul + diagonal (stacked step) | "
             "[L,B,K,S,H] per-head (decode programs) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['slots']} | {r['per_head_ms']:.3f} | {r['all_heads_ms']:.3f} | "
              f"{r['BKSH_ms']:.3f} |" for r in rows]
    (out / "cache_layout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
