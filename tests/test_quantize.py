"""Post-training quantization (jaxformer.quantize, qwix): which weights are quantized and how, the error against
the float model bounded by the format's step, cached decoding and beam search with quantized weights, the
batch-1 padding path, and `eval` / `generate --quantize` on a trained run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cached_and_full, compiled

from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.nn.cache import QuantizedKV
from jaxformer.nn.params import project
from jaxformer.quantize import MODES, Quantized, contracted_axes, quantize_model, quantize_weight, weight_bytes

V = 19
EPS32 = float(np.finfo(np.float32).eps)
# relative error of a quantized model's logits against the float model's: a few quantization steps of the
# format (int8: 1/127 of a channel's largest weight; int4: 1/7), with headroom for their accumulation
REL = {"int8": 8 / 127, "w8a8": 8 / 127, "int4": 2 / 7}


def cfg(**kw):
    base = dict(arch="decoder_only", vocab_size=V, d_model=256, num_heads=4, d_ff=256, num_decoder_layers=2,
                num_encoder_layers=1, norm__position="pre", positional="rope", runtime__dropout=0.0, max_len=32)
    return replaced(ModelConfig(), **{**base, **kw})


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_the_contracted_axes_of_every_projection():
    assert contracted_axes(("layers", "embed", "q_heads", "head_dim")) == (1,)         # wq/wk/wv [L,D,N,H]
    assert contracted_axes(("layers", "q_heads", "head_dim", "embed")) == (1, 2)      # wo [L,N,H,D]
    assert contracted_axes(("layers", "embed", "mlp")) == (1,)                        # w1 [L,D,F]
    assert contracted_axes(("layers", "mlp", "embed")) == (1,)                        # w2 [L,F,D]
    assert contracted_axes(("layers", "expert", "mlp", "embed")) == (2,)              # MoE w2 [L,E,F,D]


def test_only_the_layer_projections_are_quantized_with_per_channel_scales():
    model = quantize_model(build_model(cfg(tie_embeddings=False, ffn="moe", moe__num_experts=2)), "int8")
    kinds = {}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        kinds["/".join(map(str, path))] = v.get_value()
    q = {k for k, v in kinds.items() if isinstance(v, Quantized)}
    assert {k.split("/")[-1] for k in q} == {"wq", "wk", "wv", "wo", "w1", "w2"}
    assert all(not isinstance(kinds[k], Quantized) for k in kinds if k.split("/")[-1] in
               ("tokens", "head", "router", "scale", "bias", "b1", "b2", "bq", "bo"))
    wq = kinds["decoder/layers/blocks/self_attn/wq"].array
    assert wq.qvalue.dtype == jnp.int8 and wq.qvalue.shape == (2, 256, 4, 64)
    assert wq.scale.shape == (2, 1, 4, 64)                              # one scale per layer and output channel
    int4 = quantize_model(build_model(cfg()), "int4")
    q4 = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(int4, nnx.Param))}
    assert q4["decoder/layers/blocks/self_attn/wq"].array.scale.shape == (2, 2, 4, 64)   # 256 inputs: 2 blocks
    assert q4["decoder/layers/blocks/self_attn/wo"].array.scale.shape == (2, 1, 1, 256)  # N·H in, per channel


def test_w8a8_multiplies_int8_by_int8():
    """w8a8's dot takes int8 activations as well as int8 weights (weight-only int8 dequantizes its weight and
    multiplies floats)."""
    x = jax.random.normal(jax.random.key(1), (3, 2, 64))
    for mode, both in (("w8a8", True), ("int8", False)):
        w = quantize_weight(jax.random.normal(jax.random.key(0), (64, 4, 16)), ("embed", "q_heads", "head_dim"),
                            mode)
        dots = [e for e in jax.make_jaxpr(lambda x: project("BTD,DNH->BTNH", x, w))(x).jaxpr.eqns
                if e.primitive.name == "dot_general"]
        assert len(dots) == 1
        assert [str(v.aval.dtype) for v in dots[0].invars].count("int8") == (2 if both else 0), dots[0]


def test_weight_bytes_quarter_and_eighth_of_float32():
    floats = weight_bytes(build_model(cfg()))
    b8 = weight_bytes(quantize_model(build_model(cfg()), "int8"))
    b4 = weight_bytes(quantize_model(build_model(cfg()), "int4"))
    assert b8["float"] == b4["float"] < floats["total"]
    projections = floats["total"] - b8["float"]                         # float32 bytes of what was quantized
    assert projections / 4 < b8["quantized"] < projections / 4 * 1.05   # int8 values + float32 scales
    assert projections / 8 < b4["quantized"] < projections / 8 * 1.2   # packed int4 + block scales


@pytest.mark.parametrize("mode", MODES)
def test_quantized_logits_stay_within_the_formats_step_of_float(mode):
    x = jnp.asarray(np.random.default_rng(0).integers(1, V, (3, 12)), jnp.int32)
    want = compiled(build_model(cfg(), seed=1), x)[0]
    got = compiled(quantize_model(build_model(cfg(), seed=1), mode), x)[0]
    assert 0 < rel(got, want) < REL[mode]


def test_w8a8_one_row_padding_equals_the_row_of_a_batch():
    w = quantize_weight(jax.random.normal(jax.random.key(0), (64, 4, 16)), ("embed", "q_heads", "head_dim"), "w8a8")
    x = jax.random.normal(jax.random.key(1), (3, 2, 64))
    many = project("BTD,DNH->BTNH", x, w)
    one = project("BTD,DNH->BTNH", x[:1, :1], w)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(many[:1, :1]))   # per-token scales: same bits


@pytest.mark.parametrize("mode", [pytest.param("int4", marks=pytest.mark.slow), "w8a8"])
def test_quantized_cached_decoding_equals_its_full_forward(mode):
    model = quantize_model(build_model(cfg(), seed=2), mode)
    x = jnp.asarray(np.random.default_rng(1).integers(1, V, (2, 9)), jnp.int32)
    got, want, _ = cached_and_full(model, x, 5)
    # int4 weights are constants: float32 agreement. w8a8 also rounds each activation to int8 at run time, and the
    # cached pass's float32-level differences can flip a rounding: bounded by one int8 step of the largest logit
    tol = 64 * EPS32 if mode == "int4" else 1 / 127
    assert float(jnp.abs(got - want).max()) <= tol * float(jnp.abs(want).max())


def test_int8_kv_cache_decodes_like_the_full_forward_in_a_quarter_of_the_bytes():
    model = build_model(cfg(runtime__kv_cache_dtype="int8", num_kv_heads=2), seed=4)
    got, want, cache = cached_and_full(model, jnp.asarray(np.random.default_rng(3).integers(1, V, (2, 9)),
                                                          jnp.int32), 5)
    assert all(isinstance(k, QuantizedKV) and k.values.dtype == jnp.int8 for k in cache.k)
    # keys and values rounded to int8 steps of each vector's largest entry: the logits move by less than a step
    assert 0 < float(jnp.abs(got - want).max()) <= 1 / 127 * float(jnp.abs(want).max())
    f32 = build_model(cfg(num_kv_heads=2), seed=4).init_cache(2, 9)
    nbytes = lambda t: sum(a.nbytes for a in jax.tree.leaves(t))                     # noqa: E731
    head_dim = 256 // 4
    assert nbytes(cache.k) == nbytes(f32.k) // 4 + nbytes(f32.k) // head_dim          # int8 + a float32 per vector
