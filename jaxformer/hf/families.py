"""Hugging Face `config.json` <-> `ModelConfig`, per family: Llama, Qwen2, Qwen3, Mistral, GPT-2, Gemma, Gemma 2.

Every key of a checkpoint's config is read, accepted as changing nothing (`ACCEPTED`: metadata, token ids, dropout,
kernel selection, other frameworks' hints, each with its reason), or refused: a config using anything the model
does not support raises HFError listing those keys, so a checkpoint is never loaded approximately. Values that
transformers itself maps are mapped the same way (Gemma 1's hidden_act "gelu" runs as the tanh GELU). Keys a file
omits take the family's transformers default.
"""
from __future__ import annotations

import math

from jaxformer.config import AttentionConfig, ConfigError, ModelConfig, NormConfig, RopeConfig, RuntimeConfig
from jaxformer.errors import JaxformerError


class HFError(JaxformerError, ValueError):
    """A Hugging Face checkpoint cannot be imported or a model cannot be exported: an unsupported config key,
    a missing, unexpected or misshapen tensor, an unreadable file; the message says which.

    A `ValueError` and a `jaxformer.errors.JaxformerError`: the command line prints its message (no traceback)
    and exits with `exit_code`.

    Attributes:
      label: "hugging face checkpoint error", the words the command line prints before the message.
      exit_code: 2, the command line's exit status (inherited from `JaxformerError`).

    Examples:
      >>> from jaxformer.hf import HFError, to_model_config
      >>> try:
      ...     to_model_config({"model_type": "bert"})
      ... except HFError as e:
      ...     print(e)
      unsupported model_type 'bert' (supported: llama, qwen2, qwen3, mistral, gpt2, gemma, gemma2)
      >>> issubclass(HFError, ValueError), HFError.exit_code
      (True, 2)
    """
    label = "hugging face checkpoint error"


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma", "gemma2")
"""The `model_type` values of config.json that `from_pretrained` reads and `save_pretrained` writes: Llama,
Qwen2, Qwen3, Mistral, GPT-2, Gemma and Gemma 2 (each family's `*ForCausalLM` of transformers)."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM"}

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
                "reorder_and_upcast_attn", "chunk_size_feed_forward", "cache_implementation"),
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
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   hidden_act=None, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, layer_types=None,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, use_bidirectional_attention=None),
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
    elif kind == "dynamic":                    # transformers scales from max_position_embeddings itself
        out.update(scaling="dynamic", factor=float(params["factor"]), original_max_len=int(max_len))
        known = {"factor"}
    elif kind == "yarn":
        out.update(_yarn(params, d, max_len))
        known = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
                 "mscale_all_dim", "truncate"}
    else:
        raise HFError(f"unsupported config: rope type {kind!r} (supported: default, linear, llama3, yarn, dynamic)")
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

    Every key is read, accepted as changing nothing (`ACCEPTED`: metadata, token ids, dropout, kernel
    selection), or refused: nothing is ever loaded approximately. Keys the dict omits take the family's
    transformers default.

    Args:
      d: the parsed config.json (`read_config`), its `model_type` one of `FAMILIES`.
      dtype: the compute dtype of the model (`model.runtime.dtype`): "float32", "bfloat16" or "float16".

    Returns:
      The `jaxformer.config.ModelConfig` (arch "decoder_only", no padding id: pad_id -1, no dropout) whose model
        computes transformers' logits for the checkpoint's weights.

    Raises:
      HFError: a `model_type` not in `FAMILIES`; keys the model does not support (an unknown key, another
        activation, partial rotary embeddings, an unknown RoPE type, ...), all of them named in one message;
        values that map to an invalid model config.

    Examples:
      >>> from jaxformer.hf import to_model_config
      >>> cfg = to_model_config({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
      ...                        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      ...                        "max_position_embeddings": 16})
      >>> cfg.arch, cfg.d_model, cfg.num_decoder_layers, cfg.positional, cfg.norm.type, cfg.activation
      ('decoder_only', 16, 1, 'rope', 'rmsnorm', 'swiglu')
      >>> gpt2 = to_model_config({"model_type": "gpt2", "vocab_size": 16, "n_embd": 16, "n_layer": 1,
      ...                         "n_head": 2, "n_positions": 16}, dtype="bfloat16")
      >>> gpt2.positional, gpt2.norm.type, gpt2.tie_embeddings, gpt2.runtime.dtype
      ('learned', 'layernorm', True, 'bfloat16')
      >>> to_model_config({"model_type": "llama", "hidden_act": "relu", "foo": 1})
      Traceback (most recent call last):
      ...
      jaxformer.hf.families.HFError: unsupported llama config: hidden_act='relu' (llama supports silu);
      foo (unknown key)
    """
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
                           pad_id=-1, norm=NormConfig(**{"position": "pre", "final": True, **norm}), rope=RopeConfig(**rope),
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
    gemma = family in ("gemma", "gemma2")
    want = "gelu_pytorch_tanh" if gemma else "silu"
    _activation(family, r, want)
    attention = {"qk_norm": family == "qwen3"}
    kw = dict(d_model=dm, num_heads=heads, num_kv_heads=r("num_key_value_heads"), d_ff=r("intermediate_size"),
              num_decoder_layers=r("num_hidden_layers"), max_len=r("max_position_embeddings"), positional="rope",
              activation=_ACTIVATIONS[want], use_bias=False, scale_embeddings=gemma,
              norm=dict(type="rmsnorm", eps=float(r("rms_norm_eps"))), rope=_rope(d, r("max_position_embeddings")), attention=attention)
    if family != "qwen2":
        hd = r("head_dim")
        kw["head_dim"] = None if hd is None or hd * heads == dm else hd
    biases = []
    if family in ("llama", "qwen3", "gemma", "gemma2") and r("attention_bias"):
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
    if gemma:
        r.need("use_bidirectional_attention", lambda v: not v, "bidirectional attention")
    if family == "gemma2":
        _gemma2(r, kw, attention)
    return kw


def _activation(family: str, r: _Reader, want: str) -> None:
    """Refuse an FFN activation other than the family's. Gemma 1's published files say hidden_act "gelu", which
    transformers (GemmaConfig) runs as the tanh GELU; Gemma 2 runs hidden_activation (hidden_act, where a file
    also has it, must agree)."""
    if family == "gemma2":
        r.need("hidden_activation", lambda v: v == want, f"{family} supports {want}")
        r.need("hidden_act", lambda v: v in (None, want), "hidden_activation is what transformers runs")
        return
    act = lambda: {"gelu": want}.get(r("hidden_act"), r("hidden_act")) if family == "gemma" else r("hidden_act")  # noqa: E731
    r.need("hidden_act", lambda v: act() in ((want, "gelu_new") if family == "gemma" else (want,)),
           f"{family} supports {want}")
    if family == "gemma":
        r.need("hidden_activation", lambda v: v in (None, r("hidden_act"), act()), "hidden_act is what transformers runs")


def _gemma2(r: _Reader, kw: dict, attention: dict) -> None:
    """Gemma 2 on top of Gemma: sandwich norms (a norm after each sublayer too), attention-logit and final-logit
    soft-capping, sliding windows on the layers layer_types names (default: every other one, from layer 0), and
    the attention scale 1/sqrt(query_pre_attn_scalar)."""
    windows = _layer_windows(r, r("sliding_window"), lambda i: (i + 1) % 2)
    if any(windows):
        attention["windows"] = windows
    attention["softcap"] = float(r("attn_logit_softcapping") or 0.0)
    scalar, head = r("query_pre_attn_scalar"), kw.get("head_dim") or kw["d_model"] // kw["num_heads"]
    attention["scale_dim"] = 0 if scalar == head else int(scalar)
    kw["logit_softcap"] = float(r("final_logit_softcapping") or 0.0)
    kw["norm"]["position"] = "sandwich"


def _qwen_windows(r: _Reader) -> tuple[int, ...]:
    """Each layer's window (0 = full attention) as transformers' Qwen2/Qwen3 configs decide them: layer_types when
    given, else sliding from layer max_window_layers on when use_sliding_window; sliding_window counts only then."""
    window, k = r("sliding_window"), r("max_window_layers")
    window = window if r("use_sliding_window") else None
    return _layer_windows(r, window, lambda i: window is not None and i >= k)


def _layer_windows(r: _Reader, window, sliding_by_default) -> tuple[int, ...]:
    """Each layer's window (0 = full attention): `window` on the layers layer_types calls sliding_attention, or,
    without layer_types, on layer i when sliding_by_default(i); no window when `window` is None or 0."""
    layers = r("num_hidden_layers")
    types = r("layer_types") or ["sliding_attention" if sliding_by_default(i) else "full_attention"
                                 for i in range(layers)]
    r.need("layer_types", lambda v: set(types) <= {"full_attention", "sliding_attention"} and len(types) == layers,
           "full_attention / sliding_attention, one per layer")
    return tuple(int(window) if t == "sliding_attention" and window else 0 for t in types)


def accepted_keys_table() -> str:
    """ACCEPTED and ACCEPTED_AT as a markdown table (the README's "hf_keys" block)."""
    by_reason: dict[str, list[str]] = {}
    for key, why in ACCEPTED.items():
        by_reason.setdefault(why, []).append(f"`{key}`")
    rows = [f"| {', '.join(keys)} | {why} |" for why, keys in by_reason.items()]
    rows += [f"| `{k}` = `{str(v).lower()}` only | {why} |" for k, (v, why) in ACCEPTED_AT.items()]
    return "\n".join(["| config.json keys | accepted because |", "|---|---|", *rows])
