"""SAELens' own folders read as SAELens reads them (issue R5): each folder here is written by SAELens 6.54 itself
(`save_model` of an inference SAE and of a trainer's SAE), or in SAELens 5's layout and read back by SAELens'
own loader as the reference; latents, reconstructions and the spliced model are compared with SAELens' own
encode/decode/forward in PyTorch.

Wrong readings these catch (each was today's behaviour before R5): an SAE on blocks.1.hook_mlp_out read as
resid_post at layer 0 (SAELens 6 writes no hook_layer); blocks.0.hook_resid_post refused with a KeyError text;
a pre-6 config read as layer 0, and its topk (activation_fn_str) as a ReLU SAE; rescale_acts_by_decoder_norm
ignored (latents off by up to 2.4); an attn.hook_z SAE read as resid_post; apply_b_dec_to_input=false refused
though it folds exactly; bfloat16 weights unreadable; a truncated or non-JSON folder a traceback.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError, DataError
from jaxformer.nn import build_model
from jaxformer.sae import SAESpec, decode, encode, load_saelens, sae_patch, save_saelens, site_rows

torch = pytest.importorskip("torch", reason="SAELens runs on PyTorch (the test extra)")

D, N, H, V = 32, 4, 8, 40
SAE = SAEMetadata = sl = None          # SAELens, set by the `sae_lens` fixture


@pytest.fixture(scope="module", autouse=True)
def sae_lens():
    """SAELens, imported by the tests that run (its import takes ~5 s: not at collection, which every worker
    does for every file)."""
    global SAE, SAEMetadata, sl
    sl = pytest.importorskip("sae_lens", reason="SAELens (the test extra) writes and reads the folders")
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    return sl
TOKENS = (np.random.default_rng(0).integers(0, V, (2, 6)),)


@pytest.fixture(scope="module")
def model():
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=V, d_model=D, num_heads=N, num_kv_heads=2,
                   d_ff=64, num_decoder_layers=2, max_len=16, positional="rope", norm__position="pre",
                   runtime__dropout=0.0)
    return build_model(cfg, seed=0)


def _randomized(sae, seed=0, dec_scale=1.0):
    """Random weights everywhere (decoder rows of norms far from 1 with dec_scale), so a mistake shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("W") else 0.1))
        sae.W_dec.mul_(dec_scale * (0.2 + 3 * torch.rand(sae.W_dec.shape[0], 1, generator=g)))
    return sae


def _write(kind, path, hook, d_in=D, d_sae=48, seed=0, dec_scale=1.0, **cfg):
    cls, config = {"topk": (sl.TopKSAE, sl.TopKSAEConfig),
                   "topk_training": (sl.TopKTrainingSAE, sl.TopKTrainingSAEConfig),
                   "standard": (sl.StandardSAE, sl.StandardSAEConfig),
                   "jumprelu": (sl.JumpReLUSAE, sl.JumpReLUSAEConfig),
                   "gated": (sl.GatedSAE, sl.GatedSAEConfig)}[kind]
    sae = _randomized(cls(config(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=hook, model_name="tiny"),
                                 **cfg)), seed, dec_scale)
    sae.save_model(path)
    return path


def _theirs(path, x):
    """SAELens' own reading of the folder: (latents, reconstruction) of x as NumPy."""
    sae = SAE.load_from_disk(str(path))
    with torch.no_grad():
        f = sae.encode(torch.tensor(np.asarray(x)))
        return f.numpy(), sae.decode(f).numpy()


def _captured(model, site, layer):
    return np.asarray(model(*TOKENS, capture=(site,))[1]["captured"][site][layer])


@pytest.mark.parametrize("hook, site, layer", [("blocks.1.hook_mlp_out", "mlp_out", 1),
                                               ("blocks.0.hook_resid_post", "resid_post", 0),
                                               ("blocks.1.hook_resid_pre", "resid_pre", 1),
                                               ("blocks.0.mlp.hook_post", "mlp_hidden", 0)])
def test_the_site_and_layer_come_from_the_hook_name_and_splice_as_saelens_does(model, tmp_path, hook, site, layer):
    d_in = 64 if site == "mlp_hidden" else D
    path = _write("topk", tmp_path / "s", hook, d_in=d_in, k=6)
    assert "hook_layer" not in json.loads((path / "cfg.json").read_text())["metadata"]      # SAELens 6 writes none
    params, spec = load_saelens(path)
    assert (spec.site, spec.layer, spec.architecture, spec.k) == (site, layer, "topk", 6)
    x = _captured(model, site, layer)                                                           # [B,T,D]
    f, x_hat = _theirs(path, x)
    np.testing.assert_allclose(encode(params, x, spec), f, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decode(params, f), x_hat, rtol=1e-5, atol=1e-5)
    # SAELens' splice: the hook's value replaced by sae(x) at that layer, every later computation reading it
    by_hand = model(*TOKENS, patch={site: lambda v, at: jnp.where(at == layer, jnp.asarray(x_hat, v.dtype), v)})[0]
    spliced = model(*TOKENS, patch={site: sae_patch(params, spec)})[0]
    np.testing.assert_allclose(spliced, by_hand, rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(spliced - model(*TOKENS)[0]))) > 1e-2                         # it did change


def test_a_trainers_folder_with_decoder_norm_rescaling_is_folded_exactly(model, tmp_path):
    path = _write("topk_training", tmp_path / "t", "blocks.1.hook_resid_post", k=6, dec_scale=1.0)
    cfg = json.loads((path / "cfg.json").read_text())
    assert cfg["rescale_acts_by_decoder_norm"] is True                    # SAELens' TopK training default, kept
    params, spec = load_saelens(path)
    x = _captured(model, "resid_post", 1)
    f, x_hat = _theirs(path, x)
    ours = np.asarray(encode(params, x, spec))
    assert np.abs(f).max() > 0.5
    np.testing.assert_allclose(ours, f, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decode(params, ours), x_hat, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(params["W_dec"], axis=-1), 1.0, rtol=1e-6)   # unit rows after folding


def test_a_hook_z_sae_reads_z_with_its_heads_flattened(model, tmp_path):
    path = _write("topk", tmp_path / "z", "blocks.1.attn.hook_z", d_in=N * H, k=5, reshape_activations="hook_z")
    params, spec = load_saelens(path)
    assert (spec.site, spec.layer, spec.d_in) == ("z", 1, N * H)
    z = _captured(model, "z", 1)                                                                # [B,T,N,H]
    sae = SAE.load_from_disk(str(path))
    with torch.no_grad():
        want = sae(torch.tensor(z)).numpy()                                                      # [B,T,N,H]
    got = model(*TOKENS, patch={"z": sae_patch(params, spec)}, capture=("z",))[1]["captured"]["z"][1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rows, _ = site_rows(model, TOKENS, spec)
    assert rows.shape == (12, N * H)


def test_no_b_dec_on_the_input_folds_into_the_encoder_bias(model, tmp_path):
    path = _write("standard", tmp_path / "n", "blocks.0.hook_resid_post", apply_b_dec_to_input=False)
    params, spec = load_saelens(path)
    x = _captured(model, "resid_post", 0)
    f, x_hat = _theirs(path, x)
    np.testing.assert_allclose(encode(params, x, spec), f, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decode(params, f), x_hat, rtol=1e-5, atol=1e-5)


def test_a_pre_6_folder_reads_as_saelens_reads_it(model, tmp_path):
    """SAELens 5's layout: hook_name/hook_layer at the top, topk as activation_fn_str + activation_fn_kwargs."""
    _write("topk", tmp_path / "new", "blocks.1.hook_mlp_out", k=7)
    old = tmp_path / "old"
    old.mkdir()
    (old / "sae_weights.safetensors").write_bytes((tmp_path / "new" / "sae_weights.safetensors").read_bytes())
    (old / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": D, "d_sae": 48, "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 7}, "apply_b_dec_to_input": True, "finetuning_scaling_factor": False,
        "context_size": 128, "model_name": "tiny", "hook_name": "blocks.1.hook_mlp_out", "hook_layer": 1,
        "hook_head_index": None, "prepend_bos": True, "normalize_activations": False, "dtype": "float32",
        "device": "cpu", "sae_lens_training_version": "5.5.0"}))
    params, spec = load_saelens(old)
    assert (spec.site, spec.layer, spec.architecture, spec.k) == ("mlp_out", 1, "topk", 7)
    x = _captured(model, "mlp_out", 1)
    f, _ = _theirs(old, x)
    np.testing.assert_allclose(encode(params, x, spec), f, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_are_read(model, tmp_path):
    path = _write("standard", tmp_path / "b", "blocks.0.hook_resid_pre", dtype="bfloat16")
    params, spec = load_saelens(path)
    sae = SAE.load_from_disk(str(path))
    np.testing.assert_array_equal(np.asarray(params["W_enc"]), sae.W_enc.detach().float().numpy())


def test_our_z_folder_is_read_by_saelens_with_the_same_latents(model, tmp_path):
    spec = SAESpec(d_in=N * H, d_sae=40, site="z", layer=0, k=4)
    rng = np.random.default_rng(1)
    params = {"W_enc": rng.standard_normal((N * H, 40)), "b_enc": rng.standard_normal(40) * 0.1,
              "W_dec": rng.standard_normal((40, N * H)), "b_dec": rng.standard_normal(N * H) * 0.1}
    params = {n: jnp.asarray(v, jnp.float32) for n, v in params.items()}
    save_saelens(params, spec, tmp_path / "ours")
    sae = SAE.load_from_disk(str(tmp_path / "ours"))
    assert sae.cfg.metadata.hook_name == "blocks.0.attn.hook_z" and sae.cfg.reshape_activations == "hook_z"
    z = _captured(model, "z", 0)
    with torch.no_grad():
        theirs = sae.encode(torch.tensor(z)).numpy()
    np.testing.assert_array_equal(np.asarray(encode(params, z.reshape(2, 6, -1), spec)) > 0, theirs > 0)
    np.testing.assert_allclose(encode(params, z.reshape(2, 6, -1), spec), theirs, rtol=1e-5, atol=1e-5)
    assert load_saelens(tmp_path / "ours")[1] == spec


@pytest.mark.parametrize("case, message", [
    ("gated", "architecture='gated' is not one of"),
    ("layer_norm", "normalize_activations='layer_norm' is not supported"),
    ("head", "hook_head_index is set"),
    ("unknown_hook", "hook 'blocks.0.ln1.hook_normalized' names no site"),
    ("no_hook", "metadata.hook_name is missing"),
    ("z_without_reshape", "heads are flattened \\(hook_z\\) for z and only for z"),
    ("not_json", "cfg.json: not a JSON file"),
    ("a_list", "a JSON object is expected, not list"),
    ("truncated", "sae_weights.safetensors: not a readable safetensors file"),
    ("scaling", "a scaling factor other than 1"),
    ("no_d_in", "no 'd_in'"),
])
def test_what_cannot_be_read_as_saelens_means_it_is_named(tmp_path, case, message):
    hook = {"unknown_hook": "blocks.0.ln1.hook_normalized", "z_without_reshape": "blocks.0.attn.hook_z"}.get(
        case, "blocks.0.hook_resid_post")
    path = _write("gated" if case == "gated" else "standard", tmp_path / "f", hook,
                  d_in=N * H if case == "z_without_reshape" else D)
    cfg = json.loads((path / "cfg.json").read_text())
    edit = {"layer_norm": {"normalize_activations": "layer_norm"},
            "head": {"metadata": {**cfg["metadata"], "hook_head_index": 2}},
            "no_hook": {"metadata": {k: v for k, v in cfg["metadata"].items() if k != "hook_name"}}}.get(case)
    if edit:
        (path / "cfg.json").write_text(json.dumps({**cfg, **edit}))
    if case == "no_d_in":
        (path / "cfg.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "d_in"}))
    if case == "not_json":
        (path / "cfg.json").write_text(json.dumps(cfg)[:-9])
    if case == "a_list":
        (path / "cfg.json").write_text("[1, 2]")
    if case == "truncated":
        data = (path / "sae_weights.safetensors").read_bytes()
        (path / "sae_weights.safetensors").write_bytes(data[: len(data) // 2])
    if case == "scaling":
        from safetensors.torch import load_file, save_file
        w = load_file(str(path / "sae_weights.safetensors"))
        save_file({**w, "scaling_factor": torch.full((48,), 2.0)}, str(path / "sae_weights.safetensors"))
    with pytest.raises(DataError, match=message):
        load_saelens(path)


def test_sites_an_sae_cannot_read_are_named(model):
    from jaxformer.sae import check_site
    for site, message in [("embed", "is model-level"), ("logits", "is model-level"), ("pattern", r"is \[B,N,T,S\]"),
                          ("attn_scores", r"is \[B,N,T,S\]"), ("q", "SAELens flattens the heads of z only"),
                          ("k", "SAELens flattens the heads of z only")]:
        with pytest.raises(ConfigError, match=message):
            check_site(model, site, 0)
    check_site(model, "z", 1)


@pytest.mark.parametrize("architecture, site, layer", [("topk", "resid_post", 1), ("standard", "z", 0)])
def test_our_cfg_json_is_the_one_saelens_writes_for_the_same_sae(tmp_path, architecture, site, layer):
    """save_saelens' cfg.json against SAELens' own `save_model` of an SAE of the same settings: every field SAELens
    writes, ours holds with SAELens' value (metadata: the hook and model), and ours adds only "jaxformer" (which
    SAELens ignores); z's heads flattened (reshape_activations hook_z), a TopK's decoder norms not rescaled."""
    from jaxformer.saelens import hook_name
    spec = SAESpec(d_in=32, d_sae=48, site=site, layer=layer, architecture=architecture, k=4)
    params = {"W_enc": jnp.zeros((32, 48)), "b_enc": jnp.zeros(48), "W_dec": jnp.zeros((48, 32)),
              "b_dec": jnp.zeros(32)}
    ours = json.loads((save_saelens(params, spec, tmp_path / "ours", model_name="tiny") / "cfg.json").read_text())
    cls, config = (sl.TopKSAE, sl.TopKSAEConfig) if architecture == "topk" else (sl.StandardSAE, sl.StandardSAEConfig)
    extra = {"k": 4} if architecture == "topk" else {}
    reshape = "hook_z" if site.endswith("z") else "none"
    cls(config(d_in=32, d_sae=48, dtype="float32", device="cpu", apply_b_dec_to_input=True,
               normalize_activations="none", reshape_activations=reshape, **extra,
               metadata=SAEMetadata(hook_name=hook_name(site, layer), model_name="tiny"))
        ).save_model(tmp_path / "theirs")
    theirs = json.loads((tmp_path / "theirs" / "cfg.json").read_text())
    assert set(ours) - set(theirs) == {"jaxformer"}, set(ours) ^ set(theirs)
    for key in set(theirs) - {"metadata"}:
        assert ours.get(key) == theirs[key], (key, ours.get(key), theirs[key])
    for key in ("hook_name", "model_name"):
        assert ours["metadata"][key] == theirs["metadata"][key]
    assert ours["reshape_activations"] == reshape
