"""Differential attention (`nn.differential`, model.attention.kind="differential"), against a float64 NumPy
transcription of the paper's reference code (Ye et al. 2024, multihead_diffattn.py) on the q, k, v the model
captures.

Wrong implementations these tests catch: heads paired as (j, j + N/2) instead of adjacent (2j, 2j+1); λ_init
from the wrong layer (every layer's 0.2, or its neighbour's: the cached path told another index); values not
paired side by side into 2H; the sub-norm over H instead of 2H, or the (1 − λ_init) scale dropped; λ's two
exponentials swapped.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.nn.differential import lambda_init
from helpers import cached_and_full

V = 17


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="decoder_only", num_encoder_layers=0, vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2,
                d_ff=32, num_decoder_layers=3, max_len=16, positional="rope", norm__position="pre",
                runtime__dropout=0.0, attention__kind="differential")
    return replaced(ModelConfig(), **{**base, **kw})


def _reference(q, k, v, lam, lam_init, scale, eps):
    """The paper's differential attention of one layer in float64: q [T,N,H], k/v [S,K,H] -> [T,N/2,2H]."""
    t, n, h = q.shape
    kh = k.shape[1]
    k = np.repeat(k, n // kh, axis=1)                                   # repeat_kv(k, n_rep) over 2·nkv heads
    logits = np.einsum("tnh,snh->nts", q, k) * scale
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    w = w.reshape(n // 2, 2, t, t)
    diff = w[:, 0] - lam * w[:, 1]                                       # [N/2,T,S]
    v2 = np.repeat(v.reshape(v.shape[0], kh // 2, 2 * h), n // kh, axis=1)   # [S,N/2,2H]
    out = np.einsum("jts,sjd->tjd", diff, v2)
    out = out / np.sqrt((out ** 2).mean(-1, keepdims=True) + eps)
    return out * (1 - lam_init)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_each_layer_is_the_papers_differential_attention(backend):
    """Every layer's z (the heads' context) is the paper's, on the reference backend and on a fused one (whose
    probabilities are recomputed from its log-sum-exp)."""
    model = build_model(_cfg(runtime__attention_backend=backend, runtime__attention_block=2), seed=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 6), 1, V)
    _, out = model(tokens, capture=("q", "k", "v", "z"))
    cap = {name: np.asarray(x, np.float64) for name, x in out["captured"].items()}
    for i in range(3):
        attn = model.decoder.layers.layer(i).self_attn
        lam = float(attn.lam(i))
        for b in range(2):
            want = _reference(cap["q"][i, b], cap["k"][i, b], cap["v"][i, b], lam, float(lambda_init(i)),
                              8 ** -0.5, model.cfg.norm.eps) * np.asarray(attn.sub_norm[...])
            np.testing.assert_allclose(cap["z"][i, b].reshape(6, 2, 16), want, rtol=2e-4, atol=2e-5,
                                       err_msg=f"layer {i} row {b}")


def test_lambda_init_follows_depth():
    np.testing.assert_allclose(np.asarray([lambda_init(i) for i in range(3)]),
                               [0.2, 0.8 - 0.6 * np.exp(-0.3), 0.8 - 0.6 * np.exp(-0.6)], rtol=1e-6)


def test_cached_decoding_equals_the_uncached_call():
    """Prefill then one token at a time: the uncached call's logits (λ_init follows each layer's own index)."""
    model = build_model(_cfg(), seed=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 1, V)
    got, want, _ = cached_and_full(model, tokens, 3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_it_trains_and_exports_nowhere(tmp_path):
    """Gradients reach λ's vectors and the sub-norm; no Hugging Face family writes it (refused by name)."""
    from flax import nnx
    from jaxformer.hf import HFError, save_pretrained
    model = build_model(_cfg(), seed=3)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
    grads = nnx.grad(lambda m: jnp.mean(m(tokens)[0] ** 2))(model)
    blk = grads.decoder.layers.blocks.self_attn
    assert float(jnp.abs(blk.lambda_q1[...]).max()) > 0 and float(jnp.abs(blk.sub_norm[...]).max()) > 0
    llama = build_model(_cfg(norm__type="rmsnorm", activation="swiglu", use_bias=False, scale_embeddings=False))
    with pytest.raises(HFError, match="model.attention.kind='differential'"):
        save_pretrained(llama, tmp_path / "out", family="llama")


def test_odd_heads_are_a_named_error():
    """The module's own check (`DifferentialAttention.check`), run when the model is built."""
    with pytest.raises(ConfigError, match="model.attention.kind='differential'.*num_heads=3"):
        build_model(_cfg(num_heads=3, num_kv_heads=1, d_model=24))
