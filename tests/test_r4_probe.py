"""Issue R4's closing probe: the newest commands run as a careless user would. Each case below printed a traceback,
lost a user's file, gave a silently wrong result or could not be stopped before:

- eval-tasks: a task file kept as RUN/eval_tasks/NAME.json was replaced by its own results; a results file that
  failed to write (a full disk) left NAME.json.tmp behind and named no file; a character the tokenizer lacks was
  reported without the task file it is in.
- report --verdict-only: a NAME.md that is not UTF-8, a damaged or non-object NAME_info.json, an info file a
  summary cannot read: tracebacks; a runs CSV with every run 'missing' replaced the published verdict by one of
  no data (0/0 runs); a full disk while rewriting NAME.md truncated it; a missing NAME.md was reported as having
  no verdict section.
- mup-check: SIGINT/SIGTERM were held until every width had trained (the check could not be stopped); --out naming
  a file failed only after the whole check ran.
- sweep: a run named twice by --run was trained twice (under --jobs, twice at once: one failed on the lock and
  the sweep exited 2); --jobs 0 or -5 ran silently one by one; --list with --print-commands ignored --list.
- export-hf: a second export to one --out removed the first one's OUT.partial while it was written; safetensors'
  own error (a full disk) was a traceback; --out '' exported into the working directory.
- generate_lm / generate_seq2seq: ids outside the vocabulary, float or negative ids, segment ids of another shape
  and empty or 1-D prompts decoded silently (garbage) or raised IndexError/ValueError/TypeError.
- generate: an out-of-memory request (a huge --max-new on a RoPE model) was a traceback, and a long decode could
  not be stopped with Ctrl-C.
Everything runs in-process, without training: the run a command reads is stood in for where it needs one.
"""
from __future__ import annotations

import errno
import json
import pathlib
import re
import shutil
import signal
import types

import jax
import numpy as np
import pytest
from helpers import ROOT, run_cli, stop_now

from jaxformer.cli import main as cli_main
from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError, DataError, JaxformerError

ACTIVATIONS = ROOT / "configs/sweeps/activations.py"
MC = {"context": "the cat", "choices": [" sat", " ran"], "answer": 0}




# ----------------------------------------------------------------------------- eval-tasks

def test_eval_tasks_never_replaces_a_task_file_kept_where_its_results_go(tmp_path, capsys, monkeypatch):
    """Before: RUN/eval_tasks/arc.json (a JSONL task file) was overwritten by the results of scoring it."""
    import jaxformer.inference as inference
    monkeypatch.setattr(inference, "load_model", lambda *a, **k: types.SimpleNamespace(which="best", step=1))
    task = tmp_path / "eval_tasks" / "arc.json"
    task.parent.mkdir()
    task.write_text(json.dumps(MC) + "\n")
    before = task.read_bytes()
    rc, out = run_cli(capsys, "eval-tasks", "--workdir", tmp_path, "--tasks", task)
    assert rc == 2 and "data error:" in out and "it would be replaced" in out and str(task) in out, out
    assert task.read_bytes() == before and sorted(p.name for p in task.parent.iterdir()) == ["arc.json"]


def test_a_results_file_that_fails_to_write_leaves_no_temporary_file_and_names_itself(tmp_path, monkeypatch):
    """Before: a full disk left NAME.json.tmp and the error named no file."""
    from jaxformer.inference import tasks

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tasks.os, "replace", full_disk)
    with pytest.raises(OSError) as e:
        tasks._write_whole(tmp_path / "arc.json", {"task": "arc"})
    assert e.value.filename == str(tmp_path / "arc.json") and list(tmp_path.iterdir()) == []


def test_a_data_error_while_scoring_names_the_task_file(tmp_path, monkeypatch):
    """Before: '1 character(s) outside the tokenizer's vocabulary' named neither the task file nor its line."""
    from jaxformer.inference import tasks
    path = tmp_path / "arc.jsonl"
    path.write_text(json.dumps(MC) + "\n")

    def unencodable(hm, rows):
        raise DataError("1 character(s) outside the tokenizer's vocabulary: 'Q'")
    monkeypatch.setattr(tasks, "HarnessModel", lambda *a, **k: types.SimpleNamespace(task=None))
    monkeypatch.setattr(tasks, "score_multiple_choice", unencodable)
    run = types.SimpleNamespace(which="best", step=1, tokenizer=None)
    with pytest.raises(DataError, match=f"^{path}: 1 character"):
        tasks.evaluate_tasks(run, tmp_path, [str(path)])


# ----------------------------------------------------------------------------- report --verdict-only

@pytest.fixture()
def report_copy(tmp_path):
    for name in ("activations.md", "activations_runs.csv"):
        shutil.copy(ROOT / "docs/ablations" / name, tmp_path / name)
    return tmp_path


def verdict_only(capsys, out, sweep=ACTIVATIONS):
    return run_cli(capsys, "report", sweep, "--verdict-only", "--out", out)


def test_a_report_that_is_not_utf8_is_named_and_left_alone(report_copy, capsys):
    """Before: a UnicodeDecodeError traceback."""
    md = report_copy / "activations.md"
    md.write_bytes(md.read_bytes() + b"\xe9")
    before = md.read_bytes()
    rc, out = verdict_only(capsys, report_copy)
    assert rc == 2 and "Traceback" not in out and f"{md}: byte {len(before) - 1} is not UTF-8" in out, out
    assert md.read_bytes() == before


@pytest.mark.parametrize("info, says", [("{bad", "is not UTF-8 JSON"), ("[1]", "holds a JSON list")])
def test_a_damaged_info_file_is_named(report_copy, capsys, info, says):
    """Before: a JSONDecodeError traceback, or a TypeError inside the sweep's summary."""
    (report_copy / "activations_info.json").write_text(info)
    rc, out = verdict_only(capsys, report_copy)
    assert rc == 2 and "sweep error:" in out and f"activations_info.json {says}" in out, out


def test_an_info_file_the_summary_cannot_read_is_named(tmp_path, capsys):
    """Before: KeyError 'dense d_ff=512' from configs/sweeps/moe.py's summary, a traceback."""
    for name in ("moe.md", "moe_runs.csv"):
        shutil.copy(ROOT / "docs/ablations" / name, tmp_path / name)
    (tmp_path / "moe_info.json").write_text('{"another arm": {}}')
    rc, out = verdict_only(capsys, tmp_path, ROOT / "configs/sweeps/moe.py")
    assert rc == 2 and "summary() cannot compute a verdict" in out and "KeyError" in out, out


def test_a_runs_csv_without_a_finished_run_leaves_the_published_verdict(report_copy, capsys):
    """Before: rc 0, the verdict rewritten from no data ('failed 0/0 runs', the best arm's line gone)."""
    csv = report_copy / "activations_runs.csv"
    lines = csv.read_text().splitlines()
    col = lines[0].split(",").index("status")
    rows = [ln.split(",") for ln in lines[1:]]
    for r in rows:
        r[col] = "missing"
    csv.write_text("\n".join([lines[0]] + [",".join(r) for r in rows]) + "\n")
    md = (report_copy / "activations.md").read_bytes()
    rc, out = verdict_only(capsys, report_copy)
    assert rc == 2 and "has no finished run" in out, out
    assert (report_copy / "activations.md").read_bytes() == md


def test_a_full_disk_while_rewriting_the_verdict_keeps_the_report_whole(report_copy, capsys, monkeypatch):
    """Before: NAME.md was truncated in place (opened for writing, then the disk was full). The verdict itself is
    stood in for (its computation is tested elsewhere)."""
    from jaxformer import verdicts
    monkeypatch.setattr(verdicts, "verdict_from_csv", lambda sweep, out: "a new verdict")
    md = report_copy / "activations.md"
    before = md.read_bytes()
    real = pathlib.Path.write_text

    def full_disk(self, data, *a, **k):
        real(self, data[:10], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    rc, out = verdict_only(capsys, report_copy)
    monkeypatch.undo()
    assert rc == 2 and "No space left on device" in out, out
    assert md.read_bytes() == before and not list(report_copy.glob("*.tmp"))


def test_a_missing_report_is_said_to_be_missing(tmp_path, capsys):
    """Before: 'has no ## Verdict section' for a folder without the report."""
    rc, out = verdict_only(capsys, tmp_path / "nowhere")
    assert rc == 2 and f"{tmp_path / 'nowhere' / 'activations.md'} not found" in out, out


# ----------------------------------------------------------------------------- mup-check

MUP = [str(ROOT / "configs/alice.py"), "--set", "data.num_chars=2000", "--set", "model.num_heads=2",
       "--set", "model.num_decoder_layers=1", "--widths", "16", "32", "--steps", "1"]


def test_mup_check_stops_on_a_signal_with_nothing_written(tmp_path, capsys, monkeypatch):
    """Before: the signal was held until every width had trained (with many --steps: for good), then the results
    were written anyway. The signal arrives while the config's data is resolved: the check stops before it
    reads a batch."""
    import jaxformer.data.build as build
    real = build.resolve

    def resolve(cfg):
        stop_now(monkeypatch)
        return real(cfg)
    monkeypatch.setattr(build, "resolve", resolve)
    rc, out = run_cli(capsys, "mup-check", *MUP, "--out", tmp_path / "mup")
    assert rc == 143 and "mup-check stopped on SIGTERM" in out and "nothing was written" in out, out
    assert not (tmp_path / "mup").exists()


def test_mup_check_refuses_an_out_that_is_a_file_before_it_runs(tmp_path, capsys):
    """Before: the whole check ran, then 'I/O error: [Errno 17] File exists'."""
    f = tmp_path / "out"
    f.write_text("mine")
    rc, out = run_cli(capsys, "mup-check", *MUP, "--out", f)
    assert rc == 2 and "exists and is not a folder" in out and "sp D=16" not in out, out
    assert f.read_text() == "mine"


# ----------------------------------------------------------------------------- sweep

def test_a_run_named_twice_is_selected_once():
    """Before: --run 1 --run ARM/seed-S (the same run) trained it twice; under --jobs 2 at once."""
    from jaxformer.sweep import Sweep, runs, select
    sweep = Sweep(name="s", base="b.py", grid={"optim.lr": (1e-3, 3e-3)}, seeds=(0, 1))
    all_runs = runs(sweep, "root")
    picked = select(all_runs, ["1", all_runs[1].id, "1", "3"])
    assert [r.index for r in picked] == [1, 3]


@pytest.mark.parametrize("jobs", ["0", "-5"])
def test_sweep_refuses_jobs_below_one(tmp_path, capsys, jobs):
    """Before: --jobs 0 or -5 ran the sweep one run after another, silently."""
    path = tmp_path / "s.py"
    path.write_text("from jaxformer.sweep import Sweep\ndef get_sweep():\n    return Sweep(name='s', base='nope.py')\n")
    rc, out = run_cli(capsys, "sweep", path, "--jobs", jobs, "--root", tmp_path)
    assert rc == 2 and f"--jobs {jobs} must be at least 1" in out, out


def test_sweep_refuses_list_with_print_commands(capsys):
    """Before: --print-commands won and --list was ignored."""
    with pytest.raises(SystemExit) as e:
        cli_main(["sweep", str(ACTIVATIONS), "--list", "--print-commands"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# ----------------------------------------------------------------------------- export-hf staging

def test_a_second_export_to_one_out_is_refused_while_the_first_writes(tmp_path):
    """Before: the second export removed the first one's OUT.partial (marked as jaxformer's) and wrote its own;
    the first then renamed a folder holding the second's half-written files to OUT."""
    from jaxformer.hf.staging import staged
    out = tmp_path / "out"
    with staged(out) as first:
        (first / "model.safetensors").write_text("first")
        with pytest.raises(JaxformerError, match="another export to .* is running"):
            with staged(out):
                pass
        assert (first / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    with staged(out.with_name("again")):       # a finished (or killed) export's lock is gone
        pass


def test_a_safetensors_write_error_is_named_and_leaves_nothing(tmp_path):
    """Before: SafetensorError ('No space left on device') came through as a traceback."""
    import safetensors
    from jaxformer.hf.staging import staged
    out = tmp_path / "out"
    with pytest.raises(JaxformerError, match="No space left on device.*nothing was written"):
        with staged(out):
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_out_names_no_folder(capsys):
    """Before: --out '' was the working directory (an export went there when it was empty)."""
    rc, out = run_cli(capsys, "export-hf", "--workdir", "RUN", "--out", "")
    assert rc == 2 and "--out '' names no directory" in out, out


# ----------------------------------------------------------------------------- decoding inputs

V = 17


@pytest.fixture(scope="module")
def models():
    from jaxformer.nn import build_model
    base = replaced(ModelConfig(), vocab_size=V, d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1,
                    positional="rope", runtime__dropout=0.0, max_len=32)
    return {"lm": build_model(replaced(base, arch="decoder_only", num_encoder_layers=0)),
            "s2s": build_model(replaced(base, arch="encoder_decoder", num_encoder_layers=1))}


GOOD = np.array([[3, 4, 5]], np.int32)
BAD_INPUTS = {   # case -> (prompts, segment_ids, max_new, what the DataError/ConfigError says)
    "id past the vocabulary": (np.array([[3, 40]]), None, 2, "holds 40, outside the vocabulary [0, 17)"),
    "negative id": (np.array([[3, -2]]), None, 2, "holds -2, outside the vocabulary"),
    "float ids": (np.array([[3.5, 4.2]]), None, 2, "are float64"),
    "segment ids of another shape": (GOOD, np.ones((1, 2), np.int32), 2, "segment_ids of shape [1, 2] do not match"),
    "negative segment id": (GOOD, np.array([[-1, 1, 1]]), 2, "holds -1, outside ids >= 0"),
    "1-D prompt": (np.array([3, 4]), None, 2, "of shape [2]"),
    "empty prompt": (np.zeros((2, 0), np.int32), None, 2, "of shape [2, 0]"),
    "float max_new": (GOOD, None, 2.0, "max_new=2.0 must be an integer"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("arch", ["lm", "s2s"])
def test_decoding_refuses_inputs_it_would_misread(models, case, arch):
    """Before: garbage decoded silently (ids outside the table, rounded floats, negative segment ids) or an
    IndexError/ValueError/TypeError from inside the model."""
    from jaxformer import decode
    prompts, seg, max_new, says = BAD_INPUTS[case]
    with pytest.raises((DataError, ConfigError), match=re.escape(says)):
        if arch == "lm":
            decode.generate_lm(models["lm"], prompts, max_new=max_new, segment_ids=seg)
        else:
            decode.generate_seq2seq(models["s2s"], prompts, max_new=max_new, bos_id=1, eos_id=2, segment_ids=seg)


def test_padding_positions_may_hold_any_id_a_tokenizer_pads_with(models):
    """A pretrained tokenizer pads with -1 (model.pad_id=-1): ids at positions whose segment id is 0 are never
    read, so they are not refused (the slow recipe test in tests/test_hf.py decodes such a batch)."""
    from jaxformer import decode
    prompts = np.array([[3, 4, 5], [-1, -1, 6]], np.int32)
    seg = (prompts >= 0).astype(np.int32)
    out = decode.generate_lm(models["lm"], prompts, max_new=2, segment_ids=seg)
    assert np.shape(out) == (2, 2)


def test_seq2seq_refuses_a_bos_outside_the_vocabulary(models):
    from jaxformer import decode
    for fn in (decode.generate_seq2seq, decode.beam_search):
        with pytest.raises(DataError, match="bos_id=99 is outside the vocabulary"):
            fn(models["s2s"], GOOD, max_new=2, bos_id=99, eos_id=2)


# ----------------------------------------------------------------------------- generate

def _fake_run(monkeypatch, generate_text):
    import jaxformer.inference as inference
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(model=types.SimpleNamespace(arch="decoder_only")),
                                which="best", step=1)
    monkeypatch.setattr(inference, "load_model", lambda *a, **k: run)
    monkeypatch.setattr(inference, "generate_text", generate_text)


def test_generate_out_of_memory_is_one_line(capsys, monkeypatch):
    """Before: JaxRuntimeError RESOURCE_EXHAUSTED (e.g. --max-new 1000000000 on a RoPE model), a traceback."""
    def oom(*a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 161000007544 bytes.")
    _fake_run(monkeypatch, oom)
    rc, out = run_cli(capsys, "generate", "--workdir", "RUN", "--prompt", "a", "--max-new", "1000000000")
    assert rc == 2 and out.startswith("out of memory: RESOURCE_EXHAUSTED") and "--max-new" in out, out


def test_generate_decodes_with_the_stop_signals_at_their_default(capsys, monkeypatch):
    """A decode is one compiled call that writes nothing: Ctrl-C ends it at once (before: held until the whole
    --max-new was generated). A signal held while the model loaded stops it before decoding."""
    seen = []
    _fake_run(monkeypatch, lambda *a, **k: seen.append(signal.getsignal(signal.SIGINT)) or ["b"])
    before = signal.getsignal(signal.SIGINT)
    rc, out = run_cli(capsys, "generate", "--workdir", "RUN", "--prompt", "a")
    assert rc == 0 and seen == [signal.SIG_DFL] and signal.getsignal(signal.SIGINT) is before, out
    import jaxformer.inference as inference
    monkeypatch.setattr(inference, "load_model", lambda *a, **k: stop_now(monkeypatch, "SIGINT"))
    rc, out = run_cli(capsys, "generate", "--workdir", "RUN", "--prompt", "a")
    assert rc == 130 and "generate stopped on SIGINT; nothing was done" in out and len(seen) == 1, out
