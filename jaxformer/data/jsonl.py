"""JSON Lines files read one object a line, with errors that name the file and the line: the one reader of task
files (`inference.task_files`) and chat conversations (`data.sft`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from jaxformer.errors import DataError


def objects(path: str | Path, parse_float: Callable[[str], object] | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of `path`; DataError "PATH:LINE: ..." for a line that is not
    UTF-8, not JSON, or not a JSON object. parse_float: as json.loads's (e.g. to keep a number's text)."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{line}: not UTF-8") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text, parse_float=parse_float)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line}: not a JSON line ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{line}: not a JSON object: {text.strip()[:80]}")
            yield line, obj
