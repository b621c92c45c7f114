"""Every attention backend against "reference": outputs, log-sum-exp and gradients under padding, causal, combined
masks, bias (dense and ALiBi), GQA/MQA, KV segments and all-masked rows; named refusals; the whole model
(train step, KV-cached decoding, heatmaps) with each backend; remat and the mixed-precision policy.

Tolerances are relative to the reference's own magnitude at float32 (1e-5), so they hold on any CPU or GPU.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import ops
from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.errors import BackendError
from jaxformer.nn import build_model
from jaxformer.ops import fused, positional

RTOL = 1e-5
B, T, N, H = 2, 32, 4, 8


def close(got, want, what="", scale=None):
    """|got - want| <= RTOL · max|want| (or RTOL · scale: a gradient leaf that is zero in exact arithmetic,
    such as a key bias's, is judged against the largest gradient of its model)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), scale or 1e-30)
    assert np.abs(got - want).max() <= RTOL * scale, f"{what}: max |diff| {np.abs(got - want).max():.3g}, " \
                                                     f"|ref| {scale:.3g}"


def make(kh=2, t=T, s=T, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)
    return f(B, t, N, H), f(B, s, kh, H), f(B, s, kh, H), r


def case(name):
    """-> (q, k, v, mask, bias, row weights [B,T] for the loss, pallas_ok)."""
    if name == "gqa_mqa":
        q, k, v, r = make(kh=1)
        return q, k, v, None, None, None, True
    q, k, v, r = make()
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    valid = jnp.arange(T)[None] < jnp.array([[T], [T - 7]])                     # row 1: 7 padded keys
    if name == "padding":
        return q, k, v, valid[:, None, None, :], None, valid, True
    if name == "causal":
        return q, k, v, ops.CausalMask(pos, pos, valid), None, valid, True
    if name == "combined":                                      # causal & random & one query row with no key
        extra = jnp.asarray(r.random((B, 1, T, T)) > 0.3).at[0, 0, 5].set(False)
        return q, k, v, ops.CausalMask(pos, pos, valid).materialize() & extra, None, None, False
    if name == "bias":                                          # a learnable dense bias, broadcast over B
        return q, k, v, valid[:, None, None, :], jnp.asarray(r.normal(size=(1, N, T, T)), jnp.float32), None, False
    if name == "alibi":
        return q, k, v, ops.CausalMask(pos, pos), positional.AlibiBias(positional.alibi_slopes(N), pos, pos), \
            None, False
    raise KeyError(name)


CASES = ("padding", "causal", "combined", "bias", "gqa_mqa", "alibi")


def run(backend, q, k, v, mask, bias, rows, block=8):
    """-> out, lse, grads (q, k, v[, bias]) of a loss that weights every output (rows: only those rows)."""
    dense_bias = bias is not None and not hasattr(bias, "tile")

    def loss(q, k, v, b):
        out = ops.dot_product_attention(q, k, v, mask=mask, bias=b if dense_bias else bias, backend=backend,
                                        block_size=block).out
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return jnp.sum(out * w * (1.0 if rows is None else rows[:, :, None, None]))

    out, _, lse = jax.jit(lambda q, k, v: ops.dot_product_attention(q, k, v, mask=mask, bias=bias, backend=backend,
                                                                 block_size=block, return_lse=True))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if dense_bias else (0, 1, 2)))(q, k, v, bias)
    return out, lse, grads


@pytest.mark.parametrize("backend", ["chunked", "pallas"])
@pytest.mark.parametrize("name", CASES)
def test_backend_agrees_with_reference(backend, name):
    q, k, v, mask, bias, rows, pallas_ok = case(name)
    if backend == "pallas" and not pallas_ok:
        with pytest.raises(BackendError, match="pallas"):
            run(backend, q, k, v, mask, bias, rows)
        return
    want = run("reference", q, k, v, mask, bias, rows)
    got = run(backend, q, k, v, mask, bias, rows)
    keep = np.ones((B, T), bool) if rows is None else np.asarray(rows)   # pallas: padded query rows differ
    close(np.asarray(got[0])[keep], np.asarray(want[0])[keep], "out")
    lse_g, lse_w = np.moveaxis(np.asarray(got[1]), 1, 2)[keep], np.moveaxis(np.asarray(want[1]), 1, 2)[keep]
    np.testing.assert_array_equal(np.isinf(lse_g), np.isinf(lse_w))
    close(np.where(np.isinf(lse_w), 0, lse_g), np.where(np.isinf(lse_w), 0, lse_w), "lse")
    for i, (g, w) in enumerate(zip(got[2], want[2])):
        close(g, w, f"grad {i}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("name", CASES)
def test_cudnn_agrees_with_reference_in_bfloat16(name):
    """cuDNN (bfloat16 activations) against the float32 reference on the same bf16-rounded inputs: outputs and
    gradients within a few bfloat16 steps of the reference's scale."""
    q, k, v, mask, bias, rows, _ = case(name)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    want = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), mask, bias, rows)
    got = run("cudnn", q, k, v, mask, bias, rows)
    bf16 = 8 * float(jnp.finfo(jnp.bfloat16).eps)
    for g, w, what in [(got[0], want[0], "out"), *((a, b, f"grad {i}") for i, (a, b) in enumerate(zip(got[2],
                                                                                                       want[2])))]:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= bf16 * max(np.abs(w).max(), 1e-30), what
    g, w = np.asarray(got[1], np.float64), np.asarray(want[1], np.float64)            # lse [B,N,T]
    np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
    finite = np.isfinite(w)
    assert np.abs(g[finite] - w[finite]).max() <= bf16 * max(np.abs(w[finite]).max(), 1.0), "lse"


def test_all_masked_rows_are_zero_with_zero_gradient():
    q, k, v, _ = make()
    mask = jnp.ones((B, 1, T, T), bool).at[:, :, 3].set(False)
    out, _, lse = ops.dot_product_attention(q, k, v, mask=mask, backend="chunked", block_size=8, return_lse=True)
    assert np.all(np.asarray(out[:, 3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, 3])))
    g = jax.grad(lambda q: ops.dot_product_attention(q, k, v, mask=mask, backend="chunked").out.sum())(q)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g[:, 3]) == 0)


def test_chunked_kv_segments_and_uneven_blocks():
    q, k, v, _ = make(t=5, s=29)
    want = ops.dot_product_attention(q, k, v).out
    got = ops.dot_product_attention(q, (k[:, :20], k[:, 20:]), (v[:, :20], v[:, 20:]), backend="chunked",
                                    block_size=7).out
    close(got, want, "segments")


def test_chunked_under_vmap():
    q, k, v, _ = make()
    f = lambda q, k, v, b: ops.dot_product_attention(q[None], k[None], v[None], backend=b, block_size=8)[0]
    close(jax.vmap(lambda *a: f(*a, "chunked"))(q, k, v), jax.vmap(lambda *a: f(*a, "reference"))(q, k, v))


def test_weights_recomputed_from_lse():
    q, k, v, mask, bias, _, _ = case("alibi")
    _, want, _ = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_probs=True)
    out, got, _ = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_probs=True, backend="chunked")
    close(got, want, "weights")
    _, _, lse = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="chunked")
    rows = jnp.array([0, 7, 23])
    close(ops.attention_probs(q, k, lse, mask=mask, bias=bias, rows=rows), want[:, :, rows], "rows")


def test_named_refusals():
    q, k, v, _ = make()
    with pytest.raises(BackendError, match="cudnn"):              # this test machine has no GPU
        if ops.fused.platform() == "gpu":
            raise BackendError("cudnn: float32 refused by problem()") if ops.fused.problem(
                "cudnn", dtype=jnp.float32) else AssertionError("float32 should be refused")
        ops.dot_product_attention(q, k, v, backend="cudnn").out
    with pytest.raises(BackendError, match="reference"):
        ops.dot_product_attention(q, k, v, backend="chunked", mask_value=0.0).out
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    with pytest.raises(BackendError, match="decode"):             # a causal mask against a cache
        ops.dot_product_attention(q[:, :1], k, v, mask=ops.CausalMask(pos[:, :1] + 3, pos), backend="pallas").out
    with pytest.raises(ValueError, match="backend"):
        ops.dot_product_attention(q, k, v, backend="flash").out
    base = dict(arch="decoder_only", vocab_size=8, d_model=16, num_heads=2, d_ff=32)
    with pytest.raises(ConfigError, match="model.runtime.attention_backend"):
        replaced(ModelConfig(), **base, runtime__attention_backend="cudnn")              # float32 activations
    with pytest.raises(ConfigError, match="model.runtime.attention_backend"):
        replaced(ModelConfig(), **base, runtime__attention_backend="pallas", positional="alibi")
    with pytest.raises(ConfigError, match="model.runtime.remat"):
        replaced(ModelConfig(), **base, runtime__remat="some")
    with pytest.raises(ConfigError, match="model.ablation.mask_value"):
        replaced(ModelConfig(), **base, runtime__attention_backend="chunked", ablation__mask_value="zero")
    if ops.fused.platform() != "gpu":
        with pytest.raises(BackendError, match="needs an NVIDIA GPU"):
            build_model(replaced(ModelConfig(), **base, runtime__attention_backend="cudnn", runtime__dtype="bfloat16"))


# ---- the whole model with each backend ----

LM = replaced(ModelConfig(), arch="decoder_only", vocab_size=23, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                 num_decoder_layers=2, max_len=64, runtime__dropout=0.0, norm__position="pre", positional="rope",
                 runtime__attention_block=8)
SEQ = replaced(ModelConfig(), vocab_size=23, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
               num_decoder_layers=2,
                  max_len=64, runtime__dropout=0.0, positional="alibi", runtime__attention_block=8)


def lm_batch():
    r = np.random.default_rng(1)
    tokens = jnp.asarray(r.integers(1, 23, size=(2, 32)), jnp.int32).at[1, 25:].set(0)   # row 1 padded
    return tokens


def loss_and_grads(cfg, tokens, src=None):
    model = build_model(cfg, seed=0)

    def loss(m):
        logits = (m(tokens) if src is None else m(src, tokens))[0]
        w = (tokens != 0).astype(jnp.float32)[..., None]
        return jnp.sum(jax.nn.log_softmax(logits) * w * jnp.cos(jnp.arange(logits.shape[-1]))) / 100
    return nnx.jit(nnx.value_and_grad(loss))(model)


def assert_same(a, b):
    close(a[0], b[0], "loss")
    top = max(float(jnp.abs(y).max()) for y in jax.tree.leaves(b[1]))
    for (path, x), (_, y) in zip(nnx.to_flat_state(a[1]), nnx.to_flat_state(b[1])):
        close(x[...], y[...], "/".join(map(str, path)), scale=top)


@pytest.mark.parametrize("backend", ["chunked", "pallas"])
def test_lm_loss_and_grads_per_backend(backend):
    tokens = lm_batch()
    want = loss_and_grads(LM, tokens)
    assert_same(loss_and_grads(replaced(LM, runtime__attention_backend=backend), tokens), want)


@pytest.mark.slow          # the encoder-decoder through the chunked backend with ALiBi: ~8 s
def test_seq2seq_with_alibi_chunked():
    tokens, src = lm_batch(), lm_batch()[::-1, 3:]
    assert_same(loss_and_grads(replaced(SEQ, runtime__attention_backend="chunked"), tokens, src),
                loss_and_grads(SEQ, tokens, src))


@pytest.mark.slow          # ~8 s; the chunked backend's cached decoding is also in tests/test_attention_inputs.py
def test_cached_decoding_equals_full_forward_chunked():
    from jaxformer import decode
    model = build_model(replaced(LM, runtime__attention_backend="chunked"), seed=0)
    prompt = jnp.asarray([[5, 6, 7, 8], [0, 0, 9, 4]], jnp.int32)            # row 1 left-padded
    out = decode.generate_lm(model, prompt, max_new=6, segment_ids=(prompt != 0).astype(jnp.int32))
    # greedy by full recomputation with the same backend, over one fixed-size buffer (one compiled forward; the
    # not-yet-written slots have segment id 0, so no position reads them; the test's padding, said explicitly)
    full = jnp.concatenate([prompt, jnp.zeros((2, 6), jnp.int32)], axis=1)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, positions=p,
                                                              segment_ids=(t != 0).astype(jnp.int32))[0])
    for i in range(4, 10):
        pos = jnp.maximum(jnp.cumsum(full != 0, axis=1) - 1, 0)
        full = full.at[:, i].set(jnp.argmax(forward(state, full, pos)[:, i - 1], -1).astype(jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full)[:, 4:])
    seq = build_model(replaced(SEQ, runtime__attention_backend="chunked"), seed=0)
    src = lm_batch()[:, :9]
    np.testing.assert_array_equal(np.asarray(decode.generate_seq2seq(seq, src, max_new=6, bos_id=1, eos_id=None)),
                                  np.asarray(decode.greedy_naive(seq, src, 6, bos_id=1, eos_id=2))[:, :6])


def test_pallas_refuses_the_decode_path_by_name():
    from jaxformer import decode
    model = build_model(replaced(LM, runtime__attention_backend="pallas"), seed=0)
    with pytest.raises(BackendError, match="pallas"):
        decode.generate_lm(model, jnp.asarray([[5, 6, 7, 8]], jnp.int32), max_new=2)


def test_heatmaps_with_the_chunked_backend_are_its_own():
    tokens = lm_batch()
    pattern = lambda cfg: build_model(cfg, seed=0)(tokens, capture=("pattern",))[1]["captured"]["pattern"]  # noqa: E731
    close(pattern(replaced(LM, runtime__attention_backend="chunked")), pattern(LM), "heatmaps")


# ---- remat and mixed precision ----

@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_loss_and_gradients(policy):
    tokens = lm_batch()
    model = build_model(replaced(LM, runtime__remat=policy), seed=0)
    assert "remat" in str(jax.make_jaxpr(lambda m: nnx.grad(lambda m: m(tokens)[0].sum())(m))(model))
    assert_same(loss_and_grads(replaced(LM, runtime__remat=policy), tokens), loss_and_grads(LM, tokens))


def test_bf16_policy_dtypes():
    """Parameters float32; activations bfloat16; attention logits, norms and output logits float32."""
    cfg = replaced(LM, runtime__dtype="bfloat16")
    model = build_model(cfg, seed=0)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}
    jaxpr = str(jax.make_jaxpr(lambda t: nnx.merge(*nnx.split(model))(t))(lm_batch()))
    assert "bf16" in jaxpr
    logits = model(lm_batch())[0]
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))
    x = jnp.ones((2, 3, 32), jnp.bfloat16) * 3
    assert ops.norms.layer_norm(x, None, None).dtype == jnp.bfloat16        # computed in f32, cast back


@pytest.mark.slow          # two reversal trainings of 600 steps (about 2 minutes; make test-all)
def test_bf16_policy_trains_reversal_to_the_same_accuracy(tmp_path):
    from helpers import ROOT
    from jaxformer.configio import apply_overrides, load_config_file
    from jaxformer.train.loop import train
    exact = {}
    for dtype in ("float32", "bfloat16"):
        cfg = apply_overrides(load_config_file(ROOT / "configs/reverse.py"),
                              [f"model.runtime.dtype={dtype}", "train.steps=600", "train.eval_every=600"])
        exact[dtype] = train(cfg, tmp_path / dtype, progress="none")["eval"]["exact_match"]
    assert exact["float32"] >= 0.9, exact
    assert exact["bfloat16"] >= exact["float32"] - 0.02, exact


@pytest.mark.parametrize("t, n", [(8, 4), (4, 4)])       # T == N: a layout mix-up cannot hide behind a shape error
def test_the_residual_of_jax_attention_is_read_as_btn(t, n):
    """cudnn_attention reads the log-sum-exp of `jax.nn.dot_product_attention(return_residual=True)` through
    `fused.residual_lse`. jax returns it [B,T,N] for every implementation (cuDNN's own [B,N,T] transposed inside
    jax); the xla implementation runs here, so the contract is pinned without a GPU. Wrong implementations: the
    residual taken as [B,N,T] already (stop 46's GPU failure: a broadcast error, or silently wrong when T == N),
    or kept in bfloat16."""
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.normal(size=(2, t, n, 8)), jnp.bfloat16) for _ in range(3))
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    _, res = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla", return_residual=True)
    assert res.shape == (2, t, n)
    _, _, want = ops.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask=mask,
                                           return_lse=True, backend="reference")
    got = fused.residual_lse(res)
    assert got.dtype == jnp.float32 and got.shape == want.shape == (2, n, t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05)


def _scanned_grad_temp_bytes(t: int) -> int:
    """XLA's temporaries of the gradient of two chunked attentions applied by a lax.scan (as the layer stack
    applies its blocks), causal over t tokens, tiles of 128."""
    q = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    pos = jnp.arange(t)[None]

    def loss(q, k, v):
        mask = ops.masks.CausalMask(pos, pos)
        step = lambda x, _: (ops.flash.chunked_attention(x, k, v, mask, scale=0.2, block_q=128, block_k=128)[0],
                             None)
        return jnp.sum(jnp.sin(jax.lax.scan(step, q, None, length=2)[0]))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes


def test_chunked_attention_under_a_differentiated_scan_keeps_no_tiles():
    # a lax.cond skipping tiles made JAX keep every [bq,bk] tile as a scan residual: T² memory (16x for 4x T)
    small, large = _scanned_grad_temp_bytes(512), _scanned_grad_temp_bytes(2048)
    assert large < 6 * small, (small, large)
