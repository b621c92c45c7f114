"""Activation sites of imported models against transformers' own outputs (float32, random weights of std 0.2,
eager attention): the residual stream against `output_hidden_states` (embed = hidden_states[0], layer l's
resid_post = hidden_states[l + 1], final_norm = the last, after the final norm) and the attention probabilities
against `output_attentions` (pattern), for Llama, GPT-2, Qwen3 and Gemma 2 (sandwich norms, soft-capping and
windows). Wrong implementations these catch: a residual read one layer off, an embedding captured before its
scale (Gemma), a pattern before the soft-cap or the window, a final_norm site read before the norm.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import random_hf_model  # noqa: E402
from jaxformer.hf import from_pretrained  # noqa: E402

V = 97
IDS = np.random.default_rng(7).integers(0, V, (2, 12))
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, LLAMA),
    "gpt2": (transformers.GPT2Config, dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "qwen3": (transformers.Qwen3Config, dict(LLAMA, head_dim=8)),
    "gemma2": (transformers.Gemma2Config, dict(LLAMA, head_dim=16, num_hidden_layers=4, sliding_window=4,
                                               query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                               final_logit_softcapping=3.0)),
}


hf_model = random_hf_model


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_sites_are_transformers_hidden_states_and_attentions(tmp_path, family):
    cls, sizes = FAMILIES[family]
    m = hf_model(cls(**sizes))
    m.save_pretrained(tmp_path)
    with torch.no_grad():
        out = m(torch.tensor(IDS), output_hidden_states=True, output_attentions=True)
    hidden = [h.numpy() for h in out.hidden_states]
    ours = from_pretrained(tmp_path)
    _, aux = ours(jnp.asarray(IDS), capture=("embed", "resid_post", "final_norm", "pattern"))
    cap = aux["captured"]
    layers = len(hidden) - 1
    assert cap["resid_post"].shape[0] == layers == len(out.attentions)
    assert rel(cap["embed"], hidden[0]) < 1e-5
    for layer in range(layers - 1):
        assert rel(cap["resid_post"][layer], hidden[layer + 1]) < 1e-5, layer
    assert rel(cap["final_norm"], hidden[layers]) < 1e-5
    for layer in range(layers):
        assert rel(cap["pattern"][layer], out.attentions[layer].numpy()) < 1e-5, layer


def test_the_instruments_run_on_an_imported_model(tmp_path):
    """An imported Gemma 2 (sandwich norms, windows, soft-caps) takes the patching grid, attribution patching and
    an SAE patch like a model built here: the grid restores a one-token corruption exactly at its position before
    layer 0, and an SAE patch with its error kept leaves the logits unchanged."""
    import jax
    from jaxformer.patching import attribution_patching, patching_grid
    from jaxformer.sae import SAESpec, init_sae, sae_patch
    cls, sizes = FAMILIES["gemma2"]
    hf_model(cls(**sizes)).save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    clean = jnp.asarray(IDS[:1])
    corrupt = clean.at[0, 5].set((clean[0, 5] + 1) % V)
    target = int(jnp.argmax(ours(clean)[0][0, -1]))

    def metric(logits):
        return jax.nn.log_softmax(logits[0, -1])[target]
    grid = np.asarray(patching_grid(ours, (clean,), (corrupt,), "resid_pre", metric))
    est = np.asarray(attribution_patching(ours, (clean,), (corrupt,), "resid_pre", metric))
    assert grid.shape == est.shape == (4, 12) and grid[0, 5] == pytest.approx(1.0, abs=1e-4)
    np.testing.assert_allclose(grid[0, :5], 0.0, atol=1e-5)
    spec = SAESpec(d_in=32, d_sae=64, site="resid_mid", layer=2, k=8)
    patched = ours(clean, patch={"resid_mid": sae_patch(init_sae(spec, jax.random.key(0)), spec, keep_error=True)})
    np.testing.assert_allclose(patched[0], ours(clean)[0], rtol=1e-4, atol=1e-4)
