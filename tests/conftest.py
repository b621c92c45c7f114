"""Shared fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real corpora: ../shared/data beside the project, or $JAXFORMER_DATA. Skips where absent."""
    d = Path(os.environ.get("JAXFORMER_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
    if not d.is_dir():
        pytest.skip(f"corpus folder {d} not found (set JAXFORMER_DATA to the folder holding the real text files)")
    return d
