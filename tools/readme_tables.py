"""Render the tables of the README and the guide's pages (docs/guide/*.md) from the committed results files, so
that no figure in them can go stale: the performance table and `make run`'s phases (here), and the claims table
(tools/claims_table.py).

  python tools/readme_tables.py          # rewrite README.md and docs/guide/*.md between the table markers
  python tools/readme_tables.py --check  # exit 1 if a page differs from what the results give

A block is `<!-- table:NAME (rendered by tools/readme_tables.py from ...) -->` ... `<!-- /table:NAME -->`;
tests/test_reports.py fails when a block and its results files disagree. `make bench` runs this last.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
from claims_table import _margin, _signed, claims, difference, values  # noqa: E402
from train_step import TARGETS, paired_ratio, target_verdict  # noqa: E402
from interp_tables import capture_parity, patching, patching_tl  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"
_BLOCK = re.compile(r"(?s)(<!-- table:(?P<name>[a-z_]+) [^\n]*-->\n).*?(\n<!-- /table:(?P=name) -->)")


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def performance() -> str:
    """Train-step throughput (train_step.json) and cached decoding (decode.json), ours against PyTorch."""
    ts, dec = _load("train_step"), _load("decode")
    label = {"tiny": "train step, seed 004's tiny encoder-decoder, target tokens/s (`train_step.py`)",
             "base": "train step, base encoder-decoder D512 6+6 layers, B16, T64",
             "gpt": "train step, GPT-style char model D128 4 layers, B12, T64 (remat dots, as its recipe)",
             "gpt-noremat": "the same with model.runtime.remat=none (every activation stored)"}
    rows = ["| measurement (script) | ours | PyTorch | ours / PyTorch | paired per round [95%]; target |",
            "|---|---:|---:|---:|---|"]
    for name, text in label.items():
        j, t = ts["configs"][name]["jax"], ts["configs"][name]["torch"]
        pr = paired_ratio(ts["configs"][name]["runs"])
        paired = (f"{pr['ratio']:.2f} [{pr['lo']:.2f}, {pr['hi']:.2f}]" if pr else "—") + (
            f"; {target_verdict(pr, TARGETS[name])}" if name in TARGETS else "")
        rows.append(f"| {text} | {j['median_tokens_per_s']:,.0f} | {t['median_tokens_per_s']:,.0f} | "
                    f"{j['median_tokens_per_s'] / t['median_tokens_per_s']:.2f}× | {paired} |")
    for size, text in (("base", "KV-cached decoding, base decoder, batch 1, context 64, ms/token (`decode.py`)"),
                       ("tiny", "KV-cached decoding, tiny decoder, batch 1, context 64, ms/token")):
        r = next(r for r in dec["rows"] if r["size"] == size and r["batch"] == 1 and r["context"] == 64)
        rows.append(f"| {text} | {r['cached_ms']:.2g} | {r['torch_cached_ms']:.2g} (with its own KV cache) | "
                    f"{r['torch_cached_ms'] / r['cached_ms']:.2f}× | — |")
    base = ts["configs"]["base"]
    rows += ["", f"The base model's train step reaches {base['jax']['model_flops_per_s'] / 1e9:.0f} GFLOP/s by "
             f"6·params·tokens, {100 * base['jax']['model_fraction_of_peak']:.0f}% of the float32 matmul rate "
             f"measured in the same run (`jnp.dot` 2048²); PyTorch reaches "
             f"{100 * base['torch']['model_fraction_of_peak']:.0f}%. Machine: {ts['machine']}; PyTorch "
             f"{ts['torch']}."]
    return "\n".join(rows)


def make_run() -> str:
    """`make run`'s phases (make_run.json: medians over its runs)."""
    run = _load("make_run")
    m = {k: v["median"] for k, v in run["stats"].items()}
    steps = run["runs"][0]["to_step"]
    return (f"`make run` takes {m['wall']:.0f} s end to end: {m['steps']:.0f} s of train steps "
            f"({1e3 * m['steps'] / steps:.0f} ms each), {m['first_step']:.1f} s tracing and compiling the step, "
            f"{m['setup']:.1f} s setup, {m['eval']:.1f} s evaluation, {m['checkpoint']:.1f} s checkpoints, "
            f"{m['examples']:.1f} s final examples, {m['start + exit']:.1f} s interpreter start and exit "
            f"(`make_run.py`, medians; the loop writes these phases to `RUN/timings.jsonl` and `jaxformer train` "
            f"prints them).{_against(run)}")


BEFORE_LEVERS = "40eb631"      # the last commit before issue P's speed levers (make bench's --against)


def _against(run: dict) -> str:
    """make_run.json's --against comparison as a sentence ('' without one)."""
    a = run.get("against")
    if not a:
        return ""
    ph = a["phases"]
    say = lambda k: (f"{ph[k]['ratio']:.2f}× [{ph[k]['lo']:.2f}, {ph[k]['hi']:.2f}], "   # noqa: E731
                     f"{ph[k]['verdict']}")
    what = " (the code before the speed levers)" if a["commit"].startswith(BEFORE_LEVERS) else ""
    return (f" In the same run, rounds alternating with commit {a['commit']}{what}: "
            f"this tree / it, wall {say('wall')}; train steps {say('steps')}; first step (compile) "
            f"{say('first_step')} ({ph['wall']['pairs']} pairs; --against in `make_run.py`).")


def _bytes(n: float) -> str:
    return f"{n / 2 ** 20:.0f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.3g} GiB"


def attention() -> str:
    """The attention backends' memory and time (attention.json)."""
    a = _load("attention")
    rows = {(r["mask"], r["backend"], r["length"]): r for r in a["attention"]}
    lengths = sorted({n for _, _, n in rows})
    grown = lambda backend: [r["rss_growth_bytes"] / r["peak_bytes"] for (m, b, n), r in rows.items()   # noqa: E731
                             if b == backend and "rss_growth_bytes" in r]
    out = [f"Measured by `python benchmarks/attention.py` ([benchmarks/results/attention.md]"
           f"(benchmarks/results/attention.md), {a['machine']}, float32): forward + backward of causal "
           f"self-attention, batch 1, {a['heads']} heads of {a['head_dim']}. Peak is the compiled program's memory "
           f"analysis; the resident-set growth of a fresh process confirms it within "
           f"{math.ceil(100 * max(abs(g - 1) for g in grown('chunked'))):.0f}% for chunked, while the reference's "
           f"process grows to {min(grown('reference')):.1f}–{max(grown('reference')):.1f}× its compiled peak. Time "
           f"is the median of 3 runs.", "",
           "| length | reference peak | chunked peak | chunked / reference memory | chunked / reference time |",
           "|---:|---:|---:|---:|---:|"]
    for n in lengths:
        ref, ch = rows["causal", "reference", n], rows["causal", "chunked", n]
        if ref["fits"]:
            out.append(f"| {n:,} | {_bytes(ref['peak_bytes'])} | {_bytes(ch['peak_bytes'])} | "
                       f"{100 * ch['peak_bytes'] / ref['peak_bytes']:.2g}% | {ch['median_s'] / ref['median_s']:.2f}× |")
        else:
            out.append(f"| {n:,} | {_bytes(ref['peak_bytes'])} (more than this machine's available memory) | "
                       f"{_bytes(ch['peak_bytes'])} | {100 * ch['peak_bytes'] / ref['peak_bytes']:.2g}% | "
                       f"chunked: {ch['median_s']:.0f} s |")
    full = [n for n in lengths if ("full", "reference", n) in rows and rows["full", "reference", n]["fits"]]
    mem = " / ".join(f"{100 * rows['full', 'chunked', n]['peak_bytes'] / rows['full', 'reference', n]['peak_bytes']:.2g}%"
                     for n in full)
    time_ = " / ".join(f"{rows['full', 'chunked', n]['median_s'] / rows['full', 'reference', n]['median_s']:.2f}×"
                       for n in full)
    ts = {(r["backend"], r["remat"]): r for r in a["train_step"]}
    base = ts["reference", "none"]
    more = lambda r: f"{100 * (r['median_s'] / base['median_s'] - 1):+.0f}%"                    # noqa: E731
    out += ["", f"Without a mask (nothing to skip) chunked needs {mem} of the reference's memory at "
            f"{' / '.join(f'{n // 1024}k' for n in full)} and {time_} its time. A whole train step (GPT-style decoder "
            f"D512, 6 layers, T=1024, batch 4): {_bytes(base['peak_bytes'])} without remat, "
            f"{_bytes(ts['reference', 'dots']['peak_bytes'])} with `dots`, {_bytes(ts['reference', 'full']['peak_bytes'])} "
            f"with `full` (time {more(ts['reference', 'dots'])} / {more(ts['reference', 'full'])}); chunked attention "
            f"alone {_bytes(ts['chunked', 'none']['peak_bytes'])}, chunked with `full` "
            f"{_bytes(ts['chunked', 'full']['peak_bytes'])}."]
    out[0], out[-1] = textwrap.fill(out[0], 116), textwrap.fill(out[-1], 116)
    return "\n".join(out)


def moe_quantize() -> str:
    """The MoE sweep's loss difference and throughput, quantized decoding's speed and sizes (quantize.json)."""
    moe, small = "MoE 4 experts × d_ff=256, top-2", "dense d_ff=512"
    d = difference(values("moe", moe, "best held-out loss"), values("moe", small, "best held-out loss"))
    tps = statistics.fmean(values("moe", moe, "train tokens/s")) / statistics.fmean(values("moe", small, "train tokens/s"))
    q = _load("quantize")
    speed = {(r["batch"], r["mode"]): r["speedup_vs_float32"] for r in q["speed"]}
    kv = {(r["batch"], r["context"], r["cache"]): r for r in q["kv_cache"]}
    b = q["bytes"]
    margin = _margin("moe")
    return (f"- **Measured** ([docs/ablations/moe.md](docs/ablations/moe.md): 2-core Intel Xeon VM;\n"
            f"  [benchmarks/results/quantize.md](benchmarks/results/quantize.md): {q['machine'].split(',')[0]}):\n"
            f"  MoE with 4 experts of half width, top-2, is {'not resolved' if d.hi - d.lo > 2 * margin else 'resolved'} "
            f"against the dense model of equal active size in\n  held-out loss (the 95% interval of the difference, "
            f"[{_signed(d.lo)}, {_signed(d.hi)}], is {'wider' if d.hi - d.lo > 2 * margin else 'narrower'} than a "
            f"±{margin} margin) and is lower\n  than the dense model of equal total size, but trains at {tps:.2f}× "
            f"its throughput on this CPU. At the base decoder\n  size (D512, 6 layers), batch 1, cached decoding per "
            f"token: int8 weight-only {speed[1, 'int8']:.2f}×, int4 {speed[1, 'int4']:.2f}×, w8a8 "
            f"{speed[1, 'w8a8']:.2f}×\n  float32's speed (batch 8: {speed[8, 'int8']:.2f}×, {speed[8, 'int4']:.2f}×, "
            f"{speed[8, 'w8a8']:.2f}×); weights {b['float32']['total'] / b['int8']['total']:.1f}× (int8) and "
            f"{b['float32']['total'] / b['int4']['total']:.1f}× (int4) smaller. XLA:CPU\n  dequantizes a weight-only "
            f"int8/int4 weight whole before a float matmul (shown from the compiled program in the\n  report), which "
            "is why only int8 × int8 is well above float32's speed. The int8 KV cache is "
            f"{kv[1, 64, 'float32']['cache_bytes'] / kv[1, 64, 'int8']['cache_bytes']:.1f}× smaller and "
            f"{kv[1, 64, 'int8']['speedup_vs_float32']:.2f}× (batch 1,\n  context 64) to "
            f"{kv[8, 1024, 'int8']['speedup_vs_float32']:.2f}× (batch 8, context 1024) faster per token.")


def step_profile() -> str:
    """Where the train step's time goes (step_profile.json), ours against PyTorch."""
    s = _load("step_profile")["results"]
    share = {name: {k: v / sum(r["jax"]["groups_ms"].values()) for k, v in r["jax"]["groups_ms"].items()}
             for name, r in s.items()}
    span = lambda group: (f"{100 * min(x.get(group, 0) for x in share.values()):.0f}–"                # noqa: E731
                          f"{100 * max(x.get(group, 0) for x in share.values()):.0f}%")
    back = lambda name: (s[name]["jax"]["step_ms"] - s[name]["jax"]["forward_ms"]) / s[name]["jax"]["forward_ms"]  # noqa: E731
    top = s["gpt"]["jax"]["top"][0]
    weights = _load("quantize")["bytes"]["float32"]["total"]
    return ("Where the time goes (`step_profile.py`, XLA's own op timings matched to the compiled HLO, and\n"
            "`torch.profiler`): most of the gap is in the backward "
            f"pass\n({back('base'):.1f}× the forward for base, {back('gpt'):.1f}× for the character model, where the "
            f"matmuls alone make 2×). XLA:CPU spends\n{span('transposes/copies')} of the step's op time in layout "
            "copies (the activation gradients transposed for the weight-gradient\ndots"
            f"{_fused_transpose(s['base']['jax'])}), {span('layer-stack I/O')} storing and re-reading each\nscanned "
            f"layer's activations plus {span('buffer fills')} zero-filling those buffers{_one_core(s['gpt'])}, and for the character model "
            f"{100 * share['gpt']['reductions']:.0f}% in\nreductions (its most expensive op, in the group "
            f"{top['group']}, `{top['source'].split('/')[-1]}` in the "
            f"{'backward' if 'transpose(' in top['source'] else 'forward'} pass, costs {top['ms']:.1f} ms of a "
            f"{s['gpt']['jax']['step_ms']:.0f} ms step). PyTorch has none of these: its BLAS calls take\ntransposed "
            "operands, its layers keep activations as separate tensors, and its attention is a fused kernel.\n"
            f"{_malloc(s['base'])}{_threefry(s)}{_no_op(s)}{_decoding_and_kernels(weights)} The training loop itself never\nwaits for the device: no host read per step (metrics and the NaN check "
            "are read at log, eval and checkpoint\nsteps), the next batch is put on the device while a step runs, "
            "and the train step compiles once per run\n(tested).")


def _fused_transpose(base: dict) -> str:
    """How XLA:CPU runs elementwise work fused with a transpose (kernels.json, its layout copies), and what of it
    is left in the base step (step_profile.json, its copies split)."""
    f = _load("kernels")["summary"].get("fused_transpose_over_parts")
    left = base.get("copies", {}).get("with work")
    if not f or not left:
        return ""
    return (": XLA:CPU would fuse the norm's and dropout's backward into those transposes, a fusion\n`kernels.py` "
            f"times at {f['[1024,2048]']:.1f}× the time of its parts run apart on a [1024,2048] array "
            f"({f['[768,512]']:.1f}× on a [768,512] one that fits in\ncache), so each weight gradient transposes the "
            "smaller of its two operands, materialized (`nn.params._weight_grad`,\nin 32×32 tiles, "
            "`platforms.cpu.transpose`: the levers table below); "
            f"{left['ms']:.0f} ms per base step of copies still carry fused work")


def _one_core(gpt: dict) -> str:
    """The char model's fills pinned to one core (step_profile.json jax_one_core): two-thread op times overlap."""
    one = gpt.get("jax_one_core", {})
    if "groups_ms" not in one:
        return ""
    share = one["groups_ms"].get("buffer fills", 0.0) / sum(one["groups_ms"].values())
    return (f" (pinned to one core, {100 * share:.0f}% for the character model; an op's timing can span waits "
            "for a worker or the\ncore, so the shares of cheap ops are not their cost: 2% and 22% in two "
            "earlier runs)")


def _threefry(s: dict) -> str:
    """The dropout models' steps with jax's CPU lowering of threefry against ours (step_profile.json
    jax_rolled_threefry)."""
    runs = {n: (r["jax"], r["jax_rolled_threefry"]) for n, r in s.items()
            if "op_events_per_step" in r.get("jax_rolled_threefry", {}) and "op_events_per_step" in r["jax"]}
    if "tiny" not in runs or "base" not in runs:
        return ""
    (tu, tr), (bu, br) = runs["tiny"], runs["base"]
    return ("Dropout's random bits: jax lowers its threefry hash on CPU as a 5-trip loop per draw, each trip "
            "separate runtime ops;\n`jaxformer` lowers it unrolled, as jax does for GPUs (`jaxformer/platforms/lowering.py`, "
            f"the same bits): the tiny step runs {tu['op_events_per_step']:,.0f}\nop events instead of "
            f"{tr['op_events_per_step']:,.0f} ({tu['step_ms']:.1f} vs {tr['step_ms']:.1f} ms), the base step "
            f"{bu['step_ms']:.0f} vs {br['step_ms']:.0f} ms{_within_noise(tu, tr, bu, br)}.\n")


def _within_noise(*runs: dict) -> str:
    """A caveat when each unrolled/rolled pair's step times (one process each) differ by under 5%: this VM's
    run-to-run spread between processes is about that large (step_profile's two malloc runs of the same code)."""
    pairs = list(zip(runs[::2], runs[1::2]))
    if all(abs(a["step_ms"] - b["step_ms"]) < 0.05 * b["step_ms"] for a, b in pairs):
        return " (one process each: within this machine's run-to-run spread, so the time saved is not shown)"
    return " (one process each)"


def _no_op(s: dict) -> str:
    """Time in our steps with no op event open (step_profile.json no_op_ms): pool work after the ops' events."""
    if not all("no_op_ms" in s.get(n, {}).get("jax", {}) for n in ("base", "gpt")):
        return ""
    b, g = s["base"]["jax"], s["gpt"]["jax"]
    return (f"The op times above miss the work a dot or YNNPACK fusion hands to the thread pool after its own event "
            f"ends:\n{b['no_op_ms']:.0f} ms of the base step ({100 * b['no_op_ms'] / b['step_ms']:.0f}%) and "
            f"{g['no_op_ms']:.1f} ms of the character model's ({100 * g['no_op_ms'] / g['step_ms']:.0f}%) pass with "
            f"no op event open on any thread (base's largest gaps follow {_ops(b['no_op_after'][:2])}, which need "
            "not own the work\nrunning then), so the shares of the groups that hand work to the pool, dots and "
            "YNNPACK fusions, are lower bounds.\n")


def _ops(after: list[dict]) -> str:
    """'op (group) and op (group)' of step_profile.json's no_op_after entries."""
    return " and ".join(f"`{a['op']}` ({a['group']})" for a in after)


def _malloc(base: dict) -> str:
    """The base step's temporary block and glibc's malloc (step_profile.json: ours with and without the tunable)."""
    ours, plain = base["jax"], base.get("jax_default_malloc", {})
    if "faults_per_step" not in ours or "faults_per_step" not in plain:
        return ""
    return (f"The base step's {ours['temp_mib']:.0f} MiB temporary block is allocated at every execution; with "
            f"glibc's malloc as it is,\nthat is a fresh mapping each step, faulted in page by page "
            f"({plain['faults_per_step']:,.0f} minor faults, {plain['step_ms']:.0f} ms per step), so `jaxformer` "
            f"starts with glibc's\nhuge-page tunable (`jaxformer/platforms/launch.py`; {ours['faults_per_step']:,.0f} faults, "
            f"{ours['step_ms']:.0f} ms; the char model's 28 MiB block is reused either way).\n")


def _decoding_and_kernels(weights: float) -> str:
    """Decoding's layout and profile (decode_profile.json, decode.json), the kernels alone (kernels.json)."""
    prof = {(r["batch"], r["context"]): r for r in _load("decode_profile")["rows"]}
    p = prof[1, 64]
    dec = _load("decode")
    floor = next(r for r in dec["rows"] if r["size"] == "base" and r["batch"] == 1 and r["context"] == 64)
    bw, reader = dec["bandwidth_bytes_per_s"]["base"], dec["fastest_reader"]["base"]
    k = _load("kernels")["summary"]
    return (f"Decoding one token at base size reads all {weights / 1e6:.0f} MB of float32 weights: the decoding "
            "program lays the model\nout first (`model.init_cache`: each layer's weights copied out of the "
            "stacked arrays once per call,\nits q/k/v weights as one matrix, a heads-major [B,K,S,H] cache buffer "
            "per layer updated in place, and at batch 1\nthe FFN's output weight in [out,in] order, which "
            "XLA:CPU's matrix-vector product reads faster: `decode_w2_out_in` in the\nlevers table: "
            f"{max(r['cache_copies'] for r in prof.values())} whole-buffer copies per token in the compiled "
            f"loop), so that at batch 1, context 64,\na token takes {floor['cached_ms']:.2f} ms, "
            f"{floor['cached_ms'] / floor['floor_ms']:.2f}× the time of reading the weights once at the fastest "
            f"rate any of four readers\n(ours and PyTorch's) reads a buffer of their size in the same run, "
            f"{bw / 1e9:.1f} GB/s by {reader} (`decode.py`; PyTorch's own cached token takes\n"
            f"{floor['torch_cached_ms'] / floor['floor_ms']:.2f}× that; `decode_profile.py`: "
            f"{p['groups_ms'].get('matmul', 0):.1f} ms of our op time in the weight matmuls{_matmul_rates(prof)}). "
            "Alone, the matmuls "
            "of one layer of the\ncharacter model's "
            f"train step take {1 / k['ratio']:.2f}× PyTorch's time on the same shapes (`kernels.py`): the "
            "kernels' own gap.")


def _matmul_rates(prof: dict) -> str:
    """How fast the batch-1 weight matmuls read their weights, in the loop and alone, ours and PyTorch's
    (decode_profile.json), or '' for a file without them."""
    alone = _load("decode_profile").get("kernels_alone")
    p = prof.get((1, 64), {})
    if not alone or "weight_matmuls" not in p:
        return ""
    ws = [(k, w) for k, w in p["weight_matmuls"].items() if w["us"] and k in alone]
    total = sum(w["bytes"] for _, w in ws)
    loop = total / sum(w["us"] for _, w in ws) / 1e3
    at = {s: total / sum(w["bytes"] / alone[k][s] for k, w in ws) for s in ("jax_gbs", "torch_gbs")}
    return (f", reading them at {loop:.1f} GB/s, {loop / at['jax_gbs']:.2f}× the rate of the same matmuls "
            f"alone, {at['jax_gbs']:.1f} GB/s; PyTorch's F.linear\nreads the same shapes alone at "
            f"{at['torch_gbs']:.1f} GB/s")


def tokenizers() -> str:
    """Characters vs BPE at equal compute (docs/ablations/tokenizers_*.csv), and the input pipeline against the
    train step (pipeline.json)."""
    from claims_table import arm
    rows = ["| tokens | held-out bits per byte (best) | held-out loss per token | best − char, Welch 95% interval |",
            "|---|---:|---:|---:|"]
    arms = ("char", "bpe 512", "bpe 2048")
    char = values("tokenizers", "char", "best held-out bits per byte")
    for a in arms:
        b, loss = arm("tokenizers", a, "best held-out bits per byte"), arm("tokenizers", a, "held-out loss per token")
        d = difference(values("tokenizers", a, "best held-out bits per byte"), char) if a != "char" else None
        rows.append(f"| {a} | {b.mean:.3f} ± {b.std:.3f} | {loss.mean:.3f} ± {loss.std:.3f} | "
                    + (f"{_signed(d.mean)} [{_signed(d.lo)}, {_signed(d.hi)}]" if d else "—") + " |")
    out = ["Characters against byte-level BPE on tiny Shakespeare at equal compute (`configs/sweeps/tokenizers.py`, "
           "3 seeds, mean ± std; [report](docs/ablations/tokenizers.md)). Equal compute means the same model, steps "
           "and tokens per step: a BPE token stands for more bytes, so the BPE arms read more of the text in their "
           "1,500 steps, which is the point of a tokenizer.", "", *rows]
    path = RESULTS / "pipeline.json"
    if path.exists():
        p = _load("pipeline")
        low = min(p["pipeline"], key=lambda r: r["headroom"])
        out += ["", textwrap.fill(
            f"The input pipeline (`benchmarks/pipeline.py`, {p['machine']}): preparing a {p['corpus_mb']} MiB corpus "
            f"runs at {p['prepare']['byte']['mb_per_s']:.1f} MiB/s with the byte tokenizer and "
            f"{p['prepare']['bpe']['mb_per_s']:.1f} MiB/s with byte-level BPE (2,048 ids, trained on it); the "
            f"tokens task delivers training batches at {low['headroom']:.0f}× or more the rate the train step "
            f"consumes them (slowest: {low['shape']} {low['packing']}, {low['tokens_per_s']:,.0f} against "
            f"{low['train_step_tokens_per_s']:,.0f} tokens/s), so it is never the bottleneck.", 116)]
    return "\n".join(out)


def levers() -> str:
    """Each kept speed lever against the program without it, paired in one process (levers.json)."""
    lv = _load("levers")
    out = ["| lever | config | after / before, time per step (per call for an op, per token for a decoding config "
           "SIZE bB cC) [95% interval] | verdict |",
           "|---|---|---|---|"]
    for r in lv["rows"]:
        out.append(f"| {r['lever']} | {r['config']} | {r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] | "
                   f"{r['verdict']} |")
    control = [r for r in lv["rows"] if r["lever"] == "control"]
    out += [""] + [f"- **{n}**: {v['what']}; before: {v['before']}." for n, v in lv["levers"].items()]
    if control:
        out += ["", textwrap.fill(
            "The A/A control is the harness's own error: one program timed against itself gave " + ", ".join(
                f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] ({r['config']})" for r in control)
            + ": an effect of a percent or two is not established here, whatever its row's verdict says.", 116)]
    out += ["", textwrap.fill(
        f"`benchmarks/levers.py` builds both programs in one process, the lever switched off for \"before\" (the "
        f"code it replaced, patched back while that program is traced), and alternates blocks of steps between "
        f"them; the verdict is the 95% interval of the paired ratios against a ±{lv['margin']:.0%} margin "
        f"(`control` times one program against itself). Machine: {lv['machine']} "
        f"([levers.md](benchmarks/results/levers.md)).", 116)]
    return "\n".join(out)


def hf_keys() -> str:
    """The config.json keys a Hugging Face import accepts as changing nothing (jaxformer.hf.families.ACCEPTED)."""
    from jaxformer.hf.families import accepted_keys_table
    return accepted_keys_table()


def lora_memory() -> str:
    """Low-rank adapters against full fine-tuning: trainable parameters, state and train-step memory
    (lora_memory.json)."""
    lm = _load("lora_memory")
    full = lm["rows"][0]
    mib = lambda b: f"{b / 2**20:,.0f}"                                              # noqa: E731
    out = ["| arm | trainable params | state MiB (model + optimizer) | XLA temporaries MiB | step peak MiB |",
           "|---|---:|---:|---:|---:|"]
    for r in lm["rows"]:
        out.append(f"| {r['arm']} | {r['trainable']:,} ({100 * r['trainable'] / r['params']:.2f}%) | "
                   f"{mib(r['model_bytes'])} + {mib(r['opt_bytes'])} | {mib(r['temp_bytes'])} | "
                   f"{mib(r['peak_bytes'])} ({r['peak_bytes'] / full['peak_bytes']:.2f}×) |")
    out.append("")
    out.append(f"Machine: {lm['machine']} ([lora_memory.md](benchmarks/results/lora_memory.md)).")
    return "\n".join(out)


def context_memory() -> str:
    """Per-device train-step memory against sequence length, one device against context parallelism
    (benchmarks/context_memory.py)."""
    from context_memory import table
    res = _load("context_memory")
    return (table(res) + f"\n\nMachine: {res['machine']}, {res['date']} "
            "([context_memory.md](benchmarks/results/context_memory.md)).")


def pipeline_bubble() -> str:
    """The GPipe bubble against micro-batches (benchmarks/pipeline_bubble.py)."""
    from pipeline_bubble import table
    res = _load("pipeline_bubble")
    return (table(res) + f"\n\nMachine: {res['machine']}, {res['date']} "
            "([pipeline_bubble.md](benchmarks/results/pipeline_bubble.md)).")


def mup_check() -> str:
    """µP's coordinate check (docs/mup/mup_check.json, `jaxformer mup-check`): per site, the slope of log mean|x|
    against log width after the last step, under SP and µP."""
    r = json.loads((ROOT / "docs" / "mup" / "mup_check.json").read_text(encoding="utf-8"))
    out = [f"| site (mean abs value after {r['steps']} steps) | SP slope | µP slope |", "|---|---:|---:|"]
    out += [f"| {s} | {r['slopes']['sp'][s]:+.2f} | {r['slopes']['mup'][s]:+.2f} |" for s in r["sites"]]
    out += ["", f"Widths {', '.join(map(str, r['widths']))} (µP's base: {r['widths'][0]}), lr {r['lr']:g}: SP "
            f"{r['verdict']['sp']}; µP {r['verdict']['mup']}. `{r['command']}` on {r['machine']}, {r['date']} "
            "([docs/mup/mup_check.png](docs/mup/mup_check.png))."]
    return "\n".join(out)


TABLES = {"context_memory": context_memory, "pipeline_bubble": pipeline_bubble, "hf_keys": hf_keys, "mup_check": mup_check, "lora_memory": lora_memory, "performance": performance, "levers": levers, "make_run": make_run, "claims": claims,
          "attention": attention, "moe_quantize": moe_quantize, "step_profile": step_profile, "tokenizers": tokenizers,
          "capture_parity": capture_parity, "patching": patching, "patching_tl": patching_tl}


def render(text: str, page: str = "README.md") -> str:
    """`text` with every table block replaced by its rendering; ValueError names a block with no renderer.
    page: where the text lives (the renderers write links from the repository root; a docs/guide page's are
    rewritten to resolve from there: docs/X -> ../X, benchmarks/results/X -> ../results/X, the site's copy)."""
    def one(m):
        if m["name"] not in TABLES:
            raise ValueError(f"{page}: table block {m['name']!r} has no renderer in tools/readme_tables.py")
        table = TABLES[m["name"]]()
        if page.startswith("docs/guide/"):
            table = table.replace("](docs/", "](../").replace("](benchmarks/results/", "](../results/")
        return m.group(1) + table + m.group(3)
    return _BLOCK.sub(one, text)


def pages() -> list[str]:
    """Every page that holds table blocks: the README and the guide's pages."""
    return ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs" / "guide").glob("*.md")))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    stale = []
    for page in pages():
        path = ROOT / page
        old = path.read_text(encoding="utf-8")
        new = render(old, page)
        if new != old:
            stale.append(page)
            if not args.check:
                path.write_text(new, encoding="utf-8")
                print(f"rendered {len(_BLOCK.findall(old))} table(s) into {page}")
    if args.check and stale:
        print(f"{', '.join(stale)}: tables differ from their results files: run python tools/readme_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
