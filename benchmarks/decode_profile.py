"""Where a cached decoding step's time goes: the compiled token loop of benchmarks/decode.py (base decoder, laid out
by `model.for_decoding`, per-layer cache) traced with jax.profiler, each op matched to its compiled HLO
instruction and grouped as benchmarks/step_profile.py groups a train step's.

  .venv/bin/python benchmarks/decode_profile.py [--contexts 64 1024] [--batches 1 8] [--steps 16]

Per (batch, context): ms per token of each group (op time summed over XLA:CPU's threads, so it can exceed the
wall time), the wall time per token, and the number of copies of a whole per-layer cache buffer in the compiled
loop (0 when every buffer is updated in place). "attention" splits out the dots that read the cache (their
operand holds S slots), from "matmul" (the weight matmuls). Writes benchmarks/results/decode_profile.md/.json.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import glob
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxformer.config import ModelConfig  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402
from decode import SIZES, cached_loop  # noqa: E402  (benchmarks/decode.py)
from step_profile import classify_hlo, fused_bodies, op_events, self_times  # noqa: E402


def profile(batch: int, context: int, steps: int) -> dict:
    cfg = ModelConfig(arch="decoder_only", vocab_size=256, max_len=context + steps + 1, positional="rope",
                      norm_position="pre", dropout=0.0, **SIZES["base"])
    graphdef, state = nnx.split(nnx.merge(*nnx.split(build_model(cfg))).for_decoding(batch))
    loop = cached_loop(graphdef, steps)
    slots = context + steps
    empty = nnx.merge(graphdef, state).init_cache(batch, slots).unstacked()
    fresh = lambda: jax.tree.map(jnp.copy, empty)                                 # noqa: E731 (donated per call)
    tok = jnp.ones((batch, 1), jnp.int32)
    pos = jnp.full((batch, 1), context, jnp.int32)
    hlo = loop.lower(state, fresh(), tok, pos).compile().as_text()
    jax.block_until_ready(loop(state, fresh(), tok, pos))
    walls = []
    for _ in range(5):
        cache = fresh()
        jax.block_until_ready(cache)
        t = time.perf_counter()
        jax.block_until_ready(loop(state, cache, tok, pos))
        walls.append((time.perf_counter() - t) * 1e3 / steps)
    with tempfile.TemporaryDirectory() as d:
        cache = fresh()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(loop(state, cache, tok, pos))
        events = json.load(gzip.open(glob.glob(f"{d}/plugins/profile/*/perfetto_trace.json.gz")[0]))["traceEvents"]
    info = fused_bodies(hlo)
    groups = collections.Counter()
    events = op_events(events, "run_steps")
    for e, own in zip(events, self_times(events)):              # a loop's event spans its body's ops
        op = e["args"]["hlo_op"]
        body, _ = info.get(op, ("", ""))
        g = classify_hlo(op, body)
        if g == "matmul" and re.search(rf"\b{slots}\b|\b{slots * cfg.kv_heads}\b", body):
            g = "attention (reads the cache)"
        groups[g] += own / 1e3 / steps
    shape = f"f32[{batch},{cfg.kv_heads},{slots},{cfg.head_size}]"            # heads-major per-layer buffer
    copies = sum(1 for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line)
    return {"batch": batch, "context": context, "wall_ms": sorted(walls)[len(walls) // 2],
            "groups_ms": dict(groups), "cache_copies": copies}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_profile"))
    a = p.parse_args(argv)
    from jaxformer.report import machine
    rows = [profile(b, c, a.steps) for b in a.batches for c in a.contexts]
    stem = Path(a.out)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    names = sorted({g for r in rows for g in r["groups_ms"]}, key=lambda g: -max(r["groups_ms"].get(g, 0)
                                                                                 for r in rows))
    lines = ["# Where a cached decoding step's time goes (base decoder, laid out for decoding)", "",
             f"`python benchmarks/decode_profile.py --contexts {' '.join(map(str, a.contexts))} --batches "
             f"{' '.join(map(str, a.batches))} --steps {a.steps}` on {machine()}.", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "| batch | context | wall ms/token | " + " | ".join(names) + " | cache copies |",
             "|---|---|---:|" + "---:|" * len(names) + "---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['wall_ms']:.3f} | " +
                     " | ".join(f"{r['groups_ms'].get(g, 0):.3f}" for g in names) + f" | {r['cache_copies']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
