"""Frozen, validated configuration dataclasses (files, overrides and JSON: `jaxformer.configio`).

Every config section is a frozen dataclass with a `validate()` that raises ConfigError naming the field and the
value. Constructing a section validates it; `configio.apply_overrides` validates once, after all overrides, so
the order of `--set` flags never matters.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import typing
from typing import Any

from jaxformer.axes import LOGICAL_AXES, MESH_AXES
from jaxformer.errors import ConfigError
from jaxformer.ops import activations, fused, norms, positional
from jaxformer.ops.attention import BACKENDS

REMAT_POLICIES = ("none", "full", "dots")
BIASES = ("q", "k", "v", "o", "ffn")           # the projections model.biases may name

_DEFERRED = contextvars.ContextVar("jaxformer_config_validation_deferred", default=False)


@contextlib.contextmanager
def _deferred_validation():
    """Inside: constructing or replacing a config section does not validate it (see `apply_overrides`)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class _Validated:
    """Mixin: validate on construction unless deferred."""

    def __post_init__(self):
        if not _DEFERRED.get():
            self.validate()

    def validate(self) -> None:
        raise NotImplementedError


def choice(field: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ConfigError(f"{field}={value!r} is not one of {options}")


def positive(field: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or value != value or value == float("inf"):  # NaN and Inf are not usable either
        raise ConfigError(f"{field}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def seed_range(field: str, value: Any) -> None:
    """A PRNG seed: an integer in [0, 2**32)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 32:
        raise ConfigError(f"{field}={value!r} must be an integer in [0, 2**32)")


def _type_ok(value: Any, typ: Any) -> bool:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(typ))
    if typ is type(None):
        return value is None
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ) if isinstance(typ, type) else True


def check_types(cfg: Any, section: str) -> None:
    """Every field holds a value of its declared type (bool is not an int; an int is a float)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if not _type_ok(v, hints[f.name]):
            want = str(hints[f.name]).replace("<class '", "").replace("'>", "")
            raise ConfigError(f"{section}.{f.name}={v!r} must be of type {want}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
            raise ConfigError(f"{section}.{f.name}={v} does not fit a 64-bit integer (no array or counter holds it)")


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
    dropout: float = 0.1                   # residual + embedding dropout, training only
    norm_position: str = "post"            # "post": LN(x + f(x)) (paper, seed 000) | "pre": x + f(LN(x)) |
                                           # "sandwich": x + LN'(f(LN(x))) | "deepnorm": LN(α·x + f(x)), β init |
                                           # "rezero": x + g·f(x), g from 0 (jaxformer.nn.layers.Residual)
    norm_type: str = "layernorm"           # "layernorm" | "rmsnorm" | any name in ops.norms.NORMS
    norm_eps: float = 1e-5
    final_norm: bool | None = None         # norm after the stack; None = yes for pre and sandwich, else no
    positional: str = "sinusoidal"         # sinusoidal | learned | rope | alibi | none
    rope_base: float = 10000.0
    rope_scaling: str = "none"             # RoPE frequency scaling: none | linear (positions / factor) | llama3
                                           # (Llama 3.1: low frequencies / factor, high kept, a smooth band between)
    rope_factor: float = 1.0               # linear, llama3: the context extension factor
    rope_original_max_len: int = 8192      # llama3: the context the model was pretrained on
    rope_low_freq_factor: float = 1.0      # llama3: wavelengths above original_max_len / this are scaled
    rope_high_freq_factor: float = 4.0     # llama3: wavelengths below original_max_len / this are kept
    qk_norm: bool = False                  # RMSNorm over H on each query and key head before RoPE (Qwen3, OLMo 2)
    activation: str = "relu"               # relu | gelu | gelu_tanh | swiglu | geglu | geglu_tanh
    use_bias: bool = True                  # biases in projections (the paper and PyTorch have them)
    biases: tuple[str, ...] | None = None  # the projections with a bias, replacing use_bias when set: any of
                                           # q, k, v, o (attention), ffn (every FFN matrix); Qwen2: (q, k, v)
    tie_embeddings: bool = True            # output head shares the token embedding
    scale_embeddings: bool = True          # multiply embeddings by sqrt(D) as in the paper
    init: str = "glorot"                   # parameter initialisation: glorot | pytorch | gpt2 (jaxformer.nn.init)
    logit_softcap: float = 0.0             # final logits -> cap · tanh(logits / cap) (Gemma 2: 30); 0 = off
    attention_softcap: float = 0.0         # attention logits (scaled q·k) -> cap · tanh(. / cap) (Gemma 2: 50)
    pad_id: int = 0                        # the token id that is padding; -1 = none is (padding is then only
                                           # explicit: segment ids, or the -1 fill of ragged batches)
    # Precision policy. float32: everything. bfloat16/float16 (mixed precision): parameters and optimizer state
    # stay float32, activations and matmul inputs take this dtype, while attention logits and softmax, norms,
    # output logits and the loss are computed in float32.
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"           # decoding's KV cache: auto (= dtype) | int8 (a float32 scale per slot
                                           # and kv head; keys/values rounded when written)
    attention_backend: str = "reference"   # reference | chunked | cudnn | pallas (ops.attention.BACKENDS)
    attention_block: int = 512             # the chunked backend's tile edge (queries and keys)
    attention_windows: tuple[int, ...] = ()  # sliding-window (local) self-attention of the decoder, per layer: a
                                           # pattern of windows repeated over the layers, 0 = global; e.g. (128,)
                                           # every layer sees its 128 most recent positions, (128, 0) alternates
    remat: str = "none"                    # recompute in the backward pass, per block: none | full | dots
                                           # (dots: keep the matmul outputs without batch dims, recompute the rest)
    attention_scale: str = "rsqrt"         # logits scale: "rsqrt" = 1/sqrt(H) (the paper) | "none" = 1
    # Mixture of Experts (jaxformer.ops.moe): ffn="moe" replaces the FFN of every moe_every-th block (the last of
    # each group of moe_every) by E experts of width d_ff, each token routed to its top-k.
    ffn: str = "dense"                     # dense | moe
    num_experts: int = 8                   # E
    moe_top_k: int = 1                     # 1 (Switch) | 2 (GShard, Mixtral)
    moe_capacity_factor: float = 1.25      # training: slots per expert = ceil(factor·tokens·k/E), overflow dropped;
                                           # 0 = dropless. Inference (eval, decoding) always runs dropless.
    moe_dropless: str = "ragged"           # how dropless MoE runs: ragged (grouped matmuls, M·k rows) | padded
                                           # (every expert over all M token slots: E/k× the work, plain matmuls)
    moe_every: int = 1                     # MoE on every layer (1) or every n-th (layers must be a multiple of n)
    # Ablation switches: wrong on purpose, to measure what the seeds claim (docs/ablations/masking.md).
    # Training with either set to its non-default value prints a warning; nothing else should flip them.
    ablation_mask_value: str = "min"       # masked logits: "min" = float32's most negative | "zero" = 0 (leaks)
    ablation_causal: str = "tril"          # decoder self-attention: "tril" = past | "triu" = future (a bug)

    # The runtime fields: how the model runs, not what it is. They change neither its parameters nor the function
    # they compute (dtype: its rounding), so `train.init_from`, restoring and a Hugging Face export compare models
    # up to these (hf.families.function_of, inference.restore.pretrained_state).
    RUNTIME: typing.ClassVar[tuple[str, ...]] = (
        "dropout", "init", "dtype", "remat", "attention_backend", "attention_block", "kv_cache_dtype",
        "moe_capacity_factor", "moe_dropless")

    def validate(self) -> None:
        check_types(self, "model")
        self._check_sizes()
        self._check_choices()
        self._check_rope()
        self._check_ffn_and_windows()

    def _check_sizes(self) -> None:
        """The architecture and its sizes: layers, heads, widths, dropout."""
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
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} must be in [0, 1)")

    def _check_choices(self) -> None:
        """The named choices (norms, positions, activation, dtype, attention backend) and soft-capping."""
        choice("model.norm_position", self.norm_position, ("pre", "post", "sandwich", "deepnorm", "rezero"))
        choice("model.norm_type", self.norm_type, tuple(norms.NORMS))        # registered norms
        choice("model.positional", self.positional, positional.KINDS)
        choice("model.activation", self.activation, activations.NAMES)
        choice("model.init", self.init, ("glorot", "pytorch", "gpt2"))
        choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        choice("model.attention_scale", self.attention_scale, ("rsqrt", "none"))
        choice("model.kv_cache_dtype", self.kv_cache_dtype, ("auto", "int8"))
        choice("model.attention_backend", self.attention_backend, BACKENDS)
        choice("model.remat", self.remat, REMAT_POLICIES)
        positive("model.attention_block", self.attention_block)
        if self.ablation_mask_value != "min" and self.attention_backend != "reference":
            raise ConfigError(f"model.ablation_mask_value={self.ablation_mask_value!r} exists only with "
                              f"model.attention_backend='reference' (got {self.attention_backend!r})")
        why = fused.problem(self.attention_backend, dtype=self.dtype, where="any", bias=self.positional == "alibi",
                            cross=self.arch == "encoder_decoder", window=any(self.attention_windows),
                            softcap=bool(self.attention_softcap))
        if why:
            raise ConfigError(f"model.attention_backend={self.attention_backend!r}: {why}")
        choice("model.ablation_mask_value", self.ablation_mask_value, ("min", "zero"))
        choice("model.ablation_causal", self.ablation_causal, ("tril", "triu"))
        positive("model.norm_eps", self.norm_eps)
        positive("model.logit_softcap", self.logit_softcap, allow_zero=True)
        positive("model.attention_softcap", self.attention_softcap, allow_zero=True)

    def _check_rope(self) -> None:
        """Rope: its base, an even head dim, its frequency scaling."""
        positive("model.rope_base", self.rope_base)
        if self.positional == "rope" and self.head_size % 2:
            raise ConfigError(f"model.positional='rope' needs an even head dim; got H={self.head_size}")
        choice("model.rope_scaling", self.rope_scaling, positional.SCALINGS)
        positive("model.rope_factor", self.rope_factor)
        positive("model.rope_original_max_len", self.rope_original_max_len)
        positive("model.rope_low_freq_factor", self.rope_low_freq_factor)
        positive("model.rope_high_freq_factor", self.rope_high_freq_factor)
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor}")
        if self.rope_scaling != "none" and self.positional != "rope":
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} needs model.positional='rope' "
                              f"(got {self.positional!r})")

    def _check_ffn_and_windows(self) -> None:
        """Biases, the moe ffn, sliding windows, the padding id."""
        if self.biases is not None:
            bad = [b for b in self.biases if b not in BIASES]
            if bad or len(set(self.biases)) != len(self.biases):
                raise ConfigError(f"model.biases={self.biases!r}: expected distinct names of {BIASES}")
        choice("model.ffn", self.ffn, ("dense", "moe"))
        positive("model.num_experts", self.num_experts)
        choice("model.moe_top_k", self.moe_top_k, (1, 2))
        if self.ffn == "moe" and self.moe_top_k > self.num_experts:
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} exceeds model.num_experts={self.num_experts}")
        positive("model.moe_capacity_factor", self.moe_capacity_factor, allow_zero=True)
        positive("model.moe_every", self.moe_every)
        for w in self.attention_windows:
            if w < 0:
                raise ConfigError(f"model.attention_windows={self.attention_windows!r}: a window must be >= 0 "
                                  f"(0 = global); got {w}")
        if self.attention_windows and self.num_decoder_layers % len(self.attention_windows):
            raise ConfigError(f"model.attention_windows={self.attention_windows!r}: its pattern of "
                              f"{len(self.attention_windows)} does not divide model.num_decoder_layers="
                              f"{self.num_decoder_layers}")
        if any(self.attention_windows) and self.ablation_causal != "tril":
            raise ConfigError(f"model.attention_windows={self.attention_windows!r} needs the causal decoder "
                              f"(model.ablation_causal='tril'; got {self.ablation_causal!r})")
        choice("model.moe_dropless", self.moe_dropless, ("ragged", "padded"))
        if self.ffn == "moe":
            stacks = [("num_decoder_layers", self.num_decoder_layers)]
            if self.arch == "encoder_decoder":
                stacks.append(("num_encoder_layers", self.num_encoder_layers))
            for f, n in stacks:
                if n % self.moe_every:
                    raise ConfigError(f"model.moe_every={self.moe_every} does not divide model.{f}={n}")
        if self.pad_id < -1 or (self.vocab_size and self.pad_id >= self.vocab_size):
            raise ConfigError(f"model.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size}) "
                              f"(or -1: no token is padding)")

    @property
    def head_size(self) -> int:   # H
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def has_bias(self, name: str) -> bool:
        """Whether projection `name` (q, k, v, o or ffn) has a bias: model.biases, else model.use_bias."""
        return name in self.biases if self.biases is not None else self.use_bias

    def rope(self) -> "positional.RopeScaling | None":
        """The RoPE frequency scaling of this config (None: plain RoPE)."""
        if self.rope_scaling == "none":
            return None
        return positional.RopeScaling(self.rope_scaling, self.rope_factor, self.rope_original_max_len,
                                      self.rope_low_freq_factor, self.rope_high_freq_factor)

    @property
    def kv_heads(self) -> int:   # K
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ablations(self) -> list[str]:
        """The ablation switches set away from their correct default, as 'model.key=value'."""
        return [f"model.{k}={v!r}" for k, v, ok in (("ablation_mask_value", self.ablation_mask_value, "min"),
                                                    ("ablation_causal", self.ablation_causal, "tril")) if v != ok]

    @property
    def use_final_norm(self) -> bool:
        return self.norm_position in ("pre", "sandwich") if self.final_norm is None else self.final_norm

    def layer_windows(self) -> tuple[int, ...]:
        """Each decoder layer's self-attention window (0 = global): model.attention_windows repeated."""
        pattern = self.attention_windows or (0,)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_decoder_layers))

    def check_length(self, length: int, what: str = "sequence") -> None:
        """Positions come from a table of model.max_len rows (sinusoidal/learned): refuse longer inputs."""
        if self.positional in ("sinusoidal", "learned") and length > self.max_len:
            raise ConfigError(f"{what} length {length} exceeds model.max_len={self.max_len} "
                              f"(model.positional={self.positional!r} has no position beyond it)")


@dataclasses.dataclass(frozen=True)
class DataConfig(_Validated):
    """What to train on. task: "reverse" | "copy" (digit seq2seq, seed 004) | "text" (char LM, seed 000) |
    "tokens" (an LM on token shards made by `jaxformer data prepare`: data.path is their folder)."""
    task: str = "reverse"
    batch_size: int = 32
    seed: int = 0
    # reverse / copy: random digit strings, a train set and a disjoint held-out set
    num_train: int = 1000
    num_eval: int = 200
    min_len: int = 3
    max_len: int = 6
    eval_min_len: int | None = None        # None = min_len (train short, test long)
    eval_max_len: int | None = None        # None = max_len
    # text: any UTF-8 file, a character slice, blocks of block_size (+1 for the shifted target)
    path: str = ""                         # a UTF-8 file, or "builtin:alice" (shipped with the package)
    start: int = 0
    num_chars: int | None = 10000          # None = to the end
    gutenberg: bool = True                 # strip the Project Gutenberg header/footer
    block_size: int = 10
    eval_fraction: float = 0.1             # contiguous tail held out
    # tokens: windows of block_size + 1 tokens; packing "windows" (attention crosses documents) or "documents"
    packing: str = "windows"
    eval_tokens: int | None = None         # tokens: score the first N held-out tokens (None = all of them)

    def validate(self) -> None:
        check_types(self, "data")
        choice("data.task", self.task, ("reverse", "copy", "text", "tokens"))
        choice("data.packing", self.packing, ("windows", "documents"))
        seed_range("data.seed", self.seed)
        for f in ("batch_size", "num_train", "num_eval", "min_len", "max_len", "block_size"):
            v = getattr(self, f)
            if v <= 0:
                raise ConfigError(f"data.{f}={v!r} must be a positive integer")
        if self.min_len > self.max_len:
            raise ConfigError(f"data.min_len={self.min_len} > data.max_len={self.max_len}")
        if self.eval_lengths[0] > self.eval_lengths[1] or self.eval_lengths[0] <= 0:
            raise ConfigError(f"data.eval_min_len/eval_max_len={self.eval_lengths} is not a valid range")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction!r} must be in (0, 1)")
        if self.task == "text" and not self.path:
            raise ConfigError("data.path='' : data.task='text' needs a text file path (or \"builtin:alice\")")
        if self.task == "tokens" and not self.path:
            raise ConfigError("data.path='' : data.task='tokens' needs the folder `jaxformer data prepare` wrote")
        if self.num_chars is not None and self.num_chars <= 0:
            raise ConfigError(f"data.num_chars={self.num_chars!r} must be positive or None")
        if self.start < 0:
            raise ConfigError(f"data.start={self.start!r} must be >= 0")
        if self.eval_tokens is not None and self.eval_tokens < 1:
            raise ConfigError(f"data.eval_tokens={self.eval_tokens!r} must be positive or None (all)")

    @property
    def eval_lengths(self) -> tuple[int, int]:
        return (self.min_len if self.eval_min_len is None else self.eval_min_len,
                self.max_len if self.eval_max_len is None else self.eval_max_len)


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Validated):
    name: str = "adamw"                    # adamw | lion | muon (attention/FFN matrices; AdamW for the rest) |
                                           # schedule_free (schedule-free AdamW: optim.schedule must be constant;
                                           # linear warmup over warmup_steps; evaluates its averaged iterate) | sgd
    lr: float = 1e-3                       # peak learning rate
    schedule: str = "warmup_cosine"        # constant | noam (linear warmup, then inverse sqrt) | warmup_cosine |
                                           # wsd (warmup, stable, linear decay over the last decay_fraction)
    warmup_steps: int = 100
    decay_fraction: float = 0.2            # wsd: the share of steps spent decaying to 0
    muon_adam_lr: float | None = None      # muon: the AdamW part's peak lr (None = optim.lr)
    accumulate: int = 1                    # micro-batches per step: data.batch_size rows in k parts, gradients
                                           # summed and weighted by target tokens (equal to one batch exactly)
    weight_decay: float = 0.01             # decoupled; adamw, lion, muon, schedule_free (not sgd)
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0                 # global-norm clipping, 0 = off
    label_smoothing: float = 0.0
    z_loss: float = 0.0                    # PaLM's output z-loss: + z_loss · log(Z)² per token (1e-4 in PaLM);
                                           # mean log(Z)² is logged as log_z2 whenever it is set
    moe_balance_weight: float = 0.01       # α · Switch load-balancing loss of an MoE model, added to the objective
    moe_z_weight: float = 0.001            # β · router z-loss (ST-MoE) of an MoE model, added to the objective
    weight_decay_mask: str = "matrices"    # matrices: projection/FFN/output-head weights only | all parameters
    ema: float = 0.0                       # decay of an EMA of the weights, evaluated alongside (eval_ema/*);
                                           # 0 = none, e.g. 0.99

    def validate(self) -> None:
        check_types(self, "optim")
        choice("optim.name", self.name, ("adamw", "lion", "muon", "schedule_free", "sgd"))
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"optim.ema={self.ema!r} must be in [0, 1) (0 = no EMA)")
        if self.name == "schedule_free" and self.schedule != "constant":
            raise ConfigError(f"optim.schedule={self.schedule!r} with optim.name='schedule_free': schedule-free "
                              "AdamW replaces the decay; set optim.schedule=constant (its warmup is "
                              "optim.warmup_steps)")
        if self.name == "schedule_free" and self.ema:
            raise ConfigError(f"optim.ema={self.ema!r} with optim.name='schedule_free': schedule-free AdamW "
                              "already evaluates an average of its iterates; set optim.ema=0")
        choice("optim.schedule", self.schedule, ("constant", "noam", "warmup_cosine", "wsd"))
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction={self.decay_fraction!r} must be in (0, 1]")
        if self.muon_adam_lr is not None:
            positive("optim.muon_adam_lr", self.muon_adam_lr)
        positive("optim.accumulate", self.accumulate)
        choice("optim.weight_decay_mask", self.weight_decay_mask, ("matrices", "all"))
        positive("optim.lr", self.lr)
        for f in ("b1", "b2"):
            v = getattr(self, f)
            if not 0.0 <= v < 1.0:                               # NaN fails this too
                raise ConfigError(f"optim.{f}={v!r} must be in [0, 1)")
        for f in ("warmup_steps", "weight_decay", "clip_norm"):
            positive(f"optim.{f}", getattr(self, f), allow_zero=True)
        positive("optim.z_loss", self.z_loss, allow_zero=True)
        positive("optim.moe_balance_weight", self.moe_balance_weight, allow_zero=True)
        positive("optim.moe_z_weight", self.moe_z_weight, allow_zero=True)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"optim.label_smoothing={self.label_smoothing!r} must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Validated):
    steps: int = 1000
    seed: int = 0                          # parameter init, dropout and data order derive from it
    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 250
    keep_checkpoints: int = 2              # latest N kept; the best one (by best_metric) is kept apart
    best_metric: str = "exact_match"       # an eval metric name
    best_mode: str = "max"                 # max | min
    eval_batch_size: int = 200
    num_examples: int = 5                  # decoded examples printed after the final eval
    peak_flops: float | None = None        # per device, for the logged MFU (None = measured once at the start)
    init_from: str = ""                    # a fresh run starts from these weights (fine-tuning): a Hugging Face
                                           # checkpoint folder or a jaxformer run directory with the same model

    def validate(self) -> None:
        check_types(self, "train")
        seed_range("train.seed", self.seed)
        for f in ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "eval_batch_size"):
            v = getattr(self, f)
            if v <= 0:
                raise ConfigError(f"train.{f}={v!r} must be a positive integer")
        choice("train.best_mode", self.best_mode, ("max", "min"))
        if self.peak_flops is not None:
            positive("train.peak_flops", self.peak_flops)
        choice("train.best_metric", self.best_metric, ("loss", "token_accuracy", "exact_match"))




@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Validated):
    """How one step runs over many devices and hosts: a mesh (data × fsdp × expert × tensor) and rules that map logical
    axes onto it (the table: `jaxformer.parallel.RULES`, printed by `jaxformer plan`)."""
    mode: str = "jit"                      # jit: GSPMD over the mesh | shard_map: explicit per-device data parallel
    data: int = -1                         # mesh axis sizes; one may be -1 = the devices left
    fsdp: int = 1
    expert: int = 1                        # expert parallelism: MoE experts split over it (batch rows too)
    tensor: int = 1
    rules: tuple[str, ...] = ()            # overrides of the rule table: "logical:axis[+axis]" ("logical:" = none)
    distributed: str = "auto"              # auto (when configured or launched by SLURM/Open MPI) | on | off
    coordinator: str = ""                  # host:port of process 0 (else $JAX_COORDINATOR_ADDRESS or detected)
    num_processes: int | None = None       # else $JAX_NUM_PROCESSES or detected
    process_id: int | None = None          # else $JAX_PROCESS_ID or detected
    heartbeat_timeout_s: int = 100         # a process that stops answering fails the others after this long

    def validate(self) -> None:
        check_types(self, "parallel")
        choice("parallel.mode", self.mode, ("jit", "shard_map"))
        choice("parallel.distributed", self.distributed, ("auto", "on", "off"))
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        for a, v in sizes.items():
            if v == 0 or v < -1:
                raise ConfigError(f"parallel.{a}={v} must be a positive mesh axis size or -1 (the devices left)")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ConfigError(f"parallel: only one mesh axis size may be -1; got {sizes}")
        if self.mode == "shard_map" and (self.fsdp != 1 or self.tensor != 1 or self.expert != 1):
            raise ConfigError(f"parallel.mode='shard_map' is the explicit data-parallel step; it needs "
                              f"parallel.fsdp=1, parallel.expert=1 and parallel.tensor=1 (got {self.fsdp}, "
                              f"{self.expert}, {self.tensor})")
        for r in self.rules:
            logical, sep, axes = r.partition(":")
            if not sep:
                raise ConfigError(f"parallel.rules entry {r!r} must look like 'logical:axis[+axis]'")
            if logical not in LOGICAL_AXES:
                raise ConfigError(f"parallel.rules entry {r!r} names an unknown logical axis {logical!r} "
                                  f"(known: {LOGICAL_AXES})")
            for a in filter(None, axes.split("+")):
                if a not in MESH_AXES:
                    raise ConfigError(f"parallel.rules entry {r!r} names an unknown mesh axis {a!r} "
                                      f"(mesh axes: {MESH_AXES})")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"parallel.num_processes={self.num_processes} must be >= 1")
        if self.process_id is not None and self.num_processes is None:
            raise ConfigError(f"parallel.process_id={self.process_id} needs parallel.num_processes (how many "
                              f"processes the run has)")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or self.process_id + 1):
            raise ConfigError(f"parallel.process_id={self.process_id} must be in [0, parallel.num_processes)")
        positive("parallel.heartbeat_timeout_s", self.heartbeat_timeout_s)


@dataclasses.dataclass(frozen=True)
class Config(_Validated):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()

    def validate(self) -> None:
        check_types(self, "config")
        for section in (self.model, self.data, self.optim, self.train, self.parallel):
            section.validate()
        seq2seq = self.data.task in ("reverse", "copy")
        want = "encoder_decoder" if seq2seq else "decoder_only"
        if self.model.arch != want:
            raise ConfigError(f"model.arch={self.model.arch!r} does not fit data.task={self.data.task!r} "
                              f"(needs {want!r})")
        if not seq2seq and self.train.best_metric == "exact_match":
            raise ConfigError("train.best_metric='exact_match' needs a seq2seq task; use 'loss' or 'token_accuracy'")
        k = self.optim.accumulate
        if self.data.batch_size % k:
            raise ConfigError(f"optim.accumulate={k} does not divide data.batch_size={self.data.batch_size} "
                              f"(each step's rows are split into {k} equal micro-batches)")
        if k > 1 and self.parallel.mode == "shard_map":
            raise ConfigError(f"optim.accumulate={k} runs under parallel.mode='jit' (every GSPMD strategy); "
                              f"the shard_map step does not accumulate")
        longest = max(self.data.max_len, self.data.eval_lengths[1]) + 1 if seq2seq else self.data.block_size
        self.model.check_length(longest, "data")


def resolve_vocab(cfg: Config, vocab_size: int, pad_id: int | None = None) -> Config:
    """Fill model.vocab_size from the tokenizer's `vocab_size` (0 = take it from the data), or check that the
    configured one is large enough; pad_id: the tokenizer's, which model.pad_id must equal (padding the model
    ignores must be the padding the data writes)."""
    if pad_id is not None and cfg.model.pad_id != pad_id:
        raise ConfigError(f"model.pad_id={cfg.model.pad_id} is not the tokenizer's pad id {pad_id}: the model would "
                          f"attend to the data's padding and ignore a real token; set model.pad_id={pad_id}")
    if cfg.model.vocab_size == 0:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return cfg


# Sections that must match to resume from a checkpoint (train.* may change, e.g. more steps).
RESUME_MUST_MATCH = ("model", "data", "optim")


def resume_differences(saved: Config, new: Config) -> list[str]:
    """'section.key: old -> new' for every key of RESUME_MUST_MATCH that differs between two resolved configs."""
    old, cur = to_dict(saved), to_dict(new)
    return [f"{sec}.{k}: {old[sec][k]!r} -> {v!r}" for sec in RESUME_MUST_MATCH for k, v in cur[sec].items()
            if old[sec][k] != v]


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain JSON-able dict."""
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
