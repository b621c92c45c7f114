"""benchmarks/gpu.py's report: STEM.md (tables) and STEM.json (everything), rewritten after every item."""
from __future__ import annotations

import json
from pathlib import Path

import gpu_levers


def fmt(st: dict | None, f: str = ",.0f") -> str:
    g = lambda v: format(v, f)                                                # noqa: E731
    return f"{g(st['median'])} ({g(st['min'])}–{g(st['max'])}, n={st['n']})" if st else "n/a"


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                           for r in rows]


def _flat_model(mo: dict) -> dict:
    """A recorded model config as flat keys: sectioned (model.norm.position, ...) or as results before the
    sections recorded it (norm_position, ...)."""
    from jaxformer.config import SECTIONED
    if "norm" not in mo:
        return mo
    flat = {k: v for k, v in mo.items() if not isinstance(v, dict)}
    for old, new in SECTIONED.items():
        section, field = new.split(".")
        flat[old] = mo[section][field]
    return flat


def gb(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def peer_rows(peer: dict, kind: str) -> list[list]:
    """PyTorch's rows for the train table (kind "train") or the decode table ("decode")."""
    rows = []
    for name, r in peer.get("items", {}).items():
        if not name.startswith(kind) or "tokens_per_s" not in r:
            continue
        mode = name.split("_")[1]
        label = f"PyTorch {'torch.compile' if mode == 'compiled' else 'eager'}"
        if kind == "train":
            rows.append([label, fmt(r["tokens_per_s"]), "", "", fmt(r["mfu"], ".1%"), f"{r['compile_s']:.1f}",
                         gb(r["peak_memory_gb"]), f"{r['final_loss']:.3f}"])
        else:
            rows.append([f"{r['batch']} ({label})", fmt(r["tokens_per_s"]), fmt(r["ms_per_step"], ".2f"), "", "",
                         f"{r['compile_s']:.1f}"])
    return rows


def lane_lines(lane: dict) -> list[str]:
    if "counts" not in lane:
        return []
    c = lane["counts"]
    fails = [x for x in lane["log"] if x.startswith("failed")]
    head = [x for x in lane["log"] if x.startswith("#")]
    return ["", "## GPU lane (pytest -m gpu)", "", f"`{lane['command']}`: {c['passed']} passed, {c['failed']} failed, "
            f"{c['skipped']} skipped (exit status {lane['returncode']}); " + (head[0][2:] if head else "no log"),
            *([""] + [f"- {x}" for x in fails] if fails else [])]


def write(stem: Path, rec: dict) -> None:
    m, S = rec["machine"], rec["sections"]
    tr, de, rv = (S.get(k, {}) for k in ("train", "decode", "reversal"))
    L = ["# GPU benchmark: the GPU lane, train MFU (~1B LM) against PyTorch, levers, cached decoding"
         + " (DRY RUN)" * rec["dry"], "",
         f"Machine: {m['device_kind']} ({m['platform']}); {m['summary']}", "", f"Command: `{rec['command']}`", "",
         *[f"- {k}: {v}" for k, v in rec["formulas"].items()], "", "Values: median (min–max, n = repetitions).",
         *lane_lines(S.get("lane", {}))]
    if "backend" in tr:
        mo, mem = _flat_model(tr["model"]), tr["peak_memory_gb"]
        L += ["", "## Train step, MFU, against PyTorch", "",
              f"Model: decoder-only, {tr['params']:,} parameters (nnx.eval_shape), D{mo['d_model']}, {mo['num_heads']} "
              f"heads, F{mo['d_ff']} {mo['activation']}, {mo['num_decoder_layers']} layers, V{mo['vocab_size']} tied, "
              f"{mo['norm_position']}-{mo['norm_type']}, {mo['positional']}, dtype {mo['dtype']} (params float32), "
              f"remat {tr['remat']}; B×T = {tr['batch']}×{tr['seq']}; {tr['warmup_steps']} warm-up steps, then "
              f"repetitions of {tr['steps_per_rep']} steps.", "", f"Attention backend: **{tr['backend']}**"
              + "".join(f"; passed over {b}: {w}" for b, w in tr["passed_over"].items()), "",
              *table(["", "tokens/s", "s/step", "model TFLOP/s", "MFU", "compile s", "peak mem GB", "loss"],
                     [["jaxformer", fmt(tr["tokens_per_s"]), fmt(tr["s_per_step"], ".4f"), fmt(tr["model_tflops"],
                       ".3g"), fmt(tr["mfu"], ".1%"), f"{tr['compile_s']:.1f}", gb(mem), f"{tr['final_loss']:.3f}"],
                      *peer_rows(S.get("peer", {}), "train")]),
              "", f"FLOPs per token: {tr['flops_per_token']:,}; peak: {tr['peak_tflops'] or 'n/a'} TFLOP/s "
              f"({tr['peak_source']}); jaxformer's compiled step: {gb(tr.get('memory_gb'))} GB of arguments + "
              "temporaries (XLA's memory analysis); peak memory: the device's own count (PyTorch: "
              "torch.cuda.max_memory_allocated)."]
    L += gpu_levers.lines(S.get("levers", {}))
    if "batches" in de:
        L += ["", "## Cached decoding (generate_lm, greedy, bfloat16 weights)", "", f"Same model, attention backend "
              f"**{de['backend']}**, prompt {de['prompt']} tokens, {de['new']} new tokens; weights "
              f"{de['weight_bytes'] / 1e9:.2f} GB, read bandwidth measured {de['read_gb_per_s']:.0f} GB/s.", "",
              *table(["batch", "tokens/s", "ms/step", "floor ms/step", "× floor", "compile s"],
                     [[b, fmt(r["tokens_per_s"]), fmt(r["ms_per_step"], ".2f"), f"{r['floor_ms']:.2f}",
                       f"{r['ms_per_step']['median'] / r['floor_ms']:.2f}", f"{r['compile_s']:.1f}"]
                      for b, r in de["batches"].items()] + peer_rows(S.get("peer", {}), "decode"))]
    if "variants" in rv:
        L += ["", "## Reversal main job (configs/reverse.py)", "", f"Batch {rv['batch']}, shapes {rv['shapes']}, "
              f"{rv['steps_per_rep']} steps per repetition cycling {rv['distinct_batches']} real batches "
              f"({rv['target_tokens_per_rep']:,} target tokens).", "",
              *table(["dtype", "target tokens/s", "ms/step", "compile s"],
                     [[d, fmt(r["tokens_per_s"]), fmt(r["ms_per_step"], ".3f"), f"{r['compile_s']:.1f}"]
                      for d, r in rv["variants"].items()])]
    notes = [f"- {k}: {n}" for k, sec in S.items() for n in sec.get("notes", [])] + [
        f"- {k} error ({w}): {v}" for k, sec in S.items() for w, v in sec.get("errors", {}).items()] + [
        f"- {k} FAILED: {sec['error']}" for k, sec in S.items() if "error" in sec] + [
        f"- peer {n} error: {r['error']}" for n, r in S.get("peer", {}).get("items", {}).items() if "error" in r] + [
        f"- peer skipped (budget): {', '.join(S['peer']['skipped'])}" for _ in [1] if S.get("peer", {}).get("skipped")]
    L += ["", "## Notes", "", *(notes or ["- every section ran all its repetitions"]), "", f"Wall time: "
          f"{rec['wall_s']:.0f} s (sections: " + ", ".join(f"{k} {v.get('section_s', 0):.0f} s" for k, v in S.items()) + ")."]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".md").write_text("\n".join(L) + "\n")
    stem.with_name(stem.name + ".json").write_text(json.dumps(rec, indent=1, default=str) + "\n")


