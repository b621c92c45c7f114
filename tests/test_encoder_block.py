"""An encoder-decoder's encoder blocks (`nn.layers.EncoderBlock`) built as the config says, and the one-line
failures of an attention variant's module (`nn.layers._failure`), against independent computations: the encoder's
ALiBi pattern against NumPy's softmax(q·k/√H − slope·|i − j|) with the paper's slopes (a block built as
cross-attention drops the bias), a MoE encoder-decoder routing in both stacks (a dense encoder FFN reports one
router), and the exact error lines (an import error without a frame, a message of more than 60 words cut at 60, an
exception without a message). DeepNorm's per-stack α and β: tests/test_residuals.py.
"""
from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest

from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError
from jaxformer.nn import build_model

N, H = 4, 8


def s2s(**kw):
    cfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=13, d_model=N * H, num_heads=N, d_ff=32,
                   num_encoder_layers=1, num_decoder_layers=1, max_len=16, runtime__dropout=0.0,
                   norm__position="pre", **kw)
    return build_model(cfg, seed=0)


def test_an_alibi_encoders_pattern_is_softmax_of_scores_minus_slope_times_distance():
    m = s2s(positional="alibi")
    src = np.random.default_rng(0).integers(1, 13, (2, 7))
    _, aux = m(src, src[:, :5], capture=("encoder.q", "encoder.k", "encoder.pattern"))
    q, k, got = (np.asarray(aux["captured"][f"encoder.{s}"][0], np.float64) for s in ("q", "k", "pattern"))
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)                       # Press et al. 2022, N a power of two
    distance = np.abs(np.arange(7)[:, None] - np.arange(7)[None, :])
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H) - slopes[None, :, None, None] * distance
    want = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_a_moe_encoder_decoder_routes_in_both_stacks():
    m = s2s(positional="sinusoidal", ffn="moe", moe__num_experts=4, moe__top_k=2)
    src = np.random.default_rng(1).integers(1, 13, (2, 6))
    _, aux = m(src, src)
    assert {leaf.shape[0] for leaf in jax.tree.leaves(aux["moe"])} == {2}           # encoder layer + decoder layer


VARIANT = '''
from jaxformer.nn.attention import MultiHeadAttention


class Long(MultiHeadAttention):
    @classmethod
    def check(cls, cfg):
        raise ValueError(" ".join(f"w{i}" for i in range(100)))


class Bare(MultiHeadAttention):
    @classmethod
    def check(cls, cfg):
        assert cfg.num_heads == 3
'''


def _line(text: str) -> int:
    return next(i for i, line in enumerate(VARIANT.splitlines(), 1) if text in line)


@pytest.fixture()
def variant(tmp_path, monkeypatch):
    (tmp_path / "t4_failures.py").write_text(textwrap.dedent(VARIANT))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "t4_failures.py"


def _error(kind: str) -> str:
    cfg = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, vocab_size=11, d_model=16,
                   num_heads=4, d_ff=16, num_decoder_layers=1, attention__kind=kind)
    with pytest.raises(ConfigError) as e:
        build_model(cfg)
    return str(e.value)


def test_a_variants_failure_is_one_exact_line(variant):
    """ImportError: the message alone (no frame of importlib's); a message of 100 words: its first 60; an assert
    without a message: the type and where, no ': '."""
    assert _error("t4_no_such_module:X") == ("model.attention.kind='t4_no_such_module:X' cannot be imported: "
                                              "ModuleNotFoundError: No module named 't4_no_such_module'")
    long = _error("t4_failures:Long")
    words = " ".join(f"w{i}" for i in range(60))
    assert long == (f"model.attention.kind='t4_failures:Long': its check(cfg) raised ValueError: {words} "
                    f"({variant}, line {_line('raise ValueError')})"), long
    assert _error("t4_failures:Bare") == (f"model.attention.kind='t4_failures:Bare': its check(cfg) raised "
                                          f"AssertionError ({variant}, line {_line('assert cfg')})")


def test_an_encoder_block_is_dense_unless_asked_for_experts():
    from flax import nnx

    from jaxformer.nn.layers import EncoderBlock, FeedForward
    from jaxformer.nn.moe import MoEFeedForward
    cfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=13, d_model=16, num_heads=2, d_ff=16,
                   num_encoder_layers=1, num_decoder_layers=1, ffn="moe", moe__num_experts=2, moe__top_k=1)
    assert type(EncoderBlock(cfg, rngs=nnx.Rngs(0)).ffn) is FeedForward
    assert type(EncoderBlock(cfg, moe=True, rngs=nnx.Rngs(0)).ffn) is MoEFeedForward
