"""Cached decoding (`model(..., cache=, mode=)`, one path: the decoder laid out for a token loop, kept in the cache
`model.init_cache` makes) computes what the uncached call computes, and leaves the model as it was; the compiled
token loop slices no stacked weight; projections contract in the weight's own order.

Wrong implementations these tests catch: a per-layer block given another layer's weights or cache (layer order
lost in `lay_out` / `_layer`), or told another layer's index for its activation patches or its window; a
per-layer cache written at the wrong axis, not written at all, or not stored heads-major [B,K,S,H]; `take` /
`without_slots` on the wrong axis of a per-layer buffer; a decode program that lays its model out inside its
loop (the loop then slices every layer's weights per token); `contract` ordering contracting dimensions as
jnp.einsum does (H before N: XLA then copies wo at every call) or dropping the output permutation; the fused
q/k/v matrix of the layout (`nn.layout`, `nn.weights.Fused`) split at the wrong offsets (GQA: K < N heads), in the wrong order (k and
v swapped), without its biases or QK-norm, or never used by the step (three matmuls again), or built from
quantized weights, which bring their own matmul; the one-row layout's FFN output weight
(`nn.weights.OutIn`) not transposed, never used by the step, laid out for a batch of more rows too
(where it is slower), or built from quantized weights; a layout that changes the model it was made from
(attributes added to its modules, as `for_decoding` once did).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import decode
from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.nn.cache import KVCache, QuantizedKV, heads_major, quantize_kv
from jaxformer.nn.params import contract
from jaxformer.nn.weights import Fused, OutIn, Quantized, Within
from jaxformer.ops.masks import positions_from_segments
from helpers import all_eqns

V = 19
EPS32 = float(np.finfo(np.float32).eps)
CASES = {                                   # batch 1: the layout for one row (the FFN's w2 as [D,F])
    "mha-rope-batch1": dict(positional="rope", num_decoder_layers=3),
    "gqa-moe-window": dict(positional="rope", num_kv_heads=2, num_decoder_layers=4, ffn="moe", moe__every=2,
                           moe__num_experts=4, attention__windows=(3, 0)),
    "int8-alibi": dict(positional="alibi", num_decoder_layers=2, runtime__kv_cache_dtype="int8"),
    "gqa-bias-qknorm-swiglu-batch1": dict(positional="rope", num_kv_heads=2, num_decoder_layers=2,
                                   biases=("q", "k", "v", "ffn"), attention__qk_norm=True, activation="swiglu"),
}
# two-row cases run with explicit segment ids: row 0 two packed documents, row 1 left-padded (0 = padding)
SEGMENTS = jnp.asarray([[1, 1, 2, 2, 2], [0, 0, 1, 1, 1]], jnp.int32)


def _cfg(**kw):
    base = dict(arch="decoder_only", vocab_size=V, d_model=32, num_heads=4, d_ff=48, norm__position="pre",
                runtime__dropout=0.0, max_len=32)
    return replaced(ModelConfig(), **{**base, **kw})


def _run(graphdef, state, tokens, segment_ids, steps: int = 3):
    """Prefill tokens [B,P] (segment_ids [B,P], or None: every token real) then `steps` greedy cached steps, each
    row continuing its last document; and the uncached call over the sequence decoded, its keys/values captured.
    -> (cached logits [B,P+steps,V], uncached logits [B,P+steps,V], captured {"k", "v"} [L,B,P+steps,K,H], the
    final cache, the sequence's segment ids and positions [B,P+steps])."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    seg = jnp.ones((b, p), jnp.int32) if segment_ids is None else segment_ids
    pos = positions_from_segments(seg)
    last_seg = None if segment_ids is None else seg[:, -1:]
    logits, out = model(tokens, pos, segment_ids=segment_ids, cache=model.init_cache(b, p + steps), mode="prefill")
    got, seq, last = [logits], [tokens], logits[:, -1]
    for i in range(steps):
        tok = jnp.argmax(last, -1)[:, None].astype(jnp.int32)
        logits, out = model(tok, pos[:, -1:] + 1 + i, segment_ids=last_seg, cache=out["cache"], mode="decode")
        got.append(logits)
        seq.append(tok)
        last = logits[:, 0]
    seq = jnp.concatenate(seq, 1)
    full_seg = jnp.concatenate([seg] + [seg[:, -1:]] * steps, 1)
    full_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(steps)], 1)
    want, ref = model(seq, full_pos, segment_ids=None if segment_ids is None else full_seg, capture=("k", "v"))
    return jnp.concatenate(got, 1), want, ref["captured"], out["cache"], full_seg, full_pos


def _assert_cache_holds(cache, captured, valid, cfg):
    """Layer by layer, the cache's heads-major buffers [B,K,S,H] hold the uncached call's keys/values
    (captured [L,B,S,K,H]) at the valid slots [B,S]. An int8 cache: within one int8 step of each vector (its
    rounding, half a step, plus what the rounded keys/values of the layers below moved its input: measured 0.7)."""
    keep = np.asarray(valid)[:, None, :, None]
    for name in ("k", "v"):
        layers = getattr(cache, name)
        assert isinstance(layers, tuple) and len(layers) == cfg.num_decoder_layers
        for i, layer in enumerate(layers):
            assert jax.tree.leaves(layer)[0].shape[1:3] == (cfg.kv_heads, valid.shape[1])   # stored heads-major
            want = np.asarray(heads_major(captured[name][i]))
            if isinstance(layer, QuantizedKV):
                err = np.abs(np.asarray(layer.dequantize(jnp.float32)) - want) / np.asarray(layer.scale)
                assert float(np.where(keep, err, 0.0).max()) <= 1.0, (name, i)
            else:
                err = np.where(keep, np.abs(np.asarray(layer) - want), 0.0).max()
                assert err <= 64 * EPS32 * float(np.abs(want).max()), (name, i, err)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("mha-rope-batch1", "gqa-moe-window")
                                  else c for c in CASES])        # slow: ~6 s each (MoE and windows decode elsewhere)
def test_cached_decoding_equals_the_uncached_call(case):
    """A prefill then greedy one-token steps give, at every real position, the uncached call's logits over the
    sequence decoded (int8 cache: within one int8 step of the largest logit, as tests/test_quantize.py bounds it),
    and leave in the cache, layer by layer, its keys/values, positions and segment ids."""
    cfg = _cfg(**CASES[case])
    graphdef, state = nnx.split(build_model(cfg, seed=3))
    one = case.endswith("batch1")
    tokens = jax.random.randint(jax.random.key(1), (1 if one else 2, 5), 1, V)
    got, want, captured, cache, seg, pos = jax.jit(_run, static_argnums=0)(
        graphdef, state, tokens, None if one else SEGMENTS)
    valid = np.asarray(seg) != 0
    scale = float(jnp.max(jnp.abs(want)))
    tol = scale / 127 if cfg.runtime.kv_cache_dtype == "int8" else 64 * EPS32 * scale
    err = float(np.abs(np.where(valid[..., None], np.asarray(got) - np.asarray(want), 0.0)).max())
    assert err <= tol, (err, tol)
    _assert_cache_holds(cache, captured, valid, cfg)
    if cfg.runtime.kv_cache_dtype == "int8":
        assert all(isinstance(k, QuantizedKV) and k.values.dtype == jnp.int8 for k in cache.k + cache.v)
    np.testing.assert_array_equal(np.asarray(cache.positions), np.asarray(pos))
    np.testing.assert_array_equal(np.asarray(cache.segments), np.asarray(seg))
    assert int(cache.index) == seg.shape[1]


def test_cached_decoding_tells_each_layers_patch_its_own_index():
    """Activation patches (`nn.sites`) in cached decoding, the token loop's: each block told its own layer index,
    as the scanned stack of the uncached call tells it. A steering vector scaled by the layer's index + 1, in a
    prefill and a decoded token: the patched uncached call's logits (every layer told 0, or its neighbour's
    index, gives others)."""
    graphdef, state = nnx.split(build_model(_cfg(num_decoder_layers=2), seed=3))
    steer = jax.random.normal(jax.random.key(5), (32,))
    patch = {"resid_post": lambda v, i: v + (i + 1).astype(v.dtype) * steer}
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 1, V)

    @jax.jit
    def both(state):                                       # one program: eager dispatch costs more than compiling
        model = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
        first, out = model(tokens[:, :4], pos[:, :4], cache=model.init_cache(2, 5), mode="prefill", patch=patch)
        last, _ = model(tokens[:, 4:], pos[:, 4:], cache=out["cache"], mode="decode", patch=patch)
        return jnp.concatenate([first, last], 1), model(tokens, patch=patch)[0], model(tokens)[0]
    got, want, plain = both(state)
    assert not np.allclose(np.asarray(want), np.asarray(plain), atol=1e-2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", pytest.param("chunked", marks=pytest.mark.slow)])  # ~4 s; the
# chunked backend's windowed cached decoding stays in the default lane: tests/test_attention_inputs.py
def test_cached_decoding_gives_each_layer_its_own_window(backend):
    """A per-layer setting follows from the layer index every block is given (`nn.per_layer`): with windows
    (2, 0) (layer 0 sliding, layer 1 global), a prompt prefilled then decoded a token at a time gives the
    uncached call's logits at every position (a layer told another's index would see another window), with each
    backend CPU decoding can run (cudnn is GPU-only; pallas refuses cached decoding:
    tests/test_attention_backends.py)."""
    cfg = _cfg(num_decoder_layers=2, attention__windows=(2, 0), runtime__attention_backend=backend,
               runtime__attention_block=2)
    graphdef, state = nnx.split(build_model(cfg, seed=4))
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

    @jax.jit
    def paths(state):                                      # one program: eager dispatch costs more than compiling
        model = nnx.merge(graphdef, state)
        first, out = model(tokens[:, :3], pos[:, :3], cache=model.init_cache(2, 6), mode="prefill")
        rest = []
        for t in range(3, 6):
            logits, out = model(tokens[:, t:t + 1], pos[:, t:t + 1], cache=out["cache"], mode="decode")
            rest.append(logits)
        return model(tokens)[0], jnp.concatenate([first, *rest], axis=1)
    want, got = paths(state)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for same in ((2,), (0,)):                  # the same weights with one window everywhere: other logits
        other = build_model(replaced(cfg, attention__windows=same), seed=4)(tokens)[0]
        assert not np.allclose(np.asarray(other), np.asarray(want), atol=1e-3), same


def test_cache_take_and_cut_act_on_each_layers_rows_and_slots():
    """`take` reorders / repeats the rows (axis 0 of each layer's [B,K,S,H] buffer, float or int8, and of the
    positions and segment ids); `without_slots` cuts the slots (axis 2; axis 1 of positions) to none."""
    keys = jax.random.split(jax.random.key(0), 2)
    k, v = (jax.random.normal(kk, (3, 4, 2, 6, 5)) for kk in keys)                  # [L,B,K,S,H]
    c = KVCache(tuple(k), tuple(quantize_kv(a) for a in v), jnp.arange(24).reshape(4, 6),
                jnp.arange(24).reshape(4, 6) % 3, jnp.asarray(2))
    rows = np.asarray([3, 0, 0, 2])
    got = c.take(jnp.asarray(rows))
    for a, b in zip(jax.tree.leaves((got.k, got.v, got.positions, got.segments)),
                    jax.tree.leaves((c.k, c.v, c.positions, c.segments)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[rows])
    cut = c.without_slots()
    for a, b in zip(jax.tree.leaves((cut.k, cut.v)), jax.tree.leaves((c.k, c.v)), strict=True):
        assert a.shape == b.shape[:2] + (0,) + b.shape[3:] and a.dtype == b.dtype
    assert cut.positions.shape == cut.segments.shape == (4, 0) and int(cut.index) == 2
    assert isinstance(cut.k, tuple) and len(cut.k) == 3 and isinstance(cut.v[0], QuantizedKV)


def _slices_of_stacked(jaxpr, stacked: set) -> list:
    """The equations that slice (or scan over) an array shaped like a stacked weight [L,...]."""
    return [e.primitive.name for e in all_eqns(jaxpr) if e.primitive.name in ("slice", "dynamic_slice", "gather",
                                                                             "scan")
            and any(tuple(getattr(v.aval, "shape", ())) in stacked for v in e.invars)]


def test_the_token_loop_slices_no_stacked_weight():
    cfg = _cfg(num_decoder_layers=3)
    model = build_model(cfg)
    graphdef, state = nnx.split(model)
    stacked = {tuple(a.shape) for a in jax.tree.leaves(nnx.state(model.decoder.layers.blocks))}
    prompts = jnp.ones((1, 4), jnp.int32)
    traced = decode._generate_lm.trace(graphdef, state, prompts, None, jax.random.key(0), max_new=3, eos_id=None,
                                       sampling=(0.0, 0, 1.0), cache_len=7, kv_cache="auto")
    loops = [e for e in all_eqns(traced.jaxpr.jaxpr) if e.primitive.name == "while"]
    assert loops, "the decode program has no token loop"
    for loop in loops:
        body = loop.params["body_jaxpr"].jaxpr
        assert not _slices_of_stacked(body, stacked), "the token loop slices stacked weights"

    # the check can fail: a loop that lays the model out at every token (not once, before it) slices them
    def relaid(s, tok):
        m = nnx.merge(graphdef, s)
        step = lambda i, c: m(tok, tok, cache=c._replace(stack=m.decoder.layers.lay_out(1)),  # noqa: E731
                              mode="decode")[1]["cache"]
        return jax.lax.fori_loop(0, 2, step, m.init_cache(1, 4))
    jaxpr = jax.make_jaxpr(relaid)(state, jnp.ones((1, 1), jnp.int32))
    assert _slices_of_stacked(jaxpr.jaxpr, stacked)


@pytest.mark.parametrize("eq,xs,ws", [("BTNH,NHD->BTD", (2, 3, 4, 5), (4, 5, 6)),
                                      ("BTD,DNH->BTNH", (2, 3, 6), (6, 4, 5)),
                                      ("BTD,DF->BTF", (2, 3, 6), (6, 7)),
                                      ("BD,DK->KB", (3, 6), (6, 4)),
                                      ("BTNH,HND->DTB", (2, 3, 4, 5), (5, 4, 6)),
                                      ("ETD,EDF->ETF", (3, 4, 6), (3, 6, 5))])            # batch letter: einsum
def test_contract_is_einsum(eq, xs, ws):
    x = np.random.default_rng(0).standard_normal(xs)
    w = np.random.default_rng(1).standard_normal(ws)
    want = np.einsum(eq, x, w)                                        # float64 NumPy reference
    got = contract(eq, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=64 * EPS32 * np.abs(want).max())


def test_contract_contracts_in_the_weights_order():
    x, w = jnp.ones((2, 3, 4, 5)), jnp.ones((4, 5, 6))
    dots = [e for e in all_eqns(jax.make_jaxpr(lambda a, b: contract("BTNH,NHD->BTD", a, b))(x, w).jaxpr)
            if e.primitive.name == "dot_general"]
    (lhs, rhs), _ = dots[0].params["dimension_numbers"]
    assert tuple(rhs) == (0, 1) and tuple(lhs) == (2, 3)


def _cache_copies(model, slots: int) -> int:
    """Copies of a whole per-layer cache buffer (heads-major [B,K,S,H]) in generate_lm's compiled program."""
    graphdef, state = nnx.split(model)
    cfg = model.cfg
    low = decode._generate_lm.lower(graphdef, state, jnp.ones((1, 4), jnp.int32), None, jax.random.key(0),
                                    max_new=slots - 4, eos_id=None, sampling=(0.0, 0, 1.0), cache_len=slots,
                                    kv_cache="auto")
    shape = f"f32[1,{cfg.kv_heads},{slots},{cfg.head_size}]"
    return sum(1 for line in low.compile().as_text().splitlines()
               if f"= {shape}" in line and " copy(" in line)


def test_the_token_loop_updates_each_cache_buffer_in_place(monkeypatch):
    model = build_model(_cfg(num_decoder_layers=2, max_len=300))
    assert _cache_copies(model, 257) == 0
    # the check can fail: without the write's data dependence on the read, XLA:CPU copies every buffer. A model
    # of its own (d_ff=56, in no other test) gives a fresh trace, so no other test can meet the patched one.
    from jaxformer.nn import attention
    monkeypatch.setattr(attention, "_after", lambda new, out: new)
    assert _cache_copies(build_model(_cfg(num_decoder_layers=2, max_len=300, d_ff=56)), 257) > 0


def test_a_decoding_cache_refuses_to_train_and_leaves_its_model_as_it_was():
    """`init_cache` lays the decoder out (a copy of its weights); the model is unchanged, and a cached call with
    a dropout stream (training) raises: gradients would reach the copies, not the model's weights."""
    model = build_model(_cfg(num_decoder_layers=2, runtime__dropout=0.1))
    before = jax.tree.map(np.asarray, nnx.state(model))
    graph_before = nnx.graphdef(model)
    cache = model.init_cache(1, 3)
    tok, pos = jnp.ones((1, 3), jnp.int32), jnp.broadcast_to(jnp.arange(3), (1, 3))
    with pytest.raises(ValueError, match="cannot train"):
        model(tok, pos, cache=cache, mode="prefill", rngs=nnx.Rngs(dropout=0))
    after = nnx.state(model)
    assert nnx.graphdef(model) == graph_before                           # no attribute added to any module
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert not hasattr(model.decoder.layers, "unstacked")


def _dots(model, batch: int, layout="own") -> list:
    """The dot_general equations of a one-token cached step over `batch` rows, traced (no compilation), the cache
    made inside the program (`init_cache`: the model laid out for its rows) or, with layout (rows, or None: not
    known), holding the decoder laid out for that many rows."""
    graphdef, state = nnx.split(model)
    tok = jnp.ones((batch, 1), jnp.int32)

    def step(s):
        m = nnx.merge(graphdef, s)
        cache = m.init_cache(batch, 4)
        if layout != "own":
            cache = cache._replace(stack=m.decoder.layers.lay_out(layout))
        return m(tok, tok, cache=cache, mode="decode")
    return [e for e in all_eqns(jax.make_jaxpr(step)(state).jaxpr) if e.primitive.name == "dot_general"]


def test_the_laid_out_step_projects_q_k_v_in_one_matmul():
    """A trace, no compilation (~0.3 s); a quantized model's layout: the test below."""
    cfg = _cfg(num_kv_heads=2, num_decoder_layers=2)
    n, k, h, d = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_model
    model = build_model(cfg)
    for b in model.decoder.layers.lay_out().blocks:            # wq holds the group's one matrix, wk/wv hold none
        att = b.self_attn
        assert isinstance(att.wq[...], Fused) and att.wq[...].array.shape == (d, (n + 2 * k) * h)
        assert isinstance(att.wk[...], Within) and isinstance(att.wv[...], Within)
        assert att.wk[...].shape == att.wv[...].shape == (d, k, h)                  # each keeps its own shape
        assert att.wq[...].shapes == ((d, n, h), (d, k, h), (d, k, h))
    widths = [e.outvars[0].aval.shape[-1] for e in _dots(model, 1)
              if e.invars[1].aval.shape[0] == d and e.invars[0].aval.shape[-1] == d]
    assert widths.count((n + 2 * k) * h) == cfg.num_decoder_layers      # one q/k/v matmul per layer
    assert widths.count(n * h) == 0 and widths.count(k * h) == 0          # and no separate q, k or v one


@pytest.mark.slow          # ~4 s: an int8 model's eager step
def test_a_quantized_models_layout_keeps_q_k_v_apart():
    """Quantized weights bring their own matmul: they stay apart (and the cached step gives the uncached
    call's logits)."""
    cfg = _cfg(num_kv_heads=2, num_decoder_layers=2)
    tok = jnp.ones((1, 1), jnp.int32)
    from jaxformer.quantize import quantize_model
    q = quantize_model(build_model(cfg), "int8")
    assert all(isinstance(b.self_attn.wq[...], Quantized) for b in q.decoder.layers.lay_out().blocks)
    cache = q.init_cache(1, 4)
    assert all(isinstance(b.self_attn.wk[...], Quantized) for b in cache.stack.blocks)
    logits, _ = q(tok, tok, cache=cache, mode="decode")
    assert bool(jnp.all(jnp.isfinite(logits)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(q(tok, tok)[0]), rtol=1e-5, atol=1e-5)


def _ffn_out_dots(model, batch: int, layout="own") -> list[tuple]:
    """(rhs shape, rhs contracting dims) of the cached step's dots whose weight is an FFN output weight, stepping
    `batch` rows, laid out as `_dots` says."""
    cfg = model.cfg
    return [(e.invars[1].aval.shape, tuple(e.params["dimension_numbers"][0][1])) for e in _dots(model, batch, layout)
            if sorted(e.invars[1].aval.shape) == sorted((cfg.d_model, cfg.d_ff))
            and e.invars[0].aval.shape[-1] == cfg.d_ff]


def test_a_one_row_layout_reads_the_ffn_output_weight_row_by_row():
    cfg = _cfg(num_decoder_layers=2)
    d, f = cfg.d_model, cfg.d_ff
    model = build_model(cfg)
    one = model.decoder.layers.lay_out(1)
    assert all(isinstance(b.ffn.w2[...], OutIn) and b.ffn.w2[...].array.shape == (d, f) for b in one.blocks)
    assert all(b.ffn.w2[...].shape == (f, d) for b in one.blocks)          # the weight's own shape
    np.testing.assert_array_equal(np.asarray(one.blocks[1].ffn.w2[...].dequantize()),   # as a float array: w2
                                  np.asarray(model.decoder.layers.blocks.ffn.w2[...][1]))
    np.testing.assert_array_equal(np.asarray(one.blocks[1].ffn.w2[...].array),
                                  np.asarray(model.decoder.layers.blocks.ffn.w2[...][1]).T)
    assert not any(isinstance(b.ffn.w1[...], OutIn) for b in one.blocks)  # [D,F]: its input is not wider
    assert _ffn_out_dots(model, 1) == [((d, f), (1,))] * 2            # [D,F] contracted on F, one per layer
    for batch in (None, 2):                                         # more rows, or not known: w2 as it is
        assert not any(isinstance(b.ffn.w2[...], OutIn) for b in model.decoder.layers.lay_out(batch).blocks)
        assert _ffn_out_dots(model, 2, batch) == [((f, d), (0,))] * 2
    assert _ffn_out_dots(model, 2) == [((f, d), (0,))] * 2           # init_cache lays out for its own rows
    from jaxformer.quantize import quantize_model                  # quantized weights bring their own matmul
    q = quantize_model(build_model(cfg), "int8").decoder.layers.lay_out(1)
    assert all(isinstance(b.ffn.w2[...], Quantized) for b in q.blocks)
    for f in (24, 32):                               # F < D, F = D: w2's input is not wider than its output
        wide = build_model(_cfg(num_decoder_layers=1, d_ff=f)).decoder.layers.lay_out(1)
        assert isinstance(wide.blocks[0].ffn.w2[...], jax.Array), f


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_lays_its_model_out_for_its_own_batch(batch):
    """generate_lm's cache (`init_cache`) lays the model out for its rows: one row reads the FFN's w2 as [D,F],
    two rows as [F,D]."""
    cfg = _cfg(num_decoder_layers=1)
    graphdef, state = nnx.split(build_model(cfg))
    traced = decode._generate_lm.trace(graphdef, state, jnp.ones((batch, 4), jnp.int32), None, jax.random.key(0),
                                       max_new=2, eos_id=None, sampling=(0.0, 0, 1.0), cache_len=6, kv_cache="auto")
    d, f = cfg.d_model, cfg.d_ff
    down = {tuple(e.invars[1].aval.shape) for e in all_eqns(traced.jaxpr.jaxpr)      # the dots that read h [..,F]
            if e.primitive.name == "dot_general" and e.invars[0].aval.shape[-1] == f}
    assert down == ({(d, f)} if batch == 1 else {(f, d)})


def test_laid_out_weight_kinds_project_in_the_inputs_dtype_and_refuse_a_partial_group():
    """OutIn contracts in the input's dtype (a bfloat16 step stays bfloat16) and equals the plain projection;
    a Fused group projects only whole (as many equations as weights, the others Within): anything else is
    named."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)                              # [F, D]
    x = jnp.asarray(rng.standard_normal((2, 1, 6)), jnp.bfloat16)
    y = OutIn(w.T).project("BTF,FD->BTD", x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(contract("BTF,FD->BTD", x, w.astype(jnp.bfloat16)), np.float32))
    wq, wk = (jnp.asarray(rng.standard_normal((4, 2, 3)), jnp.float32) for _ in range(2))
    fused = Fused(jnp.concatenate([wq.reshape(4, -1), wk.reshape(4, -1)], 1), (wq.shape, wk.shape))
    eqs = ("BTD,DNH->BTNH", "BTD,DKH->BTKH")
    xq = jnp.asarray(rng.standard_normal((2, 1, 4)), jnp.float32)
    q, k = fused.project_each(eqs, xq, (Within(wk.shape),))
    np.testing.assert_allclose(np.asarray(q), np.asarray(contract(eqs[0], xq, wq)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(k), np.asarray(contract(eqs[1], xq, wk)), rtol=1e-6, atol=1e-6)
    for bad_eqs, others in ((eqs[:1], (Within(wk.shape),)), (eqs, (wk,)), (eqs, ())):
        with pytest.raises(ValueError, match="projects with its group"):
            fused.project_each(bad_eqs, xq, others)
    for kind in (fused, Within(wk.shape)):
        with pytest.raises(ValueError, match="group"):
            kind.project(eqs[0], xq)
    from jaxformer.nn.params import together
    wo = jnp.ones((2, 3, 4))                                 # [N,H,D]: two input axes cannot sit side by side
    for bad in ((eqs[0], "BTNH,NHD->BTD"), (eqs[0], "BSD,DKH->BSKH")):     # or another x
        with pytest.raises(ValueError, match="do not read one input axis of the same x"):
            together(bad, xq, fused.array, (wq.shape, wo.shape))


def test_an_encoder_decoder_decodes_from_its_laid_out_memory_as_the_uncached_call():
    """The memory laid out once (`nn.layout.laid_out_memory`: each decoder layer's own cross-attention keys and
    values of the encoder output, heads-major): a prefill, then the rest of the target from the cache, give the
    uncached call's logits, two decoder layers (each must read its own layer's memory keys)."""
    cfg = _cfg(arch="encoder_decoder", num_encoder_layers=1, num_decoder_layers=2, positional="rope")
    model = build_model(cfg, seed=5)
    src = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
    tgt = jax.random.randint(jax.random.key(3), (2, 5), 1, V)
    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(2, tgt.shape[1], memory=m.encode(src))
        pos = jnp.broadcast_to(jnp.arange(tgt.shape[1]), tgt.shape)
        lg, out = m(None, tgt[:, :3], tgt_positions=pos[:, :3], cache=cache, mode="decode")
        lg2, _ = m(None, tgt[:, 3:], tgt_positions=pos[:, 3:], cache=out["cache"], mode="decode")
        return jnp.concatenate([lg, lg2], 1), m(src, tgt)
    got, want = both(state)
    want = want[0] if isinstance(want, tuple) else want
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) <= 64 * EPS32 * scale
