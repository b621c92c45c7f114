"""The patching grid as one compiled program against the loop of single patches, and attribution patching.

  .venv/bin/python benchmarks/patching.py [--rounds 7] [--layers 4] [--length 32]

  grid         `jaxformer.patching.patching_grid`: every cell's patched pass inside one jitted program
               (lax.map over the cells, --batch of them vmapped together)
  loop         what a TransformerLens-style script does: a Python loop calling one jitted single-patch pass per
               cell (compiled once, the cell a traced argument), then the same normalisation
  attribution  `jaxformer.patching.attribution_patching`: the linear estimate of every cell, one program
Each is timed after its compilation (compile times reported apart), in paired rounds (the order alternating),
and grid/loop's agreement and attribution's rank correlation with the grid are reported. Model: decoder-only,
pre-LN, d_model 128, 4 heads, --layers layers, vocab 512, batch 8; cells: (layer, position, head) of `z`.
Writes benchmarks/results/patching.md and .json (machine named).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy.stats import pearsonr, spearmanr

from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.patching import attribution_patching, patching_grid
from jaxformer.stats import machine, paired_ratio
from timing import paired_times_ms  # benchmarks/timing.py (the script's folder is on sys.path)

SITE = "z"


def _model(layers: int, length: int):
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=512, d_model=128, num_heads=4, num_kv_heads=4,
                   d_ff=512, num_decoder_layers=layers, max_len=length, positional="rope", norm__position="pre",
                   runtime__dropout=0.0)
    return build_model(cfg, seed=0)


def _loop(model, clean, corrupt, metric):
    """The per-cell loop: one jitted single-patch pass (the cell traced), called once per cell from Python."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def one(state, saved, layer, pos, head):
        def fn(v, at):
            here = (at == layer) & (jnp.arange(v.shape[1]) == pos)[None, :, None, None] & \
                (jnp.arange(v.shape[2]) == head)[None, None, :, None]
            return jnp.where(here, saved[at].astype(v.dtype), v)
        return metric(nnx.merge(graphdef, state)(*corrupt, patch={SITE: fn})[0])
    ends = jax.jit(lambda state: (nnx.merge(graphdef, state)(*clean, capture=(SITE,)),
                                  nnx.merge(graphdef, state)(*corrupt)[0]))

    def run():
        (logits, aux), bad = ends(state)
        saved = aux["captured"][SITE]
        base, top = metric(bad), metric(logits)
        lay, _, t, n, _ = saved.shape
        out = [one(state, saved, i, p, h) for i in range(lay) for p in range(t) for h in range(n)]
        return (jnp.stack(out) - base) / (top - base)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="cells vmapped together inside the grid program")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "patching"))
    a = ap.parse_args()
    model = _model(a.layers, a.length)
    tokens = jax.random.randint(jax.random.key(0), (8, a.length), 0, 512)
    corrupt = tokens.at[:, a.length // 2].set((tokens[:, a.length // 2] + 1) % 512)
    right, wrong = 7, 11

    def metric(logits):
        return jnp.mean(logits[:, -1, right] - logits[:, -1, wrong])
    fns = {"grid": lambda: patching_grid(model, (tokens,), (corrupt,), SITE, metric, over="both", batch=a.batch),
           "loop": _loop(model, (tokens,), (corrupt,), metric),
           "attribution": lambda: attribution_patching(model, (tokens,), (corrupt,), SITE, metric, over="both")}
    first = {}
    for name, fn in fns.items():                  # the first call compiles (a fresh jit each call for the API)
        t = time.perf_counter()
        jax.block_until_ready(fn())
        first[name] = 1e3 * (time.perf_counter() - t)
    grid, loop, est = (np.asarray(fns[n]()).reshape(-1) for n in ("grid", "loop", "attribution"))
    times = paired_times_ms(fns, a.rounds)
    cells = grid.size
    result = {"machine": machine(), "backend": jax.default_backend(), "layers": a.layers, "length": a.length,
              "cells": cells, "batch": a.batch, "rounds": a.rounds, "first_call_ms": first,
              "median_ms": {n: float(np.median(v)) for n, v in times.items()},
              "loop_over_grid": paired_ratio(times["loop"], times["grid"]),
              "grid_over_attribution": paired_ratio(times["grid"], times["attribution"]),
              "grid_vs_loop_max_abs": float(np.max(np.abs(grid - loop))),
              "attribution_spearman": float(spearmanr(grid, est).statistic),
              "attribution_pearson": float(pearsonr(grid, est).statistic),
              "same_top_cell": int(np.argmax(grid)) == int(np.argmax(est))}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    r, s = result["loop_over_grid"], result["grid_over_attribution"]
    md = [f"# Patching grid vs a loop of single patches ({result['machine']}, {result['backend']})", "",
          f"Site `{SITE}`, over (layer, position, head): {cells} cells; {a.layers} layers, length {a.length}, "
          f"batch 8; {a.rounds} paired rounds. `.venv/bin/python benchmarks/patching.py`", "",
          "| method | median ms | first call ms (compiles) |", "|---|---|---|"]
    md += [f"| {n} | {result['median_ms'][n]:.1f} | {first[n]:.0f} |" for n in fns]
    md += ["", f"loop / grid: {r['ratio']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] (95% paired interval); "
           f"grid / attribution: {s['ratio']:.1f} [{s['lo']:.1f}, {s['hi']:.1f}]; max |grid − loop| "
           f"{result['grid_vs_loop_max_abs']:.1e}; attribution against the grid: Pearson r "
           f"{result['attribution_pearson']:.3f}, Spearman ρ {result['attribution_spearman']:.3f} (most cells are "
           f"0 in both: the ranks of near-zero cells are noise), the same largest cell: "
           f"{result['same_top_cell']}.", ""]
    Path(a.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
