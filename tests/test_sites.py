"""Activation sites (`jaxformer.nn.sites`): capture and patch named activations of a language model's forward pass
under jit, grad and the scanned layer stack.

Wrong implementations these catch: a per-layer site recorded from the wrong layer or not stacked in layer order,
or a sublayer's output site (attn_out, mlp_out) taken after its residual add (compared with blocks applied one
at a time by hand); a patch applied at the wrong layer (the head ablation would remove another layer's head); a
patch whose result is not what flows on (the write-back and ablation tests), or a captured site recorded before
its patch; attention scores read before their scale, or patched after the softmax has read them, or the
mask applied before a patch (a patch could then unmask a key); generate_lm patching its prefill alone; probabilities of a fused backend not recomputed; unknown site
names accepted silently.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.nn import build_model
from jaxformer.nn.inputs import AttentionInputs, decoder_self_mask
from jaxformer.nn.layers import Context
MODEL_SITES = ("embed", "final_norm", "logits")
LAYER_SITES = ("resid_pre", "attn_in", "q", "k", "v", "attn_scores", "pattern", "z", "attn_out", "resid_mid", "mlp_in",
               "mlp_hidden", "mlp_out", "resid_post")

L = 3


def lm(layers=L, **kw):
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2,
                   d_ff=48, num_decoder_layers=layers, max_len=16, positional="rope", activation="swiglu",
                   norm__position="pre", runtime__dropout=0.0, **kw)
    return build_model(cfg)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 10)))


def test_every_site_is_listed_and_captured_in_its_shape():
    m = lm()
    assert m.sites() == ("embed", *LAYER_SITES, "final_norm", "logits")          # in the order the pass reaches them
    _, aux = m(TOKENS, capture=m.sites())
    got = {k: v.shape for k, v in aux["captured"].items()}
    b, t, d, n, k, h, f = 2, 10, 32, 4, 2, 8, 48
    assert got == {"embed": (b, t, d), "final_norm": (b, t, d), "logits": (b, t, 40),
                   "resid_pre": (L, b, t, d), "attn_in": (L, b, t, d), "q": (L, b, t, n, h), "k": (L, b, t, k, h),
                   "v": (L, b, t, k, h), "attn_scores": (L, b, n, t, t), "pattern": (L, b, n, t, t), "z": (L, b, t, n, h), "attn_out": (L, b, t, d),
                   "resid_mid": (L, b, t, d), "mlp_in": (L, b, t, d), "mlp_hidden": (L, b, t, f),
                   "mlp_out": (L, b, t, d), "resid_post": (L, b, t, d)}
    moe = lm(ffn="moe", moe__num_experts=2)
    assert "mlp_hidden" not in moe.sites() and "mlp_out" in moe.sites()


def test_the_captured_residual_stream_is_the_blocks_applied_by_hand():
    m = lm()
    logits, aux = m(TOKENS, capture=("embed", "resid_pre", "attn_in", "attn_out", "resid_mid", "mlp_in",
                                     "mlp_out", "resid_post", "final_norm"))
    cap = aux["captured"]
    side = AttentionInputs(m.cfg, TOKENS, None, None)
    pos = side.positions
    ctx = Context(pos, decoder_self_mask(m.cfg, pos, pos, side.valid, side.segments, side.segments), pos, side.valid)
    x = m.embed(TOKENS, pos, None)
    np.testing.assert_allclose(cap["embed"], x, rtol=1e-6, atol=1e-6)
    for i in range(L):
        block = m.decoder.layers.layer(i)
        np.testing.assert_allclose(cap["resid_pre"][i], x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cap["attn_in"][i], block.res_self.norm(x), rtol=1e-5, atol=1e-5)
        attn = block.self_attn(block.res_self.norm(x), mask=ctx.mask, positions=pos)[0]     # before the residual
        np.testing.assert_allclose(cap["attn_out"][i], attn, rtol=1e-5, atol=1e-5)
        mid = x + attn
        np.testing.assert_allclose(cap["resid_mid"][i], mid, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cap["mlp_in"][i], block.res_ffn.norm(mid), rtol=1e-5, atol=1e-5)
        x = block(x, ctx, layer=i).x
        np.testing.assert_allclose(cap["resid_post"][i], x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cap["mlp_out"][i], x - mid, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cap["final_norm"], m.decoder.final_norm(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, m.embed.logits(cap["final_norm"]), rtol=1e-5, atol=1e-5)


def test_a_site_is_whatever_a_module_passes_through_sites_found_by_an_abstract_trace():
    """`discover` lists the names a pass reaches, in order, computing nothing (a new site is one line where its
    value is computed: no registry); a name the model does not reach is a ConfigError listing those it does."""
    from jaxformer.nn.sites import Sites, discover
    ran = []

    def toy(hooks):
        sites = Sites(hooks, 0)
        x = sites("first", jnp.ones(3))
        jax.debug.callback(lambda: ran.append(1))
        return Sites(hooks).view("sub_")("second", x * 2)           # model-level: no layer
    assert discover(toy) == {"first": True, "sub_second": False} and not ran
    assert list(discover(toy)) == ["first", "sub_second"]
    model = lm()
    assert model.site_layers("resid_post") == model.cfg.num_decoder_layers and model.site_layers("embed") == 0
    with pytest.raises(ConfigError, match=r"'attn_score' does not exist.*'attn_scores'"):
        lm()(TOKENS, capture=("attn_score",))


def test_writing_back_the_captured_values_changes_nothing():
    m = lm()
    logits, aux = m(TOKENS, capture=m.sites())
    cap = aux["captured"]
    back = {n: (lambda n: lambda v, layer: cap[n] if layer is None else cap[n][layer])(n)
            for n in m.sites() if n != "pattern"}
    again, _ = m(TOKENS, patch=back)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logits))


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_attn_scores_are_the_scaled_q_dot_k_that_softmax_to_the_pattern(backend):
    """The attn_scores site is q·kᵀ/√H (float64 NumPy from the captured q and k, GQA's kv head n // (N/K)), and the
    pattern is its softmax over the causal keys; a fused backend asked for it reads them in the reference backend
    (its logits are never materialised)."""
    m = lm(runtime__attention_backend=backend, runtime__attention_block=4)
    cap = {k: np.asarray(v, np.float64) for k, v in m(TOKENS, capture=("q", "k", "attn_scores", "pattern"))[1][
        "captured"].items()}
    k = np.repeat(cap["k"], cap["q"].shape[3] // cap["k"].shape[3], axis=3)
    want = np.einsum("lbtnh,lbsnh->lbnts", cap["q"], k) / np.sqrt(cap["q"].shape[-1])
    np.testing.assert_allclose(cap["attn_scores"], want, rtol=1e-5, atol=1e-5)
    t = TOKENS.shape[1]
    logits = np.where(np.tril(np.ones((t, t), bool)), cap["attn_scores"], -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(cap["pattern"], p / p.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_a_score_mod_outside_the_reference_backend_is_a_named_error():
    """The op's score_mod (what the attn_scores site rides on) exists in the materialising backend only: elsewhere
    a BackendError naming it, not a silently unread function (the model asks the reference backend itself)."""
    from jaxformer import ops
    from jaxformer.errors import BackendError
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(BackendError, match="score_mod"):
        ops.dot_product_attention(q, q, q, backend="chunked", score_mod=lambda s: s)


def test_patched_scores_are_what_the_softmax_reads_and_the_mask_still_applies():
    """Scores patched to zero make every query's pattern uniform over the keys it may see (the mask applies after
    the patch: no future key gains weight)."""
    m = lm()
    _, aux = m(TOKENS, capture=("pattern",), patch={"attn_scores": lambda s, i: jnp.zeros_like(s)})
    t = TOKENS.shape[1]
    want = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]
    np.testing.assert_allclose(np.asarray(aux["captured"]["pattern"]), np.broadcast_to(want, (L, 2, 4, t, t)),
                               atol=1e-6)


def test_zero_ablating_a_head_is_dropping_its_slice_of_the_output_projection():
    m = lm()
    layer, head = 2, 1
    ablated, aux = m(TOKENS, capture=("z",),
                     patch={"z": lambda z, i: jnp.where(i == layer, z.at[:, :, head].set(0.0), z)})
    z = np.asarray(aux["captured"]["z"])                                   # recorded after its patch
    assert not z[layer, :, :, head].any() and np.abs(z[layer - 1, :, :, head]).max() > 1e-3
    cut = nnx.clone(m)
    wo = cut.decoder.layers.blocks.self_attn.wo
    wo.set_value(wo[...].at[layer, head].set(0.0))                       # wo [L,N,H,D]
    np.testing.assert_allclose(np.asarray(ablated), np.asarray(cut(TOKENS)[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(ablated), np.asarray(m(TOKENS)[0]), atol=1e-3)


@pytest.mark.parametrize("backend,remat", [("reference", "none"), ("chunked", "full")])
def test_capture_and_patch_under_jit_grad_and_the_backends(backend, remat):
    m = lm(runtime__attention_backend=backend, runtime__remat=remat, runtime__attention_block=4)
    graph, state = nnx.split(m)

    def loss(scale, state):
        model = nnx.merge(graph, state)
        logits, aux = model(TOKENS, capture=("pattern", "mlp_out"),
                            patch={"mlp_out": lambda v, i: v * jnp.where(i == 1, scale, 1.0)})
        return logits.sum(), aux["captured"]

    (value, cap), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(1.0, state)
    eps = 1e-2
    numeric = (loss(1.0 + eps, state)[0] - loss(1.0 - eps, state)[0]) / (2 * eps)
    np.testing.assert_allclose(float(g), float(numeric), rtol=2e-2)
    np.testing.assert_allclose(np.asarray(cap["pattern"]).sum(-1), 1.0, rtol=1e-5)
    want = m(TOKENS, capture=("pattern",))[1]["captured"]["pattern"]    # eager, outside jit and grad
    np.testing.assert_allclose(np.asarray(cap["pattern"]), np.asarray(want), rtol=1e-5, atol=1e-6)


def _pattern_patch(layer, head, fill):
    """Layer `layer`, query head `head`: its attention probabilities replaced by fill(probabilities of that head)."""
    return lambda p, i: jnp.where(i == layer, p.at[:, head].set(fill(p[:, head])), p)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_a_patched_pattern_is_what_the_heads_read(backend):
    """Query head 2 of layer 1 made to attend to key 0 alone: its output z is key 0's value of kv head 1 (head n
    reads kv head n // (N/K); n % K would read kv head 0) at every query; the layer's other heads read as before;
    zeroing that head's pattern is zeroing its z (a fused backend's probabilities, recomputed, patched too)."""
    m = lm(runtime__attention_backend=backend, runtime__attention_block=4)
    layer, head = 1, 2
    hot = _pattern_patch(layer, head, lambda p: jnp.zeros_like(p).at[..., 0].set(1.0))
    _, clean = m(TOKENS, capture=("z",))
    _, aux = m(TOKENS, capture=("v", "z"), patch={"pattern": hot})
    z, v = np.asarray(aux["captured"]["z"]), np.asarray(aux["captured"]["v"])
    np.testing.assert_allclose(z[layer, :, :, head], np.broadcast_to(v[layer, :, :1, head // 2], z[layer, :, :, head].shape),
                               rtol=1e-5, atol=1e-6)
    others = [h for h in range(4) if h != head]
    np.testing.assert_allclose(z[layer][:, :, others], np.asarray(clean["captured"]["z"])[layer][:, :, others],
                               rtol=1e-5, atol=1e-5)
    zero_p = m(TOKENS, patch={"pattern": _pattern_patch(layer, head, jnp.zeros_like)})[0]
    zero_z = m(TOKENS, patch={"z": lambda x, i: jnp.where(i == layer, x.at[:, :, head].set(0.0), x)})[0]
    np.testing.assert_allclose(np.asarray(zero_p), np.asarray(zero_z), rtol=1e-5, atol=1e-5)


def test_a_patched_pattern_in_cached_decoding_is_the_patched_forward_pass():
    """A head's pattern zeroed at layer 1: the prefill and the cached steps (cache slots and new keys as two
    segments; laid out heads-major) give the patched forward pass's logits."""
    m = lm()
    patch = {"pattern": _pattern_patch(1, 2, jnp.zeros_like)}
    want, _ = m(TOKENS, patch=patch)
    assert not np.allclose(np.asarray(want), np.asarray(m(TOKENS)[0]), atol=1e-3)
    np.testing.assert_allclose(_decoded(m, patch), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_bad_sites_are_named_errors():
    m = lm()
    with pytest.raises(ConfigError, match="'resid' does not exist"):
        m(TOKENS, capture=("resid",))
    with pytest.raises(ConfigError, match="must be a function"):
        m(TOKENS, patch={"z": 0.0})
    with pytest.raises(ConfigError, match="does not exist"):
        lm(ffn="moe", moe__num_experts=2)(TOKENS, capture=("mlp_hidden",))


def s2s():
    cfg = replaced(ModelConfig(), vocab_size=13, d_model=32, num_heads=4, d_ff=48, num_encoder_layers=2,
                   num_decoder_layers=2, max_len=16, runtime__dropout=0.0)
    return build_model(cfg)


def test_an_encoder_decoder_has_encoder_and_cross_attention_sites():
    m = s2s()
    src, tgt = TOKENS[:, :7] % 13, TOKENS[:, 3:] % 13
    logits, aux = m(src, tgt, capture=m.sites())
    got = {k: v.shape for k, v in aux["captured"].items()}
    assert got["encoder.embed"] == got["memory"] == (2, 7, 32) and got["encoder.resid_post"] == (2, 2, 7, 32)
    assert got["cross_pattern"] == (2, 2, 4, 7, 7) and got["cross_k"] == (2, 2, 7, 4, 8)
    assert got["resid_cross"] == got["resid_post"] == (2, 2, 7, 32) and got["logits"] == (2, 7, 13)
    np.testing.assert_allclose(np.asarray(aux["captured"]["cross_pattern"]).sum(-1), 1.0, rtol=1e-5)
    cap = aux["captured"]
    back = {n: (lambda n: lambda v, layer: cap[n] if layer is None else cap[n][layer])(n)
            for n in m.sites() if not n.endswith("pattern")}
    np.testing.assert_array_equal(np.asarray(m(src, tgt, patch=back)[0]), np.asarray(logits))


@pytest.mark.slow          # trains the README's reversal model for 600 steps (~60 s)
def test_activation_patching_localises_the_digit_being_copied(tmp_path):
    """Corrupt one source digit; patch the clean run's encoder output (memory) into the corrupted run one source
    position at a time: the logit difference of the reversed output that copies that digit comes back only when
    the patched position is the corrupted one."""
    from jaxformer.configio import apply_overrides, load_config_file
    from jaxformer.data.tasks import encode_digit_pairs
    from jaxformer.inference import load_model
    from jaxformer.train.loop import train
    from helpers import ROOT
    cfg = apply_overrides(load_config_file(ROOT / "configs/reverse.py"),
                          ["train.steps=600", "train.eval_every=600", "train.checkpoint_every=600"])
    assert train(cfg, tmp_path / "rev", progress="none")["eval"]["exact_match"] > 0.9
    m = load_model(tmp_path / "rev", "latest").model
    clean = (3, 1, 4, 1, 5)
    for p in (1, 3):
        corrupt = tuple((d + 6) % 10 if i == p else d for i, d in enumerate(clean))
        b = encode_digit_pairs([clean, corrupt], True, 7)
        src, tgt = jnp.asarray(b["src"]), jnp.asarray(b["tgt_in"])
        kw = dict(src_segment_ids=jnp.asarray(b["src_segment_ids"]), tgt_segment_ids=jnp.asarray(b["tgt_segment_ids"]))
        logits, aux = m(src, tgt, capture=("memory",), **kw)
        memory = aux["captured"]["memory"]
        j, good, bad = len(clean) - 1 - p, clean[p] + 3, corrupt[p] + 3         # reversed: output j copies p
        diff = lambda lg, row=1: lg[row, j, good] - lg[row, j, bad]             # noqa: E731
        clean_diff, corrupt_diff = diff(logits, 0), diff(logits)
        assert clean_diff > 0 > corrupt_diff
        curve = []
        for q in range(len(clean) + 1):                                         # the digits and EOS
            lg, _ = m(src, tgt, patch={"memory": lambda v, i, q=q: v.at[1, q].set(memory[0, q])}, **kw)
            curve.append(float((diff(lg) - corrupt_diff) / (clean_diff - corrupt_diff)))
        assert int(np.argmax(curve)) == p and curve[p] > 0.8, curve
        assert max(abs(c) for i, c in enumerate(curve) if i != p) < 0.2, curve


def _decoded(m, patch) -> np.ndarray:
    """TOKENS' logits from a 4-token prefill then one-token cached steps, patched."""
    b, t = TOKENS.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), TOKENS.shape)
    step = nnx.jit(lambda m, tokens, pos, cache, mode: m(tokens, pos, cache=cache, mode=mode, patch=patch),
                   static_argnames="mode")      # one program per mode: the eager ops' first calls cost more
    out, aux = step(m, TOKENS[:, :4], pos[:, :4], m.init_cache(b, t), "prefill")
    got = [out]
    for i in range(4, t):
        out, aux = step(m, TOKENS[:, i:i + 1], pos[:, i:i + 1], aux["cache"], "decode")
        got.append(out)
    return np.asarray(jnp.concatenate(got, 1))


def test_a_patch_acts_in_cached_decoding_as_in_the_forward_pass():
    """A steering vector added to layer 1's residual stream: prefill then one-token cached steps give the patched
    forward pass's logits."""
    m = lm()
    steer = jax.random.normal(jax.random.key(5), (32,))
    patch = {"resid_post": lambda v, i: v + jnp.where(i == 1, 1.0, 0.0) * steer,
             "logits": lambda v, i: v * 1.5}
    want, _ = m(TOKENS, patch=patch)
    assert not np.allclose(np.asarray(want), np.asarray(m(TOKENS)[0]), atol=1e-2)
    np.testing.assert_allclose(_decoded(m, patch), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_capture_in_cached_calls_is_the_uncached_calls_sites():
    """Every site captured in a cached call: a 4-token prefill's are the uncached call's over those tokens; a
    one-token decode step's are the uncached call's at its position (its pattern over the cache's slots then itself:
    the prefill's keys as the uncached row reads them, the empty slots 0)."""
    m = lm()
    b, t = TOKENS.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), TOKENS.shape)
    sites = m.sites()

    @nnx.jit                                              # the four calls as one program, not op by op
    def calls(m, tokens, pos):
        full = m(tokens, capture=sites)[1]["captured"]
        want = m(tokens[:, :4], capture=sites)[1]["captured"]
        _, out = m(tokens[:, :4], pos[:, :4], cache=m.init_cache(b, t), mode="prefill", capture=sites)
        _, step = m(tokens[:, 4:5], pos[:, 4:5], cache=out["cache"], mode="decode", capture=sites)
        return full, want, out["captured"], step["captured"]
    full, want, prefilled, got = calls(m, TOKENS, pos)
    assert set(prefilled) == set(sites)
    for name in sites:
        np.testing.assert_allclose(prefilled[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    for name in set(m.sites()) - {"pattern", "attn_scores"}:   # per-token: [B,1,...] or per layer [L,B,1,...]
        ref = full[name][:, 4:5] if name in MODEL_SITES else full[name][:, :, 4:5]
        np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5, err_msg=name)
    p, ref = np.asarray(got["pattern"]), np.asarray(full["pattern"])[:, :, :, 4:5]        # p [L,B,N,1,S+1]
    assert p.shape == (L, b, 4, 1, t + 1) and not p[..., 4:t].any()
    np.testing.assert_allclose(np.concatenate([p[..., :4], p[..., t:]], -1), ref[..., :5], rtol=1e-5, atol=1e-6)
    s, ref = np.asarray(got["attn_scores"]), np.asarray(full["attn_scores"])[:, :, :, 4:5]   # the visible slots'
    np.testing.assert_allclose(np.concatenate([s[..., :4], s[..., t:]], -1), ref[..., :5], rtol=1e-5, atol=1e-5)


def test_a_bad_mode_or_a_cache_that_does_not_fit_it_is_a_value_error():
    m = lm()
    cache = m.init_cache(*TOKENS.shape)
    for kw, mode in ((dict(mode="bogus"), "'bogus'"), (dict(mode="prefill"), "'prefill'"),
                     (dict(mode="decode"), "'decode'"), (dict(cache=cache, mode="train"), "'train'"),
                     (dict(cache=cache), "'train'")):
        with pytest.raises(ValueError, match=f"mode={mode}"):
            m(TOKENS, **kw)
    m, src = s2s(), TOKENS[:, :7] % 13
    with pytest.raises(ValueError, match="mode='bogus'"):
        m(src, src, mode="bogus")
    with pytest.raises(ValueError, match="pass src=None"):                  # the cache holds the memory
        m(src, src[:, :1], cache=m.init_cache(2, 8, memory=m.encode(src)), mode="decode")


def test_generate_lm_patches_every_generated_token():
    """A patch that forces token 7 through `generate_lm(..., patch=)` (one layer, two new tokens): every new token
    is 7, the generated step's as well as the prefill's, where the model alone would follow a 7 with another
    token (an untied head: a tied one repeats its input). The test below decodes a steering vector."""
    from jaxformer.decode import generate_lm
    m = lm(layers=1, tie_embeddings=False)
    prompts = TOKENS[:, :4]
    assert (np.asarray(m(jnp.concatenate([prompts, jnp.full((2, 1), 7)], 1))[0][:, -1].argmax(-1)) != 7).all()
    forced = generate_lm(m, prompts, max_new=2, patch={"logits": lambda v, i: v.at[..., 7].add(100.0)})
    np.testing.assert_array_equal(np.asarray(forced), 7)


@pytest.mark.slow          # ~5 s: generate_lm's compiled loop with a patch; its every step patched: the test above
def test_generate_lm_decodes_the_patched_model():
    """A steering vector through `generate_lm(..., patch=)`: the greedy tokens are those of the patched forward
    pass recomputed for every new token (and differ from the unpatched model's)."""
    from jaxformer.decode import generate_lm
    m = lm()
    steer = 30.0 * jax.random.normal(jax.random.key(5), (32,))         # it decides every token
    patch = {"resid_post": lambda v, i: v + jnp.where(i == 1, 1.0, 0.0) * steer}
    prompts, new = TOKENS[:, :4], 5
    got = generate_lm(m, prompts, max_new=new, patch=patch)
    buf = jnp.zeros((2, 4 + new), jnp.int32).at[:, :4].set(prompts)
    for i in range(new):
        logits = m(buf, patch=patch)[0][:, 3 + i].at[:, m.cfg.pad_id].set(-jnp.inf)
        buf = buf.at[:, 4 + i].set(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(buf[:, 4:]))
    assert not np.array_equal(np.asarray(got), np.asarray(generate_lm(m, prompts, max_new=new)))
    forced = generate_lm(m, prompts, max_new=new, patch={"logits": lambda v, i: v.at[..., 7].add(100.0)})
    np.testing.assert_array_equal(np.asarray(forced), 7)             # every step patched, not the prefill alone
