"""Datasets as grain pipelines with checkpointable iterators.

seq2seq batches: src [B,S], tgt_in [B,T] (BOS + answer), tgt_out [B,T] (answer + EOS), pad 0; and what each
side attends by: src_segment_ids, src_positions [B,S], tgt_segment_ids, tgt_positions [B,T].
LM batches: inputs [B,T], targets [B,T] (inputs shifted by one), segment_ids and positions [B,T].

Segment ids (0 = padding, documents numbered from 1) and positions are made where the data is laid out, from the
lengths the data has (`attention_fields`): the model builds every mask from them alone, and pad_id only fills.
"""
from __future__ import annotations

import dataclasses
import hashlib

import grain
import numpy as np

from jaxformer.config import DataConfig
from jaxformer.data.text import load_text
from jaxformer.data.tokenizers import BOS, EOS, PAD, CharTokenizer, DataError, DigitTokenizer


@dataclasses.dataclass
class Task:
    """A dataset with its tokenizer: the training and held-out arrays, whole, in the batch layout of its kind
    (module docstring), served as batches by `train_dataset` (a grain pipeline) and `eval_batches`. Made by
    `build_task` from a `DataConfig`.

    Attributes:
      kind: "seq2seq" (src, tgt_in, tgt_out, each side's segment ids and positions) or "lm" (inputs, targets,
        segment_ids, positions).
      tokenizer: the tokenizer that wrote the ids (`DigitTokenizer`, `CharTokenizer`, ...).
      train: the training arrays by field, each [N, T] int32 (N examples).
      eval: the held-out arrays, the same fields.
      fingerprint: the sha256 of the text read (a corpus read by path; resuming checks it), None for generated
        data.

    Examples:
      >>> from jaxformer.config import DataConfig
      >>> from jaxformer.data import build_task
      >>> task = build_task(DataConfig(task="reverse", num_train=8, num_eval=4, batch_size=4))
      >>> task.kind, type(task.tokenizer).__name__, task.train["src"].shape, task.eval["src"].shape   # [N, T]
      ('seq2seq', 'DigitTokenizer', (8, 7), (4, 7))
      >>> task.tokenizer.decode(task.train["src"][0]), task.tokenizer.decode(task.train["tgt_out"][0])
      ('652300', '003256')
      >>> batch = next(iter(task.train_dataset(batch_size=4, seed=0)))      # infinite, reshuffled each epoch
      >>> batch["src"].shape, sorted(batch)
      ((4, 7), ['src', 'src_positions', 'src_segment_ids', 'tgt_in', 'tgt_out', 'tgt_positions',
                'tgt_segment_ids'])
      >>> [b["src"].shape for b in task.eval_batches(3)], [b["src"].shape for b in task.eval_batches(3, pad_id=0)]
      ([(3, 7), (1, 7)], [(3, 7), (3, 7)])
    """
    kind: str                      # "seq2seq" | "lm"
    tokenizer: object
    train: dict[str, np.ndarray]   # full training arrays, [num_examples, ...]
    eval: dict[str, np.ndarray]    # full held-out arrays
    fingerprint: str | None = None  # sha256 of the text read (a corpus read by path), None for generated data

    def train_dataset(self, batch_size: int, seed: int, rows: slice = slice(None)) -> grain.MapDataset:
        """Batches of the global batch_size, infinite, reshuffled every epoch, deterministic in `seed`; iter()
        of it has get_state/set_state. rows: the part of each global batch this process reads (its devices'
        rows, `Plan.local_rows`): indices are batched first, then only those rows are gathered, so every
        process sees the same global batches as a single process would, row for row."""
        n = len(next(iter(self.train.values())))
        if n < batch_size:
            raise DataError(f"only {n} training examples for data.batch_size={batch_size}")
        arrays = self.train
        return (grain.MapDataset.range(n).shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)
                .map(lambda idx: {k: v[idx[rows]] for k, v in arrays.items()}))

    def eval_batches(self, batch_size: int, pad_id: int | None = None):
        """The held-out set in order, in batches. The last one is smaller, or with pad_id, padded to batch_size
        with all-pad rows (no target token: they add nothing to any metric; one compiled shape)."""
        n = len(next(iter(self.eval.values())))
        for i in range(0, n, batch_size):
            b = {k: v[i:i + batch_size] for k, v in self.eval.items()}
            yield b if pad_id is None else pad_batch(b, batch_size, pad_id)


def pad_batch(batch: dict[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """A batch grown to `rows` rows with all-padding rows: tokens pad_id, segment ids and positions 0."""
    def fill(k, v):
        value = 0 if k.endswith(("segment_ids", "positions")) else pad_id
        return np.concatenate([v, np.full((rows - len(v), *v.shape[1:]), value, v.dtype)])
    return batch if len(next(iter(batch.values()))) >= rows else {k: fill(k, v) for k, v in batch.items()}


# ----------------------------------------------------------------------------- attention inputs

def positions_of(segment_ids: np.ndarray) -> np.ndarray:
    """Host twin of `ops.positions_from_segments` (its rule, in NumPy for the data pipeline): segment_ids [N,T]
    int (0 = padding) -> positions [N,T] int32, 0 at each document's first token; padding gets 0."""
    seg = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(seg.shape[1], dtype=np.int32), seg.shape)
    last = np.maximum.accumulate(np.where(seg != 0, idx, -1), axis=1)
    last = np.pad(last[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
    prev = np.where(last >= 0, np.take_along_axis(seg, np.maximum(last, 0), 1), -1)
    start = np.maximum.accumulate(np.where((seg != 0) & (seg != prev), idx, 0), axis=1)
    return np.where(seg != 0, idx - start, 0).astype(np.int32)


def attention_fields(segment_ids: np.ndarray, prefix: str = "") -> dict[str, np.ndarray]:
    """What a batch carries for attention: {prefix+"segment_ids", prefix+"positions"}, both [N,T] int32.

    The model builds every mask from these alone (module docstring): each token attends within its own
    document, and positions restart at 0 at each document's first token.

    Args:
      segment_ids: [N, T] int: the document of each token, numbered from 1 in each row; 0 on padding.
      prefix: put before both keys, e.g. "src_" and "tgt_" for the two sides of a seq2seq batch.

    Returns:
      {prefix + "segment_ids": the ids as int32, prefix + "positions": each token's position in its document
        (`positions_of`; 0 on padding)}, both [N, T] int32.

    Examples:
      >>> import numpy as np
      >>> from jaxformer.data import attention_fields
      >>> attention_fields(np.array([[1, 1, 2, 2, 2, 0]]))          # two documents packed in a row, then padding
      {'segment_ids': array([[1, 1, 2, 2, 2, 0]], dtype=int32),
       'positions': array([[0, 1, 0, 1, 2, 0]], dtype=int32)}
      >>> sorted(attention_fields(np.ones((2, 3)), prefix="src_"))
      ['src_positions', 'src_segment_ids']
    """
    seg = np.asarray(segment_ids, np.int32)
    return {f"{prefix}segment_ids": seg, f"{prefix}positions": positions_of(seg)}


def length_segments(lengths, width: int, left: bool = False) -> np.ndarray:
    """Row lengths [N] -> segment ids [N,width] int32: 1 on each row's tokens (its first `length` columns, or
    its last with left), 0 on the padding."""
    cols, n = np.arange(width), np.asarray(lengths)[:, None]
    return ((cols >= width - n) if left else (cols < n)).astype(np.int32)


def pad_rows(rows: list[np.ndarray], pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids -> (tokens, segment ids), each [B, longest] int32: the rows padded with pad_id on the left
    (LM prompts) or the right; segment id 1 on every row's tokens, 0 on its padding.

    Args:
      rows: B token id sequences (each [n] int, n >= 1), of any lengths.
      pad_id: the id that fills the padding (the tokenizer's; masks come from the segment ids, never from it).
      left: pad on the left (a batch of LM prompts, each ending at the last column) instead of the right.

    Returns:
      (tokens, segment_ids), each [B, T] int32 with T the longest row's length.

    Examples:
      >>> import numpy as np
      >>> from jaxformer.data import pad_rows
      >>> tokens, segment_ids = pad_rows([np.array([5, 6, 7]), np.array([8])], pad_id=0, left=True)
      >>> tokens
      array([[5, 6, 7],
             [0, 0, 8]], dtype=int32)
      >>> segment_ids
      array([[1, 1, 1],
             [0, 0, 1]], dtype=int32)
      >>> pad_rows([np.array([5, 6, 7]), np.array([8])], pad_id=0, left=False)[0]
      array([[5, 6, 7],
             [8, 0, 0]], dtype=int32)
    """
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        if left:
            out[i, width - len(r):] = r
        else:
            out[i, : len(r)] = r
    return out, length_segments([len(r) for r in rows], width, left)


# ----------------------------------------------------------------------------- digits (seed 004)

def _unique_digit_strings(rng: np.random.Generator, count: int, lo: int, hi: int, exclude: set) -> list[tuple]:
    capacity = sum(10 ** n for n in range(lo, hi + 1))
    if count > capacity - sum(lo <= len(s) <= hi for s in exclude):
        raise DataError(f"cannot draw {count} distinct digit strings of length {lo}..{hi} ({capacity} exist)")
    out, seen = [], set(exclude)
    while len(out) < count:
        n = int(rng.integers(lo, hi + 1))
        s = tuple(int(d) for d in rng.integers(0, 10, size=n))
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def encode_digit_pairs(strings: list[tuple], reverse: bool, width: int) -> dict[str, np.ndarray]:
    """Digit strings -> padded src (digits + EOS), tgt_in (BOS + answer), tgt_out (answer + EOS), each [N,width],
    with each side's segment ids and positions (`attention_fields`)."""
    tok = DigitTokenizer()
    src = np.full((len(strings), width), PAD, np.int32)
    tgt_in, tgt_out = src.copy(), src.copy()
    for i, s in enumerate(strings):
        x = tok.encode(s)
        y = x[::-1] if reverse else x
        src[i, : len(x) + 1] = np.append(x, EOS)
        tgt_in[i, : len(y) + 1] = np.append(BOS, y)
        tgt_out[i, : len(y) + 1] = np.append(y, EOS)
    seg = length_segments([len(s) + 1 for s in strings], width)                # digits + EOS; BOS + answer
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, **attention_fields(seg, "src_"),
            **attention_fields(seg, "tgt_")}


def digit_task(cfg: DataConfig) -> Task:
    rng = np.random.default_rng(cfg.seed)
    train = _unique_digit_strings(rng, cfg.num_train, cfg.min_len, cfg.max_len, set())
    lo, hi = cfg.eval_lengths
    held = _unique_digit_strings(rng, cfg.num_eval, lo, hi, set(train))
    width = max(cfg.max_len, hi) + 1
    rev = cfg.task == "reverse"
    return Task("seq2seq", DigitTokenizer(), encode_digit_pairs(train, rev, width), encode_digit_pairs(held, rev, width))


# ----------------------------------------------------------------------------- text (seed 000)

def lm_blocks(ids: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Non-overlapping windows of block_size+1 ids -> inputs/targets [n, block_size] (seed 000's layout), each
    window one document (segment ids 1, positions 0..block_size-1)."""
    n = len(ids) // (block_size + 1)
    w = ids[: n * (block_size + 1)].reshape(n, block_size + 1)
    return {"inputs": w[:, :-1], "targets": w[:, 1:], **attention_fields(np.ones((n, block_size), np.int32))}


def text_task(cfg: DataConfig, tokenizer: CharTokenizer | None = None) -> Task:
    text = load_text(cfg.path, gutenberg=cfg.gutenberg)
    end = None if cfg.num_chars is None else cfg.start + cfg.num_chars
    text = text[cfg.start:end]
    need = 2 * (cfg.block_size + 1)
    if len(text) < need:
        raise DataError(f"{cfg.path!r} gives {len(text)} characters after slicing; data.block_size="
                        f"{cfg.block_size} needs at least {need} (one training and one held-out block)")
    tok = tokenizer or CharTokenizer(text)
    ids = tok.encode(text)
    cut = len(ids) - max(int(round(len(ids) * cfg.eval_fraction)), cfg.block_size + 1)
    if cut < cfg.block_size + 1:
        raise DataError(f"data.eval_fraction={cfg.eval_fraction} leaves {cut} training characters, less than one "
                        f"block of data.block_size={cfg.block_size} (+1)")
    return Task("lm", tok, lm_blocks(ids[:cut], cfg.block_size), lm_blocks(ids[cut:], cfg.block_size),
                hashlib.sha256(text.encode("utf-8")).hexdigest())
