"""The patching grid and attribution patching against TransformerLens on the same GPT-2: the first call (a fresh
process: JAX traces and compiles, with and without a persistent compilation cache) and the steady state.

  .venv/bin/python benchmarks/patching_tl.py [--rounds 7] [--layers 2] [--width 128] [--length 16] [--batch 4]

One GPT-2 (transformers' GPT2LMHeadModel, random weights of seed 0, vocab 512, 4 heads) is saved to a folder; ours
loads it with `jaxformer.hf.from_pretrained`, TransformerLens converts the same weights (its own
`convert_gpt2_weights`, no folding or centring, so both compute the same function). Cells: (layer, position, head)
of the heads' outputs (`z`, TransformerLens' `hook_z`); the metric: the mean logit difference of two tokens at the
last position, normalised by the clean and corrupt runs' (1: the cell restores the clean run).

  grid         `jaxformer.patching.patching_grid(..., "z", over="both", batch=--batch)` against TransformerLens'
               `patching.get_act_patch_attn_head_out_by_pos` (one hooked forward pass per cell)
  attribution  `jaxformer.patching.attribution_patching(..., "z", over="both")` against the TransformerLens way
               (run_with_cache on the clean run, forward and backward hooks on the corrupted one: Σ (clean −
               corrupt) · ∂metric/∂z per cell)

First call: each measured in a fresh process (`--child`), after the imports and the model's loading (reported
apart): JAX with an empty persistent compilation cache ("cold"), then again with the cache the cold run wrote
("warm": `jaxformer.compile_cache.enable`), and TransformerLens (no compilation; its first call pays PyTorch's
warm-up). Steady state: in one process, the calls after the first, in paired rounds (the order alternating),
with the ratio's 95% paired interval. Agreement: max |ours − TransformerLens| per method.
Writes benchmarks/results/patching_tl.json and .md (machine named).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB, HEADS, RIGHT, WRONG = 512, 4, 7, 11
METHODS = ("grid", "attribution")


def _save_gpt2(folder: Path, layers: int, width: int) -> None:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=width, n_layer=layers, n_head=HEADS)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)


def _tokens(length: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    clean = np.random.default_rng(0).integers(0, VOCAB, (rows, length))
    corrupt = clean.copy()
    corrupt[:, length // 2] = (clean[:, length // 2] + 1) % VOCAB
    return clean, corrupt


def _ours(folder: Path, clean: np.ndarray, corrupt: np.ndarray, batch: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxformer.hf import from_pretrained
    from jaxformer.patching import attribution_patching, patching_grid
    model = from_pretrained(folder)
    clean, corrupt = (jnp.asarray(clean),), (jnp.asarray(corrupt),)

    def metric(logits):
        return jnp.mean(logits[:, -1, RIGHT] - logits[:, -1, WRONG])
    return {"grid": lambda: jax.block_until_ready(patching_grid(model, clean, corrupt, "z", metric, over="both",
                                                                batch=batch)),
            "attribution": lambda: jax.block_until_ready(attribution_patching(model, clean, corrupt, "z", metric,
                                                                              over="both"))}


def _tl_model(folder: Path):
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head,
                                  n_heads=c.n_head, d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new",
                                  normalization_type="LN", positional_embedding_type="standard", device="cpu",
                                  original_architecture="GPT2LMHeadModel", default_prepend_bos=False)
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    return model.eval()


def _theirs(folder: Path, clean: np.ndarray, corrupt: np.ndarray) -> dict:
    import torch
    from transformer_lens import patching
    model = _tl_model(folder)
    clean, corrupt = torch.as_tensor(clean), torch.as_tensor(corrupt)

    def diff(logits):
        return (logits[:, -1, RIGHT] - logits[:, -1, WRONG]).mean()

    def grid():
        with torch.no_grad():
            clean_logits, cache = model.run_with_cache(clean)
            top, base = diff(clean_logits), diff(model(corrupt))
            return patching.get_act_patch_attn_head_out_by_pos(model, corrupt, cache,
                                                               lambda lg: (diff(lg) - base) / (top - base))

    def attribution():
        names = lambda name: name.endswith("hook_z")                         # noqa: E731
        with torch.no_grad():
            clean_logits, clean_cache = model.run_with_cache(clean, names_filter=names)
        acts, grads = {}, {}
        model.reset_hooks()
        model.add_hook(names, lambda t, hook: acts.__setitem__(hook.name, t.detach()), "fwd")
        model.add_hook(names, lambda t, hook: grads.__setitem__(hook.name, t.detach()), "bwd")
        value = diff(model(corrupt))
        value.backward()
        model.reset_hooks()
        top = diff(clean_logits).detach()
        est = torch.stack([((clean_cache[n] - acts[n]) * grads[n]).sum((0, 3)) for n in sorted(acts, key=_layer)])
        return est / (top - value.detach())                                  # [L, T, N]
    return {"grid": grid, "attribution": attribution}


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def _child(a) -> None:
    """One fresh process: load, then time each method's first call; prints {load_ms, first_ms: {method: ms}}."""
    t = time.perf_counter()
    clean, corrupt = _tokens(a.length, a.rows)
    if a.child == "jaxformer":
        from jaxformer import compile_cache
        if a.cache:
            compile_cache.enable(a.cache)
        fns = _ours(Path(a.folder), clean, corrupt, a.batch)
    else:
        fns = _theirs(Path(a.folder), clean, corrupt)
    out = {"load_ms": 1e3 * (time.perf_counter() - t), "first_ms": {}}
    for name in METHODS:
        t = time.perf_counter()
        fns[name]()
        out["first_ms"][name] = 1e3 * (time.perf_counter() - t)
    print(json.dumps(out))


def _first_calls(a, folder: Path, cache: Path) -> dict:
    def run(who: str, *extra: str) -> dict:
        cmd = [sys.executable, __file__, "--child", who, "--folder", str(folder), "--length", str(a.length),
               "--rows", str(a.rows), "--batch", str(a.batch), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode:
            raise SystemExit(f"{who} child failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return {"jaxformer, no cache": run("jaxformer"), "jaxformer, cold cache": run("jaxformer", "--cache", str(cache)),
            "jaxformer, warm cache": run("jaxformer", "--cache", str(cache)), "TransformerLens": run("tl")}


def _steady(a, folder: Path) -> dict:
    import torch
    from jaxformer.stats import paired_ratio
    from timing import paired_times_ms  # benchmarks/timing.py (the script's folder is on sys.path)
    torch.set_num_threads(os.cpu_count() or 1)
    clean, corrupt = _tokens(a.length, a.rows)
    ours, theirs = _ours(folder, clean, corrupt, a.batch), _theirs(folder, clean, corrupt)
    out = {}
    for name in METHODS:
        mine, ref = np.asarray(ours[name]()), theirs[name]().detach().numpy()
        times = paired_times_ms({"jaxformer": ours[name], "TransformerLens": theirs[name]}, a.rounds)
        out[name] = {"median_ms": {k: float(np.median(v)) for k, v in times.items()}, "cells": int(mine.size),
                     "tl_over_ours": paired_ratio(times["TransformerLens"], times["jaxformer"]),
                     "max_abs_diff": float(np.max(np.abs(mine - ref)))}
    return out


def _markdown(r: dict) -> str:
    a = r["args"]
    md = [f"# Patching against TransformerLens, first call and steady state ({r['machine']}; torch {r['torch']}, "
          f"transformer-lens {r['transformer_lens']})", "",
          f"GPT-2 (random weights), {a['layers']} layers, width {a['width']}, {HEADS} heads, vocab {VOCAB}; "
          f"{a['rows']} × {a['length']} tokens; cells (layer, position, head) of `z`: "
          f"{r['steady']['grid']['cells']}; grid batch {a['batch']}; {a['rounds']} paired rounds. "
          "`.venv/bin/python benchmarks/patching_tl.py`", "",
          "## First call (a fresh process, after imports and loading)", "",
          "| run | load ms | grid first call ms | attribution first call ms |", "|---|---|---|---|"]
    md += [f"| {k} | {v['load_ms']:.0f} | {v['first_ms']['grid']:.0f} | {v['first_ms']['attribution']:.0f} |"
           for k, v in r["first"].items()]
    md += ["", "## Steady state (calls after the first)", "",
           "| method | jaxformer ms | TransformerLens ms | TransformerLens / jaxformer [95% paired] | max abs diff |",
           "|---|---|---|---|---|"]
    for name, s in r["steady"].items():
        q = s["tl_over_ours"]
        md.append(f"| {name} | {s['median_ms']['jaxformer']:.1f} | {s['median_ms']['TransformerLens']:.1f} | "
                  f"{q['ratio']:.1f} [{q['lo']:.1f}, {q['hi']:.1f}] | {s['max_abs_diff']:.1e} |")
    return "\n".join(md + [""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4, help="the batch of prompts")
    ap.add_argument("--batch", type=int, default=4, help="cells vmapped together inside the grid program")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "patching_tl"))
    ap.add_argument("--child", choices=("jaxformer", "tl"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ["TQDM_DISABLE"] = "1"          # TransformerLens' progress bar over the cells (children inherit it)
    if a.child:
        return _child(a)
    from importlib.metadata import version

    import torch

    from jaxformer.stats import machine
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2"
        _save_gpt2(folder, a.layers, a.width)
        first = _first_calls(a, folder, Path(tmp) / "jax-cache")
        r = {"machine": machine(), "torch": torch.__version__, "transformer_lens": version("transformer-lens"),
             "args": {k: v for k, v in vars(a).items() if k not in ("child", "folder", "cache", "out")},
             "first": first, "steady": _steady(a, folder)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(r, indent=1) + "\n")
    Path(a.out + ".md").write_text(_markdown(r))
    print(_markdown(r))


if __name__ == "__main__":
    main()
