"""Tokenizers: digits (reversal/copy tasks), characters (char-level LM), bytes, subword tokenizers of HF
`tokenizers` (byte-level BPE or unigram trained locally, `train_tokenizer`, which `jaxformer data prepare` calls;
or a `tokenizer.json`, `load_tokenizer_file`), and
SentencePiece models (a `.model` file; needs the `sentencepiece` package). Id 0 is padding, except for a
pretrained model's tokenizer (`pretrained_tokenizer`: no token is, pad_id = -1). Tokenizers of prepared token
shards also have an end-of-document id (`eod_id`)."""
from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxformer.errors import DataError

PAD, BOS, EOS = 0, 1, 2


class DigitTokenizer:
    """<pad>=0, <bos>=1, <eos>=2, digit d = 3 + d.

    The digit tasks' tokenizer (reverse, copy): `encode` takes a sequence of digits (ints 0-9), `decode` gives
    the digits as text, skipping the special ids.

    Attributes:
      kind: "digits", its name in a saved tokenizer.json (`save_tokenizer`).
      vocab_size: 13: three special ids and ten digits.
      pad_id: 0.
      bos_id: 1, the decoder's first input.
      eos_id: 2, the end of a source and of an answer.

    Examples:
      >>> from jaxformer.data import DigitTokenizer
      >>> tok = DigitTokenizer()
      >>> tok.encode([7, 1, 4])
      array([10,  4,  7], dtype=int32)
      >>> tok.decode([tok.bos_id, 10, 4, 7, tok.eos_id, tok.pad_id])
      '714'
      >>> tok.token_bytes()                       # [V]: the bytes of text each id stands for
      array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=int32)
    """
    kind = "digits"
    vocab_size = 13
    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def encode(self, digits) -> np.ndarray:
        return np.asarray(digits, dtype=np.int32) + 3

    def decode(self, ids) -> str:
        return "".join(str(int(i) - 3) if int(i) >= 3 else "" for i in ids)

    def token_bytes(self) -> np.ndarray:
        """[V] int32: the UTF-8 bytes of text each id stands for (0 for pad, BOS, EOS)."""
        return np.asarray([0, 0, 0] + [1] * 10, np.int32)

    def to_json(self) -> dict:
        return {"kind": self.kind}


class CharTokenizer:
    """Characters sorted by code point, ids from 1 (0 = <pad>); with eod, <eod> = the id after the last char.

    The character LM's tokenizer (data.task "text"): built from the characters of the text it will encode
    (any iterable of characters, e.g. the text itself).

    Attributes:
      kind: "char", its name in a saved tokenizer.json (`save_tokenizer`).
      chars: the distinct characters, sorted by code point: character chars[i] is id i + 1.
      stoi: character -> id.
      pad_id: 0.
      eod_id: the end-of-document id (len(chars) + 1), or None without eod.
      vocab_size: len(chars) + 1, plus one with eod.

    Raises:
      DataError: `encode` of text with characters outside `chars` (naming them).

    Examples:
      >>> from jaxformer.data import CharTokenizer
      >>> tok = CharTokenizer("hello world")
      >>> tok.chars, tok.vocab_size
      ([' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w'], 9)
      >>> ids = tok.encode("hello")
      >>> ids, tok.decode(ids)
      (array([4, 3, 5, 5, 6], dtype=int32), 'hello')
      >>> CharTokenizer("ab", eod=True).eod_id
      3
      >>> tok.encode("hex!")
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: 2 character(s) outside the tokenizer's vocabulary: '!x'
    """
    kind = "char"
    pad_id = PAD

    def __init__(self, chars, eod: bool = False):
        self.chars = sorted(set(chars))
        self.stoi = {c: i + 1 for i, c in enumerate(self.chars)}
        self.eod_id = len(self.chars) + 1 if eod else None

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1 + (self.eod_id is not None)

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise DataError(f"{len(unknown)} character(s) outside the tokenizer's vocabulary: "
                            f"{''.join(unknown)[:40]!r}")
        return np.fromiter((self.stoi[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i) - 1] for i in ids if 0 < int(i) <= len(self.chars))

    def token_bytes(self) -> np.ndarray:
        """[V] int32: each character's UTF-8 length (0 for pad and eod)."""
        return np.asarray([0] + [len(c.encode("utf-8")) for c in self.chars] + [0] * (self.eod_id is not None),
                          np.int32)

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": "".join(self.chars)} | ({"eod": True} if self.eod_id else {})


class ByteTokenizer:
    """UTF-8 bytes: <pad>=0, <eod>=1, byte b = 2 + b (vocabulary 258). Any text, exactly."""
    kind = "byte"
    vocab_size = 258
    pad_id, eod_id = PAD, 1

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 2

    def decode(self, ids) -> str:
        b = np.asarray(ids, np.int64)
        return (b[b >= 2] - 2).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.asarray([0, 0] + [1] * 256, np.int32)

    def to_json(self) -> dict:
        return {"kind": self.kind}


class HFTokenizer:
    """A HF `tokenizers.Tokenizer` with an end-of-document token (`eod_id`; a pretrained model's EOS). pad_id:
    <pad> = 0 for the tokenizers trained here, -1 (no token is padding) for a pretrained model's; bos_id: the
    token a pretrained model's prompts start with (None: none). Text never produces a special id: "<pad>" or
    "</s>" written in a document is encoded as the characters it is made of (`encode_special_tokens`)."""
    kind = "hf"

    def __init__(self, tok, eod_id: int, pad_id: int = PAD, bos_id: int | None = None):
        tok.encode_special_tokens = True            # not saved in tokenizer.json: set on every construction
        self.tok, self.pad_id, self.eod_id, self.bos_id = tok, pad_id, eod_id, bos_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    @contextlib.contextmanager
    def reading_special_tokens(self):
        """Inside: text that spells a special token ("<|im_start|>") is encoded as its id, as transformers
        tokenizes a rendered chat template; outside, as the characters it is made of."""
        self.tok.encode_special_tokens = False
        try:
            yield self
        finally:
            self.tok.encode_special_tokens = True

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        """[V] int32: the bytes of text each id stands for (0 for special tokens). Byte-level tokenizers spell
        each byte as one character of their alphabet, so a token's length is its byte count; others are
        measured by decoding the id alone."""
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        byte_level = '"ByteLevel"' in json.dumps(json.loads(self.tok.to_str()).get("pre_tokenizer"))
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            t = self.tok.id_to_token(i)
            if t is None or t in special:
                continue
            out[i] = len(t) if byte_level else len(self.tok.decode([i]).encode("utf-8"))
        return out

    def to_json(self) -> dict:
        ids = {"pad_id": self.pad_id} if self.pad_id != PAD else {}
        ids.update({"bos_id": self.bos_id} if self.bos_id is not None else {})
        return {"kind": self.kind, "eod_id": self.eod_id, **ids, "tokenizer": json.loads(self.tok.to_str())}


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise DataError("a SentencePiece model needs the sentencepiece package: pip install sentencepiece") from None
    return sentencepiece


class SentencePieceTokenizer:
    """A SentencePiece model, run by the `sentencepiece` package exactly as it was trained (its normaliser and
    dummy prefix included). Trained here: <pad>=0, <eod>=1, piece i = 2 + i (offset 2). A pretrained model's
    (`pretrained_tokenizer` of a folder with only tokenizer.model): piece i = id i (offset 0), no padding id
    (-1), its EOS ends a document and its BOS opens prompts (bos_id; None: none). Decoding gives the model's
    normalised text (the input itself when the model's normaliser is the identity)."""
    kind = "sentencepiece"

    def __init__(self, proto: bytes, *, offset: int = 2, eod_id: int = 1, pad_id: int = PAD,
                 bos_id: int | None = None):
        try:
            self.sp = _sentencepiece().SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, OSError, TypeError) as e:
            raise DataError(f"the SentencePiece model does not parse: {str(e)[:200]}") from None
        self.proto, self.offset, self.eod_id, self.pad_id, self.bos_id = proto, offset, eod_id, pad_id, bos_id
        self.vocab_size = self.sp.get_piece_size() + offset

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), np.int32) + self.offset

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(x, np.int32) + self.offset for x in self.sp.encode(texts)]

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) - self.offset for i in ids if self.offset <= int(i) < self.vocab_size])

    def token_bytes(self) -> np.ndarray:
        """[V] int32: the UTF-8 bytes of each piece, its "▁" read as a space (1 for byte pieces; 0 for pad,
        eod, control and unknown pieces). A document's dummy prefix counts as one byte."""
        sp, out = self.sp, np.zeros(self.vocab_size, np.int32)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                out[i + self.offset] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("▁", " ").encode("utf-8"))
        return out

    def to_json(self) -> dict:
        ids = {} if self.offset == 2 else {"offset": self.offset, "eod_id": self.eod_id, "pad_id": self.pad_id,
                                           "bos_id": self.bos_id}           # a pretrained model's ids
        return {"kind": self.kind, "model": base64.b64encode(self.proto).decode("ascii"), **ids}


def pretrained_tokenizer(path: str | Path) -> "HFTokenizer | SentencePieceTokenizer":
    """A pretrained model's folder (Hugging Face: config.json, tokenizer.json) -> its tokenizer as a run's: no
    token is padding (pad_id -1), the end of a document is the model's EOS (config.json's eos_token_id), and
    prompts start with its BOS when the tokenizer's own post-processor adds one (Llama's does, GPT-2's not).
    A folder with only a SentencePiece tokenizer.model (Llama 1/2, Mistral v0.1, Gemma as first published):
    that model with its own ids, the EOS and BOS of config.json (or the model's), BOS added unless
    tokenizer_config.json's add_bos_token is false (LlamaTokenizer's default)."""
    from tokenizers import Tokenizer
    path = Path(path)
    try:
        d = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}/config.json is unreadable: {type(e).__name__}: {e}") from None
    file = path / "tokenizer.json"
    if not file.is_file() and (path / "tokenizer.model").is_file():
        return _pretrained_sentencepiece(path, d)
    if not file.is_file():
        raise DataError(f"{str(path)!r} has neither tokenizer.json nor a SentencePiece tokenizer.model")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:                  # tokenizers raises a bare Exception with serde's message
        raise DataError(f"{file} does not parse: {str(e)[:300]}") from None
    first = lambda v: v[0] if isinstance(v, list) and v else v          # noqa: E731
    eos, bos = first(d.get("eos_token_id")), first(d.get("bos_token_id"))
    if eos is None:
        vocab = tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>") if t in vocab), None)
    if eos is None:
        raise DataError(f"{path}: no end-of-sequence token (config.json's eos_token_id, or </s>, <|endoftext|>)")
    probe = tok.encode("a", add_special_tokens=True).ids
    adds_bos = bos is not None and probe[:1] == [bos] and tok.encode("a", add_special_tokens=False).ids[:1] != [bos]
    return HFTokenizer(tok, int(eos), pad_id=-1, bos_id=int(bos) if adds_bos else None)


def _pretrained_sentencepiece(path: Path, config: dict) -> SentencePieceTokenizer:
    """`pretrained_tokenizer` of a folder whose tokenizer is tokenizer.model alone; config: its config.json."""
    proto = (path / "tokenizer.model").read_bytes()
    sp = SentencePieceTokenizer(proto, offset=0, eod_id=0, pad_id=-1).sp
    first = lambda v: v[0] if isinstance(v, list) and v else v          # noqa: E731
    eos, bos = first(config.get("eos_token_id")), first(config.get("bos_token_id"))
    eos = sp.eos_id() if eos is None else eos
    bos = sp.bos_id() if bos is None else bos
    if eos is None or eos < 0:
        raise DataError(f"{path}: no end-of-sequence token (config.json's eos_token_id, or the SentencePiece "
                        f"model's)")
    try:
        tc = json.loads((path / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        tc = {}
    adds_bos = tc.get("add_bos_token", True) is not False and bos is not None and bos >= 0
    return SentencePieceTokenizer(proto, offset=0, eod_id=int(eos), pad_id=-1,
                                  bos_id=int(bos) if adds_bos else None)


def tokenizer_from_json(d: dict):
    if isinstance(d, dict) and d.get("kind") == "digits":
        return DigitTokenizer()
    if isinstance(d, dict) and d.get("kind") == "char" and isinstance(d.get("chars"), str):
        return CharTokenizer(d["chars"], eod=bool(d.get("eod")))
    if isinstance(d, dict) and d.get("kind") == "byte":
        return ByteTokenizer()
    if isinstance(d, dict) and d.get("kind") == "hf" and isinstance(d.get("eod_id"), int):
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_str(json.dumps(d["tokenizer"]))
        except Exception as e:                    # tokenizers raises a bare Exception for a bad description
            raise DataError(f"the saved HF tokenizer does not parse: {str(e)[:200]}") from None
        return HFTokenizer(tok, d["eod_id"], int(d.get("pad_id", PAD)), d.get("bos_id"))
    if isinstance(d, dict) and d.get("kind") == "sentencepiece" and isinstance(d.get("model"), str):
        ids = {k: d[k] for k in ("offset", "eod_id", "pad_id", "bos_id") if k in d}
        return SentencePieceTokenizer(base64.b64decode(d["model"]), **ids)
    raise DataError(f"unknown tokenizer description {str(d)[:200]!r}")


def tokenizer_difference(a, b) -> str | None:
    """None when tokenizers `a` and `b` give every id the same meaning (same kind, same ids for the same text,
    the same special ids), else a sentence naming the first difference ("a" read as there, "b" as here)."""
    da, db = a.to_json(), b.to_json()
    if da == db:
        return None
    if da.get("kind") != db.get("kind"):
        return f"a {da.get('kind')} tokenizer there, a {db.get('kind')} tokenizer here"
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} ids there, {b.vocab_size} here"
    if da.get("kind") == "char":
        i = next(i for i, (x, y) in enumerate(zip(a.chars + [None], b.chars + [None])) if x != y)
        return f"id {i + 1} is {a.chars[i]!r} there, {b.chars[i]!r} here (the character sets differ)"
    key = next(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))
    if key == "model":
        return "another SentencePiece model (pieces or rules differ)"
    if key == "tokenizer":
        va, vb = a.tok.get_vocab(with_added_tokens=True), b.tok.get_vocab(with_added_tokens=True)
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
        return (f"token {diff[0][0]!r} (id {diff[0][1]}) is in one vocabulary only" if diff else
                "same vocabulary, different rules (normaliser, pre-tokenizer, merges or post-processor)")
    return f"{key} {da.get(key)!r} there, {db.get(key)!r} here"


def save_tokenizer(tok, path: Path) -> None:
    """Write a tokenizer as JSON (a run directory's tokenizer.json): its `to_json()` description, from which
    `load_tokenizer` rebuilds it.

    Args:
      tok: a tokenizer of this module (`DigitTokenizer`, `CharTokenizer`, `ByteTokenizer`, a subword or
        SentencePiece tokenizer).
      path: the file to write (replaced if it exists).

    Returns:
      None.

    Examples:
      >>> import os, tempfile
      >>> from jaxformer.data import CharTokenizer, save_tokenizer
      >>> path = os.path.join(tempfile.mkdtemp(), "tokenizer.json")
      >>> save_tokenizer(CharTokenizer("hello"), path)
      >>> open(path, encoding="utf-8").read()
      '{"kind": "char", "chars": "ehlo"}'
    """
    Path(path).write_text(json.dumps(tok.to_json(), ensure_ascii=False), encoding="utf-8")


def load_tokenizer(path: Path):
    """A tokenizer saved by save_tokenizer; DataError if the file is missing or unreadable.

    Args:
      path: the JSON file `save_tokenizer` wrote (a run directory's tokenizer.json).

    Returns:
      The tokenizer, giving every id the meaning the saved one gave it.

    Raises:
      DataError: the file is missing, unreadable or not JSON, or describes no tokenizer of this module.

    Examples:
      >>> import os, tempfile
      >>> from jaxformer.data import CharTokenizer, load_tokenizer, save_tokenizer
      >>> path = os.path.join(tempfile.mkdtemp(), "tokenizer.json")
      >>> save_tokenizer(CharTokenizer("hello", eod=True), path)
      >>> tok = load_tokenizer(path)
      >>> type(tok).__name__, tok.chars, tok.eod_id, tok.decode(tok.encode("hole"))
      ('CharTokenizer', ['e', 'h', 'l', 'o'], 5, 'hole')
      >>> load_tokenizer(path + ".missing")
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: tokenizer file '...missing' is unreadable: FileNotFoundError: ...
    """
    try:
        return tokenizer_from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"tokenizer file {str(path)!r} is unreadable: {type(e).__name__}: {e}") from None


SPECIALS = ("<pad>", "<eod>")      # ids 0 and 1 of the tokenizers trained here


def load_tokenizer_file(path: Path):
    """A Hugging Face checkpoint folder (`tokenizers.pretrained_tokenizer`: no padding id, its EOS ends each
    document), a SentencePiece model (PATH ending in .model), or a HF tokenizer.json; a tokenizer.json's <pad>
    must be id 0 (a file without "<pad>" at id 0 is refused) and its end-of-document token is "<eod>",
    "<|endoftext|>" or "</s>", whichever it has."""
    if path.is_dir():                   # a pretrained model's folder: its tokenizer.json and token ids
        return pretrained_tokenizer(path)
    if not path.is_file():
        raise DataError(f"--tokenizer {str(path)!r}: expected char, byte, bpe, unigram, or the path of a "
                        f"tokenizer.json, a SentencePiece .model or a Hugging Face checkpoint folder (no such file)")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path.read_bytes())
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:              # tokenizers raises a bare Exception with serde's message
        raise DataError(f"tokenizer file {str(path)!r} does not parse: {str(e)[:300]}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab.get("<pad>") != 0:
        raise DataError(f"tokenizer file {str(path)!r}: \"<pad>\" must be id 0 (it is "
                        f"{vocab.get('<pad>', 'absent')}); jaxformer pads with id 0")
    eod = next((vocab[t] for t in ("<eod>", "<|endoftext|>", "</s>") if t in vocab), None)
    if eod is None:
        raise DataError(f"tokenizer file {str(path)!r} has no end-of-document token (<eod>, <|endoftext|> or </s>)")
    return HFTokenizer(tok, eod)


def train_tokenizer(kind: str, texts: Iterator[str], vocab_size: int):
    """kind "bpe" or "unigram": a byte-level HF tokenizer trained on `texts` (a stream), ids 0/1 = <pad>/<eod>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    least = len(alphabet) + len(SPECIALS)

    if vocab_size < least + (1 if kind == "bpe" else 0):
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level {kind} tokenizer (at least "
                        f"{least + 1}: the {len(alphabet)} bytes, <pad>, <eod> and one merge)")
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                      initial_alphabet=alphabet, show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                          initial_alphabet=alphabet, show_progress=False)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    if (vocab.get("<pad>"), vocab.get("<eod>")) != (0, 1):
        raise DataError(f"the trained {kind} tokenizer did not put <pad>, <eod> at ids 0, 1")
    return HFTokenizer(tok, 1)
