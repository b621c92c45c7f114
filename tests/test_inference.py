"""`jaxformer generate`: restore a run without its data and decode prompts; output equals independent decoding."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_lm, tiny_reverse

from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError, replaced
from jaxformer.data import DataError
from jaxformer.decode import generate_seq2seq, greedy_naive
from jaxformer.inference import generate_text
from jaxformer.inference import load_model
from jaxformer.train.loop import train

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
        "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. ") * 4


@pytest.fixture(scope="module")
def reversal_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("reverse")
    train(tiny_reverse("train.steps=30", "train.eval_every=30", "train.num_examples=0"), d, progress="none")
    return d


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = tiny_lm(f"data.path={corpus}", "data.num_chars=None", "data.gutenberg=False", "data.block_size=16",
                  "model.max_len=48", "train.steps=20", "train.eval_every=20", "train.checkpoint_every=20",
                  "train.num_examples=0")
    train(cfg, d / "run", progress="none")
    corpus.unlink()                                       # generate must not need the training data
    return d / "run"


def greedy_by_recomputation(model, prompt_ids: list[int], n: int, width: int = 48) -> list[int]:
    """n greedy tokens, each from a full forward pass over the sequence so far, right-padded to `width`
    (causal: the pads after the last token cannot change its logits), so one compiled forward serves all."""
    graph, state = nnx.split(model)
    forward = _forward(graph)
    ids = list(prompt_ids)
    for _ in range(n):
        x = np.zeros((1, width), np.int32)
        x[0, :len(ids)] = ids
        row = np.asarray(forward(state, jnp.asarray(x)))[0, len(ids) - 1]
        first, second = np.sort(row)[-2:][::-1]
        assert first - second > 1e-3, f"near tie ({first - second:.2e}): exact tokens would not be a fair test"
        ids.append(int(row.argmax()))
    return ids[len(prompt_ids):]


@functools.lru_cache(maxsize=None)
def _forward(graph):
    return jax.jit(lambda state, x: nnx.merge(graph, state)(x)[0])


@pytest.mark.slow          # ~3 s; cached decoding = the full forward: tests/test_decode.py
def test_reversal_generate_equals_full_recomputation_decoding(reversal_run):
    run = load_model(reversal_run)
    prompts = ["123", "908172", "5"]
    got = generate_text(run, prompts)
    tok = run.tokenizer
    for p, g in zip(prompts, got):
        src = jnp.asarray(np.append(tok.encode([int(c) for c in p]), tok.eos_id)[None])
        ref = greedy_naive(run.model, src, src.shape[1], bos_id=tok.bos_id, eos_id=tok.eos_id)
        assert g == tok.decode(np.asarray(ref)[0])
    assert generate_text(run, prompts, beam=1) == got


@pytest.mark.slow          # the trained char-LM fixture (~10 s); tests/test_decode.py batches ragged LM prompts
def test_lm_generate_batches_ragged_prompts_like_each_alone_and_like_recomputation(lm_run):
    run = load_model(lm_run, "latest")
    assert (run.step, run.which) == (20, "latest")
    prompts = ["The quick", "judge", "How vexingly quick daft"]
    got = generate_text(run, prompts, max_new=8)
    for p, g in zip(prompts, got):
        assert g == generate_text(run, [p], max_new=8)[0]
        assert g == run.tokenizer.decode(greedy_by_recomputation(run.model, list(run.tokenizer.encode(p)), 8))
    # sampling is reproducible per seed
    a = generate_text(run, prompts, max_new=8, temperature=1.0, top_k=5, seed=3)
    assert a == generate_text(run, prompts, max_new=8, temperature=1.0, top_k=5, seed=3)


@pytest.mark.slow          # ~3 s
def test_cli_generate_prints_prompts_and_answers(reversal_run, capsys):
    assert cli_main(["generate", "--workdir", str(reversal_run), "--prompt", "4321", "--prompt", "77"]) == 0
    out = capsys.readouterr().out
    run = load_model(reversal_run)
    for p, a in zip(["4321", "77"], generate_text(run, ["4321", "77"])):
        assert f"{p} -> {a}" in out
    assert cli_main(["generate", "--workdir", str(reversal_run)]) == 0            # default: held-out inputs
    assert capsys.readouterr().out.count(" -> ") == 3


@pytest.mark.slow          # the trained char-LM fixture (~10 s)
def test_cli_generate_samples_a_char_lm_like_the_library(lm_run, capsys):
    sampled = ["--prompt", "The", "--max-new", "5", "--beam", "1", "--temperature", "0.7", "--top-p", "0.9",
               "--seed", "4"]
    assert cli_main(["generate", "--workdir", str(lm_run), *sampled]) == 0
    want = generate_text(load_model(lm_run), ["The"], max_new=5, temperature=0.7, top_p=0.9, seed=4)[0]
    assert want and f"The{want}" in capsys.readouterr().out        # the continuation, not just the echo


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "12a"], "digits 0-9"),
    (["--prompt", "12", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "12", "--top-p", "0"], "top_p=0.0"),
    (["--prompt", "12", "--top-k", "-2"], "top_k=-2"),
    (["--prompt", "12", "--max-new", "0"], "max_new=0"),
    (["--prompt", "12", "--max-new", "400"], "model.max_len"),
    (["--prompt", "12", "--temperature", "1", "--top-k", "14"], "top_k=14 must be in [0, vocab_size=13]"),
])
def test_cli_generate_bad_inputs_exit_2_with_named_errors(reversal_run, argv, message, capsys):
    assert cli_main(["generate", "--workdir", str(reversal_run), *argv]) == 2
    assert message in capsys.readouterr().out.replace("\n", "")


@pytest.mark.slow          # the trained char-LM fixture (~10 s)
def test_named_errors_for_lm_beam_unknown_chars_and_missing_runs(lm_run, tmp_path):
    run = load_model(lm_run)
    with pytest.raises(ConfigError, match="beam=2"):
        generate_text(run, ["The"], beam=2)
    with pytest.raises(DataError, match="outside the tokenizer"):
        generate_text(run, ["Über"])
    with pytest.raises(DataError, match="empty prompt"):
        generate_text(run, [""])
    with pytest.raises(ConfigError, match="not a run directory"):
        load_model(tmp_path)


@pytest.mark.slow          # three CLI commands with quantized weights: ~8 s
def test_cli_eval_and_generate_take_quantize(reversal_run, capsys):
    from jaxformer.cli_parser import QUANT
    from jaxformer.quantize import MODES
    assert QUANT == MODES
    assert cli_main(["eval", "--workdir", str(reversal_run), "--quantize", "int8"]) == 0
    out = capsys.readouterr().out
    assert "weights int8" in out and "exact_match" in out
    assert cli_main(["generate", "--workdir", str(reversal_run), "--quantize", "int4", "--kv-cache", "int8",
                     "--beam", "2", "--prompt", "4321"]) == 0
    assert "weights int4, KV cache int8, beam 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["eval", "--workdir", str(reversal_run), "--quantize", "int3"])
    assert e.value.code == 2 and "int3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="quantize='fp8'"):
        load_model(reversal_run, quantize="fp8")


def test_exact_match_counts_exactly_the_answers_that_equal_their_targets(reversal_run):
    """Half the held-out targets are replaced by the model's own greedy answers: exact match must be exactly the
    share of rows whose answer equals the target, counted here independently (an evaluator that counts every
    answer, or none, or compares the wrong columns, fails). The answers come from the same cached decoder the
    evaluator uses, so the premise is the counting alone, not a tie-free decoding."""
    import dataclasses

    from jaxformer.data import build_task
    from jaxformer.inference import evaluate
    run = load_model(reversal_run)
    task = build_task(run.cfg.data, run.tokenizer)
    tok, want = run.tokenizer, task.eval["tgt_out"].copy()
    pred = np.asarray(generate_seq2seq(run.model, task.eval["src"], max_new=want.shape[1], bos_id=tok.bos_id,
                                       eos_id=tok.eos_id, segment_ids=task.eval["src_segment_ids"]))
    want[::2] = pred[::2]
    task = dataclasses.replace(task, eval={**task.eval, "tgt_out": want})
    expected = float(np.mean((pred == want).all(1)))
    assert 0.5 <= expected < 1.0
    assert evaluate(run.cfg, task, run.model)["exact_match"] == expected


def test_evaluation_never_applies_dropout():
    """Dropout needs an explicit rngs argument, which only the train step passes: a model with dropout 0.5
    evaluates (held-out metrics) exactly like the same weights with dropout 0, and the same twice, while a call
    with rngs does drop. A model that kept dropout on at inference (a seed warning) would differ."""
    from jaxformer.data import resolve
    from jaxformer.inference import evaluate
    from jaxformer.nn import build_model
    cfg, task = resolve(tiny_lm("model.runtime.dropout=0.5"))
    off = dataclasses.replace(cfg, model=replaced(cfg.model, runtime__dropout=0.0))
    model, same = build_model(cfg.model), build_model(off.model)
    nnx.update(same, nnx.state(model, nnx.Param))
    first, again, without = evaluate(cfg, task, model), evaluate(cfg, task, model), evaluate(off, task, same)
    assert first == again == without
    tokens = jnp.asarray(np.arange(1, 17).reshape(2, 8) % cfg.model.vocab_size)
    np.testing.assert_array_equal(model(tokens)[0], same(tokens)[0])
    assert not np.array_equal(model(tokens, rngs=nnx.Rngs(dropout=1))[0], model(tokens)[0])
