"""benchmarks/gpu.py's lever matrix: each accelerator lever (`jaxformer.platforms`), remat policy, attention backend
and tokens-per-step choice A/B'd against the train section's step, in the same process, as paired blocks. Each
item compiles a step of its own, so a 9-minute run covers the first few on a ~1B model; the rest by name in a run
of their own: `python benchmarks/gpu.py --sections train levers --levers NAME ...`.

For each item, in the order below (the most promising first: what the section's budget cannot fit is skipped and
named): the variant's train step is built (levers switched on by name while it is traced, `platforms.override`)
and compiled ahead of time (its compile time and XLA's memory analysis recorded: arguments + temporaries, GB),
then blocks of `steps` steps alternate between it and the baseline (`timing.paired_times_ms`: one untimed block
each, then `reps` rounds, the order reversed every other round). Each pair gives a ratio of ms per token (variant /
baseline: below 1 is faster); the verdict follows from the 95% Student-t interval of the mean log ratio
(`levers.paired`: faster / slower / no difference beyond ±2% / not resolved). "Keep what pays": a lever is turned on
for "gpu" in `jaxformer.platforms` only on a "faster" verdict from such a run.
"""
from __future__ import annotations

import statistics

import jax

from jaxformer import platforms

# name -> (what it changes, levers switched on, model overrides for `replaced`, rows per step (None: baseline's))
ITEMS = {
    "chunked_loss": ("loss from the head's input a sequence slice at a time (no [B,T,V] logits)",
                     {"chunked_loss": True}, {}, None),
    "remat_dots": ("model.runtime.remat=dots", {}, {"runtime__remat": "dots"}, None),
    "bf16_params": ("bfloat16 parameters, float32 master copy in the optimizer", {},
                    {"runtime__param_dtype": "bfloat16"}, None),
    "fused_projections": ("q/k/v and gate/up as one matmul each", {"fused_projections": True}, {}, None),
    "gpu_latency_hiding": ("XLA latency-hiding scheduler", {"gpu_latency_hiding": True}, {}, None),
    "gpu_no_triton_gemm": ("XLA Triton GEMMs off (cuBLAS)", {"gpu_no_triton_gemm": True}, {}, None),
    "gpu_no_command_buffers": ("XLA command buffers (CUDA graphs) off", {"gpu_no_command_buffers": True}, {}, None),
    "gpu_while_double_buffering": ("XLA while-loop double buffering", {"gpu_while_double_buffering": True}, {},
                                   None),
    "remat_dots_attention": ("model.runtime.remat=dots_attention", {}, {"runtime__remat": "dots_attention"}, None),
    "unrolled_layers": ("the layer scan unrolled", {"unrolled_layers": True}, {}, None),
    "backend_pallas": ("attention by Pallas (Triton)", {}, {"runtime__attention_backend": "pallas"}, None),
    "backend_chunked": ("attention by the chunked XLA backend", {}, {"runtime__attention_backend": "chunked"}, None),
    "tokens_half": ("half the rows per step", {}, {}, 0.5),
    "tokens_double": ("twice the rows per step", {}, {}, 2.0),
}


def bench_levers(s: dict, a, budget, rec: dict, live: dict, build_stepper) -> dict:
    """-> {"baseline": what it is, "items": {name: row}}. build_stepper(s, model
    overrides, rows) -> (Stepper, info dict): gpu.py's, compiled ahead of time."""
    from levers import paired
    from timing import paired_times_ms
    base = live.get("train")
    if base is None:
        return {"error": "no baseline: the train section did not run"}
    tr = rec["sections"]["train"]
    out = {"baseline": {k: tr[k] for k in ("backend", "remat", "batch", "seq")}, "items": {}}
    names = [n for n in ITEMS if not a.levers or n in a.levers]
    for name in budget.parts(names, "lever"):
        what, levers, model, rows = ITEMS[name]
        b = max(1, int(s["batch"] * rows)) if rows else s["batch"]
        row = out["items"][name] = {"what": what, "levers": levers, "model": model, "batch": b}
        print(f"  lever {name}: {what}", flush=True)
        try:
            with platforms.override(**levers):
                run, info = build_stepper(s, dict(remat=tr["remat"], backend=tr["backend"]) | model, b)
            n = s["lever_steps"]
            ms = paired_times_ms({"base": lambda: base(n), "variant": lambda: run(n)}, s["lever_reps"])
            per_token = [v * s["batch"] / b for v in ms["variant"]]                 # ms per baseline-sized block
            row.update(info, ratio=paired(ms["base"], per_token), base_ms=ms["base"], variant_ms=ms["variant"],
                       tokens_per_s=statistics.median(b * s["seq"] * n / (v / 1e3) for v in ms["variant"]),
                       final_loss=float(run.metrics["loss"]))
            print(f"    {row['ratio']['ratio']:.3f} [{row['ratio']['lo']:.3f}, {row['ratio']['hi']:.3f}] "
                  f"{row['ratio']['verdict']}", flush=True)
        except Exception as e:  # noqa: BLE001  a lever that fails to compile or run here: recorded, next one
            row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            print(f"    failed: {row['error']}", flush=True)
        finally:
            run = None
            jax.clear_caches()
        rec["sections"]["levers"] = out
        live["write"]()
    return out


def lines(lv: dict) -> list[str]:
    """The levers section of gpu.md."""
    if "items" not in lv:
        return []
    b = lv["baseline"]
    head = ["lever", "what", "ms/token ratio [95%]", "verdict", "tokens/s", "args+temp GB", "compile s"]
    rows = []
    for name, r in lv["items"].items():
        if "error" in r:
            rows.append([name, r["what"], "failed", r["error"][:80], "", "", ""])
            continue
        q = r["ratio"]
        rows.append([name, r["what"], f"{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}]", q["verdict"],
                     f"{r['tokens_per_s']:,.0f}", f"{r['memory_gb']:.1f}" if r.get("memory_gb") else "n/a",
                     f"{r['compile_s']:.1f}"])
    return ["", "## Levers (paired A/B against the train step)", "",
            f"Baseline: attention {b['backend']}, remat {b['remat']}, B×T = {b['batch']}×{b['seq']}. Ratio: variant "
            "/ baseline ms per token over paired blocks (below 1: faster).", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(map(str, r)) + " |"
                                                                         for r in rows)]

