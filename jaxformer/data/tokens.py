"""The `tokens` task: a language model trained on prepared token shards (`jaxformer data prepare`).

Rows are windows of block_size + 1 tokens read from the memory-mapped shards (inputs = the first block_size,
targets = the last): an epoch is the split's non-overlapping windows in a seeded random order, shifted by a
seeded random offset in [0, block_size) that changes every epoch, so that every token in time starts a window.
`data.packing`:
  windows    the window as it is: attention crosses document boundaries (nanoGPT's layout);
  documents  the same tokens as packed documents: segment ids (1, 2, ... per document or piece of one in the
             row, counted from its end-of-document tokens) so that each token attends only within its own
             document, positions restarting at each document (the model derives them), and no target that lies
             in the next document.
The held-out pass reads the eval split once, in order, in windows of block_size (the last one padded): every
held-out token is a target exactly once (data.eval_tokens: only the first N, the same N every time). Deterministic in data.seed and train.seed; the iterator's state (a
position in the index stream) checkpoints and resumes exactly; each process gathers only its rows.
"""
from __future__ import annotations

import hashlib
import json

import grain
import numpy as np

from jaxformer.config import DataConfig
from jaxformer.data.shards import TokenShards
from jaxformer.data.tasks import Task, attention_fields, length_segments, pad_batch
from jaxformer.data.tokenizers import PAD
from jaxformer.errors import DataError


def packed(rows: np.ndarray, eod: int, lengths=None, ignore: int = PAD) -> dict[str, np.ndarray]:
    """Rows [B, T+1] of tokens -> {inputs, targets, segment_ids, positions} [B, T]: segment ids count documents
    from 1 (a new one after each end-of-document token), and a target in another document than its input, or
    in the padding, is `ignore` (the tokenizer's pad id: -1 for a pretrained one, whose 0 is a real token).
    lengths [B]: each row's real tokens (the rest is padding: segment 0); None = all real."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    seg = 1 + np.cumsum(np.concatenate([np.zeros_like(rows[:, :1]), (rows[:, :-1] == eod)], 1), 1, dtype=np.int32)
    if lengths is not None:
        seg = seg * length_segments(lengths, rows.shape[1])
    keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return {"inputs": inputs, "targets": np.where(keep, targets, ignore).astype(np.int32),
            **attention_fields(seg[:, :-1])}


def window_rows(rows: np.ndarray, lengths=None, ignore: int = PAD) -> dict[str, np.ndarray]:
    """Rows [B, T+1] of tokens -> {inputs, targets, segment_ids, positions} [B, T], each row one segment
    (attention crosses document boundaries); lengths and `ignore` as `packed`."""
    n = rows.shape[1] if lengths is None else lengths
    seg = length_segments(np.broadcast_to(n, rows.shape[:1]), rows.shape[1])
    targets = np.where(seg[:, 1:] != 0, rows[:, 1:], ignore).astype(np.int32)
    return {"inputs": rows[:, :-1], "targets": targets, **attention_fields(seg[:, :-1])}


class _EvalWindows:
    """The held-out split as [n, T] rows, read lazily: row i covers targets [i·T + 1, (i+1)·T + 1); the last
    row is padded."""

    def __init__(self, shards: TokenShards, block: int, field: str, eod: int, packing: str, limit: int | None):
        self.shards, self.block, self.field, self.eod, self.packing = shards, block, field, eod, packing
        self.ignore = shards.tokenizer.pad_id
        self.total = shards.tokens("eval") if limit is None else min(shards.tokens("eval"), limit + 1)
        self.n = -(-(self.total - 1) // block)

    def __len__(self) -> int:
        return self.n

    def rows(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        t = self.block
        out = np.full((hi - lo, t + 1), PAD, np.int32)
        lengths = np.zeros(hi - lo, np.int32)
        for r, i in enumerate(range(lo, hi)):
            w = self.shards.window("eval", i * t, min(t + 1, self.total - i * t))
            out[r, : len(w)], lengths[r] = w, len(w)
        if self.packing == "documents":
            return packed(out, self.eod, lengths, self.ignore)
        return window_rows(out, lengths, self.ignore)

    def __getitem__(self, idx):
        if not isinstance(idx, slice):
            raise TypeError("held-out windows are read by slices")
        lo, hi, _ = idx.indices(self.n)
        return self.rows(lo, max(lo, hi))[self.field]


class TokensTask(Task):
    """A Task over prepared shards (module docstring); `eval` holds lazy views, nothing is loaded up front."""

    def __init__(self, cfg: DataConfig, tokenizer=None):
        self.shards = TokenShards(cfg.path)
        tok = self.shards.tokenizer
        if tokenizer is not None and tokenizer.to_json() != tok.to_json():
            raise DataError(f"{cfg.path} was prepared with another tokenizer than this run's (a {tok.kind} "
                            f"tokenizer of {tok.vocab_size} ids; the run has {tokenizer.kind}, "
                            f"{tokenizer.vocab_size}): train in a new --workdir, or point data.path at the shards "
                            f"this run was trained on")
        self.block, self.packing, self.eod = cfg.block_size, cfg.packing, tok.eod_id
        n = self.shards.tokens("train")
        self.windows = (n - 1 - self.block) // self.block          # room for a shift of up to block - 1
        if self.windows < 1 or self.shards.tokens("eval") < 2:
            raise DataError(f"{cfg.path}: {n:,} training and {self.shards.tokens('eval'):,} held-out tokens are "
                            f"too few for data.block_size={self.block} (two windows of training tokens and two "
                            f"held-out tokens at least)")
        fields = ("inputs", "targets", "segment_ids", "positions")
        ev = {f: _EvalWindows(self.shards, self.block, f, self.eod, self.packing, cfg.eval_tokens) for f in fields}
        index = (self.shards.root / "index.json").read_bytes()
        super().__init__("lm", tok, {}, ev, hashlib.sha256(index).hexdigest())
        self.index = json.loads(index)

    def train_dataset(self, batch_size: int, seed: int, rows: slice = slice(None)) -> grain.MapDataset:
        """Batches of the global batch_size, infinite, deterministic in `seed`; this process gathers `rows`."""
        if self.windows < batch_size:
            raise DataError(f"only {self.windows} training windows of data.block_size={self.block} for "
                            f"data.batch_size={batch_size}")
        n, t, shards, eod, docs = self.windows, self.block, self.shards, self.eod, self.packing == "documents"
        ignore = self.tokenizer.pad_id

        def start(i, w):
            shift = int(np.random.default_rng([seed, i // n]).integers(t))   # one offset per epoch
            return w * t + shift

        def gather(starts):
            out = np.stack([shards.window("train", int(s), t + 1) for s in starts[rows]])
            return packed(out, eod, ignore=ignore) if docs else window_rows(out, ignore=ignore)
        return (grain.MapDataset.range(n).shuffle(seed=seed).repeat().map_with_index(start)
                .batch(batch_size, drop_remainder=True).map(gather))

    def eval_batches(self, batch_size: int, pad_id: int | None = None):
        """The held-out windows in order; the last batch padded to batch_size with all-pad rows."""
        first = next(iter(self.eval.values()))
        for lo in range(0, len(first), batch_size):
            b = first.rows(lo, min(lo + batch_size, len(first)))
            yield b if pad_id is None else pad_batch(b, batch_size, pad_id)
