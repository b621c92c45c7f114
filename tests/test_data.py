"""Data: text loading (BOM, CRLF, Gutenberg), char/digit tokenizers, tasks, grain pipelines, DataConfig checks."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import tiny_reverse
from jaxformer.config import ConfigError, DataConfig
from jaxformer.data import (CharTokenizer, DataError, DigitTokenizer, build_task, load_text, load_tokenizer,
                            save_tokenizer)
from jaxformer.data.tokenizers import BOS, EOS, PAD

GUT_HEADER = ("The Project Gutenberg EBook of X, by Somebody\r\n\r\nThis eBook is for the use of anyone anywhere.\r\n"
              "\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\n\r\n")
GUT_FOOTER = ("\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\n"
              "***** This file should be named x.txt *****\r\nSection 1. General Terms of Use\r\n")
BOOK = "CHAPTER I.\n\nOnce upon a time\nthere was a test.\n\nTHE END"


def write(tmp_path, data, name="t.txt"):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return p


def corpus(data_dir, name):
    p = data_dir / name
    if not p.is_file():
        pytest.skip(f"{p} not found")
    return p


def windows(block):
    """inputs/targets [n, T] -> the [n, T+1] windows they were cut from (asserting the one-step shift)."""
    x, y = block["inputs"], block["targets"]
    assert x.shape == y.shape
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    return np.concatenate([x, y[:, -1:]], axis=1)


# ----------------------------------------------------------------------------- load_text

def test_load_text_drops_bom_and_normalises_line_ends(tmp_path):
    p = write(tmp_path, b"\xef\xbb\xbfone\r\ntwo\rthree\n\rfour\r\n")
    text = load_text(p, gutenberg=False)
    assert text == "one\ntwo\nthree\n\nfour\n"
    assert "\ufeff" not in text and "\r" not in text


def test_load_text_strips_gutenberg_header_and_footer(tmp_path):
    p = write(tmp_path, "\ufeff" + GUT_HEADER + BOOK.replace("\n", "\r\n") + GUT_FOOTER)
    text = load_text(p)
    assert text == BOOK
    assert "Gutenberg" not in text and "START OF" not in text and "Section 1" not in text


def test_load_text_keeps_text_without_markers_or_with_gutenberg_false(tmp_path):
    body = "No boilerplate here.\n*** not a marker ***\nProject Gutenberg mentioned in passing.\n"
    assert load_text(write(tmp_path, body)) == body.strip("\n")
    assert load_text(write(tmp_path, body), gutenberg=False) == body
    full = GUT_HEADER + BOOK + GUT_FOOTER
    kept = load_text(write(tmp_path, full, "g.txt"), gutenberg=False)
    assert kept == full.replace("\r\n", "\n")
    assert "*** START OF THE PROJECT GUTENBERG EBOOK X ***" in kept and "Section 1" in kept


@pytest.mark.parametrize("data", [b"", b"\xef\xbb\xbf", b"  \r\n\t\n \r", (GUT_HEADER + "\r\n\r\n" + GUT_FOOTER).encode()],
                         ids=["empty", "bom-only", "whitespace", "gutenberg-without-book"])
def test_load_text_empty_is_an_error(tmp_path, data):
    with pytest.raises(DataError, match="empty"):
        load_text(write(tmp_path, data))


def test_load_text_missing_file_or_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_text(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="is a directory"):             # named for what it is
        load_text(tmp_path)


def test_load_text_non_utf8_is_an_error(tmp_path):
    with pytest.raises(DataError, match="not UTF-8"):
        load_text(write(tmp_path, "caf\u00e9 cr\u00e8me\n".encode("latin-1")))
    with pytest.raises(DataError, match="not UTF-8"):
        load_text(write(tmp_path, "hello".encode("utf-16"), "u16.txt"))


def test_load_text_keeps_non_ascii(tmp_path):
    assert load_text(write(tmp_path, "\u2014\u201cna\u00efve\u201d \u00e9\u00e8 \U0001f600\r\n")) == \
        "\u2014\u201cna\u00efve\u201d \u00e9\u00e8 \U0001f600"


# ----------------------------------------------------------------------------- real corpora

def test_real_alice_is_clean(data_dir):
    raw = corpus(data_dir, "alice_in_wonderland.txt").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf") and b"\r\n" in raw   # the file is what the test claims to handle
    text = load_text(data_dir / "alice_in_wonderland.txt")
    assert "\ufeff" not in text and "\r" not in text
    assert text.startswith("ALICE'S ADVENTURES IN WONDERLAND"), text[:80]
    assert "Project Gutenberg" not in text[:2000]
    assert "*** START OF" not in text and "*** END OF" not in text
    assert "PROJECT GUTENBERG LICENSE" not in text.upper() and "Section 1." not in text
    assert text.rstrip().endswith("Lewis Carroll")        # last book line before the END marker
    assert 100_000 < len(text) < len(raw)


def test_real_alice_first_10k_vocab(data_dir):
    text = load_text(corpus(data_dir, "alice_in_wonderland.txt"))[:10_000]
    tok = CharTokenizer(text)
    print(f"\nAlice first 10,000 chars: CharTokenizer.vocab_size = {tok.vocab_size} ({len(set(text))} chars + <pad>)")
    assert tok.vocab_size == len(set(text)) + 1
    assert 50 <= tok.vocab_size <= 80
    assert tok.decode(tok.encode(text)) == text


def test_real_shakespeare_plain_ascii(data_dir):
    p = corpus(data_dir, "tiny_shakespeare.txt")
    raw = p.read_text(encoding="utf-8")
    text = load_text(p)
    assert text == raw.strip("\n")          # no markers: only the trailing newline goes
    assert text.startswith("First Citizen:")
    assert text.isascii()


def test_real_alice_text_task(data_dir):
    p = corpus(data_dir, "alice_in_wonderland.txt")
    task = build_task(DataConfig(task="text", path=str(p), num_chars=10_000, block_size=64))
    text = load_text(p)[:10_000]
    assert task.kind == "lm" and task.tokenizer.vocab_size == len(set(text)) + 1
    assert task.train["inputs"].shape[1] == 64 and task.eval["inputs"].shape[1] == 64
    assert task.tokenizer.decode(windows(task.train).ravel()) == text[:task.train["inputs"].shape[0] * 65]


# ----------------------------------------------------------------------------- text task

def _text_file(tmp_path, n=500, seed=0):
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("abcdefghij klmnop\n.,'\u00e9"))
    text = "".join(rng.choice(alphabet, size=n))
    return write(tmp_path, text, "lm.txt"), text


@pytest.mark.parametrize("num_chars,start,block,frac", [(None, 0, 10, 0.1), (400, 37, 7, 0.25), (123, 5, 16, 0.1)])
def test_text_task_shapes_shift_and_heldout_tail(tmp_path, num_chars, start, block, frac):
    p, full = _text_file(tmp_path)
    cfg = DataConfig(task="text", path=str(p), num_chars=num_chars, start=start, block_size=block, eval_fraction=frac)
    task = build_task(cfg)
    text = full[start:None if num_chars is None else start + num_chars]
    L, w = len(text), block + 1
    cut = L - max(round(L * frac), w)
    assert task.kind == "lm" and isinstance(task.tokenizer, CharTokenizer)
    assert task.train["inputs"].shape == task.train["targets"].shape == (cut // w, block)
    assert task.eval["inputs"].shape == task.eval["targets"].shape == ((L - cut) // w, block)
    assert task.train["inputs"].shape[0] >= 1 and task.eval["inputs"].shape[0] >= 1
    for split in (task.train, task.eval):
        assert split["inputs"].dtype == np.int32
        assert split["inputs"].min() >= 1 and split["inputs"].max() < task.tokenizer.vocab_size
    tr = task.tokenizer.decode(windows(task.train).ravel())
    ev = task.tokenizer.decode(windows(task.eval).ravel())
    # training text is the head, held-out text the contiguous tail (less a remainder of < one window)
    assert text.startswith(tr)
    assert ev == text[cut:cut + len(ev)] and L - (cut + len(ev)) < w
    assert len(tr) <= cut                          # no training window reaches into the held-out part
    assert task.tokenizer.chars == sorted(set(text))


def test_text_task_too_short_names_block_size(tmp_path):
    p, _ = _text_file(tmp_path, n=100)
    with pytest.raises(DataError, match=r"data\.block_size=20\b"):
        build_task(DataConfig(task="text", path=str(p), num_chars=41, block_size=20))   # 41 < 2*21
    build_task(DataConfig(task="text", path=str(p), num_chars=42, block_size=20))       # exactly enough
    with pytest.raises(DataError, match=r"data\.block_size=10\b"):
        build_task(DataConfig(task="text", path=str(p), start=95, num_chars=None, block_size=10))


def test_text_task_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_task(DataConfig(task="text", path=str(tmp_path / "absent.txt")))


@pytest.mark.parametrize("frac,train_blocks", [(0.95, None), (0.90, None), (0.89, 1), (0.5, 4)])
def test_text_task_large_eval_fraction_keeps_a_training_block_or_names_the_field(tmp_path, frac, train_blocks):
    """100 characters, block_size=10 (windows of 11). text_task holds out max(round(100·frac), 11) characters and
    needs >= 11 left for training: frac=0.89 leaves exactly 11 (one block), 0.90 leaves 10 (an error naming
    data.eval_fraction), 0.95 leaves 5."""
    p, _ = _text_file(tmp_path, n=100)
    cfg = DataConfig(task="text", path=str(p), num_chars=100, block_size=10, eval_fraction=frac)
    cut = 100 - max(round(100 * frac), 11)                       # the documented split, recomputed here
    assert (cut >= 11) == (train_blocks is not None) and (train_blocks is None or cut // 11 == train_blocks)
    if train_blocks is None:
        with pytest.raises(DataError, match=rf"data\.eval_fraction={frac}\b.*leaves {cut} training"):
            build_task(cfg)
    else:
        task = build_task(cfg)
        assert task.train["inputs"].shape == (train_blocks, 10)
        assert task.eval["inputs"].shape == ((100 - cut) // 11, 10)


def test_char_tokenizer_unknown_characters_are_listed(tmp_path):
    save_tokenizer(CharTokenizer("abc \n"), tmp_path / "tok.json")
    tok = load_tokenizer(tmp_path / "tok.json")
    np.testing.assert_array_equal(tok.encode("cab"), [5, 3, 4])
    with pytest.raises(DataError, match=r"2 character\(s\).*'xz'"):
        tok.encode("a zax\n")


def test_tokenizer_save_load_round_trip(tmp_path):
    text = "Caf\u00e9 \u201cquoted\u201d \u2014 na\u00efve\n\ttabs & \\ backslash \"q\" \U0001f600"
    tok = CharTokenizer(text)
    save_tokenizer(tok, tmp_path / "char.json")
    back = load_tokenizer(tmp_path / "char.json")
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars and back.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(back.encode(text), tok.encode(text))
    assert back.decode(tok.encode(text)) == text
    save_tokenizer(DigitTokenizer(), tmp_path / "dig.json")
    d = load_tokenizer(tmp_path / "dig.json")
    assert isinstance(d, DigitTokenizer) and d.decode(d.encode([3, 1, 4])) == "314"
    (tmp_path / "bad.json").write_text('{"kind": "bpe"}')
    with pytest.raises(DataError, match="unknown tokenizer"):
        load_tokenizer(tmp_path / "bad.json")


def test_text_task_with_saved_tokenizer(tmp_path):
    p, text = _text_file(tmp_path)
    cfg = DataConfig(task="text", path=str(p), num_chars=None, block_size=10)
    bigger = CharTokenizer(text + "XYZ")                        # a superset: reused, ids are its ids
    task = build_task(cfg, bigger)
    assert task.tokenizer is bigger
    assert bigger.decode(windows(task.train).ravel()) == text[:task.train["inputs"].shape[0] * 11]
    lacking = CharTokenizer(set(text) - {"\u00e9", "."})
    with pytest.raises(DataError, match="outside the tokenizer's vocabulary"):
        build_task(cfg, lacking)


# ----------------------------------------------------------------------------- digit tasks

def _check_seq2seq(split, reverse, width, lo, hi):
    src, tin, tout = split["src"], split["tgt_in"], split["tgt_out"]
    assert src.shape == tin.shape == tout.shape and src.shape[1] == width
    strings = []
    for s, i, o in zip(src, tin, tout):
        n = int(np.argmax(s == EOS))
        assert s[n] == EOS and lo <= n <= hi
        digits = s[:n]
        assert ((digits >= 3) & (digits <= 12)).all()
        ans = digits[::-1] if reverse else digits
        np.testing.assert_array_equal(o[:n], ans)
        assert o[n] == EOS
        assert i[0] == BOS
        np.testing.assert_array_equal(i[1:n + 1], ans)
        for row in (s, i, o):
            assert (row[n + 1:] == PAD).all()
        strings.append(tuple(int(d) - 3 for d in digits))
    return strings


def test_reverse_task_layout_and_disjoint_sets():
    cfg = DataConfig(task="reverse", num_train=300, num_eval=60, min_len=2, max_len=5, seed=3)
    task = build_task(cfg)
    assert task.kind == "seq2seq" and isinstance(task.tokenizer, DigitTokenizer)
    tr = _check_seq2seq(task.train, True, 6, 2, 5)
    ev = _check_seq2seq(task.eval, True, 6, 2, 5)
    assert len(tr) == 300 and len(ev) == 60
    assert len(set(tr)) == 300 and len(set(ev)) == 60
    assert not set(tr) & set(ev)
    assert {len(s) for s in tr} == {2, 3, 4, 5}                  # the whole length range is used
    assert any(s != s[::-1] for s in tr)


def test_copy_task_target_equals_source():
    task = build_task(DataConfig(task="copy", num_train=50, num_eval=10, min_len=1, max_len=4))
    for split in (task.train, task.eval):
        _check_seq2seq(split, False, 5, 1, 4)
        n = (split["src"] != PAD).sum(1)
        np.testing.assert_array_equal(n, (split["tgt_out"] != PAD).sum(1))
        np.testing.assert_array_equal(split["tgt_out"], split["src"])


def test_digit_task_deterministic_in_seed():
    a = build_task(DataConfig(seed=7, num_train=100, num_eval=20))
    b = build_task(DataConfig(seed=7, num_train=100, num_eval=20))
    c = build_task(DataConfig(seed=8, num_train=100, num_eval=20))
    for k in ("src", "tgt_in", "tgt_out"):
        np.testing.assert_array_equal(a.train[k], b.train[k])
        np.testing.assert_array_equal(a.eval[k], b.eval[k])
    assert not np.array_equal(a.train["src"], c.train["src"])
    assert not np.array_equal(a.eval["src"], c.eval["src"])


def test_digit_task_train_short_test_long():
    cfg = DataConfig(task="reverse", num_train=200, num_eval=50, min_len=2, max_len=4, eval_min_len=6, eval_max_len=8)
    assert cfg.eval_lengths == (6, 8)
    task = build_task(cfg)
    tr = _check_seq2seq(task.train, True, 9, 2, 4)
    ev = _check_seq2seq(task.eval, True, 9, 6, 8)
    assert max(map(len, tr)) <= 4 and min(map(len, ev)) >= 6
    assert task.train["src"].shape[1] == task.eval["src"].shape[1] == 9
    # only the upper bound given: the other defaults to min_len
    task = build_task(DataConfig(num_train=20, num_eval=20, min_len=2, max_len=3, eval_max_len=7))
    _check_seq2seq(task.eval, True, 8, 2, 7)


def test_digit_task_too_many_distinct_strings():
    with pytest.raises(DataError, match="distinct"):
        build_task(DataConfig(num_train=101, num_eval=1, min_len=2, max_len=2))          # 100 exist
    with pytest.raises(DataError, match="distinct"):
        build_task(DataConfig(num_train=90, num_eval=11, min_len=2, max_len=2))          # 10 left for eval
    task = build_task(DataConfig(num_train=100, num_eval=10, min_len=1, max_len=2))      # 110 exist: all used
    assert len(set(map(tuple, task.train["src"])) | set(map(tuple, task.eval["src"]))) == 110


def test_digit_task_capacity_counts_only_excluded_strings_of_eval_lengths():
    # train on the 10 one-digit strings, evaluate on all 100 two-digit strings: 100 exist, none excluded
    task = build_task(DataConfig(num_train=10, num_eval=100, min_len=1, max_len=1, eval_min_len=2, eval_max_len=2))
    assert len(set(map(tuple, task.eval["src"]))) == 100


# ----------------------------------------------------------------------------- grain pipeline

def _batches(it, n):
    return [next(it) for _ in range(n)]


def test_train_dataset_state_round_trip():
    task = build_task(DataConfig(num_train=64, num_eval=8))
    ds = task.train_dataset(8, seed=5)
    it = iter(ds)
    first = _batches(it, 3)
    assert set(first[0]) == {"src", "tgt_in", "tgt_out", "src_segment_ids", "src_positions", "tgt_segment_ids",
                             "tgt_positions"} and first[0]["src"].shape == (8, 7)
    state = it.get_state()
    after = _batches(it, 2)
    fresh = iter(task.train_dataset(8, seed=5))
    fresh.set_state(state)
    resumed = _batches(fresh, 2)
    for a, b in zip(after, resumed):
        for k in a:
            assert np.array_equal(a[k], b[k])
    # and a fresh iterator from the start replays the first batches
    again = _batches(iter(ds), 3)
    assert all(np.array_equal(a["src"], b["src"]) for a, b in zip(first, again))
    other = _batches(iter(task.train_dataset(8, seed=6)), 3)
    assert not all(np.array_equal(a["src"], b["src"]) for a, b in zip(first, other))


def test_train_dataset_state_round_trip_lm(tmp_path):
    p, _ = _text_file(tmp_path, n=600)
    task = build_task(DataConfig(task="text", path=str(p), num_chars=None, block_size=8))
    it = iter(task.train_dataset(4, seed=0))
    _batches(it, 3)
    state = it.get_state()
    after = _batches(it, 2)
    fresh = iter(task.train_dataset(4, seed=0))
    fresh.set_state(state)
    for a, b in zip(after, _batches(fresh, 2)):
        assert a["inputs"].shape == (4, 8)
        assert np.array_equal(a["inputs"], b["inputs"]) and np.array_equal(a["targets"], b["targets"])


def test_train_dataset_reshuffles_each_epoch():
    task = build_task(DataConfig(num_train=16, num_eval=4, min_len=3, max_len=6))
    it = iter(task.train_dataset(4, seed=0))
    epochs = [np.concatenate([b["src"] for b in _batches(it, 4)]) for _ in range(3)]
    key = lambda a: sorted(map(tuple, a.tolist()))                       # noqa: E731
    for e in epochs:                                                     # each epoch: every example exactly once
        assert key(e) == key(task.train["src"])
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], task.train["src"])             # shuffled, not in file order


def test_train_dataset_batch_larger_than_data():
    task = build_task(DataConfig(num_train=10, num_eval=2))
    with pytest.raises(DataError, match="batch_size=11"):
        task.train_dataset(11, seed=0)
    assert next(iter(task.train_dataset(10, seed=0)))["src"].shape == (10, 7)


def test_eval_batches_cover_heldout_in_order():
    task = build_task(DataConfig(num_train=20, num_eval=23))
    bs = list(task.eval_batches(10))
    assert [len(b["src"]) for b in bs] == [10, 10, 3]
    np.testing.assert_array_equal(np.concatenate([b["tgt_out"] for b in bs]), task.eval["tgt_out"])


# ----------------------------------------------------------------------------- DataConfig validation

@pytest.mark.parametrize("kwargs,field", [
    (dict(task="sort"), "data.task"),
    (dict(batch_size=0), "data.batch_size"),
    (dict(batch_size=True), "data.batch_size"),
    (dict(block_size=-1), "data.block_size"),
    (dict(num_train=2.5), "data.num_train"),
    (dict(min_len=5, max_len=3), "data.min_len"),
    (dict(eval_min_len=9, eval_max_len=4), "data.eval_min_len"),
    (dict(eval_fraction=1.5), "data.eval_fraction"),
    (dict(eval_fraction=0.0), "data.eval_fraction"),
    (dict(task="text", path=""), "data.path"),
    (dict(task="text", path="x.txt", num_chars=0), "data.num_chars"),
    (dict(task="text", path="x.txt", start=-1), "data.start"),
])
def test_data_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        DataConfig(**kwargs)
    assert field in str(e.value)


def test_data_config_defaults_valid():
    cfg = DataConfig()
    assert cfg.eval_lengths == (cfg.min_len, cfg.max_len)
    DataConfig(task="text", path="any.txt", num_chars=None)


def test_data_config_rejects_zero_eval_min_len():
    with pytest.raises(ConfigError, match="eval_min_len"):
        DataConfig(eval_min_len=0)


@pytest.mark.slow          # default-lane budget
def test_each_process_reads_its_rows_of_the_same_global_batches():
    task = build_task(tiny_reverse().data)
    whole = iter(task.train_dataset(16, seed=3))
    parts = [iter(task.train_dataset(16, seed=3, rows=slice(i, i + 4))) for i in range(0, 16, 4)]
    for _ in range(10):                                   # across an epoch boundary (128 rows = 8 batches)
        full = next(whole)
        got = [next(p) for p in parts]
        for k in full:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), full[k])


def test_tokenizers_differ_by_what_their_ids_mean_not_by_their_size():
    """`tokenizer_difference` (what init_from checks): two character tokenizers of the same size over other
    characters differ, named by the first id that means another character; the same one does not."""
    from jaxformer.data.tokenizers import tokenizer_difference
    assert tokenizer_difference(CharTokenizer("abc"), CharTokenizer("cba")) is None       # the same sorted set
    why = tokenizer_difference(CharTokenizer("abc"), CharTokenizer("abd"))
    assert why is not None and "'c' there, 'd' here" in why
    assert "ids there" in tokenizer_difference(CharTokenizer("abc"), CharTokenizer("abcd"))
