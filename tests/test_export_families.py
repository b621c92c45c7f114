"""Exporting with a forced family (`save_pretrained(family=F)`, `export-hf --family F`): every model shape built
here × every family is either exported and loads in transformers with our logits, or refused by name with
nothing written. Before: a forced family wrote another model and exited 0 (a Llama-shaped run as gemma or qwen3,
a QK-norm run as llama, per-layer windows [4, 0] as mistral, a Llama run as mistral that transformers could not
run). Models are built from configs with random weights; nothing is downloaded."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxformer.config import ModelConfig, replaced  # noqa: E402
from jaxformer.hf import FAMILIES, HFError, save_pretrained  # noqa: E402
from jaxformer.hf.expressing import expresses, family_for  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402

V = 61
BASE = replaced(ModelConfig(), arch="decoder_only", vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                   num_encoder_layers=0, num_decoder_layers=2, max_len=64, runtime__dropout=0.0, norm__position="pre",
                   norm__type="rmsnorm", positional="rope", activation="swiglu", use_bias=False, tie_embeddings=False,
                   scale_embeddings=False, pad_id=-1)
SHAPES = {   # shape -> (its config, the families that express it)
    "llama": (BASE, {"llama", "mistral"}),
    "llama_biases": (dataclasses.replace(BASE, biases=("q", "k", "v", "o", "ffn")), {"llama"}),
    "llama3_rope": (replaced(BASE, rope__scaling="llama3", rope__factor=8.0, rope__original_max_len=16),
                    {"llama", "mistral"}),
    "qwen2": (dataclasses.replace(BASE, biases=("q", "k", "v")), {"qwen2"}),
    "qwen2_yarn": (replaced(BASE, biases=("q", "k", "v"), rope__scaling="yarn", rope__factor=4.0,
                            rope__original_max_len=16), {"qwen2"}),
    "qwen3": (replaced(BASE, attention__qk_norm=True, head_dim=16), {"qwen3"}),
    "mistral": (replaced(BASE, attention__windows=(4,)), {"mistral"}),
    "qwen2_windows_0_4": (replaced(BASE, biases=("q", "k", "v"), attention__windows=(0, 4)), {"qwen2"}),
    "windows_4_0": (replaced(BASE, attention__windows=(4, 0)), set()),
    "gemma": (dataclasses.replace(BASE, activation="geglu_tanh", scale_embeddings=True, head_dim=16,
                                  tie_embeddings=True), {"gemma"}),
    "gemma2": (replaced(BASE, activation="geglu_tanh", scale_embeddings=True, head_dim=16, tie_embeddings=True,
                        norm__position="sandwich", attention__softcap=5.0, logit_softcap=3.0,
                        attention__windows=(4, 0), attention__scale_dim=24), {"gemma2"}),
    "gpt2": (replaced(BASE, positional="learned", norm__type="layernorm", activation="gelu_tanh",
                                 use_bias=True, tie_embeddings=True, num_kv_heads=None), {"gpt2"}),
}


def random_model(cfg: ModelConfig, seed: int = 0):
    """Our model of `cfg` with every parameter (norm scales included) drawn around its init: a dropped or
    misplaced tensor changes the logits."""
    model = build_model(cfg, seed=seed)
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


def test_each_shape_is_expressed_by_exactly_the_families_expected():
    for name, (cfg, families) in SHAPES.items():
        got = {f for f in FAMILIES if not expresses(cfg, f)}
        assert got == families, (name, got)


@pytest.mark.slow          # twelve shapes, each exported as every family it can be and loaded in transformers (~12 s)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_family_either_exports_the_same_logits_or_is_refused(shape, tmp_path):
    cfg, families = SHAPES[shape]
    model = random_model(cfg)
    ids = np.random.default_rng(0).integers(0, V, (2, 12))
    ours = np.asarray(model(jnp.asarray(ids))[0])
    for family in FAMILIES:
        out = tmp_path / family
        if family not in families:
            with pytest.raises(HFError, match=f"the {family} family cannot express this model"):
                save_pretrained(model, out, family=family)
            assert not (out / "config.json").exists()
            continue
        written = save_pretrained(model, out, family=family)
        assert written["model_type"] == family
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = theirs(torch.tensor(ids)).logits.numpy()
        err = float(np.abs(logits - ours).max() / np.abs(ours).max())
        assert err < 2e-5, (shape, family, err)


def test_the_automatic_family_is_held_to_the_same_check():
    for name, (cfg, families) in SHAPES.items():
        if families:
            assert family_for(cfg) in families, name


def test_the_refusal_names_the_field_and_the_families_that_can(tmp_path):
    cfg = SHAPES["qwen3"][0]
    with pytest.raises(HFError,
                       match=r"model.attention.qk_norm=True \(a llama config gives False\).*families that can: "
                                      r"qwen3"):
        save_pretrained(random_model(cfg), tmp_path / "x", family="llama")
    with pytest.raises(HFError, match=r"model.windows=\(4, 0\).*no family can"):
        save_pretrained(random_model(SHAPES["windows_4_0"][0]), tmp_path / "y", family="mistral")
