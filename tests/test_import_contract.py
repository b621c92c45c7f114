"""The package's layer rules, checked statically: every import in every file under jaxformer/ (top level and inside
functions, relative ones resolved) is read with `ast`, nothing is imported. Only jaxformer.* targets matter.
Prefixes match on dotted names: "jaxformer.nn" matches jaxformer.nn and jaxformer.nn.x, not jaxformer.nnx."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple


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
    Rule(("jaxformer.nn",), never=("jaxformer.train", "jaxformer.runs", "jaxformer.decode", "jaxformer.quantize",
                                   "jaxformer.cli", "jaxformer.inference", "jaxformer.sweep", "jaxformer.report",
                                   "jaxformer.verdicts", "jaxformer.viz", "jaxformer.checkpoints"),
         reason="nn is modules built from ops and config, below everything that uses them"),
    Rule(("jaxformer.decode",), never=("jaxformer.train", "jaxformer.runs", "jaxformer.config", "jaxformer.configio",
                                       "jaxformer.nn.models", "jaxformer.cli", "jaxformer.inference",
                                       "jaxformer.data"),
         reason="decode takes a model and plain arguments; errors come from jaxformer.errors"),
    Rule(("jaxformer.runs",), never=("jaxformer.nn", "jaxformer.train", "jaxformer.decode", "jaxformer.inference",
                                     "jaxformer.quantize"),
         reason="the run directory is files; restoring a model is inference's job"),
    Rule(TOP, unless=("jaxformer.train", "jaxformer.cli", "jaxformer.sweep", "jaxformer.scaling", "jaxformer.mup"),
         never=("jaxformer.train",),
         reason="train is imported only by train itself, cli, sweep, scaling (a run's FLOPs by the same formula) "
                "and mup (its coordinate check trains a few steps)"),
    Rule(TOP, unless=("jaxformer.cli", "jaxformer.__main__"), never=("jaxformer.cli",),
         reason="cli is the top: nothing in the package imports it"),
    Rule(("jaxformer.ops",), never=("jaxformer.platforms",),
         reason="ops is the same math on every platform: compiler levers live in the platform seam"),
    Rule(("jaxformer.platforms",), only=("jaxformer.platforms", "jaxformer.errors", "jaxformer.signals"),
         reason="the platform seam sits below the model: it knows compilers and processes, not models"),
    Rule(("jaxformer.nn",), unless=("jaxformer.nn.params",), never=("jaxformer.platforms",),
         reason="the model reaches the platform seam from one place (nn.params.lever)"),
    Rule(("jaxformer.nn", "jaxformer.ops", "jaxformer.decode"), never=("jaxformer.quantize",),
         reason="quantization sits above the math, the modules and decoding: they do not depend on it"),
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
