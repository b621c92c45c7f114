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
    assert params == 4 * _counted(build_model(cfg, seed=0))
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
