"""`jaxformer eval-tasks` / `jaxformer.inference.tasks`: downstream evaluation scored as lm-evaluation-harness scores
it, checked against an independent computation (the model's full forward on each (context, continuation) alone,
log-softmax in float64 NumPy).

Wrong implementations these catch: a continuation scored one position off (the logit that predicts token i read at
i); padding or batching leaking into a row's score; acc_norm normalising by tokens instead of bytes; the context's
trailing space left in the context (lm-evaluation-harness moves it to the continuation); a standard error of the
population (n) instead of the sample (n − 1); a generation compared before its stop string is cut.
"""
from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_lm
from jaxformer.cli import main as cli_main
from jaxformer.errors import DataError
from jaxformer.inference import generate_text, load_model
from jaxformer.inference.tasks import HarnessModel, _Request, _stat, evaluate_tasks, read_task, score_generation

STEPS = ("train.steps=4", "train.log_every=2", "train.checkpoint_every=4", "train.eval_every=4")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from jaxformer.train.loop import train
    d = tmp_path_factory.mktemp("tasks") / "run"
    train(tiny_lm(*STEPS), d, progress="none")
    return d


def naive_loglikelihood(run, context: str, continuation: str) -> float:
    """log P(continuation | context) from one unbatched, unpadded forward, float64 log-softmax."""
    tok = run.tokenizer
    ctx, cont = list(tok.encode(context)), list(tok.encode(continuation))
    ids = np.asarray([ctx + cont], np.int32)
    logits = np.asarray(run.model(jnp.asarray(ids))[0], np.float64)[0]
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1,
                                                                                                         keepdims=True)
    return float(sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_loglikelihood_equals_the_unbatched_forward(run_dir):
    run = load_model(run_dir)
    hm = HarnessModel(run, batch_rows=3)             # 5 requests: two compiled calls, one padded to 4 rows
    pairs = [("Alice was", " beginning"), ("the", " rabbit"), ("Down the rabbit", "-hole"), ("she", " said"),
             ("a", "bc")]
    got = hm.loglikelihood([_Request(c, x) for c, x in pairs])
    for (c, x), (ll, greedy) in zip(pairs, got):
        np.testing.assert_allclose(ll, naive_loglikelihood(run, c, x), rtol=1e-5, atol=1e-5)
        assert isinstance(greedy, bool)
    # the context's trailing space moves to the continuation, as lm-evaluation-harness encodes a pair
    (moved, _), = hm.loglikelihood([_Request("Alice was ", "beginning")])
    np.testing.assert_allclose(moved, naive_loglikelihood(run, "Alice was", " beginning"), rtol=1e-5, atol=1e-5)


def test_multiple_choice_and_generation_tasks_score_as_the_harness_defines(run_dir, tmp_path):
    run = load_model(run_dir)
    hm = HarnessModel(run)
    mc = [{"context": "Alice was", "choices": [" beginning", " a", " very long answer here"], "answer": 0},
          {"context": "the", "choices": [" rabbit", " queen"], "answer": 1}]
    prompts = ["Alice was begi", "Down the"]
    outs = generate_text(run, prompts, max_new=6)
    gen = [{"prompt": prompts[0], "answer": f"#### {outs[0].strip()}"},      # the model's own output: a match
           {"prompt": prompts[1], "answer": "#### something else"}]
    files = []
    for name, rows in (("mc", mc), ("gen", gen)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = evaluate_tasks(run, run_dir, [str(f) for f in files], max_new=6, until=("\n\n\n",),
                         answer_regex=None)
    lls = [[naive_loglikelihood(run, r["context"], c) for c in r["choices"]] for r in mc]
    acc = [float(np.argmax(x) == r["answer"]) for x, r in zip(lls, mc)]
    norm = [float(np.argmax([s / len(c.encode()) for s, c in zip(x, r["choices"])]) == r["answer"])
            for x, r in zip(lls, mc)]
    assert res["mc"]["metrics"]["acc"]["value"] == np.mean(acc)
    assert res["mc"]["metrics"]["acc_norm"]["value"] == np.mean(norm)
    saved = json.loads((run_dir / "eval_tasks" / "mc.json").read_text())
    np.testing.assert_allclose(np.concatenate([p["loglikelihoods"] for p in saved["predictions"]]),
                               np.concatenate(lls), rtol=1e-5, atol=1e-5)
    assert res["gen"]["metrics"]["exact_match"]["value"] == 0.0          # "#### x" is not the output itself
    res = evaluate_tasks(run, run_dir, [str(files[1])], max_new=6, until=("\n\n\n",),
                         answer_regex=r"####\s*(.*)")
    saved = json.loads((run_dir / "eval_tasks" / "gen.json").read_text())["predictions"]
    assert saved[0]["extracted"] == "" and res["gen"]["metrics"]["exact_match"]["value"] == 0.0
    # the output carries no "####": compare the output whole against the answer's extraction instead
    gen[0]["answer"] = outs[0]
    files[1].write_text("\n".join(json.dumps(r) for r in gen) + "\n")
    res = evaluate_tasks(run, run_dir, [str(files[1])], max_new=6, until=("\n\n\n",))
    assert res["gen"]["metrics"]["exact_match"]["value"] == 0.5


def test_stop_strings_cut_before_comparing_and_rolling_loglikelihood_covers_every_token(run_dir):
    run = load_model(run_dir)
    hm = HarnessModel(run)
    full = generate_text(run, ["Alice"], max_new=8)[0]
    stop = full[3:5]
    cut = hm.generate_until([_Request("Alice", {"until": [stop], "max_gen_toks": 8})])[0]
    assert cut == full[:full.find(stop)]
    metrics, (pred,) = score_generation(hm, [{"prompt": "Alice", "answer": cut}], 8, [stop], None)
    assert pred["output"] == cut and metrics["exact_match"]["value"] == 1.0     # the task's stop strings cut it
    text = "Alice was beginning to get very tired"
    (rolling,) = hm.loglikelihood_rolling([_Request(text)])
    eod = run.tokenizer.eod_id               # None for this char run: the text's first token is not scored
    ids = ([] if eod is None else [eod]) + list(run.tokenizer.encode(text))
    logits = np.asarray(run.model(jnp.asarray([ids], jnp.int32))[0], np.float64)[0]
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    np.testing.assert_allclose(rolling, sum(lp[i, t] for i, t in enumerate(ids[1:])), rtol=1e-5)


def test_standard_error_is_the_samples():
    xs = [1.0, 0.0, 1.0, 1.0, 0.0]
    st = _stat(xs)
    assert st["value"] == 0.6 and st["n"] == 5
    assert math.isclose(st["stderr"], np.std(xs, ddof=1) / math.sqrt(5))
    assert _stat([1.0, 0.0])["stderr"] == np.std([1.0, 0.0], ddof=1) / math.sqrt(2)    # from two samples on
    one = _stat([1.0])
    assert one["stderr"] is None and one["value"] == 1.0


def test_bad_task_files_are_named_errors_and_the_cli_writes_results(run_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    for text, match in (('{"context": "a", "choices": ["b"], "answer": 3}\n', 'bad.jsonl:1: "answer" 3 is not an'),
                        ('{"question": "a"}\n', "neither multiple choice"), ("not json\n", "bad.jsonl:1: not a JSON"),
                        ("\n", "has no examples")):
        bad.write_text(text)
        with pytest.raises(DataError, match=match):
            read_task(bad)
    assert cli_main(["eval-tasks", "--workdir", str(run_dir), "--tasks", str(tmp_path / "none.jsonl")]) != 0
    assert "data error: task file" in capsys.readouterr().out
    good = tmp_path / "arc_tiny.jsonl"
    good.write_text(json.dumps({"context": "Alice", "choices": [" was", " is"], "answer": 0}) + "\n")
    assert cli_main(["eval-tasks", "--workdir", str(run_dir), "--tasks", str(good)]) == 0
    out = capsys.readouterr().out
    assert "arc_tiny" in out and "acc_norm" in out
    assert json.loads((run_dir / "eval_tasks" / "arc_tiny.json").read_text())["metrics"]["acc"]["n"] == 1
