"""SAELens' folder format, read as SAELens itself reads it: cfg.json + sae_weights.safetensors, written by SAELens
6 (`SAE.save_model`, a trainer's checkpoint, `save_inference_model`), by SAELens before 6 (read through SAELens'
own `handle_pre_6_0_config` rules) or by `jaxformer.sae.save_saelens`.

What a folder means is taken from its fields, never from a default: the site and layer from the hook name
(TransformerLens' `blocks.L.hook_resid_post`, `blocks.L.attn.hook_z`, ... or ours, `SITE.L`; SAELens 6 writes
no hook_layer), the architecture from `architecture` (SAELens 5's `activation_fn_str: "topk"` with its
`activation_fn_kwargs.k` is a TopK SAE). Settings that change the SAE's function are folded into its weights
exactly as SAELens computes them, or refused by name (DataError), never ignored:

- `rescale_acts_by_decoder_norm` (SAELens' TopK training default): SAELens encodes with the pre-activations
  times ‖W_dec_i‖ and decodes with the latents divided by them; folded as SAELens' own `fold_W_dec_norm`
  (W_enc·n, b_enc·n, W_dec/n: the same latents and reconstruction, decoder rows of unit norm).
- `apply_b_dec_to_input: false`: the input is not centred before encoding; folded into b_enc (b_enc + b_dec·W_enc).
- `reshape_activations: "hook_z"`: the heads [.., N, H] flattened to N·H (our site z, whose SAEs `jaxformer.sae`
  reads so); required for a z SAE, refused elsewhere.
- jumprelu: its `threshold` [F] (or an older checkpoint's `log_threshold`, exponentiated as SAELens'
  process_state_dict_for_loading does); a BatchTopK SAE SAELens saved for inference is one (architecture jumprelu).
- refused: other architectures (gated, ...), activation normalisation, a fine-tuning scaling factor, a head index,
  a hook name no site of ours answers to.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxformer.errors import DataError

WEIGHTS, CFG = "sae_weights.safetensors", "cfg.json"        # SAELens' file names
HOOKS = {"resid_pre": "blocks.{}.hook_resid_pre", "resid_mid": "blocks.{}.hook_resid_mid",
         "resid_post": "blocks.{}.hook_resid_post", "attn_out": "blocks.{}.hook_attn_out",
         "mlp_out": "blocks.{}.hook_mlp_out", "mlp_hidden": "blocks.{}.mlp.hook_post",
         "z": "blocks.{}.attn.hook_z"}           # our site -> TransformerLens' hook name (the same activation)
ARCHITECTURES = ("topk", "standard", "jumprelu")
_OURS = re.compile(r"^((?:encoder\.)?[a-z_]+)\.(\d+)$")             # SITE.L: our name where TL has none
_TL = {re.compile("^" + re.escape(h).replace(r"\{\}", r"(\d+)") + "$"): s for s, h in HOOKS.items()}


def hook_name(site: str, layer: int) -> str:
    """TransformerLens' name of a site's activation at `layer` where it has one (blocks.L.hook_resid_post,
    blocks.L.attn.hook_z, ...), else SITE.L."""
    return HOOKS[site].format(layer) if site in HOOKS else f"{site}.{layer}"


def parse_hook(hook: str) -> tuple[str, int]:
    """A hook name (`hook_name`'s either form) -> (site, layer). ValueError for a name neither form reads."""
    for pattern, site in _TL.items():
        m = pattern.match(hook)
        if m:
            return site, int(m.group(1))
    m = _OURS.match(hook)
    if m and m.group(1) not in ("blocks", "hook"):
        return m.group(1), int(m.group(2))
    raise ValueError(f"hook {hook!r} names no site jaxformer has (TransformerLens' names it reads: "
                     f"{sorted(h.format('L') for h in HOOKS.values())}, or SITE.L)")


def as_v6(cfg: dict) -> dict:
    """A cfg.json of SAELens before 6 in SAELens 6's terms, by SAELens' own rules (`handle_pre_6_0_config`:
    renamed keys, the hook under metadata, topk from activation_fn_str, a boolean normalize_activations);
    a 6 config unchanged."""
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    if version and _major(version) >= 6:
        return cfg
    renamed = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}
    new = {renamed.get(k, k): v for k, v in cfg.items()}
    new.setdefault("architecture", "standard")
    new.setdefault("apply_b_dec_to_input", True)
    kwargs = new.get("activation_fn_kwargs") or {}
    if new.get("activation_fn") == "topk" and kwargs.get("k") is not None:
        new["architecture"], new["k"] = "topk", kwargs["k"]
    elif new.get("activation_fn", "relu") != "relu":
        raise ValueError(f"activation_fn={new['activation_fn']!r} (only relu, or topk with activation_fn_kwargs.k)")
    norm = new.get("normalize_activations")
    new["normalize_activations"] = ("expected_average_only_in" if norm is True else "none") \
        if isinstance(norm, bool) or norm is None else norm
    new.setdefault("reshape_activations", "hook_z" if "hook_z" in str(new.get("hook_name", "")) else "none")
    new["metadata"] = {**(new.get("metadata") or {}), "hook_name": new.get("hook_name"),
                       "hook_head_index": new.get("hook_head_index")}
    return new


def _major(version: str) -> int:
    m = re.match(r"\s*(\d+)", str(version))
    return int(m.group(1)) if m else 0


def read_folder(path: str | Path) -> tuple[dict, dict, dict]:
    """(cfg in SAELens 6's terms, weights as float32 NumPy arrays, the site fields: site, layer, architecture,
    k, d_in, d_sae) of an SAELens folder, its settings folded into the weights (module docstring). DataError
    naming the file and what is missing, unreadable or unsupported."""
    path = Path(path)
    if not (path / CFG).is_file() or not (path / WEIGHTS).is_file():
        raise DataError(f"{path}: an SAELens folder holds {CFG} and {WEIGHTS}")
    try:
        cfg = json.loads((path / CFG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path / CFG}: not a JSON file ({e})") from None
    try:
        if not isinstance(cfg, dict):
            raise ValueError(f"a JSON object is expected, not {type(cfg).__name__}")
        cfg = as_v6(cfg)
        fields = _fields(cfg)
    except (KeyError, TypeError, ValueError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise DataError(f"{path / CFG}: not an SAE jaxformer can read as SAELens does ({why})") from None
    weights = _weights(path / WEIGHTS, fields)
    return cfg, _folded(weights, cfg), fields


def _fields(cfg: dict) -> dict:
    architecture = cfg.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not one of {ARCHITECTURES}")
    meta = cfg.get("metadata") or {}
    for key, ok in (("normalize_activations", "none"), ("finetuning_scaling_factor", False)):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"{key}={cfg[key]!r} is not supported (only {ok!r})")
    if meta.get("hook_head_index", cfg.get("hook_head_index")) is not None:
        raise ValueError("hook_head_index is set: an SAE on one head's slice is not supported")
    if cfg.get("rescale_acts_by_decoder_norm") and architecture != "topk":
        raise ValueError("rescale_acts_by_decoder_norm outside a topk SAE is not SAELens' own")
    hook = meta.get("hook_name") or cfg.get("hook_name")
    if not isinstance(hook, str):
        raise ValueError("metadata.hook_name is missing: the folder does not say which activation it reads")
    site, layer = parse_hook(hook)
    reshape = cfg.get("reshape_activations", "none")
    if (reshape == "hook_z") != (site.rsplit(".", 1)[-1] in ("z", "cross_z")):
        raise ValueError(f"reshape_activations={reshape!r} with hook {hook!r}: heads are flattened (hook_z) for z "
                         f"and only for z")
    k = cfg["k"] if architecture == "topk" else None
    return {"site": site, "layer": layer, "architecture": architecture, "d_in": cfg["d_in"], "d_sae": cfg["d_sae"],
            **({"k": k} if k is not None else {})}


def _weights(file: Path, fields: dict) -> dict:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(file), framework="flax") as f:         # flax: bfloat16 too, which NumPy cannot hold
            weights = {n: np.asarray(f.get_tensor(n), np.float32) for n in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise DataError(f"{file}: not a readable safetensors file ({e})") from None
    d_in, d_sae = fields["d_in"], fields["d_sae"]
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if fields["architecture"] == "jumprelu":
        shapes["threshold"] = (d_sae,)
        if "threshold" not in weights and "log_threshold" in weights:
            weights["threshold"] = np.exp(weights.pop("log_threshold"))
    for name, shape in shapes.items():
        if name not in weights or weights[name].shape != shape:
            got = weights[name].shape if name in weights else "missing"
            raise DataError(f"{file}: {name} should be {shape}, got {got}")
    scale = weights.get("scaling_factor", weights.get("finetuning_scaling_factor"))
    if scale is not None and not np.allclose(scale, 1.0):
        raise DataError(f"{file}: a scaling factor other than 1 (SAELens' finetuning_scaling_factor) is not "
                        f"supported")
    return {n: weights[n] for n in shapes}


def _folded(w: dict, cfg: dict) -> dict:
    """The weights with apply_b_dec_to_input=false and rescale_acts_by_decoder_norm folded in (module docstring),
    float32, computed in float64."""
    w = {n: v.astype(np.float64) for n, v in w.items()}
    if not cfg.get("apply_b_dec_to_input", True):
        w["b_enc"] = w["b_enc"] + w["b_dec"] @ w["W_enc"]
    if cfg.get("rescale_acts_by_decoder_norm"):
        n = np.maximum(np.linalg.norm(w["W_dec"], axis=-1), 1e-8)        # SAELens' get_W_dec_norm
        w = {**w, "W_enc": w["W_enc"] * n, "b_enc": w["b_enc"] * n, "W_dec": w["W_dec"] / n[:, None]}
    return {n: jnp.asarray(v, jnp.float32) for n, v in w.items()}


def check_ours(path: Path, fields: dict, ours) -> dict:
    """Our own settings (cfg.json's "jaxformer" entry) without what the SAELens fields already say; DataError
    when they disagree about what the SAE reads."""
    if not isinstance(ours, dict):
        return {}
    for key in ("site", "layer", "architecture", "d_in", "d_sae", "k"):
        if key in ours and key in fields and ours[key] != fields[key]:
            raise DataError(f"{path / CFG}: jaxformer.{key}={ours[key]!r} disagrees with the SAELens fields "
                            f"({key} {fields[key]!r}); the folder was edited by hand")
    return {k: v for k, v in ours.items() if k not in fields and k != "k"}
