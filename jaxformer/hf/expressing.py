"""Which Hugging Face family expresses a model, and the model as that family's `config.json` (the export side of
`jaxformer.hf.families`, which reads config.json): a family is chosen, or a forced one accepted, only when writing
the model as its config and reading that back gives the same function (`expresses`).
"""
from __future__ import annotations

from jaxformer.config import ModelConfig, flat_items
from jaxformer.hf.families import ARCHITECTURES, FAMILIES, HFError, to_model_config


def _gemma2_for(cfg: ModelConfig) -> str:
    """"gemma2" for a sandwich-norm model Gemma 2 expresses, else HFError naming what it cannot."""
    biases = tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b))
    problems = [f"model.{k}={v!r}" for k, v, ok in (
        ("arch", cfg.arch, cfg.arch == "decoder_only"), ("norm.final", cfg.norm.final, cfg.use_final_norm),
        ("norm.type", cfg.norm.type, cfg.norm.type == "rmsnorm"), ("positional", cfg.positional, cfg.positional == "rope"),
        ("activation", cfg.activation, cfg.activation == "geglu_tanh"), ("ffn", cfg.ffn, cfg.ffn == "dense"),
        ("scale_embeddings", cfg.scale_embeddings, cfg.scale_embeddings), ("attention.scale", cfg.attention.scale,
                                                                            cfg.attention.scale == "rsqrt"),
        ("attention.qk_norm", cfg.attention.qk_norm, not cfg.attention.qk_norm), ("ablation", cfg.ablations,
                                                                                   not cfg.ablations),
        ("biases", biases, biases in ((), ("q", "k", "v", "o"))),
        ("attention.windows", cfg.attention.windows, len(set(cfg.layer_windows()) - {0}) <= 1)) if not ok]
    if problems:
        raise HFError(f"sandwich norms export as Gemma 2 only, which cannot express {', '.join(problems)}")
    return "gemma2"


def _gemma2_config(cfg: ModelConfig, out: dict) -> None:
    """Gemma 2's keys of `cfg` added to its config.json dict `out`."""
    windows = cfg.layer_windows()
    out.pop("hidden_act")
    out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg.attention.scale_dim or cfg.head_size,
               sliding_window=max(windows) or 4096,
               layer_types=["sliding_attention" if w else "full_attention" for w in windows],
               attn_logit_softcapping=cfg.attention.softcap or None, final_logit_softcapping=cfg.logit_softcap or None)


def _qwen_split(windows: tuple[int, ...]) -> int | None:
    """k when `windows` is k full-attention layers then one window over the rest (what a Qwen config says with
    max_window_layers), else None."""
    k = next((i for i, w in enumerate(windows) if w), len(windows))
    rest = set(windows[k:])
    return k if len(rest) == 1 and 0 not in rest else None


def family_for(cfg: ModelConfig) -> str:
    """The family whose config.json expresses `cfg`: the one `save_pretrained` writes when no family is given.

    Decided from the switches that set the families apart: learned positions with layernorm are GPT-2;
    sandwich norms are Gemma 2; RoPE with RMSNorm is Gemma (GeGLU, scaled embeddings), Mistral (one sliding
    window over every layer), Qwen3 (QK-norm), Qwen2 (q, k, v biases) or Llama (the rest).

    Args:
      cfg: a `jaxformer.config.ModelConfig` (a model's `model.cfg`).

    Returns:
      One of `FAMILIES`, e.g. "llama".

    Raises:
      HFError: no family expresses `cfg` (an encoder-decoder, post-norm, an ablation, another positional
        encoding or activation, a bias or window pattern no family has, ...), naming the switch that none can.

    Examples:
      >>> from jaxformer.config import replaced
      >>> from jaxformer.hf import family_for, to_model_config
      >>> cfg = to_model_config({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
      ...                        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...                        "max_position_embeddings": 16})
      >>> family_for(cfg), family_for(replaced(cfg, attention__qk_norm=True)), family_for(replaced(cfg,
      ...                                                                       attention__windows=(8,)))
      ('llama', 'qwen3', 'mistral')
      >>> family_for(replaced(cfg, norm__position="post"))
      Traceback (most recent call last):
      ...
      jaxformer.hf.families.HFError: no Hugging Face family expresses model.norm.position='post'
    """
    if cfg.norm.position == "sandwich":
        return _gemma2_for(cfg)
    problems = []
    for field, value, ok in (("arch", cfg.arch, cfg.arch == "decoder_only"),
                             ("norm.position", cfg.norm.position, cfg.norm.position == "pre"),
                             ("norm.final", cfg.norm.final, cfg.use_final_norm), ("ffn", cfg.ffn, cfg.ffn == "dense"),
                             ("attention.scale", cfg.attention.scale, cfg.attention.scale == "rsqrt"),
                             ("ablation", cfg.ablations, not cfg.ablations),
                             ("logit_softcap", cfg.logit_softcap, not cfg.logit_softcap),
                             ("attention.softcap", cfg.attention.softcap, not cfg.attention.softcap)):
        if not ok:
            problems.append(f"model.{field}={value!r}")
    if problems:
        raise HFError(f"no Hugging Face family expresses {', '.join(problems)}")
    if cfg.positional == "learned":
        if (cfg.norm.type, cfg.activation, cfg.tie_embeddings, cfg.scale_embeddings, cfg.attention.qk_norm) == \
                ("layernorm", "gelu_tanh", True, False, False) and cfg.biases in (None, ("q", "k", "v", "o", "ffn")) \
                and cfg.use_bias and cfg.kv_heads == cfg.num_heads and cfg.head_dim is None \
                and not any(cfg.attention.windows):
            return "gpt2"
        raise HFError("learned positions export as GPT-2 only: layernorm, gelu_tanh, tied, every bias, MHA")
    if cfg.positional != "rope" or cfg.norm.type != "rmsnorm":
        raise HFError(f"model.positional={cfg.positional!r} with model.norm.type={cfg.norm.type!r}: no Hugging "
                      f"Face family (rope + rmsnorm, or GPT-2's learned + layernorm)")
    biases = tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b))
    windows = set(cfg.layer_windows())
    if cfg.activation == "geglu_tanh" and cfg.scale_embeddings and not cfg.attention.qk_norm and windows == {0} \
            and biases in ((), ("q", "k", "v", "o")):
        return "gemma"
    if cfg.activation != "swiglu" or cfg.scale_embeddings:
        raise HFError(f"model.activation={cfg.activation!r} (scale_embeddings={cfg.scale_embeddings}): no family")
    qwen = cfg.attention.qk_norm or biases == ("q", "k", "v")
    if len(windows) == 1 and windows != {0} and not biases and not cfg.attention.qk_norm:
        return "mistral"
    if windows != {0} and not (qwen and _qwen_split(cfg.layer_windows()) is not None):
        raise HFError(f"model.attention.windows={cfg.attention.windows!r}: no family (Mistral: one window over every "
                      f"layer, no biases, no QK-norm; Qwen2/Qwen3: full attention in the first k layers, one window "
                      f"after them)")
    if cfg.attention.qk_norm:
        if biases in ((), ("q", "k", "v", "o")):
            return "qwen3"
        raise HFError("QK-norm exports as Qwen3: all attention biases or none")
    if biases == ("q", "k", "v"):
        return "qwen2"
    if biases in ((), ("q", "k", "v", "o"), ("ffn",), ("q", "k", "v", "o", "ffn")):
        return "llama"
    raise HFError(f"biases {biases}: no family (Qwen2: q, k, v; Llama: attention and/or FFN)")


# The export check (`function_of`, `expresses`) compares every ModelConfig field (its key under model.) as it is,
# except those these tables classify: so a field added later (a research variant) and set away from its default
# is refused by every export with no edit here, until a family learns to write it.
# compared in one spelling (function_of's key), whichever way the config says it
RESPELLED = {"num_kv_heads": "kv_heads", "head_dim": "head_size", "use_bias": "biases", "biases": "biases",
             "norm.final": "final_norm", "attention.windows": "windows", "attention.scale_dim": "attention_scale_dim"}
_ROPE_SCALING = {"none": (), "linear": ("rope.factor",),
                 "llama3": ("rope.factor", "rope.original_max_len", "rope.low_freq_factor", "rope.high_freq_factor"),
                 "yarn": ("rope.factor", "rope.original_max_len", "rope.beta_fast", "rope.beta_slow",
                          "rope.attention_factor", "rope.truncate"),
                 "dynamic": ("rope.factor", "rope.original_max_len")}


def _rope_uses(key: str):
    return lambda c: c.positional == "rope" and (key in ("rope.base", "rope.scaling")
                                                 or key in _ROPE_SCALING.get(c.rope.scaling, ()))


# compared only where the model uses them (elsewhere they change nothing)
APPLIES = {"num_encoder_layers": lambda c: c.arch == "encoder_decoder",
           **{f"rope.{k}": _rope_uses(f"rope.{k}") for k in ("base", "scaling", "factor", "original_max_len",
                                                            "low_freq_factor", "high_freq_factor", "beta_fast",
                                                            "beta_slow", "attention_factor", "truncate")},
           **{f"moe.{k}": (lambda c: c.ffn == "moe") for k in ("num_experts", "top_k", "every")}}
_RUNTIME = "model.runtime: how the model runs, not what its weights compute (ModelConfig.function)"
_LORA = "the adapters are merged into the weights they adapt before the export (nn.lora.merged)"
# change nothing in the exported model, each with the reason
UNCHANGED = {"pad_id": "the tokenizer's padding id: masks come from segment ids, never from it",
             **{f"runtime.{k}": _RUNTIME for k in ("dtype", "param_dtype", "kv_cache_dtype", "attention_backend",
                                                   "attention_block", "remat", "dropout", "init",
                                                   "moe_capacity_factor", "moe_dropless")},
             **{f"lora.{k}": _LORA for k in ("rank", "alpha", "dropout", "targets", "base")}}


def function_of(cfg: ModelConfig) -> dict:
    """The fields of `cfg` that decide the function its model computes, each in one spelling: every field but
    those that change nothing (UNCHANGED) or do not apply to this model (APPLIES), the respelled ones (RESPELLED)
    as the projections with a bias, K and H, the final norm, each layer's window. A field no table names is kept
    as it is. Two configs with equal function_of compute the same logits from the same weights."""
    d = {k: v for k, v in flat_items(cfg).items()
         if k not in UNCHANGED and k not in RESPELLED and APPLIES.get(k, lambda c: True)(cfg)}
    d.update(biases=tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b)), kv_heads=cfg.kv_heads,
             head_size=cfg.head_size, final_norm=cfg.use_final_norm, windows=cfg.layer_windows(),
             attention_scale_dim=cfg.attention.scale_dim or cfg.head_size)
    if cfg.width_mult == 1.0:                       # µP at its base width is SP (`jaxformer.mup`)
        d.update(parametrization="sp", base_width=0)
    return d


def expresses(cfg: ModelConfig, family: str) -> list[str]:
    """What `family`'s config.json cannot say of `cfg`: `cfg` is written as that family's config and read back
    as transformers would run it, and every field whose function differs is named (empty: it expresses cfg)."""
    try:
        back = to_model_config(to_hf_config(cfg, family), cfg.runtime.dtype)
    except HFError as e:
        return [str(e)]
    ours, theirs = function_of(cfg), function_of(back)
    return [f"model.{k}={ours.get(k)!r} (a {family} config gives {theirs.get(k)!r})" if k in theirs else
            f"model.{k}={ours.get(k)!r} (a {family} config cannot say it)"
            for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]


def check_family(cfg: ModelConfig, family: str) -> None:
    """HFError unless `family` expresses `cfg` exactly (`expresses`): a forced family is held to the same test
    as the one chosen by `family_for`."""
    if family not in FAMILIES:
        raise HFError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    problems = expresses(cfg, family)
    if problems:
        ok = [f for f in FAMILIES if not expresses(cfg, f)]
        raise HFError(f"the {family} family cannot express this model, exporting it would write another model: "
                      + "; ".join(problems) + (f" (families that can: {', '.join(ok)})" if ok else
                                               " (no family can)"))


def to_hf_config(cfg: ModelConfig, family: str) -> dict:
    """`cfg` as `family`'s config.json (a dict; token ids and dtype are the caller's).

    Only writes the keys: whether `family` says all of `cfg` is `save_pretrained`'s check (`expresses`,
    `check_family`), which refuses an export that would write another model.

    Args:
      cfg: a `jaxformer.config.ModelConfig`.
      family: one of `FAMILIES` (`family_for(cfg)` chooses one that expresses `cfg`).

    Returns:
      The config.json dict: "model_type", "architectures" (transformers' class, e.g. ["LlamaForCausalLM"]) and
        the family's keys for the sizes, norm, RoPE, biases and windows, without "torch_dtype" or token ids.

    Raises:
      HFError: family "qwen2" for a model whose heads are not D wide together (N·H != D: Qwen2 has no head_dim).
      KeyError: a family not in `FAMILIES`.

    Examples:
      >>> from jaxformer.hf import to_hf_config, to_model_config
      >>> cfg = to_model_config({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
      ...                        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...                        "max_position_embeddings": 16})
      >>> hf = to_hf_config(cfg, "llama")
      >>> hf["architectures"], hf["hidden_size"], hf["num_key_value_heads"], hf["head_dim"], hf["hidden_act"]
      (['LlamaForCausalLM'], 16, 2, 8, 'silu')
      >>> back = to_model_config(hf)                     # read back as `from_pretrained` reads it
      >>> back.d_model, back.kv_heads, back.head_size
      (16, 2, 8)
    """
    if family == "gpt2":
        return {"model_type": "gpt2", "architectures": [ARCHITECTURES[family]], "vocab_size": cfg.vocab_size,
                "n_positions": cfg.max_len, "n_embd": cfg.d_model, "n_layer": cfg.num_decoder_layers,
                "n_head": cfg.num_heads, "n_inner": cfg.d_ff, "activation_function": "gelu_new",
                "layer_norm_epsilon": cfg.norm.eps, "tie_word_embeddings": True, "scale_attn_weights": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    rope = {"rope_theta": cfg.rope.base, "rope_type": "default" if cfg.rope.scaling == "none" else cfg.rope.scaling}
    if cfg.rope.scaling != "none":
        rope["factor"] = cfg.rope.factor
    if cfg.rope.scaling == "llama3":
        rope.update(original_max_position_embeddings=cfg.rope.original_max_len,
                    low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor)
    if cfg.rope.scaling == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope.original_max_len, beta_fast=cfg.rope.beta_fast,
                    beta_slow=cfg.rope.beta_slow, truncate=cfg.rope.truncate,
                    attention_factor=cfg.rope.attention_factor or None)
    out = {"model_type": family, "architectures": [ARCHITECTURES[family]], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_decoder_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
           "max_position_embeddings": cfg.rope.original_max_len if cfg.rope.scaling == "dynamic" else cfg.max_len,
           "rms_norm_eps": cfg.norm.eps,
           "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "attention_dropout": 0.0}
    out["hidden_act"] = "gelu_pytorch_tanh" if family in ("gemma", "gemma2") else "silu"
    if family == "gemma2":
        _gemma2_config(cfg, out)
    if family in ("llama", "qwen3", "gemma", "gemma2"):
        out["attention_bias"] = cfg.has_bias("o")
    if family == "llama":
        out["mlp_bias"] = cfg.has_bias("ffn")
    if family == "qwen2":
        del out["head_dim"]
        if cfg.head_size * cfg.num_heads != cfg.d_model:
            raise HFError(f"Qwen2 has no head_dim: model.head_dim={cfg.head_dim} (N·H != D) cannot export")
    if family in ("qwen2", "qwen3"):
        k = _qwen_split(cfg.layer_windows())
        out["use_sliding_window"] = k is not None
        if k is not None:
            out.update(sliding_window=cfg.layer_windows()[-1], max_window_layers=k)
    if family == "mistral":
        out["sliding_window"] = cfg.layer_windows()[0] or None       # None: no window (0 would mask everything)
    return out
