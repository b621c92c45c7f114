"""Mutation testing as a tool (`make mutants MODULES="jaxformer/patching.py ..."`): mutmut 3 (the `dev` extra) mutates
each named module and runs, for each mutant, the default-lane tests that cover it; the result is a row of the
committed score table (tests/mutation_scores.json, rendered into docs/mutation.md).

    .venv/bin/python tools/mutation.py jaxformer/patching.py [--children 2] [--render-only]

What is run: tests/mutation.toml names, per module, the default-lane test files that exercise it (mutmut then picks,
per mutated function, the tests that reach it) and the mutants judged equivalent, each with a one-line reason.
Each module is worked on in its own folder .mutants/<module>/ (ignored by git): the tracked files copied there,
pyproject.toml given a [tool.mutmut] section, mutmut run in it with that folder's `mutants/` copy first on
PYTHONPATH (so subprocess workers, e.g. the 8-fake-device ones, import the mutated code too). mutmut resumes
where a run stopped and retests only changed functions. Process isolation is mutmut's forkserver, with the
tests' imports (jax, the package, torch, transformers, lm-eval: seconds a mutant) loaded in the server before it
forks (`_preload`): importing JAX does not start its runtime, which is not fork-safe, and a last preloaded module
stops the run if one did.

Limits of mutmut 3 that the table states rather than hides: it mutates function bodies only, never a decorated
function (so a jitted function is written undecorated and jitted by assignment where it should be mutated:
`_grid = jax.jit(_grid_program, ...)`), nor module-level code. The text of an error message is not mutated
(lines starting `raise X(`: that an error is raised, and where, is mutated; its wording is prose).

A test that needs several devices reaches the code in its own process only (mutmut records which tests reach
which function there, not in a child process): such a module's entry names `devices`, the run gets that many fake
CPU devices, and its tests (`helpers.with_devices`) run in the process instead of a child. A module's entry may
name `functions` (mutmut's mangled names: `x_name` for a function, `xǁClassǁmethod` for a
method): then only those are mutated and scored, for a capability that is a few functions of a larger file.

Score = (killed + timeout) / (mutants − equivalent); a mutant no test reaches ("no tests") counts as a survivor.
Each mutant that no test killed is recorded with its change (`old -> new`, from mutmut's own diff), and each
judgment with the change it was written for: mutmut numbers a function's mutants anew when the function is
edited, so after an edit a name may be another mutant; a reason whose mutant changed is then stale (listed, the
mutant counted a survivor) until it is reworded or removed after a look at the new change.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import fnmatch
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
    p.add_argument("--survivors", action="store_true",
                   help="rerun the module's survivors of the score table (after tests were added), then any "
                        "mutants mutmut reset because the tests reaching their function changed")
    p.add_argument("--render-only", action="store_true", help="only render docs/mutation.md from the scores")
    args = p.parse_args(argv)
    config = tomllib.loads(CONFIG.read_text())
    modules = args.modules or list(config["modules"])
    unknown = [m for m in modules if m not in config["modules"]]
    if unknown:
        print(f"not in {CONFIG.relative_to(ROOT)}: {unknown} (add the module with the tests that cover it)")
        return 2
    scores = json.loads(SCORES.read_text()) if SCORES.exists() else {}
    scores = {m: rescored(r, config["modules"].get(m, {}).get("equivalent", {})) for m, r in scores.items()}
    if args.render_only:
        SCORES.write_text(json.dumps(scores, indent=1, sort_keys=True) + "\n")
    else:
        for module in modules:
            old = scores.get(module, {})
            again = [n for n in old.get("survivors", []) if n not in old.get("unchecked", [])] if args.survivors else []
            row = run_module(module, config, args.children, again, old.get("judged", {}))
            if again:                                       # the minutes: the whole run's and the rerun's
                row["seconds"] += scores[module]["seconds"]
            scores = json.loads(SCORES.read_text()) if SCORES.exists() else {}     # another module's run may have
            scores[module] = row                                                    # written its row meanwhile
            scores = {m: rescored(r, config["modules"].get(m, {}).get("equivalent", {})) for m, r in scores.items()}
            SCORES.write_text(json.dumps(scores, indent=1, sort_keys=True) + "\n")
            row = scores[module]
            print(f"{module}: {row['killed']}/{row['mutants'] - row['equivalent']} killed ({row['score']:.1%}), "
                  f"{len(row['survivors'])} survivors, {row['seconds'] / 60:.1f} min")
    PAGE.write_text(render(scores, config))
    return 0


def run_module(module: str, config: dict, children: int, again: list[str] = (), judged: dict | None = None) -> dict:
    """Mutate `module`, run mutmut in its own folder, -> its score row. again: mutant names to rerun (mutmut
    keeps every other verdict: a changed test selection would reset them all, so survivors' tests go in a file
    already listed). judged: the earlier row's judgments (`score`)."""
    entry = config["modules"][module]
    work = WORK / module.replace("/", "_").removesuffix(".py")
    _copy_tree(work)
    settings = {"source_paths": ["jaxformer"], "only_mutate": [module],
                "pytest_add_cli_args_test_selection": entry["tests"],
                "pytest_add_cli_args": ["-p", "no:xdist", "-p", "no:cacheprovider", "-m", "not slow and not gpu"],
                "also_copy": ["configs/", "docs/", "benchmarks/", "experiments/"],
                "do_not_mutate_patterns": config["defaults"]["do_not_mutate_patterns"],
                "process_isolation": "forkserver", "forkserver_warmup": "import",
                "preload_modules_file": str(_preload(work, entry["tests"])),
                "use_git_change_detection": False}
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    (work / "mutants").mkdir(exist_ok=True)     # on PYTHONPATH before mutmut fills it: a path missing when Python
    env = {**_test_env(), "PYTHONPATH": f"{work / 'mutants'}{os.pathsep}{work / 'preload'}",   # starts is never
           "JAX_PLATFORMS": "cpu"}                                                                  # searched
    if entry.get("devices"):        # tests that need n devices run in mutmut's process (helpers.with_devices)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={entry['devices']}"
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    dotted = module.removesuffix(".py").replace("/", ".")
    only = [f"{dotted}.{f}__mutmut_*" for f in entry.get("functions", [])]
    start = time.time()
    with open(work / "mutmut.log", "w") as log:          # mutmut's own progress and errors, kept for a look
        for names in ([f"{dotted}.{n}" for n in again], only) if again else (only,):
            subprocess.run([mutmut, "run", "--max-children", str(children), *names], cwd=work, env=env,
                           check=False, stdout=log, stderr=subprocess.STDOUT)
            status = _status(mutmut, work, env, only)
            if not any(s == "not checked" for s in status.values()):
                break           # else mutmut reset the verdicts of functions whose tests changed: test them all
    seconds = time.time() - start
    reasons = entry.get("equivalent", {})
    diffs = _diffs(work, module, [n for n, s in status.items() if s not in KILLED], env)
    return score(status, reasons, seconds, diffs, judged)


def _status(mutmut: str, work: Path, env: dict, only: list[str]) -> dict[str, str]:
    """mutmut's verdict per mutant of the module (of its `functions` where it names them)."""
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
    status = dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", out.stdout, re.M))
    return {n: s for n, s in status.items() if not only or any(fnmatch.fnmatch(n, pat) for pat in only)}


def score(status: dict[str, str], equivalent: dict[str, str], seconds: float, diffs: dict[str, str] | None = None,
          judged: dict | None = None) -> dict:
    """A module's row from mutmut's status per mutant, the equivalent mutants' reasons, each mutant's change
    (`diffs`, by full or short name: what a survivor or an equivalent mutant does) and the earlier row's
    judgments (`judged`: name -> [reason, the change it was written for])."""
    short = {name.split(".")[-1]: s for name, s in status.items()}
    changes = {name.split(".")[-1]: d for name, d in (diffs or {}).items()}
    open_ = sorted(n for n, s in short.items() if s not in KILLED)
    row = {"mutants": len(short), "killed": sum(s in KILLED for s in short.values()),
           "unchecked": sorted(n for n in open_ if short[n] == "not checked"),
           "diffs": {n: changes.get(n, "") for n in open_}, "judged": dict(judged or {}),
           "gone": sorted(n for n in equivalent if n not in short),
           "seconds": round(seconds), "machine": f"{platform.processor() or platform.machine()}, "
                                                 f"{os.cpu_count()} cores", "date": str(datetime.date.today())}
    return rescored(row, equivalent)


def rescored(row: dict, reasons: dict) -> dict:
    """The row's verdicts under the reasons of tests/mutation.toml: a mutant that no test killed is equivalent
    when a reason names it, unless that reason was written for another change (mutmut numbers a function's
    mutants anew when it is edited: the same name may then be another mutant). Such a stale judgment makes it a
    survivor until its reason is reworded (or removed) after a look at the new change. A row from before the
    changes were recorded (no "diffs") keeps its counts, with the survivors named since moved to equivalent."""
    if "diffs" not in row:
        moved = [n for n in row["survivors"] if n in reasons]
        if not moved:
            return row
        survivors = [n for n in row["survivors"] if n not in reasons]
        equivalent = row["equivalent"] + len(moved)
        return {**row, "survivors": survivors, "equivalent": equivalent,
                "unchecked": [n for n in row["unchecked"] if n in survivors],
                "score": row["killed"] / max(row["mutants"] - equivalent, 1)}
    judged, stale = {}, []
    for name, change in row["diffs"].items():
        if name not in reasons:
            continue
        was = row["judged"].get(name)
        if was and was[0] == reasons[name] and was[1] != change:
            stale.append(name)
            judged[name] = was
        else:
            judged[name] = [reasons[name], change]
    equal = [n for n in row["diffs"] if n in judged and n not in stale]
    survivors = sorted(n for n in row["diffs"] if n not in equal)
    return {**row, "judged": judged, "equivalent": len(equal), "survivors": survivors,
            "stale_equivalents": sorted(stale + row["gone"]),
            "score": row["killed"] / max(row["mutants"] - len(equal), 1)}


def _compact(diff: str) -> str:
    """mutmut's unified diff of one mutant as one line: `old` -> `new`, comments dropped."""
    lines = [l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    side = lambda sign: " / ".join(re.sub(r"\s+#.*$", "", l[1:]).strip() for l in lines if l[0] == sign)
    return f"{side('-')} -> {side('+')}"


_DIFFS = ("import json, sys\nfrom mutmut.mutation.diff_apply import get_diff_for_mutant\n"
          "module, names = json.load(sys.stdin)\n"
          "print(json.dumps({n: get_diff_for_mutant(n, path=module) for n in names}))\n")


def _diffs(work: Path, module: str, names: list[str], env: dict) -> dict[str, str]:
    """Each named mutant's change (`_compact`), from mutmut's own diff of the mutated copy in `work`."""
    out = subprocess.run([sys.executable, "-c", _DIFFS], cwd=work, env=env, input=json.dumps([module, names]),
                         capture_output=True, text=True, check=True)
    return {n: _compact(d) for n, d in json.loads(out.stdout).items()}


def _scope(functions: list[str]) -> str:
    """mutmut's mangled names as Python's: x_name -> name, xǁClassǁmethod -> Class.method."""
    return ", ".join(".".join(p for p in f.split("ǁ")[1:]) if "ǁ" in f else f.removeprefix("x_") for f in functions)


def render(scores: dict, config: dict) -> str:
    lines = ["# Mutation scores", "",
             "Rendered by `tools/mutation.py` from `tests/mutation_scores.json` (`make mutants MODULES=...`; the",
             "method and its limits are in that script's docstring). Score = killed / (mutants − equivalent).", "",
             "not run: mutants a run cut short never tested (counted as survivors).", "",
             "| module | mutants | killed | equivalent | survivors (not run) | score | minutes | machine, date |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for module, r in sorted(scores.items()):
        only = config["modules"].get(module, {}).get("functions")
        scope = f" ({_scope(only)} only)" if only else ""
        lines.append(f"| `{module}`{scope} | {r['mutants']} | {r['killed']} | {r['equivalent']} | "
                     f"{len(r['survivors'])} ({len(r['unchecked'])}) | {r['score']:.1%} | {r['seconds'] / 60:.0f} | "
                     f"{r['machine']}, {r['date']} |")
    lines += [f"| `{m}` | not run yet | | | | | | |"
              for m in sorted(set(config["modules"]) - set(scores))]
    for module, r in sorted(scores.items()):
        reasons = config["modules"].get(module, {}).get("equivalent", {})
        if reasons or r["survivors"]:
            lines += ["", f"## `{module}`", ""]
        lines += _listed(r, reasons)
    return "\n".join(lines) + "\n"


def _listed(r: dict, reasons: dict) -> list[str]:
    """A row's equivalent mutants with their reasons and its survivors, each with its change where recorded."""
    if "diffs" not in r:                                # a row from before the changes were recorded
        return [f"- equivalent `{n}`: {why}" for n, why in sorted(reasons.items())] + [
            f"- survivor `{n}`" + (" (not run: the run was cut short)" if n in r["unchecked"] else "")
            for n in r["survivors"]]
    code = lambda n: f" (`{r['diffs'][n]}`)".replace(" -> ", "` → `") if r["diffs"].get(n) else ""
    lines = [f"- equivalent `{n}`{code(n)}: {reasons[n]}" for n in sorted(r["diffs"])
             if n in reasons and n not in r["survivors"]]
    lines += [f"- gone `{n}`: no such mutant now (judged: {reasons[n]})" for n in r["gone"]]
    for n in r["survivors"]:
        note = (" (not run: the run was cut short)" if n in r["unchecked"] else
                f" (judged equivalent for `{r['judged'][n][1]}`: another mutant now, re-judge)".replace(" -> ", "` → `")
                if n in r["stale_equivalents"] else "")
        lines.append(f"- survivor `{n}`{code(n)}{note}")
    return lines


_FORKSAFE = ('"""Imported last by the fork server (tools/mutation.py): forking a process whose JAX runtime has started is '
             'unsafe."""\nfrom jax._src import xla_bridge\n\nif xla_bridge.backends_are_initialized():\n'
             '    raise SystemExit("a preloaded module started JAX\'s runtime: the fork server cannot fork it")\n')


def _preload(work: Path, tests: list[str]) -> Path:
    """The fork server's preload list (mutmut's `import` warm-up): the libraries and package modules the tests
    import, anywhere in the file (each mutant's run then starts with them imported instead of importing jax, torch and
    transformers again: seconds a mutant), then a check that none of them started JAX's runtime, which a fork
    cannot carry. Test-local modules (helpers, conftest) are left to pytest."""
    local = {f.stem for f in (ROOT / "tests").glob("*.py")}
    names = []
    for test in [*tests, "tests/helpers.py"]:
        for node in ast.walk(ast.parse((ROOT / test).read_text())):
            found = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else
                     [node.args[0].value] if isinstance(node, ast.Call) and getattr(node.func, "attr", "") ==
                     "importorskip" and node.args and isinstance(node.args[0], ast.Constant) else [])
            names += [n for n in found if n.split(".")[0] not in local | {"__future__"} and n not in names]
    (work / "preload").mkdir(exist_ok=True)
    (work / "preload" / "_mutation_forksafe.py").write_text(_FORKSAFE)
    (work / "preload.txt").write_text("\n".join([*names, "_mutation_forksafe"]) + "\n")
    return work / "preload.txt"


def _test_env() -> dict:
    """os.environ with what tests/conftest.py sets before JAX is imported (the compilation cache, the probed
    code-generation flags): the fork server imports JAX before any conftest runs."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  (its module level sets the variables)
    return dict(os.environ)


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
