"""Mutation testing as a tool (`make mutants MODULES="jaxformer/patching.py ..."`): mutmut 3 (the `dev` extra) mutates
each named module and runs, for each mutant, the default-lane tests that cover it; the result is a row of the
committed score table (tests/mutation_scores.json, rendered into docs/mutation.md).

    .venv/bin/python tools/mutation.py jaxformer/patching.py [--children 2] [--render-only]

What is run: tests/mutation.toml names, per module, the default-lane test files that exercise it (mutmut then picks,
per mutated function, the tests that reach it) and the mutants judged equivalent, each with a one-line reason.
Each module is worked on in its own folder .mutants/<module>/ (ignored by git): the tracked files copied there,
pyproject.toml given a [tool.mutmut] section, mutmut run in it with that folder's `mutants/` copy first on
PYTHONPATH (so subprocess workers, e.g. the 8-fake-device ones, import the mutated code too). mutmut resumes
where a run stopped and retests only changed functions. Process isolation is mutmut's forkserver: JAX's runtime
is not fork-safe once started, and the server forks before anything imports it.

Limits of mutmut 3 that the table states rather than hides: it mutates function bodies only, never a decorated
function (so a jitted function is written undecorated and jitted by assignment where it should be mutated:
`_grid = jax.jit(_grid_program, ...)`), nor module-level code. The text of an error message is not mutated
(lines starting `raise X(`: that an error is raised, and where, is mutated; its wording is prose).

Score = (killed + timeout) / (mutants − equivalent); a mutant no test reaches ("no tests") counts as a survivor.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "mutation.toml"
SCORES = ROOT / "tests" / "mutation_scores.json"
PAGE = ROOT / "docs" / "mutation.md"
WORK = ROOT / ".mutants"
KILLED = ("killed", "timeout", "segfault", "caught by type check")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help="module paths, e.g. jaxformer/patching.py (default: every one listed)")
    p.add_argument("--children", type=int, default=2, help="mutants tested at once (mutmut --max-children)")
    p.add_argument("--render-only", action="store_true", help="only render docs/mutation.md from the scores")
    args = p.parse_args(argv)
    config = tomllib.loads(CONFIG.read_text())
    modules = args.modules or list(config["modules"])
    unknown = [m for m in modules if m not in config["modules"]]
    if unknown:
        print(f"not in {CONFIG.relative_to(ROOT)}: {unknown} (add the module with the tests that cover it)")
        return 2
    scores = json.loads(SCORES.read_text()) if SCORES.exists() else {}
    if not args.render_only:
        for module in modules:
            scores[module] = run_module(module, config, args.children)
            SCORES.write_text(json.dumps(scores, indent=1, sort_keys=True) + "\n")
            row = scores[module]
            print(f"{module}: {row['killed']}/{row['mutants'] - row['equivalent']} killed ({row['score']:.1%}), "
                  f"{len(row['survivors'])} survivors, {row['seconds'] / 60:.1f} min")
    PAGE.write_text(render(scores, config))
    return 0


def run_module(module: str, config: dict, children: int) -> dict:
    """Mutate `module`, run mutmut in its own folder, -> its score row."""
    entry = config["modules"][module]
    work = WORK / module.replace("/", "_").removesuffix(".py")
    _copy_tree(work)
    settings = {"source_paths": ["jaxformer"], "only_mutate": [module],
                "pytest_add_cli_args_test_selection": entry["tests"],
                "pytest_add_cli_args": ["-p", "no:xdist", "-p", "no:cacheprovider", "-m", "not slow and not gpu"],
                "also_copy": ["configs/", "docs/", "benchmarks/", "experiments/"],
                "do_not_mutate_patterns": config["defaults"]["do_not_mutate_patterns"],
                "process_isolation": "forkserver", "forkserver_warmup": "none",
                "use_git_change_detection": False}
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    (work / "mutants").mkdir(exist_ok=True)     # on PYTHONPATH before mutmut fills it: a path missing when Python
    env = {**os.environ, "PYTHONPATH": str(work / "mutants"), "JAX_PLATFORMS": "cpu"}   # starts is never searched
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    start = time.time()
    with open(work / "mutmut.log", "w") as log:          # mutmut's own progress and errors, kept for a look
        subprocess.run([mutmut, "run", "--max-children", str(children)], cwd=work, env=env, check=False,
                       stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - start
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
    status = dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", out.stdout, re.M))
    return score(status, entry.get("equivalent", {}), seconds)


def score(status: dict[str, str], equivalent: dict[str, str], seconds: float) -> dict:
    """A module's row from mutmut's status per mutant and the equivalent mutants' reasons."""
    short = {name.split(".")[-1]: s for name, s in status.items()}
    gone = [n for n in equivalent if n not in short]
    killed = sum(s in KILLED for s in short.values())
    equal = [n for n in equivalent if n in short and short[n] not in KILLED]
    survivors = sorted(n for n, s in short.items() if s not in KILLED and n not in equivalent)
    unchecked = sorted(n for n in survivors if short[n] == "not checked")
    total = len(short)
    denominator = max(total - len(equal), 1)
    return {"mutants": total, "killed": killed, "equivalent": len(equal), "survivors": survivors,
            "unchecked": unchecked, "stale_equivalents": gone, "score": killed / denominator,
            "seconds": round(seconds), "machine": f"{platform.processor() or platform.machine()}, "
                                                  f"{os.cpu_count()} cores", "date": str(datetime.date.today())}


def render(scores: dict, config: dict) -> str:
    lines = ["# Mutation scores", "",
             "Rendered by `tools/mutation.py` from `tests/mutation_scores.json` (`make mutants MODULES=...`; the",
             "method and its limits are in that script's docstring). Score = killed / (mutants − equivalent).", "",
             "| module | mutants | killed | equivalent | survivors | score | minutes | machine, date |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for module, r in sorted(scores.items()):
        lines.append(f"| `{module}` | {r['mutants']} | {r['killed']} | {r['equivalent']} | {len(r['survivors'])} | "
                     f"{r['score']:.1%} | {r['seconds'] / 60:.0f} | {r['machine']}, {r['date']} |")
    for module, r in sorted(scores.items()):
        reasons = config["modules"].get(module, {}).get("equivalent", {})
        if reasons or r["survivors"]:
            lines += ["", f"## `{module}`", ""]
        lines += [f"- equivalent `{n}`: {why}" for n, why in sorted(reasons.items())]
        lines += [f"- survivor `{n}`" + (" (not run: the run was cut short)" if n in r["unchecked"] else "")
                  for n in r["survivors"]]
    return "\n".join(lines) + "\n"


def _copy_tree(work: Path) -> None:
    """The tracked files (and untracked, not ignored ones) of the repository into `work`, replacing older copies;
    mutmut's own state (work/mutants, its caches) is kept so that a run resumes."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        src, dst = ROOT / name, work / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


if __name__ == "__main__":
    sys.exit(main())
