"""`jaxformer data prepare`: text files -> a tokenizer and token shards with a JSON index, streamed.

    jaxformer data prepare INPUT... --tokenizer char|byte|bpe|unigram|PATH [--vocab-size N] --out DIR

Documents: each input file is one document (`--docs file`), each line of a JSONL file one document (its "text"
field; the default for *.jsonl), paragraphs between blank lines (`--docs blank-lines`), or the pieces between
lines equal to a separator (`--docs separator=STR`). Text is read as UTF-8 exactly as it is (no newline or BOM
normalisation), so decoding a document's tokens gives its bytes back. Every document ends with the tokenizer's
end-of-document token.

Three streaming passes over the inputs, never the whole corpus in memory (documents are read in pieces of about
64 KiB, cut after a newline): (1) count documents and bytes, and choose the held-out split, the last documents
holding `--eval-fraction` of the bytes (a corpus of one document is cut in two at the newline nearest the cut);
(2) train the tokenizer (HF `tokenizers`: byte-level BPE, or unigram over the same 256-byte alphabet, so that any
text encodes; `char` collects the corpus's characters; `byte` needs no training; PATH loads a `tokenizer.json`, a
SentencePiece `.model`, or a Hugging Face checkpoint folder's tokenizer) on the training split only; (3) encode
and append to shards of at most `--shard-tokens` tokens, uint16 when the vocabulary fits, else uint32. A loaded
tokenizer that marks the start of its input (SentencePiece's dummy prefix, a normaliser that trims) would mark
every piece: it encodes whole documents instead. Reading the inputs' documents: `jaxformer.data.documents`.
The output is written to DIR.partial and renamed to DIR when complete: an interrupted run leaves no DIR (the next
run starts afresh), and a finished DIR is never overwritten. DIR.partial is marked as jaxformer's (a file
`.jaxformer-partial` in it): only a marked DIR.partial is ever removed; any other DIR.partial is refused.

DIR/index.json: format, the tokenizer (file + sha256), the dtype, the inputs (path, bytes, sha256), the document
rule, and per split its token, document and text-byte counts, its shards (file, tokens, sha256) and its
documents' token offsets (SPLIT_docs.npy: int64 [documents + 1]).
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxformer.data.documents import Piece, check_inputs, pieces, rule_of, sha256_file
from jaxformer.data.tokenizers import (ByteTokenizer, CharTokenizer, HFTokenizer, SentencePieceTokenizer,
                                      load_tokenizer_file, save_tokenizer, train_tokenizer)
from jaxformer.errors import DataError, Interrupted
from jaxformer.signals import pending

FORMAT = "jaxformer-tokens/1"
PIECE = 1 << 16                    # bytes of text per piece read (cut after a newline when there is one)
SPLITS = ("train", "eval")
MAX_VOCAB = 1 << 24               # --vocab-size: tokenizers trains 2^24 on any corpus; 10^9 aborts the process
MARK = ".jaxformer-partial"        # in OUT.partial: this folder is prepare's unfinished output, free to remove


def _marks_start(tok) -> bool:
    """Whether a loaded tokenizer marks the start of what it encodes (a dummy prefix, a normaliser that trims):
    then the pieces of a document cannot be encoded apart, and documents are read whole (memory: the largest)."""
    if not isinstance(tok, (HFTokenizer, SentencePieceTokenizer)):
        return False
    return tok.decode(np.concatenate([tok.encode("a\n"), tok.encode("b\n")])) != "a\nb\n"


class _Writer:
    """One split's shards: appends tokens, rolls a shard at `limit` tokens, hashes as it writes."""

    def __init__(self, root: Path, split: str, dtype, limit: int):
        self.root, self.split, self.dtype, self.limit = root, split, dtype, limit
        self.shards, self.docs, self.tokens, self.text_bytes = [], array.array("q", [0]), 0, 0
        self._f = self._h = None
        self._n = 0

    def _open(self):
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0, "sha256": None})
        self._f, self._h, self._n = open(self.root / name, "wb"), hashlib.sha256(), 0

    def _close(self):
        if self._f is not None:
            self._f.close()
            self.shards[-1].update(tokens=self._n, sha256=self._h.hexdigest())
            self._f = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype)
        while len(ids):
            if self._f is None or self._n >= self.limit:
                self._close()
                self._open()
            part, ids = ids[: self.limit - self._n], ids[self.limit - self._n:]
            data = part.tobytes()
            self._f.write(data)
            self._h.update(data)
            self._n += len(part)
            self.tokens += len(part)

    def end_document(self) -> None:
        self.docs.append(self.tokens)

    def finish(self) -> dict:
        self._close()
        np.save(self.root / f"{self.split}_docs.npy", np.asarray(self.docs, np.int64))
        return {"tokens": self.tokens, "documents": len(self.docs) - 1, "text_bytes": self.text_bytes,
                "shards": self.shards, "documents_file": f"{self.split}_docs.npy"}


def _progress(total: int, label: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not enabled, file=sys.stderr,
                leave=False)


def _stop_if_asked(kept: str) -> None:
    """Between pieces: Interrupted once the command line held a stop signal (signals.pending)."""
    if pending():
        raise Interrupted(f"data prepare stopped on {pending()}: {kept}", pending())


def prepare(inputs: list[str | Path], out: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 2048,
            docs: str = "auto", eval_fraction: float = 0.1, shard_tokens: int = 1 << 27, dtype: str = "auto",
            progress: bool = True) -> dict:
    """Prepare token shards (module docstring) -> the index written to OUT/index.json."""
    paths, out = [Path(p) for p in inputs], Path(out)
    _check_request(paths, out, tokenizer, vocab_size, docs, eval_fraction, shard_tokens)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        if not (tmp / MARK).is_file():
            raise DataError(f"{tmp} exists and was not made by jaxformer data prepare (no {MARK} in it); it is "
                            f"left as it is: move it away or choose another --out")
        shutil.rmtree(tmp)              # an interrupted earlier run: start afresh
    t0 = time.perf_counter()
    total = sum(p.stat().st_size for p in paths)
    split = _Split(paths, docs, _document_sizes(paths, docs, total, progress), eval_fraction)     # pass 1
    tok = _make_tokenizer(tokenizer, paths, docs, split, vocab_size)                             # pass 2
    dtype = _shard_dtype(dtype, tok)
    try:                                                                                          # pass 3
        tmp.mkdir(parents=True)
    except FileExistsError:             # made by someone else since the start: never removed
        raise DataError(f"{tmp} appeared while the corpus was read; it is left as it is: choose another "
                        f"--out") from None
    (tmp / MARK).write_text("unfinished output of jaxformer data prepare; removed by the next run\n")
    try:
        splits = _encode(tok, split, tmp, dtype, shard_tokens, total, progress)
        for s, info in splits.items():
            if info["tokens"] == 0:
                raise DataError(f"the {s} split is empty: the corpus is too small for --eval-fraction {eval_fraction}")
    except DataError:
        shutil.rmtree(tmp)              # nothing of a refused corpus is kept
        raise
    save_tokenizer(tok, tmp / "tokenizer.json")
    index = {
        "format": FORMAT,
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "eod_id": tok.eod_id,
                      "file": "tokenizer.json", "sha256": sha256_file(tmp / "tokenizer.json"), "requested": tokenizer},
        "dtype": dtype,
        "documents": docs,
        "eval_fraction": eval_fraction,
        "inputs": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths],
        "splits": splits,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (tmp / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False), encoding="utf-8")
    (tmp / MARK).unlink()
    os.replace(tmp, out)
    return index


def _check_request(paths, out: Path, tokenizer: str, vocab_size: int, docs: str, eval_fraction: float,
                   shard_tokens: int) -> None:
    """Every argument and the output folder, checked before any pass over the corpus."""
    check_inputs(paths)
    if not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction {eval_fraction}: must be in (0, 1)")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be positive")
    if tokenizer in ("bpe", "unigram") and vocab_size > MAX_VOCAB:
        raise DataError(f"--vocab-size {vocab_size:,} is too large: at most {MAX_VOCAB:,} (2^24; the tokenizers "
                        f"library allocates for the size asked, and aborts the process far above it)")
    for p in paths:
        rule_of(docs, p)
    if (out / "index.json").exists():
        raise DataError(f"{out} already holds prepared shards (index.json); choose another --out or delete it")
    if out.exists():
        raise DataError(f"--out {out} exists and is not a finished output; choose another --out or delete it")


def _document_sizes(paths, docs: str, total: int, progress: bool) -> array.array:
    """Pass 1: bytes per document (documents are numbered 0, 1, ... in order)."""
    sizes = array.array("q")
    bar = _progress(total, "counting", progress)
    for p in pieces(paths, docs, PIECE):
        _stop_if_asked("nothing was written")
        n = len(p.text.encode("utf-8"))
        if p.doc == len(sizes):
            sizes.append(0)
        sizes[p.doc] += n
        bar.update(n)
    bar.close()
    if sum(sizes) == 0:
        raise DataError(f"the inputs hold no text ({', '.join(map(str, paths))[:300]})")
    return sizes


class _Split:
    """The held-out split: the last documents holding eval_fraction of the bytes; one document is cut at the
    newline nearest that fraction (`assigned`)."""

    def __init__(self, paths, docs: str, sizes: array.array, eval_fraction: float):
        self.paths, self.docs = paths, docs
        self.cut_bytes = (1 - eval_fraction) * sum(sizes)
        self.first_eval = None
        if len(sizes) > 1:
            before = np.cumsum(np.asarray(sizes)) - np.asarray(sizes)        # bytes before each document
            self.first_eval = int(np.clip(np.searchsorted(before, self.cut_bytes), 1, len(sizes) - 1))

    def assigned(self, piece: int | None) -> Iterator[tuple[Piece, str]]:
        """(piece, split) for every piece. One document: its training part ends at the newline nearest the
        cut (that piece is split in two; the training part becomes a document of its own)."""
        seen, cut, cut_bytes = 0, False, self.cut_bytes
        for p in pieces(self.paths, self.docs, piece):
            if self.first_eval is not None:
                yield p, ("eval" if p.doc >= self.first_eval else "train")
                continue
            n = len(p.text.encode("utf-8"))
            if cut or seen + n < cut_bytes:
                seen += n
                yield p, ("eval" if cut else "train")
                continue
            cut = True
            at = int((cut_bytes - seen) / max(n, 1) * len(p.text))         # about the cut, in characters
            ends = [i + 1 for i in (p.text.rfind("\n", 0, at), p.text.find("\n", at))
                    if 0 <= i < len(p.text) - 1]                            # after a newline, inside the piece
            at = min(ends, key=lambda e: abs(e - at)) if ends else max(1, min(at, len(p.text) - 1))
            yield Piece(p.doc, p.text[:at], True), "train"
            if at < len(p.text) or not p.last:
                yield Piece(p.doc, p.text[at:], p.last), "eval"
            seen += n


def _make_tokenizer(tokenizer: str, paths, docs: str, split: _Split, vocab_size: int):
    """Pass 2: the tokenizer: byte, char (every character of the corpus), bpe/unigram trained on the training
    split, or read from a file."""
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer == "char":
        chars = set()
        for p in pieces(paths, docs, PIECE):
            chars.update(p.text)
        return CharTokenizer(chars, eod=True)
    if tokenizer in ("bpe", "unigram"):
        return train_tokenizer(tokenizer, (p.text for p, s in split.assigned(PIECE) if s == "train" and p.text),
                               vocab_size)
    return load_tokenizer_file(Path(tokenizer))


def _shard_dtype(dtype: str, tok) -> str:
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"--dtype {dtype!r}: expected auto, uint16 or uint32")
    if dtype == "uint16" and tok.vocab_size > 1 << 16:
        raise DataError(f"the tokenizer's vocabulary of {tok.vocab_size:,} ids does not fit uint16 shards "
                        f"(65,536 at most): use --dtype uint32 (or auto)")
    return dtype


def _encode(tok, split: _Split, tmp: Path, dtype: str, shard_tokens: int, total: int, progress: bool) -> dict:
    """Pass 3: every piece encoded into its split's shards in `tmp`, in batches. -> {split: shard info}."""
    writers = {s: _Writer(tmp, s, np.dtype(dtype), shard_tokens) for s in SPLITS}
    bar = _progress(total, "encoding", progress)
    batch: list[tuple[Piece, str]] = []

    def drain():
        texts = [p.text for p, _ in batch]
        ids = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in texts]
        for (p, s), x in zip(batch, ids):
            w = writers[s]
            w.write(x)
            w.text_bytes += len(p.text.encode("utf-8"))
            if p.last:
                w.write(np.asarray([tok.eod_id]))
                w.end_document()
        batch.clear()

    for p, s in split.assigned(None if _marks_start(tok) else PIECE):
        _stop_if_asked(f"{tmp} is left for the next run to clear")
        batch.append((p, s))
        bar.update(len(p.text.encode("utf-8")))
        if len(batch) >= 64:
            drain()
    drain()
    bar.close()
    return {s: w.finish() for s, w in writers.items()}
