"""The package's layer rules, checked statically: every import in every file under jaxformer/ (top level and inside
functions, relative ones resolved) is read with `ast`, nothing is imported. Only jaxformer.* targets matter.
Prefixes match on dotted names: "jaxformer.nn" matches jaxformer.nn and jaxformer.nn.x, not jaxformer.nnx."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest


class Rule(NamedTuple):
    sources: tuple[str, ...]          # modules the rule applies to (prefixes) ...
    reason: str
    never: tuple[str, ...] = ()       # ... which may not import these ...
    only: tuple[str, ...] = ()        # ... or, when given, may import nothing in the package but these
    unless: tuple[str, ...] = ()      # ... except modules under these prefixes


TOP = ("jaxformer",)  # every module of the package
RULES = (
    Rule(("jaxformer.ops",), only=("jaxformer.ops", "jaxformer.errors"),
         reason="ops is pure math: no Flax-facing code, no config"),
    Rule(("jaxformer.nn",), never=("jaxformer.train", "jaxformer.runs", "jaxformer.decode", "jaxformer.cli",
                                   "jaxformer.inference", "jaxformer.sweep", "jaxformer.report",
                                   "jaxformer.verdicts", "jaxformer.viz", "jaxformer.checkpoints"),
         reason="nn is modules built from ops and config, below everything that uses them"),
    Rule(("jaxformer.decode",), never=("jaxformer.train", "jaxformer.runs", "jaxformer.config", "jaxformer.configio",
                                       "jaxformer.nn.models", "jaxformer.cli", "jaxformer.inference",
                                       "jaxformer.data"),
         reason="decode takes a model and plain arguments; errors come from jaxformer.errors"),
    Rule(("jaxformer.runs",), never=("jaxformer.nn", "jaxformer.train", "jaxformer.decode", "jaxformer.inference",
                                     "jaxformer.quantize"),
         reason="the run directory is files; restoring a model is inference's job"),
    Rule(TOP, unless=("jaxformer.train", "jaxformer.cli", "jaxformer.sweep", "jaxformer.mup"),
         never=("jaxformer.train",),
         reason="train is imported only by train itself, cli, sweep (it trains the runs and records their sizes) "
                "and mup (its coordinate check trains a few steps)"),
    Rule(("jaxformer.stats",), only=("jaxformer.errors",),
         reason="stats is the ground floor of the statistics: numpy, scipy and the standard library"),
    Rule(("jaxformer.report", "jaxformer.verdicts", "jaxformer.scaling"),
         never=("jaxformer.nn", "jaxformer.train", "jaxformer.inference", "jaxformer.decode", "jaxformer.arch"),
         reason="reports and fits read the runs' records: a run's sizes come from its sweep.json (the sweep "
                "writes them; sweep.computed_sizes is the one fallback to the model code)"),
    Rule(TOP, unless=("jaxformer.cli", "jaxformer.__main__"), never=("jaxformer.cli",),
         reason="cli is the top: nothing in the package imports it"),
    Rule(("jaxformer.ops",), never=("jaxformer.platforms",),
         reason="ops is the same math on every platform: compiler levers live in the platform seam"),
    Rule(("jaxformer.platforms",), only=("jaxformer.platforms", "jaxformer.errors", "jaxformer.signals"),
         reason="the platform seam sits below the model: it knows compilers and processes, not models"),
    Rule(("jaxformer.nn",), unless=("jaxformer.nn.params",), never=("jaxformer.platforms",),
         reason="the model reaches the platform seam from one place (nn.params.lever)"),
    Rule(("jaxformer.nn", "jaxformer.ops", "jaxformer.decode"), never=("jaxformer.quantize",),
         reason="post-training quantization sits above the math, the modules and decoding: they do not depend "
                "on it (weight kinds, a frozen int8 LoRA base among them, are nn's own: nn.weights)"),
    Rule(("jaxformer.arch",), never=("jaxformer.nn",),
         reason="an architecture adapter talks to a model object (its call, its methods), not to the modules"),
)


def matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (the package folder; __init__.py names the package)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = (root.name, *f.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_of(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module `file` (module `name`) imports, anywhere in the file."""
    top, package = name.split(".")[0], name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package.split(".")
                if node.level - 1 >= len(up):
                    continue  # beyond the top package: python would refuse it too
                base = ".".join(up[:len(up) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
    # the bare top package is implied by importing any of its submodules: never a violation on its own
    return {t for t in found if t.startswith(top + ".")}


def import_graph(root: Path) -> dict[str, tuple[Path, set[str]]]:
    modules = module_names(root)
    return {name: (f, imports_of(name, f, modules)) for name, f in modules.items()}


def violations(root: Path, rules=RULES) -> list[str]:
    """One line per forbidden (file, target), naming the first rule in the table that forbids it."""
    out = []
    for name, (file, targets) in import_graph(root).items():
        rel = file.relative_to(root.parent).as_posix()
        for t in sorted(targets):
            for rule in rules:
                if matches(name, rule.sources) and not matches(name, rule.unless) and (
                        matches(t, rule.never) or (rule.only and not matches(t, rule.only))):
                    out.append(f"{rel} imports {t} (rule: {rule.reason})")
                    break
    return out


def room_cycles(root: Path) -> list[list[str]]:
    """Groups of rooms (jaxformer.<first component>) that import each other in a circle (strongly connected)."""
    room = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    edges: dict[str, set[str]] = {}
    for name, (_, targets) in import_graph(root).items():
        if "." in name:  # the top __init__ is no room
            edges.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in edges.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    r = {a: reach(a) for a in edges}
    groups = {tuple(sorted({a} | {b for b in r[a] if a in r.get(b, ())})) for a in edges if a in r[a]}
    return sorted(list(g) for g in groups)


def module_cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other in a circle (strongly connected), inside a folder or across
    folders. A module importing its own package (its __init__, which re-exports it) is no circle."""
    graph = import_graph(root)
    packages = {n for n, (f, _) in graph.items() if f.name == "__init__.py"}
    edges = {n: {t for t in ts if t in graph and t != n and not (t in packages and n.startswith(t + "."))}
             for n, (_, ts) in graph.items()}

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in edges[todo.pop()]:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    r = {a: reach(a) for a in edges}
    groups = {tuple(sorted({a} | {b for b in r[a] if a in r[b]})) for a in edges if a in r[a]}
    return sorted(list(g) for g in groups)


PACKAGE = Path(__file__).parents[1] / "jaxformer"


def test_package_obeys_layer_rules():
    found = violations(PACKAGE)
    assert not found, f"{len(found)} layer-rule violations:\n" + "\n".join(found)


def test_checker_finds_planted_violations(tmp_path):
    files = {
        "__init__.py": "", "errors.py": "class E(Exception): ...\n", "config.py": "X = 1\n",
        "ops/__init__.py": "", "nn/__init__.py": "", "nn/models.py": "", "train/__init__.py": "", "train/step.py": "",
        "ops/a.py": "def f():\n    from jaxformer.config import X\n    return X\n",
        "nn/b.py": "from ..train import step\n",
        "decode.py": "import jaxformer.nn.models as m\n",
        "runs.py": "from jaxformer import nn\nimport jaxformer.nnx\n",
        "data.py": "def g():\n    from .train.step import step\n",
        # clean: same-room and errors imports from ops; config from a module that only looks like ops
        "ops/clean.py": "import numpy as np\nfrom . import a\nfrom .. import errors\nfrom jaxformer.errors import E\n",
        "opsx.py": "from jaxformer.config import X\n",
    }
    for rel, text in files.items():
        (tmp_path / "jaxformer" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "jaxformer" / rel).write_text(text)
    found = violations(tmp_path / "jaxformer")
    pairs = {line.split(" (rule:")[0] for line in found}
    assert pairs == {
        "jaxformer/ops/a.py imports jaxformer.config",
        "jaxformer/nn/b.py imports jaxformer.train", "jaxformer/nn/b.py imports jaxformer.train.step",
        "jaxformer/decode.py imports jaxformer.nn.models",
        "jaxformer/runs.py imports jaxformer.nn",
        "jaxformer/data.py imports jaxformer.train.step",
    }, "\n".join(found)
    assert f"jaxformer/ops/a.py imports jaxformer.config (rule: {RULES[0].reason})" in found
    assert matches("jaxformer.nn.x", ("jaxformer.nn",)) and not matches("jaxformer.nnx", ("jaxformer.nn",))
    (tmp_path / "jaxformer/ops/__init__.py").write_text("from jaxformer import nn\n")   # ops -> nn -> ops
    (tmp_path / "jaxformer/nn/__init__.py").write_text("from jaxformer.ops import a\n")
    assert room_cycles(tmp_path / "jaxformer") == [["jaxformer.nn", "jaxformer.ops"]]


def test_no_cycles_between_top_level_rooms():
    cycles = room_cycles(PACKAGE)
    assert not cycles, "rooms importing each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_cycles_between_modules_inside_a_folder():
    """Before: data.tasks <-> data.tokens (build_task's lazy import), train.step <-> train.weights."""
    cycles = module_cycles(PACKAGE)
    assert not cycles, "modules importing each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_module_cycle_check_finds_a_planted_circle_and_allows_package_reexports(tmp_path):
    files = {"__init__.py": "", "data/__init__.py": "from jaxformer.data.tasks import T\n",
             "data/tasks.py": "T = 1\ndef f():\n    from jaxformer.data.tokens import U\n",
             "data/tokens.py": "from jaxformer.data import tasks\nU = 2\n",
             "data/text.py": "from jaxformer.data import T\n"}          # its own package: no circle
    for rel, text in files.items():
        (tmp_path / "jaxformer" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "jaxformer" / rel).write_text(text)
    assert module_cycles(tmp_path / "jaxformer") == [["jaxformer.data.tasks", "jaxformer.data.tokens"]]


def test_the_layer_stack_has_one_spelling_and_it_is_the_models():
    """`nn.stack.blocks_path` is where every stack's blocks sit in a model's state (encoder-decoder and decoder-
    only), and no library file spells that path out again."""
    from flax import nnx
    from jaxformer.config import ModelConfig
    from jaxformer.nn import build_model
    from jaxformer.nn.stack import blocks_path
    for arch, stacks in (("encoder_decoder", ("encoder", "decoder")), ("decoder_only", ("decoder",))):
        cfg = ModelConfig(arch=arch, vocab_size=11, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=2,
                          num_decoder_layers=3, max_len=8)
        state = nnx.to_pure_dict(nnx.eval_shape(lambda: nnx.state(build_model(cfg))))
        for stack in stacks:
            node = state
            for key in blocks_path(stack):
                node = node[key]
            leading = {leaf.shape[0] for leaf in __import__("jax").tree.leaves(node)}
            assert leading == {cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers}
    spelled = [f for f in PACKAGE.rglob("*.py") if '"layers", "blocks"' in f.read_text()]
    assert spelled == [PACKAGE / "nn" / "stack.py"], spelled


STATS_FLOOR = {"numpy", "scipy", "jaxformer"} | set(sys.stdlib_module_names)


def test_the_statistics_ground_floor_imports_numpy_scipy_and_the_standard_library_only():
    """jaxformer/stats.py (Stat, the verdicts, paired intervals, the bootstrap resampler) imports nothing but
    numpy, scipy, the standard library and jaxformer.errors (the layer rule), and jax only inside `machine`
    (it names the devices a result was measured on). Before: Stat and the verdicts lived in report.py and
    verdicts.py, over the sweep and its runs."""
    tree = ast.parse((PACKAGE / "stats.py").read_text())
    outside = {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] + [tree]:
        body = fn.body if fn is tree else ast.walk(fn)
        for node in body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for top in {n.split(".")[0] for n in names} - STATS_FLOOR - {"__future__"}:
                outside.setdefault(top, set()).add("<module>" if fn is tree else fn.name)
    assert outside == {"jax": {"machine"}}, outside


def _run_at_import(node: ast.AST):
    """The nodes of a module that run when it is imported: all but the bodies of functions (and lambdas)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _run_at_import(child)


def module_level_closure(root: Path, start: tuple[str, ...]) -> set[str]:
    """Every module that importing `start` loads by the package's module-level imports (those inside functions
    wait for a call): package modules by name, and the top-level names of what else they import."""
    modules = module_names(root)
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for parent in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):    # a module loads its packages
            if parent in seen:
                continue
            seen.add(parent)
            file = modules.get(parent)
            if file is None:
                continue
            package = parent if file.name == "__init__.py" else parent.rpartition(".")[0]
            for sub in _run_at_import(ast.parse(file.read_text(), filename=str(file))):
                if isinstance(sub, ast.Import):
                    todo += [a.name for a in sub.names]
                elif isinstance(sub, ast.ImportFrom) and sub.module != "__future__":
                    up = package.split(".")
                    base = (".".join(up[:len(up) - sub.level + 1] + ([sub.module] if sub.module else []))
                            if sub.level else sub.module)
                    todo += [base] + [f"{base}.{a.name}" for a in sub.names if f"{base}.{a.name}" in modules]
    return {n if n.startswith("jaxformer") else n.split(".")[0] for n in seen}


REPORTS = ("jaxformer.report", "jaxformer.scaling", "jaxformer.verdicts", "jaxformer.stats")


def test_importing_the_reports_loads_no_model_code():
    """The import graph at module level: the reports, the fits and the statistics reach neither jaxformer.nn nor
    jaxformer.train nor flax (the slow lane runs the same check in a fresh interpreter)."""
    loaded = module_level_closure(PACKAGE, REPORTS)
    assert {"jaxformer.sweep", "jaxformer.stats", "numpy"} <= loaded            # the closure is followed
    model = sorted(m for m in loaded if matches(m, ("jaxformer.nn", "jaxformer.train", "flax")))
    assert not model, model


@pytest.mark.slow                    # a fresh interpreter importing jax (~2 s)
def test_importing_the_reports_loads_no_model_code_in_a_fresh_interpreter():
    code = (f"import {', '.join(REPORTS)}; import sys; print(sorted(m for m in sys.modules if "
            f"m.startswith('jaxformer.nn') or m.startswith('jaxformer.train') or m.startswith('flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


TEST_ONLY = {"torch", "transformers", "lm_eval", "peft", "sae_lens", "pytest", "hypothesis", "mutmut", "jinja2",
             "sentencepiece"}


def test_no_module_of_the_package_needs_the_test_extra_to_import():
    """`make run` installs the package's own dependencies only (the test extra comes with `make test`): importing
    any module of the package loads none of the test-only references (torch, transformers, lm-eval, peft,
    SAELens, the test tools) nor an optional extra (jinja2, sentencepiece); those are imported inside the
    functions that need them, which name the extra when it is missing."""
    loaded = module_level_closure(PACKAGE, tuple(module_names(PACKAGE)))
    assert {"jax", "flax", "optax", "jaxformer.cli"} <= loaded                   # the closure is followed
    assert not loaded & TEST_ONLY, sorted(loaded & TEST_ONLY)
