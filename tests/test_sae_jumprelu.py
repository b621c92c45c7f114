"""JumpReLU SAEs (Z2's first piece): `jaxformer.ops.sparse` against SAELens' own autograd functions, and the SAE
against SAELens 6 itself: the training loss and every gradient (the threshold's straight-through estimate
included) equal JumpReLUTrainingSAE's training_forward_pass on the same weights and rows; a folder SAELens writes
(JumpReLUSAE.save_model) read with its latents and reconstruction, ours read by SAELens; an older checkpoint's
log_threshold read as SAELens reads it; and a jumprelu SAE trained on a model's site keeps its thresholds >= 0 and
lowers its loss.

Wrong implementations these catch: the threshold's estimate with the wrong kernel width or sign, or not summed over
the rows; the input's gradient taken through the step (or, with ste_to_input, without the estimate); a gate that
lets pre-activations equal to the threshold through; the L0 penalty on the latents' values instead of their count;
the threshold not saved (or saved as log_threshold) or not read; thresholds let fall below 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.errors import ConfigError
from jaxformer.ops import sparse
from jaxformer.sae import SAESpec, encode, decode, init_sae, load_saelens, sae_loss, save_saelens

torch = pytest.importorskip("torch", reason="PyTorch (the test extra) runs SAELens")
jumprelu_sae = pytest.importorskip("sae_lens.saes.jumprelu_sae", reason="SAELens (the test extra) is the reference")

D, F, R = 8, 24, 32


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(R, F)).astype(np.float32)
    theta = np.abs(rng.normal(0.5, 0.3, size=F)).astype(np.float32)
    x[:, :4] = theta[:4] + rng.uniform(-0.02, 0.02, size=(R, 4))          # rows inside the kernel
    return x, theta, rng.normal(size=(R, F)).astype(np.float32)


@pytest.mark.parametrize("ste_to_input", [False, True])
@pytest.mark.parametrize("fn", ["jumprelu", "step"])
def test_the_ops_and_their_gradients_equal_saelens_autograd_functions(fn, ste_to_input):
    x, theta, g = _rows()
    bw = 0.05
    ref = {"jumprelu": jumprelu_sae.JumpReLU, "step": jumprelu_sae.Step}[fn]
    tx, tt = torch.tensor(x, requires_grad=True), torch.tensor(theta, requires_grad=True)
    out = ref.apply(tx, tt, bw, ste_to_input)
    out.backward(torch.tensor(g))
    ours = getattr(sparse, fn)
    y, vjp = jax.vjp(lambda a, b: ours(a, b, bw, ste_to_input), jnp.asarray(x), jnp.asarray(theta))
    gx, gt = vjp(jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(y), out.detach().numpy())
    np.testing.assert_allclose(np.asarray(gt), tt.grad.numpy(), rtol=1e-6, atol=1e-5)
    assert np.abs(tt.grad.numpy()[:4]).min() > 0                          # the estimate really ran
    want_x = tx.grad.numpy() if tx.grad is not None else np.zeros_like(x)
    np.testing.assert_allclose(np.asarray(gx), want_x, rtol=1e-6, atol=1e-5)


def test_the_ops_at_the_threshold_in_bfloat16_and_with_one_shared_threshold():
    """At x = θ both are off (the gate is strict) and so is x's gradient; the kernel is open: (−½, ½); bfloat16 stays
    bfloat16 through values and gradients; a scalar threshold gets the sum over every element."""
    assert sparse.rectangle(jnp.array([-0.5, -0.49, 0.49, 0.5])).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert sparse.rectangle(jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    x, theta = jnp.array([[1.0, 2.0]]), jnp.array([1.0, 1.0])
    for fn in (sparse.jumprelu, sparse.step):
        y, vjp = jax.vjp(lambda a, b: fn(a, b, 0.1), x, theta)
        assert y[0, 0] == 0.0 and vjp(jnp.ones_like(x))[0][0, 0] == 0.0, fn.__name__
        xb, tb = x.astype(jnp.bfloat16), theta.astype(jnp.bfloat16)
        yb, vjpb = jax.vjp(lambda a, b: fn(a, b, 0.1), xb, tb)
        assert yb.dtype == jnp.bfloat16 and [g.dtype for g in vjpb(jnp.ones_like(xb))] == [jnp.bfloat16] * 2
        rows = jnp.array([[0.98, 1.03], [1.01, 3.0]])
        g = jax.grad(lambda t: fn(rows, t, 0.1).sum())(jnp.float32(1.0))
        per = jax.grad(lambda t: fn(rows, t, 0.1).sum())(jnp.ones(2))
        assert g.shape == () and float(g) == pytest.approx(float(per.sum())) and float(g) != 0.0


def _spec(**kw):
    return SAESpec(d_in=D, d_sae=F, site="resid_post", layer=1, architecture="jumprelu", **kw)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"W_enc": jnp.asarray(rng.normal(0, 0.5, (D, F)), jnp.float32),
            "b_enc": jnp.asarray(rng.normal(0, 0.1, F), jnp.float32),
            "W_dec": jnp.asarray(rng.normal(0, 0.5, (F, D)), jnp.float32),
            "b_dec": jnp.asarray(rng.normal(0, 0.1, D), jnp.float32),
            "threshold": jnp.asarray(np.abs(rng.normal(0.3, 0.2, F)), jnp.float32)}


def _theirs(params, *, l0=0.7, bw=0.05):
    cfg = jumprelu_sae.JumpReLUTrainingSAEConfig(d_in=D, d_sae=F, dtype="float32", device="cpu", l0_coefficient=l0,
                                                 jumprelu_bandwidth=bw, apply_b_dec_to_input=True)
    sae = jumprelu_sae.JumpReLUTrainingSAE(cfg)
    with torch.no_grad():
        for name, value in params.items():
            getattr(sae, name).data = torch.tensor(np.asarray(value))
    return sae


def test_the_training_loss_and_every_gradient_equal_saelens_training_forward_pass():
    from sae_lens.saes.sae import TrainStepInput
    params, spec = _params(), _spec(l0_coefficient=0.7, bandwidth=0.05)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(R, D)), jnp.float32)
    pre = (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
    assert np.any(np.abs(np.asarray(pre - params["threshold"])) < 0.025), "no pre-activation inside the kernel"
    dead = jnp.zeros(F, bool)
    (loss, parts), grads = jax.value_and_grad(sae_loss, has_aux=True)(params, x, spec, dead)
    sae = _theirs(params)
    out = sae.training_forward_pass(TrainStepInput(sae_in=torch.tensor(np.asarray(x)), coefficients={"l0": 0.7},
                                                   dead_neuron_mask=None, n_training_steps=0, is_logging_step=False))
    out.loss.backward()
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(parts["mse"]), out.losses["mse_loss"].item(), rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(np.asarray(grads[name]), getattr(sae, name).grad.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    assert np.abs(np.asarray(grads["threshold"])).max() > 0


def test_a_folder_saelens_writes_is_read_with_its_latents_and_ours_is_read_by_saelens(tmp_path):
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    params = _params(1)
    cfg = jumprelu_sae.JumpReLUSAEConfig(d_in=D, d_sae=F, dtype="float32", device="cpu",
                                         metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post", model_name="tiny"))
    theirs = jumprelu_sae.JumpReLUSAE(cfg)
    with torch.no_grad():
        for name, value in params.items():
            getattr(theirs, name).data = torch.tensor(np.asarray(value))
    theirs.save_model(str(tmp_path / "theirs"))
    x = np.random.default_rng(4).normal(size=(R, D)).astype(np.float32)
    got, spec = load_saelens(tmp_path / "theirs")
    assert (spec.architecture, spec.site, spec.layer, spec.d_sae) == ("jumprelu", "resid_post", 1, F)
    with torch.no_grad():
        f_ref = theirs.encode(torch.tensor(x)).numpy()
        x_ref = theirs.decode(torch.tensor(f_ref)).numpy()
    f = np.asarray(encode(got, jnp.asarray(x), spec))
    assert (f > 0).sum() > R and (f == 0).sum() > R                   # some latents gated off, some on
    np.testing.assert_allclose(f, f_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(decode(got, jnp.asarray(f))), x_ref, rtol=1e-5, atol=1e-5)
    save_saelens(params, _spec(bandwidth=0.02), tmp_path / "ours")
    mine, again = load_saelens(tmp_path / "ours")
    assert again == _spec(bandwidth=0.02) and all(bool(jnp.array_equal(mine[n], params[n])) for n in params)
    back = SAE.load_from_disk(str(tmp_path / "ours"), device="cpu")
    assert type(back).__name__ == "JumpReLUSAE"
    np.testing.assert_array_equal(back.threshold.detach().numpy(), np.asarray(params["threshold"]))
    with torch.no_grad():
        np.testing.assert_allclose(back.encode(torch.tensor(x)).numpy(), f_ref, rtol=1e-5, atol=1e-5)


def test_an_older_checkpoints_log_threshold_is_read_as_saelens_reads_it(tmp_path):
    from safetensors.numpy import load_file, save_file
    params = _params(2)
    folder = save_saelens(params, _spec(), tmp_path / "sae")
    w = load_file(str(folder / "sae_weights.safetensors"))
    w["log_threshold"] = np.log(w.pop("threshold"))
    save_file(w, str(folder / "sae_weights.safetensors"))
    got, _ = load_saelens(folder)
    np.testing.assert_allclose(np.asarray(got["threshold"]), np.asarray(params["threshold"]), rtol=1e-6)


def test_encode_gates_at_the_threshold_and_the_spec_checks_its_fields():
    params, spec = _params(), _spec()
    x = jnp.zeros((1, D))
    pre = (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
    at = {**params, "threshold": pre[0]}                                    # every pre-activation exactly at θ
    assert float(jnp.abs(encode(at, x, spec)).max()) == 0.0
    below = {**params, "threshold": pre[0] - 1e-3}
    np.testing.assert_allclose(np.asarray(encode(below, x, spec)), np.asarray(jax.nn.relu(pre)), rtol=1e-6)
    assert (np.asarray(init_sae(spec, jax.random.key(0))["threshold"]) == np.float32(0.01)).all()
    for field, bad in (("bandwidth", 0.0), ("threshold", -0.1), ("l0_coefficient", float("nan"))):
        with pytest.raises(ConfigError, match=f"sae.{field}="):
            _spec(**{field: bad})


def test_after_each_update_thresholds_below_zero_are_raised_to_it_and_nothing_else_changes():
    """SAELens projects the threshold onto >= 0 before each step (below 0 the gate would pass negative
    pre-activations); a jumprelu decoder is not renormalised (SAELens' step mode), a topk one is (Gao et al.)."""
    from jaxformer.sae import _normalized
    params = {**_params(), "threshold": jnp.array([-0.5, 0.0, 0.25] * (F // 3))}
    out = _normalized(params, _spec())
    assert out["threshold"].tolist() == [0.0, 0.0, 0.25] * (F // 3)
    assert all(bool(jnp.array_equal(out[n], params[n])) for n in params if n != "threshold")
    topk = _normalized({n: v for n, v in params.items() if n != "threshold"},
                       SAESpec(d_in=D, d_sae=F, k=4))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(topk["W_dec"]), axis=-1), 1.0, rtol=1e-6)


@pytest.mark.slow          # 60 steps (~4 s); the default lane checks the loss and its gradients against SAELens
def test_a_jumprelu_sae_trains_on_a_models_site_and_keeps_its_thresholds_non_negative():
    from jaxformer.config import ModelConfig, replaced
    from jaxformer.nn import build_model
    from jaxformer.sae import train_sae
    model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=32, d_model=D, num_heads=2, d_ff=16,
                                 num_decoder_layers=2, max_len=16), seed=0)
    spec = SAESpec(d_in=D, d_sae=F, site="resid_post", layer=0, architecture="jumprelu", lr=3e-3,
                   l0_coefficient=0.05, threshold=0.05)
    keys = jax.random.split(jax.random.key(1), 60)
    params, log = train_sae(model, ((jax.random.randint(k, (4, 12), 0, 32),) for k in keys), spec, steps=60)
    assert float(log[-1]["loss"]) < 0.5 * float(log[0]["loss"])
    assert float(params["threshold"].min()) >= 0.0 and not np.allclose(np.asarray(params["threshold"]), 0.05)
