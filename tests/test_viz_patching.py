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
    assert "--site 'nope' is not one of the model's sites" in capsys.readouterr().out
