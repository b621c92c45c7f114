"""A run's low-rank adapters (model.lora) as a PEFT adapter folder: adapter_config.json and
adapter_model.safetensors, what `peft.PeftModel.from_pretrained(base, DIR)` reads on top of the base model the
run started from (`train.init_from`, exported or published).

PEFT's LoRA layer on nn.Linear(in, out) holds lora_A.weight [r, in] and lora_B.weight [out, r] and adds
(alpha/r)·B·A to the weight [out, in]; ours are A [L, in..., r] and B [L, r, out...] (`nn.lora`), flattened in
the order `hf.mapping` flattens the weights they adapt (heads-major: n·H + h). Llama-like families only (GPT-2's
fused c_attn projection has one adapter for q, k and v in PEFT; ours are separate).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.hf.expressing import family_for
from jaxformer.hf.families import HFError
from jaxformer.nn.lora import ATTRIBUTES, Adapted

# our attribute in the block -> the HF module it adapts
MODULES = {("self_attn", "wq"): "self_attn.q_proj", ("self_attn", "wk"): "self_attn.k_proj",
           ("self_attn", "wv"): "self_attn.v_proj", ("self_attn", "wo"): "self_attn.o_proj",
           ("ffn", "wg"): "mlp.gate_proj", ("ffn", "w1"): "mlp.up_proj", ("ffn", "w2"): "mlp.down_proj"}


def adapter_tensors(model) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} for every adapter of a decoder-only model."""
    out = {}
    stack = model.decoder.layers
    for i in range(stack.num_layers):
        block = stack.layer(i)
        for (sub, attr), hf in MODULES.items():
            w = getattr(getattr(block, sub), attr, None)
            if not isinstance(w, Adapted):
                continue
            a, b = np.asarray(w.a[...], np.float32), np.asarray(w.b[...], np.float32)   # [in..., r], [r, out...]
            r = a.shape[-1]
            name = f"base_model.model.model.layers.{i}.{hf}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)      # [r, in]
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)      # [out, r]
    return out


def save_adapter(model, path: str | Path, base: str = "") -> dict:
    """Write `model`'s adapters as a PEFT LoRA adapter folder (module docstring); base: the base model's name or
    folder for adapter_config.json. -> the adapter config written. HFError: no adapters, an encoder-decoder or a
    GPT-2-family model, or a folder that already holds an adapter."""
    from safetensors.numpy import save_file
    cfg = model.cfg
    lora = cfg.lora
    if not lora.rank:
        raise HFError("the run has no adapters (model.lora.rank=0): export the model itself (export-hf without "
                      "--adapter)")
    if cfg.arch != "decoder_only":
        raise HFError("PEFT adapters are written for decoder-only models; export the merged model instead")
    family = family_for(cfg.function())
    if family == "gpt2":
        raise HFError("a gpt2-family model's q/k/v are one fused c_attn in PEFT, and its adapters are separate "
                      "here; export the merged model (export-hf without --adapter)")
    path = Path(path)
    if (path / "adapter_config.json").exists():
        raise HFError(f"{path} already holds an adapter (adapter_config.json); choose another folder")
    targets = sorted({MODULES[k].split(".")[1] for k in MODULES if k[1] in {ATTRIBUTES[t] for t in lora.targets}})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None}
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(model), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    return config
