"""Hugging Face `config.json` <-> `ModelConfig`, per family: Llama, Qwen2, Qwen3, Mistral, GPT-2, Gemma.

Every key of a checkpoint's config is read, accepted as changing nothing (`ACCEPTED`: metadata, token ids, dropout,
kernel selection, other frameworks' hints, each with its reason), or refused: a config using anything the model
does not support raises HFError listing those keys, so a checkpoint is never loaded approximately. Values that
transformers itself maps are mapped the same way (Gemma 1's hidden_act "gelu" runs as the tanh GELU). Keys a file
omits take the family's transformers default.
"""
from __future__ import annotations

import math

from jaxformer.config import (AttentionConfig, ConfigError, ModelConfig, NormConfig, RopeConfig, RuntimeConfig,
                              flat_items)
from jaxformer.errors import JaxformerError


class HFError(JaxformerError, ValueError):
    """A Hugging Face checkpoint cannot be imported or a model cannot be exported: an unsupported config key,
    a missing, unexpected or misshapen tensor, an unreadable file; the message says which."""
    label = "hugging face checkpoint error"


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma": "GemmaForCausalLM"}

# Keys accepted without changing the function the model computes, each with the reason (README's table
# "hf_keys" renders this). Anything a config carries that is neither read nor here is refused, by name.
_REASONS = {
    "file": "describes the file, not the model",
    "tokens": "a token id: the tokenizer's business, not the network's",
    "training": "training only (dropout, initialisation, loss options): no effect on the logits",
    "runtime": "selects a kernel, cache or runtime path in transformers: the same function",
    "foreign": "another framework's hint; transformers does not read it",
    "legacy": "legacy metadata transformers ignores",
    "heads": "task heads or encoder-decoder wiring a causal LM does not build",
}
ACCEPTED = {k: _REASONS[why] for why, keys in {
    "file": ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "name_or_path",
             "_name_or_path", "tokenizer_class", "_attn_implementation_autoset", "return_dict",
             "output_attentions", "output_hidden_states"),
    "tokens": ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id"),
    "training": ("initializer_range", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "summary_first_dropout", "problem_type"),
    "runtime": ("use_cache", "pretraining_tp", "attn_implementation", "_attn_implementation",
                "reorder_and_upcast_attn", "chunk_size_feed_forward"),
    "foreign": ("is_llama_config", "rope_interleaved", "transformers.js_config", "unsloth_fixed", "unsloth_version"),
    "legacy": ("n_special", "predict_special_tokens", "task_specific_params"),
    "heads": ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "id2label",
              "label2id", "tie_encoder_decoder", "is_encoder_decoder"),
}.items() for k in keys}
# keys accepted only at the value that changes nothing (another value is refused, naming the key)
ACCEPTED_AT = {"use_mrope": (False, "Qwen2.5's text models write use_mrope: false (multimodal RoPE off)")}

# the transformers defaults of the keys read (a config.json may omit a key at its default)
_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                    max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28, layer_types=None),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None),
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  hidden_activation=None, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  attention_bias=False, use_bidirectional_attention=None),
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
                 n_ctx=None),
}
_ROPE_KEYS = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings"}
_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu_tanh"}


class _Reader:
    """A config dict read key by key: what was read, what was refused, and the keys nobody read."""

    def __init__(self, family: str, d: dict):
        self.family, self.d, self.read, self.refused = family, d, set(), []

    def __call__(self, key: str):
        self.read.add(key)
        return self.d.get(key, _DEFAULTS[self.family].get(key))

    def need(self, key: str, ok, what: str) -> None:
        """Refuse (later, with every other refusal) a value of `key` that `ok` rejects; `what` says why."""
        if not ok(self(key)):
            self.refused.append(f"{key}={self(key)!r} ({what})")

    def unread(self) -> list[str]:
        return sorted(k for k in self.d if k not in self.read and k not in ACCEPTED and k not in _ROPE_KEYS)


def _rope(d: dict, max_len: int) -> dict:
    """model.rope's fields (RopeConfig keywords) from rope_parameters (transformers 5) or rope_theta +
    rope_scaling (older)."""
    params = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        params = {**dict(d["rope_scaling"]), **params}
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if d.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("unsupported config: partial_rotary_factor != 1 (RoPE over part of each head)")
    out = {"base": float(theta)}
    if kind == "default":
        known = set()
    elif kind == "linear":
        out.update(scaling="linear", factor=float(params["factor"]))
        known = {"factor"}
    elif kind == "llama3":
        out.update(scaling="llama3", factor=float(params["factor"]),
                   original_max_len=int(params["original_max_position_embeddings"]),
                   low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]))
        known = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    elif kind == "yarn":
        out.update(_yarn(params, d, max_len))
        known = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
                 "mscale_all_dim", "truncate"}
    else:
        raise HFError(f"unsupported config: rope type {kind!r} (supported: default, linear, llama3, yarn)")
    extra = sorted(set(params) - known)
    if extra:
        raise HFError(f"unsupported config: rope parameters {extra} of rope type {kind!r}")
    return out


def _yarn(params: dict, d: dict, max_len: int) -> dict:
    """YaRN's RopeConfig fields, as transformers' _compute_yarn_parameters reads them: the original context defaults
    to max_position_embeddings, the factor to max_position_embeddings / original, the attention factor to
    mscale / mscale_all_dim's ratio of 0.1·m·ln(factor) + 1 when both are given (else 0: derived from factor)."""
    original = int(d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_len)
    factor = float(params.get("factor") or max_len / original)
    af = params.get("attention_factor")
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if af is None and m and m_all and factor > 1:
        af = (0.1 * m * math.log(factor) + 1.0) / (0.1 * m_all * math.log(factor) + 1.0)
    return dict(scaling="yarn", factor=factor, original_max_len=original,
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                attention_factor=float(af or 0.0), truncate=bool(params.get("truncate", True)))


def family_of(d: dict) -> str:
    family = d.get("model_type")
    if family not in FAMILIES:
        raise HFError(f"unsupported model_type {family!r} (supported: {', '.join(FAMILIES)})")
    return family


def to_model_config(d: dict, dtype: str = "float32") -> ModelConfig:
    """A checkpoint's config.json (a dict) -> the decoder-only ModelConfig computing the same function.
    HFError for a family or a setting the model does not support (naming the keys)."""
    family = family_of(d)
    r = _Reader(family, d)
    kw = _gpt2(r) if family == "gpt2" else _rope_family(family, r, d)
    norm, rope, attention = kw.pop("norm"), kw.pop("rope", {}), kw.pop("attention", {})
    tie, vocab = r("tie_word_embeddings"), r("vocab_size")
    for key, (value, _) in ACCEPTED_AT.items():
        if key in d:
            r.need(key, lambda v, want=value: v == want, f"only {value!r} changes nothing")
    unread = r.unread()
    if r.refused or unread:
        raise HFError(f"unsupported {family} config: " + "; ".join(r.refused + [f"{k} (unknown key)" for k in unread]))
    try:
        return ModelConfig(arch="decoder_only", vocab_size=vocab, num_encoder_layers=0, tie_embeddings=bool(tie),
                           pad_id=-1, norm=NormConfig(position="pre", final=True, **norm), rope=RopeConfig(**rope),
                           attention=AttentionConfig(**attention), runtime=RuntimeConfig(dropout=0.0, dtype=dtype),
                           **kw)
    except ConfigError as e:
        raise HFError(f"the {family} config maps to an invalid model config: {e}") from None


def _gpt2(r: _Reader) -> dict:
    """GPT-2's config read into ModelConfig keywords (its sections as dicts)."""
    dm, heads = r("n_embd"), r("n_head")
    r.need("activation_function", lambda v: v in ("gelu_new", "gelu", "gelu_pytorch_tanh"), "GELU kinds only")
    r.need("scale_attn_weights", lambda v: v is True, "unscaled attention")
    r.need("scale_attn_by_inverse_layer_idx", lambda v: not v, "per-layer attention scaling")
    r.need("add_cross_attention", lambda v: not v, "cross-attention")
    r("n_ctx")
    return dict(d_model=dm, num_heads=heads, d_ff=r("n_inner") or 4 * dm, num_decoder_layers=r("n_layer"),
                max_len=r("n_positions"), positional="learned",
                activation={"gelu": "gelu"}.get(r("activation_function"), "gelu_tanh"), use_bias=True,
                scale_embeddings=False, norm=dict(type="layernorm", eps=float(r("layer_norm_epsilon"))))


def _rope_family(family: str, r: _Reader, d: dict) -> dict:
    """A Llama-like family's config (llama, qwen2, qwen3, mistral, gemma) read into ModelConfig keywords."""
    dm, heads = r("hidden_size"), r("num_attention_heads")
    want = "gelu_pytorch_tanh" if family == "gemma" else "silu"
    # Gemma 1's published files say hidden_act "gelu", which transformers (GemmaConfig) runs as the tanh GELU
    act = lambda: {"gelu": want}.get(r("hidden_act"), r("hidden_act")) if family == "gemma" else r("hidden_act")  # noqa: E731
    r.need("hidden_act", lambda v: act() in ((want, "gelu_new") if family == "gemma" else (want,)),
           f"{family} supports {want}")
    if family == "gemma":
        r.need("hidden_activation", lambda v: v in (None, r("hidden_act"), act()), "hidden_act is what transformers runs")
    attention = {"qk_norm": family == "qwen3"}
    kw = dict(d_model=dm, num_heads=heads, num_kv_heads=r("num_key_value_heads"), d_ff=r("intermediate_size"),
              num_decoder_layers=r("num_hidden_layers"), max_len=r("max_position_embeddings"), positional="rope",
              activation=_ACTIVATIONS[want], use_bias=False, scale_embeddings=family == "gemma",
              norm=dict(type="rmsnorm", eps=float(r("rms_norm_eps"))), rope=_rope(d, r("max_position_embeddings")), attention=attention)
    if family != "qwen2":
        hd = r("head_dim")
        kw["head_dim"] = None if hd is None or hd * heads == dm else hd
    biases = []
    if family in ("llama", "qwen3", "gemma") and r("attention_bias"):
        biases += ["q", "k", "v", "o"]
    if family == "qwen2":
        biases += ["q", "k", "v"]
    if family == "llama" and r("mlp_bias"):
        biases += ["ffn"]
    kw["biases"] = tuple(biases)
    if family in ("qwen2", "qwen3"):
        windows = _qwen_windows(r)
        if any(windows):
            attention["windows"] = windows
    if family == "mistral" and r("sliding_window"):
        attention["windows"] = (int(r("sliding_window")),)
    if family == "gemma":
        r.need("use_bidirectional_attention", lambda v: not v, "bidirectional attention")
    return kw


def _qwen_windows(r: _Reader) -> tuple[int, ...]:
    """Each layer's window (0 = full attention) as transformers' Qwen2/Qwen3 configs decide them: layer_types when
    given, else sliding from layer max_window_layers on when use_sliding_window; sliding_window counts only then."""
    layers, window, k = r("num_hidden_layers"), r("sliding_window"), r("max_window_layers")
    window = window if r("use_sliding_window") else None
    types = r("layer_types") or ["sliding_attention" if window is not None and i >= k else "full_attention"
                                 for i in range(layers)]
    r.need("layer_types", lambda v: set(types) <= {"full_attention", "sliding_attention"} and len(types) == layers,
           "full_attention / sliding_attention, one per layer")
    return tuple(int(window) if t == "sliding_attention" and window else 0 for t in types)


def _qwen_split(windows: tuple[int, ...]) -> int | None:
    """k when `windows` is k full-attention layers then one window over the rest (what a Qwen config says with
    max_window_layers), else None."""
    k = next((i for i, w in enumerate(windows) if w), len(windows))
    rest = set(windows[k:])
    return k if len(rest) == 1 and 0 not in rest else None


def family_for(cfg: ModelConfig) -> str:
    """The family whose config.json expresses `cfg` (HFError naming the switch that none can)."""
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


_RESPELLED = ("pad_id", "use_bias", "biases", "num_kv_heads", "head_dim", "norm.final", "attention.windows")
_ROPE_SCALING = {"none": (), "linear": ("rope.factor",),
                 "llama3": ("rope.factor", "rope.original_max_len", "rope.low_freq_factor", "rope.high_freq_factor"),
                 "yarn": ("rope.factor", "rope.original_max_len", "rope.beta_fast", "rope.beta_slow",
                          "rope.attention_factor", "rope.truncate")}


def function_of(cfg: ModelConfig) -> dict:
    """The fields of `cfg` that decide the function its model computes, each in one spelling: the projections
    with a bias, K and H, the final norm, each layer's window; RoPE's settings only where they apply, MoE's
    only for an MoE model (model.runtime is not the function). Two configs with equal function_of compute the
    same logits from the same weights."""
    d = {k: v for k, v in flat_items(cfg).items() if not k.startswith("runtime.") and k not in _RESPELLED}
    d.update(biases=tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b)), kv_heads=cfg.kv_heads,
             head_size=cfg.head_size, final_norm=cfg.use_final_norm, windows=cfg.layer_windows())
    rope = ("rope.base", "rope.scaling") + _ROPE_SCALING.get(cfg.rope.scaling, ())
    for k in [k for k in d if k.startswith("rope.") and (cfg.positional != "rope" or k not in rope)]:
        del d[k]
    if cfg.ffn != "moe":
        for k in [k for k in d if k.startswith("moe.")]:
            del d[k]
    if cfg.arch == "decoder_only":
        del d["num_encoder_layers"]
    return d


def expresses(cfg: ModelConfig, family: str) -> list[str]:
    """What `family`'s config.json cannot say of `cfg`: `cfg` is written as that family's config and read back
    as transformers would run it, and every field whose function differs is named (empty: it expresses cfg)."""
    try:
        back = to_model_config(to_hf_config(cfg, family), cfg.runtime.dtype)
    except HFError as e:
        return [str(e)]
    ours, theirs = function_of(cfg), function_of(back)
    return [f"model.{k}={ours.get(k)!r} (a {family} config gives {theirs.get(k)!r})"
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
    """`cfg` as `family`'s config.json (a dict; token ids and dtype are the caller's)."""
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
           "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm.eps,
           "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "attention_dropout": 0.0}
    out["hidden_act"] = "gelu_pytorch_tanh" if family == "gemma" else "silu"
    if family in ("llama", "qwen3", "gemma"):
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


def accepted_keys_table() -> str:
    """ACCEPTED and ACCEPTED_AT as a markdown table (the README's "hf_keys" block)."""
    by_reason: dict[str, list[str]] = {}
    for key, why in ACCEPTED.items():
        by_reason.setdefault(why, []).append(f"`{key}`")
    rows = [f"| {', '.join(keys)} | {why} |" for why, keys in by_reason.items()]
    rows += [f"| `{k}` = `{str(v).lower()}` only | {why} |" for k, (v, why) in ACCEPTED_AT.items()]
    return "\n".join(["| config.json keys | accepted because |", "|---|---|", *rows])
