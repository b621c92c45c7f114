"""Reading real text files: BOM, CRLF, and the Project Gutenberg header/footer."""
from __future__ import annotations

import re
from pathlib import Path

from jaxformer.data.tokenizers import DataError

_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Keep what lies between the '*** START OF ...' and '*** END OF ...' lines, if they exist."""
    m = _START.search(text)
    if m:
        text = text[m.end():]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    return text.strip("\n")


def load_text(path: str | Path, *, gutenberg: bool = True) -> str:
    """Read UTF-8 text (a byte-order mark is dropped), normalise CRLF/CR to LF, optionally strip the Gutenberg
    boilerplate. Raises DataError for a missing or empty file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file {str(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"text file {str(path)!r} is not UTF-8: {e}") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if gutenberg:
        text = strip_gutenberg(text)
    if not text.strip():
        raise DataError(f"text file {str(path)!r} is empty")
    return text
