"""Which Hugging Face tensor is which jaxformer parameter, per family, and how each converts both ways.

Axis legend: D model width, N query heads, K kv heads, H head dim, F FFN width, V vocab, L layers (P positions).
Torch `nn.Linear` weights are [out, in] and GPT-2's `Conv1D` weights [in, out]; ours are [in, ...out] with
heads split ([D,N,H], [N,H,D]). Parameters of the layer stack are [L, ...]: a tensor of layer i fills row i.
Gemma's RMSNorm multiplies by (1 + w): its weight w is our scale - 1 (the same function; Adam's updates do not
depend on the offset either).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxformer.config import ModelConfig
from jaxformer.nn.stack import blocks_path

Path = tuple[str, ...]                       # a parameter's path in the model's state, without the layer index
STACK = blocks_path("decoder")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor `name` of shape `shape`: our parameters `ours` (rows `layer` of stacked ones), with
    `load` (hf array -> one array per path) and `save` (our arrays -> the hf array)."""
    name: str
    shape: tuple[int, ...]
    ours: tuple[Path, ...]
    layer: int | None
    load: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    save: Callable[..., np.ndarray]


def _same(name, shape, path, layer=None, offset=0.0):
    if not offset:
        return Tensor(name, shape, (path,), layer, lambda a: (a,), lambda a: a)      # no copy
    return Tensor(name, shape, (path,), layer, lambda a: (a + offset,), lambda a: a - offset)


def _linear(name, d_in, out_shape, path, layer):
    """nn.Linear weight [prod(out), d_in] <-> ours [d_in, *out]."""
    n = int(np.prod(out_shape))
    return Tensor(name, (n, d_in), (path,), layer, lambda a: (a.T.reshape(d_in, *out_shape),),
                  lambda w: w.reshape(d_in, n).T)


def _linear_in(name, in_shape, d_out, path, layer):
    """nn.Linear weight [d_out, prod(in)] <-> ours [*in, d_out] (the attention output)."""
    n = int(np.prod(in_shape))
    return Tensor(name, (d_out, n), (path,), layer, lambda a: (a.T.reshape(*in_shape, d_out),),
                  lambda w: w.reshape(n, d_out).T)


def _reshaped(name, shape, path, layer):
    flat = (int(np.prod(shape)),)
    return Tensor(name, flat, (path,), layer, lambda a: (a.reshape(shape),), lambda w: w.reshape(flat))


def _dims(cfg: ModelConfig):
    return cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size


def _llama_like(cfg: ModelConfig, family: str) -> list[Tensor]:
    d, n, k, h, f, v = _dims(cfg)
    one = 1.0 if family in ("gemma", "gemma2") else 0.0          # Gemma's norms: (1 + w)
    out = [_same("model.embed_tokens.weight", (v, d), ("embed", "tokens")),
           _same("model.norm.weight", (d,), ("decoder", "final_norm", "scale"), offset=one)]
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head.weight", (v, d), (("embed", "head"),), None, lambda a: (a.T,), lambda w: w.T))
    attn, ffn = STACK + ("self_attn",), STACK + ("ffn",)
    for i in range(cfg.num_decoder_layers):
        p = f"model.layers.{i}."
        out += [_linear(p + "self_attn.q_proj.weight", d, (n, h), attn + ("wq",), i),
                _linear(p + "self_attn.k_proj.weight", d, (k, h), attn + ("wk",), i),
                _linear(p + "self_attn.v_proj.weight", d, (k, h), attn + ("wv",), i),
                _linear_in(p + "self_attn.o_proj.weight", (n, h), d, attn + ("wo",), i),
                _linear(p + "mlp.gate_proj.weight", d, (f,), ffn + ("wg",), i),
                _linear(p + "mlp.up_proj.weight", d, (f,), ffn + ("w1",), i),
                _linear(p + "mlp.down_proj.weight", f, (d,), ffn + ("w2",), i),
                _same(p + "input_layernorm.weight", (d,), STACK + ("res_self", "norm", "scale"), i, one)]
        if family == "gemma2":                    # sandwich norms: a norm after each sublayer too
            out += [_same(p + "post_attention_layernorm.weight", (d,), STACK + ("res_self", "post_norm", "scale"),
                          i, one),
                    _same(p + "pre_feedforward_layernorm.weight", (d,), STACK + ("res_ffn", "norm", "scale"), i, one),
                    _same(p + "post_feedforward_layernorm.weight", (d,), STACK + ("res_ffn", "post_norm", "scale"),
                          i, one)]
        else:
            out.append(_same(p + "post_attention_layernorm.weight", (d,), STACK + ("res_ffn", "norm", "scale"), i,
                             one))
        for b, shape in (("q", (n, h)), ("k", (k, h)), ("v", (k, h))):
            if cfg.has_bias(b):
                out.append(_reshaped(p + f"self_attn.{b}_proj.bias", shape, attn + (f"b{b}",), i))
        if cfg.has_bias("o"):
            out.append(_same(p + "self_attn.o_proj.bias", (d,), attn + ("bo",), i))
        if cfg.has_bias("ffn"):
            out += [_same(p + "mlp.gate_proj.bias", (f,), ffn + ("bg",), i),
                    _same(p + "mlp.up_proj.bias", (f,), ffn + ("b1",), i),
                    _same(p + "mlp.down_proj.bias", (d,), ffn + ("b2",), i)]
        if cfg.attention.qk_norm:
            out += [_same(p + "self_attn.q_norm.weight", (h,), attn + ("q_norm",), i),
                    _same(p + "self_attn.k_norm.weight", (h,), attn + ("k_norm",), i)]
    return out


def _gpt2(cfg: ModelConfig) -> list[Tensor]:
    d, n, _, h, f, v = _dims(cfg)
    t = "transformer."
    out = [_same(t + "wte.weight", (v, d), ("embed", "tokens")),
           _same(t + "wpe.weight", (cfg.max_len, d), ("embed", "positions")),
           _same(t + "ln_f.weight", (d,), ("decoder", "final_norm", "scale")),
           _same(t + "ln_f.bias", (d,), ("decoder", "final_norm", "bias"))]
    attn, ffn = STACK + ("self_attn",), STACK + ("ffn",)
    for i in range(cfg.num_decoder_layers):
        p = f"{t}h.{i}."
        out += [Tensor(p + "attn.c_attn.weight", (d, 3 * n * h), tuple(attn + (w,) for w in ("wq", "wk", "wv")), i,
                       lambda a: tuple(x.reshape(d, n, h) for x in np.split(a, 3, axis=1)),
                       lambda *ws: np.concatenate([w.reshape(d, n * h) for w in ws], axis=1)),
                Tensor(p + "attn.c_attn.bias", (3 * n * h,), tuple(attn + (b,) for b in ("bq", "bk", "bv")), i,
                       lambda a: tuple(x.reshape(n, h) for x in np.split(a, 3)),
                       lambda *bs: np.concatenate([b.reshape(-1) for b in bs])),
                Tensor(p + "attn.c_proj.weight", (n * h, d), (attn + ("wo",),), i, lambda a: (a.reshape(n, h, d),),
                       lambda w: w.reshape(n * h, d)),
                _same(p + "attn.c_proj.bias", (d,), attn + ("bo",), i),
                _same(p + "mlp.c_fc.weight", (d, f), ffn + ("w1",), i),
                _same(p + "mlp.c_fc.bias", (f,), ffn + ("b1",), i),
                _same(p + "mlp.c_proj.weight", (f, d), ffn + ("w2",), i),
                _same(p + "mlp.c_proj.bias", (d,), ffn + ("b2",), i),
                _same(p + "ln_1.weight", (d,), STACK + ("res_self", "norm", "scale"), i),
                _same(p + "ln_1.bias", (d,), STACK + ("res_self", "norm", "bias"), i),
                _same(p + "ln_2.weight", (d,), STACK + ("res_ffn", "norm", "scale"), i),
                _same(p + "ln_2.bias", (d,), STACK + ("res_ffn", "norm", "bias"), i)]
    return out


def tensors(cfg: ModelConfig, family: str) -> list[Tensor]:
    """Every HF tensor of `family` for the model of `cfg`, in the order transformers names them."""
    return _gpt2(cfg) if family == "gpt2" else _llama_like(cfg, family)


def canonical_name(name: str, family: str) -> str | None:
    """A file's tensor name as `tensors` spells it: GPT-2 files written without the "transformer." prefix get
    it. None for tensors that are not parameters (GPT-2's attention-mask buffers) or a tied head's copy."""
    if family == "gpt2":
        if name.endswith((".attn.bias", ".attn.masked_bias")) and ".c_attn." not in name:
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
    return name
