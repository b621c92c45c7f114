"""Where a cached decoding step's time goes: the compiled token loop of benchmarks/decode.py (base decoder, laid out
by `model.init_cache`, per-layer cache) traced with jax.profiler, each op matched to its compiled HLO
instruction and grouped as benchmarks/step_profile.py groups a train step's.

  .venv/bin/python benchmarks/decode_profile.py [--contexts 64 1024] [--batches 1 8] [--steps 16]

Per (batch, context): ms per token of each group (op time summed over XLA:CPU's threads, so it can exceed the
wall time), the wall time per token, and the number of copies of a whole per-layer cache buffer in the compiled
loop (0 when every buffer is updated in place). "attention" splits out the dots that read the cache (their
operand holds S slots), from "matmul" (the weight matmuls). Writes benchmarks/results/decode_profile.md/.json.

Whether the weight matmuls run at their kernels' peak: each weight matmul's rate in the loop (its largest
operand's bytes, the weight, over its op time), per weight shape and layout, against the same matmul alone in a
chain of distinct weights as large as the model's (`kernels_alone`), in XLA and in PyTorch (F.linear, as its
decoder): the gap of the loop to XLA's kernel, and of XLA's kernel to PyTorch's. Also the rates at which four
readers read a buffer of the weights' size in the same process (benchmarks/decode.py's `stream_bandwidth`: a
jitted sum and matrix-vector product, torch.sum and torch.mv; decode.py's floor takes the fastest).
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

from jaxformer.config import ModelConfig, replaced  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402
from decode import SIZES, cached_loop, decoding_cache, stream_bandwidth, weight_bytes  # noqa: E402  (benchmarks/decode.py)
from step_profile import classify_hlo, fused_bodies, op_events, self_times  # noqa: E402


SHAPE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (f32|bf16|f16|s8|s32|u8)\[([\d,]*)\]", re.M)
ITEMSIZE = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1}


def value_shapes(hlo: str) -> dict[str, tuple[str, int]]:
    """Instruction name -> (its array shape, its bytes) for every array-valued instruction in compiled HLO text
    (names are unique in a module; the operands of an instruction are printed by name only)."""
    out = {}
    for name, t, dims in SHAPE.findall(hlo):
        n = ITEMSIZE[t]
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out[name] = (f"{t}[{dims}]", n)
    return out


def dot_weight(body: str, shapes: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """("SHAPE in AXIS", bytes) of the largest operand of the dot in an op's text (a bare dot's line or a fusion's
    body) and the axis it is contracted on: for a weight matmul, the weight it reads and how."""
    best = ("", 0)
    for m in re.finditer(r" dot\(([^)]*)\)(.*)", body):
        for side, name in zip(("lhs", "rhs"), re.findall(r"%([\w.\-]+)", m.group(1))):
            if shapes.get(name, best)[1] > best[1]:
                axis = re.search(rf"{side}_contracting_dims=\{{(\d+)\}}", m.group(2))
                best = (f"{shapes[name][0]} in {axis.group(1) if axis else '?'}", shapes[name][1])
    return best


def kernels_alone(keys: list[str], nbytes: int, reps: int = 15) -> dict[str, dict[str, float]]:
    """Each weight matmul of the batch-1 loop alone ("f32[A,B] in AXIS": a [A,B] weight contracted on AXIS with
    one row): GB/s of a jitted chain of distinct weights of that shape and layout, `nbytes` of them in all (out
    of cache, as in the loop), and of the same chain in PyTorch as its decoder runs it (F.linear, the weight
    stored [out,in]). Median of `reps`, alternating. A little glue between the links (a sum or a tile to the
    next input's width) is timed with them, on both sides."""
    import statistics
    import torch
    out = {}
    for key in keys:
        m = re.fullmatch(r"f32\[(\d+),(\d+)\] in ([01])", key)
        if not m:
            continue
        dims, axis = (int(m.group(1)), int(m.group(2))), int(m.group(3))
        k_in, k_out = dims[axis], dims[1 - axis]
        n = max(1, nbytes // (k_in * k_out * 4))
        ws = [jax.random.normal(jax.random.key(i), dims) * 0.02 for i in range(n)]
        tw = [torch.randn(k_out, k_in) * 0.02 for _ in range(n)]

        def glue(y, lib):                                     # [1,k_out] -> the next link's input [1,k_in]
            if k_out >= k_in:
                return y.reshape(1, -1, k_in).sum(1)
            return (jnp.tile(y, (1, k_in // k_out)) if lib is jnp else y.repeat(1, k_in // k_out)) * 0.5

        @jax.jit
        def chain(ws, x):                                     # one row, [1,k_in], as the loop's
            for w in ws:
                x = glue(jax.lax.dot_general(x, w, (((1,), (axis,)), ((), ()))), jnp)
            return x

        def tchain(x):
            with torch.no_grad():
                for w in tw:
                    x = glue(torch.nn.functional.linear(x, w), torch)
            return x

        x, tx = jnp.ones((1, k_in)), torch.ones(1, k_in)
        jax.block_until_ready(chain(ws, x)), tchain(tx)
        tj, tt = [], []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(chain(ws, x))
            tj.append(time.perf_counter() - t)
            t = time.perf_counter()
            tchain(tx)
            tt.append(time.perf_counter() - t)
        size = n * k_in * k_out * 4
        out[key] = {"jax_gbs": size / statistics.median(tj) / 1e9, "torch_gbs": size / statistics.median(tt) / 1e9}
    return out


def profile(batch: int, context: int, steps: int) -> dict:
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=256, max_len=context + steps + 1, positional="rope",
                      norm__position="pre", runtime__dropout=0.0, **SIZES["base"])
    graphdef, state = nnx.split(build_model(cfg))
    loop = cached_loop(graphdef, steps)
    slots = context + steps
    empty = decoding_cache(graphdef, batch, slots)(state)
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
    info, shapes = fused_bodies(hlo), value_shapes(hlo)
    groups = collections.Counter()
    weights = collections.defaultdict(lambda: [0.0, 0, 0])           # shape -> [µs, bytes, calls] per token
    events = op_events(events, "run_steps")
    for e, own in zip(events, self_times(events)):              # a loop's event spans its body's ops
        op = e["args"]["hlo_op"]
        body, _ = info.get(op, ("", ""))
        g = classify_hlo(op, body)
        if g == "matmul":
            shape, nbytes = dot_weight(body, shapes)
            if re.search(rf"\b{slots}\b|\b{slots * cfg.kv_heads}\b", shape):        # its operand holds the slots
                g = "attention (reads the cache)"
        groups[g] += own / 1e3 / steps
        if g == "matmul":
            w = weights[shape]
            w[0], w[1], w[2] = w[0] + own / steps, w[1] + nbytes / steps, w[2] + 1 / steps
    shape = f"f32[{batch},{cfg.kv_heads},{slots},{cfg.head_size}]"            # heads-major per-layer buffer
    copies = sum(1 for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line)
    return {"batch": batch, "context": context, "wall_ms": sorted(walls)[len(walls) // 2],
            "groups_ms": dict(groups), "cache_copies": copies,
            "weight_matmuls": {k: {"us": v[0], "bytes": v[1], "calls": v[2]} for k, v in weights.items()}}


def rate(ms: dict) -> float:
    """GB/s of weight matmuls {"us", "bytes"} summed (a row's, or one shape's)."""
    return ms["bytes"] / ms["us"] / 1e3 if ms["us"] else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_profile"))
    a = p.parse_args(argv)
    from jaxformer.stats import machine
    nbytes = weight_bytes("base")
    readings = [stream_bandwidth(7, nbytes)]
    rows = [profile(b, c, a.steps) for b in a.batches for c in a.contexts]
    readings.append(stream_bandwidth(7, nbytes))
    readers = {k: max(r[k] for r in readings) / 1e9 for k in readings[0]}           # GB/s, best of two readings
    alone = kernels_alone(sorted({k for r in rows if r["batch"] == 1 for k in r["weight_matmuls"]}), nbytes)
    for r in rows:
        ws = r["weight_matmuls"].values()
        r["matmul_gbs"] = rate({"us": sum(w["us"] for w in ws), "bytes": sum(w["bytes"] for w in ws)})
    stem = Path(a.out)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine(), "rows": rows, "readers_gbs": readers,
                                                     "reader_bytes": nbytes, "kernels_alone": alone}, indent=1))
    names = sorted({g for r in rows for g in r["groups_ms"]}, key=lambda g: -max(r["groups_ms"].get(g, 0)
                                                                                 for r in rows))
    lines = ["# Where a cached decoding step's time goes (base decoder, laid out for decoding)", "",
             f"`python benchmarks/decode_profile.py --contexts {' '.join(map(str, a.contexts))} --batches "
             f"{' '.join(map(str, a.batches))} --steps {a.steps}` on {machine()}.", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "| batch | context | wall ms/token | " + " | ".join(names) + " | cache copies | weight matmuls, GB/s |",
             "|---|---|---:|" + "---:|" * len(names) + "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['wall_ms']:.3f} | " +
                     " | ".join(f"{r['groups_ms'].get(g, 0):.3f}" for g in names) +
                     f" | {r['cache_copies']} | {r['matmul_gbs']:.1f} |")
    lines += ["", __doc__.split("\n\n")[3].replace("\n", " "), "",
              f"Readers at {nbytes / 2 ** 20:.1f} MiB in this process, GB/s (best of two readings): " +
              ", ".join(f"{k} {v:.1f}" for k, v in readers.items()) + ".", ""]
    for r in rows:
        if r["batch"] != 1:
            continue
        lines += [f"Batch 1, context {r['context']}: the weight matmuls per token, by weight (shape, and the axis "
                  "the row is contracted on), in the loop and alone (`kernels_alone`: XLA with the same layout, "
                  "PyTorch's F.linear), GB/s", "",
                  "| weight | calls | µs | in the loop | alone | loop / alone | PyTorch alone | XLA / PyTorch, alone |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        items = sorted(r["weight_matmuls"].items(), key=lambda kv: -kv[1]["bytes"])
        for key, w in items + [("all", {k: sum(w[k] for _, w in items) for k in ("us", "bytes", "calls")})]:
            k = alone.get(key)
            if key == "all":                                     # the loop's weights read at each side's rates
                k = {s: sum(w["bytes"] for _, w in items) / sum(w["bytes"] / alone[kk][s] for kk, w in items
                                                                 if kk in alone) for s in ("jax_gbs", "torch_gbs")}
            g = rate(w)
            lines.append(f"| {key} | {w['calls']:.0f} | {w['us']:.0f} | {g:.1f} | " + (
                f"{k['jax_gbs']:.1f} | {g / k['jax_gbs']:.2f} | {k['torch_gbs']:.1f} | "
                f"{k['jax_gbs'] / k['torch_gbs']:.2f} |" if k else "– | – | – | – |"))
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
