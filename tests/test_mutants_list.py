"""The planted-bug list (tests/mutants.py) cannot rot silently: each mutant's snippet occurs exactly once in its
file (a refactor that moves the code fails here, in the default lane, not only when the mutants are run), its
replacement differs, and its killing tests exist."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mutants  # noqa: E402


def test_every_mutant_applies_to_exactly_one_place_and_names_existing_tests():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names)), "mutant names repeat"
    for m in mutants.MUTANTS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its snippet occurs {text.count(m.old)} times in {m.path}"
        assert m.new != m.old, m.name
        for t in m.tests:
            if t.startswith("tests/"):
                assert (ROOT / t.split("::")[0]).is_file(), f"{m.name}: {t} does not exist"
