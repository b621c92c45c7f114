"""The executed tutorials (docs/tutorials/*.py, jupytext percent notebooks; their outputs are not committed): each
runs to its end as a script in its own process on the CPU, its assertions (parity with NumPy, cached decoding
equal to the full call) included. The first-principles one is cheap and runs in the default lane; the rest in the
slow lane, each one's wall time printed (pytest -s) for the docs' table.

Wrong implementations caught: a tutorial that rots when an API it shows moves (it stops running), a parity check
that stops holding, a tutorial page missing from the site.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT

TUTORIALS = sorted(p.stem for p in (ROOT / "docs" / "tutorials").glob("*.py"))
CHEAP = ("first_principles",)


def _run(name: str) -> float:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "tutorials" / f"{name}.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return time.perf_counter() - start


@pytest.mark.parametrize("name", [n if n in CHEAP else pytest.param(n, marks=pytest.mark.slow) for n in TUTORIALS])
def test_the_tutorial_runs_to_its_end(name):
    print(f"\n{name}: {_run(name):.0f} s")


def test_every_tutorial_is_a_percent_notebook_on_the_site():
    page = (ROOT / "docs" / "tutorials" / "index.md").read_text(encoding="utf-8")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert len(TUTORIALS) >= 5
    for name in TUTORIALS:
        text = (ROOT / "docs" / "tutorials" / f"{name}.py").read_text(encoding="utf-8")
        assert "formats: py:percent" in text and "# %% [markdown]" in text, name
        assert f"]({name}.py)" in page and f"tutorials/{name}.py" in nav, name
