"""Writing an export folder whole or not at all (`jaxformer.staging.staged`, worded for export-hf: "--out",
"export", raising HFError): everything goes to OUT.partial (marked as jaxformer's by a file `.jaxformer-partial`
in it), which is renamed to OUT once complete.

OUT must not exist or be an empty folder: a folder holding anything (a file a user put there, an earlier export)
is refused, naming what it holds, and nothing in it is ever replaced or removed; export to a new folder instead.
An interrupted or failed export leaves no OUT (a stop signal held by the command line is honoured before the
rename; an error removes OUT.partial); OUT.partial left behind by a killed process is removed by the next export
to OUT, because it is marked; an unmarked OUT.partial (not jaxformer's) is refused and left as it is. The export
writing OUT.partial holds a lock (flock) on its mark, so that a second export to OUT started meanwhile is refused
instead of taking the folder over (it would remove the first one's files while they are written).
"""
from __future__ import annotations

from pathlib import Path
from typing import ContextManager

from jaxformer import staging
from jaxformer.hf.families import HFError

MARK = staging.MARK


def check_free(out: str | Path) -> Path:
    """OUT as an absolute path when an export may be written there (absent, or an empty folder); HFError naming
    what it holds otherwise."""
    return staging.check_free(out, what="--out", noun="export", error=HFError)


def staged(out: str | Path, command: str = "export-hf") -> ContextManager[Path]:
    """Yield a fresh, marked OUT.partial to write an export into; when the block ends without an error, rename it
    to OUT (module docstring). HFError: OUT not free, an unmarked OUT.partial, OUT filled meanwhile.
    Interrupted: a stop signal arrived while writing (nothing is left at OUT)."""
    return staging.staged(out, command, what="--out", noun="export", error=HFError)
