"""Reading real text files: BOM, CRLF, and the Project Gutenberg header/footer; corpora shipped with the
package are named "builtin:NAME" (Alice in Wonderland, exactly as Project Gutenberg distributes it)."""
from __future__ import annotations

import re
from pathlib import Path

from jaxformer.errors import DataError

BUILTIN = {"alice": "alice_in_wonderland.txt"}   # name -> file in jaxformer/data/corpora/

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


def corpus_path(path: str | Path) -> Path:
    """A file path, or "builtin:NAME" for a corpus shipped inside the package (see BUILTIN)."""
    text = str(path)
    if not text.startswith("builtin:"):
        return Path(path)
    name = text.removeprefix("builtin:")
    if name not in BUILTIN:
        raise DataError(f"unknown built-in corpus {text!r}; available: {['builtin:' + n for n in BUILTIN]}")
    return Path(__file__).resolve().parent / "corpora" / BUILTIN[name]


def load_text(path: str | Path, *, gutenberg: bool = True) -> str:
    """Read UTF-8 text (a byte-order mark is dropped), normalise CRLF/CR to LF, optionally strip the Gutenberg
    boilerplate.

    Args:
      path: a file, or "builtin:NAME" for a corpus shipped with the package (`BUILTIN`: "builtin:alice").
      gutenberg: keep only what lies between Project Gutenberg's "*** START OF ..." and "*** END OF ..." lines,
        where the file has them.

    Returns:
      The text, with LF line ends.

    Raises:
      DataError: an unknown built-in corpus; a missing, empty, all-NUL or non-regular file (a directory, a
        FIFO); a file that is not UTF-8.

    Examples:
      >>> import os, tempfile
      >>> from jaxformer.data import load_text
      >>> load_text("builtin:alice")[:32]
      "ALICE'S ADVENTURES IN WONDERLAND"
      >>> path = os.path.join(tempfile.mkdtemp(), "notes.txt")
      >>> with open(path, "wb") as f:
      ...     _ = f.write(b"\\xef\\xbb\\xbfone\\r\\ntwo\\r\\n")          # a byte-order mark, Windows line ends
      >>> load_text(path)
      'one\\ntwo'
      >>> load_text(path + ".missing")
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: text file '...notes.txt.missing' does not exist
    """
    path = corpus_path(path)
    if not path.exists():
        raise DataError(f"text file {str(path)!r} does not exist")
    if path.is_dir():
        raise DataError(f"text file {str(path)!r} is a directory, not a text file")
    if not path.is_file():
        raise DataError(f"text file {str(path)!r} is not a regular file (a FIFO or device cannot be read twice)")
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
    if not text.replace("\x00", "").strip():
        raise DataError(f"text file {str(path)!r} holds only NUL bytes (a sparse or zeroed file), no text")
    return text
