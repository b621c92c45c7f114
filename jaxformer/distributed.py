"""Multi-host: start JAX's multi-controller runtime from the config or the environment.

Every process runs the same program on its own devices; `jax.distributed.initialize` connects them (process 0
hosts the coordinator) and must run before any JAX computation. Only process 0 writes the run's logs, metrics
and checkpoint metadata (`is_primary`); every process takes part in each step and checkpoint.

Where the values come from, first found wins: parallel.coordinator / num_processes / process_id; then
$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID; then JAX's own cluster detection (SLURM,
Open MPI, Kubernetes, Cloud TPU). parallel.distributed="auto" initializes when one of these says there is
more than one process (SLURM_NTASKS or OMPI_COMM_WORLD_SIZE > 1, or several TPU worker hosts listed in the
environment); "on" always asks JAX (e.g. on a Cloud TPU VM slice, where it asks the metadata server).
"""
from __future__ import annotations

import logging
import os
import socket

import jax

from jaxformer.config import ParallelConfig
from jaxformer.errors import ConfigError

log = logging.getLogger(__name__)

_LAUNCHERS = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}       # process counts
_TPU_HOSTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")                     # comma-separated hosts


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer") from None


def settings(cfg: ParallelConfig) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None when this is a single-process run."""
    kw = {"coordinator_address": cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
          "num_processes": cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES"),
          "process_id": cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID"),
          "heartbeat_timeout_seconds": cfg.heartbeat_timeout_s,
          "initialization_timeout": cfg.heartbeat_timeout_s}          # an unreachable peer fails in this time
    if cfg.distributed == "off":
        return None
    if cfg.distributed == "auto":
        launched = (any((_env_int(v) or 1) > 1 for v in _LAUNCHERS)
                    or any("," in os.environ.get(v, "") for v in _TPU_HOSTS))
        if not launched and kw["coordinator_address"] is None and (kw["num_processes"] or 1) == 1:
            return None
        if kw["num_processes"] == 1:
            return None
    return kw


def initialize(cfg: ParallelConfig) -> None:
    """Connect this process to the others (see the module docstring); a no-op for a single process or when
    already connected. ConfigError when the settings are incomplete or the coordinator cannot be reached."""
    kw = settings(cfg)
    if kw is None or jax.distributed.is_initialized():
        return
    _check_host(kw["coordinator_address"])
    try:
        jax.distributed.initialize(**kw)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"multi-host start failed ({', '.join(f'{k}={v}' for k, v in kw.items())}): "
                          f"{(str(e).splitlines() or [''])[0][:300]}. Set parallel.coordinator=HOST:PORT, "
                          f"parallel.num_processes and parallel.process_id (or the $JAX_* variables)") from None
    log.info("process %d of %d, %d local devices of %d", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _check_host(address: str | None) -> None:
    """ConfigError at once for a coordinator address that is not HOST:PORT or whose host does not resolve (JAX
    would wait for its whole initialization timeout, then abort the process)."""
    if address is None:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"parallel.coordinator={address!r} must look like HOST:PORT")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"parallel.coordinator={address!r}: host {host!r} does not resolve ({e})") from None


def is_primary() -> bool:
    """True in process 0: the one that writes logs, metrics and run metadata."""
    return jax.process_index() == 0
