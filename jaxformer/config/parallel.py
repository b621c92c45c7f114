"""The `parallel` section of a run: the device mesh's sizes, the rule table's overrides, the step's mode and the
multi-host settings (`jaxformer.parallel` builds the mesh and shardings from it)."""
from __future__ import annotations

import dataclasses

from jaxformer.axes import LOGICAL_AXES, MESH_AXES
from jaxformer.config.checks import _Validated, check_types, choice, positive
from jaxformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Validated):
    """How one step runs over many devices and hosts: a mesh (stage × data × fsdp × context × expert × tensor)
    and rules that map logical axes onto it (the table: `jaxformer.parallel.RULES`, printed by `jaxformer plan`).

    Attributes:
      mode: "jit" (GSPMD over the mesh) | "shard_map" (explicit per-device data parallel: every other axis 1).
      data: the data-parallel axis size; one mesh axis size may be -1 = the devices left.
      fsdp: the fully sharded data-parallel axis size.
      context: context parallelism: every activation's sequence split over it (a language model's
        data.block_size a multiple of it).
      context_attention: how attention reads the other devices' keys: "gather" (GSPMD all-gathers them) | "ring"
        (`ops.context.ring_attention`: blocks passed round; not with stage > 1).
      context_order: "contiguous" | "zigzag" (device i holds chunks i and 2C-1-i: a causal LM's load balanced).
      expert: expert parallelism: MoE experts split over it (batch rows too).
      tensor: the tensor-parallel axis size.
      stage: pipeline parallelism: stacked layers split over it, a GPipe schedule (`jaxformer.nn.pipeline`).
      microbatches: the pipeline's micro-batches per step (> 0).
      rules: overrides of the rule table, "logical:axis[+axis]" each ("logical:" = no mesh axis).
      distributed: "auto" (when configured or launched by SLURM/Open MPI) | "on" | "off".
      coordinator: host:port of process 0 ("" = $JAX_COORDINATOR_ADDRESS or detected).
      num_processes: the processes of the run, >= 1 (None = $JAX_NUM_PROCESSES or detected).
      process_id: this process's index in [0, num_processes) (None = $JAX_PROCESS_ID or detected).
      heartbeat_timeout_s: a process that stops answering fails the others after this many seconds.

    Examples:
      >>> from jaxformer.config import ParallelConfig
      >>> ParallelConfig(data=-1, tensor=2).tensor
      2
      >>> ParallelConfig(data=-1, fsdp=-1)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: parallel: only one mesh axis size may be -1; got {...}
    """
    mode: str = "jit"                      # jit | shard_map
    data: int = -1                         # mesh axis sizes; one may be -1 = the devices left
    fsdp: int = 1
    context: int = 1                       # context parallelism
    context_attention: str = "gather"      # gather | ring
    context_order: str = "contiguous"      # contiguous | zigzag
    expert: int = 1                        # expert parallelism
    tensor: int = 1
    stage: int = 1                         # pipeline parallelism
    microbatches: int = 1                  # the pipeline's micro-batches
    rules: tuple[str, ...] = ()            # "logical:axis[+axis]" overrides of the rule table
    distributed: str = "auto"              # auto | on | off
    coordinator: str = ""                  # host:port of process 0
    num_processes: int | None = None       # else $JAX_NUM_PROCESSES or detected
    process_id: int | None = None          # else $JAX_PROCESS_ID or detected
    heartbeat_timeout_s: int = 100

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
