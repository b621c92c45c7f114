"""The run's sections besides the model: data, optim, train, parallel, and the Config that holds them all."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.axes import LOGICAL_AXES, MESH_AXES
from jaxformer.config.checks import _Validated, check_types, choice, flat_items, positive, seed_range
from jaxformer.config.model import ModelConfig
from jaxformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig(_Validated):
    """What to train on. task: "reverse" | "copy" (digit seq2seq, seed 004) | "text" (char LM, seed 000) |
    "tokens" (an LM on token shards made by `jaxformer data prepare`: data.path is their folder) | "chat"
    (supervised fine-tuning on conversations: data.path a JSONL file of {"messages": [...]}, rendered by the chat
    template of data.tokenizer's folder, the loss on the assistant's tokens only: `jaxformer.data.sft`)."""
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
    context: int = 1                       # context parallelism: every activation's sequence split over it
    context_attention: str = "gather"      # how attention reads the other devices' keys: gather (GSPMD all-gathers
                                           # them) | ring (`ops.context.ring_attention`: blocks passed round)
    context_order: str = "contiguous"      # contiguous | zigzag: device i holds chunks i and 2C-1-i (causal balance)
    expert: int = 1                        # expert parallelism: MoE experts split over it (batch rows too)
    tensor: int = 1
    stage: int = 1                         # pipeline parallelism: stacked layers split over it, a GPipe schedule
    microbatches: int = 1                  # (`jaxformer.nn.pipeline`) over this many micro-batches of each step
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
        if self.mode == "shard_map" and (self.fsdp != 1 or self.tensor != 1 or self.expert != 1 or self.context != 1):
            raise ConfigError(f"parallel.mode='shard_map' is the explicit data-parallel step; it needs "
                              f"parallel.fsdp=1, parallel.context=1, parallel.expert=1 and parallel.tensor=1 (got "
                              f"{self.fsdp}, {self.context}, {self.expert}, {self.tensor})")
        choice("parallel.context_attention", self.context_attention, ("gather", "ring"))
        choice("parallel.context_order", self.context_order, ("contiguous", "zigzag"))
        positive("parallel.microbatches", self.microbatches)
        if self.context_attention == "ring" and self.stage != 1:
            raise ConfigError(f"parallel.context_attention='ring' with parallel.stage={self.stage}: the ring's "
                              f"shard_map does not run inside the pipeline's stages; use 'gather' there")
        if self.stage != 1 and self.mode != "jit":
            raise ConfigError(f"parallel.stage={self.stage} (pipeline parallelism) runs under parallel.mode='jit' "
                              f"(got {self.mode!r})")
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
    old, cur = flat_items(saved), flat_items(new)
    return [f"{k}: {old[k]!r} -> {v!r}" for k, v in cur.items()
            if k.split(".")[0] in RESUME_MUST_MATCH and old[k] != v]


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain JSON-able dict."""
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
