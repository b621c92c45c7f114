"""The model config's sections: `model.norm`, `.rope`, `.attention`, `.moe`, `.ablation`, `.runtime`, `.lora`.

Each is a frozen dataclass that validates its own fields on construction (ConfigError naming the dotted key and
the value); `ModelConfig` (`jaxformer.config.model`) holds them and checks what spans sections. `jaxformer.config`
exports them all.
"""
from __future__ import annotations

import dataclasses
import re

from jaxformer.config.checks import _Validated, check_types, choice, positive
from jaxformer.errors import ConfigError
from jaxformer.ops import norms, positional
from jaxformer.ops.attention import BACKENDS

REMAT_POLICIES = ("none", "full", "dots", "dots_attention")
# model.attention.kind: the self-attention module by name; any other "package.module:Class" path is imported as is
ATTENTION_KINDS = {"softmax": "jaxformer.nn.attention:MultiHeadAttention",
                   "differential": "jaxformer.nn.differential:DifferentialAttention"}   # Ye et al. 2024
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")      # attention projections; the dense FFN's matrices


@dataclasses.dataclass(frozen=True)
class NormConfig(_Validated):
    """model.norm: where the residual's normalisation sits and which one it is.

    Attributes:
      position: "post": LN(x + f(x)) (the paper, seed 000) | "pre": x + f(LN(x)) | "sandwich": x + LN'(f(LN(x))) |
        "deepnorm": LN(α·x + f(x)), β-scaled init | "rezero": x + g·f(x), g from 0 (`nn.layers.Residual`).
      type: "layernorm" | "rmsnorm" | any name registered in `ops.norms.NORMS`.
      eps: the norm's epsilon (> 0).
      final: a norm after the stack; None = yes for "pre" and "sandwich", else no.

    Examples:
      >>> from jaxformer.config import NormConfig
      >>> NormConfig(position="pre", type="rmsnorm").type
      'rmsnorm'
      >>> NormConfig(position="middle")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.norm.position='middle' is not one of ('pre', 'post', ...)
    """
    position: str = "post"                 # post | pre | sandwich | deepnorm | rezero
    type: str = "layernorm"                # layernorm | rmsnorm | any name in ops.norms.NORMS
    eps: float = 1e-5
    final: bool | None = None              # None = yes for pre and sandwich, else no

    def validate(self) -> None:
        check_types(self, "model.norm")
        choice("model.norm.position", self.position, ("pre", "post", "sandwich", "deepnorm", "rezero"))
        choice("model.norm.type", self.type, tuple(norms.NORMS))        # registered norms
        positive("model.norm.eps", self.eps)


@dataclasses.dataclass(frozen=True)
class RopeConfig(_Validated):
    """model.rope: rotary positions (used when model.positional='rope'): the base and its frequency scaling.

    Attributes:
      base: the rotary base θ (> 0).
      scaling: "none" | "linear" (positions / factor) | "llama3" (Llama 3.1: low frequencies / factor, high kept, a
        smooth band between) | "yarn" | "dynamic" (dynamic NTK: the base grows past original_max_len).
      factor: linear, llama3, yarn: the context extension factor (> 0).
      original_max_len: llama3, yarn: the context the model was pretrained on.
      low_freq_factor: llama3: wavelengths above original_max_len / this are scaled.
      high_freq_factor: llama3: wavelengths below original_max_len / this are kept (must exceed low_freq_factor).
      beta_fast: yarn: dimensions turning more often than this over original_max_len are kept.
      beta_slow: yarn: dimensions turning less often than this are interpolated; a ramp between.
      attention_factor: yarn: the cos/sin scale (0 = 0.1·ln(factor) + 1).
      truncate: yarn: the ramp's ends rounded outwards (transformers' default).
      nope_every: k > 0: every k-th self-attention layer (k-1, 2k-1, ...) skips RoPE (NoPE layers, as SmolLM3 and
        Llama 4); 0 = every layer rotates.

    Examples:
      >>> from jaxformer.config import RopeConfig
      >>> RopeConfig(scaling="linear", factor=4.0).frequency_scaling().factor
      4.0
      >>> RopeConfig(scaling="llama3", low_freq_factor=4.0, high_freq_factor=1.0)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.rope.high_freq_factor=1.0 must exceed model.rope.low_freq_factor=4.0
    """
    base: float = 10000.0
    scaling: str = "none"                  # none | linear | llama3 | yarn | dynamic
    factor: float = 1.0                    # linear, llama3, yarn: the context extension factor
    original_max_len: int = 8192           # llama3, yarn: the pretrained context
    low_freq_factor: float = 1.0           # llama3
    high_freq_factor: float = 4.0          # llama3
    beta_fast: float = 32.0                # yarn
    beta_slow: float = 1.0                 # yarn
    attention_factor: float = 0.0          # yarn: cos/sin scale (0 = 0.1·ln(factor) + 1)
    truncate: bool = True                  # yarn: the ramp's ends rounded outwards
    nope_every: int = 0                    # k > 0: layers k-1, 2k-1, ... skip RoPE; 0 = every layer rotates

    def validate(self) -> None:
        check_types(self, "model.rope")
        positive("model.rope.base", self.base)
        choice("model.rope.scaling", self.scaling, positional.SCALINGS)
        for f in ("factor", "original_max_len", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            positive(f"model.rope.{f}", getattr(self, f))
        positive("model.rope.attention_factor", self.attention_factor, allow_zero=True)
        positive("model.rope.nope_every", self.nope_every, allow_zero=True)
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"model.rope.high_freq_factor={self.high_freq_factor} must exceed "
                              f"model.rope.low_freq_factor={self.low_freq_factor}")

    def frequency_scaling(self) -> "positional.RopeScaling | None":
        """The RoPE frequency scaling (None: plain RoPE)."""
        if self.scaling == "none":
            return None
        return positional.RopeScaling(self.scaling, self.factor, self.original_max_len, self.low_freq_factor,
                                      self.high_freq_factor, self.beta_fast, self.beta_slow, self.attention_factor,
                                      self.truncate)


@dataclasses.dataclass(frozen=True)
class AttentionConfig(_Validated):
    """model.attention: how attention scores (the head sizes are model.num_heads / num_kv_heads / head_dim).

    Attributes:
      scale: the logits' scale: "rsqrt" = 1/sqrt(H) (the paper) | "none" = 1.
      softcap: attention logits (scaled q·k) -> cap · tanh(logits / cap) (Gemma 2: 50); 0 = off.
      windows: sliding-window (local) self-attention of the decoder: a pattern of windows repeated over the layers
        (its length must divide model.num_decoder_layers), 0 = global; e.g. (128,): every layer sees its 128 most
        recent positions, (128, 0) alternates. Integers in [0, 2**31).
      qk_norm: RMSNorm over H on each query and key head before RoPE (Qwen3, OLMo 2).
      scale_dim: with scale "rsqrt": 1/sqrt(scale_dim) (0 = the head size H; Gemma 2's query_pre_attn_scalar).
      kind: the self-attention module: a name of ATTENTION_KINDS ("softmax" | "differential": Ye et al. 2024) or
        your own "package.module:Class", a subclass of `nn.attention.MultiHeadAttention` (a research variant is
        that one file: `nn.layers.self_attention`).
      options: the kind's own knobs, "name=value" each, e.g. ("temperature=10",): what its Options declares
        (`nn.attention.MultiHeadAttention.options`; softmax has none).

    Examples:
      >>> from jaxformer.config import AttentionConfig
      >>> AttentionConfig(windows=(128, 0), qk_norm=True).windows
      (128, 0)
      >>> AttentionConfig(windows=(-1,))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.attention.windows=(-1,): a window must be >= 0 (0 = global); got -1
    """
    scale: str = "rsqrt"                   # rsqrt = 1/sqrt(H) | none = 1
    softcap: float = 0.0                   # cap · tanh(logits / cap); 0 = off
    windows: tuple[int, ...] = ()          # a pattern of windows repeated over the decoder's layers, 0 = global
    qk_norm: bool = False                  # RMSNorm on each query and key head before RoPE
    scale_dim: int = 0                     # 0 = H
    kind: str = "softmax"                  # a name of ATTENTION_KINDS or "package.module:Class"
    options: tuple[str, ...] = ()          # "name=value" each: the kind's Options

    def validate(self) -> None:
        check_types(self, "model.attention")
        choice("model.attention.scale", self.scale, ("rsqrt", "none"))
        names = [o.partition("=")[0] for o in self.options]
        for o, name in zip(self.options, names):
            if not isinstance(o, str) or "=" not in o or not name.isidentifier():
                raise ConfigError(f"model.attention.options={self.options!r}: {o!r} is not name=value")
        if len(set(names)) < len(names):
            raise ConfigError(f"model.attention.options={self.options!r} names an option twice")
        if self.kind not in ATTENTION_KINDS and not _IMPORT_PATH.fullmatch(self.kind):
            raise ConfigError(f"model.attention.kind={self.kind!r} is neither one of {tuple(ATTENTION_KINDS)} nor "
                              f"a 'package.module:Class' path")
        positive("model.attention.scale_dim", self.scale_dim, allow_zero=True)
        positive("model.attention.softcap", self.softcap, allow_zero=True)
        if not isinstance(self.windows, (tuple, list)):
            raise ConfigError(f"model.attention.windows={self.windows!r} must be a tuple of windows (a pattern "
                              f"repeated over the layers, 0 = global), e.g. (128,) or (128, 0)")
        for w in self.windows:
            if not isinstance(w, int) or isinstance(w, bool):
                raise ConfigError(f"model.attention.windows={self.windows!r}: a window must be an integer; got "
                                  f"{w!r} ({type(w).__name__})")
            if w < 0:
                raise ConfigError(f"model.attention.windows={self.windows!r}: a window must be >= 0 (0 = global); "
                                  f"got {w}")
            if w >= 2 ** 31:            # the mask compares int32 position distances with it (`nn.per_layer`)
                raise ConfigError(f"model.attention.windows={self.windows!r}: a window must fit int32 (< 2**31); "
                                  f"got {w} (a window at least the sequence length is global attention: use 0 = "
                                  f"global)")


@dataclasses.dataclass(frozen=True)
class MoEConfig(_Validated):
    """model.moe (`jaxformer.ops.moe`): with model.ffn='moe', the FFN of every `every`-th block (the last of each
    group of `every`) is `num_experts` experts of width model.d_ff, each token routed to its top_k.

    Attributes:
      num_experts: E, the experts per MoE layer (> 0; at least top_k).
      top_k: the experts each token is routed to: 1 (Switch) | 2 (GShard, Mixtral).
      every: MoE on every layer (1) or every n-th (the layer counts must be multiples of n).

    Examples:
      >>> from jaxformer.config import MoEConfig
      >>> MoEConfig(num_experts=4, top_k=2).top_k
      2
      >>> MoEConfig(top_k=3)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.moe.top_k=3 is not one of (1, 2)
    """
    num_experts: int = 8                   # E
    top_k: int = 1                         # 1 (Switch) | 2 (GShard, Mixtral)
    every: int = 1                         # MoE on every n-th layer

    def validate(self) -> None:
        check_types(self, "model.moe")
        positive("model.moe.num_experts", self.num_experts)
        choice("model.moe.top_k", self.top_k, (1, 2))
        positive("model.moe.every", self.every)


@dataclasses.dataclass(frozen=True)
class AblationConfig(_Validated):
    """model.ablation: wrong on purpose, to measure what the seeds claim (docs/ablations/masking.md). Training
    with either away from its default prints a warning; nothing else should flip them.

    Attributes:
      mask_value: masked logits: "min" = float32's most negative (correct) | "zero" = 0 (leaks; reference
        attention backend only).
      causal: decoder self-attention: "tril" = the past (correct) | "triu" = the future (a bug).

    Examples:
      >>> from jaxformer.config import AblationConfig
      >>> AblationConfig(causal="triu").causal
      'triu'
      >>> AblationConfig(mask_value="nan")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.ablation.mask_value='nan' is not one of ('min', 'zero')
    """
    mask_value: str = "min"                # min | zero (leaks)
    causal: str = "tril"                   # tril = past | triu = future (a bug)

    def validate(self) -> None:
        check_types(self, "model.ablation")
        choice("model.ablation.mask_value", self.mask_value, ("min", "zero"))
        choice("model.ablation.causal", self.causal, ("tril", "triu"))


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(_Validated):
    """model.runtime: how the model runs, not the function its weights compute (dtype: its rounding).

    Attributes:
      dtype: the precision policy: "float32" (everything) | "bfloat16" | "float16" (mixed precision: parameters
        and optimizer state stay float32, activations and matmul inputs take this dtype, attention logits and
        softmax, norms, output logits and the loss are computed in float32).
      param_dtype: the parameters' dtype: "float32" | "bfloat16" (needs dtype="bfloat16"; the optimizer then keeps
        a float32 master copy and updates from it: `train.step.with_master_weights`).
      kv_cache_dtype: decoding's KV cache: "auto" (= dtype) | "int8" (a float32 scale per slot and kv head; keys
        and values rounded when written).
      attention_backend: "reference" | "chunked" | "cudnn" | "pallas" (`ops.attention.BACKENDS`).
      attention_block: the chunked backend's tile edge, queries and keys (> 0).
      remat: recompute in the backward pass, per block: "none" | "full" | "dots" (keep the matmul outputs without
        batch dims, recompute the rest) | "dots_attention" (and each attention's output).
      dropout: residual and embedding dropout, training only, in [0, 1).
      init: parameter initialisation: "glorot" | "pytorch" | "gpt2" (`jaxformer.nn.init`).
      moe_capacity_factor: MoE training: slots per expert = ceil(factor·tokens·k/E), overflow dropped; 0 = dropless.
        Inference (eval, decoding) always runs dropless.
      moe_dropless: how dropless MoE runs: "ragged" (grouped matmuls, M·k rows) | "padded" (every expert over all
        M token slots: E/k× the work, plain matmuls).

    Examples:
      >>> from jaxformer.config import RuntimeConfig
      >>> r = RuntimeConfig(dtype="bfloat16", remat="dots")
      >>> r.dtype, r.param_dtype
      ('bfloat16', 'float32')
      >>> RuntimeConfig(param_dtype="bfloat16")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.runtime.param_dtype='bfloat16' computes in bfloat16: it needs ...
    """
    dtype: str = "float32"                 # float32 | bfloat16 | float16 (mixed precision)
    param_dtype: str = "float32"           # float32 | bfloat16 (needs dtype=bfloat16)
    kv_cache_dtype: str = "auto"           # auto (= dtype) | int8
    attention_backend: str = "reference"   # reference | chunked | cudnn | pallas
    attention_block: int = 512             # the chunked backend's tile edge
    remat: str = "none"                    # none | full | dots | dots_attention
    dropout: float = 0.1                   # training only
    init: str = "glorot"                   # glorot | pytorch | gpt2
    moe_capacity_factor: float = 1.25      # MoE training; 0 = dropless
    moe_dropless: str = "ragged"           # ragged | padded

    def validate(self) -> None:
        check_types(self, "model.runtime")
        choice("model.runtime.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        choice("model.runtime.param_dtype", self.param_dtype, ("float32", "bfloat16"))
        if self.param_dtype == "bfloat16" and self.dtype != "bfloat16":
            raise ConfigError(f"model.runtime.param_dtype='bfloat16' computes in bfloat16: it needs "
                              f"model.runtime.dtype='bfloat16' (got {self.dtype!r})")
        choice("model.runtime.kv_cache_dtype", self.kv_cache_dtype, ("auto", "int8"))
        choice("model.runtime.attention_backend", self.attention_backend, BACKENDS)
        positive("model.runtime.attention_block", self.attention_block)
        choice("model.runtime.remat", self.remat, REMAT_POLICIES)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.runtime.dropout={self.dropout!r} must be in [0, 1)")
        choice("model.runtime.init", self.init, ("glorot", "pytorch", "gpt2"))
        positive("model.runtime.moe_capacity_factor", self.moe_capacity_factor, allow_zero=True)
        choice("model.runtime.moe_dropless", self.moe_dropless, ("ragged", "padded"))


@dataclasses.dataclass(frozen=True)
class LoraConfig(_Validated):
    """model.lora (`jaxformer.nn.lora`): low-rank adapters on the layer stacks' projections, trained while every
    other weight stays frozen.

    With rank r each target W [in, out] computes x·W + (alpha/r)·dropout(x)·A·B, A [in, r], B [r, out] from zero
    (so a fresh adapter changes nothing). Not part of the function the weights compute: an export,
    `train.init_from` and restoring compare models with the adapters merged (`ModelConfig.function`).

    Attributes:
      rank: r (>= 0); 0 = no adapters (every parameter trains).
      alpha: the update's scale is alpha / rank (the LoRA paper's α; > 0).
      dropout: on an adapter's input, training only, in [0, 1).
      targets: distinct names of LORA_TARGETS: q, k, v, o (every attention), gate, up, down (the dense FFN).
      base: the frozen projections: "float32" | "bfloat16" | "int8" (weight-only, one scale per output channel:
        QLoRA's idea with qwix's int8).

    Examples:
      >>> from jaxformer.config import LoraConfig
      >>> LoraConfig(rank=8, targets=("q", "k", "v", "o")).targets
      ('q', 'k', 'v', 'o')
      >>> LoraConfig(rank=8, targets=("w1",))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.lora.targets=('w1',): expected distinct names of ('q', 'k', ...)
    """
    rank: int = 0                          # r; 0 = no adapters
    alpha: float = 16.0                    # scale alpha / rank
    dropout: float = 0.0                   # training only
    targets: tuple[str, ...] = ("q", "v")  # names of LORA_TARGETS
    base: str = "float32"                  # float32 | bfloat16 | int8

    def validate(self) -> None:
        check_types(self, "model.lora")
        positive("model.lora.rank", self.rank, allow_zero=True)
        positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout!r} must be in [0, 1)")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"model.lora.targets={self.targets!r}: expected distinct names of {LORA_TARGETS}")
        choice("model.lora.base", self.base, ("float32", "bfloat16", "int8"))
