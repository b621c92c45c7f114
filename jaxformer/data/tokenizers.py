"""Tokenizers: digits (reversal/copy tasks) and characters (char-level LM). Id 0 is always padding."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.errors import DataError

PAD, BOS, EOS = 0, 1, 2


class DigitTokenizer:
    """<pad>=0, <bos>=1, <eos>=2, digit d = 3 + d."""
    kind = "digits"
    vocab_size = 13
    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def encode(self, digits) -> np.ndarray:
        return np.asarray(digits, dtype=np.int32) + 3

    def decode(self, ids) -> str:
        return "".join(str(int(i) - 3) if int(i) >= 3 else "" for i in ids)

    def to_json(self) -> dict:
        return {"kind": self.kind}


class CharTokenizer:
    """Characters sorted by code point, ids from 1 (0 = <pad>)."""
    kind = "char"
    pad_id = PAD

    def __init__(self, chars):
        self.chars = sorted(set(chars))
        self.stoi = {c: i + 1 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise DataError(f"{len(unknown)} character(s) outside the tokenizer's vocabulary: "
                            f"{''.join(unknown)[:40]!r}")
        return np.fromiter((self.stoi[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i) - 1] for i in ids if 0 < int(i) <= len(self.chars))

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": "".join(self.chars)}


def tokenizer_from_json(d: dict):
    if isinstance(d, dict) and d.get("kind") == "digits":
        return DigitTokenizer()
    if isinstance(d, dict) and d.get("kind") == "char" and isinstance(d.get("chars"), str):
        return CharTokenizer(d["chars"])
    raise DataError(f"unknown tokenizer description {str(d)[:200]!r}")


def save_tokenizer(tok, path: Path) -> None:
    Path(path).write_text(json.dumps(tok.to_json(), ensure_ascii=False), encoding="utf-8")


def load_tokenizer(path: Path):
    """A tokenizer saved by save_tokenizer; DataError if the file is missing or unreadable."""
    try:
        return tokenizer_from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"tokenizer file {str(path)!r} is unreadable: {type(e).__name__}: {e}") from None
