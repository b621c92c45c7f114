"""The model's configuration: its sizes and choices at the top, the rest in sections that validate themselves
(`jaxformer.config.sections`).

`model.norm`, `model.rope`, `model.attention`, `model.moe` and `model.ablation` describe the function the weights
compute; `model.runtime` says how it runs (precision, kernels, recomputation, dropout, the initial distribution,
MoE token dropping) and changes neither the parameters' shapes nor what trained weights compute, so
`train.init_from`, restoring a pretrained model and a Hugging Face export compare models up to it
(`ModelConfig.function`). Checks that span sections (a backend and a dtype, windows and the layer count) are
`ModelConfig.validate`'s.
"""
from __future__ import annotations

import dataclasses

from jaxformer.config.checks import _Validated, check_types, choice, positive
from jaxformer.config.sections import (AblationConfig, AttentionConfig, LoraConfig, MoEConfig, NormConfig, RopeConfig,
                                       RuntimeConfig)
from jaxformer.errors import ConfigError
from jaxformer.ops import activations, fused, positional

BIASES = ("q", "k", "v", "o", "ffn")           # the projections model.biases may name

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
    """Transformer hyper-parameters. Defaults are the 2017 paper's base model (seed 000).

    Attributes:
      arch: "encoder_decoder" (`nn.models.Transformer`) | "decoder_only" (`nn.models.TransformerLM`).
      vocab_size: V (0 = take it from the data's tokenizer: `config.run.resolve_vocab`).
      d_model: D, the model width (a multiple of num_heads unless head_dim is set).
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (None = N: multi-head; 1: multi-query; else grouped); divides N.
      head_dim: H (None = D/N); set it for heads whose width N·H is not D.
      d_ff: F, the FFN width (each expert's with model.ffn="moe").
      num_encoder_layers: L of the encoder (>= 1 for "encoder_decoder"; 0 allowed for "decoder_only").
      num_decoder_layers: L of the decoder (>= 1).
      max_len: the longest sequence for "sinusoidal"/"learned" positions (a table of this many rows).
      positional: "sinusoidal" | "learned" | "rope" (model.rope) | "alibi" | "none".
      activation: "relu" | "gelu" | "gelu_tanh" | "swiglu" | "geglu" | "geglu_tanh" (`ops.activations`).
      ffn: "dense" | "moe" (model.moe).
      use_bias: biases in every projection (the paper and PyTorch have them).
      biases: the projections with a bias, replacing use_bias when set: distinct names of BIASES, q, k, v, o
        (attention) and ffn (every FFN matrix); Qwen2: ("q", "k", "v").
      tie_embeddings: the output head shares the token embedding.
      scale_embeddings: multiply embeddings by sqrt(D), as in the paper.
      logit_softcap: final logits -> cap · tanh(logits / cap) (Gemma 2: 30); 0 = off.
      pad_id: the tokenizer's padding id: what padding and ignored targets are filled with (-1 = none; else in
        [0, V)); masks come from segment ids, never from it.
      parametrization: "sp" (standard) | "mup" (µP, Yang et al. 2022: hyperparameters tuned at base_width transfer
        across d_model; `jaxformer.mup`).
      base_width: µP's base width D₀ (0 = d_model: at its base width µP is SP exactly); needs "mup".
      norm: the residual's normalisation (`NormConfig`).
      rope: rotary positions and their scaling (`RopeConfig`).
      attention: how attention scores (`AttentionConfig`).
      moe: the mixture of experts (`MoEConfig`).
      ablation: switches wrong on purpose (`AblationConfig`).
      runtime: how the model runs, not what it computes (`RuntimeConfig`).
      lora: low-rank adapters (`LoraConfig`).

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", d_model=64, num_heads=4, num_kv_heads=2,
      ...                norm__position="pre")
      >>> cfg.head_size, cfg.kv_heads, cfg.use_final_norm
      (16, 2, True)
      >>> replaced(ModelConfig(), d_model=100)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.d_model=100 is not a multiple of model.num_heads=8
    """
    arch: str = "encoder_decoder"          # encoder_decoder | decoder_only
    vocab_size: int = 32000                # V (0 = from the data's tokenizer)
    d_model: int = 512                     # D
    num_heads: int = 8                     # N
    num_kv_heads: int | None = None        # K (None = N)
    head_dim: int | None = None            # H (None = D/N)
    d_ff: int = 2048                       # F
    num_encoder_layers: int = 6            # L (encoder)
    num_decoder_layers: int = 6            # L (decoder)
    max_len: int = 512                     # longest sequence for table/learned positions
    positional: str = "sinusoidal"         # sinusoidal | learned | rope | alibi | none
    activation: str = "relu"               # relu | gelu | gelu_tanh | swiglu | geglu | geglu_tanh
    ffn: str = "dense"                     # dense | moe
    use_bias: bool = True                  # biases in projections
    biases: tuple[str, ...] | None = None  # names of BIASES with a bias (replaces use_bias when set)
    tie_embeddings: bool = True            # output head shares the token embedding
    scale_embeddings: bool = True          # embeddings · sqrt(D)
    logit_softcap: float = 0.0             # cap · tanh(logits / cap); 0 = off
    pad_id: int = 0                        # the tokenizer's padding id (-1 = none)
    parametrization: str = "sp"            # sp | mup
    base_width: int = 0                    # µP's D₀ (0 = d_model)
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
    def head_size(self) -> int:
        """H, each head's width: head_dim, else d_model / num_heads."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def width_mult(self) -> float:
        """µP's width multiplier d_model / model.base_width (1.0 under SP or at the base width)."""
        return self.d_model / self.base_width if self.parametrization == "mup" and self.base_width else 1.0

    @property
    def kv_heads(self) -> int:
        """K, the key/value heads: num_kv_heads, else num_heads."""
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
        """Whether the stack ends in a norm: norm.final, else yes for pre and sandwich norms."""
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
