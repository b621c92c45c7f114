"""The ablation switches (wrong on purpose) do what the ablations say, and stay off by default."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_lm, tiny_reverse
from jaxformer import ops
from jaxformer.nn import build_model
from jaxformer.nn.models import decoder_self_mask

EPS = float(jnp.finfo(jnp.float32).eps)


def _qkv(seed=0, b=2, t=5, n=2, h=8):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (b, t, n, h)), jax.random.normal(k2, (b, t, n, h)),
            jax.random.normal(k3, (b, t, n, h)))


def test_mask_value_zero_leaks_and_default_does_not():
    q, k, v = _qkv()
    mask = ops.causal_mask(5)
    out, w, _ = ops.dot_product_attention(q, k, v, mask=mask, return_probs=True)
    assert float(jnp.abs(jnp.where(mask, 0.0, w)).max()) == 0.0          # default: masked weights exactly 0
    out0, w0, _ = ops.dot_product_attention(q, k, v, mask=mask, return_probs=True, mask_value=0.0)
    assert float(jnp.where(mask, 0.0, w0).min(initial=1.0, where=~mask)) > 0.0   # every masked key leaks
    np.testing.assert_allclose(w0.sum(-1), 1.0, rtol=10 * EPS)
    # the leak is a softmax with the masked logits set to 0 (reference computed here)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * 8 ** -0.5
    ref = jax.nn.softmax(jnp.where(mask, logits, 0.0), axis=-1)
    np.testing.assert_allclose(w0, ref, atol=20 * EPS)
    assert not np.allclose(out0, out)


def test_triu_decoder_mask_sees_the_future_only():
    cfg = tiny_lm("model.ablation.causal=triu").model
    pos = jnp.arange(4)[None]
    m = decoder_self_mask(cfg, pos, pos, jnp.array([[True, True, True, False]]))[0, 0]
    expect = (np.arange(4)[None, :] >= np.arange(4)[:, None]) & np.array([True, True, True, False])
    np.testing.assert_array_equal(m, expect)
    normal = decoder_self_mask(tiny_lm().model, pos, pos).materialize()[0, 0]
    np.testing.assert_array_equal(normal, np.tril(np.ones((4, 4), bool)))


def test_switches_change_the_model_and_are_off_by_default():
    base = tiny_reverse()
    assert base.model.ablations == [] and base.model.attention.scale == "rsqrt"
    src = jnp.array([[4, 5, 6, 2, 0]])
    tgt = jnp.array([[1, 6, 5, 4, 2]])
    ref = build_model(base.model)(src, tgt)[0]
    for ov in ("model.ablation.mask_value=zero", "model.ablation.causal=triu", "model.attention.scale=none"):
        cfg = tiny_reverse(ov)
        out = build_model(cfg.model)(src, tgt)[0]                    # same seed, same parameters
        assert out.shape == ref.shape and not np.allclose(out, ref, atol=1e-4), ov
    assert tiny_reverse("model.ablation.causal=triu").model.ablations == ["model.ablation.causal='triu'"]


@pytest.mark.parametrize("key,value", [("model.ablation.mask_value", "inf"), ("model.ablation.causal", "full"),
                                       ("model.attention.scale", "sqrt")])
def test_bad_switch_values_are_named(key, value):
    from jaxformer.errors import ConfigError
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_reverse(f"{key}={value}")
