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
    """RULES with the config's overrides ("logical:axis+axis") applied.

    Args:
      cfg: the parallel config (its `rules`).

    Returns:
      {logical axis: mesh axes}.

    Examples:
      >>> from jaxformer.config import ParallelConfig; from jaxformer.parallel import rules_for
      >>> rules_for(ParallelConfig(rules=("embed:", "mlp:tensor+fsdp")))["mlp"]
      ('tensor', 'fsdp')
    """
    rules = dict(RULES)
    for r in cfg.rules:
        logical, _, axes = r.partition(":")
        rules[logical] = tuple(a for a in axes.split("+") if a)
    return rules


def rules_table(cfg: ParallelConfig = ParallelConfig()) -> str:
    """The rule table as Markdown (README, `jaxformer plan`).

    Args:
      cfg: the parallel config whose overrides apply.

    Returns:
      A Markdown table, one row per logical axis.

    Examples:
      >>> from jaxformer.parallel import rules_table
      >>> print(rules_table().splitlines()[2])
      | batch | data × fsdp × expert |
    """
    rows = ["| logical axis | mesh axes |", "|---|---|"]
    rows += [f"| {k} | {' × '.join(v) if v else '— (replicated)'} |" for k, v in rules_for(cfg).items()]
    return "\n".join(rows)


def mesh_shape(cfg: ParallelConfig, num_devices: int) -> dict[str, int]:
    """The mesh's axis sizes, -1 resolved to the devices left.

    Args:
      cfg: the parallel config (its axis sizes).
      num_devices: how many devices the mesh spans.

    Returns:
      {mesh axis: size}, in mesh order.

    Raises:
      ConfigError: the sizes do not multiply to num_devices.

    Examples:
      >>> from jaxformer.config import ParallelConfig; from jaxformer.parallel import mesh_shape
      >>> mesh_shape(ParallelConfig(data=-1, tensor=2), 8)
      {'stage': 1, 'data': 4, 'fsdp': 1, 'context': 1, 'expert': 1, 'tensor': 2}
    """
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
    """A mesh plus the rule table: shardings for parameters, optimizer state, batches and activations.

    Args:
      cfg: the parallel config.
      devices: the mesh's devices (default: all of jax.devices()).

    Attributes:
      cfg: the parallel config.
      rules: {logical axis: mesh axes} (`rules_for`).
      sizes: {mesh axis: size} (`mesh_shape`).
      mesh: the jax Mesh.
      replicated: a NamedSharding replicating over the mesh.

    Examples:
      >>> import jax; from jaxformer.config import ParallelConfig; from jaxformer.parallel import Plan
      >>> plan = Plan(ParallelConfig(), devices=jax.devices()[:1])             # a 1-device mesh
      >>> plan.sizes["data"], plan.spec(("batch", "embed")), plan.batch_shards
      (1, P(None, None), 1)
    """

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
    """The plan whose `use()` block this code runs in.

    Returns:
      That `Plan`, or None outside one.

    Examples:
      >>> import jax; from jaxformer.config import ParallelConfig; from jaxformer.parallel import Plan, active_plan
      >>> with Plan(ParallelConfig(), devices=jax.devices()[:1]).use() as plan:
      ...     active_plan() is plan
      True
    """
    return _ACTIVE.get()


def abstract_with_shardings(state: Any, plan: "Plan | None" = None) -> Any:
    """An abstract state with shardings: what a state is created or restored into.

    Args:
      state: a pytree of ShapeDtypeStructs (e.g. from nnx.eval_shape).
      plan: whose rules shard it; None: this process's first device.

    Returns:
      The same pytree, each leaf a ShapeDtypeStruct with its sharding.

    Raises:
      ConfigError: with a plan, a dimension not divisible by its mesh axes.

    Examples:
      >>> import jax, jax.numpy as jnp; from jaxformer.parallel import abstract_with_shardings
      >>> abstract_with_shardings({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})["w"].sharding
      SingleDeviceSharding(device=...)
    """
    if plan is not None:
        shardings = plan.state_shardings(state)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, state)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def no_mesh():
    """A context without jax's mesh: nnx.eval_shape would otherwise read the parameters' logical axis names
    as mesh axes.

    Returns:
      A context manager.

    Examples:
      >>> import jax; from jaxformer.parallel import no_mesh
      >>> with no_mesh():
      ...     jax.sharding.get_abstract_mesh().empty
      True
    """
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """A sharding constraint from logical names under the active plan (identity without one, and inside
    shard_map's per-device code). Dims not divisible by their mesh axes are left unsharded.

    Args:
      x: an array.
      names: one logical axis name (or None) per dim.

    Returns:
      x, constrained.

    Examples:
      >>> import jax.numpy as jnp; from jaxformer.parallel import constrain
      >>> constrain(jnp.ones((2, 3)), ("batch", None)).shape
      (2, 3)
    """
    plan = _ACTIVE.get()
    if plan is None or plan.mode == "shard_map" or math.prod(plan.sizes.values()) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, plan.sharding(names, x.shape, strict=False))


def replicate(x):
    """Constrain every array of a pytree to be replicated under the active plan (so every process can read it).

    Args:
      x: a pytree of arrays.

    Returns:
      x, constrained (as it is without a plan or under shard_map).

    Examples:
      >>> import jax.numpy as jnp; from jaxformer.parallel import replicate
      >>> replicate({"x": jnp.ones(2)})["x"].shape
      (2,)
    """
    plan = _ACTIVE.get()
    if plan is None or plan.mode == "shard_map":
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, plan.replicated), x)
