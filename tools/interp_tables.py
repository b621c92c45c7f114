"""The README's interpretability tables (tools/readme_tables.py renders them): capture error against
transformers per dtype (benchmarks/results/capture_parity.json) and the patching grid against a loop of single
patches (benchmarks/results/patching.json)."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def capture_parity() -> str:
    """Per family and dtype: the largest residual-stream error (embed, resid_post, final_norm), the pattern's
    and the logits', against transformers in the same dtype; and ours / transformers' own against float32."""
    r = _load("capture_parity")
    rows = {}
    for x in r["rows"]:
        rows.setdefault((x["family"], x["dtype"]), {})[x["site"]] = x
    out = ["| family | dtype | residual stream | pattern (abs) | logits | ours vs float32 (logits) | transformers "
           "vs float32 (logits) |", "|---|---|---:|---:|---:|---:|---:|"]
    for (family, dtype), s in rows.items():
        resid = max(s[k]["vs_same_dtype"] for k in ("embed", "resid_post", "final_norm"))
        out.append(f"| {family} | {dtype} | {resid:.1e} | {s['pattern']['vs_same_dtype']:.1e} | "
                   f"{s['logits']['vs_same_dtype']:.1e} | {s['logits']['vs_float32']:.1e} | "
                   f"{s['logits']['theirs_vs_float32']:.1e} |")
    out += ["", f"Relative to the largest value (the pattern: absolute). transformers {r['transformers']}, "
            f"{r['tokens'][0]} × {r['tokens'][1]} tokens, 4 layers, random weights; {r['machine']} "
            "([capture_parity.md](benchmarks/results/capture_parity.md), `benchmarks/capture_parity.py`)."]
    return "\n".join(out)


def patching() -> str:
    """The patching grid in one program against the loop of single patches, and attribution patching."""
    r = _load("patching")
    lg, ga = r["loop_over_grid"], r["grid_over_attribution"]
    out = ["| method | median ms | first call ms (compiles) |", "|---|---:|---:|"]
    out += [f"| {n} | {r['median_ms'][n]:.1f} | {r['first_call_ms'][n]:.0f} |" for n in r["median_ms"]]
    out += ["", f"{r['cells']} cells of `z` ((layer, position, head); {r['layers']} layers, length {r['length']}): "
            f"loop / grid {lg['ratio']:.2f} [{lg['lo']:.2f}, {lg['hi']:.2f}], grid / attribution {ga['ratio']:.0f} "
            f"[{ga['lo']:.0f}, {ga['hi']:.0f}] (95% paired intervals, {r['rounds']} rounds); attribution against the "
            f"grid: Pearson r {r['attribution_pearson']:.3f}, the same largest cell: {r['same_top_cell']}. "
            f"{r['machine']} ([patching.md](benchmarks/results/patching.md), `benchmarks/patching.py`)."]
    return "\n".join(out)


def patching_tl() -> str:
    """The patching grid and attribution patching against TransformerLens on one GPT-2: the first call in a fresh
    process (no cache, an empty persistent cache, a warm one) and the steady state with its paired interval."""
    r = _load("patching_tl")
    a, first, steady = r["args"], r["first"], r["steady"]
    out = ["| method | first call: jaxformer, no cache | jaxformer, warm cache | TransformerLens | steady: jaxformer "
           "| TransformerLens | TransformerLens / jaxformer | max abs diff |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in steady.items():
        q = s["tl_over_ours"]
        out.append(f"| {name} | {first['jaxformer, no cache']['first_ms'][name]:.0f} ms | "
                   f"{first['jaxformer, warm cache']['first_ms'][name]:.0f} ms | "
                   f"{first['TransformerLens']['first_ms'][name]:.0f} ms | {s['median_ms']['jaxformer']:.1f} ms | "
                   f"{s['median_ms']['TransformerLens']:.1f} ms | {q['ratio']:.1f} [{q['lo']:.1f}, {q['hi']:.1f}] | "
                   f"{s['max_abs_diff']:.0e} |")
    out += ["", f"GPT-2 with random weights, {a['layers']} layers, width {a['width']}; {a['rows']} × {a['length']} "
            f"tokens; {steady['grid']['cells']} cells of `z` (layer, position, head). First call: a fresh process "
            "after imports and loading (JAX traces and compiles; a warm cache loads the compiled programs written "
            f"by an earlier process); steady: medians of {a['rounds']} paired rounds, 95% paired interval. "
            f"transformer-lens {r['transformer_lens']}, torch {r['torch']}; {r['machine']} "
            "([patching_tl.md](benchmarks/results/patching_tl.md), `benchmarks/patching_tl.py`)."]
    return "\n".join(out)
