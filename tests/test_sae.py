"""Sparse autoencoders (`jaxformer.sae`) against NumPy transcriptions of SAELens' math, on a tiny model's captured
activations.

Wrong implementations these catch: TopK choosing the k smallest pre-activations, or keeping negative ones among
its k (no ReLU after the choice); b_dec not subtracted before encoding;
an L1 term that ignores the decoder norms; an AuxK loss over live latents, or not scaled by min(dead / k_aux, 1);
the dead counter reset by a latent that did not fire; resampling that leaves the Adam moments; a patch applied at
every layer, or whose error term is not the unedited reconstruction's; a saved folder SAELens could not read
(other file names, other keys or shapes).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError, DataError
from jaxformer.nn import build_model
from jaxformer.ops.losses import mean_nll
from jaxformer.sae import (SAESpec, decode, encode, evaluate_sae, init_sae, load_saelens, sae_loss, sae_patch,
                           save_saelens, site_rows, train_sae)

D, V = 32, 40


@pytest.fixture(scope="module")
def model():
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=V, d_model=D, num_heads=4, num_kv_heads=2,
                   d_ff=64, num_decoder_layers=2, max_len=16, positional="rope", norm__position="pre",
                   runtime__dropout=0.0)
    return build_model(cfg, seed=0)


def _batch(i, b=16, t=12):
    return (jax.random.randint(jax.random.key(i), (b, t), 0, V),)


def _params(spec, seed=0):
    rng = np.random.default_rng(seed)
    return {"W_enc": rng.standard_normal((spec.d_in, spec.d_sae)).astype(np.float32) * 0.3,
            "b_enc": rng.standard_normal(spec.d_sae).astype(np.float32) * 0.1,
            "W_dec": rng.standard_normal((spec.d_sae, spec.d_in)).astype(np.float32) * 0.3,
            "b_dec": rng.standard_normal(spec.d_in).astype(np.float32) * 0.1}


def _np_encode(p, x, spec):
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    if spec.architecture == "standard":
        return pre, np.maximum(pre, 0)
    out = np.zeros_like(pre)
    top = np.argsort(-pre, -1)[:, :spec.k]                       # SAELens' TopK: choose the k, then ReLU them
    np.put_along_axis(out, top, np.maximum(np.take_along_axis(pre, top, -1), 0), -1)
    return pre, out


@pytest.mark.parametrize("architecture", ["topk", "standard"])
def test_encode_decode_and_loss_are_saelens_math(architecture):
    spec = SAESpec(d_in=8, d_sae=24, architecture=architecture, k=5, l1=0.7, aux=0.5)
    p = _params(spec)
    x = np.random.default_rng(1).standard_normal((10, 8)).astype(np.float32)
    pre, f = _np_encode(p, x.astype(np.float64), spec)
    np.testing.assert_allclose(encode(p, x, spec), f, rtol=1e-5, atol=1e-5)
    x_hat = f @ p["W_dec"] + p["b_dec"]
    np.testing.assert_allclose(decode(p, jnp.asarray(f, jnp.float32)), x_hat, rtol=1e-5, atol=1e-5)
    mse = np.mean(np.sum((x_hat - x) ** 2, -1))
    dead = np.zeros(24, bool)
    dead[[2, 3, 7, 11, 19]] = True
    if architecture == "standard":
        want = mse + 0.7 * np.mean(np.sum(f * np.linalg.norm(p["W_dec"], axis=-1), -1))
    else:
        k_aux = 8 // 2                                                   # d_in / 2; 5 dead: the top 4 of them
        ranked = np.where(dead, pre, -np.inf)
        top = np.argsort(-ranked, -1)[:, :k_aux]
        acts = np.zeros_like(pre)
        np.put_along_axis(acts, top, np.take_along_axis(pre, top, -1), -1)
        aux = np.mean(np.sum((acts @ p["W_dec"] - (x - x_hat)) ** 2, -1))
        want = mse + 0.5 * min(5 / k_aux, 1.0) * aux
    got, parts = sae_loss(p, x, spec, jnp.asarray(dead))
    assert float(got) == pytest.approx(want, rel=1e-4)
    assert float(parts["l0"]) == pytest.approx(np.mean(np.sum(f > 0, -1)))


def test_topk_relus_its_k_where_fewer_than_k_pre_activations_are_positive():
    """A very negative b_enc leaves rows with fewer than k positive pre-activations (some with none): TopK chooses
    the k largest, then ReLUs them (SAELens' TopK), so every latent is >= 0 and a row has min(k, #positive) active
    ones, each its pre-activation, in float64 NumPy; the loss's reconstruction and L0 read the same latents.
    Catches a TopK that keeps negative pre-activations among its k (no ReLU after the choice)."""
    spec = SAESpec(d_in=8, d_sae=24, architecture="topk", k=6)
    p = _params(spec, seed=3)
    p["b_enc"] = np.linspace(-4.0, 0.0, 24).astype(np.float32)          # 0 to 4 positive per row
    x = np.random.default_rng(4).standard_normal((12, 8)).astype(np.float32)
    pre, want = _np_encode(p, x.astype(np.float64), spec)
    positive = (pre > 0).sum(-1)
    assert positive.min() == 0 and (positive < spec.k).all() and positive.max() > 0, positive   # the case at hand
    got = np.asarray(encode(p, x, spec))
    assert (got >= 0).all()
    np.testing.assert_array_equal((got > 0).sum(-1), np.minimum(positive, spec.k))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _, parts = sae_loss(p, x, spec, jnp.zeros(24, bool))
    assert float(parts["l0"]) == pytest.approx(positive.mean())
    x_hat = want @ p["W_dec"] + p["b_dec"]
    assert float(parts["mse"]) == pytest.approx(np.mean(np.sum((x_hat - x) ** 2, -1)), rel=1e-4)


def test_the_auxk_loss_is_scaled_by_the_dead_share_and_absent_without_dead_latents():
    spec = SAESpec(d_in=8, d_sae=24, k=5, aux=1.0)
    p, x = _params(spec), np.random.default_rng(2).standard_normal((6, 8)).astype(np.float32)
    none = jnp.zeros(24, bool)
    base = float(sae_loss(p, x, spec, none)[1]["mse"])
    assert float(sae_loss(p, x, spec, none)[0]) == pytest.approx(base)
    one, two = none.at[3].set(True), none.at[3].set(True).at[5].set(True)
    a1, a2 = (float(sae_loss(p, x, spec, d)[0]) - base for d in (one, two))
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    r = x - decode(p, encode(p, x, spec))
    want1 = float(np.mean(np.sum((np.outer(pre[:, 3], p["W_dec"][3]) - np.asarray(r)) ** 2, -1))) / 4  # 1 of 4
    assert a1 == pytest.approx(want1, rel=1e-4) and a2 != pytest.approx(a1)


def test_training_on_captured_activations_explains_the_variance(model):
    spec = SAESpec(d_in=D, d_sae=4 * D, site="resid_post", layer=1, k=8, lr=3e-3)
    params, log = train_sae(model, (_batch(i) for i in range(1000)), spec, steps=150)
    first, last = float(log[0]["mse"]), float(log[-1]["mse"])
    report = evaluate_sae(model, params, spec, _batch(10 ** 6), _batch(10 ** 6)[0])
    assert last < 0.3 * first, (first, last)
    assert report["fve"] > 0.75 and report["l0"] <= 8, report          # 0.81 when written
    assert 0.0 < report["recovered"] <= 1.05 and report["loss_zero"] > report["loss_clean"], report
    x, _ = site_rows(model, _batch(10 ** 6), spec)
    x_hat = decode(params, encode(params, x, spec))
    assert report["fve"] == pytest.approx(float(1 - jnp.sum((x - x_hat) ** 2) / jnp.sum((x - x.mean(0)) ** 2)),
                                          rel=1e-5)


def test_dead_latents_are_counted_and_resampled_with_fresh_adam_moments(model):
    """Latents 0..9 get b_enc = −1e4 (they can never fire): after dead_steps steps they are dead; a standard
    SAE resampled at step 4 points them at rows, zeroes their Adam moments, and they fire again."""
    import optax
    from jaxformer.sae import _resample, _step
    from flax import nnx
    spec = SAESpec(d_in=D, d_sae=64, architecture="standard", l1=0.01, site="resid_mid", layer=0, dead_steps=3,
                   resample_every=4)
    p = init_sae(spec, jax.random.key(0))
    p["b_enc"] = p["b_enc"].at[:10].set(-1e4)
    _, log = train_sae(model, (_batch(i) for i in range(100)), spec, steps=4, params=dict(p))
    assert [round(float(m["dead"]) * 64) for m in log] == [0, 0, 0, 10]           # dead from the 4th step
    graphdef, state = nnx.split(model)
    tx = optax.adam(spec.lr)
    train = {"params": dict(p), "opt": tx.init(p), "since_fired": jnp.zeros(64, jnp.int32)}
    for i in range(3):
        train, _ = _step(train, graphdef, state, _batch(i), spec=spec, tx=tx)
    assert float(jnp.abs(train["opt"][0].mu["W_enc"][:, :10]).max()) == 0.0       # never fired: no gradient yet
    train["opt"] = jax.tree.map(lambda a: a + 1.0 if a.dtype == jnp.float32 else a, train["opt"])
    before = np.asarray(train["opt"][0].mu["W_enc"])
    out = _resample(train, graphdef, state, _batch(3), spec=spec)
    assert float(jnp.abs(out["opt"][0].mu["W_enc"][:, :10]).max()) == 0.0
    assert float(jnp.abs(out["opt"][0].nu["W_dec"][:10]).max()) == 0.0
    np.testing.assert_array_equal(out["opt"][0].mu["W_enc"][:, 10:], before[:, 10:])   # the live ones kept theirs
    np.testing.assert_allclose(jnp.linalg.norm(out["params"]["W_dec"][:10], axis=-1), 1.0, rtol=1e-5)
    f = encode(out["params"], site_rows(model, _batch(3), spec)[0], spec)
    assert bool(jnp.all(jnp.any(f[:, :10] > 0, 0)))                                # they fire again


def test_the_patch_splices_the_reconstruction_at_its_layer_only(model):
    spec = SAESpec(d_in=D, d_sae=64, site="resid_pre", layer=1, k=4)
    p = init_sae(spec, jax.random.key(3))
    tokens = _batch(5)[0]
    exact = model(tokens, patch={"resid_pre": sae_patch(p, spec, keep_error=True)})[0]
    np.testing.assert_allclose(exact, model(tokens)[0], rtol=1e-4, atol=1e-4)        # with its error: itself

    def by_hand(value, at):
        x = value[...]
        f = encode(p, x, spec).at[..., 7].set(0.0)
        return jnp.where(at == 1, decode(p, f) + (x - decode(p, encode(p, x, spec))), value)
    ablated = model(tokens, patch={"resid_pre": sae_patch(p, spec, edit=lambda f: f.at[..., 7].set(0.0),
                                                          keep_error=True)})[0]
    np.testing.assert_allclose(ablated, model(tokens, patch={"resid_pre": by_hand})[0], rtol=1e-5, atol=1e-5)
    spliced = model(tokens, patch={"resid_pre": sae_patch(p, spec)}, capture=("resid_pre",))[1]["captured"]
    clean = model(tokens, capture=("resid_pre",))[1]["captured"]["resid_pre"]
    np.testing.assert_allclose(spliced["resid_pre"][0], clean[0])                 # layer 0 untouched
    report = evaluate_sae(model, p, spec, (tokens,), tokens)
    want = float(mean_nll(model(tokens, patch={"resid_pre": sae_patch(p, spec)})[0], tokens))
    assert report["loss_spliced"] == pytest.approx(want, rel=1e-5)


def test_saved_in_saelens_layout_and_read_back(tmp_path):
    from safetensors.numpy import load_file
    spec = SAESpec(d_in=8, d_sae=24, site="resid_post", layer=3, k=5)
    p = {n: jnp.asarray(v) for n, v in _params(spec).items()}
    save_saelens(p, spec, tmp_path / "sae", model_name="tiny")
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert {k: cfg[k] for k in ("architecture", "d_in", "d_sae", "k", "apply_b_dec_to_input",
                                "normalize_activations")} == {"architecture": "topk", "d_in": 8, "d_sae": 24, "k": 5,
                                                              "apply_b_dec_to_input": True,
                                                              "normalize_activations": "none"}
    assert cfg["metadata"]["hook_name"] == "blocks.3.hook_resid_post" and cfg["metadata"]["hook_layer"] == 3
    weights = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))
    assert {n: w.shape for n, w in weights.items()} == {"W_enc": (8, 24), "b_enc": (24,), "W_dec": (24, 8),
                                                         "b_dec": (8,)}
    back, spec2 = load_saelens(tmp_path / "sae")
    assert spec2 == spec and all(np.array_equal(back[n], p[n]) for n in p)
    del cfg["jaxformer"]                                        # as SAELens itself writes it: read from hook_name
    (tmp_path / "sae" / "cfg.json").write_text(json.dumps(cfg))
    assert load_saelens(tmp_path / "sae")[1] == spec


@pytest.mark.parametrize("kw, message", [
    (dict(architecture="gated"), "sae.architecture='gated' is not one of"),
    (dict(k=0), "sae.k=0 must be a positive int"), (dict(k=99), "sae.k=99 exceeds sae.d_sae=24"),
    (dict(lr=-1.0, k=5), "sae.lr=-1.0 must be a finite number > 0"),
    (dict(lr=float("nan"), k=5), "sae.lr=nan must be a finite"), (dict(l1=float("inf"), k=5), "sae.l1=inf must be"),
    (dict(lr=0.0, k=5), "sae.lr=0.0 must be a finite number > 0"), (dict(layer=-1, k=5), "sae.layer=-1 must be an int"),
    (dict(layer=1.5, k=5), "sae.layer=1.5 must be an int"), (dict(site="", k=5), "sae.site='' must name")])
def test_bad_specs_are_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        SAESpec(**{"d_in": 8, "d_sae": 24, **kw})


def test_bad_sites_and_folders_are_named(model, tmp_path):
    with pytest.raises(ConfigError, match="sae.site='nope' is not one of the model's sites"):
        train_sae(model, [_batch(0)], SAESpec(d_in=D, d_sae=8, k=2, site="nope"), steps=1)
    with pytest.raises(ConfigError, match="sae.layer=5 is outside the 2 layers of site 'resid_post'"):
        train_sae(model, [_batch(0)], SAESpec(d_in=D, d_sae=8, k=2, layer=5), steps=1)
    with pytest.raises(DataError, match="the batches ran out after 1 of 3 steps"):
        train_sae(model, [_batch(0)], SAESpec(d_in=D, d_sae=8, k=2), steps=3)
    with pytest.raises(DataError, match="an SAELens folder holds cfg.json and sae_weights.safetensors"):
        load_saelens(tmp_path)
    spec = SAESpec(d_in=8, d_sae=24, k=5)
    save_saelens({n: jnp.asarray(v) for n, v in _params(spec).items()}, spec, tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    (tmp_path / "s" / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(DataError, match="normalize_activations='layer_norm' is not supported"):
        load_saelens(tmp_path / "s")


def test_padding_rows_are_neither_fitted_nor_counted(model):
    """With weights, the loss and its parts are those of the real rows alone (a padding row's activation, however
    large, moves nothing and fires no latent); a batch's `valid` reaches the rows and the report."""
    from jaxformer.sae import SiteInputs
    for architecture in ("topk", "standard"):
        spec = SAESpec(d_in=8, d_sae=24, architecture=architecture, k=5)
        p = _params(spec)
        x = np.random.default_rng(3).standard_normal((10, 8)).astype(np.float32)
        x[7:] *= 1e3
        w = (np.arange(10) < 7).astype(np.float32)
        dead = jnp.zeros(24, bool).at[4].set(True)
        got, parts = sae_loss(p, x, spec, dead, jnp.asarray(w))
        want, wparts = sae_loss(p, x[:7], spec, dead)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        assert np.array_equal(parts["fired"], wparts["fired"]) and float(parts["l0"]) == float(wparts["l0"])
    spec = SAESpec(d_in=D, d_sae=64, site="resid_post", layer=0, k=4)
    p = init_sae(spec, jax.random.key(1))
    tokens = _batch(4)[0]
    valid = jnp.ones(tokens.shape).at[:, 8:].set(0)
    rows, weights = site_rows(model, SiteInputs((tokens,), {}, valid), spec)
    assert rows.shape == (16 * 12, D) and float(weights.sum()) == 16 * 8
    cut = evaluate_sae(model, p, spec, (tokens[:, :8],), tokens[:, :8])
    full = evaluate_sae(model, p, spec, SiteInputs((tokens,), {}, valid), tokens)   # causal: the first 8 agree
    assert full["fve"] == pytest.approx(cut["fve"], rel=1e-5) and full["l0"] == pytest.approx(cut["l0"])
    assert full["loss_clean"] == pytest.approx(cut["loss_clean"], rel=1e-5)


def test_a_feature_ablated_in_cached_decoding_is_the_patched_call(model):
    """The SAE patch is per position, so prefill then one-token cached steps with a feature ablated give the
    uncached patched call's logits (generation can steer with it)."""
    spec = SAESpec(d_in=D, d_sae=64, site="resid_mid", layer=1, k=4)
    p = init_sae(spec, jax.random.key(5))
    patch = {"resid_mid": sae_patch(p, spec, edit=lambda f: f * 3.0, keep_error=True)}
    tokens = _batch(6, b=2, t=8)[0]
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    got, out = model(tokens[:, :5], pos[:, :5], cache=model.init_cache(b, t), mode="prefill", patch=patch)
    steps = [got]
    for i in range(5, t):
        lg, out = model(tokens[:, i:i + 1], pos[:, i:i + 1], cache=out["cache"], mode="decode", patch=patch)
        steps.append(lg)
    want = model(tokens, patch=patch)[0]
    np.testing.assert_allclose(jnp.concatenate(steps, 1), want, rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(want - model(tokens)[0]).max()) > 1e-2                    # the steering does something


# ----------------------------------------------------------------------------- R5: silent wrongs and tracebacks
def test_a_patch_for_a_layer_the_model_lacks_is_refused(model):
    """sae_patch at layer 7 of a 2-layer model ran and changed nothing."""
    spec = SAESpec(d_in=D, d_sae=48, k=4, site="resid_post", layer=7)
    p = {n: jnp.asarray(v) for n, v in _params(spec).items()}
    with pytest.raises(ConfigError, match=r"patch\['resid_post'\] is for layer 7, but site 'resid_post' has 2 layers"):
        model(*_batch(0), patch={"resid_post": sae_patch(p, spec)})
    with pytest.raises(ConfigError, match="is model-level"):
        model(*_batch(0), patch={"embed": sae_patch(p, replaced_spec(spec, site="embed", layer=0))})
    with pytest.raises(ConfigError, match="the SAE reads sae.d_in=32 but site 'mlp_hidden' has width 64"):
        model(*_batch(0), patch={"mlp_hidden": sae_patch(p, replaced_spec(spec, site="mlp_hidden", layer=0))})


def replaced_spec(spec, **kw):
    import dataclasses
    return dataclasses.replace(spec, **kw)


@pytest.fixture(scope="module")
def seq2seq():
    cfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=V, d_model=D, num_heads=4, num_kv_heads=2,
                   d_ff=64, num_encoder_layers=3, num_decoder_layers=1, max_len=16, runtime__dropout=0.0)
    return build_model(cfg, seed=0)


def test_an_encoder_site_counts_the_encoders_layers(seq2seq):
    """train_sae on an encoder site counted layers in the decoder: layer 2 of a 3-layer encoder was refused
    (the decoder has 1), and a decoder site past its layers was not."""
    src, tgt = _batch(1, 4, 6)[0], _batch(2, 4, 5)[0]
    params, log = train_sae(seq2seq, [(src, tgt)], SAESpec(d_in=D, d_sae=16, k=2, site="encoder.resid_post",
                                                           layer=2), steps=1)
    assert np.isfinite(float(log[0]["loss"]))
    with pytest.raises(ConfigError, match="sae.layer=1 is outside the 1 layers of site 'resid_post'"):
        train_sae(seq2seq, [(src, tgt)], SAESpec(d_in=D, d_sae=16, k=2, site="resid_post", layer=1), steps=1)
    for site, message in [("memory", "is model-level"), ("cross_k", "SAELens flattens the heads of z only"),
                          ("cross_pattern", r"\[B,N,T,S\]"), ("encoder.embed", "is model-level")]:
        with pytest.raises(ConfigError, match=message):
            train_sae(seq2seq, [(src, tgt)], SAESpec(d_in=D, d_sae=16, k=2, site=site), steps=1)


@pytest.mark.parametrize("steps", [0, -3, 2.5])
def test_steps_below_one_are_named(model, steps):
    with pytest.raises(ConfigError, match=f"steps={steps!r}: an SAE trains for at least one step"):
        train_sae(model, [_batch(0)], SAESpec(d_in=D, d_sae=8, k=2), steps=steps)


def test_a_z_sae_trains_on_the_heads_flattened(model):
    spec = SAESpec(d_in=32, d_sae=16, k=2, site="z", layer=1)          # N·H = 4·8
    params, log = train_sae(model, [_batch(i) for i in range(2)], spec, steps=2)
    assert params["W_enc"].shape == (32, 16) and np.isfinite(float(log[-1]["loss"]))
    with pytest.raises(ConfigError, match="sae.d_in=8 but site 'z' has width 32"):
        train_sae(model, [_batch(0)], SAESpec(d_in=8, d_sae=16, k=2, site="z", layer=1), steps=1)


def test_an_encoder_z_sae_is_written_with_its_heads_flattened(tmp_path):
    """encoder.z (and cross_z) hold heads as z does: the folder says hook_z, and reads back as the same spec."""
    import json
    for site in ("encoder.z", "cross_z", "z"):
        spec = SAESpec(d_in=8, d_sae=16, site=site, layer=0, k=2)
        params = {"W_enc": jnp.zeros((8, 16)), "b_enc": jnp.zeros(16), "W_dec": jnp.zeros((16, 8)),
                  "b_dec": jnp.zeros(8)}
        path = save_saelens(params, spec, tmp_path / site)
        assert json.loads((path / "cfg.json").read_text())["reshape_activations"] == "hook_z", site
        assert load_saelens(path)[1] == spec


def test_an_sae_folder_is_refused_over_a_users_files_by_that_name(tmp_path):
    from jaxformer.errors import OutputError
    spec = SAESpec(d_in=8, d_sae=16, site="resid_post", layer=0, k=2)
    (tmp_path / "sae").mkdir()
    (tmp_path / "sae" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"sae is not empty \(it holds notes.txt\); an SAE folder is written only"):
        save_saelens(init_sae(spec, jax.random.key(0)), spec, tmp_path / "sae")


def test_resampling_points_the_ith_dead_latent_at_the_ith_worst_real_row(model, monkeypatch):
    """The resampling rule against NumPy (float64), on rows given directly (`site_rows` stood in for): real
    rows ranked by squared reconstruction error, worst first, padding rows after every real one whatever their
    error (here the largest, and every real error is below 1); the i-th dead latent's decoder row is the unit
    direction of its row minus b_dec, its encoder column that direction times 0.2 × the live columns' mean
    norm, its b_enc 0, its Adam moments and its since-fired count 0; live latents and b_dec as they were."""
    import optax
    from flax import nnx

    from jaxformer import sae as module
    spec = SAESpec(d_in=4, d_sae=10, architecture="standard", site="resid_mid", layer=0, dead_steps=3,
                   resample_every=4)
    rng = np.random.default_rng(5)
    p = {n: v * 0.3 for n, v in _params(spec, seed=5).items()}
    x = rng.standard_normal((9, 4)).astype(np.float32) * 0.2
    x[[2, 6]] *= 40.0                                                    # the padding rows: the worst reconstructed
    w = np.ones(9, np.float32)
    w[[2, 6]] = 0.0
    monkeypatch.setattr(module, "site_rows", lambda *a: (jnp.asarray(x), jnp.asarray(w)))
    tx = optax.adam(spec.lr)
    opt = jax.tree.map(lambda a: a + 1.0 if a.dtype == jnp.float32 else a, tx.init(p))
    since = np.array([0, 5, 1, 3, 9, 0, 2, 4, 0, 1], np.int32)              # dead: 1, 3, 4, 7
    graphdef, state = nnx.split(model)
    out = module._resample_program({"params": {n: jnp.asarray(v) for n, v in p.items()}, "opt": opt,
                                    "since_fired": jnp.asarray(since)}, graphdef, state, None, spec=spec)
    q = {n: np.asarray(v, np.float64) for n, v in p.items()}
    x64 = x.astype(np.float64)
    err = (((np.maximum((x64 - q["b_dec"]) @ q["W_enc"] + q["b_enc"], 0) @ q["W_dec"] + q["b_dec"] - x64) ** 2)
           .sum(-1))
    assert err[w > 0].max() < 1.0 < err[w == 0].min()
    worst = [int(r) for r in np.argsort(-np.where(w > 0, err, -1.0), kind="stable")]
    dead = np.flatnonzero(since >= 3)
    scale = 0.2 * np.linalg.norm(q["W_enc"][:, since < 3], axis=0).mean()
    got = {n: np.asarray(v, np.float64) for n, v in out["params"].items()}
    for i, j in enumerate(dead):
        d = x64[worst[i]] - q["b_dec"]
        d /= np.linalg.norm(d)
        np.testing.assert_allclose(got["W_dec"][j], d, rtol=1e-5, atol=1e-6, err_msg=f"dead latent {j}")
        np.testing.assert_allclose(got["W_enc"][:, j], d * scale, rtol=1e-5, atol=1e-6, err_msg=f"dead latent {j}")
    live = since < 3
    np.testing.assert_array_equal(got["W_dec"][live], q["W_dec"][live])
    np.testing.assert_array_equal(got["b_enc"], np.where(live, q["b_enc"], 0.0))
    np.testing.assert_array_equal(got["b_dec"], q["b_dec"])
    np.testing.assert_array_equal(np.asarray(out["since_fired"]), np.where(live, since, 0))
    adam = out["opt"][0]
    for moments in (adam.mu, adam.nu):
        np.testing.assert_array_equal(np.asarray(moments["W_enc"]), np.where(live[None, :], 1.0, 0.0).repeat(4, 0))
        np.testing.assert_array_equal(np.asarray(moments["W_dec"]), np.where(live[:, None], 1.0, 0.0).repeat(4, 1))
        np.testing.assert_array_equal(np.asarray(moments["b_enc"]), np.where(live, 1.0, 0.0))
        np.testing.assert_array_equal(np.asarray(moments["b_dec"]), 1.0)


def test_our_training_settings_round_trip_and_a_hand_edited_folder_is_named(tmp_path):
    """Settings SAELens has no field for (l1, aux, lr, dead_steps, resample_every) come back from our "jaxformer"
    entry; an entry that disagrees with the SAELens fields is refused naming the file."""
    import json
    from jaxformer.errors import DataError
    spec = SAESpec(d_in=8, d_sae=16, site="resid_mid", layer=1, architecture="standard", l1=2.5, aux=0.1, lr=1e-3,
                   dead_steps=7, resample_every=3)
    path = save_saelens(init_sae(spec, jax.random.key(0)), spec, tmp_path / "sae")
    assert load_saelens(path)[1] == spec
    cfg = json.loads((path / "cfg.json").read_text())
    assert cfg["metadata"]["model_name"] == "jaxformer"                                  # the default
    cfg["jaxformer"]["d_sae"] = 32
    (path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match=rf"^{path / 'cfg.json'}: jaxformer.d_sae=32 disagrees with the SAELens "
                                        rf"fields \(d_sae 16\)"):
        load_saelens(path)


@pytest.mark.parametrize("architecture", ["topk", "standard"])
def test_a_topk_sae_keeps_unit_decoder_rows_and_a_standard_one_does_not(model, architecture):
    """Gao et al.'s TopK renormalises the decoder rows after every step; a standard SAE's L1 reads their norms
    (Anthropic's April update), so they are left as trained: here started at norm 3, they stay near 3."""
    spec = SAESpec(d_in=D, d_sae=64, architecture=architecture, k=8, l1=0.01, site="resid_mid", layer=0)
    p = init_sae(spec, jax.random.key(0))
    p["W_dec"] = p["W_dec"] * 3.0
    params, _ = train_sae(model, (_batch(i) for i in range(2)), spec, steps=2, params=p)
    norms = np.linalg.norm(np.asarray(params["W_dec"]), axis=-1)
    if architecture == "topk":
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    else:
        np.testing.assert_allclose(norms, 3.0, rtol=0.05)


def test_a_training_step_fits_the_real_rows_only(model):
    """One step of train_sae on a batch with padding (valid 0 past position 8) is one Adam step on the loss of
    the real rows alone: the model is causal, so its first 8 positions are those of the batch cut at 8."""
    import optax
    from jaxformer.sae import SiteInputs
    spec = SAESpec(d_in=D, d_sae=64, architecture="standard", l1=0.01, site="resid_post", layer=1)
    p = {n: jnp.asarray(v) for n, v in _params(spec).items()}
    tokens = _batch(6)[0]
    valid = jnp.ones(tokens.shape).at[:, 8:].set(0)
    got, _ = train_sae(model, [SiteInputs((tokens,), {}, valid)], spec, steps=1, params=dict(p))
    x = site_rows(model, (tokens[:, :8],), spec)[0]
    grads = jax.grad(lambda q: sae_loss(q, x, spec, jnp.zeros(64, bool))[0])(p)
    tx = optax.adam(spec.lr)
    want = optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])
    for n in p:
        np.testing.assert_allclose(np.asarray(got[n]), np.asarray(want[n]), rtol=1e-5, atol=1e-7, err_msg=n)


@pytest.mark.parametrize("real", [8, 1])
def test_b_dec_starts_at_the_mean_of_the_first_batchs_real_rows(model, real):
    """Without params, b_dec starts at the first batch's mean real row (padding left out; one real position: that
    row itself); an lr of 1e-9 leaves one step's params at their start."""
    from jaxformer.sae import SiteInputs
    spec = SAESpec(d_in=D, d_sae=64, site="resid_post", layer=0, k=4, lr=1e-9)
    tokens = _batch(7)[0]
    valid = jnp.zeros(tokens.shape).at[:, :real].set(1) if real > 1 else jnp.zeros(tokens.shape).at[0, 0].set(1)
    got, _ = train_sae(model, [SiteInputs((tokens,), {}, valid)], spec, steps=1)
    x = np.asarray(site_rows(model, (tokens,), spec)[0], np.float64)
    want = x[np.asarray(valid).reshape(-1) > 0].mean(0)
    np.testing.assert_allclose(np.asarray(got["b_dec"]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_train_sae_resamples_a_standard_saes_dead_latents_on_its_schedule_only(model, architecture):
    """resample_every=2, dead after 1 step unfired: latents 0..9 (b_enc −1e4) are dead at step 1; a standard SAE
    resamples them before step 2 (dead 0 again), a TopK one never resamples (its dead latents are AuxK's)."""
    spec = SAESpec(d_in=D, d_sae=64, architecture=architecture, k=8, l1=0.01, site="resid_mid", layer=0,
                   dead_steps=1, resample_every=2)
    p = init_sae(spec, jax.random.key(0))
    p["b_enc"] = p["b_enc"].at[:10].set(-1e4)
    _, log = train_sae(model, (_batch(i) for i in range(3)), spec, steps=3, params=p)
    want = [0, 10, 0] if architecture == "standard" else [0, 10, 10]
    assert [round(float(m["dead"]) * 64) for m in log] == want
    assert all(set(m) == {"loss", "mse", "l0", "dead"} for m in log)


def test_evaluate_sae_weighs_the_loss_by_the_weights_given(model):
    """Explicit weights (here the first 5 positions) decide which targets the clean loss averages, and the call's
    keywords (two documents packed in a row: segment ids) reach the model, against its log-softmax in NumPy."""
    from jaxformer.sae import SiteInputs
    spec = SAESpec(d_in=D, d_sae=64, site="resid_post", layer=0, k=4)
    tokens = _batch(8)[0]
    targets = jnp.roll(tokens, -1, 1)
    weights = jnp.zeros(tokens.shape).at[:, :5].set(1)
    seg = jnp.ones(tokens.shape, jnp.int32).at[:, 3:].set(2)
    inputs = SiteInputs((tokens,), {"segment_ids": seg})
    report = evaluate_sae(model, init_sae(spec, jax.random.key(0)), spec, inputs, targets, weights)
    logits = np.asarray(model(tokens, segment_ids=seg)[0], np.float64)
    assert not np.allclose(logits, np.asarray(model(tokens)[0]), atol=1e-3)          # the keywords matter
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    assert report["loss_clean"] == pytest.approx(nll[:, :5].mean(), rel=1e-5)


def test_evaluate_sae_reports_what_numpy_computes_from_the_captured_rows(model):
    """Every number of the report against NumPy (float64) on the captured site rows, padding (valid 0) left out:
    mse and l0 per real row, fve against the real rows' mean, dead = latents firing on no real row (small
    activations count: some fire below 1), the loss with the site zeroed at the SAE's layer only (mlp_out: zeroing
    another layer's is another loss; a bias-free stack's resid_post would be 0 after either), and recovered =
    (zero − spliced) / (zero − clean)."""
    from jaxformer.sae import SiteInputs
    spec = SAESpec(d_in=D, d_sae=48, site="mlp_out", layer=1, k=3)
    p = _params(spec, seed=9)
    p["W_enc"] = p["W_enc"] * 0.2                                   # activations of both sides of 1
    tokens = _batch(9)[0]
    targets = jnp.roll(tokens, -1, 1)
    valid = jnp.ones(tokens.shape).at[:, 9:].set(0)
    r = evaluate_sae(model, {n: jnp.asarray(v) for n, v in p.items()}, spec, SiteInputs((tokens,), {}, valid),
                     targets)
    x = np.asarray(model(tokens, capture=("mlp_out",))[1]["captured"]["mlp_out"][1], np.float64)
    x = x.reshape(-1, D)[np.asarray(valid).reshape(-1) > 0]
    q = {n: v.astype(np.float64) for n, v in p.items()}
    f = _np_encode(q, x, spec)[1]
    assert ((f > 0) & (f < 1)).any()
    err = ((f @ q["W_dec"] + q["b_dec"] - x) ** 2).sum(-1)
    assert r["mse"] == pytest.approx(err.mean(), rel=1e-4)
    assert r["fve"] == pytest.approx(1 - err.sum() / ((x - x.mean(0)) ** 2).sum(), rel=1e-4)
    assert r["l0"] == pytest.approx((f > 0).sum(-1).mean(), rel=1e-6)
    assert r["dead"] == pytest.approx((~(f > 0).any(0)).mean(), rel=1e-6)
    assert 0 < r["dead"] < 1

    def zeroed(v, at):
        return v * (at != 1)                                                  # layer 1's mlp_out only
    loss_zero = float(mean_nll(model(tokens, patch={"mlp_out": zeroed})[0], targets, valid))
    other = float(mean_nll(model(tokens, patch={"mlp_out": lambda v, at: v * (at != 0)})[0], targets, valid))
    assert r["loss_zero"] == pytest.approx(loss_zero, rel=1e-5) and abs(loss_zero - other) > 1e-3
    assert r["recovered"] == pytest.approx((r["loss_zero"] - r["loss_spliced"]) / (r["loss_zero"] - r["loss_clean"]))


def test_an_encoders_and_a_cross_attentions_head_sites_are_refused_as_the_decoders(seq2seq):
    from jaxformer.sae import check_site
    for site in ("encoder.q", "encoder.pattern", "cross_k", "cross_pattern", "encoder.attn_scores"):
        with pytest.raises(ConfigError, match=rf"sae.site='{site}' is \[B"):
            check_site(seq2seq, site, 0)
    check_site(seq2seq, "encoder.z", 0)                                          # z's heads flatten


def test_site_rows_pass_the_calls_keywords(model):
    from jaxformer.sae import SiteInputs
    spec = SAESpec(d_in=D, d_sae=64, site="resid_mid", layer=1, k=4)
    tokens = _batch(10)[0]
    seg = jnp.ones(tokens.shape, jnp.int32).at[:, 4:].set(2)
    rows, _ = site_rows(model, SiteInputs((tokens,), {"segment_ids": seg}), spec)
    want = model(tokens, segment_ids=seg, capture=("resid_mid",))[1]["captured"]["resid_mid"][1]
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want).reshape(-1, D))


def test_the_loss_of_one_row_is_that_rows_error():
    """A mean over one real row is that row (a floor on the weight sum above 1 would halve it)."""
    spec = SAESpec(d_in=8, d_sae=24, architecture="standard", l1=0.0)
    p = _params(spec)
    x = np.random.default_rng(4).standard_normal((3, 8)).astype(np.float32)
    q = {n: v.astype(np.float64) for n, v in p.items()}
    f = _np_encode(q, x[:1].astype(np.float64), spec)[1]
    want = ((f @ q["W_dec"] + q["b_dec"] - x[:1]) ** 2).sum()
    got, parts = sae_loss(p, x, spec, jnp.zeros(24, bool), jnp.asarray([1.0, 0.0, 0.0]))
    assert float(parts["mse"]) == pytest.approx(want, rel=1e-5) and float(got) == pytest.approx(want, rel=1e-5)


def test_a_lone_live_latent_sets_the_resampling_scale_alone(model, monkeypatch):
    """All latents dead but one: the dead ones' encoder columns are their unit directions times 0.2 × that one
    live column's norm (the mean over the live columns, of one)."""
    from flax import nnx

    from jaxformer import sae as module
    spec = SAESpec(d_in=4, d_sae=6, architecture="standard", site="resid_mid", layer=0, dead_steps=3,
                   resample_every=4)
    p = {n: jnp.asarray(v) for n, v in _params(spec, seed=6).items()}
    x = np.random.default_rng(6).standard_normal((5, 4)).astype(np.float32)
    monkeypatch.setattr(module, "site_rows", lambda *a: (jnp.asarray(x), jnp.ones(5, jnp.float32)))
    since = jnp.asarray([9, 9, 0, 9, 9, 9], jnp.int32)                          # latent 2 alone is live
    graphdef, state = nnx.split(model)
    out = module._resample_program({"params": p, "opt": optax_state(p), "since_fired": since}, graphdef, state,
                                   None, spec=spec)
    w_enc = np.asarray(out["params"]["W_enc"], np.float64)
    scale = 0.2 * np.linalg.norm(np.asarray(p["W_enc"], np.float64)[:, 2])
    for j in (0, 1, 3, 4, 5):
        np.testing.assert_allclose(np.linalg.norm(w_enc[:, j]), scale, rtol=1e-5, err_msg=f"dead latent {j}")


def optax_state(p):
    import optax
    return optax.adam(1e-3).init(p)


def test_train_sae_logs_each_steps_numbers_and_draws_from_seed_0_unless_told(model):
    """One dict per step with loss, mse, l0 and the dead fraction; the default seed is 0 (another seed draws
    another SAE)."""
    spec = SAESpec(d_in=D, d_sae=48, site="resid_post", layer=1, k=4)
    batches = [_batch(i) for i in range(2)]
    default, log = train_sae(model, iter(batches), spec, 2)
    assert [sorted(m) for m in log] == [["dead", "l0", "loss", "mse"]] * 2
    zero, _ = train_sae(model, iter(batches), spec, 2, seed=0)
    one, _ = train_sae(model, iter(batches), spec, 2, seed=1)
    for n in default:
        np.testing.assert_array_equal(np.asarray(default[n]), np.asarray(zero[n]), err_msg=n)
    assert not np.array_equal(np.asarray(default["W_enc"]), np.asarray(one["W_enc"]))


def test_the_patch_keeps_a_bfloat16_sites_dtype_and_auxk_takes_one_dead_latent_at_two_inputs():
    """sae_patch returns the site's own dtype (a bfloat16 residual stream stays bfloat16, at the SAE's layer and
    elsewhere); at d_in = 2 the AuxK term takes k_aux = max(d_in // 2, 1) = 1 dead latent, scaled by
    min(dead / k_aux, 1) = 1 (NumPy)."""
    from jaxformer.sae import sae_patch
    spec = SAESpec(d_in=D, d_sae=48, site="resid_post", layer=1, k=4)
    p = {n: jnp.asarray(v) for n, v in _params(spec).items()}
    v = jnp.asarray(np.random.default_rng(7).standard_normal((2, 3, D)), jnp.bfloat16)
    for at in (0, 1):
        assert sae_patch(p, spec)(v, jnp.int32(at)).dtype == jnp.bfloat16
    spec = SAESpec(d_in=2, d_sae=6, k=2, aux=1.0)
    p, x = _params(spec, seed=8), np.random.default_rng(8).standard_normal((5, 2)).astype(np.float32)
    dead = np.zeros(6, bool)
    dead[[1, 4]] = True
    pre, f = _np_encode({n: v.astype(np.float64) for n, v in p.items()}, x.astype(np.float64), spec)
    x_hat = f @ p["W_dec"] + p["b_dec"]
    top = np.argmax(np.where(dead, pre, -np.inf), -1)                          # k_aux = 1: the larger of the two
    acts = np.zeros_like(pre)
    acts[np.arange(5), top] = pre[np.arange(5), top]
    aux = np.mean(np.sum((acts @ p["W_dec"] - (x - x_hat)) ** 2, -1))
    want = np.mean(np.sum((x_hat - x) ** 2, -1)) + 1.0 * min(2 / 1, 1.0) * aux
    assert float(sae_loss(p, x, spec, jnp.asarray(dead))[0]) == pytest.approx(want, rel=1e-4)


def test_small_activations_fire_and_the_spec_takes_k_up_to_d_sae_but_no_bool_numbers():
    """A latent fires when its activation is above 0, however small (below 1 too), on a real row (w > 0) only;
    a TopK spec may keep every latent (k = d_sae) but not more; a bool is no number for a training setting."""
    spec = SAESpec(d_in=8, d_sae=24, architecture="standard")
    p = _params(spec, seed=11)
    p["W_enc"] = p["W_enc"] * 0.05                                               # activations below 1
    x = np.random.default_rng(11).standard_normal((6, 8)).astype(np.float32)
    w = jnp.asarray([1, 1, 1, 0, 1, 0], jnp.float32)
    f = _np_encode({n: v.astype(np.float64) for n, v in p.items()}, x.astype(np.float64), spec)[1]
    assert 0 < f.max() < 1
    _, parts = sae_loss(p, x, spec, jnp.zeros(24, bool), w)
    np.testing.assert_array_equal(np.asarray(parts["fired"]), ((f > 0) & (np.asarray(w)[:, None] > 0)).any(0))
    assert SAESpec(d_in=4, d_sae=8, k=8).k == 8
    with pytest.raises(ConfigError, match="k"):
        SAESpec(d_in=4, d_sae=8, k=9)
    with pytest.raises(ConfigError, match="l1"):
        SAESpec(d_in=4, d_sae=8, k=4, l1=True)
