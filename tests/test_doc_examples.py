"""The API reference of jaxformer.ops teaches by example, and its examples are true: every docstring example of the
modules docs/api/ops.md renders runs as written (standard-library doctest, whitespace normalised, `...` matching
anything) and prints what it shows; and every public function or class of those modules has a Google-style
docstring with the sections the reference renders: `Args:` (a function with parameters), `Returns:` (a
function), `Attributes:` (a class: its fields) and `Examples:` (the title mkdocstrings' Google parser reads as
an examples section: under `Example:` it would render the doctest as prose).

Public: listed in the module's `__all__` where it has one, else not starting with "_", and defined in that module
(not imported into it). The examples use tiny arrays: the whole file runs in a few seconds.

The same two checks cover the modules docs/api/decode.md, patching.md and sae.md render (`LIBRARY`: decoding,
activation patching, sparse autoencoders), whose examples build the smallest model the package allows (D=16,
one or two layers, V=16) once per docstring: ~9 s together, so they run in the slow lane (their sections are
checked in the default lane).

Wrong implementations these catch: an example whose printed output no longer matches what the op returns (a
changed default, shape or dtype), an example that raises, and a new public op without arguments, return value or
example documented.
"""
from __future__ import annotations

import doctest
import importlib
import inspect
from pathlib import Path

import pytest

MODULES = ("attention", "masks", "positional", "norms", "activations", "flash", "fused", "context", "moe", "losses")
LIBRARY = ("jaxformer.decode", "jaxformer.patching", "jaxformer.sae")   # one docs/api page each
DOCUMENTED = tuple(f"jaxformer.ops.{m}" for m in MODULES) + LIBRARY
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
# the library's examples build and run tiny models (~9 s together): the slow lane; their sections: the default
SLOW = {name: pytest.mark.slow for name in LIBRARY}


def _public(mod) -> list[tuple[str, object]]:
    """The module's public functions and classes: its `__all__`, else its names not starting with "_", keeping
    those defined in the module itself."""
    names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
    objs = [(n, getattr(mod, n)) for n in names]
    return [(n, o) for n, o in objs if (inspect.isfunction(o) or inspect.isclass(o))
            and getattr(o, "__module__", None) == mod.__name__]


def test_the_modules_are_those_the_reference_renders():
    api = Path(__file__).resolve().parents[1] / "docs" / "api"
    page = (api / "ops.md").read_text(encoding="utf-8")
    assert [line.split(".")[-1] for line in page.splitlines() if line.startswith(":::")] == list(MODULES)
    for name in LIBRARY:
        page = (api / f"{name.split('.')[-1]}.md").read_text(encoding="utf-8")
        assert f"::: {name}" in page.splitlines(), f"docs/api/{name.split('.')[-1]}.md does not render {name}"


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_public_function_and_class_has_its_sections(name):
    mod = importlib.import_module(name)
    public = _public(mod)
    assert public, f"{name} has no public function or class"
    missing = []
    for attr, obj in public:
        doc = inspect.getdoc(obj) or ""
        need = ["Examples:"]
        if inspect.isclass(obj):
            need.append("Attributes:")
        else:
            need.append("Returns:")
            if inspect.signature(obj).parameters:
                need.append("Args:")
        missing += [f"{attr}: no {section}" for section in need if f"\n{section}\n" not in f"\n{doc}\n"]
    assert not missing, f"{name}: " + "; ".join(missing)


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW.get(n, ())) for n in DOCUMENTED])
def test_the_docstring_examples_run_as_written(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    tests = [t for t in doctest.DocTestFinder().find(importlib.import_module(name)) if t.examples]
    assert tests, f"{name} has no docstring examples"
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.summarize(verbose=False).failed == 0, "".join(report)
