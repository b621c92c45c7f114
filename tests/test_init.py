"""Initialisation schemes (model.runtime.init) against the modules they name: PyTorch's own nn.MultiheadAttention,
nn.Linear and nn.Embedding initialised here (sample standard deviations and bounds agree), GPT-2's N(0, 0.02)
with 1/√(2L) residual outputs, and today's Glorot scheme unchanged bit for bit."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_lm
from jaxformer.config import ConfigError, replaced
from jaxformer.nn import build_model

torch = pytest.importorskip("torch")

D, N, F, L = 256, 8, 512, 3


def _params(scheme: str, **kw) -> dict:
    cfg = replaced(tiny_lm("model.norm.position=pre").model, vocab_size=300, d_model=D, num_heads=N,
                              d_ff=F, num_decoder_layers=L, runtime__init=scheme, **kw)
    flat = nnx.to_flat_state(nnx.state(build_model(cfg, seed=0), nnx.Param))
    return {"/".join(str(p) for p in path if not isinstance(p, int)): np.asarray(v[...]) for path, v in flat}


def _close_std(ours: np.ndarray, ref: np.ndarray, rel: float = 0.03):
    assert abs(ours.std() / ref.std() - 1) < rel, (ours.std(), ref.std())


def test_pytorch_scheme_matches_pytorch_modules():
    p = _params("pytorch")
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(D, N)                        # xavier over in_proj [3D, D], out_proj Linear
    lin1, lin2, emb = torch.nn.Linear(D, F), torch.nn.Linear(F, D), torch.nn.Embedding(300, D)
    t = lambda x: x.detach().numpy()                               # noqa: E731
    for name in ("wq", "wk", "wv"):
        _close_std(p[f"decoder/layers/blocks/self_attn/{name}"], t(mha.in_proj_weight))
        assert np.abs(p[f"decoder/layers/blocks/self_attn/{name}"]).max() <= math.sqrt(6 / (4 * D))
    _close_std(p["decoder/layers/blocks/self_attn/wo"], t(mha.out_proj.weight))
    _close_std(p["decoder/layers/blocks/ffn/w1"], t(lin1.weight))
    _close_std(p["decoder/layers/blocks/ffn/b1"], t(lin1.bias), rel=0.1)
    _close_std(p["decoder/layers/blocks/ffn/w2"], t(lin2.weight))
    _close_std(p["decoder/layers/blocks/ffn/b2"], t(lin2.bias), rel=0.1)
    _close_std(p["embed/tokens"], t(emb.weight))
    assert (p["decoder/layers/blocks/self_attn/bq"] == 0).all() and (p["decoder/layers/blocks/self_attn/bo"] == 0).all()
    assert (p["decoder/layers/blocks/res_self/norm/scale"] == 1).all()


def test_gpt2_scheme_scales_the_residual_outputs():
    p = _params("gpt2")
    for name, std in (("self_attn/wq", 0.02), ("ffn/w1", 0.02), ("self_attn/wo", 0.02 / math.sqrt(2 * L)),
                      ("ffn/w2", 0.02 / math.sqrt(2 * L))):
        w = p[f"decoder/layers/blocks/{name}"]
        assert abs(w.std() / std - 1) < 0.03 and abs(w.mean()) < 3 * std / math.sqrt(w.size), name
    assert abs(p["embed/tokens"].std() / 0.02 - 1) < 0.03
    assert (p["decoder/layers/blocks/ffn/b1"] == 0).all()


def test_glorot_is_the_default_and_the_schemes_differ():
    default, glorot = _params("glorot"), _params("glorot")
    for k in default:
        np.testing.assert_array_equal(default[k], glorot[k])
    wq = default["decoder/layers/blocks/self_attn/wq"]
    assert np.abs(wq).max() <= math.sqrt(6 / (D + D)) and abs(wq.std() / math.sqrt(2 / (D + D)) - 1) < 0.03
    assert abs(_params("pytorch")["embed/tokens"].std() / default["embed/tokens"].std() - math.sqrt(D)) < 1.0
    with pytest.raises(ConfigError, match="model.runtime.init='lecun'"):
        tiny_lm("model.runtime.init=lecun")


def test_moe_experts_follow_the_scheme():
    p = _params("pytorch", ffn="moe", moe__num_experts=4)
    w1 = p["decoder/layers/blocks/ffn/w1"]
    assert np.abs(w1).max() <= 1 / math.sqrt(D) and abs(w1.std() / (1 / math.sqrt(3 * D)) - 1) < 0.03
    assert jax.tree.leaves(p)
