"""The norm registry (jaxformer.ops.norms.NORMS / register_norm): what the Norm module and config validation
dispatch through. Each test that registers a norm restores the registry afterwards."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.config import ModelConfig, replaced
from jaxformer.configio import apply_overrides
from jaxformer.errors import ConfigError
from jaxformer.nn import Norm
from jaxformer.ops import norms


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder_only", vocab_size=11, d_model=8, num_heads=2, d_ff=16, num_decoder_layers=1,
                runtime__dropout=0.0)
    return replaced(ModelConfig(), **{**base, **kw})


@pytest.fixture
def registry():
    """Yields the norms module; whatever a test registers is removed afterwards."""
    saved = dict(norms.NORMS), dict(norms.NORM_BIAS)
    yield norms
    norms.NORMS.clear()
    norms.NORMS.update(saved[0])
    norms.NORM_BIAS.clear()
    norms.NORM_BIAS.update(saved[1])


def centre(x, scale, bias, eps):        # a toy norm: x - mean, times scale, plus bias when there is one
    y = (x - x.mean(-1, keepdims=True)) * scale
    return y if bias is None else y + bias


def test_builtin_norms_are_registered():
    assert norms.NORMS["layernorm"] is norms.layer_norm and norms.NORM_BIAS["layernorm"] is True
    assert norms.NORM_BIAS["rmsnorm"] is False
    x, s = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8)), jnp.float32), jnp.full((8,), 2.0)
    np.testing.assert_array_equal(norms.NORMS["rmsnorm"](x, s, None, 1e-5), norms.rms_norm(x, s, 1e-5))


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_module_dispatches_builtins(kind):
    m = Norm(tiny(norm__type=kind), rngs=nnx.Rngs(0))
    assert hasattr(m, "bias") == (kind == "layernorm")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 8)), jnp.float32)
    want = (norms.layer_norm(x, m.scale[...], m.bias[...], 1e-5) if kind == "layernorm"
            else norms.rms_norm(x, m.scale[...], 1e-5))
    np.testing.assert_array_equal(m(x), want)


def test_registering_an_existing_name_raises(registry):
    for name in ("layernorm", "rmsnorm"):
        with pytest.raises(ValueError, match=f"norm '{name}' is already registered"):
            registry.register_norm(name, centre, bias=False)
    assert registry.NORMS["layernorm"] is norms.layer_norm                 # nothing replaced
    registry.register_norm("centre", centre, bias=False)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_norm("centre", centre, bias=True)
    assert registry.NORM_BIAS["centre"] is False


@pytest.mark.parametrize("name,fn,bias,err", [("", centre, False, ValueError), (None, centre, False, ValueError),
                                              ("x", "not callable", False, TypeError), ("x", centre, 1, TypeError)])
def test_register_rejects_bad_arguments(registry, name, fn, bias, err):
    with pytest.raises(err):
        registry.register_norm(name, fn, bias=bias)
    assert "x" not in registry.NORMS


@pytest.mark.parametrize("bias", [False, True])
def test_registered_norm_is_validated_built_and_called(registry, bias):
    with pytest.raises(ConfigError, match="model.norm.type='centre'"):         # checked when validation runs
        tiny(norm__type="centre")
    assert registry.register_norm("centre", centre, bias=bias) is centre
    cfg = apply_overrides(tiny(), ["norm.type=centre"])
    m = Norm(cfg, rngs=nnx.Rngs(0))
    assert hasattr(m, "bias") == bias
    if bias:
        m.bias[...] = jnp.arange(8.0)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8)), jnp.float32)
    np.testing.assert_allclose(m(x), x - x.mean(-1, keepdims=True) + (jnp.arange(8.0) if bias else 0.0),
                               atol=1e-6)


def test_unknown_norm_type_names_the_field_and_the_registered_names(registry):
    registry.register_norm("centre", centre, bias=False)
    with pytest.raises(ConfigError) as e:
        tiny(norm__type="batchnorm")
    msg = str(e.value)
    assert "model.norm.type='batchnorm'" in msg and all(f"'{n}'" in msg for n in ("layernorm", "rmsnorm", "centre"))
