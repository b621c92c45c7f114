"""Issue R5: outputs never lose a user's file, and a stop signal stops `jaxformer sae` promptly. Before:

- `jaxformer sae --out DIR` wrote over a user's report.json and frequencies.png there (after the whole training);
  the default RUN/sae/SITE-L was written over by the next SAE on the same site and layer.
- `sae.save_saelens` wrote over a user's cfg.json.
- `jaxformer viz --out DIR` wrote over a user's PNG of the same name (prompt0-self-layer0.png, patching-*.json).
- SIGTERM to `jaxformer sae` was held until the whole training had run, then everything was written anyway.

Now: `jaxformer.staging` (a folder written whole into OUT.partial, renamed when complete; OUT must be new or empty)
and its `write_kept` (files in a folder shared by several viz calls, replacing only those its manifest lists).
Everything runs in-process on an untrained tiny char LM standing in for a run (a few SAE steps at most).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli, stop_now, tiny_lm, tiny_reverse

from jaxformer.errors import OutputError

PNG = b"\x89PNG"




def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def lm():
    """An untrained 1-layer char LM on the built-in corpus, as `load_model` would return its run."""
    from jaxformer.data.build import resolve
    from jaxformer.inference import LoadedModel
    from jaxformer.nn import build_model
    cfg, task = resolve(tiny_lm())
    return LoadedModel(cfg, task.tokenizer, build_model(cfg.model, seed=1), 0, "best")


@pytest.fixture()
def sae_run(lm, monkeypatch, tmp_path):
    """RUN (an empty run folder) whose model `jaxformer sae` loads is `lm`; -> (RUN, the loads made)."""
    from jaxformer import sae_run as module
    loads = []
    monkeypatch.setattr(module, "load_model", lambda *a, **k: loads.append(a) or lm)
    run = tmp_path / "run"
    run.mkdir()
    return run, loads


SAE = ["--layer", "0", "--steps", "2", "--k", "4", "--d-sae", "32"]


# ----------------------------------------------------------------------------- jaxformer sae --out

def test_sae_refuses_an_out_holding_a_users_files_before_it_trains(sae_run, tmp_path, capsys):
    """Before: the SAE trained, then report.json and frequencies.png were replaced by its own."""
    run, loads = sae_run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.json").write_text('{"mine": 1}')
    (out / "frequencies.png").write_bytes(b"my figure")
    rc, said = run_cli(capsys, "sae", "--workdir", run, *SAE, "--out", out)
    assert rc == 2 and said.startswith("output error:"), said
    assert f"--out {out} is not empty (it holds frequencies.png, report.json)" in said, said
    assert loads == []                                          # refused before the run was even loaded
    assert listing(out) == ["frequencies.png", "report.json"] and (out / "report.json").read_text() == '{"mine": 1}'
    assert (out / "frequencies.png").read_bytes() == b"my figure" and listing(tmp_path) == ["mine", "run"]


@pytest.mark.slow          # ~5 s, two trainings (CI's slow lane runs it); the default lane: a user's --out refused
def test_sae_writes_a_fresh_folder_when_the_default_one_is_taken(sae_run, capsys):
    """Before: RUN/sae/resid_post-0 (here holding a user's report.json) was written over; now the SAE goes to
    resid_post-0-2, written whole (no .partial left), and the command says where."""
    run, _ = sae_run
    taken = run / "sae" / "resid_post-0"
    taken.mkdir(parents=True)
    (taken / "report.json").write_text("mine")
    rc, said = run_cli(capsys, "sae", "--workdir", run, *SAE)
    fresh = run / "sae" / "resid_post-0-2"
    assert rc == 0 and said.endswith(f"-> {fresh}"), said
    assert listing(taken) == ["report.json"] and (taken / "report.json").read_text() == "mine"
    assert listing(run / "sae") == ["resid_post-0", "resid_post-0-2"]
    assert listing(fresh) == ["frequencies.png", "report.json", "sae", "top_contexts.json"]
    assert listing(fresh / "sae") == ["cfg.json", "sae_weights.safetensors"]
    assert (fresh / "frequencies.png").read_bytes()[:4] == PNG and json.loads((fresh / "report.json").read_text())
    from PIL import Image
    assert Image.open(fresh / "frequencies.png").size == (500, 300)      # 5 x 3 inches at 100 dpi


def test_the_sae_command_reports_and_saves_the_sae_it_trained(sae_run, lm, monkeypatch):
    """`train_run_sae` on a stand-in run: it loads RUN's best checkpoint; the saved SAE (read back by
    `load_saelens`) is 8 x the site's width, top-k with the k asked; report.json is `evaluate_sae` of that SAE on
    the first held-out batch of data.batch_size rows, top_contexts.json and the histogram's frequencies are those
    of its latents at the batch's valid positions; the seed (0 by default) is the training's."""
    from dataclasses import asdict
    from pathlib import Path
    from jaxformer import sae_run as module
    from jaxformer.data import build_task
    from jaxformer.sae import encode, evaluate_sae, load_saelens, site_rows, site_width
    run, loads = sae_run
    freqs, draw = [], module._frequencies
    monkeypatch.setattr(module, "_frequencies", lambda freq: freqs.append(freq) or draw(freq))
    seeds, train = [], module.train_sae
    monkeypatch.setattr(module, "train_sae", lambda *a, seed, **k: seeds.append(seed) or train(*a, seed=seed, **k))
    sites, inputs = [], module.run_inputs         # every batch, training and held-out, read at the site asked
    monkeypatch.setattr(module, "run_inputs", lambda cfg, batch, site: sites.append(site) or inputs(cfg, batch, site))
    report = module.train_run_sae(run, "resid_post", 0, steps=60, k=4)    # <= 100 steps: the whole curve
    out = Path(report["out"])
    assert sites == ["resid_post"] * 61 and loads == [(run, "best")] and out == run / "sae" / "resid_post-0"
    params, spec = load_saelens(out / "sae")
    assert json.loads((out / "sae" / "cfg.json").read_text())["metadata"]["model_name"] == str(run)
    d = site_width(lm.model, "resid_post")
    assert (spec.site, spec.layer, spec.architecture, spec.k, spec.d_in, spec.d_sae) == ("resid_post", 0, "topk", 4,
                                                                                        d, 8 * d)
    batch = next(build_task(lm.cfg.data, lm.tokenizer).eval_batches(lm.cfg.data.batch_size))
    held, targets, weights = module.run_inputs(lm.cfg, batch, "resid_post")
    saved = json.loads((out / "report.json").read_text())
    for key, value in evaluate_sae(lm.model, params, spec, held, targets, weights).items():
        assert saved[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert (saved["step"], saved["steps"], saved["spec"], len(saved["curve"])) == (lm.step, 60, asdict(spec), 60)
    top = json.loads((out / "top_contexts.json").read_text())
    assert top == json.loads(json.dumps(module.top_contexts(lm, params, spec, held)))
    assert len(top) == 8 and {len(e["top"]) for e in top} == {5}          # 8 latents, 5 hits each, <= 8 characters
    assert max(len(h["context"]) for e in top for h in e["top"]) == 8
    f = np.asarray(encode(params, site_rows(lm.model, held, spec)[0], spec))[np.asarray(held.valid).reshape(-1) > 0]
    np.testing.assert_array_equal(freqs[0], (f > 0).mean(0))
    assert seeds == [0]
    module.train_run_sae(run, "resid_post", 0, steps=1, k=4, seed=1, out=run.parent / "mine")
    assert seeds == [0, 1] and loads[1] == (run, "best") and listing(run / "sae") == ["resid_post-0"]
    assert listing(run.parent / "mine") == ["frequencies.png", "report.json", "sae", "top_contexts.json"]


@pytest.mark.slow          # ~7 s, an encoder-decoder built and trained for it (CI's slow lane runs it)
def test_the_sae_command_on_an_encoder_decoder_counts_its_real_target_positions_only(monkeypatch, tmp_path):
    """A reversal run's held-out targets are padded (strings of 3-6 digits): report.json is `evaluate_sae` with
    the targets' weights, and the histogram's frequencies count the decoder's real positions only; the site, layer
    and architecture asked (none of them SAESpec's defaults) are the saved SAE's; the data is built with the run's
    own tokenizer."""
    from pathlib import Path
    from jaxformer import sae_run as module
    from jaxformer.data import build_task
    from jaxformer.data.build import resolve
    from jaxformer.inference import LoadedModel
    from jaxformer.nn import build_model
    from jaxformer.sae import encode, evaluate_sae, load_saelens, site_rows
    cfg, task = resolve(tiny_reverse("model.num_decoder_layers=2"))
    s2s = LoadedModel(cfg, task.tokenizer, build_model(cfg.model, seed=2), 3, "best")
    monkeypatch.setattr(module, "load_model", lambda *a, **k: s2s)
    tokenizers, build = [], module.build_task
    monkeypatch.setattr(module, "build_task", lambda data, tok: tokenizers.append(tok) or build(data, tok))
    freqs, draw = [], module._frequencies
    monkeypatch.setattr(module, "_frequencies", lambda freq: freqs.append(freq) or draw(freq))
    report = module.train_run_sae(tmp_path / "run", "mlp_out", 1, steps=3, d_sae=48, architecture="standard",
                                  out=tmp_path / "out")
    assert tokenizers == [s2s.tokenizer] and Path(report["out"]) == tmp_path / "out"
    params, spec = load_saelens(tmp_path / "out" / "sae")
    assert (spec.site, spec.layer, spec.architecture, spec.d_sae, spec.d_in) == ("mlp_out", 1, "standard", 48, 32)
    batch = next(build_task(cfg.data, s2s.tokenizer).eval_batches(cfg.data.batch_size))
    held, targets, weights = module.run_inputs(cfg, batch, "mlp_out")
    valid = np.asarray(held.valid).reshape(-1)
    assert 0 < valid.sum() < valid.size and 0 < np.asarray(weights).sum() < np.asarray(weights).size
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["step"] == 3
    for key, value in evaluate_sae(s2s.model, params, spec, held, targets, weights).items():
        assert saved[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    f = np.asarray(encode(params, site_rows(s2s.model, held, spec)[0], spec))
    np.testing.assert_array_equal(freqs[0], (f[valid] > 0).mean(0))
    assert not np.array_equal(freqs[0], (f > 0).mean(0))       # the padding positions would change them


def test_the_sae_commands_defaults_and_its_refusals(sae_run, monkeypatch):
    """1000 steps of a top-k SAE with k=32 unless asked; each integer option refused by name below its least
    value, and a bool (an int to Python) refused as well, before the run is loaded."""
    from jaxformer import sae_run as module
    from jaxformer.errors import ConfigError
    run, loads = sae_run
    asked = []

    def train(model, batches, spec, steps, seed):
        asked.append((spec.architecture, spec.k, steps, seed))
        raise KeyboardInterrupt                    # enough: what the training was asked for
    monkeypatch.setattr(module, "train_sae", train)
    with pytest.raises(KeyboardInterrupt):
        module.train_run_sae(run, "resid_post", 0, d_sae=64)
    assert asked == [("topk", 32, 1000, 0)]
    for option, value, least in (("steps", 0, 1), ("steps", True, 1), ("batch_size", -1, 0), ("d_sae", -1, 0),
                                 ("d_sae", 2.0, 0), ("k", 0, 1), ("layer", -1, 0)):
        flag = "--" + option.replace("_", "-")
        with pytest.raises(ConfigError, match=f"^{flag} {value!r} must be an integer >= {least}$"):
            module.train_run_sae(run, "resid_post", **{"layer": 0, option: value})
    assert loads == [(run, "best")]


def test_an_out_filled_while_the_sae_trains_is_kept_and_a_stop_while_writing_leaves_nothing(sae_run, tmp_path,
                                                                                          monkeypatch):
    """--out is checked before the training and again when written: a folder filled meanwhile is left as it is
    (OutputError naming --out); a stop signal while the folder is written leaves nothing, naming the command."""
    from jaxformer import sae_run as module
    from jaxformer.errors import Interrupted
    run, _ = sae_run
    out, train, draw = tmp_path / "mine", module.train_sae, module._frequencies

    def filling(*a, **k):
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return train(*a, **k)
    monkeypatch.setattr(module, "train_sae", filling)
    with pytest.raises(OutputError, match=f"--out {out} is not empty .*: choose another --out"):
        module.train_run_sae(run, "resid_post", 0, steps=1, k=4, out=out)
    assert listing(out) == ["notes.txt"]
    monkeypatch.setattr(module, "train_sae", train)
    def stopping(freq):                          # the signal arrives while the figure is saved into OUT.partial
        fig = draw(freq)
        fig.savefig = lambda *a, real=fig.savefig, **k: stop_now(monkeypatch) or real(*a, **k)
        return fig
    monkeypatch.setattr(module, "_frequencies", stopping)
    with pytest.raises(Interrupted, match=f"jaxformer sae stopped on SIGTERM: nothing was written to {run}"):
        module.train_run_sae(run, "resid_post", 0, steps=1, k=4)
    assert listing(run / "sae") == []                   # no OUT, no OUT.partial


def test_sigterm_during_sae_training_stops_it_with_nothing_written(sae_run, tmp_path, capsys, monkeypatch):
    """Before: the signal was held until every step had run, then OUT was written and the command exited 0. The
    signal arrives during the first step: the loop stops before the next one, exit 143."""
    from jaxformer import sae
    run, _ = sae_run
    real, steps = sae._step, []

    def step(*a, **k):
        steps.append(1)
        stop_now(monkeypatch)
        return real(*a, **k)
    monkeypatch.setattr(sae, "_step", step)
    out = tmp_path / "out"
    rc, said = run_cli(capsys, "sae", "--workdir", run, "--layer", "0", "--steps", "50", "--k", "4",
                       "--d-sae", "32", "--out", out)
    assert rc == 143 and "jaxformer sae stopped on SIGTERM at step 1 of 50; nothing was written" in said, said
    assert steps == [1] and listing(tmp_path) == ["run"] and listing(run) == []


# ----------------------------------------------------------------------------- save_saelens

def test_save_saelens_refuses_a_folder_holding_a_users_cfg_json(tmp_path):
    """Before: the user's cfg.json was replaced (and sae_weights.safetensors written beside it)."""
    from jaxformer.sae import SAESpec, init_sae, load_saelens, save_saelens
    import jax
    spec = SAESpec(d_in=8, d_sae=16, site="resid_post", layer=0, k=2)
    params = init_sae(spec, jax.random.key(0))
    folder = tmp_path / "sae"
    folder.mkdir()
    (folder / "cfg.json").write_text('{"mine": true}')
    with pytest.raises(OutputError, match=r"sae is not empty \(it holds cfg.json\)"):
        save_saelens(params, spec, folder)
    assert listing(folder) == ["cfg.json"] and (folder / "cfg.json").read_text() == '{"mine": true}'
    assert listing(tmp_path) == ["sae"]
    assert save_saelens(params, spec, tmp_path / "new") == tmp_path / "new"            # a new folder, whole
    assert listing(tmp_path) == ["new", "sae"] and listing(tmp_path / "new") == ["cfg.json", "sae_weights.safetensors"]
    back, spec2 = load_saelens(tmp_path / "new")
    assert spec2 == spec and all(np.array_equal(back[n], np.asarray(params[n])) for n in params)


# ----------------------------------------------------------------------------- jaxformer viz --out

@pytest.fixture()
def viz_run(monkeypatch):
    """`jaxformer viz` on an untrained char LM over the letters a-j (as tests/test_viz_patching.py's twin)."""
    from jaxformer import viz
    from jaxformer.data.tokenizers import CharTokenizer
    from jaxformer.inference import LoadedModel
    from jaxformer.nn import build_model
    cfg = tiny_lm("model.vocab_size=11")
    run = LoadedModel(cfg, CharTokenizer("abcdefghij"), build_model(cfg.model, seed=1), 0, "best")
    monkeypatch.setattr(viz, "load_model", lambda *a, **k: run)
    return run


def viz(capsys, out, *plots):
    return run_cli(capsys, "viz", "--workdir", "RUN", "--prompt", "abcd", *[a for p in plots for a in ("--plot", p)],
                   "--out", out)


def test_viz_refuses_an_out_holding_a_users_figure_of_the_same_name(viz_run, tmp_path, capsys):
    """Before: the user's prompt0-self-layer0.png was replaced by the heatmap."""
    out = tmp_path / "figures"
    out.mkdir()
    (out / "prompt0-self-layer0.png").write_bytes(b"my figure")
    rc, said = viz(capsys, out, "attention")
    assert rc == 2 and said.startswith("output error:"), said
    assert f"--out {out} holds prompt0-self-layer0.png, not written there by jaxformer: left as they are" in said
    assert listing(out) == ["prompt0-self-layer0.png"] and (out / "prompt0-self-layer0.png").read_bytes() == b"my figure"


def test_viz_calls_into_one_folder_replace_only_their_own_files(viz_run, tmp_path, capsys):
    """--plot attention, again, then --plot lens into one --out: each replaces the files jaxformer wrote there
    (its manifest lists them), a user's file of another name stays, and no temporary file is left."""
    out = tmp_path / "figures"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert viz(capsys, out, "attention")[0] == 0
    (out / "prompt0-self-layer0.png").write_bytes(b"stale")                # jaxformer's own, listed: replaced
    rc, said = viz(capsys, out, "attention")
    assert rc == 0 and (out / "prompt0-self-layer0.png").read_bytes()[:4] == PNG, said
    assert viz(capsys, out, "lens")[0] == 0
    assert listing(out) == [".jaxformer-viz", "notes.txt", "prompt0-lens.png", "prompt0-self-layer0.png"]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / ".jaxformer-viz").read_text().splitlines()[1:] == ["prompt0-lens.png", "prompt0-self-layer0.png"]


def test_viz_patching_refuses_a_users_file_and_writes_its_own_whole(tmp_path, monkeypatch):
    """write_patching through the same helper: a user's patching-z.json is refused, nothing written; into a
    new folder both files are written, and again over them."""
    from jaxformer import viz_patching
    maps = {"site": "z", "over": "head", "grid": np.ones((1, 2)).tolist(), "attribution": np.zeros((1, 2)).tolist(),
            "tokens": ["a", "b"], "metric_clean": 0.0, "metric_corrupt": -1.0, "step": 0, "clean": "ab",
            "corrupt": "ac"}
    monkeypatch.setattr(viz_patching, "patching_maps", lambda *a, **k: maps)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "patching-z.json").write_text("mine")
    with pytest.raises(OutputError, match="holds patching-z.json, not written there by jaxformer"):
        viz_patching.write_patching("RUN", ["ab"], "ac", out=out)
    assert listing(out) == ["patching-z.json"] and (out / "patching-z.json").read_text() == "mine"
    for _ in range(2):
        paths = viz_patching.write_patching("RUN", ["ab"], "ac", out=tmp_path / "new")
        assert [p.name for p in paths] == ["patching-z.png", "patching-z.json"]
    assert listing(tmp_path / "new") == [".jaxformer-viz", "patching-z.json", "patching-z.png"]
    assert json.loads((tmp_path / "new" / "patching-z.json").read_text())["site"] == "z"


# ----------------------------------------------------------------------------- the helpers themselves

def test_write_kept_leaves_nothing_when_a_writer_fails_and_a_foreign_manifest_is_refused(tmp_path):
    from jaxformer.staging import MANIFEST, write_kept

    def broken(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        write_kept(tmp_path / "a", {"x.json": lambda p: p.write_text("1"), "y.json": broken})
    assert listing(tmp_path / "a") == [MANIFEST, "x.json"]                 # x whole, y not at all (no temporary)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / MANIFEST).write_text("my own notes\nx.json\n")
    (tmp_path / "b" / "x.json").write_text("mine")
    with pytest.raises(OutputError, match="is not jaxformer's list of the files it wrote"):
        write_kept(tmp_path / "b", {"x.json": lambda p: p.write_text("1")})
    assert (tmp_path / "b" / "x.json").read_text() == "mine"


def test_the_general_staging_names_its_folder_as_the_caller_says(tmp_path):
    """`jaxformer.staging` words its errors for the caller (no '--out' or 'export' unless given), raising the
    error class it is given; hf.staging keeps export-hf's wording and HFError."""
    from jaxformer.hf.families import HFError
    from jaxformer.hf.staging import check_free as hf_check_free
    from jaxformer.staging import check_free, fresh, staged
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("mine")
    with pytest.raises(OutputError) as e:
        check_free(out)
    assert str(e.value).startswith(f"{out} is not empty (it holds a.txt); an output is written") and \
        "--out" not in str(e.value) and "export" not in str(e.value)
    with pytest.raises(HFError, match=f"--out {out} is not empty .* an export is written"):
        hf_check_free(out)
    assert fresh(out) == tmp_path / "out-2"
    with staged(tmp_path / "out-2", "sae") as tmp:
        (tmp / "f").write_text("1")
        assert fresh(out) == tmp_path / "out-3"                # out-2.partial is being written
    assert listing(tmp_path) == ["out", "out-2"]


# ----------------------------------------------------------------------------- jaxformer sae: bad inputs named
@pytest.mark.parametrize("flags, says", [
    (["--layer", "0", "--steps", "0"], "--steps 0 must be an integer >= 1"),
    (["--layer", "0", "--steps", "-4"], "--steps -4 must be an integer >= 1"),
    (["--layer", "0", "--batch-size", "-2"], "--batch-size -2 must be an integer >= 0"),
    (["--layer", "-1"], "--layer -1 must be an integer >= 0"),
    (["--layer", "3"], "sae.layer=3 is outside the 1 layers of site 'resid_post'"),
    (["--layer", "0", "--site", "embed"], "sae.site='embed' is model-level"),
    (["--layer", "0", "--site", "pattern"], "sae.site='pattern' is [B,N,T,S]"),
    (["--layer", "0", "--site", "q"], "SAELens flattens the heads of z only"),
    (["--layer", "0", "--k", "0"], "--k 0 must be an integer >= 1"),
])
def test_sae_names_what_it_cannot_train_on(sae_run, capsys, flags, says):
    """Before: --steps 0 / -4 an UnboundLocalError, a negative batch, --site embed or pattern a JAX traceback."""
    run, _ = sae_run
    rc, said = run_cli(capsys, "sae", "--workdir", run, *flags)
    assert rc == 2 and "config error:" in said and says in said, said
    assert listing(run) == []


@pytest.mark.slow          # ~4 s; the default lane trains a z SAE in tests/test_sae.py and reads one in test_saelens_folders
def test_sae_trains_on_z_with_its_heads_flattened(sae_run, capsys):
    run, _ = sae_run
    rc, said = run_cli(capsys, "sae", "--workdir", run, "--site", "z", "--layer", "0", "--steps", "2", "--k", "4")
    assert rc == 0, said
    cfg = json.loads((run / "sae" / "z-0" / "sae" / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == "blocks.0.attn.hook_z" and cfg["reshape_activations"] == "hook_z"
