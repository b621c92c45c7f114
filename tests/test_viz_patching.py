"""`jaxformer viz --plot patching` (`jaxformer.viz_patching`): the patching grid and its attribution estimate of a
trained run for a clean and a corrupted prompt, drawn and saved as JSON; named errors for what a user can get
wrong. The grid's math is tests/test_patching.py's; here the command's inputs: the metric is the clean answer's
log-probability (so the clean run scores 1 where its own value is written back, before layer 0 at the corrupted
position), the encoder's positions are the source tokens.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxformer.cli import main as cli_main
from jaxformer.errors import ConfigError
from jaxformer.viz_patching import plot_patching, write_patching


@pytest.fixture(scope="module")
def runs(trained_runs):
    """The two 2-step runs (conftest's trained_runs: an encoder-decoder and a char LM)."""
    return trained_runs


def test_the_figure_draws_both_maps_and_heads_summed():
    maps = {"grid": np.ones((2, 3, 4)).tolist(), "attribution": np.zeros((2, 3, 4)).tolist(), "over": "both",
            "site": "z", "tokens": ["a", "b", "c"], "clean": "abc", "corrupt": "abd"}
    fig = plot_patching(maps)
    images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    assert len(images) == 2 and np.asarray(images[0]).shape == (2, 3) and float(np.asarray(images[0]).max()) == 4


@pytest.mark.parametrize("prompts, corrupt", [(None, "x"), (["a", "b"], "x"), (["a"], None)])
def test_it_takes_one_prompt_and_one_corruption(prompts, corrupt, tmp_path):
    with pytest.raises(ConfigError, match="exactly one --prompt .* and one --corrupt"):
        write_patching(tmp_path, prompts, corrupt)


@pytest.mark.slow          # two trainings for the fixture
def test_viz_writes_the_grid_and_the_estimate_of_both_architectures(runs, tmp_path, capsys):
    s2s, lm = runs
    assert cli_main(["viz", "--workdir", str(s2s), "--plot", "patching", "--prompt", "12345", "--corrupt", "12945",
                     "--out", str(tmp_path / "a")]) == 0
    maps = json.loads((tmp_path / "a" / "patching-encoder-resid_pre.json").read_text())
    grid = np.asarray(maps["grid"])
    assert maps["site"] == "encoder.resid_pre" and grid.shape == (1, 6) and maps["tokens"][:5] == list("12345")
    assert grid[0, 2] == pytest.approx(1.0, abs=1e-5)                 # layer 0's input at the corrupted digit
    np.testing.assert_allclose(np.delete(grid[0], 2), 0.0, atol=1e-5)
    assert (tmp_path / "a" / "patching-encoder-resid_pre.png").read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["viz", "--workdir", str(lm), "--plot", "patching", "--prompt", "hello", "--corrupt", "jello",
                     "--site", "z", "--over", "head", "--out", str(tmp_path / "b")]) == 0
    maps = json.loads((tmp_path / "b" / "patching-z.json").read_text())
    assert np.asarray(maps["grid"]).shape == np.asarray(maps["attribution"]).shape and maps["over"] == "head"
    capsys.readouterr()
    assert cli_main(["viz", "--workdir", str(lm), "--plot", "patching", "--prompt", "hello", "--corrupt", "hi"]) == 2
    assert "patching pairs positions, so both need the same length" in capsys.readouterr().out
    assert cli_main(["viz", "--workdir", str(lm), "--plot", "patching", "--prompt", "hello", "--corrupt",
                     "hello"]) == 2
    assert "does not change the clean answer's log-probability" in capsys.readouterr().out


@pytest.mark.slow          # the trained runs fixture
def test_sae_command_trains_saves_and_reports_on_a_run(runs, tmp_path, capsys):
    """`jaxformer sae`: an SAE on the char LM's resid_post over its own training data, saved in SAELens' folder
    (read back), with its report, histogram and top contexts; and on the encoder-decoder's encoder."""
    from jaxformer.sae import load_saelens
    s2s, lm = runs
    assert cli_main(["sae", "--workdir", str(lm), "--layer", "0", "--steps", "30", "--k", "4",
                     "--out", str(tmp_path / "a")]) == 0
    assert "variance explained" in capsys.readouterr().out
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    params, spec = load_saelens(tmp_path / "a" / "sae")
    assert spec.site == "resid_post" and spec.d_sae == 8 * spec.d_in and report["l0"] <= 4 and report["fve"] > 0
    top = json.loads((tmp_path / "a" / "top_contexts.json").read_text())
    assert top and all(t["top"] and t["top"][0]["activation"] > 0 for t in top)
    assert (tmp_path / "a" / "frequencies.png").read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["sae", "--workdir", str(s2s), "--site", "encoder.resid_post", "--layer", "0", "--steps", "5",
                     "--k", "4", "--out", str(tmp_path / "b")]) == 0
    assert cli_main(["sae", "--workdir", str(lm), "--site", "nope", "--layer", "0"]) == 2
    assert "sae.site='nope' is not one of the model's sites" in capsys.readouterr().out


def test_a_task_batch_becomes_the_sites_inputs_with_its_padding_left_out():
    """Default-lane twin of the `jaxformer sae` command's input path (`sae_run.run_inputs`): an LM batch's
    segment ids and positions reach the call and padding (segment 0) is not a row; an encoder-decoder's
    valid positions are the source's for an encoder site and the decoder input's otherwise; targets are the
    batch's, weighted off where they are padding."""
    from types import SimpleNamespace
    from jaxformer.sae_run import run_inputs
    seg = np.array([[1, 1, 2, 0], [1, 1, 1, 1]], np.int32)
    lm = {"inputs": np.arange(8).reshape(2, 4), "targets": np.array([[5, 6, 0, 0], [1, 2, 3, 4]]),
          "segment_ids": seg, "positions": np.array([[0, 1, 0, 0], [0, 1, 2, 3]])}
    cfg = SimpleNamespace(model=SimpleNamespace(arch="decoder_only", pad_id=0))
    inputs, targets, weights = run_inputs(cfg, lm, "resid_post")
    assert inputs.args[0] is lm["inputs"] and set(inputs.kw) == {"segment_ids", "positions"}
    assert inputs.valid.tolist() == (seg != 0).tolist() and weights.tolist() == (lm["targets"] != 0).tolist()
    plain, _, _ = run_inputs(cfg, {k: lm[k] for k in ("inputs", "targets")}, "resid_post")   # no segment ids
    assert plain.kw == {} and plain.valid.dtype == bool and plain.valid.tolist() == [[True] * 4] * 2
    s2s = {"src": np.array([[4, 5, 2, 0]]), "tgt_in": np.array([[1, 7, 0, 0]]), "tgt_out": np.array([[7, 2, 0, 0]]),
           "src_segment_ids": np.array([[1, 1, 0, 0]]), "tgt_segment_ids": np.array([[1, 1, 1, 0]]),
           "src_positions": np.array([[0, 1, 0, 0]]), "tgt_positions": np.array([[0, 1, 2, 0]])}
    cfg = SimpleNamespace(model=SimpleNamespace(arch="encoder_decoder", pad_id=0))
    enc, _, _ = run_inputs(cfg, s2s, "encoder.resid_post")
    dec, targets, weights = run_inputs(cfg, s2s, "resid_post")     # the segment ids say, not a token = pad id
    assert enc.valid.tolist() == [[True, True, False, False]] and dec.valid.tolist() == [[True, True, True, False]]
    assert enc.args == (s2s["src"], s2s["tgt_in"]) and set(enc.kw) == {k for k in s2s if k[4:] in ("segment_ids", "positions")}
    assert all(enc.kw[k] is s2s[k] for k in enc.kw)
    assert targets is s2s["tgt_out"] and weights.tolist() == [[True, True, False, False]]
    bare = {k: s2s[k] for k in ("src", "tgt_in", "tgt_out")}          # no segment ids: the stack's own pad tokens
    enc, _, _ = run_inputs(cfg, bare, "encoder.resid_post")
    dec, _, _ = run_inputs(cfg, bare, "resid_post")
    assert enc.valid.tolist() == [[True, True, True, False]] and dec.valid.tolist() == [[True, True, False, False]]
    assert enc.kw == dec.kw == {}


def test_the_frequency_figure_is_the_histogram_of_the_live_latents(tmp_path):
    """`frequencies.png` of `jaxformer sae`: 30 bars of the live latents' log10 frequencies (np.histogram's), the
    dead ones counted in the title, axes named; 5 x 3 inches, the house's 8-point text, saved as the command does."""
    from matplotlib.colors import to_rgba
    from jaxformer.sae_run import _frequencies
    freq = np.concatenate([np.random.default_rng(0).uniform(1e-3, 1.0, 50), np.zeros(7), [1.0]])
    fig = _frequencies(freq, dpi=40)
    ax, = fig.axes
    counts, edges = np.histogram(np.log10(freq[freq > 0]), bins=30)
    bars = ax.patches
    assert [b.get_height() for b in bars] == counts.tolist()
    np.testing.assert_allclose([b.get_x() for b in bars], edges[:-1], rtol=1e-12)
    assert {b.get_facecolor() for b in bars} == {to_rgba("tab:blue")}
    assert ax.get_title() == "51 live latents, 7 never fired"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("log10 firing frequency on the held-out batch", "latents")
    assert {t.get_fontsize() for t in (ax.title, ax.xaxis.label, ax.yaxis.label)} == {8.0}
    assert tuple(fig.get_size_inches()) == (5.0, 3.0) and fig.dpi == 40 and fig.get_layout_engine() is not None
    fig.savefig(tmp_path / "f.png")
    from PIL import Image
    assert Image.open(tmp_path / "f.png").size == (200, 120)


def test_top_contexts_rank_latents_by_firing_and_read_the_sites_own_tokens(monkeypatch):
    """`sae_run.top_contexts`' ranking, on given latents (the model's part stubbed): the listed latents are those
    that fire at the most valid positions, most first; each one's frequency is its firing count over the valid
    positions (at least 1); its hits are its largest activations, each with the tokens of the site's own stack (an
    LM's tokens, an encoder-decoder's target, its source for an encoder site) ending there."""
    from types import SimpleNamespace
    from jaxformer import sae_run as module
    from jaxformer.sae import SAESpec, SiteInputs
    rng = np.random.default_rng(3)
    b, t, d_sae = 2, 5, 6
    f = np.maximum(rng.standard_normal((b * t, d_sae)), 0.1) * (rng.random((b * t, d_sae)) < np.linspace(.1, .9, d_sae))
    tok = SimpleNamespace(decode=lambda ids: ",".join(map(str, ids)))
    src, tgt = np.arange(100, 100 + b * t).reshape(b, t), np.arange(200, 200 + b * t).reshape(b, t)
    monkeypatch.setattr(module, "encode", lambda params, x, spec: f)
    for site, args, stack, w in [("resid_post", (src,), src, np.ones(b * t) * (np.arange(b * t) % t < 4)),
                                 ("resid_post", (src, tgt), tgt, np.ones(b * t)),
                                 ("encoder.resid_post", (src, tgt), src, np.eye(b * t)[3])]:
        monkeypatch.setattr(module, "site_rows", lambda model, inputs, spec, w=w: (None, w))
        spec = SAESpec(d_in=4, d_sae=d_sae, site=site, layer=0, k=2)
        top = module.top_contexts(SimpleNamespace(model=None, tokenizer=tok), None, spec, SiteInputs(args, {}, None),
                                  latents=3, per=2, width=2)
        fw = f * w[:, None]
        counts = (fw > 0).sum(0)
        listed = [counts[e["latent"]] for e in top]
        assert listed == sorted(counts, reverse=True)[:3], site
        for e in top:
            assert e["frequency"] == pytest.approx(counts[e["latent"]] / max(w.sum(), 1.0)), site
            rows = [r for r in np.argsort(-fw[:, e["latent"]])[:2] if fw[r, e["latent"]] > 0]
            assert [(h["row"], h["position"]) for h in e["top"]] == [divmod(int(r), t) for r in rows], site
            for h, r in zip(e["top"], rows):
                assert h["activation"] == pytest.approx(float(fw[r, e["latent"]]))
                row, pos = divmod(int(r), t)
                assert h["context"] == ",".join(map(str, stack[row, max(0, pos - 1):pos + 1])), site


def test_top_contexts_are_the_strongest_real_positions_with_the_tokens_before_them():
    """`sae_run.top_contexts` on a tiny model: each listed latent's positions are its largest activations among
    the valid positions (a padded position never appears), each context the decoded tokens ending there."""
    from types import SimpleNamespace
    import jax
    import jax.numpy as jnp
    from helpers import tiny_lm
    from jaxformer.data.tokenizers import CharTokenizer
    from jaxformer.nn import build_model
    from jaxformer.sae import SAESpec, SiteInputs, encode, init_sae, site_rows
    from jaxformer.sae_run import top_contexts
    tok = CharTokenizer("abcdefghij")
    model = build_model(tiny_lm("model.vocab_size=11").model)
    run = SimpleNamespace(model=model, tokenizer=tok)
    spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
    params = init_sae(spec, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 11, (3, 6)))
    valid = jnp.ones((3, 6)).at[:, 4:].set(0)
    inputs = SiteInputs((tokens,), {}, valid)
    top = top_contexts(run, params, spec, inputs, latents=3, per=2, width=3)
    f = np.asarray(encode(params, site_rows(model, inputs, spec)[0], spec)).reshape(3, 6, -1)
    for entry in top:
        for hit in entry["top"]:
            r, p = hit["row"], hit["position"]
            assert p < 4 and hit["activation"] == pytest.approx(float(f[r, p, entry["latent"]]))
            assert hit["context"] == tok.decode([int(i) for i in tokens[r, max(0, p - 2):p + 1]])
        best = f[:, :4, entry["latent"]].max()
        assert entry["top"][0]["activation"] == pytest.approx(float(best))


def test_the_commands_metric_restores_the_clean_answer_at_the_corrupted_token(monkeypatch):
    """Default-lane twin of the command (`viz_patching.patching_maps`) on an untrained char LM standing in for a
    run: the metric is the clean answer's log-probability, so writing the clean embedding back at the corrupted
    position before layer 0 restores it exactly (1) and no other position does anything; the tokens are the
    prompt's; prompts of different lengths are a named error."""
    from helpers import tiny_lm
    from jaxformer import viz_patching
    from jaxformer.data.tokenizers import CharTokenizer
    from jaxformer.errors import DataError
    from jaxformer.inference import LoadedModel
    from jaxformer.nn import build_model
    cfg = tiny_lm("model.vocab_size=11", "model.positional=rope")
    run = LoadedModel(cfg, CharTokenizer("abcdefghij"), build_model(cfg.model, seed=1), 0, "best")
    monkeypatch.setattr(viz_patching, "load_model", lambda *a, **k: run)
    maps = viz_patching.patching_maps("RUN", "abcdef", "abcjef")
    grid = np.asarray(maps["grid"])
    assert maps["site"] == "resid_pre" and maps["tokens"] == list("abcdef") and grid.shape == (1, 6)
    assert grid[0, 3] == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(np.delete(grid[0], 3), 0.0, atol=1e-5)
    assert np.asarray(maps["attribution"]).shape == (1, 6)
    with pytest.raises(DataError, match="patching pairs positions"):
        viz_patching.patching_maps("RUN", "abcdef", "abc")
