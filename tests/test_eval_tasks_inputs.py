"""`jaxformer eval-tasks` and chat templates on inputs a user can get wrong: every one refused by name (file, line,
field) or handled as lm-evaluation-harness handles it, never scored silently wrong or ended by a traceback; a stop
signal ends it at the next batch with whole results files.

Wrong implementations these catch: an empty choice (log-likelihood 0: it always wins) or `"answer": true` (index 1:
bool is an int) scored; a second task file of the same stem overwriting the first's results; a prompt longer than
model.max_len given one generated token instead of being cut from the left; a numeric GSM8K answer crashing the
comparison; a regex group that took no part in the match read as None; an empty chat template dropping every
context; a template's ZeroDivisionError (etc.) escaping as a traceback, in eval-tasks and in SFT data; SIGTERM
ignored until every task is scored.
"""
from __future__ import annotations

import json
import logging
import re
import signal
import string

import pytest

from helpers import tiny_lm
from test_sft import CONV, chat_cfg, write_chats
from jaxformer.config.run import resolve_vocab
from jaxformer.data import build_task
from jaxformer.data.chat import read_chat_template
from jaxformer.data.tokenizers import CharTokenizer
from jaxformer.errors import ConfigError, DataError, Interrupted
from jaxformer.inference import generate_text, tasks
from jaxformer.inference.restore import LoadedModel
from jaxformer.inference.tasks import (HarnessModel, _Request, as_chat, evaluate_tasks, prompt_room, read_task,
                                      score_generation)
from jaxformer.nn.build import build_model
from jaxformer.signals import Held


@pytest.fixture(scope="module")
def run():
    """An untrained char LM (rope: nothing refuses a prompt past model.max_len=100), no run directory needed."""
    tok = CharTokenizer(string.printable)
    cfg = resolve_vocab(tiny_lm("model.positional=rope"), tok.vocab_size, tok.pad_id)
    return LoadedModel(cfg, tok, build_model(cfg.model), 0, "best")


def write(path, *rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


MC = {"context": "Alice was", "choices": [" here", " there"], "answer": 0}


# ----------------------------------------------------------------------------- task files

@pytest.mark.parametrize("row, field", [
    ({"context": "a", "choices": [" b", ""], "answer": 0}, '"choices"[1] is empty'),                 # case 1
    ({"context": "a", "choices": [" b", " c"], "answer": True}, '"answer" true is not an index'),     # case 4
    ({"context": "a", "choices": [" b", " c"], "answer": 1.0}, '"answer" 1.0 is not an index'),
    ({"context": ["a"], "choices": [" b"], "answer": 0}, '"context" must be a string, not ["a"]'),
    ({"context": "a", "choices": {"b": 1}, "answer": 0}, '"choices" must be a non-empty list of strings'),
    ({"context": "a", "choices": [" b", 3], "answer": 0}, '"choices" must be a non-empty list of strings'),
    ({"context": None, "choices": [" b"], "answer": 0}, '"context" must be a string, not null'),
    ({"prompt": None, "answer": "4"}, '"prompt" must be a string, not null'),
    ({"prompt": True, "answer": "4"}, '"prompt" must be a string, not true'),
    ({"prompt": "2+2=", "answer": [4]}, '"answer" must be a string or a number, not [4]'),
    ({"prompt": "2+2=", "answer": {"n": 4}}, '"answer" must be a string or a number'),
    ({"prompt": "2+2=", "answer": None}, '"answer" must be a string or a number, not null'),
    ({"prompt": "2+2=", "answer": False}, '"answer" must be a string or a number, not false'),
    ("[1, 2]", "not a JSON object"), ("5", "not a JSON object")])
def test_bad_values_are_refused_naming_the_file_line_and_field(tmp_path, row, field):
    """Before: an empty choice and `"answer": true` were scored (the empty choice always won, true was index 1);
    the others were accepted and crashed scoring, or were refused without the line."""
    first = MC if isinstance(row, str) or "choices" in row else {"prompt": "1+1=", "answer": "2"}
    path = write(tmp_path / "t.jsonl", first, "", row)
    with pytest.raises(DataError, match=re.escape(f"t.jsonl:3: {field}")):
        read_task(path)


def test_a_numeric_answer_is_its_text_and_a_non_utf8_file_is_refused_by_line(tmp_path):
    """Before: {"answer": 4} stayed an int (AttributeError comparing it); a non-UTF-8 byte: UnicodeDecodeError."""
    path = write(tmp_path / "gsm.jsonl", {"prompt": "2+2=", "answer": 4}, '{"prompt": "x", "answer": 18.50}')
    kind, rows = read_task(path)
    assert kind == "generation" and [r["answer"] for r in rows] == ["4", "18.50"]       # the file's text
    fake = type("Fake", (), {"generate_until": lambda self, reqs: [" 4\n", "18.5"]})()
    metrics, preds = score_generation(fake, rows, 4, ["\n\n"], None)
    assert metrics["exact_match"]["value"] == 0.5 and preds[0]["answer"] == "4"
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(MC).encode() + b'\n{"context": "caf\xe9", "choices": [" a"], "answer": 0}\n')
    with pytest.raises(DataError, match="latin1.jsonl:2: not UTF-8"):
        read_task(bad)


def test_an_answer_regex_takes_the_first_group_that_took_part(run, tmp_path):
    """Before: `(\\d\\d+)|(\\d)` on "so 7" read group 1 (None): AttributeError. Now lm-evaluation-harness's rule;
    an answer the regex finds nothing in is refused (its "" would equal every output without a match)."""
    rows = [{"prompt": "p", "answer": "#### 7"}, {"prompt": "q", "answer": "12"}, {"prompt": "r", "answer": "5"}]
    fake = type("Fake", (), {"generate_until": lambda self, reqs: ["so 7", "it is 12.", "none"]})()
    metrics, preds = score_generation(fake, rows, 4, ["\n\n"], r"(\d\d+)|(\d)")
    assert [p["extracted"] for p in preds] == ["7", "12", ""]              # the answers' too: "#### 7" is 7
    assert [p["output"] for p in preds] == ["so 7", "it is 12.", "none"] and preds[0]["answer"] == "#### 7"
    assert metrics["exact_match"]["value"] == pytest.approx(2 / 3)
    path = write(tmp_path / "gsm.jsonl", {"prompt": "2+2=", "answer": "#### 4"}, {"prompt": "1+1=", "answer": "two"})
    with pytest.raises(DataError, match=r"gsm.jsonl: example 2: --answer-regex '#### \(\\\\d\+\)' finds nothing"):
        evaluate_tasks(run, tmp_path, [path], answer_regex=r"#### (\d+)")
    assert not (tmp_path / "eval_tasks").exists()                          # refused before anything was scored


def test_task_files_of_one_stem_keep_both_results(run, tmp_path):
    """Before: both were written to eval_tasks/x.json, the second over the first; results held one."""
    a, b = write(tmp_path / "a" / "x.jsonl", MC), write(tmp_path / "b" / "x.jsonl", MC, MC)
    res = evaluate_tasks(run, tmp_path, [a, b], batch_rows=4)
    assert sorted(res) == ["a-x", "b-x"] and res["b-x"]["metrics"]["acc"]["n"] == 2
    for name, path in (("a-x", a), ("b-x", b)):
        saved = json.loads((tmp_path / "eval_tasks" / f"{name}.json").read_text())
        assert saved["file"] == path and saved["task"] == name
    assert sorted(p.name for p in (tmp_path / "eval_tasks").iterdir()) == ["a-x.json", "b-x.json"]
    assert tasks.task_names(["p/q/x.jsonl", "r/q/x.jsonl", "y.jsonl"]) == ["p-q-x", "r-q-x", "y"]
    with pytest.raises(DataError, match="twice"):
        tasks.task_names([a, a])
    c = write(tmp_path / "a-x.jsonl", MC)                                  # a stem equal to a made name
    with pytest.raises(DataError, match="would both write a-x.json"):
        tasks.task_names([a, b, c])


# ----------------------------------------------------------------------------- generation within model.max_len

def test_a_long_prompt_is_cut_from_the_left_with_one_warning(run, tmp_path, caplog):
    """Before: a prompt past model.max_len generated max(1, max_len - its length) = 1 token, silently."""
    hm = HarnessModel(run)
    room = run.cfg.model.max_len - 8                                        # char tokenizer, no BOS
    long, short, exact = "Alice was beginning to get very tired of sitting by her sister " * 3, "Down the", "x" * room
    with caplog.at_level(logging.WARNING, logger="jaxformer"):
        got = hm.generate_until([_Request(p, {"until": [], "max_gen_toks": 8}) for p in (long, short, exact)])
    assert got == generate_text(run, [long[-room:], short, exact], max_new=8)
    assert len(got[0]) == 8
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["1 of 3 prompts are longer than model.max_len=100 - 8 new tokens: each keeps its last 92 "
                      "tokens (lm-evaluation-harness's rule)"]                # a prompt of exactly 92 fits
    mc, gen = write(tmp_path / "mc.jsonl", MC), write(tmp_path / "gen.jsonl", {"prompt": "a", "answer": "b"})
    with pytest.raises(ConfigError, match="--max-new 100 leaves no room for a prompt within model.max_len=100"):
        evaluate_tasks(run, tmp_path, [mc, gen], max_new=100)
    assert not (tmp_path / "eval_tasks").exists()                          # before any task was scored
    assert prompt_room(run, 99) == 1                                        # one prompt token is room enough


# ----------------------------------------------------------------------------- chat templates

def template_folder(path, template: str, **more):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **more}))
    return path


FAILING = {"ZeroDivisionError": "{{ 1 / 0 }}", "TypeError": "{{ 1 + 'a' }}", "OverflowError": "{{ 2.0 ** 10000 }}",
           "RecursionError": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
           "UndefinedError": "{{ messages.nope.deeper }}"}
HF_TOK = type("HFLike", (), {"reading_special_tokens": None})()


def test_an_empty_chat_template_is_refused(tmp_path):
    """Before: "" rendered every context as "", and eval-tasks scored the empty contexts."""
    folder = template_folder(tmp_path / "m", "")
    with pytest.raises(DataError, match=re.escape(f"{folder / 'tokenizer_config.json'} is empty")):
        read_chat_template(folder)
    with pytest.raises(DataError, match="is empty"):
        as_chat([MC], "multiple_choice", folder, HF_TOK)
    (folder / "chat_template.jinja").write_text("  \n")
    with pytest.raises(DataError, match=re.escape(f"{folder / 'chat_template.jinja'} is empty")):
        read_chat_template(folder)


@pytest.mark.parametrize("error", FAILING)
def test_a_failing_chat_template_is_a_named_error_in_eval_tasks(tmp_path, error):
    """Before: the template's exception escaped as a traceback (jinja's own errors were named, without the file)."""
    folder = template_folder(tmp_path / "m", FAILING[error])
    with pytest.raises(DataError, match=f"chat template of {re.escape(str(folder))}/tokenizer_config.json .*"
                                        f"the conversation: {error}"):
        as_chat([{"prompt": "2+2=", "answer": "4"}], "generation", folder, HF_TOK)


def test_a_failing_chat_template_is_a_named_error_in_sft_data(tmp_path):
    """data.task=chat renders each conversation (sft.encode_conversation -> ChatTemplate.assistant_spans): before,
    a ZeroDivisionError there ended training's data build with a traceback."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder = template_folder(tmp_path / "m", "{{ messages | length / 0 }}")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    chats = write_chats(tmp_path / "c.jsonl", [CONV, CONV])
    with pytest.raises(DataError, match="chat template of .*tokenizer_config.json failed on the conversation: "
                                        "ZeroDivisionError: division by zero"):
        build_task(chat_cfg(folder, chats).data)


# ----------------------------------------------------------------------------- stop signals

@pytest.mark.parametrize("sig, at_call", [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_a_stop_signal_ends_eval_tasks_at_the_next_batch_with_whole_files(run, tmp_path, monkeypatch, capsys, sig,
                                                                          at_call):
    """Before: every task was scored to the end first (the CLI held the signal), and results were written in
    place (a kill mid-write left half a file). The signal is raised in-process during the at_call-th compiled
    call (a's one batch, or b's first); an outer Held keeps it off pytest where eval-tasks does not act on it."""
    a = write(tmp_path / "a.jsonl", MC)                                    # one batch of 2 rows
    b = write(tmp_path / "b.jsonl", MC, MC, MC)                            # three batches of 2 rows
    calls, init = [], HarnessModel.__init__

    def counting_init(self, *args, **kw):
        init(self, *args, **kw)
        scores = self._scores

        def scored(*xs):
            calls.append(1)
            if len(calls) == at_call:
                signal.raise_signal(sig)
            return scores(*xs)
        self._scores = scored
    monkeypatch.setattr(HarnessModel, "__init__", counting_init)
    monkeypatch.setattr("jaxformer.inference.load_model", lambda *args, **kw: run)
    from jaxformer.cli import main as cli_main
    with Held():
        rc = cli_main(["eval-tasks", "--workdir", str(tmp_path), "--tasks", a, b, "--batch-rows", "2"])
    assert rc == 128 + sig.value and len(calls) == at_call                 # stopped before the next batch
    assert capsys.readouterr().out.strip().splitlines() == [
        f"interrupted: eval-tasks stopped on {sig.name} while scoring b (not written); results of a kept in "
        f"{tmp_path / 'eval_tasks'}"]
    assert sorted(p.name for p in (tmp_path / "eval_tasks").iterdir()) == ["a.json"]      # whole, no .tmp left
    assert json.loads((tmp_path / "eval_tasks" / "a.json").read_text())["metrics"]["acc"]["n"] == 1
    (tmp_path / "again").mkdir()
    calls.clear()
    with Held(), pytest.raises(Interrupted, match="while scoring b .not written.; no results written") as e:
        evaluate_tasks(run, tmp_path / "again", [b], batch_rows=2)
    assert e.value.exit_code == 128 + sig.value and len(calls) == at_call
    assert not list((tmp_path / "again" / "eval_tasks").iterdir())
