"""Task files of `jaxformer eval-tasks` (the formats: jaxformer.inference.tasks), read and checked before anything
is scored: every value a user can get wrong refused naming the file, line and field; and the name each file's
results are written under."""
from __future__ import annotations

import json
from pathlib import Path

from jaxformer.data import jsonl
from jaxformer.errors import DataError


class _Number(float):
    """A JSON number with a fraction or exponent, as its text in the file (a numeric answer compares as that)."""

    def __new__(cls, text: str):
        number = super().__new__(cls, text)
        number.text = text
        return number


def _value(v) -> str:
    return json.dumps(v)[:80]


def _check_example(path: Path, line: int, r: dict, kind: str) -> None:
    """DataError naming the file, line and field where an example's values are not what `kind` needs."""
    if kind == "multiple_choice":
        if not isinstance(r["context"], str):
            raise DataError(f"{path}:{line}: \"context\" must be a string, not {_value(r['context'])}")
        choices = r["choices"]
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise DataError(f"{path}:{line}: \"choices\" must be a non-empty list of strings, not {_value(choices)}")
        if "" in choices:
            raise DataError(f"{path}:{line}: \"choices\"[{choices.index('')}] is empty (an empty choice has "
                            f"log-likelihood 0: it would always win)")
        a = r["answer"]
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(choices):
            raise DataError(f"{path}:{line}: \"answer\" {_value(a)} is not an index into its {len(choices)} "
                            f"choices (an integer 0..{len(choices) - 1})")
        return
    if not isinstance(r["prompt"], str):
        raise DataError(f"{path}:{line}: \"prompt\" must be a string, not {_value(r['prompt'])}")
    a = r["answer"]
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        raise DataError(f"{path}:{line}: \"answer\" must be a string or a number, not {_value(a)}")
    r["answer"] = a if isinstance(a, str) else getattr(a, "text", str(a))      # GSM8K's 4 is the text "4"


def read_task(path: str | Path) -> tuple[str, list[dict]]:
    """-> (kind "multiple_choice" | "generation", examples); DataError naming the file and line otherwise. A
    numeric generation answer is read as its text ({"answer": 4} is "4")."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task file {str(path)!r} not found")
    rows = list(jsonl.objects(path, parse_float=_Number))
    if not rows:
        raise DataError(f"task file {path} has no examples")
    first = rows[0][1]
    kind = "multiple_choice" if "choices" in first else "generation" if "prompt" in first else None
    need = {"multiple_choice": ("context", "choices", "answer"), "generation": ("prompt", "answer")}.get(kind)
    for n, (line, r) in enumerate(rows, 1):
        if need is None or any(k not in r for k in need):
            raise DataError(f"{path}:{line}: example {n} is neither multiple choice ({{context, choices, answer: "
                            f"index}}) nor generation ({{prompt, answer}}): {json.dumps(r)[:200]}")
        _check_example(path, line, r, kind)
    return kind, [r for _, r in rows]


def task_names(paths: list[str]) -> list[str]:
    """Each task file's results name: its stem, or where files share a stem, as many of the folder names before
    it as tell them apart, joined by '-' (a/x.jsonl, b/x.jsonl -> a-x, b-x). DataError: a file given twice."""
    parts = [Path(p).resolve().with_suffix("").parts[1:][::-1] for p in paths]
    names, deepest = [], max(len(q) for q in parts) + 1
    for i, mine in enumerate(parts):
        others = [q for j, q in enumerate(parts) if j != i]
        if mine in others:
            raise DataError(f"--tasks names {paths[i]} twice")
        k = next(k for k in range(1, deepest) if all(q[:k] != mine[:k] for q in others))
        names.append("-".join(mine[:k][::-1]))
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise DataError(f"--tasks {paths[names.index(name)]} and {paths[i]} would both write {name}.json")
    return names
