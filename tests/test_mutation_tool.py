"""`make mutants` (tools/mutation.py): the score arithmetic, the committed table's consistency with its config, and
the config naming modules and test files that exist (the mutmut runs themselves take minutes to hours: not here)."""
from __future__ import annotations

import json
import sys
import tomllib

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import mutation  # noqa: E402


def test_equivalents_leave_the_denominator_and_unreached_mutants_are_survivors():
    status = {"jaxformer.m.x_f__mutmut_1": "killed", "jaxformer.m.x_f__mutmut_2": "survived",
              "jaxformer.m.x_f__mutmut_3": "timeout", "jaxformer.m.x_f__mutmut_4": "no tests",
              "jaxformer.m.x_f__mutmut_5": "survived"}
    row = mutation.score(status, {"x_f__mutmut_5": "why", "x_f__mutmut_9": "gone"}, 12.0)
    assert (row["mutants"], row["killed"], row["equivalent"]) == (5, 2, 1)
    assert row["survivors"] == ["x_f__mutmut_2", "x_f__mutmut_4"] and row["stale_equivalents"] == ["x_f__mutmut_9"]
    assert row["score"] == 2 / 4


def test_the_config_names_real_modules_and_tests_and_the_page_is_the_rendering_of_the_scores():
    config = tomllib.loads((ROOT / "tests" / "mutation.toml").read_text())
    for module, entry in config["modules"].items():
        assert (ROOT / module).is_file(), module
        assert entry["tests"] and all((ROOT / t).is_file() for t in entry["tests"]), module
    scores = json.loads((ROOT / "tests" / "mutation_scores.json").read_text())
    assert set(scores) <= set(config["modules"])
    assert (ROOT / "docs" / "mutation.md").read_text() == mutation.render(scores, config)
    for module, row in scores.items():                  # every row already counts the equivalents named since
        assert mutation.rescored(row, config["modules"][module].get("equivalent", {})) == row, module


def test_a_survivor_judged_equivalent_after_the_run_leaves_the_denominator():
    row = mutation.score({"x_f__mutmut_1": "killed", "x_f__mutmut_2": "survived", "x_f__mutmut_3": "survived"}, {},
                         1.0)
    again = mutation.rescored(row, {"x_f__mutmut_2": "why"})
    assert again["survivors"] == ["x_f__mutmut_3"] and again["equivalent"] == 1 and again["score"] == 0.5
    assert mutation._scope(["x_f", "x__g", "xǁBlockǁ__init__"]) == "f, _g, Block.__init__"


def test_a_judgment_follows_its_mutants_change_not_its_number():
    """mutmut numbers a function's mutants anew when it is edited: a reason written for one change must not
    excuse another that took its number; rewording the reason after a look accepts the new change."""
    status = {"jaxformer.m.x_f__mutmut_1": "killed", "jaxformer.m.x_f__mutmut_2": "survived"}
    first = mutation.score(status, {"x_f__mutmut_2": "why"}, 1.0, {"jaxformer.m.x_f__mutmut_2": "m - 1 -> m + 1"})
    assert first["judged"] == {"x_f__mutmut_2": ["why", "m - 1 -> m + 1"]} and first["score"] == 1.0
    same = mutation.score(status, {"x_f__mutmut_2": "why"}, 1.0, {"x_f__mutmut_2": "m - 1 -> m + 1"}, first["judged"])
    assert same["equivalent"] == 1 and same["survivors"] == []
    moved = mutation.score(status, {"x_f__mutmut_2": "why"}, 1.0, {"x_f__mutmut_2": "t < m -> t <= m"},
                           first["judged"])
    assert moved["survivors"] == moved["stale_equivalents"] == ["x_f__mutmut_2"] and moved["score"] == 0.5
    assert "another mutant now, re-judge" in "".join(mutation._listed(moved, {"x_f__mutmut_2": "why"}))
    again = mutation.rescored(moved, {"x_f__mutmut_2": "why, for t <= m"})
    assert again["survivors"] == [] and again["judged"]["x_f__mutmut_2"] == ["why, for t <= m", "t < m -> t <= m"]
    assert mutation._compact("--- a\n+++ a\n@@ -1 +1 @@\n-    y = f(x)  # a note\n+    y = g(x)  # a note\n") == \
        "y = f(x) -> y = g(x)"


def test_the_fork_servers_preload_is_the_tests_imports_then_the_fork_safety_check(tmp_path):
    """`_preload`: every module a listed test file imports, at any depth or through pytest.importorskip, once
    each, never a test-local module (helpers, conftest: pytest imports those itself), and last the module that
    stops the run if a preloaded one started JAX's runtime. Wrong implementations: top-level imports only (the
    lm-eval/torch imports inside tests re-imported per mutant), a test-local module preloaded from the wrong
    path, the check first (it would pass before anything ran)."""
    (tmp_path / "preload").mkdir()
    names = mutation._preload(tmp_path, ["tests/test_harness_parity.py"]).read_text().split()
    assert names[-1] == "_mutation_forksafe" and len(names) == len(set(names))
    assert {"numpy", "jaxformer.inference.tasks", "lm_eval.utils", "lm_eval.filters.extraction"} <= set(names)
    assert not {"helpers", "conftest", "__future__"} & {n.split(".")[0] for n in names}
    check = (tmp_path / "preload" / "_mutation_forksafe.py").read_text()
    assert "backends_are_initialized()" in check and "SystemExit" in check
