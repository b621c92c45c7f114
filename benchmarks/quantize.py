"""Post-training quantization (jaxformer.quantize, qwix), measured: weight bytes, accuracy, cached decoding speed,
and what the compiler does with a quantized weight.

  .venv/bin/python benchmarks/quantize.py [--reps 7] [--rounds 3] [--runs DIR] [--out benchmarks/results]

1. Accuracy of trained runs, float32 vs each mode (int8, int4 weight-only; w8a8 = int8 weights and per-token
   int8 activations), quantized when loaded (`load_model(..., quantize=MODE)`, as `jaxformer eval --quantize`):
   the README's reversal model (configs/reverse.py as shipped) on 2,000 held-out strings (exact match), and the
   Alice char LM (configs/alice.py as shipped) held-out loss. The runs are trained into --runs (default
   runs/quantize) unless a finished run is there.
2. Weight bytes at the base decoder size (D512, 8 heads, F2048, 6 layers, vocab 256, RoPE, pre-LN): in device
   memory (`quantize.weight_bytes`, int4 packed two per byte) and on disk (an orbax checkpoint of the parameters).
3. Cached decoding per token at base size, batch 1 and 8, context 64: the compiled decode loop of
   benchmarks/decode.py (model.step + greedy pick in a fori_loop, cache donated), random weights quantized per
   mode. --rounds rounds over all modes in turn; each a median of --reps timed loops; the median over rounds.
4. The compiled decode loop's HLO per mode: instructions that turn int8/int4 weight values into a float32 array of
   a whole weight's shape (the weight dequantized before its matmul), and dots that take int8 operands.
5. The int8 KV cache (model.runtime.kv_cache_dtype=int8) against the float32 cache, float32 weights: cache bytes and
   cached ms/token at batch 1 and 8, contexts --context and 1024.
Writes quantize.md and quantize.json in --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ModelConfig, replaced
from jaxformer.configio import load_config_file
from jaxformer.data import build_task
from jaxformer.nn import build_model
from jaxformer.quantize import MODES, quantize_model, weight_bytes
from jaxformer.inference import evaluate, load_model
from jaxformer.train.loop import train
from decode import cached_loop, prefill_fn  # benchmarks/decode.py (the script's folder is on sys.path)
from timing import median_ms  # benchmarks/timing.py

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(arch="decoder_only", vocab_size=256, d_model=512, num_heads=8, d_ff=2048, num_decoder_layers=6,
            positional="rope", norm__position="pre", runtime__dropout=0.0, max_len=256)
ALL = (None,) + MODES
label = lambda m: m or "float32"  # noqa: E731


def trained(runs: Path, name: str) -> Path:
    """configs/NAME.py trained in runs/NAME (a finished run is reused: train() resumes at its last step)."""
    d = runs / name
    out = train(load_config_file(ROOT / f"configs/{name}.py"), d, progress="none")
    print(f"{name}: {out['status']} at step {out['step']} in {d}", flush=True)
    return d


def accuracy(runs: Path) -> dict:
    out = {}
    rev = trained(runs, "reverse")
    cfg = load_model(rev, "best").cfg
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_eval=2000))
    for mode in ALL:
        run = load_model(rev, "best", quantize=mode)
        ev = evaluate(cfg, build_task(cfg.data, run.tokenizer), run.model)
        out.setdefault("reverse", {})[label(mode)] = ev
        print("reverse", label(mode), ev, flush=True)
    lm = trained(runs, "alice")
    for mode in ALL:
        run = load_model(lm, "best", quantize=mode)
        ev = evaluate(run.cfg, build_task(run.cfg.data, run.tokenizer), run.model)
        out.setdefault("alice", {})[label(mode)] = ev
        print("alice", label(mode), ev, flush=True)
    return out


def model_for(mode):
    m = build_model(replaced(ModelConfig(), **BASE), seed=0)
    return quantize_model(m, mode) if mode else m


def sizes() -> dict:
    import orbax.checkpoint as ocp
    out = {}
    for mode in ALL:
        m = model_for(mode)
        d = Path(tempfile.mkdtemp())
        ck = ocp.StandardCheckpointer()
        ck.save(d / "params", nnx.state(m, nnx.Param))
        ck.wait_until_finished()
        disk = int(subprocess.run(["du", "-sb", str(d / "params")], capture_output=True, text=True).stdout.split()[0])
        shutil.rmtree(d)
        out[label(mode)] = {**weight_bytes(m), "disk": disk}
    return out


def decode_loop(mode, batch, context, steps, kv="auto"):
    graphdef, state = nnx.split(model_for(mode))
    loop = cached_loop(graphdef, steps)
    prefill = prefill_fn(graphdef)
    toks = jax.random.randint(jax.random.key(context), (batch, context), 1, BASE["vocab_size"])
    pos = jnp.broadcast_to(jnp.arange(context), (batch, context))
    cache = nnx.merge(graphdef, state).init_cache(batch, context + steps, dtype=kv)
    _, filled = prefill(state, cache, toks, pos)
    start = (toks[:, -1:], jnp.full((batch, 1), context, jnp.int32))
    return loop, state, filled, start


def speed(batches, context, steps, reps, rounds) -> list[dict]:
    rows = []
    for b in batches:
        loops = {label(m): decode_loop(m, b, context, steps) for m in ALL}
        per = {k: [] for k in loops}
        for _ in range(rounds):                                          # modes in turn, each round
            for k, (loop, state, filled, start) in loops.items():
                per[k].append(median_ms(lambda c: loop(state, c, *start), reps,
                                        setup=lambda: (jax.tree.map(jnp.copy, filled),)) / steps)
        f32 = statistics.median(per["float32"])
        for k, v in per.items():
            ms = statistics.median(v)
            rows.append({"batch": b, "context": context, "mode": k, "ms_per_token": ms, "min": min(v),
                         "max": max(v), "speedup_vs_float32": f32 / ms})
            print(rows[-1], flush=True)
    return rows


def kv_cache(batches, contexts, steps, reps, rounds) -> list[dict]:
    """float32 weights; per-token time and cache bytes with the float32 and the int8 KV cache."""
    rows = []
    for b in batches:
        for c in contexts:
            loops = {kv: decode_loop(None, b, c, steps, kv) for kv in ("auto", "int8")}
            per = {k: [] for k in loops}
            for _ in range(rounds):
                for k, (loop, state, filled, start) in loops.items():
                    per[k].append(median_ms(lambda x: loop(state, x, *start), reps,
                                            setup=lambda: (jax.tree.map(jnp.copy, filled),)) / steps)
            nbytes = {k: sum(a.nbytes for a in jax.tree.leaves((f.k, f.v))) for k, (_, _, f, _) in loops.items()}
            f32 = statistics.median(per["auto"])
            for k, v in per.items():
                rows.append({"batch": b, "context": c, "cache": "float32" if k == "auto" else k,
                             "ms_per_token": statistics.median(v), "speedup_vs_float32": f32 / statistics.median(v),
                             "cache_bytes": nbytes[k]})
                print(rows[-1], flush=True)
    return rows


def scan_hlo(text: str, weight_elems: int) -> dict:
    """Instructions outside fused computations (what the program runs, each fusion one kernel) that output a
    float32 array of at least `weight_elems` elements from int8/int4 operands (a weight dequantized whole), and
    those that output int32 from int8 operands (int8 dots, as XLA dots or YNNPACK fusions)."""
    types, body, comp = {}, [], ""
    for raw in text.splitlines():
        ln = raw.strip()
        head = re.match(r"(ENTRY )?%([\w.\-]+) \(.*\{$", ln)
        if head:
            comp = head.group(2)
            continue
        m = re.match(r"(?:ROOT )?%([\w.\-]+) = ([a-z0-9]+)\[([0-9,]*)\]", ln)
        if m:
            types[m.group(1)] = m.group(2)
            if not comp.startswith(("fused", "wrapped", "ynn")):
                body.append((m, ln))
    deq, dots = [], []
    for m, ln in body:
        ops = re.findall(r"%([\w.\-]+)", ln.split(" = ", 1)[1].split(", metadata")[0])
        ints = any(types.get(o) in ("s8", "s4") for o in ops)
        size = 1
        for n in filter(None, m.group(3).split(",")):
            size *= int(n)
        if ints and m.group(2) == "f32" and size >= weight_elems:
            deq.append(ln[:240])
        if ints and m.group(2) == "s32" and ("dot(" in ln or "fusion(" in ln):
            dots.append(ln[:240])
    return {"dequantize_whole_weight": deq, "int8_dots": dots}


def hlo(context) -> dict:
    """Per mode: what the compiled decode loop (batch 1) does with the weights (`scan_hlo`)."""
    out = {}
    for mode in ALL:
        loop, state, filled, start = decode_loop(mode, 1, context, 4)
        r = scan_hlo(loop.lower(state, filled, *start).compile().as_text(), BASE["d_model"] ** 2)
        out[label(mode)] = r
        print(label(mode), len(r["dequantize_whole_weight"]), "whole-weight dequantizations,",
              len(r["int8_dots"]), "int8 dots", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="cached tokens per timed loop")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--runs", default=str(ROOT / "runs/quantize"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    from jaxformer.stats import machine
    acc = accuracy(Path(args.runs))
    size = sizes()
    rows = speed((1, 8), args.context, args.steps, args.reps, args.rounds)
    hl = hlo(args.context)
    kv = kv_cache((1, 8), (args.context, 1024), args.steps, args.reps, args.rounds)
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "accuracy": acc,
           "bytes": size, "speed": rows, "hlo": hl, "kv_cache": kv}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantize.json").write_text(json.dumps(res, indent=1))
    (out / "quantize.md").write_text(markdown(res))
    print(markdown(res))


def markdown(r: dict) -> str:
    a, b, rows, hl = r["accuracy"], r["bytes"], r["speed"], r["hlo"]
    f32 = b["float32"]
    rev, lm = a["reverse"], a["alice"]
    sp = {(x["batch"], x["mode"]): x for x in rows}
    ctx = rows[0]["context"]
    L = ["# Post-training quantization with qwix: size, accuracy, speed", "",
         f"`benchmarks/quantize.py --reps {r['args']['reps']} --rounds {r['args']['rounds']} --steps "
         f"{r['args']['steps']} --context {r['args']['context']}` on {r['machine']}, {r['date']}. Written by the "
         "script; do not edit.", "",
         "Modes: **int8** and **int4** quantize weights only (values int8 / int4, float32 scales per output channel; "
         "int4 also per block of 128 inputs where the input width allows); **w8a8** stores int8 weights and also "
         "quantizes each matmul's activations to int8 per token, so the dot runs int8 × int8. Quantized: the "
         "attention and FFN projections of every layer; embeddings, output head, norms and attention softmax stay "
         "float32.", "",
         "## Summary", "",
         "| | float32 | int8 | int4 | w8a8 |", "|---|---:|---:|---:|---:|"]
    L.append("| weights in memory, base decoder (MB) | " + " | ".join(f"{b[m]['total'] / 1e6:.1f}" for m in
                                                                      ("float32", "int8", "int4", "w8a8")) + " |")
    L.append("| × smaller than float32 | 1 | " + " | ".join(f"{f32['total'] / b[m]['total']:.2f}" for m in
                                                             ("int8", "int4", "w8a8")) + " |")
    L.append("| on disk, orbax checkpoint (MB) | " + " | ".join(f"{b[m]['disk'] / 1e6:.1f}" for m in
                                                                ("float32", "int8", "int4", "w8a8")) + " |")
    L.append("| reversal exact match, 2,000 held out (%) | " + " | ".join(
        f"{100 * rev[m]['exact_match']:.2f}" for m in ("float32", "int8", "int4", "w8a8")) + " |")
    L.append("| change (points) | – | " + " | ".join(
        f"{100 * (rev[m]['exact_match'] - rev['float32']['exact_match']):+.2f}" for m in ("int8", "int4", "w8a8"))
        + " |")
    L.append("| Alice char LM held-out loss | " + " | ".join(f"{lm[m]['loss']:.4f}" for m in
                                                            ("float32", "int8", "int4", "w8a8")) + " |")
    for bsz in (1, 8):
        L.append(f"| cached ms/token, base, batch {bsz}, context {ctx} | " + " | ".join(
            f"{sp[(bsz, m)]['ms_per_token']:.2f}" for m in ("float32", "int8", "int4", "w8a8")) + " |")
        L.append(f"| speed-up vs float32, batch {bsz} | 1 | " + " | ".join(
            f"**{sp[(bsz, m)]['speedup_vs_float32']:.2f}×**" for m in ("int8", "int4", "w8a8")) + " |")
    L.append("| whole weights dequantized in the compiled decode loop (HLO lines) | – | " + " | ".join(
        str(len(hl[m]["dequantize_whole_weight"])) for m in ("int8", "int4", "w8a8")) + " |")
    L.append("| int8 × int8 dots (HLO lines) | – | " + " | ".join(str(len(hl[m]["int8_dots"])) for m in
                                                                   ("int8", "int4", "w8a8")) + " |")
    s8, s4, w8 = (sp[(1, m)]["speedup_vs_float32"] for m in ("int8", "int4", "w8a8"))
    d8 = 100 * (rev["int8"]["exact_match"] - rev["float32"]["exact_match"])
    dw = 100 * (rev["w8a8"]["exact_match"] - rev["float32"]["exact_match"])
    L += ["", "## Verdicts, computed from the numbers above", "",
          f"- Target: int8 ≥ 1.6× faster per token than float32 at base size, batch 1, losing ≤ 0.5 points of "
          f"reversal exact match. Weight-only int8: {s8:.2f}×, {d8:+.2f} points: "
          + ("met." if s8 >= 1.6 and d8 >= -0.5 else "**not met**.")
          + f" w8a8 (int8 × int8 dots): {w8:.2f}×, {dw:+.2f} points: "
          + ("met." if w8 >= 1.6 and dw >= -0.5 else "**not met**."),
          f"- Seed 004, \"4-bit: a quarter of the size, twice the speed, small accuracy loss\": int4 weights are "
          f"{f32['total'] / b['int4']['total']:.1f}× smaller in memory (an eighth for the quantized matrices, packed "
          f"two values per byte; the float32 embedding and norms remain) and {f32['disk'] / b['int4']['disk']:.1f}× "
          f"on disk; per token at batch 1 int4 runs at {s4:.2f}× float32's speed on this CPU; reversal exact match "
          f"changes by {100 * (rev['int4']['exact_match'] - rev['float32']['exact_match']):+.2f} points and the "
          f"char-LM held-out loss by {lm['int4']['loss'] - lm['float32']['loss']:+.4f}.",
          "", "## What the compiler does with a quantized weight (batch 1 decode loop)", ""]
    for m in ("int8", "int4", "w8a8"):
        d, i = hl[m]["dequantize_whole_weight"], hl[m]["int8_dots"]
        L.append(f"- **{m}**: {len(d)} instructions produce a whole float32 weight from int values"
                 + (f", e.g. `{d[0][:200]}`" if d else "") + f"; {len(i)} dots/fusions on int8 operands"
                 + (f", e.g. `{i[0][:200]}`" if i else "") + ".")
    L += ["", "## Cached decoding per token (median over rounds; min–max)", "",
          "| batch | mode | ms/token | min | max | speed-up vs float32 |", "|---|---|---:|---:|---:|---:|"]
    L += [f"| {x['batch']} | {x['mode']} | {x['ms_per_token']:.3f} | {x['min']:.3f} | {x['max']:.3f} | "
          f"{x['speedup_vs_float32']:.2f}× |" for x in rows]
    L += ["", "## int8 KV cache (model.runtime.kv_cache_dtype=int8; float32 weights)", "",
          "Keys and values are rounded to int8 with a float32 scale per slot and kv head when written, and "
          "dequantized when attended.", "",
          "| batch | context | cache | cache MB | ms/token | speed-up vs float32 cache |", "|---|---|---|---:|---:|---:|"]
    L += [f"| {x['batch']} | {x['context']} | {x['cache']} | {x['cache_bytes'] / 1e6:.2f} | {x['ms_per_token']:.3f} | "
          f"{x['speedup_vs_float32']:.2f}× |" for x in r["kv_cache"]]
    L += ["", "## Accuracy (trained runs, quantized at load time)", "",
          "| run | mode | held-out loss | token accuracy | exact match |", "|---|---|---:|---:|---:|"]
    for name, res in (("reversal (configs/reverse.py)", rev), ("Alice char LM (configs/alice.py)", lm)):
        for m, ev in res.items():
            em = f"{100 * ev['exact_match']:.2f}%" if "exact_match" in ev else "–"
            L.append(f"| {name} | {m} | {ev['loss']:.4f} | {100 * ev['token_accuracy']:.2f}% | {em} |")
    L += ["", "## Bytes of the base decoder's parameters", "",
          "| mode | quantized matrices | float parameters | total in memory | orbax checkpoint on disk |",
          "|---|---:|---:|---:|---:|"]
    L += [f"| {m} | {v['quantized']:,} | {v['float']:,} | {v['total']:,} | {v['disk']:,} |" for m, v in b.items()]
    L += ["", "int4 values are packed two per byte in device memory (XLA's s4 layout) and in the orbax checkpoint; "
          "converted to numpy (e.g. `np.asarray`, an .npy file) they take one byte each."]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
