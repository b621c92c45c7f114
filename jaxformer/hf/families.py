"""Hugging Face `config.json` <-> `ModelConfig`, per family: Llama, Qwen2, Qwen3, Mistral, GPT-2, Gemma.

Every key of a checkpoint's config is read, known to change nothing (metadata, token ids, dropout rates), or
refused: a config using anything the model does not support raises HFError listing those keys, so a checkpoint
is never loaded approximately. Keys a file omits take the family's transformers default.
"""
from __future__ import annotations

import dataclasses

from jaxformer.config import ConfigError, ModelConfig
from jaxformer.errors import JaxformerError


class HFError(JaxformerError, ValueError):
    """A Hugging Face checkpoint cannot be imported or a model cannot be exported: an unsupported config key,
    a missing, unexpected or misshapen tensor, an unreadable file; the message says which."""
    label = "hugging face checkpoint error"


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma": "GemmaForCausalLM"}

# keys that describe the file or the training run, not the function the model computes
_METADATA = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
             "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
             "decoder_start_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
             "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
             "summary_first_dropout", "pretraining_tp", "output_attentions", "output_hidden_states",
             "return_dict", "id2label", "label2id", "problem_type", "tokenizer_class", "name_or_path", "_name_or_path",
             "reorder_and_upcast_attn", "max_window_layers", "tie_encoder_decoder", "is_encoder_decoder",
             "chunk_size_feed_forward", "task_specific_params", "_attn_implementation_autoset"}

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
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                  layer_types=None),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  use_sliding_window=False, sliding_window=None, layer_types=None),
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  hidden_activation=None, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  attention_bias=False, use_bidirectional_attention=None),
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
                 n_ctx=None),
}
_ROPE_KEYS = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor"}
_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu_tanh"}


class _Reader:
    """A config dict read key by key: what was read, and the keys nobody read."""

    def __init__(self, family: str, d: dict):
        self.family, self.d, self.read = family, d, set()

    def __call__(self, key: str):
        self.read.add(key)
        return self.d.get(key, _DEFAULTS[self.family].get(key))

    def unread(self) -> list[str]:
        return sorted(k for k in self.d if k not in self.read and k not in _METADATA and k not in _ROPE_KEYS)


def _rope(d: dict) -> dict:
    """ModelConfig RoPE fields from rope_parameters (transformers 5) or rope_theta + rope_scaling (older)."""
    params = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        params = {**dict(d["rope_scaling"]), **params}
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if d.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError("unsupported config: partial_rotary_factor != 1 (RoPE over part of each head)")
    out = {"rope_base": float(theta)}
    if kind == "default":
        known = set()
    elif kind == "linear":
        out.update(rope_scaling="linear", rope_factor=float(params["factor"]))
        known = {"factor"}
    elif kind == "llama3":
        out.update(rope_scaling="llama3", rope_factor=float(params["factor"]),
                   rope_original_max_len=int(params["original_max_position_embeddings"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]))
        known = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    else:
        raise HFError(f"unsupported config: rope type {kind!r} (supported: default, linear, llama3)")
    extra = sorted(set(params) - known)
    if extra:
        raise HFError(f"unsupported config: rope parameters {extra} of rope type {kind!r}")
    return out


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
    refused = []

    def need(key, ok, what):
        if not ok(r(key)):
            refused.append(f"{key}={r(key)!r} ({what})")

    if family == "gpt2":
        dm, heads = r("n_embd"), r("n_head")
        need("activation_function", lambda v: v in ("gelu_new", "gelu", "gelu_pytorch_tanh"), "GELU kinds only")
        need("scale_attn_weights", lambda v: v is True, "unscaled attention")
        need("scale_attn_by_inverse_layer_idx", lambda v: not v, "per-layer attention scaling")
        need("add_cross_attention", lambda v: not v, "cross-attention")
        r("n_ctx")
        kw = dict(d_model=dm, num_heads=heads, d_ff=r("n_inner") or 4 * dm, num_decoder_layers=r("n_layer"),
                  max_len=r("n_positions"), norm_type="layernorm", norm_eps=float(r("layer_norm_epsilon")),
                  positional="learned", activation={"gelu": "gelu"}.get(r("activation_function"), "gelu_tanh"),
                  use_bias=True, scale_embeddings=False)
    else:
        dm, heads = r("hidden_size"), r("num_attention_heads")
        want = "gelu_pytorch_tanh" if family == "gemma" else "silu"
        need("hidden_act", lambda v: v in ((want, "gelu_new") if family == "gemma" else (want,)),
             f"{family} supports {want}")
        if family == "gemma":
            need("hidden_activation", lambda v: v in (None, r("hidden_act")), "hidden_act is what transformers runs")
        kw = dict(d_model=dm, num_heads=heads, num_kv_heads=r("num_key_value_heads"),
                  d_ff=r("intermediate_size"), num_decoder_layers=r("num_hidden_layers"),
                  max_len=r("max_position_embeddings"), norm_type="rmsnorm", norm_eps=float(r("rms_norm_eps")),
                  positional="rope", activation=_ACTIVATIONS[want], use_bias=False,
                  scale_embeddings=family == "gemma", **_rope(d))
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
        kw["qk_norm"] = family == "qwen3"
        if family in ("qwen2", "qwen3"):
            need("use_sliding_window", lambda v: not v, "sliding windows of Qwen are not supported")
            r("sliding_window")
            need("layer_types", lambda v: v is None or set(v) <= {"full_attention"}, "full attention only")
        if family == "mistral" and r("sliding_window"):
            kw["attention_windows"] = (int(r("sliding_window")),)
        if family == "gemma":
            need("use_bidirectional_attention", lambda v: not v, "bidirectional attention")
    tie, vocab = r("tie_word_embeddings"), r("vocab_size")
    unread = r.unread()
    if refused or unread:
        raise HFError(f"unsupported {family} config: " + "; ".join(refused + [f"{k} (unknown key)" for k in unread]))
    try:
        return ModelConfig(arch="decoder_only", vocab_size=vocab, num_encoder_layers=0,
                           norm_position="pre", final_norm=True, tie_embeddings=bool(tie), dropout=0.0,
                           pad_id=-1, dtype=dtype, **kw)
    except ConfigError as e:
        raise HFError(f"the {family} config maps to an invalid model config: {e}") from None


def family_for(cfg: ModelConfig) -> str:
    """The family whose config.json expresses `cfg` (HFError naming the switch that none can)."""
    problems = []
    for field, ok in (("arch", cfg.arch == "decoder_only"), ("norm_position", cfg.norm_position == "pre"),
                      ("final_norm", cfg.use_final_norm), ("ffn", cfg.ffn == "dense"),
                      ("attention_scale", cfg.attention_scale == "rsqrt"), ("ablations", not cfg.ablations),
                      ("logit_softcap", not cfg.logit_softcap), ("attention_softcap", not cfg.attention_softcap)):
        if not ok:
            problems.append(f"model.{field}={getattr(cfg, field, cfg.ablations)!r}")
    if problems:
        raise HFError(f"no Hugging Face family expresses {', '.join(problems)}")
    if cfg.positional == "learned":
        if (cfg.norm_type, cfg.activation, cfg.tie_embeddings, cfg.scale_embeddings, cfg.qk_norm) == \
                ("layernorm", "gelu_tanh", True, False, False) and cfg.biases in (None, ("q", "k", "v", "o", "ffn")) \
                and cfg.use_bias and cfg.kv_heads == cfg.num_heads and cfg.head_dim is None \
                and not any(cfg.attention_windows):
            return "gpt2"
        raise HFError("learned positions export as GPT-2 only: layernorm, gelu_tanh, tied, every bias, MHA")
    if cfg.positional != "rope" or cfg.norm_type != "rmsnorm":
        raise HFError(f"model.positional={cfg.positional!r} with model.norm_type={cfg.norm_type!r}: no Hugging "
                      f"Face family (rope + rmsnorm, or GPT-2's learned + layernorm)")
    biases = tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b))
    windows = set(cfg.layer_windows())
    if cfg.activation == "geglu_tanh" and cfg.scale_embeddings and not cfg.qk_norm and windows == {0} \
            and biases in ((), ("q", "k", "v", "o")):
        return "gemma"
    if cfg.activation != "swiglu" or cfg.scale_embeddings:
        raise HFError(f"model.activation={cfg.activation!r} (scale_embeddings={cfg.scale_embeddings}): no family")
    if len(windows) == 1 and windows != {0}:
        if not biases and not cfg.qk_norm:
            return "mistral"
        raise HFError("a sliding window exports as Mistral only: no biases, no QK-norm")
    if windows != {0}:
        raise HFError(f"model.attention_windows={cfg.attention_windows!r}: per-layer windows have no family here")
    if cfg.qk_norm:
        if biases in ((), ("q", "k", "v", "o")) and cfg.rope_scaling == "none":
            return "qwen3"
        raise HFError("QK-norm exports as Qwen3: all attention biases or none, no RoPE scaling")
    if biases == ("q", "k", "v") and cfg.rope_scaling == "none":
        return "qwen2"
    if biases in ((), ("q", "k", "v", "o"), ("ffn",), ("q", "k", "v", "o", "ffn")):
        return "llama"
    raise HFError(f"biases {biases}: no family (Qwen2: q, k, v; Llama: attention and/or FFN)")


_RESPELLED = ("pad_id", "use_bias", "biases", "num_kv_heads", "head_dim", "final_norm", "attention_windows")
_ROPE_SCALING = {"none": (), "linear": ("rope_factor",),
                 "llama3": ("rope_factor", "rope_original_max_len", "rope_low_freq_factor", "rope_high_freq_factor")}


def function_of(cfg: ModelConfig) -> dict:
    """The fields of `cfg` that decide the function its model computes, each in one spelling: the projections
    with a bias, K and H, the final norm, each layer's window; RoPE's settings only where they apply, MoE's
    only for an MoE model. Two configs with equal function_of compute the same logits from the same weights."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ModelConfig.RUNTIME + _RESPELLED}
    d.update(biases=tuple(b for b in ("q", "k", "v", "o", "ffn") if cfg.has_bias(b)), kv_heads=cfg.kv_heads,
             head_size=cfg.head_size, final_norm=cfg.use_final_norm, windows=cfg.layer_windows())
    rope = ("rope_base", "rope_scaling") + _ROPE_SCALING.get(cfg.rope_scaling, ())
    for k in [k for k in d if k.startswith("rope_") and (cfg.positional != "rope" or k not in rope)]:
        del d[k]
    if cfg.ffn != "moe":
        for k in [k for k in d if k.startswith("moe_") or k == "num_experts"]:
            del d[k]
    if cfg.arch == "decoder_only":
        del d["num_encoder_layers"]
    return d


def expresses(cfg: ModelConfig, family: str) -> list[str]:
    """What `family`'s config.json cannot say of `cfg`: `cfg` is written as that family's config and read back
    as transformers would run it, and every field whose function differs is named (empty: it expresses cfg)."""
    try:
        back = to_model_config(to_hf_config(cfg, family), cfg.dtype)
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
                "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": True, "scale_attn_weights": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    rope = {"rope_theta": cfg.rope_base, "rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_len,
                    low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    out = {"model_type": family, "architectures": [ARCHITECTURES[family]], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_decoder_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
           "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm_eps,
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
        out["use_sliding_window"] = False
    if family == "mistral":
        out["sliding_window"] = cfg.layer_windows()[0] or None       # None: no window (0 would mask everything)
    return out
