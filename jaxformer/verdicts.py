"""Published reports checked against their own data: `CSVReport` reads a report back from its committed CSV, so
that `verdict_from_csv` can recompute the verdict a published report states (`jaxformer report SWEEP
--verdict-only`; tests/test_reports.py). The verdict functions a sweep's summary calls (`difference`,
`equivalence`, `within`, ...) live in `jaxformer.stats`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path

from jaxformer.errors import SweepError
from jaxformer.report import Report, _unique_arms
from jaxformer.sweep import Arm, Sweep, runs


class CSVReport(Report):
    """A report read back from its committed OUT/NAME_runs.csv (and OUT/NAME_info.json, what a summary measured
    besides the runs) instead of the run directories: the verdict of a published report can be recomputed, and
    checked, from the files it was written from."""

    def __init__(self, sweep: Sweep, out: str | Path = "docs/ablations"):
        self.sweep, self.root, self.out = sweep, Path("<csv>"), Path(out)
        self.runs = runs(sweep, self.root)
        self.arms = _unique_arms(self.runs)
        self.path = self.out / f"{sweep.name}_runs.csv"
        if not self.path.is_file():
            raise SweepError(f"{self.path} not found: `jaxformer report {sweep.source}` writes it")
        rows = read_runs_csv(self.path)
        wanted = {(r.arm.name, r.seed) for r in self.runs}
        for key, (line, _) in rows.items():
            if key not in wanted:
                raise SweepError(f"{self.path} line {line}: arm {key[0]!r} seed {key[1]} is no run of sweep "
                                 f"{sweep.name} (its grid or seeds changed since): rerun the sweep's report")
        for r in self.runs:
            if (r.arm.name, r.seed) not in rows:
                raise SweepError(f"{self.path} has no row for arm {r.arm.name!r} seed {r.seed} (a run of sweep "
                                 f"{sweep.name}; a report writes every run, unfinished ones as 'missing')")
        self._lines = {r.id: rows[(r.arm.name, r.seed)][0] for r in self.runs}
        self._rows = {r.id: rows[(r.arm.name, r.seed)][1] for r in self.runs}
        self.status = {i: ({"status": row["status"], "wall_s": float(row["wall_s"] or 0)}
                           if row["status"] != "missing" else None) for i, row in self._rows.items()}
        self.records = {}
        self.missing = [i for i, st in self.status.items() if st is None]
        if len(self.missing) == len(self.runs):           # as `report.Report` refuses the run directories
            raise SweepError(f"{self.path} has no finished run (every row is 'missing'): no verdict to compute; "
                             f"the published one is left as it is")
        self.info = _read_info(self.out / f"{sweep.name}_info.json")

    def sizes(self, axis: str, arm: Arm) -> list:
        """Each run's size from its CSV column (written when the sweep has scaling fits)."""
        return self.values(axis, arm)

    def values(self, label: str, arm: Arm) -> list:
        """Each run's value of metric (or size) `label`: a float, None (empty), or for an extra evaluation's
        metric the reason it is n/a. SweepError naming the file, line and column for a column the CSV lacks or
        a cell that is no number."""
        text = self.sweep.metrics.get(label, label).startswith("evals:")     # "n/a" reasons of extra evaluations
        out = []
        for r in self.runs_of(arm):
            row = self._rows[r.id]
            if label not in row:
                raise SweepError(f"{self.path} has no column {label!r} for {r.id}: the report predates this "
                                 f"metric; rerun the sweep's report")
            cell = row[label]
            try:
                out.append(None if cell == "" else float(cell))
            except ValueError:
                if not text:
                    raise SweepError(f"{self.path} line {self._lines[r.id]}, column {label!r}: {cell[:40]!r} is "
                                     f"not a number") from None
                out.append(cell)
        return out


def _read_info(path: Path) -> dict | None:
    """OUT/NAME_info.json (what a summary measured besides the runs) as a JSON object; None where there is none.
    SweepError naming the file for one that is not UTF-8 JSON or not an object."""
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SweepError(f"{path} is not UTF-8 JSON ({e}): a damaged file, or one not written by `jaxformer "
                         f"report`") from None
    if not isinstance(info, dict):
        raise SweepError(f"{path} holds a JSON {type(info).__name__}, not the object `jaxformer report` writes")
    return info


REQUIRED = ("arm", "seed", "status", "wall_s")           # the columns every NAME_runs.csv has (report.write_csv)
STATUSES = ("completed", "diverged", "missing")


def read_runs_csv(path: Path) -> dict[tuple[str, int], tuple[int, dict]]:
    """A report's NAME_runs.csv: (arm, seed) -> (line, {column: cell}). SweepError naming the file, line and
    column for anything damaged: bytes that are not UTF-8, a NUL byte, a missing or repeated column, a row of
    another length than the header, a seed, status or wall_s that is not one, two rows of one run."""
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")       # bad bytes named below
    except OSError as e:
        raise SweepError(f"{path} is unreadable: {e.strerror or e}") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    _check_cells(path, 1, [f"header field {i + 1}" for i in range(len(header))], header)
    for name in REQUIRED:
        if name not in header:
            raise SweepError(f"{path} has no column {name!r} (line 1: {header[:6]!r}...): not a report's runs CSV")
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise SweepError(f"{path} line 1: column {repeated[0]!r} appears more than once")
    out = {}
    for cells in reader:
        line = reader.line_num
        if not cells:
            continue                                                     # a blank line holds no row
        if len(cells) != len(header):
            raise SweepError(f"{path} line {line} has {len(cells)} fields, the header {len(header)}: a row cut "
                             f"short or run together")
        _check_cells(path, line, header, cells)
        row = dict(zip(header, cells))
        key = (row["arm"], _field(path, line, "seed", row["seed"], int))
        _field(path, line, "wall_s", row["wall_s"] or "0", float)
        if row["status"] not in STATUSES:
            raise SweepError(f"{path} line {line}, column 'status': {row['status'][:40]!r} is not one of {STATUSES}")
        if key in out:
            raise SweepError(f"{path} lines {out[key][0]} and {line} are both arm {key[0]!r} seed {key[1]}: one "
                             f"run has one row; which one is right is not for the verdict to guess")
        out[key] = (line, row)
    return out


def _check_cells(path: Path, line: int, names: list, cells: list) -> None:
    """SweepError naming the first cell with a NUL byte or a byte that is not UTF-8 (decoded as a surrogate)."""
    for name, cell in zip(names, cells):
        bad = next((c for c in cell if c == "\0" or "\udc80" <= c <= "\udcff"), None)
        if bad is not None:
            what = "a NUL byte" if bad == "\0" else f"byte {ord(bad) - 0xdc00:#04x}, not UTF-8"
            raise SweepError(f"{path} line {line}, column {name!r}: {what} (a damaged file, or one not written "
                             f"by `jaxformer report`)")


def _field(path: Path, line: int, name: str, cell: str, typ: type):
    """typ(cell), or SweepError naming the file, line and column."""
    try:
        return typ(cell)
    except ValueError:
        what = "an integer" if typ is int else "a number"
        raise SweepError(f"{path} line {line}, column {name!r}: {cell[:40]!r} is not {what}") from None


_VERDICT = re.compile(r"(?ms)^## Verdict\n\n(.*?)\n\n## ")


def committed_verdict(sweep: Sweep, out: str | Path = "docs/ablations") -> str:
    """The verdict section of the published OUT/NAME.md."""
    path = Path(out) / f"{sweep.name}.md"
    if not path.is_file():
        raise SweepError(f"{path} not found (a file, written by `jaxformer report {sweep.source}`); --out names the "
                         f"folder that holds it")
    try:
        m = _VERDICT.search(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SweepError(f"{path}: byte {e.start} is not UTF-8 ({e.object[e.start:e.start + 1]!r}): a damaged "
                         f"file, or one not written by `jaxformer report`; it is left as it is") from None
    if m is None:
        raise SweepError(f"{path} has no '## Verdict' section")
    return m.group(1).strip()


def verdict_from_csv(sweep: Sweep, out: str | Path = "docs/ablations") -> str:
    """The verdict that `sweep.summary` computes from the committed CSVs (CSVReport)."""
    if sweep.summary is None:
        raise SweepError(f"sweep {sweep.name} has no summary()")
    report = CSVReport(sweep, out)
    try:
        return sweep.summary(report).strip()
    except (KeyError, TypeError, IndexError, AttributeError) as e:      # e.g. NAME_info.json edited by hand
        raise SweepError(f"sweep {sweep.name}'s summary() cannot compute a verdict from {report.path}"
                         + (f" and {sweep.name}_info.json" if report.info is not None else "")
                         + f": {type(e).__name__}: {e}") from None


def rewrite_verdict(sweep: Sweep, out: str | Path = "docs/ablations") -> Path:
    """Recompute OUT/NAME.md's verdict from its CSVs and write it in place (the rest of the report stays): for
    a change to how a sweep's verdict is decided, without its runs."""
    path = Path(out) / f"{sweep.name}.md"
    committed_verdict(sweep, out)
    text = path.read_text(encoding="utf-8")
    new = verdict_from_csv(sweep, out)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")    # replaced whole: a full disk leaves the report as it was
    try:
        tmp.write_text(_VERDICT.sub(lambda m: f"## Verdict\n\n{new}\n\n## ", text, count=1), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
