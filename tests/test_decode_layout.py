"""The decoding layout (`model.decoding_layout`, a value, + the `LayerwiseKVCache` made for it) computes what the
stacked, scanned step computes, and leaves the model as it was; the compiled token loop slices no stacked weight;
projections contract in the weight's own order.

Wrong implementations these tests catch: a per-layer block given another layer's weights or cache (layer order
lost in `lay_out` / `_layer`), or told another layer's index for its activation patches; a per-layer cache
written at the wrong axis (the stacked one's), not written at all, or not stored heads-major [B,K,S,H]; `take` /
`without_slots` on the wrong axis of a per-layer cache; a decode program that forgets to lay its model out (the
loop then slices every layer's weights per token); `contract` ordering contracting dimensions as jnp.einsum does
(H before N: XLA then copies wo at every call) or dropping the output permutation; the fused q/k/v matrix of the
layout (`fused_qkv`) split at the wrong offsets (GQA: K < N heads), in the wrong order (k and v swapped), without
its biases or QK-norm, or never used by the step (three matmuls again), or built from quantized weights, which
bring their own matmul; the one-row layout's FFN output weight (`FeedForward.output_out_in`) not transposed,
never used by the step, laid out for a batch of more rows too (where it is slower), or built from quantized
weights; a layout that changes the model it was made from (attributes added to its modules, as `for_decoding`
once did).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import decode
from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.nn.cache import KVCache, LayerwiseKVCache, heads_major
from jaxformer.nn.params import contract

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


def _cfg(**kw):
    base = dict(arch="decoder_only", vocab_size=V, d_model=32, num_heads=4, d_ff=48, norm__position="pre",
                runtime__dropout=0.0, max_len=32)
    return replaced(ModelConfig(), **{**base, **kw})


def per_layer(t) -> list:
    """A stacked cache tensor (leaves [L,...]) -> its L layers."""
    return [jax.tree.map(lambda a: a[j], t) for j in range(jax.tree.leaves(t)[0].shape[0])]


def _run(graphdef, state, tokens, laid_out: bool, steps: int = 3):
    """Prefill tokens [B,P] then `steps` greedy cached steps -> (logits [steps+1,B,V], the final cache)."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    layout = model.decoding_layout(b) if laid_out else None
    cache = model.init_cache(b, p + steps, layout=layout)
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    logits, cache = model.step(tokens, pos, cache, prefill=True, layout=layout)
    out, last = [logits[:, -1]], logits[:, -1]
    for i in range(steps):
        tok = jnp.argmax(last, -1)[:, None].astype(jnp.int32)
        logits, cache = model.step(tok, jnp.full((b, 1), p + i, jnp.int32), cache, layout=layout)
        out.append(logits[:, 0])
        last = logits[:, 0]
    return jnp.stack(out), cache


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("mha-rope-batch1", "gqa-moe-window")
                                  else c for c in CASES])        # slow: ~6 s each (MoE and windows decode elsewhere)
def test_laid_out_decoding_equals_the_stacked_step(case):
    cfg = _cfg(**CASES[case])
    graphdef, state = nnx.split(build_model(cfg, seed=3))
    tokens = jax.random.randint(jax.random.key(1), (1 if case.endswith("batch1") else 2, 5), 1, V)
    run = jax.jit(_run, static_argnums=(0, 3))
    ref, ref_cache = run(graphdef, state, tokens, False)
    got, got_cache = run(graphdef, state, tokens, True)
    assert isinstance(got_cache, LayerwiseKVCache) and len(got_cache.k) == cfg.num_decoder_layers
    assert type(ref_cache) is KVCache
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=64 * EPS32 * scale)
    # the per-layer cache holds, layer by layer, what the stacked one holds (int8 values included)
    for name in ("k", "v"):
        stacked = getattr(ref_cache, name)
        for i, layer in enumerate(getattr(got_cache, name)):
            assert jax.tree.leaves(layer)[0].shape[1] == cfg.kv_heads              # stored heads-major [B,K,S,H]
            want = jax.tree.leaves(jax.tree.map(lambda x: x[i], stacked))
            for a, b in zip(jax.tree.leaves(heads_major(layer)), want):
                if a.dtype == jnp.int8:
                    assert np.mean(np.asarray(a) != np.asarray(b)) < 0.01    # a rounding flip at most, rarely
                else:
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                               atol=64 * EPS32 * float(jnp.max(jnp.abs(b))) + 1e-30)
    np.testing.assert_array_equal(np.asarray(got_cache.positions), np.asarray(ref_cache.positions))
    np.testing.assert_array_equal(np.asarray(got_cache.segments), np.asarray(ref_cache.segments))


def test_a_laid_out_step_tells_each_layers_patch_its_own_index():
    """Activation patches (`nn.sites`) in the laid-out step, the token loop's: each block told its own layer
    index, as the scanned stack tells it. A steering vector scaled by the layer's index + 1, in a laid-out
    prefill: the patched forward pass's logits (every layer told 0, or its neighbour's index, gives others)."""
    graphdef, state = nnx.split(build_model(_cfg(num_decoder_layers=2), seed=3))
    steer = jax.random.normal(jax.random.key(5), (32,))
    patch = {"resid_post": lambda v, i: v + (i + 1).astype(v.dtype) * steer}
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 1, V)

    @jax.jit
    def both(state):                                       # one program: eager dispatch costs more than compiling
        model = nnx.merge(graphdef, state)
        layout = model.decoding_layout(2)
        pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
        got, _ = model.step(tokens, pos, model.init_cache(2, 5, layout=layout), prefill=True, layout=layout,
                            patch=patch)
        return got, model.forward(tokens, patch=patch)[0], model(tokens)
    got, want, plain = both(state)
    assert not np.allclose(np.asarray(want), np.asarray(plain), atol=1e-2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", pytest.param("chunked", marks=pytest.mark.slow)])  # ~4 s; the
# chunked backend's windowed cached decoding stays in the default lane: tests/test_attention_inputs.py
def test_each_decoding_path_gives_each_layer_its_own_window(backend):
    """A per-layer setting follows from the layer index every block is given (`nn.per_layer`): with windows
    (2, 0) (layer 0 sliding, layer 1 global), a prompt prefilled then decoded a token at a time, through the
    scanned stack and through the token loop's layout, gives the forward pass's logits at every position (a
    layer told another's index would see another window), with each backend CPU decoding can run (cudnn is
    GPU-only; pallas refuses cached decoding: tests/test_attention_backends.py)."""
    cfg = _cfg(num_decoder_layers=2, attention__windows=(2, 0), runtime__attention_backend=backend,
               runtime__attention_block=2)
    graphdef, state = nnx.split(build_model(cfg, seed=4))
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 1, V)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

    @jax.jit
    def paths(state):                                      # one program: eager dispatch costs more than compiling
        model = nnx.merge(graphdef, state)
        out = [model(tokens)]
        for layout in (None, model.decoding_layout(2)):
            cache = model.init_cache(2, 6, layout=layout)
            first, cache = model.step(tokens[:, :3], pos[:, :3], cache, prefill=True, layout=layout)
            rest = []
            for t in range(3, 6):
                logits, cache = model.step(tokens[:, t:t + 1], pos[:, t:t + 1], cache, layout=layout)
                rest.append(logits)
            out.append(jnp.concatenate([first, *rest], axis=1))
        return out
    want, scanned, laid_out = paths(state)
    for got in (scanned, laid_out):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for same in ((2,), (0,)):                  # the same weights with one window everywhere: other logits
        other = build_model(replaced(cfg, attention__windows=same), seed=4)(tokens)
        assert not np.allclose(np.asarray(other), np.asarray(want), atol=1e-3), same


def test_per_layer_cache_take_and_cut_match_the_stacked_ones():
    keys = jax.random.split(jax.random.key(0), 2)
    k, v = (jax.random.normal(kk, (3, 4, 6, 2, 5)) for kk in keys)                  # [L,B,S,K,H]
    c = KVCache(k, v, jnp.arange(24).reshape(4, 6), jnp.ones((4, 6), jnp.int32), jnp.asarray(2))
    rows = jnp.asarray([3, 0, 0, 2])
    for got, want in ((c.unstacked().take(rows), c.take(rows)), (c.unstacked().without_slots(), c.without_slots())):
        for a, b in zip(got.k + got.v, [heads_major(x) for x in per_layer(want.k) + per_layer(want.v)]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(got.positions), np.asarray(want.positions))
    assert c.unstacked().unstacked() is not None and isinstance(c.unstacked(), LayerwiseKVCache)
    assert isinstance(c.unstacked().k, tuple) and len(c.unstacked().k) == 3


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _eqns(inner if hasattr(inner, "eqns") else sub.jaxpr)


def _slices_of_stacked(jaxpr, stacked: set) -> list:
    """The equations that slice (or scan over) an array shaped like a stacked weight [L,...]."""
    return [e.primitive.name for e in _eqns(jaxpr) if e.primitive.name in ("slice", "dynamic_slice", "gather", "scan")
            and any(tuple(getattr(v.aval, "shape", ())) in stacked for v in e.invars)]


def test_the_token_loop_slices_no_stacked_weight():
    cfg = _cfg(num_decoder_layers=3)
    model = build_model(cfg)
    graphdef, state = nnx.split(model)
    stacked = {tuple(a.shape) for a in jax.tree.leaves(nnx.state(model.decoder.layers.blocks))}
    prompts = jnp.ones((1, 4), jnp.int32)
    traced = decode._generate_lm.trace(graphdef, state, prompts, None, jax.random.key(0), max_new=3, eos_id=None,
                                       sampling=(0.0, 0, 1.0), cache_len=7, kv_cache="auto")
    loops = [e for e in _eqns(traced.jaxpr.jaxpr) if e.primitive.name == "while"]
    assert loops, "the decode program has no token loop"
    for loop in loops:
        body = loop.params["body_jaxpr"].jaxpr
        assert not _slices_of_stacked(body, stacked), "the token loop slices stacked weights"
    # the check can fail: the stacked step inside a loop scans over them
    def scanned(s, cache, tok):
        m = nnx.merge(graphdef, s)
        return jax.lax.fori_loop(0, 2, lambda i, c: m.step(tok, tok, c)[1], cache)
    jaxpr = jax.make_jaxpr(scanned)(state, model.init_cache(1, 4), jnp.ones((1, 1), jnp.int32))
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
    dots = [e for e in _eqns(jax.make_jaxpr(lambda a, b: contract("BTNH,NHD->BTD", a, b))(x, w).jaxpr)
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


def test_a_decoding_layout_refuses_to_train_and_leaves_its_model_as_it_was():
    model = build_model(_cfg(num_decoder_layers=2, runtime__dropout=0.1))
    before = jax.tree.map(np.asarray, nnx.state(model))
    graph_before = nnx.graphdef(model)
    layout = model.decoding_layout(1)
    from jaxformer.nn.layers import Context
    x, pos = jnp.ones((1, 3, 32)), jnp.broadcast_to(jnp.arange(3), (1, 3))
    with pytest.raises(ValueError, match="cannot train"):
        model.decoder(x, Context(pos, None), layout=layout, rngs=nnx.Rngs(dropout=0))
    after = nnx.state(model)
    assert nnx.graphdef(model) == graph_before                           # no attribute added to any module
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert not hasattr(model.decoder.layers, "unstacked")


def test_the_laid_out_step_projects_q_k_v_in_one_matmul():
    """A trace, no compilation (~0.3 s); a quantized model's layout: the test below."""
    cfg = _cfg(num_kv_heads=2, num_decoder_layers=2)
    n, k, h, d = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_model
    model = build_model(cfg)
    assert all(w.wqkv.shape == (d, (n + 2 * k) * h) for w in model.decoding_layout().weights)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, 4).unstacked()
    tok = jnp.ones((1, 1), jnp.int32)

    def step(s, c):
        m = nnx.merge(graphdef, s)
        return m.step(tok, tok, c, layout=m.decoding_layout())
    jaxpr = jax.make_jaxpr(step)(state, cache).jaxpr
    widths = [e.outvars[0].aval.shape[-1] for e in _eqns(jaxpr) if e.primitive.name == "dot_general"
              and e.invars[1].aval.shape[0] == d and e.invars[0].aval.shape[-1] == d]
    assert widths.count((n + 2 * k) * h) == cfg.num_decoder_layers      # one q/k/v matmul per layer
    assert widths.count(n * h) == 0 and widths.count(k * h) == 0          # and no separate q, k or v one


@pytest.mark.slow          # ~4 s: an int8 model's eager step
def test_a_quantized_models_layout_keeps_q_k_v_apart():
    """Quantized weights bring their own matmul: they stay apart (and the step still runs)."""
    cfg = _cfg(num_kv_heads=2, num_decoder_layers=2)
    tok = jnp.ones((1, 1), jnp.int32)
    from jaxformer.quantize import quantize_model
    q = quantize_model(build_model(cfg), "int8")
    layout = q.decoding_layout()
    assert all(w.wqkv is None for w in layout.weights)
    logits, _ = q.step(tok, tok, q.init_cache(1, 4, layout=layout), layout=layout)
    assert bool(jnp.all(jnp.isfinite(logits)))


def _ffn_out_dots(model, layout_batch, batch: int) -> list[tuple]:
    """(rhs shape, rhs contracting dims) of the cached step's dots whose weight is an FFN output weight, the
    model laid out for `layout_batch` rows, stepping `batch` rows."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    tok = jnp.ones((batch, 1), jnp.int32)

    def step(s, c):
        m = nnx.merge(graphdef, s)
        return m.step(tok, tok, c, layout=m.decoding_layout(layout_batch))
    jaxpr = jax.make_jaxpr(step)(state, model.init_cache(batch, 4).unstacked()).jaxpr
    return [(e.invars[1].aval.shape, tuple(e.params["dimension_numbers"][0][1])) for e in _eqns(jaxpr)
            if e.primitive.name == "dot_general"
            and sorted(e.invars[1].aval.shape) == sorted((cfg.d_model, cfg.d_ff))
            and e.invars[0].aval.shape[-1] == cfg.d_ff]


def test_a_one_row_layout_reads_the_ffn_output_weight_row_by_row():
    cfg = _cfg(num_decoder_layers=2)
    d, f = cfg.d_model, cfg.d_ff
    model = build_model(cfg)
    one = model.decoding_layout(1)
    assert all(w.w2_out_in.shape == (d, f) for w in one.weights)
    np.testing.assert_array_equal(np.asarray(one.weights[1].w2_out_in),
                                  np.asarray(model.decoder.layers.blocks.ffn.w2[...][1]).T)
    assert _ffn_out_dots(model, 1, 1) == [((d, f), (1,))] * 2         # [D,F] contracted on F, one per layer
    for batch in (None, 2):                                         # more rows, or not known: w2 as it is
        assert all(w.w2_out_in is None for w in model.decoding_layout(batch).weights)
        assert _ffn_out_dots(model, batch, 2) == [((f, d), (0,))] * 2
    from jaxformer.quantize import quantize_model                  # quantized weights bring their own matmul
    q = quantize_model(build_model(cfg), "int8").decoding_layout(1)
    assert all(w.w2_out_in is None for w in q.weights)
    wide = build_model(_cfg(num_decoder_layers=1, d_ff=24)).decoding_layout(1)    # F <= D: w2 is no tall weight
    assert wide.weights[0].w2_out_in is None


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_lays_its_model_out_for_its_own_batch(batch):
    """generate_lm passes its rows to decoding_layout: one row reads the FFN's w2 as [D,F], two rows as [F,D]."""
    cfg = _cfg(num_decoder_layers=1)
    graphdef, state = nnx.split(build_model(cfg))
    traced = decode._generate_lm.trace(graphdef, state, jnp.ones((batch, 4), jnp.int32), None, jax.random.key(0),
                                       max_new=2, eos_id=None, sampling=(0.0, 0, 1.0), cache_len=6, kv_cache="auto")
    d, f = cfg.d_model, cfg.d_ff
    down = {tuple(e.invars[1].aval.shape) for e in _eqns(traced.jaxpr.jaxpr)      # the dots that read h [..,F]
            if e.primitive.name == "dot_general" and e.invars[0].aval.shape[-1] == f}
    assert down == ({(d, f)} if batch == 1 else {(f, d)})
