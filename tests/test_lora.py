"""Low-rank adapters (`jaxformer.nn.lora`, model.lora): the adapted matmul against float64 NumPy, training that
moves only the adapters, merging, the frozen base in bfloat16/int8, the PEFT adapter layout, and named errors.

Wrong implementations these catch: the update scaled by alpha instead of alpha/r; B initialised randomly (a
fresh adapter would change the model); gradients or optimizer state for the frozen weights (the base moves, or
memory for moments of every weight); A·B merged in the wrong axis order (a [N,H,D] output weight merged as
[D,N,H]); PEFT's lora_A/lora_B written untransposed; dropout applied at evaluation, or its kept inputs not
scaled by 1/(1 − rate).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_lm
from jaxformer.config import ConfigError, ModelConfig, NormConfig, replaced
from jaxformer.nn import build_model, count_params
from jaxformer.nn.lora import Adapted, LoraWeight, merged, trainable
from jaxformer.nn.weights import frozen_base
from jaxformer.train.step import init_state, make_train_step

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def lm_cfg(**lora) -> ModelConfig:
    cfg = ModelConfig(arch="decoder_only", vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2,
                      num_decoder_layers=2, d_ff=48, max_len=16, positional="rope", activation="swiglu",
                      use_bias=False, norm=NormConfig(position="pre", type="rmsnorm"))
    return replaced(cfg, **{f"lora__{k}": v for k, v in lora.items()}) if lora else cfg


def tokens(seed=0, shape=(2, 12)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 40, shape))


def perturbed(model, scale=0.3, seed=1):
    """The model with its adapters set to random values (B is zero when fresh: no effect to test)."""
    st = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(st)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]))
    return model


@pytest.mark.parametrize("eq,w_shape,x_shape", [("BTD,DNH->BTNH", (6, 3, 4), (2, 5, 6)),
                                                ("BTNH,NHD->BTD", (3, 4, 6), (2, 5, 3, 4)),
                                                ("BTF,FD->BTD", (7, 6), (2, 5, 7))])
def test_the_adapted_matmul_is_xw_plus_scaled_xab_in_float64(eq, w_shape, x_shape):
    rng = np.random.default_rng(0)
    n_in = len(x_shape) - 2
    ins, outs = w_shape[:n_in], w_shape[n_in:]
    x, w = rng.normal(size=x_shape), rng.normal(size=w_shape)
    a, b = rng.normal(size=(*ins, 3)), rng.normal(size=(3, *outs))
    lw = LoraWeight(jnp.asarray(w, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                    scale=0.25)
    got = np.asarray(lw.project(eq, jnp.asarray(x, jnp.float32)), np.float64)
    xf = x.reshape(2, 5, -1)
    want = xf @ w.reshape(xf.shape[-1], -1) + 0.25 * (xf @ a.reshape(-1, 3)) @ b.reshape(3, -1)
    np.testing.assert_allclose(got.reshape(2, 5, -1), want, rtol=1e-5, atol=1e-5)
    merged_w = np.asarray(lw.dequantize(), np.float64)
    np.testing.assert_allclose(merged_w.reshape(xf.shape[-1], -1),
                               w.reshape(xf.shape[-1], -1) + 0.25 * a.reshape(-1, 3) @ b.reshape(3, -1), rtol=1e-5)
    # jit, grad and vmap of the adapted matmul
    f = lambda x, a: lw.replace(a=a).project(eq, x).sum()                         # noqa: E731
    g = jax.jit(jax.grad(f, argnums=1))(jnp.asarray(x, jnp.float32), lw.a)
    assert g.shape == lw.a.shape and bool(jnp.isfinite(g).all())
    v = jax.vmap(lambda x: lw.project(eq, x))(jnp.asarray(x, jnp.float32)[:, None])
    np.testing.assert_allclose(np.asarray(v)[:, 0], got, rtol=1e-5, atol=1e-5)


def test_fresh_adapters_change_nothing_and_count_apart():
    base, adapted = build_model(lm_cfg()), build_model(lm_cfg(rank=4, targets=ALL))
    np.testing.assert_array_equal(np.asarray(base(tokens())[0]), np.asarray(adapted(tokens())[0]))
    assert isinstance(adapted.decoder.layers.blocks.self_attn.wq, Adapted)
    counts = count_params(adapted)
    # per layer: q [32,4]+[4,4·8], k, v [32,4]+[4,2·8], o [4·8,4]+[4,32], gate/up [32,4]+[4,48], down [48,4]+[4,32]
    per_layer = (128 + 128) + 2 * (128 + 64) + (128 + 128) + 2 * (128 + 192) + (192 + 128)
    assert counts["LoRA adapters"] == 2 * per_layer
    assert counts["total"] == count_params(base)["total"] + 2 * per_layer


@pytest.mark.parametrize("base", ["float32", "bfloat16", "int8"])
def test_merging_folds_each_adapter_into_its_weight(base):
    model = perturbed(frozen_base(build_model(lm_cfg(rank=4, targets=ALL, base=base))), scale=0.1)
    want = np.asarray(model(tokens())[0])
    lw = model.decoder.layers.blocks.self_attn.wo[...]
    dense = np.asarray(lw.base.dequantize() if base == "int8" else lw.base, np.float64)
    by_hand = dense + lw.scale * np.einsum("lnhz,lzd->lnhd", np.asarray(lw.a, np.float64), np.asarray(lw.b))
    folded = merged(model)
    assert not any(isinstance(m, Adapted) for _, m in nnx.iter_modules(folded))
    w = folded.decoder.layers.blocks.self_attn.wo[...]
    if base == "bfloat16":          # the merged weight rounded once to the base's dtype
        assert w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(w), by_hand.astype(jnp.bfloat16))
    else:                           # float32 (an int8 base merges into float32): the same function
        assert w.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(w), by_hand, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(folded(tokens())[0]), want, rtol=1e-4, atol=1e-4)


def test_scale_is_alpha_over_rank():
    one = perturbed(build_model(lm_cfg(rank=4, alpha=8.0, targets=("q",))))
    lw = one.decoder.layers.blocks.self_attn.wq[...]
    assert lw.scale == 2.0
    delta = np.asarray(lw.dequantize()) - np.asarray(lw.base)
    want = 2.0 * np.einsum("ldz,lznh->ldnh", np.asarray(lw.a), np.asarray(lw.b))
    np.testing.assert_allclose(delta, want, rtol=1e-5, atol=1e-6)


def train_one(cfg_extra, steps=3):
    cfg = tiny_lm("model.positional=rope", "model.activation=swiglu", "model.runtime.dropout=0.0", *cfg_extra)
    from jaxformer.data import resolve
    cfg, task = resolve(cfg)
    graphs, state = init_state(cfg)
    before = jax.tree.map(np.asarray, state["model"])
    step = make_train_step(graphs, cfg)
    batches = iter(task.train_dataset(cfg.data.batch_size, 0))
    for i in range(steps):
        state, metrics = step(state, jax.tree.map(jnp.asarray, next(batches)), jax.random.key(i))
    return cfg, graphs, before, state


def test_training_moves_only_the_adapters_and_keeps_no_state_for_the_frozen_weights():
    cfg, graphs, before, state = train_one(["model.lora.rank=4", "model.lora.targets=q,v,up"])
    model = nnx.merge(graphs.model, state["model"])
    flat_before = dict(nnx.to_flat_state(before))
    moved = {p for p, v in nnx.to_flat_state(nnx.state(model)) if not np.array_equal(flat_before[p][...], v[...])}
    adapters = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert moved and moved <= adapters                      # every frozen weight bit-identical
    assert {p[-1] for p in moved} == {"a", "b"} and {p[-2] for p in moved} == {"wq", "wv", "w1"}
    n_adapter = sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    opt_floats = sum(x.size for x in jax.tree.leaves(state["opt"]) if jnp.issubdtype(x.dtype, jnp.floating))
    assert opt_floats == 2 * n_adapter                      # AdamW's two moments, of the adapters only
    assert trainable(cfg.model) is nnx.LoRAParam


def test_the_frozen_base_in_int8_trains_its_adapters():
    cfg, graphs, before, state = train_one(["model.lora.rank=4", "model.lora.base=int8", "optim.lr=0.01"], steps=4)
    model = nnx.merge(graphs.model, state["model"])
    assert type(model.decoder.layers.blocks.self_attn.wq.base[...]).__name__ == "Quantized"
    assert type(model.decoder.layers.blocks.self_attn.wk[...]).__name__ == "Quantized"        # not adapted, frozen
    assert model.embed.tokens[...].dtype == jnp.float32
    assert float(jnp.abs(model.decoder.layers.blocks.self_attn.wq.b[...]).max()) > 0


def test_dropout_on_the_adapter_input_is_training_only():
    model = perturbed(build_model(lm_cfg(rank=4, targets=("q", "v"), dropout=0.5)))
    x = tokens()
    eval_a, eval_b = model(x)[0], model(x)[0]
    np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
    np.testing.assert_allclose(np.asarray(eval_a), np.asarray(merged(nnx.clone(model))(x)[0]), rtol=1e-5, atol=1e-5)
    t1 = model(x, rngs=nnx.Rngs(dropout=1))[0]
    t2 = model(x, rngs=nnx.Rngs(dropout=2))[0]
    assert not np.allclose(np.asarray(t1), np.asarray(t2))


def test_the_adapters_input_dropout_keeps_the_expected_update():
    """Inverted dropout: the kept inputs scaled by 1/(1 − rate), so the update's mean over 4096 rows (each its own
    mask) is the update without dropout (unscaled, it would be (1 − rate) of it)."""
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 1.0, (6, 3)), rng.uniform(0.5, 1.0, (3, 5))          # positive: nothing cancels
    lw = LoraWeight(jnp.zeros((6, 5)), jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                    jax.random.key(0), scale=0.5, rate=0.5)
    got = np.asarray(lw.project("BTD,DF->BTF", jnp.ones((1, 4096, 6))), np.float64)
    assert np.unique(got[0, :, 0]).size > 3                                       # the rows' masks differ
    np.testing.assert_allclose(got.mean((0, 1)), 0.5 * np.ones(6) @ a @ b, rtol=0.03)


def test_peft_tensors_are_the_merged_update_in_torch_layout():
    from jaxformer.hf.adapters import adapter_tensors
    model = perturbed(build_model(lm_cfg(rank=4, alpha=8.0, targets=ALL)))
    ts = adapter_tensors(model)
    assert len(ts) == 2 * 7 * 2
    lw = model.decoder.layers.blocks.self_attn.wo[...]                           # [L,N,H,D]: inputs N,H
    a = ts["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"]     # [r, N·H]
    b = ts["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]     # [D, r]
    delta_torch = 2.0 * b @ a                                                     # o_proj.weight is [D, N·H]
    ours = np.asarray(lw.dequantize() - lw.base)[1]                               # [N,H,D]
    np.testing.assert_allclose(delta_torch, ours.reshape(-1, ours.shape[-1]).T, rtol=1e-5, atol=1e-6)
    q_b = ts["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_b.shape == (4 * 8, 4)


def test_qwix_lora_cannot_reach_weights_read_inside_the_scanned_stack():
    """Why jaxformer has its own adapters: qwix 0.1.8 creates them while intercepting a module's call, which
    fails on the layer scan. If a qwix release makes this pass, reconsider."""
    import qwix
    model = build_model(lm_cfg())
    with pytest.raises(Exception):
        qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path=".*", rank=4, alpha=8.0), tokens(),
                                 rngs=nnx.Rngs(0))


@pytest.mark.parametrize("change,match", [
    (dict(lora__rank=4, lora__targets=("q", "x")), "model.lora.targets"),
    (dict(lora__rank=4, lora__targets=()), "model.lora.targets"),
    (dict(lora__rank=-1), "model.lora.rank"),
    (dict(lora__rank=4, lora__dropout=1.0), "model.lora.dropout"),
    (dict(lora__rank=4, lora__base="int4"), "model.lora.base"),
    (dict(lora__rank=4, lora__targets=("gate",), activation="gelu"), "no gate projection"),
    (dict(lora__rank=4, lora__targets=("up",), ffn="moe"), "model.ffn='moe'"),
    (dict(lora__rank=4, runtime__dtype="bfloat16", runtime__param_dtype="bfloat16"), "model.lora.base"),
])
def test_bad_adapter_configs_are_named_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        replaced(lm_cfg(), **change)


def test_function_ignores_the_adapters():
    cfg = lm_cfg(rank=8, targets=ALL, base="int8")
    assert cfg.function() == lm_cfg().function()
    assert dataclasses.replace(cfg, d_model=64).function() != lm_cfg().function()


@pytest.mark.slow          # ~3 s
def test_the_ema_of_an_adapted_run_averages_only_the_adapters():
    from jaxformer.inference.weights import evaluated
    cfg, graphs, before, state = train_one(["model.lora.rank=4", "optim.ema=0.5", "optim.lr=0.01"])
    views = evaluated(cfg.optim, graphs.model, state["model"], state["opt"])
    ema, now = (dict(nnx.to_flat_state(nnx.state(nnx.merge(graphs.model, v)))) for v in
                (views["eval_ema"], state["model"]))
    differs = {p for p in now if not np.array_equal(np.asarray(now[p][...]), np.asarray(ema[p][...]))}
    assert differs and {p[-1] for p in differs} <= {"a", "b"}


@pytest.mark.parametrize("base", [pytest.param("float32", marks=pytest.mark.slow), "int8"])   # ~4 s each
def test_cached_decoding_of_an_adapted_model_equals_its_forward(base):
    from helpers import cached_and_full
    from jaxformer.decode import generate_lm
    model = perturbed(frozen_base(build_model(lm_cfg(rank=4, targets=ALL, base=base))), scale=0.1)
    x = tokens(3, (2, 9)) % 39 + 1
    cached, full, _ = cached_and_full(model, x, prefill=4)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-4, atol=1e-4)
    greedy = generate_lm(model, x[:, :4], max_new=5)                       # the laid-out token loop
    want = generate_lm(merged(nnx.clone(model)), x[:, :4], max_new=5)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(want))
