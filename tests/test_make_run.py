"""benchmarks/make_run.py --against REV: this tree's `make run` against commit REV's, in alternating rounds. The
comparison must pair each round's two runs, take the ratio this / REV, and start REV's tree through its own
entry point; the README sentence is rendered from what it wrote.

Wrong implementations caught: a ratio inverted (REV / this); rounds dropped per side before pairing (a failed run
on one side then pairs round i with round i+1); an unpaired (Welch) interval, which calls a constant 10% gain
"not resolved"; REV started through this tree's entry point or package; a worktree left behind.
"""
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import make_run  # noqa: E402
import readme_tables  # noqa: E402


def _run(wall, steps, first=5.0):
    return {"wall": wall, "steps": steps, "first_step": first}


def test_compare_pairs_rounds_and_gives_this_over_rev():
    mine = [_run(40, 20), {"error": "boom"}, _run(45, 22), _run(50, 24)]
    rev = [_run(44, 25), _run(99, 99), _run(49.5, 27.5), _run(55, 30)]
    c = make_run.compare("HEAD", mine, rev)
    ph = c["phases"]
    assert ph["wall"]["pairs"] == 3
    assert ph["wall"]["ratio"] == pytest.approx(1 / 1.1)        # every kept round: this 10% under REV's wall
    assert ph["wall"]["lo"] == pytest.approx(1 / 1.1) and ph["wall"]["verdict"].startswith("faster")
    assert ph["steps"]["ratio"] < 0.85 and ph["first_step"]["ratio"] == pytest.approx(1.0)
    assert ph["wall"]["this"] == 45 and ph["wall"]["rev"] == 49.5
    assert c["commit"] and c["subject"]


def test_compare_needs_two_complete_rounds():
    assert make_run.compare("HEAD", [_run(1, 1), {"error": "x"}], [_run(1, 1), _run(1, 1)]) is None


def test_another_tree_starts_through_its_own_entry_point(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\njaxformer = "old.cli:main"\n')
    cmd = make_run.entry(tmp_path)
    assert cmd[0] == sys.executable and "from old.cli import main" in cmd[-1]
    assert make_run.entry(make_run.ROOT)[0].endswith("/jaxformer")


def test_another_trees_run_imports_that_trees_package(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\njaxformer = "old.cli:main"\n')
    seen = {}

    def fake(cmd, cwd=None, env=None, **kw):
        seen.update(cmd=cmd, cwd=cwd, env=env)
        return subprocess.CompletedProcess(cmd, 1, "", "SomeError: named\n")
    monkeypatch.setattr(make_run.subprocess, "run", fake)
    assert make_run.one_run("configs/reverse.py", tmp_path) == {"error": "SomeError: named"}
    assert seen["cwd"] == tmp_path and seen["env"]["PYTHONPATH"] == str(tmp_path)
    assert seen["cmd"][3:5] == ["train", "configs/reverse.py"]
    make_run.one_run("configs/reverse.py")
    assert seen["cwd"] == make_run.ROOT and seen["env"] is None       # this tree: exactly what `make run` runs


def test_the_worktree_is_rev_and_is_removed():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if not head:
        pytest.skip("not a git checkout")
    with make_run.worktree("HEAD") as tree:
        assert subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout == head
        assert (tree / "pyproject.toml").exists()
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed


def test_the_readme_sentence_follows_the_comparison():
    assert readme_tables._against({"stats": {}}) == ""
    r = {"ratio": 0.9, "lo": 0.83, "hi": 0.97, "pairs": 6, "verdict": "faster by more than 2%"}
    run = {"against": {"commit": "abc1234", "phases": {"wall": r, "steps": {**r, "ratio": 0.8},
                                                       "first_step": {**r, "verdict": "not resolved"}}}}
    text = readme_tables._against(run)
    assert "abc1234" in text and "wall 0.90× [0.83, 0.97], faster" in text and "steps 0.80×" in text
    assert "not resolved (6 pairs" in text and "before the speed levers" not in text
