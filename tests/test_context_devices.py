"""Context parallelism on 4 devices, in the test's own process when it has them (`helpers.with_devices`: the
mutation tool's runs do, so mutmut sees what reaches `jaxformer.ops.context` and `jaxformer.nn.ring`), else in a
child pytest with 4 fake CPU devices. Against attention over the whole sequence on one device (the reference
backend of `dot_product_attention`, itself checked against NumPy and PyTorch): ring attention and the gathered
keys, in order and zigzag, outputs and gradients, for two packed documents and padding rows (no visible key:
zeros), with a sliding window, a soft-cap and a scale; and the model under a ring plan equals the model on one
device, with the ring run (its collective-permutes in the program) exactly where the plan asks for it.

Wrong implementations these catch (the mutants of ops/context.py and nn/ring.py): blocks rotated the wrong way
or not at all, their positions not passed with them, partial results merged without their log-sum-exps or a
fully-masked row made NaN, a scale or soft-cap dropped, key/value gradients left on the device that computed them,
zigzag's order not undone; the ring run where it does not apply (T not split evenly: a shape error or wrong
rows) or skipped where it does, heads split on one side only (tensor × context with kv heads that do not split).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from helpers import with_devices
from jaxformer.config import ModelConfig, replaced
from jaxformer.config.parallel import ParallelConfig
from jaxformer.nn import build_model
from jaxformer.ops import dot_product_attention
from jaxformer.ops.context import context_parallel_attention, ring_attention, unzigzag, zigzag
from jaxformer.ops.masks import CausalMask
from jaxformer.parallel import Plan

C, B, T, N, K, H = 4, 2, 32, 4, 2, 8


def _problem():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
    seg = jnp.asarray(np.repeat([[1] * 18 + [2] * 10 + [0] * 4], B, 0), jnp.int32)        # two docs + padding
    pos = jnp.asarray(np.where(seg == 1, np.arange(T), np.arange(T) - 18) * (seg != 0), jnp.int32)
    return q, k, v, pos, seg


def _sharded(how, window, softcap, scale, order, plain=False):
    """plain: every option left at its default (axis "context", no soft-cap, the 1/√H scale, the ring's block of
    512) and no k_valid (None: every key valid)."""
    mesh = jax.make_mesh((C,), ("context",), devices=jax.devices()[:C],
                         axis_types=(jax.sharding.AxisType.Auto,))
    z = (lambda x: zigzag(x, C)) if order == "zigzag" else (lambda x: x)
    back = (lambda x: unzigzag(x, C)) if order == "zigzag" else (lambda x: x)

    def local(q, k, v, pos, seg):
        mask = CausalMask(pos, pos, None if plain else seg != 0, seg, seg, window)
        if plain:
            return (ring_attention if how == "ring" else context_parallel_attention)(q, k, v, mask)
        if how == "ring":                                   # blocks of 3: the local 8 tokens padded to 9
            return ring_attention(q, k, v, mask, axis="context", scale=scale, softcap=softcap, block_size=3)
        return context_parallel_attention(q, k, v, mask, axis="context", scale=scale, softcap=softcap)
    spec = P(None, "context")
    run = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
    return lambda q, k, v, pos, seg: back(run(z(q), z(k), z(v), z(pos), z(seg)))


@with_devices(C)
def test_context_parallel_attention_and_the_model_under_ring_plans_equal_one_device():
    """One child process on one machine without 4 devices (its start is most of the cost)."""
    _ops_equal_one_device()
    _model_equals_one_device()


def _ops_equal_one_device():
    q, k, v, pos, seg = _problem()
    for how, order, window, softcap, scale, plain in [("ring", "contiguous", None, 0.0, None, False),
                                                      ("ring", "zigzag", None, 0.0, None, False),
                                                      ("ring", "contiguous", jnp.int32(5), 2.0, 0.3, False),
                                                      ("gather", "zigzag", jnp.int32(5), 2.0, 0.3, False),
                                                      ("ring", "zigzag", None, 0.0, None, True),
                                                      ("gather", "contiguous", None, 0.0, None, True)]:
        def one(q, k, v):
            mask = CausalMask(pos, pos, None if plain else seg != 0, seg, seg, window)
            return dot_product_attention(q, k, v, mask=mask, scale=scale, softcap=softcap).out
        sharded = _sharded(how, window, softcap, scale, order, plain)

        def loss(fn):
            return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * jnp.arange(1, T + 1)[None, :, None, None])
        case = f"{how} {order} window={window} softcap={softcap} scale={scale} plain={plain}"
        want, got = one(q, k, v), jax.jit(sharded)(q, k, v, pos, seg)
        assert bool(jnp.all(want[:, -4:] == 0)) != plain, "padding rows see no key (valid: each other)"
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, err_msg=case)
        g_want = jax.grad(loss(one), argnums=(0, 1, 2))(q, k, v)
        g_got = jax.jit(jax.grad(loss(lambda q, k, v: sharded(q, k, v, pos, seg)), argnums=(0, 1, 2)))(q, k, v)
        for name, a, b in zip("qkv", g_got, g_want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=f"{case}: d{name}")
    _bfloat16_ring_is_the_float32_one_rounded(q, k, v, pos, seg)


def _bfloat16_ring_is_the_float32_one_rounded(q, k, v, pos, seg):
    """bfloat16 q, k, v: the ring's output and gradients come back in bfloat16, the differentiated forward (its
    custom VJP's) bit for bit the plain one, within bfloat16's rounding of the float32 ring's."""
    sharded = _sharded("ring", None, 0.0, None, "zigzag")
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    plain = jax.jit(sharded)(*bf, pos, seg)
    out, pull = jax.vjp(lambda q, k, v: sharded(q, k, v, pos, seg), *bf)
    assert plain.dtype == out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    grads = pull(jnp.ones_like(out))
    g_want = jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v, pos, seg)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in bf))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(sharded(*(x.astype(jnp.float32) for x in bf),
                                                                                pos, seg)), atol=2e-2)
    for name, a, b in zip("qkv", grads, g_want):
        assert a.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=5e-2, rtol=5e-2, err_msg=f"d{name}")


def _lm(heads: int, kv_heads: int, arch: str = "decoder_only", **kw):
    cfg = replaced(ModelConfig(), arch=arch, num_encoder_layers=0 if arch == "decoder_only" else 1, vocab_size=32,
                   d_model=4 * heads, num_heads=heads, num_kv_heads=kv_heads, d_ff=16, num_decoder_layers=2,
                   max_len=16, positional="rope", runtime__dropout=0.0, norm__position="pre",
                   runtime__attention_block=4, **kw)
    return build_model(cfg, seed=0)


def _under(model, inputs, **parallel):
    """The model's logits and its program's collective-permute count, jitted under a plan of 4 devices."""
    from flax import nnx
    plan = Plan(ParallelConfig(**{"data": -1, **parallel}), jax.devices()[:C])
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda state, inputs: nnx.merge(graphdef, state)(*inputs)[0])
    with plan.use():
        compiled = f.lower(state, inputs).compile()        # compiled once: run and read
        return compiled(state, inputs), compiled.as_text().count("collective-permute(")


def _model_equals_one_device():
    """The model under plans of 4 devices against the model on one. Cases: (heads, kv heads, arch, rows, length,
    plan, whether the ring runs). Six heads over three kv heads
    split over tensor=2: the kv heads do not split, so every head stays together (split on the query side only,
    a query head would read another group's keys); one row over data=2: not split (a strict spec refuses it);
    an encoder-decoder: the encoder's bidirectional and the cross-attention's masks are no ring's (only the
    decoder's causal self-attention runs round it), 6 source tokens against 4 target ones; a window (a scalar
    leaf of the mask, not split), a soft-cap and unscaled logits reach the ring."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 8)), jnp.int32)
    ring = {"context_attention": "ring"}
    capped = {"attention__windows": (3, 0), "attention__softcap": 2.0, "attention__scale": "none"}
    for heads, kv, arch, rows, length, parallel, runs, *kw in [
            (4, 2, "decoder_only", 2, 8, {"context": 4, **ring}, True),
            (4, 2, "decoder_only", 2, 8, {"context": 4}, False),                       # gathered by GSPMD
            (4, 2, "decoder_only", 2, 6, {"context": 2, **ring}, True),                # 6 = 2 × 3 splits ...
            (4, 2, "decoder_only", 2, 6, {"context": 4, **ring}, False),               # ... 6 over 4 does not
            (4, 2, "decoder_only", 2, 8, {"context": 2, "tensor": 2, **ring}, True),
            (6, 3, "decoder_only", 2, 8, {"context": 2, "tensor": 2, **ring}, True),
            (4, 2, "decoder_only", 1, 8, {"context": 2, **ring}, True),                # data=2, one row
            (4, 2, "encoder_decoder", 2, 4, {"context": 2, **ring}, True),
            (4, 2, "decoder_only", 2, 8, {"context": 2, **ring}, True, capped)]:
        model = _lm(heads, kv, arch, **(kw[0] if kw else {}))
        inputs = (tokens[:rows, :length],) if arch == "decoder_only" else (tokens[:rows, :6], tokens[:rows, :4])
        want = model(*inputs)[0]
        got, permutes = _under(model, inputs, **parallel)
        case = f"N={heads} K={kv} {arch} B={rows} T={length} {parallel} {kw}"
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, err_msg=case)
        assert (permutes > 0) == runs, (case, permutes)
