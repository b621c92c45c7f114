"""Attention weights and `jaxformer viz`: the weights a model returns are a distribution over its visible keys,
requesting them changes no logit, each layer's slice is that layer's own attention, and the command draws one
PNG per prompt, layer and attention kind, or names what is wrong with its run directory or prompt."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import attention_pattern, tiny_lm, tiny_reverse

from jaxformer import ops
from jaxformer.cli import main as cli_main
from jaxformer.nn import build_model
from jaxformer.nn.layers import Context
from jaxformer.nn.models import decoder_self_mask, default_positions
from jaxformer.viz import PATTERNS, _probs

TOL = 128 * float(jnp.finfo(jnp.float32).eps)     # float32 rounding of a few matmuls and a softmax, weights in [0, 1]
SRC = np.array([[4, 5, 6, 7, 2, 0, 0], [8, 9, 2, 0, 0, 0, 0]], np.int32)          # digits + EOS, right-padded
TGT = np.array([[1, 7, 6, 5, 4, 0], [1, 9, 8, 0, 0, 0]], np.int32)                # BOS + answer, right-padded
TOKENS = np.array([[3, 4, 5, 6, 0, 0], [3, 4, 5, 6, 7, 8]], np.int32)
SRC_SEG, TGT_SEG, SEG = ((a != 0).astype(np.int32) for a in (SRC, TGT, TOKENS))   # their padding, said explicitly
S2S_KW = {"src_segment_ids": SRC_SEG, "tgt_segment_ids": TGT_SEG}


@pytest.fixture(scope="module")
def models():
    """A 2+2-layer pre-LN encoder-decoder with grouped-query attention and a 2-layer post-LN RoPE LM."""
    s2s = build_model(tiny_reverse("model.num_encoder_layers=2", "model.num_decoder_layers=2", "model.num_heads=4",
                                   "model.num_kv_heads=2").model)
    lm = build_model(tiny_lm("model.vocab_size=12", "model.num_decoder_layers=2", "model.positional=rope").model)
    return s2s, lm


def weights(model, *args, **kw):
    """{map name: [L,B,N,T,S]}: the `pattern` sites `jaxformer viz` draws (`viz.PATTERNS`), captured eagerly."""
    names = PATTERNS[model.cfg.arch]
    captured = model(*args, capture=tuple(names.values()), **kw)[1]["captured"]
    return {key: captured[site] for key, site in names.items()}


def visible(mask, shape):
    return np.broadcast_to(np.asarray(mask), shape)


def test_weights_are_distributions_over_the_visible_keys(models):
    s2s, lm = models
    w = {k: np.asarray(v) for k, v in weights(s2s, SRC, TGT, **S2S_KW).items()}
    b, s, t = *SRC.shape, TGT.shape[1]
    assert {k: v.shape for k, v in w.items()} == {"encoder_self": (2, b, 4, s, s), "decoder_self": (2, b, 4, t, t),
                                                  "decoder_cross": (2, b, 4, t, s)}
    keys = lambda a: (a != 0)[None, :, None, None, :]                   # noqa: E731   [1,B,1,1,S]
    queries = lambda a: (a != 0)[None, :, None, :, None]                # noqa: E731   [1,B,1,T,1]
    tpos = np.arange(t)
    causal = (tpos[None, :] <= tpos[:, None])[None, None, None] & keys(TGT) & queries(TGT)
    lw = np.asarray(weights(lm, TOKENS, segment_ids=SEG)["self"])
    n = TOKENS.shape[1]
    lm_causal = (np.arange(n)[None, :] <= np.arange(n)[:, None])[None, None, None] & keys(TOKENS) & queries(TOKENS)
    for x, ok, q in [(w["encoder_self"], keys(SRC) & queries(SRC), SRC), (w["decoder_cross"], keys(SRC) &
                     queries(TGT), TGT), (w["decoder_self"], causal, TGT), (lw, lm_causal, TOKENS)]:
        assert x.dtype == np.float32 and (x >= 0).all()
        real = np.broadcast_to(queries(q)[..., 0], x.shape[:-1])
        np.testing.assert_allclose(x.sum(-1)[real], 1.0, atol=TOL)      # every real query sees at least one key
        assert (x[~visible(ok, x.shape)] == 0).all()    # masked / padded / future keys, padding queries: exactly 0
    assert (np.triu(lw[..., :, :], 1) == 0).all()                     # causal: nothing above the diagonal


def test_requesting_weights_changes_no_logit_and_works_under_jit(models):
    s2s, lm = models
    for model, args in [(s2s, (SRC, TGT)), (lm, (TOKENS,))]:
        plain = np.asarray(model(*args)[0])
        sites = ("encoder.pattern", "pattern", "cross_pattern") if model is s2s else ("pattern",)
        logits, _ = model(*args, capture=sites)
        eager = weights(model, *args)
        np.testing.assert_allclose(np.asarray(logits), plain, rtol=TOL, atol=TOL * np.abs(plain).max())
        graph, state = nnx.split(model)
        jitted = _probs(graph, state, args, {})                          # what `jaxformer viz` draws
        assert set(jitted) == set(eager) == set(PATTERNS[model.cfg.arch])
        for k, v in eager.items():
            np.testing.assert_allclose(np.asarray(jitted[k]), np.asarray(v), atol=TOL)


def _pre(residual, x):
    return residual.sublayer_input(x)


def test_each_layers_weights_are_that_layers_own_attention(models):
    s2s, lm = models
    cfg, got = s2s.cfg, weights(s2s, SRC, TGT, **S2S_KW)
    src_mask, pos = ops.segment_mask(jnp.asarray(SRC_SEG), jnp.asarray(SRC_SEG)), default_positions(SRC)
    x = s2s.embed(jnp.asarray(SRC), pos)
    for i in range(cfg.num_encoder_layers):
        blk = s2s.encoder.layers.layer(i)
        w = attention_pattern(blk.self_attn, _pre(blk.res_attn, x), mask=src_mask, positions=pos)
        np.testing.assert_allclose(np.asarray(got["encoder_self"][i]), np.asarray(w), atol=TOL)
        x = blk(x, Context(pos, src_mask), layer=i)[0]
    memory = s2s.encoder.final_norm(x) if s2s.encoder.final_norm is not None else x
    tpos = default_positions(TGT)
    ts = jnp.asarray(TGT_SEG)
    mask = decoder_self_mask(cfg, tpos, tpos, ts != 0, ts, ts)
    cross_mask = ops.segment_mask(ts, jnp.asarray(SRC_SEG))
    h = s2s.embed(jnp.asarray(TGT), tpos)
    for i in range(cfg.num_decoder_layers):
        blk = s2s.decoder.layers.layer(i)
        ws = attention_pattern(blk.self_attn, _pre(blk.res_self, h), mask=mask, positions=tpos)
        h1, _ = blk.res_self(h, lambda y: blk.self_attn(y, mask=mask, positions=tpos), None)
        wc = attention_pattern(blk.cross_attn, _pre(blk.res_cross, h1), memory, mask=cross_mask)
        np.testing.assert_allclose(np.asarray(got["decoder_self"][i]), np.asarray(ws), atol=TOL)
        np.testing.assert_allclose(np.asarray(got["decoder_cross"][i]), np.asarray(wc), atol=TOL)
        h = blk(h, Context(tpos, mask, memory=memory, memory_mask=cross_mask), layer=i)[0]

    got = weights(lm, TOKENS, segment_ids=SEG)["self"]
    pos, seg = default_positions(TOKENS), jnp.asarray(SEG)
    mask = decoder_self_mask(lm.cfg, pos, pos, seg != 0, seg, seg)
    h = lm.embed(jnp.asarray(TOKENS), pos)
    for i in range(lm.cfg.num_decoder_layers):
        blk = lm.decoder.layers.layer(i)
        ws = attention_pattern(blk.self_attn, _pre(blk.res_self, h), mask=mask, positions=pos)
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(ws), atol=TOL)
        h = blk(h, Context(pos, mask), layer=i)[0]


@pytest.fixture(scope="module")
def runs(trained_runs):
    """The two 2-step runs (conftest's trained_runs: an encoder-decoder and a char LM)."""
    return trained_runs


def _pngs(paths):
    return all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def _figures(folder):
    """The figures in a viz folder: all but its manifest (`jaxformer.staging.MANIFEST`, what jaxformer wrote)."""
    from jaxformer.staging import MANIFEST
    return [p for p in folder.iterdir() if p.name != MANIFEST]


@pytest.mark.slow          # two trainings for the fixture (~13 s); the weights themselves are checked by default
def test_viz_writes_one_png_per_prompt_layer_and_kind(runs, tmp_path, capsys):
    s2s, lm = runs
    assert cli_main(["viz", "--workdir", str(s2s), "--prompt", "123", "--prompt", "98765"]) == 0
    want = {f"prompt{i}-{k}-layer0.png" for i in (0, 1) for k in ("encoder_self", "decoder_self", "decoder_cross")}
    assert {p.name for p in _figures(s2s / "viz")} == want and _pngs(_figures(s2s / "viz"))
    out = capsys.readouterr().out
    assert "6 figure(s) written (attention)" in out and str(s2s / "viz" / "prompt1-decoder_cross-layer0.png") in out

    assert cli_main(["viz", "--workdir", str(lm), "--which", "latest", "--out", str(tmp_path / "o")]) == 0
    written = sorted(p.name for p in _figures(tmp_path / "o"))         # default prompts: three held-out inputs
    assert written == [f"prompt{i}-self-layer0.png" for i in range(3)] and _pngs(_figures(tmp_path / "o"))
    assert not (lm / "viz").exists()


@pytest.mark.slow          # the trained runs fixture
def test_viz_draws_the_logit_lens_and_the_head_ablation_table(runs, tmp_path, capsys):
    """--plot lens: one figure per prompt; --plot heads: one table over the prompts; with attention: both kinds.
    The next tokens they score: a prompt's own next tokens (LM), the greedy answer then EOS (encoder-decoder)."""
    from jaxformer.inference import load_model
    from jaxformer.viz import next_tokens
    s2s, lm = runs
    assert cli_main(["viz", "--workdir", str(s2s), "--prompt", "123", "--prompt", "98765", "--plot", "lens",
                     "--plot", "heads", "--plot", "attention", "--out", str(tmp_path / "a")]) == 0
    names = {p.name for p in _figures(tmp_path / "a")}
    assert {"prompt0-lens.png", "prompt1-lens.png", "heads.png", "heads-cross.png", "heads-encoder.png",
            "prompt1-decoder_cross-layer0.png"} <= names
    assert len(names) == 11 and _pngs(_figures(tmp_path / "a"))
    assert "11 figure(s) written (lens, heads, attention)" in capsys.readouterr().out
    assert cli_main(["viz", "--workdir", str(lm), "--plot", "lens", "--out", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in _figures(tmp_path / "b")) == [f"prompt{i}-lens.png" for i in range(3)]
    run = load_model(lm, "best")
    nt = next_tokens(run, ["abc", "hello"])
    ids = run.tokenizer.encode("hello")
    assert list(nt.targets[1, :4]) == list(ids[1:]) and list(nt.weights[1]) == [1, 1, 1, 1, 0]
    assert list(nt.weights[0]) == [1, 1, 0, 0, 0]
    run = load_model(s2s, "best")
    nt = next_tokens(run, ["123"])
    q = nt.queries[0]                                                   # BOS + the greedy answer
    assert list(nt.targets[0, :len(q)]) == list(q[1:]) + [run.tokenizer.eos_id]


@pytest.mark.slow          # the trained runs fixture
def test_bad_run_directories_and_prompts_are_named_errors(runs, tmp_path, capsys):
    s2s, lm = runs
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text("{not json")
    cases = [(["--workdir", str(tmp_path / "missing")], "config error", "is not a run directory"),
             (["--workdir", str(tmp_path)], "config error", "no config.json"),
             (["--workdir", str(tmp_path / "corrupt")], "config error", "is unreadable"),
             (["--workdir", str(s2s), "--prompt", "123", "--prompt", "12a"], "data error", "strings of digits"),
             (["--workdir", str(s2s), "--prompt", "1" * 40], "data error", "exceeds model.max_len=32"),
             (["--workdir", str(lm), "--prompt", "Alice€"], "data error", "outside the tokenizer's vocabulary")]
    for args, label, message in cases:
        assert cli_main(["viz", *args, "--out", str(tmp_path / "never")]) == 2, args
        out = capsys.readouterr().out.replace("\n", " ")
        assert f"{label}:" in out and message in out and "Traceback" not in out, (args, out)
    assert not (tmp_path / "never").exists()          # every prompt is checked before anything is written
