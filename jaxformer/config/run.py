"""The run's sections besides the model: data, optim, train, parallel, and the Config that holds them all."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.config.checks import _Validated, check_types, choice, flat_items, positive, seed_range
from jaxformer.config.model import ModelConfig
from jaxformer.config.parallel import ParallelConfig
from jaxformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig(_Validated):
    """What to train on: the task, its data, the batches and the held-out split.

    Attributes:
      task: "reverse" | "copy" (digit seq2seq, seed 004) | "text" (a character LM, seed 000) | "tokens" (an LM on
        the token shards `jaxformer data prepare` wrote to data.path) | "chat" (supervised fine-tuning on data.path,
        a JSONL file of {"messages": [...]} rendered by data.tokenizer's chat template, the loss on the assistant's
        tokens only: `jaxformer.data.sft`).
      batch_size: rows per step (> 0; a multiple of optim.accumulate).
      seed: the data's seed, an integer in [0, 2**32).
      num_train: reverse/copy: random digit strings to train on (> 0).
      num_eval: reverse/copy: held-out strings, disjoint from the training ones (> 0).
      min_len: reverse/copy: the shortest string (> 0, <= max_len).
      max_len: reverse/copy: the longest string.
      eval_min_len: reverse/copy: the shortest held-out string (None = min_len: train short, test long).
      eval_max_len: reverse/copy: the longest held-out string (None = max_len).
      path: text: a UTF-8 file or "builtin:alice" (shipped with the package); tokens: the shards' folder; chat: the
        JSONL file.
      start: text: the first character used (>= 0).
      num_chars: text: how many characters (None = to the end).
      gutenberg: text: strip the Project Gutenberg header and footer.
      block_size: text, tokens, chat: tokens per row (text and tokens read block_size + 1: the shifted target).
      eval_fraction: text, chat: the held-out share (the contiguous tail; chat: the last conversations), in (0, 1).
      packing: tokens: "windows" (attention crosses documents) | "documents" (it does not).
      eval_tokens: tokens: score the first N held-out tokens (None = all of them).
      tokenizer: chat: a pretrained folder holding tokenizer.json and its chat template.

    Examples:
      >>> from jaxformer.config import DataConfig
      >>> d = DataConfig(min_len=3, max_len=6, eval_max_len=9)
      >>> d.eval_lengths
      (3, 9)
      >>> DataConfig(task="text")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: data.path='' : data.task='text' needs a text file path (or "builtin:alice")
    """
    task: str = "reverse"                  # reverse | copy | text | tokens | chat
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
    # chat: conversations packed into rows of block_size tokens; eval_fraction of them (the last) held out
    tokenizer: str = ""                    # a pretrained folder: tokenizer.json and its chat template

    def validate(self) -> None:
        check_types(self, "data")
        choice("data.task", self.task, ("reverse", "copy", "text", "tokens", "chat"))
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
        if self.task == "chat" and not (self.path and self.tokenizer):
            raise ConfigError(f"data.task='chat' needs data.path (a JSONL file of conversations; got "
                              f"{self.path!r}) and data.tokenizer (the pretrained folder whose tokenizer and chat "
                              f"template render them; got {self.tokenizer!r})")
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
    """The optimizer, its learning-rate schedule and the loss's extra terms.

    Attributes:
      name: "adamw" | "lion" | "muon" (Muon on the attention/FFN matrices, AdamW for the rest) | "schedule_free"
        (schedule-free AdamW: needs schedule "constant", warms up over warmup_steps, evaluates its averaged
        iterate) | "sgd".
      lr: the peak learning rate (> 0).
      schedule: "constant" | "noam" (linear warmup, then inverse sqrt) | "warmup_cosine" | "wsd" (warmup, stable,
        a linear decay over the last decay_fraction).
      warmup_steps: the linear warmup's steps (>= 0).
      decay_fraction: wsd: the share of steps spent decaying to 0, in (0, 1].
      muon_adam_lr: muon: the AdamW part's peak lr (None = lr).
      accumulate: micro-batches per step: data.batch_size rows in k parts, gradients summed and weighted by target
        tokens (equal to one batch exactly); divides data.batch_size; parallel.mode "jit" only.
      weight_decay: decoupled weight decay (>= 0): adamw, lion, muon, schedule_free (not sgd).
      b1: the first-moment (momentum) decay, in [0, 1).
      b2: the second-moment decay, in [0, 1).
      clip_norm: global-norm gradient clipping (>= 0; 0 = off).
      label_smoothing: in [0, 1).
      z_loss: PaLM's output z-loss: + z_loss · log(Z)² per token (1e-4 in PaLM); mean log(Z)² is logged as log_z2
        whenever it is set.
      moe_balance_weight: α · the Switch load-balancing loss of an MoE model, added to the objective.
      moe_z_weight: β · the router z-loss (ST-MoE) of an MoE model, added to the objective.
      weight_decay_mask: "matrices" (projection, FFN and output-head weights only) | "all" parameters.
      ema: the decay of an EMA of the weights, evaluated alongside (eval_ema/*), in [0, 1); 0 = none, e.g. 0.99.

    Examples:
      >>> from jaxformer.config import OptimConfig
      >>> OptimConfig(name="lion", lr=3e-4).lr
      0.0003
      >>> OptimConfig(name="schedule_free")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: optim.schedule='warmup_cosine' with optim.name='schedule_free': ...
    """
    name: str = "adamw"                    # adamw | lion | muon | schedule_free | sgd
    lr: float = 1e-3                       # peak learning rate
    schedule: str = "warmup_cosine"        # constant | noam | warmup_cosine | wsd
    warmup_steps: int = 100
    decay_fraction: float = 0.2            # wsd: the share of steps spent decaying to 0
    muon_adam_lr: float | None = None      # muon: the AdamW part's peak lr (None = optim.lr)
    accumulate: int = 1                    # micro-batches per step
    weight_decay: float = 0.01             # decoupled; not sgd
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0                 # global-norm clipping, 0 = off
    label_smoothing: float = 0.0
    z_loss: float = 0.0                    # + z_loss · log(Z)² per token
    moe_balance_weight: float = 0.01       # α · Switch load-balancing loss
    moe_z_weight: float = 0.001            # β · router z-loss (ST-MoE)
    weight_decay_mask: str = "matrices"    # matrices | all
    ema: float = 0.0                       # 0 = no EMA of the weights

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
    """The training loop: its length, seed, logging, evaluation and checkpoints.

    Attributes:
      steps: optimizer steps (> 0).
      seed: parameter init, dropout and data order derive from it; an integer in [0, 2**32).
      log_every: steps between logged training records (> 0).
      eval_every: steps between evaluations (> 0).
      checkpoint_every: steps between checkpoints (> 0).
      keep_checkpoints: the latest N checkpoints kept (> 0); the best one (by best_metric) is kept apart.
      best_metric: the eval metric that picks the best checkpoint: "loss" | "token_accuracy" | "exact_match"
        (seq2seq tasks only).
      best_mode: "max" | "min": whether the best_metric is better high or low.
      eval_batch_size: rows per evaluation batch (> 0).
      num_examples: decoded examples printed after the final eval.
      peak_flops: per device, for the logged MFU (None = measured once at the start).
      init_from: a fresh run starts from these weights (fine-tuning): a Hugging Face checkpoint folder or a
        jaxformer run directory with the same model ("" = a random init).

    Examples:
      >>> from jaxformer.config import TrainConfig
      >>> TrainConfig(steps=10, best_metric="loss", best_mode="min").steps
      10
      >>> TrainConfig(steps=0)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: train.steps=0 must be a positive integer
    """
    steps: int = 1000
    seed: int = 0                          # parameter init, dropout and data order
    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 250
    keep_checkpoints: int = 2              # latest N kept, and the best
    best_metric: str = "exact_match"       # loss | token_accuracy | exact_match
    best_mode: str = "max"                 # max | min
    eval_batch_size: int = 200
    num_examples: int = 5                  # decoded examples printed after the final eval
    peak_flops: float | None = None        # per device (None = measured)
    init_from: str = ""                    # a Hugging Face folder or a run directory ("" = random init)

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
class Config(_Validated):
    """The whole run: the model and the run's sections, validated together (what `jaxformer.configio` reads).

    Attributes:
      model: the model (`ModelConfig`).
      data: what to train on (`DataConfig`); its task must fit model.arch (seq2seq: encoder_decoder).
      optim: the optimizer (`OptimConfig`).
      train: the training loop (`TrainConfig`).
      parallel: devices and hosts (`ParallelConfig`).

    Examples:
      >>> from jaxformer.config import Config, DataConfig
      >>> Config().model.arch, Config().data.task
      ('encoder_decoder', 'reverse')
      >>> Config(data=DataConfig(task="text", path="builtin:alice"))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.arch='encoder_decoder' does not fit data.task='text' (needs 'decoder_only')
    """
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
        if self.model.runtime.param_dtype != "float32" and self.optim.name == "schedule_free":
            raise ConfigError("model.runtime.param_dtype='bfloat16' with optim.name='schedule_free': schedule-free "
                              "AdamW's evaluation point is read from its own state, which the float32 master copy "
                              "would wrap; use float32 parameters or another optimizer")
        if self.model.parametrization == "mup" and self.optim.name not in ("adamw", "lion"):
            raise ConfigError(f"model.parametrization='mup' with optim.name={self.optim.name!r}: µP's learning-rate "
                              f"rule here is Adam's (and Lion's: updates of a fixed size per coordinate); use "
                              f"optim.name=adamw or lion")
        if k > 1 and self.parallel.mode == "shard_map":
            raise ConfigError(f"optim.accumulate={k} runs under parallel.mode='jit' (every GSPMD strategy); "
                              f"the shard_map step does not accumulate")
        longest = max(self.data.max_len, self.data.eval_lengths[1]) + 1 if seq2seq else self.data.block_size
        self.model.check_length(longest, "data")
        self._check_context_order(seq2seq)

    def _check_context_order(self, seq2seq: bool) -> None:
        """A language model's sequence splits evenly over parallel.context; parallel.context_order='zigzag'
        reorders a language model's training rows (`LanguageModel.balanced`)."""
        c = self.parallel.context
        if c > 1 and not seq2seq and self.data.block_size % c:
            raise ConfigError(f"parallel.context={c}: data.block_size={self.data.block_size} must be a multiple of "
                              f"it (each device holds an equal share of every sequence)")
        if self.parallel.context_order != "zigzag":
            return
        if seq2seq:
            raise ConfigError("parallel.context_order='zigzag' balances a causal language model's sequence; "
                              f"data.task={self.data.task!r} is a seq2seq task: use 'contiguous'")
        if c < 1 or self.data.block_size % (2 * c):
            raise ConfigError(f"parallel.context_order='zigzag' with parallel.context={c}: data.block_size="
                              f"{self.data.block_size} must be a multiple of 2 x parallel.context (a known size; "
                              f"each device holds two of the 2C chunks)")
        if self.model.ffn == "moe" and self.model.runtime.moe_capacity_factor:
            raise ConfigError(f"parallel.context_order='zigzag' with model.runtime.moe_capacity_factor="
                              f"{self.model.runtime.moe_capacity_factor}: which tokens overflow an expert depends "
                              f"on their order; set it 0 (dropless)")


def resolve_vocab(cfg: Config, vocab_size: int, pad_id: int | None = None) -> Config:
    """Fill model.vocab_size from the tokenizer's (0 = take it from the data), or check the configured one.

    Args:
      cfg: the run's config.
      vocab_size: the tokenizer's vocabulary size.
      pad_id: the tokenizer's padding id, which model.pad_id must equal (padding the model ignores must be the
        padding the data writes); None = not checked.

    Returns:
      cfg with model.vocab_size = vocab_size where it was 0, else cfg itself.

    Raises:
      ConfigError: model.pad_id is not pad_id, or model.vocab_size is smaller than vocab_size.

    Examples:
      >>> from jaxformer.config import Config, replaced, resolve_vocab
      >>> resolve_vocab(replaced(Config(), model__vocab_size=0), 13).model.vocab_size
      13
      >>> resolve_vocab(replaced(Config(), model__vocab_size=8), 13)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.vocab_size=8 is smaller than the tokenizer's 13
    """
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
    """The keys of the sections RESUME_MUST_MATCH names (model, data, optim) that differ between two configs.

    Args:
      saved: the resolved config a checkpoint was written with.
      new: the resolved config of the run that resumes it.

    Returns:
      'section.key: old -> new' for each differing key (empty: the run may resume; train.* may change).

    Examples:
      >>> from jaxformer.config import Config, replaced, resume_differences
      >>> resume_differences(Config(), replaced(Config(), optim__lr=3e-4, train__steps=5))
      ['optim.lr: 0.001 -> 0.0003']
    """
    old, cur = flat_items(saved), flat_items(new)
    return [f"{k}: {old[k]!r} -> {v!r}" for k, v in cur.items()
            if k.split(".")[0] in RESUME_MUST_MATCH and old[k] != v]


def to_dict(cfg: Any) -> Any:
    """A config dataclass tree as plain JSON-able dicts.

    Args:
      cfg: a dataclass (a config or any section); any other value is returned as is.

    Returns:
      A dict of the fields, sections as nested dicts (tuples stay tuples: `json.dumps` writes them as lists).

    Examples:
      >>> from jaxformer.config import Config, to_dict
      >>> d = to_dict(Config())
      >>> d["model"]["norm"]["position"], d["train"]["steps"]
      ('post', 1000)
    """
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
