"""`jaxformer.memory`: the arithmetic lower bound of a model's parameter bytes is exact where it claims to be (every
attention, FFN, expert, embedding, head, position table and LoRA matrix of a built model, counted from its
parameters; only biases, norm scales and routers are left out), and the size checks refuse by name.

Wrong implementations these catch: a gated FFN counted with two matrices, MoE layers counted as dense (or every
layer as MoE), grouped-query keys and values counted at the query heads' width, an encoder-decoder's encoder or
cross-attention left out, a tied head counted twice, a learned position table left out, LoRA adapters counted on
targets the model does not adapt (or on the cross-attention of a decoder-only model), the host's sinusoidal
table counted for other position kinds.
"""
from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.memory import check_fits, check_model_size, min_param_bytes, shard_bytes
from jaxformer.nn import build_model
from jaxformer.parallel import abstract_with_shardings

LEFT_OUT = {"bq", "bk", "bv", "bo", "b1", "b2", "bg", "bias", "scale", "router", "lambdas"}
BASE = dict(vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_decoder_layers=2, max_len=16)
CASES = {
    "decoder-only": dict(arch="decoder_only"),
    "encoder-decoder": dict(arch="encoder_decoder", num_encoder_layers=3),
    "swiglu, learned, untied": dict(arch="decoder_only", activation="swiglu", positional="learned",
                                    tie_embeddings=False),
    "gqa, rmsnorm": dict(arch="decoder_only", num_kv_heads=1, norm__type="rmsnorm"),
    "moe every 2": dict(arch="decoder_only", ffn="moe", moe__num_experts=4, moe__every=2, num_decoder_layers=4),
    "moe every 1, geglu": dict(arch="decoder_only", ffn="moe", moe__num_experts=3, activation="geglu"),
    "geglu_tanh": dict(arch="decoder_only", activation="geglu_tanh"),
    "lora q v up down, encoder-decoder": dict(arch="encoder_decoder", num_encoder_layers=1, lora__rank=2,
                                              lora__targets=("q", "v", "up", "down")),
    "lora k o gate, decoder-only": dict(arch="decoder_only", activation="swiglu", lora__rank=3,
                                        lora__targets=("k", "o", "gate")),
}


def _counted(model) -> int:
    return sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
               if not any(getattr(k, "key", None) in LEFT_OUT for k in path))


@pytest.mark.parametrize("case", CASES)
def test_min_param_bytes_counts_every_matrix_of_the_built_model(case):
    cfg = replaced(ModelConfig(), **{**BASE, **CASES[case]})
    params, host = min_param_bytes(cfg)
    assert params == 4 * _counted(build_model(cfg, seed=0)) and type(params) is int and type(host) is int
    assert host == (8 * cfg.max_len * cfg.d_model if cfg.positional == "sinusoidal" else 0)


def test_the_size_checks_refuse_by_name_and_pass_what_fits():
    small = replaced(ModelConfig(), **BASE, arch="decoder_only")
    check_model_size(small)                                        # fits: returns None
    huge = replaced(ModelConfig(), arch="decoder_only", d_model=2 ** 16, d_ff=2 ** 16, vocab_size=2 ** 22)
    with pytest.raises(ConfigError, match=r"model.vocab_size=4194304, model.max_len=\d+, 6 layers\) needs at least"):
        check_model_size(huge)
    big = abstract_with_shardings({"w": jax.ShapeDtypeStruct((2 ** 20, 2 ** 20), "float32")})
    with pytest.raises(ConfigError, match=r"the state needs at least 8192.0 GiB of host memory \(parameters 4096.0 "
                                          r"GiB, gradients 4096.0 GiB; activations come on top\)"):
        check_fits({"model": big}, what="the state")
    check_fits({"model": abstract_with_shardings({"w": jax.ShapeDtypeStruct((4, 4), "float32")})})
    assert shard_bytes({"a": jax.numpy.zeros((2, 3)), "b": jax.numpy.zeros(5, "int8")}) == \
        {"total": 29, "per_device_max": 29}


class _Dev:
    """A stand-in device: its platform, kind, id and allocator statistics (None: the backend has none)."""
    def __init__(self, platform, id=0, limit=None, kind="NVIDIA H100"):
        self.platform, self.id, self.device_kind, self._limit = platform, id, kind, limit

    def memory_stats(self):
        if self._limit == "raise":
            raise RuntimeError("no statistics on this backend")
        return None if self._limit is None else {"bytes_limit": self._limit, "bytes_in_use": 1}


class _Sharding:
    def __init__(self, devices, split):
        self.addressable_devices, self._split = devices, split

    def shard_shape(self, shape):
        return (shape[0] // self._split, *shape[1:])


class _Leaf:
    def __init__(self, shape, dtype="float32", sharding=None):
        import numpy as np
        self.shape, self.dtype = shape, np.dtype(dtype)
        if sharding is not None:
            self.sharding = sharding


GIB = 2 ** 30


def test_free_bytes_reads_meminfo_then_sysconf_and_the_allocator_limit(monkeypatch):
    from jaxformer import memory
    lines = ["MemTotal:       9000 kB\n", "MemFree:        100 kB\n", "MemAvailable:   7 kB\n"]
    monkeypatch.setattr(memory, "open", lambda path: iter(lines) if path == "/proc/meminfo" else 1 / 0,
                        raising=False)
    assert memory._free_bytes(_Dev("cpu")) == 7 * 1024

    def no_file(path):
        raise OSError(path)
    monkeypatch.setattr(memory, "open", no_file, raising=False)
    monkeypatch.setattr(memory.os, "sysconf", {"SC_AVPHYS_PAGES": 3, "SC_PAGE_SIZE": 4096}.__getitem__)
    assert memory._free_bytes(_Dev("cpu")) == 3 * 4096
    monkeypatch.setattr(memory.os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert memory._free_bytes(_Dev("cpu")) is None
    assert memory._free_bytes(_Dev("gpu", limit=5 * GIB)) == 5 * GIB
    assert memory._free_bytes(_Dev("gpu", limit=None)) is None
    assert memory._free_bytes(_Dev("gpu", limit="raise")) is None


def _devices(monkeypatch, devices, cpu_free):
    from jaxformer import memory
    monkeypatch.setattr(memory.jax, "local_devices", lambda: devices)
    real = memory._free_bytes
    monkeypatch.setattr(memory, "_free_bytes", lambda d: cpu_free if d.platform == "cpu" else real(d))


def test_check_model_size_adds_the_host_and_every_accelerator_and_names_the_model(monkeypatch):
    from jaxformer import memory
    _devices(monkeypatch, [_Dev("cpu"), _Dev("gpu", 0, GIB), _Dev("gpu", 1, GIB)], cpu_free=GIB)
    lm = replaced(ModelConfig(), **BASE, arch="decoder_only")
    monkeypatch.setattr(memory, "min_param_bytes", lambda cfg: (3 * GIB, 0))
    memory.check_model_size(lm)                                    # 3 GiB in 1 + 1 + 1: fits, exactly
    monkeypatch.setattr(memory, "min_param_bytes", lambda cfg: (3 * GIB + 1, 0))
    with pytest.raises(ConfigError) as e:
        memory.check_model_size(lm)
    assert str(e.value) == ("the model (model.d_model=16, model.d_ff=32, model.vocab_size=16, model.max_len=16, "
                            "2 layers) needs at least 3.0 GiB for its parameters (3.0 GiB in this process's memory), "
                            "counted before anything is allocated: make it smaller")
    seq2seq = replaced(ModelConfig(), **BASE, arch="encoder_decoder", num_encoder_layers=3, lora__rank=2)
    monkeypatch.setattr(memory, "min_param_bytes", lambda cfg: (GIB, 2 * GIB + 1))
    with pytest.raises(ConfigError, match=r"^the model \(model\.d_model=16, model\.d_ff=32, model\.vocab_size=16, "
                       r"model\.max_len=16, 3\+2 layers, model\.lora\.rank=2\) needs at least 2\.0 GiB of host memory "
                       r"for its sinusoidal table \(1\.0 GiB available\), counted"):
        memory.check_model_size(seq2seq)
    monkeypatch.setattr(memory, "min_param_bytes", lambda cfg: (GIB, GIB))
    memory.check_model_size(seq2seq)                               # the table fits the host exactly


def test_check_model_size_says_nothing_where_a_device_memory_is_unknown(monkeypatch):
    from jaxformer import memory
    monkeypatch.setattr(memory, "min_param_bytes", lambda cfg: (10 ** 18, 10 ** 18))
    lm = replaced(ModelConfig(), **BASE, arch="decoder_only")
    _devices(monkeypatch, [_Dev("cpu"), _Dev("gpu", 0, None)], cpu_free=GIB)
    memory.check_model_size(lm)
    _devices(monkeypatch, [_Dev("gpu", 0, GIB)], cpu_free=None)     # no CPU device: the accelerator alone
    with pytest.raises(ConfigError, match=r"\(1\.0 GiB in this process's memory\), counted"):
        memory.check_model_size(lm)


def test_check_fits_counts_each_device_shards_and_names_the_fullest(monkeypatch):
    from jaxformer import memory
    gpus = [_Dev("gpu", 0, 3 * GIB, "NVIDIA H200"), _Dev("gpu", 1, 3 * GIB - 1, "NVIDIA H200")]
    _devices(monkeypatch, [_Dev("cpu")] + gpus, cpu_free=GIB)
    sharded = _Sharding(gpus, 2)
    model = {"w": _Leaf((2 * GIB // 4, 1), sharding=sharded)}            # 1 GiB per device, and its gradient
    opt = {"m": _Leaf((2 * GIB // 8, 1), "int32", sharding=sharded),     # 0.5 GiB per device each
           "v": _Leaf((2 * GIB // 8, 1), sharding=sharded)}
    with pytest.raises(ConfigError) as e:
        memory.check_fits({"model": model, "opt": opt})
    assert str(e.value).startswith("the training state needs at least 3.0 GiB of NVIDIA H200 1 (parameters 1.0 GiB, "
                                   "gradients 1.0 GiB, optimizer state 1.0 GiB; activations come on top) and 3.0 GiB "
                                   "is free: make the model smaller")
    gpus[1]._limit = 3 * GIB
    memory.check_fits({"model": model, "opt": opt})               # 3 GiB each: fits, exactly
    host = {"w": _Leaf((GIB // 8, 1))}                             # no sharding: on the first local device (the CPU)
    gpus[0]._limit = 1                                             # (and on no other: GPU 0 has no room)
    memory.check_fits({"model": host})                             # 0.5 + its 0.5 GiB gradient: the host's 1, exactly
    with pytest.raises(ConfigError, match=r"^the state needs at least 2\.0 GiB of host memory \(parameters 1\.0 GiB, "
                                          r"gradients 1\.0 GiB; activations come on top\) and 1\.0 GiB is free"):
        memory.check_fits({"model": {"w": _Leaf((GIB // 8, 1)), "b": _Leaf((GIB // 8 + 1, 1))}}, "the state")
    memory.check_fits({"model": {}})                               # nothing to hold


def test_check_fits_sums_the_host_devices_parts_where_one_holds_none_of_a_part(monkeypatch):
    from jaxformer import memory
    cpus = [_Dev("cpu", 0, kind="cpu"), _Dev("cpu", 1, kind="cpu")]
    _devices(monkeypatch, cpus, cpu_free=GIB)
    model = {"w": _Leaf((GIB // 8, 1), sharding=_Sharding(cpus, 2))}       # 0.25 GiB on each CPU device
    opt = {"m": _Leaf((GIB // 8, 1))}                                       # 0.5 GiB, on CPU 0 only
    with pytest.raises(ConfigError, match=r"^the training state needs at least 1\.5 GiB of host memory \(parameters "
                                          r"0\.5 GiB, gradients 0\.5 GiB, optimizer state 0\.5 GiB; activations"):
        memory.check_fits({"model": model, "opt": opt})


def test_shard_bytes_of_nothing_is_nothing():
    assert shard_bytes({}) == {"total": 0, "per_device_max": 0}
