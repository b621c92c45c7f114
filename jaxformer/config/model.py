"""The model's configuration: its sizes and choices at the top, the rest in sections that validate themselves.

`model.norm`, `model.rope`, `model.attention`, `model.moe` and `model.ablation` describe the function the weights
compute; `model.runtime` says how it runs (precision, kernels, recomputation, dropout, the initial distribution,
MoE token dropping) and changes neither the parameters' shapes nor what trained weights compute, so
`train.init_from`, restoring a pretrained model and a Hugging Face export compare models up to it
(`ModelConfig.function`). Checks that span sections (a backend and a dtype, windows and the layer count) are
`ModelConfig.validate`'s.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxformer.config.checks import _Validated, check_types, choice, positive
from jaxformer.errors import ConfigError
from jaxformer.ops import activations, fused, norms, positional
from jaxformer.ops.attention import BACKENDS

REMAT_POLICIES = ("none", "full", "dots", "dots_attention")
BIASES = ("q", "k", "v", "o", "ffn")           # the projections model.biases may name
# model.attention.kind: the self-attention module by name; any other "package.module:Class" path is imported as is
ATTENTION_KINDS = {"softmax": "jaxformer.nn.attention:MultiHeadAttention",
                   "differential": "jaxformer.nn.differential:DifferentialAttention"}   # Ye et al. 2024
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True)
class NormConfig(_Validated):
    """model.norm: where the residual's normalisation sits and which one it is."""
    position: str = "post"                 # "post": LN(x + f(x)) (paper, seed 000) | "pre": x + f(LN(x)) |
                                           # "sandwich": x + LN'(f(LN(x))) | "deepnorm": LN(α·x + f(x)), β init |
                                           # "rezero": x + g·f(x), g from 0 (jaxformer.nn.layers.Residual)
    type: str = "layernorm"                # "layernorm" | "rmsnorm" | any name in ops.norms.NORMS
    eps: float = 1e-5
    final: bool | None = None              # norm after the stack; None = yes for pre and sandwich, else no

    def validate(self) -> None:
        check_types(self, "model.norm")
        choice("model.norm.position", self.position, ("pre", "post", "sandwich", "deepnorm", "rezero"))
        choice("model.norm.type", self.type, tuple(norms.NORMS))        # registered norms
        positive("model.norm.eps", self.eps)


@dataclasses.dataclass(frozen=True)
class RopeConfig(_Validated):
    """model.rope: rotary positions (used when model.positional='rope'): the base and its frequency scaling."""
    base: float = 10000.0
    scaling: str = "none"                  # none | linear (positions / factor) | llama3 (Llama 3.1: low
                                           # frequencies / factor, high kept, a smooth band between) | yarn |
                                           # dynamic (dynamic NTK: the base grows past original_max_len)
    factor: float = 1.0                    # linear, llama3, yarn: the context extension factor
    original_max_len: int = 8192           # llama3, yarn: the context the model was pretrained on
    low_freq_factor: float = 1.0           # llama3: wavelengths above original_max_len / this are scaled
    high_freq_factor: float = 4.0          # llama3: wavelengths below original_max_len / this are kept
    beta_fast: float = 32.0                # yarn: dimensions turning more often than this over original_max_len kept
    beta_slow: float = 1.0                 # yarn: ... less often than this interpolated; a ramp between
    attention_factor: float = 0.0          # yarn: cos/sin scale (0 = 0.1·ln(factor) + 1)
    truncate: bool = True                  # yarn: the ramp's ends rounded outwards (transformers' default)
    nope_every: int = 0                    # k > 0: every k-th self-attention layer (k-1, 2k-1, ...) skips RoPE
                                           # (NoPE layers, as SmolLM3 / Llama 4); 0 = every layer rotates

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
    """model.attention: how attention scores (the head sizes are model.num_heads / num_kv_heads / head_dim)."""
    scale: str = "rsqrt"                   # logits scale: "rsqrt" = 1/sqrt(H) (the paper) | "none" = 1
    softcap: float = 0.0                   # attention logits (scaled q·k) -> cap · tanh(. / cap) (Gemma 2: 50)
    windows: tuple[int, ...] = ()          # sliding-window (local) self-attention of the decoder, per layer: a
                                           # pattern of windows repeated over the layers, 0 = global; e.g. (128,)
                                           # every layer sees its 128 most recent positions, (128, 0) alternates
    qk_norm: bool = False                  # RMSNorm over H on each query and key head before RoPE (Qwen3, OLMo 2)
    scale_dim: int = 0                     # scale "rsqrt": 1/sqrt(scale_dim) (0 = the head size H; Gemma 2's
                                           # query_pre_attn_scalar)
    kind: str = "softmax"                  # the self-attention module: a name of ATTENTION_KINDS (softmax |
                                           # differential: Ye et al. 2024, nn/differential.py) or your own
                                           # "package.module:Class", a subclass of nn.attention.MultiHeadAttention
                                           # (a research variant is that one file: nn.layers.self_attention)
    options: tuple[str, ...] = ()          # the kind's own knobs, "name=value" each, e.g. ("temperature=10",):
                                           # what its Options declares (nn.attention.MultiHeadAttention.options;
                                           # softmax has none)

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
    """model.moe (jaxformer.ops.moe): with model.ffn='moe', the FFN of every `every`-th block (the last of each
    group of `every`) is `num_experts` experts of width model.d_ff, each token routed to its top_k."""
    num_experts: int = 8                   # E
    top_k: int = 1                         # 1 (Switch) | 2 (GShard, Mixtral)
    every: int = 1                         # MoE on every layer (1) or every n-th (layers must be a multiple of n)

    def validate(self) -> None:
        check_types(self, "model.moe")
        positive("model.moe.num_experts", self.num_experts)
        choice("model.moe.top_k", self.top_k, (1, 2))
        positive("model.moe.every", self.every)


@dataclasses.dataclass(frozen=True)
class AblationConfig(_Validated):
    """model.ablation: wrong on purpose, to measure what the seeds claim (docs/ablations/masking.md). Training
    with either away from its default prints a warning; nothing else should flip them."""
    mask_value: str = "min"                # masked logits: "min" = float32's most negative | "zero" = 0 (leaks)
    causal: str = "tril"                   # decoder self-attention: "tril" = past | "triu" = future (a bug)

    def validate(self) -> None:
        check_types(self, "model.ablation")
        choice("model.ablation.mask_value", self.mask_value, ("min", "zero"))
        choice("model.ablation.causal", self.causal, ("tril", "triu"))


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(_Validated):
    """model.runtime: how the model runs, not the function its weights compute (dtype: its rounding)."""
    # Precision policy. float32: everything. bfloat16/float16 (mixed precision): parameters and optimizer state
    # stay float32, activations and matmul inputs take this dtype, while attention logits and softmax, norms,
    # output logits and the loss are computed in float32.
    dtype: str = "float32"
    param_dtype: str = "float32"           # the parameters' dtype: float32 | bfloat16 (needs dtype=bfloat16; the
                                           # optimizer then keeps a float32 master copy and updates from it:
                                           # train.step.with_master_weights)
    kv_cache_dtype: str = "auto"           # decoding's KV cache: auto (= dtype) | int8 (a float32 scale per slot
                                           # and kv head; keys/values rounded when written)
    attention_backend: str = "reference"   # reference | chunked | cudnn | pallas (ops.attention.BACKENDS)
    attention_block: int = 512             # the chunked backend's tile edge (queries and keys)
    remat: str = "none"                    # recompute in the backward pass, per block: none | full | dots |
                                           # dots_attention (dots: keep the matmul outputs without batch dims,
                                           # recompute the rest; dots_attention: and each attention's output)
    dropout: float = 0.1                   # residual + embedding dropout, training only
    init: str = "glorot"                   # parameter initialisation: glorot | pytorch | gpt2 (jaxformer.nn.init)
    moe_capacity_factor: float = 1.25      # MoE training: slots per expert = ceil(factor·tokens·k/E), overflow
                                           # dropped; 0 = dropless. Inference (eval, decoding) always runs dropless.
    moe_dropless: str = "ragged"           # how dropless MoE runs: ragged (grouped matmuls, M·k rows) | padded
                                           # (every expert over all M token slots: E/k× the work, plain matmuls)

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


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")      # attention projections; the dense FFN's matrices


@dataclasses.dataclass(frozen=True)
class LoraConfig(_Validated):
    """model.lora (jaxformer.nn.lora): low-rank adapters on the layer stacks' projections, trained while every
    other weight stays frozen; with rank r each target W [in,out] computes x·W + (alpha/r)·dropout(x)·A·B, A [in,r],
    B [r,out] from zero (so a fresh adapter changes nothing). Not part of the function the weights compute: an
    export, `train.init_from` and restoring compare models with the adapters merged (`ModelConfig.function`)."""
    rank: int = 0                          # r; 0 = no adapters (every parameter trains)
    alpha: float = 16.0                    # the update's scale is alpha / rank (the LoRA paper's α)
    dropout: float = 0.0                   # on an adapter's input, training only
    targets: tuple[str, ...] = ("q", "v")  # any of q, k, v, o (every attention), gate, up, down (the dense FFN)
    base: str = "float32"                  # the frozen projections: float32 | bfloat16 | int8 (weight-only, one
                                           # scale per output channel: QLoRA's idea with qwix's int8)

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


# The flat model keys before the sections, and where each lives now (configio reads the old names with a warning).
SECTIONED = {
    "norm_position": "norm.position", "norm_type": "norm.type", "norm_eps": "norm.eps", "final_norm": "norm.final",
    "rope_base": "rope.base", "rope_scaling": "rope.scaling", "rope_factor": "rope.factor",
    "rope_original_max_len": "rope.original_max_len", "rope_low_freq_factor": "rope.low_freq_factor",
    "rope_high_freq_factor": "rope.high_freq_factor", "qk_norm": "attention.qk_norm",
    "attention_softcap": "attention.softcap", "attention_scale": "attention.scale",
    "attention_windows": "attention.windows", "num_experts": "moe.num_experts", "moe_top_k": "moe.top_k",
    "moe_every": "moe.every", "ablation_mask_value": "ablation.mask_value", "ablation_causal": "ablation.causal",
    "dtype": "runtime.dtype", "kv_cache_dtype": "runtime.kv_cache_dtype",
    "attention_backend": "runtime.attention_backend", "attention_block": "runtime.attention_block",
    "remat": "runtime.remat", "dropout": "runtime.dropout", "init": "runtime.init",
    "moe_capacity_factor": "runtime.moe_capacity_factor", "moe_dropless": "runtime.moe_dropless",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Validated):
    """Transformer hyper-parameters. Defaults are the 2017 paper's base model (seed 000)."""
    arch: str = "encoder_decoder"          # "encoder_decoder" (Transformer) | "decoder_only" (TransformerLM)
    vocab_size: int = 32000                # V (0 = take it from the data's tokenizer)
    d_model: int = 512                     # D
    num_heads: int = 8                     # N
    num_kv_heads: int | None = None        # K (None = N: multi-head; 1: multi-query; else grouped)
    head_dim: int | None = None            # H (None = D/N); set it for heads whose width N·H is not D
    d_ff: int = 2048                       # F
    num_encoder_layers: int = 6            # L (encoder)
    num_decoder_layers: int = 6            # L (decoder)
    max_len: int = 512                     # longest sequence for table/learned positions
    positional: str = "sinusoidal"         # sinusoidal | learned | rope (model.rope) | alibi | none
    activation: str = "relu"               # relu | gelu | gelu_tanh | swiglu | geglu | geglu_tanh
    ffn: str = "dense"                     # dense | moe (model.moe)
    use_bias: bool = True                  # biases in projections (the paper and PyTorch have them)
    biases: tuple[str, ...] | None = None  # the projections with a bias, replacing use_bias when set: any of
                                           # q, k, v, o (attention), ffn (every FFN matrix); Qwen2: (q, k, v)
    tie_embeddings: bool = True            # output head shares the token embedding
    scale_embeddings: bool = True          # multiply embeddings by sqrt(D) as in the paper
    logit_softcap: float = 0.0             # final logits -> cap · tanh(logits / cap) (Gemma 2: 30); 0 = off
    pad_id: int = 0                        # the tokenizer's padding id: what padding and ignored targets are
                                           # filled with (-1 = none); masks come from segment ids, never from it
    parametrization: str = "sp"            # "sp" (standard) | "mup" (µP, Yang et al. 2022: hyperparameters tuned
                                           # at model.base_width transfer across d_model; `jaxformer.mup`)
    base_width: int = 0                    # µP's base width D₀ (0 = d_model: at its base width µP is SP exactly)
    norm: NormConfig = NormConfig()
    rope: RopeConfig = RopeConfig()
    attention: AttentionConfig = AttentionConfig()
    moe: MoEConfig = MoEConfig()
    ablation: AblationConfig = AblationConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    lora: LoraConfig = LoraConfig()

    def validate(self) -> None:
        check_types(self, "model")
        for section in (self.norm, self.rope, self.attention, self.moe, self.ablation, self.runtime, self.lora):
            section.validate()
        self._check_sizes()
        self._check_choices()
        self._check_layers()
        self._check_lora()
        choice("model.parametrization", self.parametrization, ("sp", "mup"))
        positive("model.base_width", self.base_width, allow_zero=True)
        if self.base_width and self.parametrization != "mup":
            raise ConfigError(f"model.base_width={self.base_width} means nothing with model.parametrization="
                              f"{self.parametrization!r} (set model.parametrization=mup)")
        if self.base_width and self.head_dim is None and self.base_width % self.num_heads:   # as d_model's
            raise ConfigError(f"model.base_width={self.base_width} is not a multiple of model.num_heads="
                              f"{self.num_heads} (µP's base model has heads of base_width / num_heads)")

    def _check_sizes(self) -> None:
        """The architecture and its sizes: layers, heads, widths."""
        choice("model.arch", self.arch, ("encoder_decoder", "decoder_only"))
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size={self.vocab_size!r} must be a positive integer (or 0 = from data)")
        for f in ("d_model", "num_heads", "d_ff", "max_len"):
            v = getattr(self, f)
            if v <= 0:
                raise ConfigError(f"model.{f}={v!r} must be a positive integer")
        for f in ("num_encoder_layers", "num_decoder_layers"):
            v = getattr(self, f)
            if v < 0:
                raise ConfigError(f"model.{f}={v!r} must be an integer >= 0")
        if self.num_decoder_layers == 0:
            raise ConfigError("model.num_decoder_layers=0: every model needs at least one decoder layer")
        if self.arch == "encoder_decoder" and self.num_encoder_layers == 0:
            raise ConfigError("model.num_encoder_layers=0 with model.arch='encoder_decoder'")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(f"model.head_dim={self.head_dim!r} must be a positive integer (or None = D/N)")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not a multiple of model.num_heads={self.num_heads}")
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise ConfigError(f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={kv!r}")
        if self.pad_id < -1 or (self.vocab_size and self.pad_id >= self.vocab_size):
            raise ConfigError(f"model.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size}) "
                              f"(or -1: no token is padding)")

    def _check_choices(self) -> None:
        """The named choices, and what one section asks of another (rope of the head size, a backend of all)."""
        choice("model.positional", self.positional, positional.KINDS)
        choice("model.activation", self.activation, activations.NAMES)
        choice("model.ffn", self.ffn, ("dense", "moe"))
        positive("model.logit_softcap", self.logit_softcap, allow_zero=True)
        if self.biases is not None:
            bad = [b for b in self.biases if b not in BIASES]
            if bad or len(set(self.biases)) != len(self.biases):
                raise ConfigError(f"model.biases={self.biases!r}: expected distinct names of {BIASES}")
        if self.positional == "rope" and self.head_size % 2:
            raise ConfigError(f"model.positional='rope' needs an even head dim; got H={self.head_size}")
        if self.rope.nope_every and self.positional != "rope":
            raise ConfigError(f"model.rope.nope_every={self.rope.nope_every} needs model.positional='rope' "
                              f"(got {self.positional!r})")
        if self.rope.scaling != "none" and self.positional != "rope":
            raise ConfigError(f"model.rope.scaling={self.rope.scaling!r} needs model.positional='rope' "
                              f"(got {self.positional!r})")
        backend = self.runtime.attention_backend
        if self.ablation.mask_value != "min" and backend != "reference":
            raise ConfigError(f"model.ablation.mask_value={self.ablation.mask_value!r} exists only with "
                              f"model.runtime.attention_backend='reference' (got {backend!r})")
        why = fused.problem(backend, dtype=self.runtime.dtype, where="any", bias=self.positional == "alibi",
                            cross=self.arch == "encoder_decoder", window=any(self.attention.windows),
                            softcap=bool(self.attention.softcap))
        if why:
            raise ConfigError(f"model.runtime.attention_backend={backend!r}: {why}")

    def _check_layers(self) -> None:
        """What the layer counts must fit: the window pattern, the MoE period, top-k of the experts."""
        windows = self.attention.windows
        if windows and self.num_decoder_layers % len(windows):
            raise ConfigError(f"model.attention.windows={windows!r}: its pattern of {len(windows)} does not divide "
                              f"model.num_decoder_layers={self.num_decoder_layers}")
        if any(windows) and self.ablation.causal != "tril":
            raise ConfigError(f"model.attention.windows={windows!r} needs the causal decoder "
                              f"(model.ablation.causal='tril'; got {self.ablation.causal!r})")
        if self.ffn != "moe":
            return
        if self.moe.top_k > self.moe.num_experts:
            raise ConfigError(f"model.moe.top_k={self.moe.top_k} exceeds model.moe.num_experts="
                              f"{self.moe.num_experts}")
        stacks = [("num_decoder_layers", self.num_decoder_layers)]
        if self.arch == "encoder_decoder":
            stacks.append(("num_encoder_layers", self.num_encoder_layers))
        for f, n in stacks:
            if n % self.moe.every:
                raise ConfigError(f"model.moe.every={self.moe.every} does not divide model.{f}={n}")

    def _check_lora(self) -> None:
        """What adapters ask of the rest: a dense FFN for FFN targets, a gate for "gate", float32 parameters."""
        lora = self.lora
        if not lora.rank:
            return
        ffn = [t for t in lora.targets if t in ("gate", "up", "down")]
        if ffn and self.ffn == "moe":
            raise ConfigError(f"model.lora.targets={lora.targets!r}: {ffn} adapt a dense FFN; model.ffn='moe' "
                              f"has experts (adapt the attention: q, k, v, o)")
        if "gate" in lora.targets and self.activation not in activations.GATED:
            raise ConfigError(f"model.lora.targets names 'gate', but model.activation={self.activation!r} has "
                              f"no gate projection")
        if self.runtime.param_dtype != "float32":
            raise ConfigError(f"model.runtime.param_dtype={self.runtime.param_dtype!r} with adapters: the frozen "
                              f"weights' precision is model.lora.base (adapters train in float32)")

    @property
    def head_size(self) -> int:   # H
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def width_mult(self) -> float:
        """µP's width multiplier d_model / model.base_width (1.0 under SP or at the base width)."""
        return self.d_model / self.base_width if self.parametrization == "mup" and self.base_width else 1.0

    @property
    def kv_heads(self) -> int:   # K
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def has_bias(self, name: str) -> bool:
        """Whether projection `name` (q, k, v, o or ffn) has a bias: model.biases, else model.use_bias."""
        return name in self.biases if self.biases is not None else self.use_bias

    @property
    def ablations(self) -> list[str]:
        """The ablation switches set away from their correct default, as 'model.ablation.key=value'."""
        a = self.ablation
        return [f"model.ablation.{k}={v!r}" for k, v, ok in (("mask_value", a.mask_value, "min"),
                                                             ("causal", a.causal, "tril")) if v != ok]

    @property
    def use_final_norm(self) -> bool:
        return self.norm.position in ("pre", "sandwich") if self.norm.final is None else self.norm.final

    def per_layer(self, stack: str = "decoder") -> dict[str, tuple | None]:
        """What each layer of `stack` ("encoder" | "decoder") does differently, one tuple per setting with one
        entry per layer (None: no layer differs, the module does as the rest of the config says). The one place
        a per-layer rule is written: `nn.per_layer.settings` indexes these by a block's (traced) layer index, the
        module named beside each setting reads it. A new rule for an existing setting is one line here.
          window: the decoder self-attention's sliding window (0 = global): model.attention.windows repeated.
          rope:   whether a self-attention layer rotates q and k: model.rope.nope_every=k drops RoPE on layers
                  k-1, 2k-1, ... of both stacks (SmolLM3's / Llama 4's NoPE layers).
          softcap: a self-attention layer's logit soft-cap (0 = none; a float per layer, traced by the ops):
                  no rule yet, every layer takes model.attention.softcap.
          scale:  a self-attention layer's logit scale (a float per layer, traced): no rule yet, every layer
                  takes the config's (model.attention.scale, scale_dim, µP)."""
        layers = self.num_decoder_layers if stack == "decoder" else self.num_encoder_layers
        every = self.rope.nope_every if self.positional == "rope" else 0
        return {"window": self.layer_windows() if stack == "decoder" and any(self.attention.windows) else None,
                "rope": tuple((i + 1) % every != 0 for i in range(layers)) if every else None,
                "softcap": None, "scale": None}

    def layer_windows(self) -> tuple[int, ...]:
        """Each decoder layer's self-attention window (0 = global): model.attention.windows repeated."""
        pattern = self.attention.windows or (0,)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_decoder_layers))

    def check_length(self, length: int, what: str = "sequence") -> None:
        """Positions come from a table of model.max_len rows (sinusoidal/learned): refuse longer inputs."""
        if self.positional in ("sinusoidal", "learned") and length > self.max_len:
            raise ConfigError(f"{what} length {length} exceeds model.max_len={self.max_len} "
                              f"(model.positional={self.positional!r} has no position beyond it)")

    def function(self) -> "ModelConfig":
        """This model up to its runtime section and its adapters (merged into the weights they adapt): what
        `train.init_from`, restoring and an export compare."""
        return dataclasses.replace(self, runtime=RuntimeConfig(), lora=LoraConfig())
