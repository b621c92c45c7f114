"""`jaxformer data prepare` and the shard reader: documents round-trip byte-exactly through every tokenizer, the
split and shards are what the index says, and bad inputs are named errors."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from jaxformer.cli import main as cli_main
from jaxformer.data import prepare as prep
from jaxformer.data.prepare import prepare
from jaxformer.data.shards import TokenShards
from jaxformer.errors import DataError

WORDS = "the quick brown fox jumps over a lazy dog café naïve 漢字 😀 tab\there \u00a0nbsp".split(" ")


def _text(rng: random.Random, lines: int) -> str:
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + rng.choice(["\n", "\r\n"])
                   for _ in range(lines))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five documents (files) of mixed scripts, CRLF and LF line ends, one without a final newline."""
    root, rng = tmp_path_factory.mktemp("corpus"), random.Random(0)
    texts = [_text(rng, rng.randint(20, 200)) for _ in range(5)]
    texts[3] = texts[3].rstrip()
    paths = []
    for i, t in enumerate(texts):
        paths.append(root / f"doc{i}.txt")
        paths[-1].write_bytes(t.encode("utf-8"))
    return paths, texts


def _all_documents(s: TokenShards) -> list[str]:
    return [s.tokenizer.decode(s.document(split, i)) for split in ("train", "eval")
            for i in range(len(s.documents(split)) - 1)]


@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe", "unigram"])
def test_every_document_round_trips_byte_exactly(corpus, tmp_path, tokenizer):
    paths, texts = corpus
    index = prepare(paths, tmp_path / "out", tokenizer=tokenizer, vocab_size=320, progress=False)
    s = TokenShards(tmp_path / "out")
    assert _all_documents(s) == texts                     # the last document(s) are held out, in order
    table = s.tokenizer.token_bytes()                     # bits per byte's denominator: each id's text bytes
    docs = [s.document(sp, i) for sp in ("train", "eval") for i in range(len(s.documents(sp)) - 1)]
    assert [int(table[d].sum()) for d in docs] == [len(t.encode()) for t in texts]
    assert table[s.tokenizer.eod_id] == table[s.tokenizer.pad_id] == 0
    eod = s.tokenizer.eod_id
    for split in ("train", "eval"):
        d = s.documents(split)
        ends = s.window(split, 0, s.tokens(split))[d[1:] - 1]
        assert (ends == eod).all() and (s.window(split, 0, s.tokens(split)) == eod).sum() == len(d) - 1
        assert index["splits"][split]["text_bytes"] == sum(len(t.encode()) for t in
                                                           texts[:4 if split == "train" else None][
                                                               4 if split == "eval" else 0:])
    assert index["dtype"] == "uint16" and s.tokenizer.vocab_size == index["tokenizer"]["vocab_size"]


def _sentencepiece_model(texts, model_type: str, **kw) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    import io
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter("".join(texts).splitlines()), model_writer=buf,
                                   vocab_size=300, model_type=model_type, byte_fallback=True, character_coverage=1.0,
                                   minloglevel=2, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_sentencepiece_model_encodes_whole_documents_and_round_trips(corpus, tmp_path, monkeypatch, model_type):
    """A SentencePiece model (identity normaliser, byte fallback) round-trips every document, though it adds a
    dummy prefix to whatever it encodes: documents longer than a piece are encoded whole, not piece by piece
    (piece by piece, every piece would gain a space). Bits per byte's table counts the prefix as one byte."""
    paths, texts = corpus
    model = tmp_path / "spm.model"
    model.write_bytes(_sentencepiece_model(texts, model_type, normalization_rule_name="identity",
                                           remove_extra_whitespaces=False))
    monkeypatch.setattr(prep, "PIECE", 100)                      # every document spans several pieces
    index = prepare(paths, tmp_path / "out", tokenizer=str(model), progress=False)
    s = TokenShards(tmp_path / "out")
    assert index["tokenizer"]["kind"] == "sentencepiece" and s.tokenizer.vocab_size == 302
    assert _all_documents(s) == texts
    docs = [s.document(sp, i) for sp in ("train", "eval") for i in range(len(s.documents(sp)) - 1)]
    table = s.tokenizer.token_bytes()
    assert [int(table[d].sum()) for d in docs] == [len(t.encode()) + 1 for t in texts]
    assert table[:2].tolist() == [0, 0] and 2 <= min(min(d) for d in docs)


def test_a_normalising_sentencepiece_model_gives_its_normalised_text(corpus, tmp_path):
    paths, texts = corpus
    model = tmp_path / "nfkc.model"
    model.write_bytes(_sentencepiece_model(texts, "unigram"))    # defaults: NFKC, extra whitespace removed
    prepare(paths, tmp_path / "out", tokenizer=str(model), progress=False)
    s = TokenShards(tmp_path / "out")
    sp = s.tokenizer.sp
    assert _all_documents(s) == [sp.decode(sp.encode(t)) for t in texts] != texts


def test_bpe_compresses_and_is_deterministic(corpus, tmp_path):
    paths, texts = corpus
    a = prepare(paths, tmp_path / "a", tokenizer="bpe", vocab_size=400, progress=False)
    b = prepare(paths, tmp_path / "b", tokenizer="bpe", vocab_size=400, progress=False)
    assert [s["sha256"] for s in a["splits"]["train"]["shards"]] == [s["sha256"] for s in b["splits"]["train"]["shards"]]
    assert a["tokenizer"]["sha256"] == b["tokenizer"]["sha256"]
    by = prepare(paths, tmp_path / "c", tokenizer="byte", progress=False)
    assert a["splits"]["train"]["tokens"] < 0.6 * by["splits"]["train"]["tokens"]      # merges were learned


def test_document_rules_jsonl_blank_lines_separator_and_one_document(tmp_path):
    rng = random.Random(1)
    docs = [_text(rng, rng.randint(1, 6)).replace("\r\n", "\n").strip("\n") for _ in range(12)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs))
                                      + "\n", encoding="utf-8")
    prepare([tmp_path / "c.jsonl"], tmp_path / "j", tokenizer="byte", progress=False)
    assert _all_documents(TokenShards(tmp_path / "j")) == docs
    (tmp_path / "p.txt").write_text("\n\n\n".join(docs) + "\n", encoding="utf-8")
    prepare([tmp_path / "p.txt"], tmp_path / "b", tokenizer="char", docs="blank-lines", progress=False)
    assert _all_documents(TokenShards(tmp_path / "b")) == [t + "\n" for t in docs]
    (tmp_path / "s.txt").write_text("".join(t + "\n<|doc|>\n" for t in docs), encoding="utf-8")
    prepare([tmp_path / "s.txt"], tmp_path / "s", tokenizer="byte", docs="separator=<|doc|>", progress=False)
    assert _all_documents(TokenShards(tmp_path / "s")) == [t + "\n" for t in docs]
    # one document: cut at a newline near the held-out fraction, the two parts give the text back
    one = "".join(t + "\n" for t in docs) * 40
    (tmp_path / "one.txt").write_text(one, encoding="utf-8")
    index = prepare([tmp_path / "one.txt"], tmp_path / "o", tokenizer="byte", eval_fraction=0.25, progress=False)
    assert "".join(_all_documents(TokenShards(tmp_path / "o"))) == one
    assert abs(index["splits"]["eval"]["text_bytes"] / len(one.encode()) - 0.25) < 0.02


def test_shards_roll_over_and_windows_read_across_them(corpus, tmp_path, monkeypatch):
    paths, _ = corpus
    whole = prepare(paths, tmp_path / "one", tokenizer="byte", progress=False)
    monkeypatch.setattr(prep, "PIECE", 100)                      # many pieces per document, too
    index = prepare(paths, tmp_path / "many", tokenizer="byte", shard_tokens=1000, progress=False)
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 5 and all(s["tokens"] == 1000 for s in shards[:-1])
    a, b = TokenShards(tmp_path / "one"), TokenShards(tmp_path / "many")
    n = a.tokens("train")
    assert n == b.tokens("train") == whole["splits"]["train"]["tokens"]
    np.testing.assert_array_equal(a.window("train", 0, n), b.window("train", 0, n))
    np.testing.assert_array_equal(b.window("train", 990, 25), a.window("train", 0, n)[990:1015])
    with pytest.raises(IndexError):
        b.window("train", n - 3, 4)


def test_vocabulary_size_picks_the_shard_dtype(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eod>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(70_000)}
    vocab |= {w: len(vocab) + i for i, w in enumerate(sorted(set(WORDS) - set(vocab)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    paths, _ = corpus
    index = prepare(paths, tmp_path / "auto", tokenizer=str(tmp_path / "big.json"), progress=False)
    assert index["dtype"] == "uint32" and index["tokenizer"]["vocab_size"] > 1 << 16
    assert TokenShards(tmp_path / "auto").window("train", 0, 5).max() > 2      # known words, not <unk>
    with pytest.raises(DataError, match="does not fit uint16 shards"):
        prepare(paths, tmp_path / "u16", tokenizer=str(tmp_path / "big.json"), dtype="uint16", progress=False)
    assert not (tmp_path / "u16").exists()


def test_bad_inputs_are_named_errors_and_leave_no_output(corpus, tmp_path):
    paths, _ = corpus
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "a.txt").write_bytes(b"a")                     # one byte: nothing to hold out
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n', encoding="utf-8")
    (tmp_path / "tok.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "nopad.json").write_text(_word_level({"a": 0, "<eod>": 1}), encoding="utf-8")
    (tmp_path / "bad.model").write_bytes(b"\x00not a model")
    cases = [([tmp_path / "missing.txt"], {}, "does not exist"),
             ([tmp_path], {}, "is not a regular file"),
             ([tmp_path / "empty.txt"], {}, "hold no text"),
             ([tmp_path / "latin1.txt"], {}, "line 1 is not UTF-8"),
             ([tmp_path / "bad.jsonl"], {}, "line 2 is not a JSON object"),
             (paths, {"tokenizer": str(tmp_path / "tok.json")}, "does not parse"),
             (paths, {"tokenizer": str(tmp_path / "nopad.json")}, '"<pad>" must be id 0'),
             (paths, {"tokenizer": str(tmp_path / "absent.json")}, "no such file"),
             (paths, {"tokenizer": str(tmp_path / "bad.model")}, "SentencePiece model does not parse"),
             (paths, {"tokenizer": "bpe", "vocab_size": 100}, "too small for a byte-level bpe"),
             (paths, {"docs": "paragraphs"}, "--docs 'paragraphs'"),
             (paths, {"eval_fraction": 1.0}, "--eval-fraction"),
             ([tmp_path / "a.txt"], {"tokenizer": "byte"}, "split is empty")]
    for i, (inputs, kw, message) in enumerate(cases):
        with pytest.raises(DataError, match=message):
            prepare(inputs, tmp_path / f"out{i}", progress=False, **kw)
        assert not (tmp_path / f"out{i}").exists() and not (tmp_path / f"out{i}.partial").exists()
    prepare(paths, tmp_path / "done", tokenizer="byte", progress=False)
    with pytest.raises(DataError, match="already holds prepared shards"):
        prepare(paths, tmp_path / "done", tokenizer="byte", progress=False)


def _word_level(vocab: dict) -> str:
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel(vocab, unk_token=None)).to_str()


def test_an_interrupted_preparation_leaves_no_output_and_the_rerun_starts_afresh(corpus, tmp_path, monkeypatch):
    paths, texts = corpus
    calls = {"n": 0}
    write = prep._Writer.write

    def dying(self, ids):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return write(self, ids)
    monkeypatch.setattr(prep._Writer, "write", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(paths, tmp_path / "out", tokenizer="byte", progress=False)
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").exists()
    monkeypatch.setattr(prep._Writer, "write", write)
    prepare(paths, tmp_path / "out", tokenizer="byte", progress=False)
    assert not (tmp_path / "out.partial").exists() and _all_documents(TokenShards(tmp_path / "out")) == texts


def test_the_reader_refuses_changed_shards_and_another_tokenizer(corpus, tmp_path):
    paths, _ = corpus
    prepare(paths, tmp_path / "a", tokenizer="bpe", vocab_size=300, progress=False)
    prepare(paths, tmp_path / "b", tokenizer="bpe", vocab_size=320, progress=False)
    shard = tmp_path / "a" / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256 does not match"):
        TokenShards(tmp_path / "a")
    TokenShards(tmp_path / "a", verify=False)                   # sizes still checked: this one only flipped a bit
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="not the .* its index gives"):
        TokenShards(tmp_path / "a", verify=False)
    (tmp_path / "b" / "tokenizer.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="not the one the shards were made with"):
        TokenShards(tmp_path / "b")
    with pytest.raises(DataError, match="not a prepared token folder"):
        TokenShards(tmp_path)


def test_cli_prepare_prints_the_splits_and_names_errors(corpus, tmp_path, capsys):
    paths, _ = corpus
    argv = ["data", "prepare", *map(str, paths), "--tokenizer", "char", "--out", str(tmp_path / "o"),
            "--no-progress"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "prepared" in out and "train: 4 documents" in out and "eval: 1 documents" in out
    assert cli_main(argv) == 2
    assert "data error:" in capsys.readouterr().out


def test_a_partial_folder_jaxformer_did_not_make_is_never_removed(corpus, tmp_path, capsys):
    """Before: `mkdir X.partial; echo x > X.partial/thesis.tex; data prepare ... --out X` exited 0 and the
    thesis was gone. Only a .partial marked as prepare's own is removed; anything else is a named error."""
    paths, texts = corpus
    mine = tmp_path / "X.partial"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x\n")
    assert cli_main(["data", "prepare", *map(str, paths), "--tokenizer", "char", "--out", str(tmp_path / "X"),
                     "--no-progress"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "was not made by jaxformer data prepare" in out and "Traceback" not in out
    assert (mine / "thesis.tex").read_text() == "x\n" and not (tmp_path / "X").exists()
    (tmp_path / "Y.partial").write_text("a file, not a folder\n")
    with pytest.raises(DataError, match="was not made by jaxformer"):
        prepare(paths, tmp_path / "Y", tokenizer="byte", progress=False)
    assert (tmp_path / "Y.partial").read_text() == "a file, not a folder\n"


def test_an_interrupted_preparation_is_marked_and_its_marker_is_gone_when_done(corpus, tmp_path, monkeypatch):
    paths, texts = corpus
    write = prep._Writer.write
    monkeypatch.setattr(prep._Writer, "write", lambda self, ids: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        prepare(paths, tmp_path / "out", tokenizer="byte", progress=False)
    assert (tmp_path / "out.partial" / prep.MARK).is_file()
    monkeypatch.setattr(prep._Writer, "write", write)
    prepare(paths, tmp_path / "out", tokenizer="byte", progress=False)          # its own: removed, started afresh
    assert not (tmp_path / "out" / prep.MARK).exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("tokenizer", ["bpe", "unigram"])
def test_literal_special_token_text_never_becomes_a_special_id(tmp_path, tokenizer):
    """Before: a document holding the characters "<pad>" or "<eod>" got padding / end-of-document ids inside
    it (the round trip failed, <eod> split the document, eval scored and counted fewer tokens and bytes)."""
    docs = ["a <pad> b <eod> c </s>\nmore <pad><eod> text\n" * 20, "plain text here\n" * 30,
            "<eod>" * 10 + "\n" + "tail\n" * 20]
    paths = []
    for i, t in enumerate(docs):
        paths.append(tmp_path / f"d{i}.txt")
        paths[-1].write_text(t, encoding="utf-8")
    prepare(paths, tmp_path / "out", tokenizer=tokenizer, vocab_size=300, eval_fraction=0.3, progress=False)
    s = TokenShards(tmp_path / "out")
    assert _all_documents(s) == docs
    tok = s.tokenizer
    for split in ("train", "eval"):
        d = s.documents(split)
        ids = s.window(split, 0, s.tokens(split))
        assert not (ids == tok.pad_id).any()
        assert np.flatnonzero(ids == tok.eod_id).tolist() == (d[1:] - 1).tolist()      # only where a doc ends
    text = docs[0]
    ids = tok.encode(text)
    assert tok.decode(ids) == text and int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    assert [x.tolist() for x in tok.encode_batch([text])] == [ids.tolist()]


def test_a_pretrained_tokenizer_never_reads_its_special_tokens_from_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from jaxformer.data.tokenizers import load_tokenizer, pretrained_tokenizer, save_tokenizer
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some text to train on\n"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2}))
    for t in (pretrained_tokenizer(tmp_path), prep.load_tokenizer_file(tmp_path / "tokenizer.json")):
        save_tokenizer(t, tmp_path / "saved.json")
        for u in (t, load_tokenizer(tmp_path / "saved.json")):
            ids = u.encode("a </s> b <s>").tolist()
            assert 1 not in ids and 2 not in ids, ids
