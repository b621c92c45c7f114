"""The parallel plan: a device mesh (stage × data × fsdp × context × expert × tensor) and one rule table mapping
logical axes onto it.

Parameters carry logical axis names (`jaxformer.nn.params`); activations and the KV cache are constrained with
`constrain(x, names)`. The same table shards both, so a strategy is a choice of mesh sizes, not code:

    data parallel   parallel.data=N          batch split N ways; parameters replicated; gradients all-reduced
    FSDP            parallel.fsdp=N          batch and parameters (their "embed" dim) split N ways; each layer's
                                             weights all-gathered where used, gradients reduce-scattered
    tensor (TP)     parallel.tensor=N        heads, FFN width and vocab split N ways (Megatron): activations
                                             all-reduced after the attention output and FFN projections
    expert (EP)     parallel.expert=N        MoE experts split N ways (and the batch, as data parallel elsewhere):
                                             tokens reach their experts' devices through collectives GSPMD inserts
    pipeline (PP)   parallel.stage=N         stacked layers split N ways; a GPipe schedule over
                    parallel.microbatches=M  M micro-batches (`jaxformer.nn.pipeline`): each stage's activations
                                             passed on to the next by a collective-permute
    combinations    e.g. data=2 tensor=4     the mesh's axes compose
    shard_map       parallel.mode=shard_map  explicit per-device data-parallel step (`train.step`)

GSPMD (`jax.jit` with the shardings below) inserts the collectives. Everything is checked before compiling:
mesh sizes against the device count, rules against known axes, every sharded dimension against its mesh axes.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxformer.axes import LOGICAL_AXES, MESH_AXES
from jaxformer.config import ParallelConfig
from jaxformer.errors import ConfigError

# logical axis -> mesh axes (in order). Parameter axes: vocab, embed, q_heads, kv_heads, head_dim, mlp, layers, expert.
# Activation axes: batch, length, act_embed (and q_heads/kv_heads/mlp/vocab for activations of those dims).
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),  # activations, batches, the KV cache's rows
    "length": ("context",),         # T / S: context parallelism splits the sequence of every activation
    "vocab": ("tensor",),           # embedding rows, output head columns, logits
    "embed": ("fsdp",),             # a parameter's D: FSDP shards every weight along it
    "act_embed": (),                # an activation's D (its batch is already split over fsdp)
    "q_heads": ("tensor",),         # N
    "kv_heads": ("tensor",),        # K (parameters and the KV cache)
    "head_dim": (),                 # H
    "mlp": ("tensor",),             # F
    "layers": ("stage",),           # L: the stacked layer axis; pipeline stages each hold L/stage layers
    "cache_slots": (),              # the KV cache's S
    "expert": ("expert",),          # E: MoE expert weights (expert parallelism)
}
assert set(RULES) == set(LOGICAL_AXES)


def rules_for(cfg: ParallelConfig) -> dict[str, tuple[str, ...]]:
    """RULES with the config's overrides ("logical:axis+axis") applied."""
    rules = dict(RULES)
    for r in cfg.rules:
        logical, _, axes = r.partition(":")
        rules[logical] = tuple(a for a in axes.split("+") if a)
    return rules


def rules_table(cfg: ParallelConfig = ParallelConfig()) -> str:
    """The rule table as Markdown (README, `jaxformer plan`)."""
    rows = ["| logical axis | mesh axes |", "|---|---|"]
    rows += [f"| {k} | {' × '.join(v) if v else '— (replicated)'} |" for k, v in rules_for(cfg).items()]
    return "\n".join(rows)


def mesh_shape(cfg: ParallelConfig, num_devices: int) -> dict[str, int]:
    """{axis: size} with -1 resolved; ConfigError unless the sizes multiply to num_devices."""
    sizes = {a: getattr(cfg, a) for a in MESH_AXES}
    known = math.prod(v for v in sizes.values() if v != -1)
    for a, v in sizes.items():
        if v == -1:
            if num_devices % known:
                raise ConfigError(f"parallel: {num_devices} devices cannot be split as {sizes} "
                                  f"({num_devices} is not a multiple of {known})")
            sizes[a] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"parallel mesh {sizes} needs {math.prod(sizes.values())} devices; "
                          f"{num_devices} are available (set one size to -1 to use the rest)")
    return sizes


class Plan:
    """A mesh plus the rule table: shardings for parameters, optimizer state, batches and activations."""

    def __init__(self, cfg: ParallelConfig, devices=None):
        devices = jax.devices() if devices is None else list(devices)
        self.cfg, self.rules = cfg, rules_for(cfg)
        self.sizes = mesh_shape(cfg, len(devices))
        self.mesh = jax.make_mesh(tuple(self.sizes.values()), MESH_AXES, devices=devices,
                                  axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
        self.replicated = NamedSharding(self.mesh, P())

    @property
    def mode(self) -> str:
        return self.cfg.mode

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.rules["batch"]

    @property
    def batch_shards(self) -> int:
        """How many ways a batch's rows are split."""
        return math.prod(self.sizes[a] for a in self.batch_axes)

    def spec(self, names, shape=None, *, strict: bool = True, what: str = "array") -> P:
        """Logical names (one per dim, None = not sharded) -> PartitionSpec. A mesh axis is used at most once.
        With a shape: strict raises ConfigError when a dim is not divisible by its mesh axes; lenient drops
        those axes for that dim (activation hints, e.g. an odd decode batch)."""
        used, out = set(), []
        for i, name in enumerate(names):
            axes = tuple(a for a in (self.rules[name] if name else ()) if a not in used and self.sizes[a] > 1)
            n = math.prod(self.sizes[a] for a in axes)
            if shape is not None and axes and shape[i] % n:
                if strict:
                    raise ConfigError(f"{what}: dimension {i} ({name}) of shape {tuple(shape)} is {shape[i]}, not "
                                      f"divisible by mesh axes {'×'.join(axes)} = {n}; change the model/batch size, "
                                      f"the mesh, or the rule (parallel.rules={name}:...)")
                axes = ()
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else (axes or None))
        return P(*out)

    def sharding(self, names, shape=None, **kw) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names, shape, **kw))

    def state_shardings(self, state: Any) -> Any:
        """The same pytree as an nnx State (or a dict of them) with each array replaced by its NamedSharding,
        from the variable's logical axes (optimizer moments inherit their parameter's); anything without axes
        (step counters, the sinusoidal table) is replicated. ConfigError for an indivisible dimension."""
        def one(path, v):
            names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
            value = v.get_value() if isinstance(v, nnx.Variable) else v
            if not jax.tree.leaves(value):           # an empty node (optax's MaskedNode: Muon's non-matrices)
                return v
            what = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
            several = len(jax.tree.leaves(value)) > 1          # e.g. an int8 weight: values and scales

            def spec(leaf):
                shape = getattr(leaf, "shape", ())
                if self.mode == "shard_map" or not names or len(names) != len(shape):
                    return self.replicated
                axes = tuple(None if several and d == 1 else n for n, d in zip(names, shape))  # a scale's 1s
                return self.sharding(axes, shape, what=what)
            sh = jax.tree.map(spec, value)
            return v.replace(sh) if isinstance(v, nnx.Variable) else sh
        return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Rows over the batch axes, the rest replicated."""
        return NamedSharding(self.mesh, P(self.batch_axes or None, *([None] * (ndim - 1))))

    def check_batch(self, rows: int, what: str) -> None:
        if rows % self.batch_shards:
            raise ConfigError(f"{what}={rows} is not divisible by the {self.batch_shards} batch shards "
                              f"({'×'.join(self.batch_axes)} of mesh {self.sizes})")

    def check_pipeline(self, cfg) -> None:
        """With parallel.stage > 1 (`jaxformer.nn.pipeline`): ConfigError for a MoE model (a pipelined stack
        returns no router statistics), and unless every layer stack's layers split evenly over the stages and each
        step's rows (data.batch_size over optim.accumulate) split into parallel.microbatches micro-batches that
        split over the batch shards. `cfg`: a Config."""
        stages, m = self.sizes["stage"], self.cfg.microbatches
        if stages == 1:
            return
        model = cfg.model
        if model.ffn == "moe":
            raise ConfigError(f"parallel.stage={stages} with model.ffn='moe': a pipelined stack returns no "
                              f"router statistics (`jaxformer.nn.pipeline`); use parallel.stage=1")
        stacks = {"model.num_decoder_layers": model.num_decoder_layers}
        if model.arch == "encoder_decoder":
            stacks["model.num_encoder_layers"] = model.num_encoder_layers
        for field, layers in stacks.items():
            if layers % stages:
                raise ConfigError(f"{field}={layers} is not divisible by parallel.stage={stages}: each pipeline "
                                  f"stage holds an equal share of the layers")
        rows = cfg.data.batch_size // cfg.optim.accumulate
        if rows % (m * self.batch_shards):
            raise ConfigError(f"parallel.microbatches={m}: data.batch_size={cfg.data.batch_size} (over "
                              f"optim.accumulate={cfg.optim.accumulate}: {rows} rows a step) is not divisible by "
                              f"{m} micro-batches × {self.batch_shards} batch shards "
                              f"({'×'.join(self.batch_axes)} of mesh {self.sizes})")

    def local_rows(self, rows: int) -> slice:
        """The rows of a [rows, ...] batch that this process's devices hold (a process reads only those)."""
        index = self.batch_sharding(1).addressable_devices_indices_map((rows,))
        starts = [i[0].start or 0 for i in index.values()]
        stops = [rows if i[0].stop is None else i[0].stop for i in index.values()]
        return slice(min(starts), max(stops))

    def global_batch(self, local: dict[str, np.ndarray], rows: int) -> dict[str, jax.Array]:
        """This process's rows (`local_rows`) of each array -> global arrays of `rows` rows, sharded by batch."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding(v.ndim), v, (rows, *v.shape[1:]))
                for k, v in local.items()}

    @contextlib.contextmanager
    def use(self):
        """Inside: `constrain` applies this plan's rules, and jax's context mesh is this mesh."""
        token = _ACTIVE.set(self)
        try:
            with jax.set_mesh(self.mesh):
                yield self
        finally:
            _ACTIVE.reset(token)

    def describe(self) -> str:
        extra = []
        if self.sizes["context"] > 1:
            extra.append(f"context attention {self.cfg.context_attention}, order {self.cfg.context_order}")
        if self.sizes["stage"] > 1:
            m, p = self.cfg.microbatches, self.sizes["stage"]
            extra.append(f"{m} micro-batches, bubble {(p - 1) / (m + p - 1):.2f}")
        return " × ".join(f"{a} {n}" for a, n in self.sizes.items()) + f" ({', '.join([self.mode, *extra])})"


_ACTIVE: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jaxformer_plan", default=None)


def active_plan() -> "Plan | None":
    """The plan whose `use()` block this code runs in (None outside one)."""
    return _ACTIVE.get()


def abstract_with_shardings(state: Any, plan: "Plan | None" = None) -> Any:
    """An abstract state (ShapeDtypeStructs, e.g. from nnx.eval_shape) with shardings: the plan's rules, or
    without a plan this process's first device. What a state is created or restored into."""
    if plan is not None:
        shardings = plan.state_shardings(state)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def no_mesh():
    """A context without jax's mesh: nnx.eval_shape would otherwise read the parameters' logical axis names
    as mesh axes."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """A sharding constraint from logical names under the active plan (identity without one, and inside
    shard_map's per-device code). Dims not divisible by their mesh axes are left unsharded."""
    plan = _ACTIVE.get()
    if plan is None or plan.mode == "shard_map" or math.prod(plan.sizes.values()) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, plan.sharding(names, x.shape, strict=False))


def replicate(x):
    """Constrain every array of a pytree to be replicated under the active plan (so every process can read it)."""
    plan = _ACTIVE.get()
    if plan is None or plan.mode == "shard_map":
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, plan.replicated), x)


def shard_bytes(tree: Any) -> dict[str, int]:
    """{"total": logical bytes, "per_device_max": the largest sum of shard bytes held by one device}."""
    per: dict[Any, int] = {}
    total = 0
    for a in jax.tree.leaves(tree):
        total += a.size * a.dtype.itemsize
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.size * s.data.dtype.itemsize
    return {"total": total, "per_device_max": max(per.values(), default=0)}


def _free_bytes(device) -> int | None:
    """Memory a device can still take: the host's available memory for a CPU device (shared by all of them),
    the allocator's limit for an accelerator; None where unknown."""
    if device.platform == "cpu":
        try:
            for line in open("/proc/meminfo"):
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:       # noqa: BLE001 (a backend without memory statistics)
        return None


def min_param_bytes(cfg) -> tuple[int, int]:
    """(parameter bytes, host bytes) that a model of `cfg` (a ModelConfig) needs at least, by arithmetic: its
    embedding (and untied head), the attention and FFN matrices of every layer in float32 (norms and biases left
    out: a lower bound), and the host's float64 copy of a sinusoidal table while it is built."""
    d, n, k, h, f, v = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size
    attn = 2 * d * n * h + 2 * d * k * h
    ffn = (3 if cfg.activation in ("swiglu", "geglu", "geglu_tanh") else 2) * d * f
    moe_layers = cfg.num_decoder_layers // cfg.moe.every if cfg.ffn == "moe" else 0
    dec = cfg.num_decoder_layers * attn + (cfg.num_decoder_layers - moe_layers) * ffn \
        + moe_layers * cfg.moe.num_experts * ffn
    enc = cfg.num_encoder_layers * (attn + ffn) if cfg.arch == "encoder_decoder" else 0
    cross = cfg.num_decoder_layers * attn if cfg.arch == "encoder_decoder" else 0
    table = cfg.max_len * d if cfg.positional == "learned" else 0
    params = v * d * (1 if cfg.tie_embeddings else 2) + enc + dec + cross + table + _lora_params(cfg)
    return 4 * params, (8 * cfg.max_len * d if cfg.positional == "sinusoidal" else 0)


def _lora_params(cfg) -> int:
    """model.lora's adapter parameters: r·(in + out) per target projection of every attention (self, cross,
    the encoder's) and dense FFN layer (`jaxformer.nn.lora`)."""
    r, d, f = cfg.lora.rank, cfg.d_model, cfg.d_ff
    if not r:
        return 0
    nh, kh = cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    sizes = {"q": d + nh, "k": d + kh, "v": d + kh, "o": nh + d, "gate": d + f, "up": d + f, "down": f + d}
    attn = sum(sizes[t] for t in cfg.lora.targets if t in ("q", "k", "v", "o"))
    ffn = sum(sizes[t] for t in cfg.lora.targets if t in ("gate", "up", "down"))
    enc = cfg.num_encoder_layers if cfg.arch == "encoder_decoder" else 0
    attentions = cfg.num_decoder_layers * (2 if enc else 1) + enc
    return r * (attentions * attn + (cfg.num_decoder_layers + enc) * ffn)       # FFN targets: dense FFNs only


def check_model_size(cfg) -> None:
    """ConfigError when a model of `cfg` cannot fit the memory of this process's devices together (or its
    positional table the host's), counted by arithmetic (`min_param_bytes`) before anything is built: an
    impossible size is named instead of ending in numpy's or XLA's allocation error."""
    need, host = min_param_bytes(cfg)
    devices = jax.local_devices()
    cpu = [d for d in devices if d.platform == "cpu"]
    free = [_free_bytes(cpu[0])] if cpu else []
    free += [_free_bytes(d) for d in devices if d.platform != "cpu"]
    if any(x is None for x in free) or not free:
        return
    host_free = _free_bytes(cpu[0]) if cpu else None
    gib = lambda x: f"{x / 2 ** 30:,.1f} GiB"                          # noqa: E731
    over = ([f"{gib(need)} for its parameters ({gib(sum(free))} in this process's memory)"] if need > sum(free)
            else []) + ([f"{gib(host)} of host memory for its sinusoidal table ({gib(host_free)} available)"]
                        if host_free is not None and host > host_free else [])
    if over:
        raise ConfigError(f"the model (model.d_model={cfg.d_model}, model.d_ff={cfg.d_ff}, model.vocab_size="
                          f"{cfg.vocab_size}, model.max_len={cfg.max_len}, {cfg.num_encoder_layers}+"
                          f"{cfg.num_decoder_layers} layers"
                          + (f", model.lora.rank={cfg.lora.rank}" if cfg.lora.rank else "") + ") needs at least "
                          + " and ".join(over)
                          + ", counted before anything is allocated: make it smaller")


def check_fits(abstract: dict, what: str = "the training state") -> None:
    """ConfigError when the arrays of `abstract` ({"model", "opt"} of ShapeDtypeStructs with shardings) and
    the gradients of "model" cannot fit the local devices' memory: a lower bound (activations come on top),
    checked before anything is allocated, so that an impossible size is named instead of ending in the
    allocator's error or the kernel's OOM killer."""
    per: dict[Any, dict[str, int]] = {}
    for part, tree in abstract.items():
        for a in jax.tree.leaves(tree):
            sharding = getattr(a, "sharding", None)
            shard = sharding.shard_shape(a.shape) if sharding is not None else a.shape
            nbytes = math.prod(shard) * a.dtype.itemsize
            for d in (sharding.addressable_devices if sharding is not None else jax.local_devices()[:1]):
                parts = per.setdefault(d, {})
                parts[part] = parts.get(part, 0) + nbytes
                if part == "model":
                    parts["gradients"] = parts.get("gradients", 0) + nbytes
    if not per:
        return
    cpu = [d for d in per if d.platform == "cpu"]
    groups = ([("host memory", cpu, _free_bytes(cpu[0]))] if cpu else []) + [
        (f"{d.device_kind} {d.id}", [d], _free_bytes(d)) for d in per if d.platform != "cpu"]
    gib = lambda n: f"{n / 2 ** 30:.1f} GiB"
    for where, devices, free in groups:
        need = sum(sum(per[d].values()) for d in devices)
        if free is not None and need > free:
            names = {"model": "parameters", "opt": "optimizer state"}
            parts = {names.get(k, k): sum(per[d].get(k, 0) for d in devices) for k in per[devices[0]]}
            raise ConfigError(
                f"{what} needs at least {gib(need)} of {where} ({', '.join(f'{k} {gib(v)}' for k, v in parts.items())}; "
                f"activations come on top) and {gib(free)} is free: make the model smaller (model.d_model, "
                f"model.d_ff, the layer counts, model.vocab_size) or shard it over more devices (parallel.fsdp)")

