"""The platform seam (`jaxformer.platforms`): every compiler lever by name, on only where it was measured to pay
(today: XLA:CPU), overridable by name, and off elsewhere, where the model is plain jax.

Wrong implementations these catch: a lever gated by mesh size but not by platform (the GPU gradient keeps the
CPU's custom VJPs and layout conditionals: issue 45's "a GPU run gets a backward pass tuned for XLA:CPU"); an
override that leaks out of its block or accepts a misspelt name; a lever whose "off" form computes something
else (gradients or cached decoding differ); the CPU losing a lever (the program no longer has its conditional)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import all_eqns, cached_and_full, tiny_lm
from jaxformer import platforms
from jaxformer.config import resolve_vocab
from jaxformer.errors import ConfigError
from jaxformer.nn import build_model
from jaxformer.platforms.lowering import train_compiler_options

ALL_OFF = {name: False for name in platforms.LEVERS}


CPU_LEVERS = {"copy_insertion", "threefry_unrolled", "weight_grad", "tiled_transpose", "softmax_gemv",
              "cache_write_order", "decode_fused_qkv", "decode_w2_out_in", "weight_order_dot"}


def test_every_measured_lever_is_on_for_the_cpu_only():
    """The CPU levers on for the CPU; the accelerator levers (tests/test_accelerator_levers.py), not yet measured
    on a GPU, on nowhere."""
    assert platforms.levers("cpu") == {name: name in CPU_LEVERS for name in platforms.LEVERS}
    assert platforms.levers("gpu") == platforms.levers("tpu") == ALL_OFF
    assert CPU_LEVERS < set(platforms.LEVERS)
    for lever in platforms.LEVERS.values():
        assert lever.measured.startswith("benchmarks/results/") and lever.what
    with pytest.raises(ConfigError, match="platform='metal'"):
        platforms.levers("metal")


def test_the_platform_is_jaxs_default_backend_with_cuda_read_as_gpu(monkeypatch):
    assert platforms.current() == jax.default_backend()
    monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
    assert platforms.current() == "gpu" and not platforms.enabled("weight_grad")


def test_override_is_by_name_nests_and_ends_with_its_block():
    on = platforms.enabled("weight_grad")
    with platforms.override(weight_grad=not on):
        assert platforms.enabled("weight_grad") is (not on)
        with platforms.override(softmax_gemv=False):
            assert not platforms.enabled("softmax_gemv") and platforms.enabled("weight_grad") is (not on)
        assert platforms.enabled("softmax_gemv") is (platforms.current() == "cpu")
    assert platforms.enabled("weight_grad") is on
    with pytest.raises(ConfigError, match="unknown lever.*weight_grads"):
        with platforms.override(weight_grads=False):
            pass
    with pytest.raises(ConfigError, match="unknown lever"):
        platforms.enabled("no_such_lever")


def _model():
    cfg = resolve_vocab(tiny_lm("model.norm.position=pre", "model.d_model=64", "model.d_ff=128",
                                "model.num_decoder_layers=2"), 40)
    return build_model(cfg.model, seed=3)


def _primitives(jaxpr) -> set[str]:
    return {e.primitive.name for e in all_eqns(jaxpr)}


def _grad_program(model, x):
    """(primitives of the loss's gradient program, the gradients), traced now (a new function: no trace cache)."""
    graph, state = nnx.split(model)
    loss = lambda s: jnp.sum(jnp.sin(nnx.merge(graph, s)(x)[0]))         # noqa: E731
    grad = lambda s: jax.grad(loss)(s)                                     # noqa: E731
    return _primitives(jax.make_jaxpr(grad)(state).jaxpr), jax.jit(grad)(state)


def test_off_platform_the_gradient_is_plain_jax_and_the_same(monkeypatch):
    """What a GPU or TPU run traces: no layout conditional (`platforms.cpu.materialize`) and no custom VJP, the
    same gradients as the CPU's levers give."""
    model, x = _model(), jnp.asarray(np.random.default_rng(0).integers(1, 40, (2, 8)), jnp.int32)
    cpu_prims, cpu_grads = _grad_program(model, x)
    if platforms.current() == "cpu":
        assert {"platform_index", "cond"} <= cpu_prims                   # the CPU keeps its levers
    monkeypatch.setattr(platforms, "current", lambda: "gpu")
    gpu_prims, gpu_grads = _grad_program(model, x)
    assert not {"platform_index", "cond", "custom_vjp_call", "custom_vjp_call_jaxpr"} & gpu_prims
    scale = max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(cpu_grads))
    for a, b in zip(jax.tree.leaves(cpu_grads), jax.tree.leaves(gpu_grads)):     # float32 summation order only
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale)
    assert train_compiler_options() is None
    monkeypatch.undo()
    if platforms.current() == "cpu":
        assert train_compiler_options()
        with platforms.override(copy_insertion=False):
            assert train_compiler_options() is None


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 2])             # ~3 s each
def test_cached_decoding_equals_the_full_forward_with_every_lever_off(batch):
    model = _model()
    x = jnp.asarray(np.random.default_rng(1).integers(1, 40, (batch, 9)), jnp.int32)
    with platforms.override(**ALL_OFF):
        cached, full, _ = cached_and_full(model, x, prefill=4)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=2e-5, atol=2e-5)
    on_cached, _, _ = cached_and_full(model, x, prefill=4)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(on_cached), rtol=2e-5, atol=2e-5)
