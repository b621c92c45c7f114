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

from jaxformer.hf.checkpoint import DTYPES
from jaxformer.hf.expressing import check_family, family_for
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


def save_adapter(model, path: str | Path, base: str, *, family: str | None = None, dtype: str = "float32") -> dict:
    """Write `model`'s adapters as a PEFT LoRA adapter folder (`write_adapter`), whole or not at all: `path` must
    not exist or be empty (`hf.staging`). -> the adapter config written."""
    from jaxformer.hf.staging import staged
    adapter_config(model, base, family)                    # refused before anything is written
    with staged(path) as tmp:
        return write_adapter(model, tmp, base, family=family, dtype=dtype)


def adapter_config(model, base: str, family: str | None = None) -> dict:
    """adapter_config.json of `model`'s adapters over `base` (the base model's name or folder). family: the
    family the base exports as; it must express the model (`check_family`; default `family_for`). HFError: no
    adapters, no base, an encoder-decoder or a GPT-2-family model, a family that cannot express the model."""
    cfg = model.cfg
    lora = cfg.lora
    if not lora.rank:
        raise HFError("the run has no adapters (model.lora.rank=0): export the model itself (export-hf without "
                      "--adapter)")
    if not str(base):
        raise HFError("the adapters have no base model to apply to (base_model_name_or_path would be empty): "
                      "export the merged model instead (export-hf without --adapter)")
    if cfg.arch != "decoder_only":
        raise HFError("PEFT adapters are written for decoder-only models; export the merged model instead")
    of_base = base_family(base)
    if family and of_base and family != of_base:
        raise HFError(f"--family {family}: the adapters' base model {base} is a {of_base} checkpoint (its "
                      f"config.json's model_type); PEFT applies them to that model")
    family = family or of_base or family_for(cfg.function())
    check_family(cfg.function(), family)
    if family == "gpt2":
        raise HFError("a gpt2-family model's q/k/v are one fused c_attn in PEFT, and its adapters are separate "
                      "here; export the merged model (export-hf without --adapter)")
    targets = sorted({MODULES[k].split(".")[1] for k in MODULES if k[1] in {ATTRIBUTES[t] for t in lora.targets}})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None}


def base_family(base: str) -> str | None:
    """The model_type of the base model's config.json where `base` is a local Hugging Face folder (None: a hub
    name, a jaxformer run directory, or no readable config)."""
    try:
        d = json.loads((Path(base) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d.get("model_type") if isinstance(d, dict) and isinstance(d.get("model_type"), str) else None


def write_adapter(model, path: str | Path, base: str, *, family: str | None = None, dtype: str = "float32") -> dict:
    """Write `model`'s adapters into the empty folder `path` (an export's staging folder, `hf.staging`):
    adapter_config.json (`adapter_config`) and adapter_model.safetensors, its tensors in `dtype` (float32 |
    bfloat16 | float16). -> the adapter config written."""
    from safetensors.numpy import save_file
    config = adapter_config(model, base, family)
    if dtype not in DTYPES:
        raise HFError(f"dtype={dtype!r}: expected float32, bfloat16 or float16")
    path = Path(path)
    tensors = {k: v.astype(DTYPES[dtype]) for k, v in adapter_tensors(model).items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    return config
