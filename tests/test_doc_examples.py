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

And the packages docs/api/hf.md, inference.md, data.md and train.md render (`PAGES`): each page renders, module
by module (`members:`), the public API of its package, the names its `__init__` exports (`__all__`;
jaxformer.train exports none: its entry points the guides and tutorials import), each object on one page only
(inference's re-export of pad_rows is documented under data; data's DataError is defined in jaxformer.errors).
A public object is then one of those names. The examples that build a model, write a checkpoint folder or
train a run (hf.checkpoint, inference, train) run in the slow lane; the data and config-only ones (data,
hf.expressing, hf.families) in the default lane.

The same for jaxformer.nn (`NN`: every module docs/api/nn.md renders; the examples that build modules or models
run in the slow lane, ~40 s together), the helpers page's parallel, memory, compile_cache and interpret
(`HELPERS`; interpret's examples build models: slow lane) and the config page's dataclasses (`CONFIG`).

Wrong implementations these catch: an example whose printed output no longer matches what the op returns (a
changed default, shape or dtype), an example that raises, and a new public op without arguments, return value or
example documented.
"""
from __future__ import annotations

import doctest
import importlib
import inspect
import re
from pathlib import Path

import pytest

MODULES = ("attention", "masks", "positional", "norms", "activations", "flash", "fused", "context", "moe", "losses",
           "sparse")
LIBRARY = ("jaxformer.decode", "jaxformer.patching", "jaxformer.sae")
HELPERS = ("jaxformer.compile_cache", "jaxformer.parallel", "jaxformer.memory", "jaxformer.interpret")  # helpers.md
CONFIG = tuple(f"jaxformer.config.{m}" for m in ("model", "sections", "run", "parallel"))     # docs/api/config.md
# docs/api/nn.md: every module it renders (`test_the_modules_are_those_the_reference_renders`)
NN = tuple(f"jaxformer.nn.{m}" for m in ("build", "models", "embed", "layers", "attention", "stack", "pipeline",
                                         "ring", "cache", "layout", "weights", "sites", "per_layer", "lora",
                                         "differential"))
# docs/api/<page>.md: {module: the public names it renders}, the package's API (module docstring)
PAGES = {
    "hf": {"jaxformer.hf.checkpoint": ("read_config", "from_pretrained", "save_pretrained"),
           "jaxformer.hf.expressing": ("family_for", "to_hf_config"),
           "jaxformer.hf.families": ("HFError", "FAMILIES", "to_model_config")},
    "inference": {"jaxformer.inference.restore": ("LoadedModel", "abstract_model", "load_model"),
                  "jaxformer.inference.evaluate": ("make_eval_step", "evaluate", "examples", "evaluate_run"),
                  "jaxformer.inference.generate": ("prompt_ids", "default_prompts", "generate_text")},
    "data": {"jaxformer.data.tasks": ("Task", "attention_fields", "pad_rows"),
             "jaxformer.data.build": ("build_task", "resolve"),
             "jaxformer.data.text": ("load_text",),
             "jaxformer.data.tokenizers": ("DigitTokenizer", "CharTokenizer", "save_tokenizer", "load_tokenizer"),
             "jaxformer.errors": ("DataError",)},
    "train": {"jaxformer.train.loop": ("train",),
              "jaxformer.train.optim": ("schedule", "optimizer"),
              "jaxformer.train.step": ("Graphs", "abstract_state", "init_state", "make_train_step")},
}
PUBLIC = {module: names for page in PAGES.values() for module, names in page.items()}
DOCUMENTED = tuple(f"jaxformer.ops.{m}" for m in MODULES) + LIBRARY + tuple(PUBLIC) + HELPERS + NN + CONFIG
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
# the library's examples build and run tiny models (~9 s together), the packages' build models, write checkpoint
# folders and train runs: the slow lane; their sections: the default
SLOW = {name: pytest.mark.slow for name in LIBRARY + ("jaxformer.hf.checkpoint", "jaxformer.inference.restore",
                                                      "jaxformer.inference.evaluate", "jaxformer.inference.generate",
                                                      "jaxformer.train.loop", "jaxformer.train.step")
        # nn's examples that build modules and models (~5-8 s a module in a fresh process)
        + tuple(m for m in NN if m.split(".")[-1] not in ("pipeline", "ring", "sites", "per_layer"))
        + ("jaxformer.interpret",)}


def _public(mod) -> list[tuple[str, object]]:
    """The module's public functions and classes: the names its page renders (`PUBLIC`), else its `__all__`, else
    its names not starting with "_", keeping those defined in the module itself."""
    names = PUBLIC.get(mod.__name__) or getattr(mod, "__all__", None) or [n for n in vars(mod)
                                                                          if not n.startswith("_")]
    objs = [(n, getattr(mod, n)) for n in names]
    return [(n, o) for n, o in objs if (inspect.isfunction(o) or inspect.isclass(o))
            and getattr(o, "__module__", None) == mod.__name__]


def test_the_modules_are_those_the_reference_renders():
    api = Path(__file__).resolve().parents[1] / "docs" / "api"
    page = (api / "ops.md").read_text(encoding="utf-8")
    assert [line.split(".")[-1] for line in page.splitlines() if line.startswith(":::")] == list(MODULES)
    nn = (api / "nn.md").read_text(encoding="utf-8")
    assert [line[4:] for line in nn.splitlines() if line.startswith(":::")] == list(NN)
    config = (api / "config.md").read_text(encoding="utf-8")
    assert [line[4:] for line in config.splitlines() if line.startswith(":::")] == list(CONFIG)
    helpers = (api / "helpers.md").read_text(encoding="utf-8").splitlines()
    assert all(f"::: {name}" in helpers for name in HELPERS)
    for name in LIBRARY:
        page = (api / f"{name.split('.')[-1]}.md").read_text(encoding="utf-8")
        assert f"::: {name}" in page.splitlines(), f"docs/api/{name.split('.')[-1]}.md does not render {name}"
    for name, modules in PAGES.items():
        page = (api / f"{name}.md").read_text(encoding="utf-8")
        rendered = {m: tuple(n.strip() for n in names.split(",")) for m, names in
                    re.findall(r"^::: (\S+)\n    options:\n      members: \[(.*)\]$", page, flags=re.M)}
        assert rendered == modules, f"docs/api/{name}.md renders {rendered}, not {modules}"
        assert len(rendered) == sum(line.startswith(":::") for line in page.splitlines()), name


def test_each_package_page_renders_every_name_the_package_exports_once():
    """Every name of hf's, inference's and data's `__all__` is rendered from the module defining it (the same
    object), on exactly one page; jaxformer.train exports none."""
    rendered = [(module, n) for page in PAGES.values() for module, names in page.items() for n in names]
    assert len(rendered) == len(set(rendered))
    for package in ("jaxformer.hf", "jaxformer.inference", "jaxformer.data"):
        pkg = importlib.import_module(package)
        for n in pkg.__all__:
            where = [m for m, name in rendered if name == n and getattr(importlib.import_module(m), n) is
                     getattr(pkg, n)]
            assert len(where) == 1, f"{package}.{n} is rendered from {where}"
    assert not getattr(importlib.import_module("jaxformer.train"), "__all__", ())


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
