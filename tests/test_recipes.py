"""docs/recipes.md runs: every ```python block of the page, in order, in one namespace shared by the whole page
(later recipes use names defined by earlier ones), each block its own test case named after its heading.

Selecting one case (`-k`) runs the blocks before it first; after a failing block the later ones are skipped,
naming it. A failure names the block's heading, and its traceback points at lines of docs/recipes.md.
The norm registry is restored afterwards (the page registers "scalenorm").
"""
from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

from jaxformer.ops import norms

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "recipes.md"


def python_blocks(text: str) -> list[tuple[str, int, str]]:
    """[(heading, first code line number (1-based), code)] for every ```python block, in order; heading is the
    nearest markdown heading above the block."""
    lines = text.splitlines()
    blocks, heading, i = [], "(no heading)", 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        elif line.strip().startswith("```"):
            lang = line.strip()[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{PAGE}: the code block opened at line {i + 1} is never closed")
            if lang == "python":
                blocks.append((heading, i + 2, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(PAGE.read_text(encoding="utf-8"))
_state = {"namespace": {"__name__": "recipes"}, "ran": 0, "failed": None}


@pytest.fixture(scope="module", autouse=True)
def _restore_norm_registry():
    saved = dict(norms.NORMS), dict(norms.NORM_BIAS)
    yield
    norms.NORMS.clear()
    norms.NORMS.update(saved[0])
    norms.NORM_BIAS.clear()
    norms.NORM_BIAS.update(saved[1])


def _run(index: int) -> None:
    heading, line, code = BLOCKS[index]
    # padded so that line numbers in tracebacks are those of docs/recipes.md
    compiled = compile("\n" * (line - 1) + code, str(PAGE), "exec")
    try:
        exec(compiled, _state["namespace"])
        return
    except Exception as e:
        _state["failed"] = heading
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(PAGE)]
        where = f" (docs/recipes.md line {frames[-1].lineno})" if frames else ""
        message = f"recipe {heading!r} failed{where}: {type(e).__name__}: {e}\n\n{traceback.format_exc()}"
    pytest.fail(message, pytrace=False)


@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.slow) if h.startswith(("7.", "8.")) else i
                                   for i, (h, _, _) in enumerate(BLOCKS)],
                         ids=[h for h, _, _ in BLOCKS])
# 7 (trains a model, then four instruments): ~8 s; 8 (an SAE on 7's model, which it runs first): ~12 s in all.
# The default lane keeps their behaviour in tests/test_interpret.py, test_patching.py, test_sae.py.
def test_recipe(index):
    while _state["ran"] <= index:          # earlier blocks first (they define names later ones use)
        if _state["failed"] is not None:
            pytest.skip(f"an earlier recipe failed: {_state['failed']!r}")
        i = _state["ran"]
        _state["ran"] += 1
        _run(i)


def test_page_has_the_recipes_and_is_linked():
    assert len(BLOCKS) >= 4
    assert all("assert" in code for _, _, code in BLOCKS), "every recipe checks what it claims"
    assert "docs/recipes.md" in (ROOT / "README.md").read_text(encoding="utf-8")
