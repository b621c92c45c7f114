"""Mixture-of-Experts in the model: one expert equals the dense FFN, dropped tokens ride the residual, patterned
stacks (MoE every n-th layer) equal their layers applied one by one, the train step's auxiliary losses and
router metrics, cached decoding and beam search with MoE layers, and config errors naming the field.
(The pure functions: tests/test_moe.py. Expert parallelism on 8 devices: tests/test_parallel.py.)"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import compiled, tiny_lm
from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.decode import beam_search, generate_seq2seq
from jaxformer.nn import build_model, count_params
from jaxformer.nn.layers import Context, DecoderBlock
from jaxformer.nn.models import decoder_self_mask, default_positions
from jaxformer.quantize import quantize_model
from jaxformer.inference import load_model
from jaxformer.train.loop import train

V = 19
EPS32 = float(np.finfo(np.float32).eps)


def cfg(**kw):
    base = dict(arch="decoder_only", vocab_size=V, d_model=32, num_heads=4, d_ff=48, num_decoder_layers=2,
                num_encoder_layers=1, norm__position="pre", positional="rope", runtime__dropout=0.0, max_len=32)
    return replaced(ModelConfig(), **{**base, **kw})


def close(got, want, ulps=64):
    """float32 agreement relative to the reference's scale (same terms summed in another order)."""
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= ulps * EPS32 * max(1.0, float(jnp.max(jnp.abs(want)))), err


def tokens(rng, b=3, t=10):
    x = rng.integers(1, V, (b, t)).astype(np.int32)
    x[0, 7:] = 0                                                  # some padding
    return jnp.asarray(x)


def segs(x):
    """The padding of `tokens`, said explicitly (the model never infers it from a token id)."""
    return (x != 0).astype(jnp.int32)


@pytest.mark.slow            # the FFN-level equality is in the default suite (tests/test_moe.py)
@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_one_expert_top1_equals_the_dense_model_in_training_and_inference(activation):
    dense = build_model(cfg(activation=activation), seed=0)
    moe = build_model(cfg(activation=activation, ffn="moe", moe__num_experts=1, runtime__moe_capacity_factor=1.0),
                      seed=1)
    d_state, m_state = nnx.state(dense, nnx.Param), nnx.state(moe, nnx.Param)
    flat = dict(nnx.to_flat_state(d_state))
    for path, v in nnx.to_flat_state(m_state):
        if path[-1] == "router":
            continue
        src = flat[path][...]
        v[...] = src[:, None] if "ffn" in path else src                  # [L, ...] -> [L, E=1, ...]
    nnx.update(moe, m_state)
    x = tokens(np.random.default_rng(0))
    real = (x != 0)[..., None]                          # padding takes no expert: its rows differ, unused
    close(jnp.where(real, compiled(moe, x, segment_ids=segs(x))[0], 0),
          jnp.where(real, compiled(dense, x, segment_ids=segs(x))[0], 0))                  # inference: dropless
    train_mode = lambda m: jnp.where(real, compiled(m, x, key=jax.random.key(0), segment_ids=segs(x))[0], 0)
    close(train_mode(moe), train_mode(dense))                             # training: capacity mode, C = M


def test_tokens_dropped_for_capacity_pass_through_the_residual_unchanged():
    c = cfg(ffn="moe", moe__num_experts=2, runtime__moe_capacity_factor=0.25)
    block = DecoderBlock(c, cross=False, moe=True, rngs=nnx.Rngs(params=0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 32)), jnp.float32)
    y, aux = nnx.jit(lambda b, x: b.res_ffn(x, lambda h: b.ffn(h, None, train=True), None))(block, x)
    stats = aux["moe"]
    same = np.asarray(jnp.all(y == x, axis=-1)).reshape(-1)               # rows the FFN left untouched
    assert 0 < same.sum() < same.size
    assert same.sum() == round(float(stats.dropped) * same.size)          # exactly the dropped tokens


def test_moe_every_second_layer_equals_its_layers_applied_one_by_one():
    c = cfg(ffn="moe", moe__num_experts=4, moe__top_k=2, moe__every=2, num_decoder_layers=4)
    model = build_model(c, seed=3)
    kinds = model.decoder.layers.blocks
    assert kinds[0].ffn.w1[...].shape == (2, 32, 48) and kinds[1].ffn.w1[...].shape == (2, 4, 32, 48)
    x = tokens(np.random.default_rng(2))

    @nnx.jit
    def both(model, x):
        logits, aux = model(x, segment_ids=segs(x))
        pos, valid = default_positions(x), x != 0
        h, loads = model.embed(x, pos), []
        for i in range(4):
            out = model.decoder.layers.layer(i)(h, Context(pos, decoder_self_mask(c, pos, pos, valid), valid=valid),
                                                layer=i)
            h, extras = out.x, out.aux
            assert ("moe" in extras) == (i % 2 == 1)
            loads += [extras["moe"].load] if "moe" in extras else []
        return logits, aux, model.embed.logits(model.decoder.final_norm(h)), jnp.stack(loads), valid

    logits, aux, by_layer, loads, valid = both(model, x)
    assert aux["moe"].load.shape == (2, 4) and aux["moe"].balance.shape == (2,)
    np.testing.assert_allclose(aux["moe"].load.sum(-1), 1.0, rtol=1e-6)
    real = valid[..., None]
    close(jnp.where(real, logits, 0), jnp.where(real, by_layer, 0))
    close(aux["moe"].load, loads)
    n = count_params(model)
    experts = 2 * (2 * 4 * 32 * 48 + 4 * 48 + 4 * 32)                     # w1, w2, b1, b2 of 2 MoE layers
    assert n["active per token"] == n["total"] - experts + experts // 2    # top-2 of 4 experts


@pytest.mark.slow            # the train step's MoE metrics are checked in the default suite by tests/test_parallel.py
def test_moe_training_logs_load_and_drops_and_its_checkpoint_restores(tmp_path):
    c = tiny_lm("model.ffn=moe", "model.moe.num_experts=4", "model.moe.top_k=2",
                "model.runtime.moe_capacity_factor=0.5",
                "model.num_decoder_layers=2", "model.moe.every=2", "train.steps=4", "train.log_every=2",
                "train.eval_every=4", "train.checkpoint_every=4", "train.num_examples=0")
    train(c, tmp_path / "run", progress="none")
    run = load_model(tmp_path / "run", "latest")                      # a patterned stack (dense, MoE) restores
    assert run.model.decoder.layers.blocks[1].ffn.w1[...].shape[1] == 4
    recs = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    tr = [r for r in recs if r["split"] == "train"]
    assert len(tr) == 2
    for r in tr:
        loads = [r[f"moe_load/{e}"] for e in range(4)]
        assert abs(sum(loads) - 1.0) < 1e-5 and all(0 <= v <= 1 for v in loads)
        assert 0 < r["moe_dropped"] < 1                      # capacity 0.5 of an even share must drop
        assert r["moe_balance"] >= 1.0 - 1e-5 and r["moe_z"] > 0


@pytest.mark.slow            # the router's gradient through the model's loss: tests/test_moe.py (default suite)
def test_router_receives_gradient_from_the_balancing_loss_alone():
    """With the token loss's gradient cut off, the router still learns from α·balance (one layer, so no router
    sits above the experts)."""
    from jaxformer.train.step import moe_metrics, objective
    from jaxformer.config import OptimConfig
    c = cfg(ffn="moe", moe__num_experts=4, num_decoder_layers=1)
    model = build_model(c, seed=0)
    x = tokens(np.random.default_rng(3))

    def loss(m):
        logits, aux = m(x, rngs=nnx.Rngs(dropout=jax.random.key(0)))
        s = {"objective": jax.lax.stop_gradient(logits).sum() * 0, "count": jnp.float32(1)}
        return objective(s, moe_metrics(aux), OptimConfig(moe_z_weight=0.0))

    g = nnx.grad(loss)(model)
    router = g.decoder.layers.blocks.ffn.router[...]
    w1 = g.decoder.layers.blocks.ffn.w1[...]
    assert float(jnp.abs(router).max()) > 0
    assert float(jnp.abs(w1).max()) == 0                  # the balancing loss does not reach the experts


def test_the_objective_adds_the_router_losses_averaged_over_layers_weighted_and_shared():
    """`moe_metrics`: each router statistic averaged over the MoE layers; `objective`: token objective / tokens
    + (α·balance + β·z) / shards (the micro-batches or devices whose gradients are summed). Pure functions; the
    train step's use of them: the test below, and tests/test_train_pins.py (slow) against a hand-written
    gradient."""
    from jaxformer.config import OptimConfig
    from jaxformer.ops.moe import MoEStats
    from jaxformer.train.step import moe_metrics, objective
    st = MoEStats(balance=jnp.asarray([1.0, 3.0]), z=jnp.asarray([2.0, 4.0]), dropped=jnp.asarray([0.0, 0.5]),
                  load=jnp.asarray([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]))               # two MoE layers, E = 3
    m = moe_metrics({"moe": st})
    assert [float(m[k]) for k in ("moe_balance", "moe_z", "moe_dropped")] == [2.0, 3.0, 0.25]
    np.testing.assert_allclose(np.asarray(m["moe_load"]), [0.25, 0.5, 0.25])
    assert moe_metrics({}) == {}
    s, opt = {"objective": jnp.float32(6.0), "count": jnp.float32(3.0)}, OptimConfig(moe_balance_weight=0.1,
                                                                                     moe_z_weight=0.01)
    assert float(objective(s, {}, opt)) == pytest.approx(2.0)
    assert float(objective(s, m, opt)) == pytest.approx(2.0 + 0.1 * 2.0 + 0.01 * 3.0)
    assert float(objective(s, m, opt, jnp.float32(12.0), shards=4)) == pytest.approx(0.5 + (0.2 + 0.03) / 4)


def test_accumulated_micro_batches_of_a_moe_model_equal_the_batch_they_repeat():
    """optim.accumulate=2 on a batch whose rows come in identical pairs (row r in micro-batch r mod 2: both
    micro-batches are the same rows): the same SGD step (lr 1: minus the gradient) and logged router losses as
    the batch in one (each micro-batch's router losses counted 1/2, its tokens over the whole batch's). Summing
    the micro-batches' router losses or their logged values, or each over its own tokens, doubles them. Two
    compiled steps (~2 s); against a hand-written gradient: tests/test_train_pins.py (slow)."""
    from jaxformer.data import resolve
    from jaxformer.train.step import init_state, make_train_step
    moe_sgd = ["model.ffn=moe", "model.moe.num_experts=4", "model.moe.top_k=2", "model.runtime.moe_capacity_factor=0",
               "model.runtime.dropout=0.0", "optim.moe_balance_weight=1.0", "optim.moe_z_weight=0.1",
               "optim.name=sgd", "optim.lr=1.0", "optim.schedule=constant", "optim.warmup_steps=0",
               "optim.clip_norm=0", "data.batch_size=8", "data.num_chars=600"]
    c, task = resolve(tiny_lm(*moe_sgd))
    graphs, state = init_state(c)
    batch = {n: jnp.asarray(np.repeat(v[:4], 2, axis=0)) for n, v in task.train.items()}
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(state["model"]))
    out = []
    for k in (1, 2):
        new, m = make_train_step(graphs, replaced(c, optim__accumulate=k))(jax.tree.map(jnp.copy, state), batch,
                                                                           jax.random.key(0))
        moved = jax.tree.map(lambda b, a: b - np.asarray(a), before, nnx.to_pure_dict(new["model"]))
        out.append((moved, float(m["moe_balance"]), float(m["moe_z"])))
    (one, bal1, z1), (acc, bal2, z2) = out
    assert bal1 > 1.0 and z1 > 0
    np.testing.assert_allclose([bal2, z2], [bal1, z1], rtol=1e-5)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(one))
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(one)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


def test_moe_lm_cached_decoding_equals_the_full_forward():
    c = cfg(ffn="moe", moe__num_experts=4, moe__top_k=2, moe__every=2, num_decoder_layers=2)
    model = build_model(c, seed=5)
    x = tokens(np.random.default_rng(4), t=9)
    valid = x != 0
    pos = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
    graphdef, state = nnx.split(model)

    @jax.jit
    def cached(state):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(x.shape[0], x.shape[1])
        seg = segs(x)
        first, out = m(x[:, :4], pos[:, :4], segment_ids=seg[:, :4], cache=cache, mode="prefill")   # pad: invalid

        def step(cache, col):
            lg, out = m(col[0][:, None], col[1][:, None], segment_ids=col[2][:, None], cache=cache, mode="decode")
            return out["cache"], lg[:, 0]
        _, rest = jax.lax.scan(step, out["cache"], (x[:, 4:].T, pos[:, 4:].T, seg[:, 4:].T))
        return jnp.concatenate([first, jnp.swapaxes(rest, 0, 1)], 1)

    want = compiled(model, x, positions=pos, segment_ids=segs(x))[0]
    close(jnp.where(valid[..., None], cached(state), 0), jnp.where(valid[..., None], want, 0))


@pytest.mark.slow          # int8 weights, MoE encoder-decoder, beam search: ~8 s of compiling
def test_moe_seq2seq_quantized_beam_of_one_is_greedy_decoding():
    """Beam search and greedy decoding through MoE layers (int8-quantized: one model covers both features)."""
    c = cfg(arch="encoder_decoder", ffn="moe", moe__num_experts=4, moe__top_k=2, positional="sinusoidal")
    model = quantize_model(build_model(c, seed=6), "int8")
    src = jnp.asarray(np.random.default_rng(5).integers(3, V, (4, 6)), jnp.int32)
    greedy = generate_seq2seq(model, src, max_new=6, bos_id=1, eos_id=2)
    beam = beam_search(model, src, max_new=6, bos_id=1, eos_id=2, beam=1)
    np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))
    assert len({tuple(r) for r in np.asarray(greedy).tolist()}) > 1          # the rows get different answers


@pytest.mark.parametrize("kw,field", [
    (dict(ffn="moe", num_decoder_layers=3, moe__every=2), "model.moe.every=2"),
    (dict(ffn="moe", moe__num_experts=1, moe__top_k=2), "model.moe.top_k=2"),
    (dict(moe__top_k=3), "model.moe.top_k=3"),
    (dict(runtime__moe_capacity_factor=-1.0), "model.runtime.moe_capacity_factor=-1.0"),
    (dict(ffn="sparse"), "model.ffn='sparse'"),
])
def test_bad_moe_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        cfg(**kw)
