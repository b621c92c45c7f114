"""The documents of `jaxformer data prepare`'s inputs, read as a stream of pieces: one document per file, per
JSONL line ("text"), per paragraph or between separator lines (`--docs`), each cut into pieces of about a given
size after a newline, decoded as UTF-8 exactly as written; and the inputs' checks and checksums."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jaxformer.errors import DataError


@dataclass(frozen=True)
class Piece:
    doc: int            # document index over the whole corpus
    text: str
    last: bool          # the document's last piece


def rule_of(rule: str, path: Path) -> str:
    """The document rule `--docs rule` means for input `path` (auto: jsonl for *.jsonl, else file)."""
    if rule == "auto":
        return "jsonl" if path.suffix == ".jsonl" else "file"
    if rule in ("file", "jsonl", "blank-lines") or rule.startswith("separator="):
        return rule
    raise DataError(f"--docs {rule!r}: expected file, jsonl, blank-lines or separator=STR")


def _lines(path: Path) -> Iterator[str]:
    """The file's lines (keeping their newlines), decoded as UTF-8; DataError naming the file otherwise."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {n} is not UTF-8 ({e.reason} at byte {e.start})") from None


def _file_pieces(path: Path, rule: str, first_doc: int, piece: int | None) -> Iterator[Piece]:
    """The pieces of one input's documents (of about `piece` characters; None: whole documents), numbered from
    first_doc; every document's last piece has last=True."""
    if rule == "jsonl":
        doc = first_doc
        for n, line in enumerate(_lines(path), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}: line {n} is not a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise DataError(f"{path}: line {n}: \"text\" is {type(text).__name__}, not a string")
            if text:
                step = piece or len(text)
                for i in range(0, len(text), step):
                    yield Piece(doc, text[i:i + step], i + step >= len(text))
                doc += 1
        return
    sep = rule.removeprefix("separator=") if rule.startswith("separator=") else None
    doc, buf, size, open_doc = first_doc, [], 0, False
    for line in _lines(path):
        if (rule == "blank-lines" and not line.strip()) or (sep is not None and line.rstrip("\r\n") == sep):
            if open_doc or "".join(buf).strip():          # a boundary closes the document (if it has text)
                yield Piece(doc, "".join(buf), True)
                doc += 1
            buf, size, open_doc = [], 0, False
            continue
        buf.append(line)
        size += len(line)
        if piece is not None and size >= piece and line.endswith("\n"):
            yield Piece(doc, "".join(buf), False)
            buf, size, open_doc = [], 0, True
    if buf or open_doc:
        yield Piece(doc, "".join(buf), True)


def pieces(paths: list[Path], rule: str, piece: int | None) -> Iterator[Piece]:
    """Every document's pieces, in input order, documents numbered across the inputs. A document with no text
    (an empty file, two separators in a row) is skipped."""
    doc = 0
    for path in paths:
        for p in _file_pieces(path, rule_of(rule, path), doc, piece):
            yield p
            doc = p.doc + 1


def check_inputs(paths: list[Path]) -> None:
    """DataError unless every input is an existing regular file (and there is one)."""
    if not paths:
        raise DataError("no input files given")
    for p in paths:
        if not p.exists():
            raise DataError(f"input {str(p)!r} does not exist")
        if not p.is_file():
            raise DataError(f"input {str(p)!r} is not a regular file")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
