"""The `tokens` task over prepared shards: packed rows equal each document alone, the pipeline is deterministic,
resumable and split by rows, the held-out pass counts every token once, and bits per byte is what it says."""
from __future__ import annotations

import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from helpers import tiny_lm, train_losses
from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError
from jaxformer.configio import apply_overrides
from jaxformer.data import build_task
from jaxformer.data.prepare import prepare
from jaxformer.data.tokenizers import ByteTokenizer
from jaxformer.data.tokens import packed
from jaxformer.errors import DataError
from jaxformer.inference.evaluate import evaluate
from jaxformer.nn import build_model
from jaxformer.train.loop import train

WORDS = "to be or not that is the question whether tis nobler in mind é 字".split()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """150 short documents (JSONL) as byte tokens."""
    root, rng = tmp_path_factory.mktemp("tokens"), random.Random(3)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(150)]
    import json
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prepare([root / "c.jsonl"], root / "out", tokenizer="byte", eval_fraction=0.2, progress=False)
    return root / "out"


def cfg_for(path, *extra):
    return tiny_lm("data.task=tokens", f"data.path={path}", "data.block_size=24", "model.max_len=32",
                   "model.vocab_size=0", "data.batch_size=4", "train.eval_batch_size=16", *extra)


def test_packed_rows_mark_documents_and_drop_cross_document_targets():
    eod = 9
    rows = np.asarray([[5, 6, eod, 7, 8, eod, 4], [eod, 1, 2, 3, eod, eod, 5]])
    b = packed(rows, eod)
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 2], [1, 2, 2, 2, 2, 3]])
    np.testing.assert_array_equal(b["inputs"], rows[:, :-1])
    np.testing.assert_array_equal(b["targets"], [[6, eod, 0, 8, eod, 0], [0, 2, 3, eod, 0, 0]])


def test_a_packed_row_gives_each_documents_logits_alone(shards):
    cfg = cfg_for(shards, "data.packing=documents", "model.runtime.dropout=0.0", "model.positional=rope")
    task = build_task(cfg.data)
    model = build_model(apply_overrides(cfg, ["model.vocab_size=258"]).model)
    batch = next(iter(task.train_dataset(4, seed=1)))
    graph, state = nnx.split(model)
    run = jax.jit(lambda s, x, seg: nnx.merge(graph, s)(x, segment_ids=seg)[0])
    full = np.asarray(run(state, jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"])))
    pieces = 0
    for r, seg in enumerate(batch["segment_ids"]):
        for s in np.unique(seg):
            cols = np.flatnonzero(seg == s)
            alone = np.zeros((1, 24), np.int32)
            alone[0, : len(cols)] = batch["inputs"][r, cols]
            one = np.asarray(run(state, jnp.asarray(alone), jnp.asarray((np.arange(24) < len(cols))[None] * 1)))
            np.testing.assert_allclose(full[r, cols], one[0, : len(cols)], rtol=2e-5, atol=2e-5)
            pieces += 1
    assert pieces > 8                                       # rows really hold several documents
    # and the training and evaluation path (the decoder-only adapter) passes the batch's segment ids on
    from jaxformer.arch import architecture
    logits, _, _ = jax.jit(lambda s, b: architecture("decoder_only").forward(nnx.merge(graph, s), b))(
        state, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(np.asarray(logits), full, rtol=1e-6, atol=1e-6)


def test_the_pipeline_is_deterministic_resumable_and_split_by_rows(shards):
    task = build_task(cfg_for(shards).data)
    take = lambda it, n: [next(it) for _ in range(n)]                                      # noqa: E731
    a = take(iter(task.train_dataset(4, seed=5)), 40)            # past several epochs
    b = take(iter(task.train_dataset(4, seed=5)), 40)
    assert all((x["inputs"] == y["inputs"]).all() for x, y in zip(a, b))
    c = take(iter(task.train_dataset(4, seed=6)), 1)
    assert (c[0]["inputs"] != a[0]["inputs"]).any()
    it = iter(task.train_dataset(4, seed=5))
    take(it, 13)
    state = it.get_state()
    again = iter(task.train_dataset(4, seed=5))
    again.set_state(state)
    assert all((x["inputs"] == y["inputs"]).all() for x, y in zip(take(again, 5), a[13:18]))
    halves = [take(iter(task.train_dataset(4, seed=5, rows=slice(i, i + 2))), 3) for i in (0, 2)]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([h[k]["inputs"] for h in halves]), a[k]["inputs"])
    # targets are the inputs shifted by one; window starts move between epochs (a per-epoch offset)
    np.testing.assert_array_equal(a[0]["inputs"][:, 1:], a[0]["targets"][:, :-1])
    per_epoch = task.windows // 4
    starts = lambda batches: {tuple(r[:3]) for x in batches for r in x["inputs"]}      # noqa: E731
    assert starts(a[:per_epoch]) != starts(a[per_epoch:2 * per_epoch])


@pytest.mark.parametrize("packing", ["windows", "documents"])
def test_the_held_out_pass_scores_every_token_once(shards, packing):
    task = build_task(cfg_for(shards, f"data.packing={packing}").data)
    eval_tokens = task.shards.window("eval", 0, task.shards.tokens("eval"))
    targets = np.concatenate([b["targets"].ravel() for b in task.eval_batches(16, pad_id=0)])
    real = targets[targets != 0]
    eods = int((eval_tokens[:-1] == task.eod).sum())     # documents: a target after an end of document is dropped
    assert len(real) == len(eval_tokens) - 1 - (eods if packing == "documents" else 0)
    want = eval_tokens[1:] if packing == "windows" else eval_tokens[1:][eval_tokens[:-1] != task.eod]
    np.testing.assert_array_equal(real, want)
    capped = build_task(cfg_for(shards, f"data.packing={packing}", "data.eval_tokens=50").data)   # the first 50
    first = np.concatenate([b["targets"].ravel() for b in capped.eval_batches(16, pad_id=0)])
    np.testing.assert_array_equal(first[first != 0], want[: len(first[first != 0])])
    assert 50 - eods <= len(first[first != 0]) <= 50


def test_bits_per_byte_is_the_text_tokens_nll_over_their_bytes(shards):
    cfg = cfg_for(shards, "model.runtime.dropout=0.0")
    task = build_task(cfg.data)
    model = build_model(apply_overrides(cfg, ["model.vocab_size=258"]).model)
    got = evaluate(apply_overrides(cfg, ["model.vocab_size=258"]), task, model)
    nll = bytes_ = total = count = 0.0
    tb = ByteTokenizer().token_bytes()
    for b in task.eval_batches(16, pad_id=0):
        logp = jax.nn.log_softmax(np.asarray(model(jnp.asarray(b["inputs"]))[0], np.float64), -1)
        t = b["targets"]
        lp = -np.take_along_axis(np.asarray(logp), t[..., None], -1)[..., 0]
        total, count = total + lp[t != 0].sum(), count + (t != 0).sum()
        text = (t != 0) & (tb[t] > 0)
        nll, bytes_ = nll + lp[text].sum(), bytes_ + tb[t][text].sum()
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nll / (math.log(2) * bytes_), rel=1e-5)
    assert got["bits_per_byte"] != pytest.approx(got["loss"] / math.log(2), rel=1e-3)    # the eods are left out


@pytest.mark.slow          # three short trainings (~15 s); the pipeline's own state round trip is checked above
def test_training_on_shards_resumes_bit_exactly_and_logs_bits_per_byte(shards, tmp_path):
    cfg = cfg_for(shards, "data.packing=documents", "model.runtime.dropout=0.1", "train.steps=4", "train.log_every=1",
                  "train.checkpoint_every=2", "train.eval_every=4", "train.num_examples=1")
    train(cfg, tmp_path / "full", progress="none")
    train(cfg, tmp_path / "resumed", stop_after=2, progress="none")
    train(cfg, tmp_path / "resumed", progress="none")
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(a) == [1, 2, 3, 4] and a == b
    import json
    evals = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "eval"]
    assert evals and 0 < evals[-1]["bits_per_byte"] < 9


def test_bad_token_configs_are_named_errors(shards, tmp_path):
    with pytest.raises(ConfigError, match="data.task='tokens' needs"):
        tiny_lm("data.task=tokens", "data.path=")
    with pytest.raises(ConfigError, match="data.packing"):
        cfg_for(shards, "data.packing=rows")
    with pytest.raises(DataError, match="not a prepared token folder"):
        build_task(cfg_for(tmp_path).data)
    from jaxformer.data.tokenizers import CharTokenizer
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        build_task(cfg_for(shards).data, CharTokenizer("abc", eod=True))
    with pytest.raises(DataError, match="too few for data.block_size"):
        build_task(cfg_for(shards, "data.block_size=4000", "model.max_len=4096").data)


def test_resume_refuses_another_corpus_prepared_at_the_same_path(tmp_path):
    """The shards at data.path re-prepared from other text (the same byte tokenizer, so the tokenizer check
    passes): a resume is refused naming the text, as it is for a text file changed under a run."""
    import json

    from jaxformer.errors import IncompatibleCheckpoint
    src, out = tmp_path / "c.jsonl", tmp_path / "shards"

    def prepared(word):
        src.write_text("".join(json.dumps({"text": f"{word} {i} " * 3}) + "\n" for i in range(80)))
        prepare([src], out, tokenizer="byte", eval_fraction=0.2, progress=False)
    prepared("alpha")
    cfg = cfg_for(out, "train.steps=4", "train.checkpoint_every=2", "train.eval_every=100", "train.num_examples=0")
    train(cfg, tmp_path / "run", stop_after=2, progress="none")
    import shutil
    shutil.rmtree(out)
    prepared("gamma")                                       # same length, same tokenizer, other text
    with pytest.raises(IncompatibleCheckpoint, match="was trained on other text"):
        train(cfg, tmp_path / "run", progress="none")


@settings(max_examples=30)
@given(n=st.integers(0, 60), window=st.integers(1, 12), data=st.data())
def test_strided_windows_score_every_token_once_with_enough_context(n, window, data):
    from jaxformer.inference.evaluate import strided_windows
    stride = data.draw(st.integers(1, window))
    ids = np.arange(1, n + 1, dtype=np.int32)              # ids are their own positions (1..n), 0 = pad
    rows = strided_windows(ids, window, stride, 0)
    x, y = rows["inputs"], rows["targets"]
    np.testing.assert_array_equal(rows["segment_ids"] != 0, x != 0)  # segment 0 exactly on the last window's padding
    scored = y[y != 0]
    np.testing.assert_array_equal(scored, ids[1:])           # each token after the first, once, in order
    for r, c in zip(*np.nonzero(y)):
        context = int(x[r, c]) if c == 0 else c + 1         # tokens the prediction of y[r, c] sees
        assert y[r, c] == x[r, c] + 1 and min(int(y[r, c]) - 1, window - stride) <= context


@pytest.fixture(scope="module")
def lm_run(shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-run")
    train(cfg_for(shards, "train.steps=3", "train.eval_every=3", "train.checkpoint_every=3", "train.num_examples=0",
                  "model.runtime.dropout=0.0"), d, progress="none")
    return d


def test_eval_data_is_strided_perplexity_and_bits_per_byte(lm_run, tmp_path, capsys):
    """Stride 1: every token predicted from the full window before it; equal to predicting each token by its
    own forward pass over its context (float64 log-softmax)."""
    from jaxformer.inference import load_model
    from jaxformer.inference.evaluate import evaluate_text
    text = "to be or not to be, é 字 that is the question"
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    run = load_model(lm_run, "latest")
    got = evaluate_text(run, tmp_path / "t.txt", stride=1)
    ids = run.tokenizer.encode(text)
    graph, state = nnx.split(run.model)
    logits_of = jax.jit(lambda s, x: nnx.merge(graph, s)(x)[0])
    nll = []
    for j in range(1, len(ids)):
        ctx = ids[max(0, j - 24):j]
        x = np.zeros((1, 24), np.int32)
        x[0, : len(ctx)] = ctx
        row = np.asarray(logits_of(state, jnp.asarray(x)), np.float64)[0, len(ctx) - 1]
        nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[ids[j]])
    assert got["tokens"] == len(ids) - 1 and got["bytes"] == len(text.encode()) - 1    # the first byte is context
    assert got["loss"] == pytest.approx(np.mean(nll), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(np.sum(nll) / (math.log(2) * got["bytes"]), rel=1e-5)
    assert evaluate_text(run, tmp_path / "t.txt")["stride"] == 12                        # half the window
    assert cli_main(["eval", "--workdir", str(lm_run), "--data", str(tmp_path / "t.txt")]) == 0
    assert "bits_per_byte=" in capsys.readouterr().out
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    for argv, message in ((["--data", str(tmp_path / "bad.txt")], "is not UTF-8"),
                          (["--data", str(tmp_path / "none.txt")], "is not a readable file"),
                          (["--data", str(tmp_path / "t.txt"), "--stride", "99"], "--stride 99")):
        assert cli_main(["eval", "--workdir", str(lm_run), *argv]) == 2
        assert message in capsys.readouterr().out


@pytest.mark.slow          # a BPE preparation and a training (~8 s)
def test_generate_decodes_subword_text_and_stops_at_the_end_of_document(shards, tmp_path):
    from jaxformer.inference import generate_text, load_model
    d = tmp_path / "bpe"
    prepare([shards.parent / "c.jsonl"], d, tokenizer="bpe", vocab_size=280, progress=False)
    train(cfg_for(d, "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.num_examples=1"),
          tmp_path / "run", progress="none")
    run = load_model(tmp_path / "run", "latest")
    out = generate_text(run, ["to be", "字"], max_new=6, temperature=1.0, seed=1)
    assert all(isinstance(o, str) for o in out) and run.tokenizer.kind == "hf"
    ids = run.tokenizer.encode(out[0])
    assert run.tokenizer.decode(ids) == out[0] and run.tokenizer.eod_id not in ids

    from jaxformer.viz import attention_maps, token_label        # heatmap axes: whole subword pieces
    prompt = "to be or not"
    tok = run.tokenizer
    labels = [token_label(tok, i) for i in tok.encode(prompt)]
    assert len(labels) < len(prompt) and "".join(labels) == prompt.replace(" ", "\u2423")
    assert token_label(tok, tok.eod_id) == "<eod>" and token_label(tok, 0) == "<pad>"
    maps = attention_maps(run, [prompt])[0]
    assert maps.queries["self"] == labels and maps.keys["self"] == labels


@pytest.mark.slow          # two processes with jax.distributed (~15 s)
def test_two_processes_read_their_rows_of_the_same_batches(shards, tmp_path):
    """Each of 2 processes (jax.distributed, 4 devices) gathers only its rows; together they are the batches one
    process reads, row for row."""
    import socket
    import subprocess
    import sys
    from pathlib import Path
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).parent / "tokens_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(shards), str(tmp_path / f"{i}.npz")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    parts = sorted((np.load(tmp_path / f"{i}.npz") for i in range(2)), key=lambda z: int(z["start"]))
    assert [(int(z["start"]), int(z["stop"])) for z in parts] == [(0, 4), (4, 8)]
    task = build_task(cfg_for(shards, "data.packing=documents").data)
    it = iter(task.train_dataset(8, seed=5))
    for i in range(3):
        whole = next(it)
        for k in ("inputs", "targets", "segment_ids"):
            np.testing.assert_array_equal(np.concatenate([z[f"{k}{i}"] for z in parts]), whole[k])
