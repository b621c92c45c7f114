"""Capture error against transformers, per dtype: how far the activation sites of an imported model are from
transformers' own hidden states and attentions, in float32 and bfloat16.

  .venv/bin/python benchmarks/capture_parity.py

For Llama, GPT-2, Qwen3 and Gemma 2 (random weights of std 0.2, 4 layers, width 64, 2 × 32 tokens, eager
attention): transformers' model in float32 and in bfloat16, ours imported from the same folder with compute
dtype float32 and bfloat16 (parameters float32, as in training). Per site: embed (hidden_states[0]), resid_post
(every layer but the last, hidden_states[l + 1]), final_norm (the last hidden state), pattern (attentions) and
the logits. Each error is max |ours − theirs| / max |theirs| (pattern: max |ours − theirs|, probabilities),
against transformers in the same dtype and against transformers in float32 (what bfloat16 itself costs).
Writes benchmarks/results/capture_parity.json and .md (machine named).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxformer.hf import from_pretrained
from jaxformer.stats import machine

V = 128
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, LLAMA),
    "gpt2": (transformers.GPT2Config, dict(vocab_size=V, n_positions=64, n_embd=64, n_layer=4, n_head=4)),
    "qwen3": (transformers.Qwen3Config, dict(LLAMA, head_dim=16)),
    "gemma2": (transformers.Gemma2Config, dict(LLAMA, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
}
IDS = np.random.default_rng(7).integers(0, V, (2, 32))
SITES = ("embed", "resid_post", "final_norm", "pattern", "logits")


def _theirs(m, dtype) -> dict:
    m = m.to(dtype)
    with torch.no_grad():
        out = m(torch.tensor(IDS), output_hidden_states=True, output_attentions=True)
    h = [x.float().numpy() for x in out.hidden_states]
    return {"embed": h[0], "resid_post": np.stack(h[1:-1]), "final_norm": h[-1],
            "pattern": np.stack([a.float().numpy() for a in out.attentions]), "logits": out.logits.float().numpy()}


def _ours(folder, dtype) -> dict:
    model = from_pretrained(folder, dtype=dtype)
    logits, aux = model(jnp.asarray(IDS), capture=("embed", "resid_post", "final_norm", "pattern"))
    cap = {k: np.asarray(v, np.float32) for k, v in aux["captured"].items()}
    cap["resid_post"] = cap["resid_post"][:-1]
    return {**cap, "logits": np.asarray(logits, np.float32)}


def _error(site, a, b) -> float:
    diff = float(np.abs(a - b).max())
    return diff if site == "pattern" else diff / float(np.abs(b).max())


def main() -> None:
    rows = []
    for family, (cls, sizes) in FAMILIES.items():
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(cls(**sizes), attn_implementation="eager")
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.2)
        m = m.eval().float()
        with tempfile.TemporaryDirectory() as folder:
            m.save_pretrained(folder)
            reference = _theirs(m, torch.float32)
            for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                theirs = reference if dtype == "float32" else _theirs(m, torch_dtype)
                ours = _ours(folder, dtype)
                for site in SITES:
                    rows.append({"family": family, "dtype": dtype, "site": site,
                                 "vs_same_dtype": _error(site, ours[site], theirs[site]),
                                 "vs_float32": _error(site, ours[site], reference[site]),
                                 "theirs_vs_float32": _error(site, theirs[site], reference[site])})
                m = m.float()
    result = {"machine": machine(), "transformers": transformers.__version__, "torch": torch.__version__,
              "tokens": list(IDS.shape), "rows": rows}
    out = Path(__file__).parent / "results" / "capture_parity"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"# Capture error against transformers ({result['machine']}; transformers {result['transformers']})", "",
          "max |ours − theirs| / max |theirs| (pattern: max |ours − theirs|). `benchmarks/capture_parity.py`", "",
          "| family | dtype | site | vs transformers, same dtype | vs transformers float32 | transformers vs its "
          "float32 |", "|---|---|---|---|---|---|"]
    md += [f"| {r['family']} | {r['dtype']} | {r['site']} | {r['vs_same_dtype']:.1e} | {r['vs_float32']:.1e} | "
           f"{r['theirs_vs_float32']:.1e} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
