"""`jaxformer generate`: restore a run without its data and decode prompts; output equals independent decoding."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError, apply_overrides, load_config_file
from jaxformer.data import DataError
from jaxformer.decode import greedy_naive
from jaxformer.inference import generate_text, load_run
from jaxformer.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.d_ff=64", "model.num_heads=2", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "data.num_train=128", "data.num_eval=32", "data.batch_size=16",
        "train.eval_batch_size=32", "train.num_examples=2", "train.steps=30", "train.eval_every=30"]
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
        "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. ") * 4


@pytest.fixture(scope="module")
def reversal_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("reverse")
    train(apply_overrides(load_config_file(ROOT / "configs/reverse.py"), TINY), d, progress=False)
    return d


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = apply_overrides(load_config_file(ROOT / "configs/alice.py"),
                          [f"data.path={corpus}", "data.num_chars=None", "data.gutenberg=False", "data.block_size=16",
                           "data.batch_size=8", "model.max_len=48", "train.steps=20", "train.eval_every=20",
                           "train.checkpoint_every=20"])
    train(cfg, d / "run", progress=False)
    corpus.unlink()                                       # generate must not need the training data
    return d / "run"


def test_reversal_generate_equals_full_recomputation_decoding(reversal_run):
    run = load_run(reversal_run)
    prompts = ["123", "908172", "5"]
    got = generate_text(run, prompts)
    tok = run.tokenizer
    for p, g in zip(prompts, got):
        src = jnp.asarray(np.append(tok.encode([int(c) for c in p]), tok.eos_id)[None])
        ref = greedy_naive(run.model, src, src.shape[1], bos_id=tok.bos_id, eos_id=tok.eos_id)
        assert g == tok.decode(np.asarray(ref)[0])
    assert generate_text(run, prompts, beam=1) == got


def test_lm_generate_batches_ragged_prompts_like_each_alone_and_like_recomputation(lm_run):
    run = load_run(lm_run, "latest")
    assert run.step == 20
    prompts = ["The quick", "judge", "How vexingly quick daft"]
    got = generate_text(run, prompts, max_new=8)
    for p, g in zip(prompts, got):
        assert g == generate_text(run, [p], max_new=8)[0]
        ids = list(run.tokenizer.encode(p))
        for _ in range(8):
            ids.append(int(run.model(jnp.asarray([ids]))[0, -1].argmax()))
        assert g == run.tokenizer.decode(ids[len(p):])
    # sampling is reproducible per seed
    a = generate_text(run, prompts, max_new=8, temperature=1.0, top_k=5, seed=3)
    assert a == generate_text(run, prompts, max_new=8, temperature=1.0, top_k=5, seed=3)


def test_cli_generate_prints_prompts_and_answers(reversal_run, lm_run, capsys):
    assert cli_main(["generate", "--workdir", str(reversal_run), "--prompt", "4321", "--prompt", "77"]) == 0
    out = capsys.readouterr().out
    run = load_run(reversal_run)
    for p, a in zip(["4321", "77"], generate_text(run, ["4321", "77"])):
        assert f"{p} -> {a}" in out
    assert cli_main(["generate", "--workdir", str(reversal_run)]) == 0            # default: held-out inputs
    assert capsys.readouterr().out.count(" -> ") == 3
    assert cli_main(["generate", "--workdir", str(lm_run), "--prompt", "The", "--max-new", "5", "--beam", "1",
                     "--temperature", "0.7", "--top-p", "0.9"]) == 0
    assert "The" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "12a"], "digits 0-9"),
    (["--prompt", "12", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "12", "--top-p", "0"], "top_p=0.0"),
    (["--prompt", "12", "--top-k", "-2"], "top_k=-2"),
    (["--prompt", "12", "--max-new", "0"], "max_new=0"),
    (["--prompt", "12", "--max-new", "400"], "model.max_len"),
])
def test_cli_generate_bad_inputs_exit_2_with_named_errors(reversal_run, argv, message, capsys):
    assert cli_main(["generate", "--workdir", str(reversal_run), *argv]) == 2
    assert message in capsys.readouterr().out.replace("\n", "")


def test_named_errors_for_lm_beam_unknown_chars_and_missing_runs(lm_run, tmp_path):
    run = load_run(lm_run)
    with pytest.raises(ConfigError, match="beam=2"):
        generate_text(run, ["The"], beam=2)
    with pytest.raises(DataError, match="outside the tokenizer"):
        generate_text(run, ["Über"])
    with pytest.raises(DataError, match="empty prompt"):
        generate_text(run, [""])
    with pytest.raises(ConfigError, match="not a run directory"):
        load_run(tmp_path)
