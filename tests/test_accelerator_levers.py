"""The accelerator levers of `jaxformer.platforms` (issue W): each one changes how the train step is laid out or
compiled, never what it computes, so each is checked here, on CPU, against the step with it off. They are on for
no platform until `benchmarks/gpu.py` measures them on a GPU.

Wrong implementations these catch: a chunked loss that counts the padded tail of its last slice (the sums move
by the padding's tokens), forgets label smoothing or the z-loss inside a slice, or keeps every slice's logits for
the backward pass (the [B,T,V]-sized residual it exists to remove); fused projections that split q/k/v (or gate and
up) in the wrong order; an unrolled stack that drops a layer; the "dots_attention" remat policy not wired to its
name; an option lever whose XLA options never reach the compiler.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import all_eqns, tiny_lm
from jaxformer import platforms
from jaxformer.config import resolve_vocab
from jaxformer.nn import build_model
from jaxformer.ops.losses import chunked_token_losses, token_losses
from jaxformer.platforms import lowering
from jaxformer.train.step import batch_losses

ACCELERATOR = ("chunked_loss", "unrolled_layers", "fused_projections", *platforms.COMPILER_OPTIONS)
V, D = 37, 8


def _head(w, cap):
    def head(x):
        out = jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)
        return cap * jnp.tanh(out / cap) if cap else out
    return head


def _inputs(b=3, t=11, pad_id=0):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(b, t, D)), jnp.float32)
    w = jnp.asarray(r.normal(size=(D, V)) * 0.5, jnp.float32)
    targets = r.integers(1, V, (b, t))
    targets[0, -4:] = pad_id                       # padding in the last slice, where the slices' own padding is
    targets[-1, 2] = pad_id
    return x, w, jnp.asarray(targets, jnp.int32)


@pytest.mark.parametrize("chunk_tokens", [3, 12, 10_000])       # c = 1, 4 (uneven: 11 = 2·4 + 3), T
@pytest.mark.parametrize("smoothing, z, cap, pad", [(0.0, 0.0, 0.0, 0), (0.1, 1e-3, 5.0, 5)])
def test_chunked_losses_equal_the_whole_logits(chunk_tokens, smoothing, z, cap, pad):
    """pad 5: a pad id that is not the value the last slice is padded with."""
    x, w, targets = _inputs(pad_id=pad)

    def sums(x, w, chunked):
        if chunked:
            return chunked_token_losses(x, _head(w, cap), targets, pad, smoothing, z, chunk_tokens)
        return token_losses(_head(w, cap)(x), targets, pad, smoothing, z)

    want, got = sums(x, w, False), jax.jit(sums, static_argnums=2)(x, w, True)
    assert set(got) == set(want) and float(got["count"]) == float((targets != pad).sum())
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=2e-6, err_msg=k)
    grad = jax.jit(jax.grad(lambda x, w, c: sums(x, w, c)["objective"], argnums=(0, 1)), static_argnums=2)
    for g, h in zip(grad(x, w, True), grad(x, w, False)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-6)


def _shapes(jaxpr) -> set[tuple]:
    return {tuple(v.aval.shape) for e in all_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}


def test_chunked_gradient_keeps_one_slice_of_logits():
    """The gradient program never makes an array of [B,T,V] logits, nor the slices' logits stacked for the
    backward pass ([m,B,c,V]): each slice's are made, used and dropped (rematerialised)."""
    x, w, targets = _inputs(b=2, t=12)
    f = lambda x, w: chunked_token_losses(x, _head(w, 0.0), targets, 0, chunk_tokens=8)["objective"]  # noqa: E731
    shapes = _shapes(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr)
    assert (2, 4, V) in shapes                                           # one slice: B=2, c=8//2=4
    assert not {(2, 12, V), (3, 2, 4, V)} & shapes
    whole = _shapes(jax.make_jaxpr(jax.grad(lambda x, w: token_losses(_head(w, 0.0)(x), targets, 0)["objective"],
                                            argnums=(0, 1)))(x, w).jaxpr)
    assert (2, 12, V) in whole                                           # the test can see the whole logits


def _model(*extra):
    cfg = resolve_vocab(tiny_lm("model.norm.position=pre", "model.activation=swiglu", "model.use_bias=true",
                                "model.num_decoder_layers=3", "model.num_kv_heads=2", *extra), 40)
    return build_model(cfg.model, seed=5)


def _loss_and_grads(model, batch):
    graph, state = nnx.split(model)

    def loss(st):
        s, _ = batch_losses(nnx.merge(graph, st), batch, None, model.cfg.pad_id, 0.1, 1e-4)
        return s["objective"] / s["count"], s

    (value, s), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return float(value), s, grads


@pytest.mark.parametrize("levers, extra", [
    ({"chunked_loss": True}, ()), ({"unrolled_layers": True}, ()), ({"fused_projections": True}, ()),
    ({}, ("model.runtime.remat=dots_attention",)),
    ({"chunked_loss": True, "unrolled_layers": True, "fused_projections": True}, ("model.runtime.remat=dots",))])
def test_each_lever_gives_the_same_loss_and_gradients(levers, extra):
    """The model's loss and every parameter's gradient, lever on vs off (float32: summation order only)."""
    r = np.random.default_rng(1)
    x = jnp.asarray(r.integers(1, 40, (3, 13)), jnp.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:].at[0, -3:].set(0)}      # some pad targets
    with platforms.override(**{k: False for k in ACCELERATOR}):
        want, ws, wg = _loss_and_grads(_model(), batch)
    with platforms.override(**({k: False for k in ACCELERATOR} | levers)):
        got, gs, gg = _loss_and_grads(_model(*extra), batch)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert float(gs["count"]) == float(ws["count"]) and float(gs["correct"]) == float(ws["correct"])
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(wg))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(wg)[0], jax.tree.leaves(gg)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6 * scale,
                                   err_msg=jax.tree_util.keystr(path))


def test_fused_and_unrolled_programs_differ_from_the_plain_one():
    """The levers reach the traced program: one q/k/v matmul and one gate/up matmul per layer (fused), no
    layer loop (unrolled)."""
    model, x = _model(), jnp.ones((2, 6), jnp.int32)

    def program(**levers):
        with platforms.override(**({k: False for k in ACCELERATOR} | levers)):
            return jax.make_jaxpr(lambda m: m(x))(model)

    def dots(jaxpr):
        return sum(1 for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")
    plain, fused = dots(program().jaxpr), dots(program(fused_projections=True).jaxpr)
    assert plain - fused == 3                # per layer body: q,k,v -> 1 (-2) and gate,up -> 1 (-1)
    scans = lambda j: [e for e in j.jaxpr.eqns if e.primitive.name == "scan"]   # noqa: E731
    assert scans(program()) and scans(program())[0].params["unroll"] == 1
    assert scans(program(unrolled_layers=True))[0].params["unroll"] == 3


def test_accelerator_levers_are_off_everywhere_and_their_options_reach_the_compiler():
    for p in platforms.PLATFORMS:
        assert not any(platforms.levers(p)[k] for k in ACCELERATOR)
    assert set(platforms.COMPILER_OPTIONS) <= set(platforms.LEVERS)
    with platforms.override(**{k: False for k in platforms.LEVERS}):
        assert lowering.train_compiler_options() is None
        for name, options in platforms.COMPILER_OPTIONS.items():
            with platforms.override(**{name: True}):
                assert lowering.train_compiler_options() == options
                # this XLA knows the option (an unknown one fails the compile): XLA:CPU ignores xla_gpu_*
                jax.jit(lambda a: a + 1, compiler_options=options)(jnp.ones(2)).block_until_ready()


def test_fused_projections_leave_weights_with_their_own_matmul_apart():
    """With the fused_projections lever on, an int8 or adapted (LoRA) model's q/k/v and gate/up stay separate
    matmuls (their weights cannot be concatenated) and give the lever-off logits."""
    from jaxformer.quantize import quantize_model
    cfg = resolve_vocab(tiny_lm("model.activation=swiglu", "model.lora.rank=2"), 40).model
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 40, (2, 6)))
    for model in (build_model(cfg, seed=1), quantize_model(build_model(cfg.function(), seed=1), "int8")):
        forward = nnx.jit(lambda m, t: m(t)[0])
        with platforms.override(fused_projections=False):
            want = forward(model, tokens)
        with platforms.override(fused_projections=True):
            got = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
