"""Memory checks before anything is allocated: the bytes a model needs at least (by arithmetic on its config) and
the bytes a sharded training state needs per device, against what this process's devices have free; an
impossible size is refused by name (ConfigError) instead of ending in an allocator's error or the kernel's OOM
killer. `shard_bytes` measures what a pytree really holds, per device.
"""
from __future__ import annotations

import math
import os
from typing import Any

import jax

from jaxformer.errors import ConfigError


def shard_bytes(tree: Any) -> dict[str, int]:
    """The bytes of a pytree of arrays, in all and on its fullest device.

    Args:
      tree: a pytree of jax arrays.

    Returns:
      {"total": logical bytes, "per_device_max": the largest sum of shard bytes held by one device}.

    Examples:
      >>> import jax.numpy as jnp; from jaxformer.memory import shard_bytes
      >>> shard_bytes({"w": jnp.zeros((2, 3))})
      {'total': 24, 'per_device_max': 24}
    """
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
    """The bytes a model needs at least, by arithmetic: its embedding (and untied head), the attention and FFN
    matrices of every layer in float32 (norms and biases left out: a lower bound), and the host's float64 copy
    of a sinusoidal table while it is built.

    Args:
      cfg: a ModelConfig.

    Returns:
      (parameter bytes, host bytes).

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced; from jaxformer.memory import min_param_bytes
      >>> min_param_bytes(replaced(ModelConfig(), arch="decoder_only", d_model=16, d_ff=32, vocab_size=16, max_len=16))
      (50176, 2048)
    """
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


def _layers(cfg) -> str:
    if cfg.arch == "encoder_decoder":
        return f"{cfg.num_encoder_layers}+{cfg.num_decoder_layers} layers"
    return f"{cfg.num_decoder_layers} layers"


def check_model_size(cfg) -> None:
    """Refuse a model too large for this process's devices, counted by arithmetic (`min_param_bytes`) before
    anything is built: an impossible size is named instead of ending in numpy's or XLA's allocation error.

    Args:
      cfg: a ModelConfig.

    Returns:
      None.

    Raises:
      ConfigError: the parameters exceed the devices' memory together, or the positional table the host's.

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced; from jaxformer.memory import check_model_size
      >>> check_model_size(replaced(ModelConfig(), d_model=2**16, d_ff=2**16, vocab_size=2**22))  # 2.5 TiB
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: the model (model.d_model=65536, ...) needs at least ... GiB for its parameters ...
    """
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
                          f"{cfg.vocab_size}, model.max_len={cfg.max_len}, " + _layers(cfg)
                          + (f", model.lora.rank={cfg.lora.rank}" if cfg.lora.rank else "") + ") needs at least "
                          + " and ".join(over)
                          + ", counted before anything is allocated: make it smaller")


def check_fits(abstract: dict, what: str = "the training state") -> None:
    """Refuse a state whose arrays and the gradients of its "model" cannot fit the local devices' memory: a
    lower bound (activations come on top), checked before anything is allocated, so that an impossible size is
    named instead of ending in the allocator's error or the kernel's OOM killer.

    Args:
      abstract: {"model", "opt"} of ShapeDtypeStructs with shardings (`abstract_with_shardings`).
      what: the state's name in the message.

    Returns:
      None.

    Raises:
      ConfigError: a device (or the host, for CPU devices) has less free memory than its shards need.

    Examples:
      >>> import jax, jax.numpy as jnp; from jaxformer.memory import check_fits
      >>> from jaxformer.parallel import abstract_with_shardings
      >>> big = abstract_with_shardings({"w": jax.ShapeDtypeStruct((2**20, 2**20), jnp.float32)})   # 4 TiB
      >>> check_fits({"model": big})
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: the training state needs at least 8192.0 GiB of ...
    """
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

