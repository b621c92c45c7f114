"""Why the KV cache stores k/v as [L,B,K,S,H] rather than [L,B,S,K,H]: the attention part of a decode step.

  .venv/bin/python benchmarks/cache_layout.py [--slots 128 1089] [--batches 1 8] [--reps 7]

Both variants run the same thing: a jitted fori_loop of --steps decode steps; each step scans over L layers,
attends one query per head over the layer's cached keys plus the new key with ops.dot_product_attention
(cache and new key as two segments), and writes the new k/v into the donated cache in place. Only the memory
order of the cache differs. Base-model attention shapes: L=6, K=N=8 heads, H=64. Medians of --reps runs.
Writes benchmarks/results/cache_layout.md and .json.
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

from jaxformer import ops

L, K, H = 6, 8, 64


def decode_loop(slots_first: bool, steps: int):
    s_axis = 2 if slots_first else 3                  # S axis of the [L,B,...] cache

    def run(ck, cv, x):
        s = ck.shape[s_axis]

        def step(i, c):
            ck, cv, x = c
            valid = (jnp.arange(s + 1) < s - steps) | (jnp.arange(s + 1) == s)   # filled slots + the new key

            def layer(h, kv):
                kl, vl = kv                            # [B,S,K,H] or [B,K,S,H]
                q = h[:, None]                         # [B,1,K,H]
                as_bskh = (lambda a: a) if slots_first else (lambda a: jnp.swapaxes(a, 1, 2))
                o = ops.dot_product_attention(q, (as_bskh(kl), q), (as_bskh(vl), 2 * q),
                                              mask=valid[None, None, None])
                new = h[:, None] if slots_first else h[:, :, None]
                return o[:, 0] + h, (new, 2 * new)
            x, (kn, vn) = jax.lax.scan(layer, x, (ck, cv))
            write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, s - steps + i, s_axis)  # noqa: E731
            return write(ck, kn), write(cv, vn), x
        return jax.lax.fori_loop(0, steps, step, (ck, cv, x))[2]
    return jax.jit(run, donate_argnums=(0, 1))


def time_ms(fn, make, reps):
    jax.block_until_ready(fn(*make()))
    ts = []
    for _ in range(reps):
        args = jax.block_until_ready(make())
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)


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
            for name, slots_first in (("LBSKH_ms", True), ("LBKSH_ms", False)):
                shape = (L, b, s, K, H) if slots_first else (L, b, K, s, H)
                make = lambda: (jnp.zeros(shape), jnp.zeros(shape), x)  # noqa: E731
                row[name] = time_ms(decode_loop(slots_first, args.steps), make, args.reps) / args.steps
            row["ratio"] = row["LBSKH_ms"] / row["LBKSH_ms"]
            rows.append(row)
            print(row, flush=True)
    machine = f"{platform.machine()} {jax.devices()[0].device_kind}, jax {jax.__version__}"
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "cache_layout.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = ["# KV-cache layout: attention per decode step (6 layers, 8 heads, H=64, float32)", "",
             f"`benchmarks/cache_layout.py --slots {' '.join(map(str, args.slots))} --batches "
             f"{' '.join(map(str, args.batches))} --steps {args.steps} --reps {args.reps}` on {machine}, "
             f"{time.strftime('%Y-%m-%d')}. Medians; written by the script.", "",
             "| batch | cache slots | [L,B,S,K,H] ms/step | [L,B,K,S,H] ms/step | slots-first is slower by |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['slots']} | {r['LBSKH_ms']:.3f} | {r['LBKSH_ms']:.3f} | {r['ratio']:.1f}× |"
              for r in rows]
    (out / "cache_layout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
