"""A run's orbax checkpoints: `latest` keeps the newest N steps, `best` the best one by an eval metric.

Each step holds the items "model" and "opt" (the training state's two halves), "data" (the input iterator's state,
JSON) and, for EMA and schedule-free runs, the weights they evaluate ("eval_ema", "eval": model states,
`jaxformer.inference.weights`), so any model a run reports restores without its optimizer. A step that cannot be
read (truncated array files, a missing or garbled metadata file, a missing item) is skipped with a warning naming
it and the next older one is tried; once one restores, a writable run moves the bad steps to its attic (nothing is
deleted), so the resumed run can save those steps again.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import orbax.checkpoint as ocp

from jaxformer.errors import CheckpointError

log = logging.getLogger("jaxformer")

KINDS = ("latest", "best")


class Restored(NamedTuple):
    step: int
    kind: str          # "latest" | "best": which manager it came from
    items: dict        # item name -> restored pytree (or dict for "data")


def _barriers(kind: str) -> ocp.options.MultiprocessingOptions:
    """Each manager's own cross-process barrier names. orbax names a save's barriers by the step alone
    ("async_write_complete.5"), so two managers saving one step at once would share them: with several
    processes one manager's barrier then meets the other's and a process waits until the timeout."""
    return ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=f"jaxformer_{kind}")


class Checkpoints:
    """The two managers of `root` (= RUN/checkpoints). read_only: never create or move anything."""

    def __init__(self, root: Path, *, keep: int = 2, best_metric: str = "loss", best_mode: str = "min",
                 read_only: bool = False, set_aside: Callable[[Path, str], Path] | None = None):
        self.root, self.read_only, self._set_aside = Path(root).absolute(), read_only, set_aside
        common = dict(create=not read_only, read_only=read_only)
        if read_only:       # what orbax would otherwise force, warning that it did
            common.update(save_interval_steps=0)
            keep = None
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        absl_log.setLevel(logging.ERROR)     # orbax warns "Given directory is read only" on every read_only open
        try:
            self.managers = {
                "latest": ocp.CheckpointManager(self.root / "latest", options=ocp.CheckpointManagerOptions(
                    max_to_keep=keep, multiprocessing_options=_barriers("latest"), **common)),
                "best": ocp.CheckpointManager(self.root / "best", options=ocp.CheckpointManagerOptions(
                    max_to_keep=None if read_only else 1, best_fn=lambda m: m[best_metric], best_mode=best_mode,
                    multiprocessing_options=_barriers("best"), **common)),
            }
        finally:
            absl_log.setLevel(level)

    def steps(self, kind: str = "latest") -> list[int]:
        return sorted(self.managers[kind].all_steps())

    def has_item(self, kind: str, step: int, item: str) -> bool:
        """Whether step `step` of `kind` saved `item` (checkpoints written before an item existed lack it)."""
        return (self.root / kind / str(step) / item).is_dir()

    def empty(self) -> bool:
        """No step saved in either manager."""
        return not any(self.steps(k) for k in KINDS)

    def save(self, step: int, state: dict, data_state: dict, metrics: dict | None = None) -> None:
        """Save `state` (items: "model", "opt", and the evaluated views of `jaxformer.inference.weights`) and the
        data iterator state as `step` in latest, and in best when eval `metrics` are given. Returns when the
        write is complete."""
        args = ocp.args.Composite(**{k: ocp.args.StandardSave(v) for k, v in state.items()},
                                  data=ocp.args.JsonSave(data_state))
        try:
            with _held_library_errors():
                self.managers["latest"].save(step, args=args, force=True)
                if metrics is not None:
                    self.managers["best"].save(step, args=args, metrics=metrics, force=True)
                for m in self.managers.values():
                    m.wait_until_finished()
        except Exception as e:        # a full disk, a vanished mount, permissions: orbax/tensorstore raise
            done = [s for s in self.steps("latest") if s != step]
            raise CheckpointError(
                f"cannot write the checkpoint of step {step} in {self.root}: {_reason(e)}. "
                + (f"The newest complete checkpoint is step {done[-1]} (kept); " if done else
                   "No earlier checkpoint exists; ")
                + "free space (or fix the disk) and rerun the same command to resume") from None

    def restore(self, target: dict, kinds: tuple[str, ...] = ("latest",), *, data: bool = False,
                check: Callable[[dict], None] | None = None) -> Restored | None:
        """Restore the items named in `target` (item -> abstract or live pytree: shapes, dtypes, shardings; None:
        as saved, plain dicts of arrays on this process's default device),
        and the data iterator state if `data`, from the first readable candidate step: with one kind, "latest"
        tries the newest first and "best" the best first; with several, the newest step of any kind first.
        `check(items)` may raise to reject a step that reads but cannot be used (e.g. a data state of another
        shape): it is then skipped like an unreadable one.
        -> Restored, or None when no step exists. Raises CheckpointError when steps exist but none is readable."""
        candidates = []
        for kind in kinds:
            steps = sorted(self.managers[kind].all_steps(), reverse=True)
            best = self.managers[kind].best_step() if kind == "best" else None
            candidates += [(kind, s) for s in ([best] if best is not None else []) + [s for s in steps if s != best]]
        if len(kinds) > 1:
            candidates.sort(key=lambda c: -c[1])                       # stable: kinds' order breaks ties
        args = {k: ocp.args.StandardRestore(None if v is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, v))
                for k, v in target.items()}
        if data:
            args["data"] = ocp.args.JsonRestore()
        bad = []
        _quiet_aborted_io()                 # before the first read: a failing one reports from other threads
        for kind, step in candidates:
            try:
                out = self.managers[kind].restore(step, args=ocp.args.Composite(**args))
                if check is not None:
                    check({k: out[k] for k in args})
            except Exception as e:  # orbax/tensorstore/JSON errors of one unreadable step: try the next
                bad.append((kind, step, f"{type(e).__name__}: {_first_sentence(e)}"))
                log.warning("checkpoint %s is unreadable (%s)", self.root / kind / str(step), bad[-1][2])
                continue
            if bad:
                log.warning("restored step %d from %s instead of the unreadable step(s) %s", step, kind,
                            ", ".join(f"{k} {s}" for k, s, _ in bad))
                self._set_aside_steps([(k, s) for k, s, _ in bad], "unreadable")
            return Restored(step, kind, {k: out[k] for k in args})
        if bad:
            raise CheckpointError(f"no readable checkpoint in {self.root}: "
                                  + "; ".join(f"{k} step {s}: {why}" for k, s, why in bad))
        return None

    def set_aside_from(self, step: int, reason: str) -> list[tuple[str, int]]:
        """Move every checkpoint of `step` or later (either kind) to the run's attic (nothing is deleted), so that
        no resume, restore or `train.init_from` picks it. -> the (kind, step) pairs moved."""
        steps = [(k, s) for k in KINDS for s in self.steps(k) if s >= step]
        for m in self.managers.values():
            m.wait_until_finished()
        self._set_aside_steps(steps, reason)
        return steps if self._set_aside is not None and not self.read_only else []

    def _set_aside_steps(self, steps: list[tuple[str, int]], reason: str) -> None:
        """Move (kind, step) checkpoints to the run's attic, so that those steps can be saved again."""
        if self._set_aside is None or self.read_only:
            return
        for kind, step in steps:
            moved = self._set_aside(self.root / kind / str(step), f"{reason}-{kind}-{step}")
            log.warning("moved checkpoint %s/%s/%d to %s", self.root, kind, step, moved)
        for kind in {k for k, _ in steps}:
            self.managers[kind].reload()

    def close(self) -> None:
        for m in self.managers.values():
            m.close()


def _reason(e: Exception) -> str:
    """The OS's words for a failed write (e.g. "No space left on device"), else the error's first line."""
    text = str(e)
    for why in ("No space left on device", "Disk quota exceeded", "Permission denied", "Read-only file system",
                "Input/output error"):
        if why in text:
            return why
    return f"{type(e).__name__}: {(text.splitlines() or [''])[0][:200]}"


class _held_library_errors:
    """While a save runs, orbax's ERROR log records (one per failed write, with its traceback) are held back:
    re-emitted if the save succeeds, dropped if it fails (the caller raises one CheckpointError instead)."""

    def __enter__(self):
        _quiet_aborted_io()
        self.records, self.logger = [], logging.getLogger("absl")
        self.filter = lambda r: r.levelno < logging.ERROR or self.records.append(r)
        self.logger.addFilter(self.filter)
        return self

    def __exit__(self, exc_type, *exc):
        self.logger.removeFilter(self.filter)
        for r in self.records if exc_type is None else ():
            self.logger.handle(r)


def _first_sentence(e: Exception) -> str:
    """An error's first sentence (orbax appends how to change its options to shape mismatches)."""
    line = (str(e).splitlines() or [""])[0]
    return re.split(r"(?<=\.) (?=[A-Z])", line)[0][:300]


def _library_noise(e: BaseException | None) -> bool:
    """An exception orbax's or tensorstore's own threads and coroutines raise after an aborted read or write
    ("Event loop is closed", an array index that could not be read): reported by name by the caller already."""
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return True
    tb = getattr(e, "__traceback__", None)
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "/orbax/" in name or "/tensorstore/" in name:
            return True
        tb = tb.tb_next
    return False


def _quiet_aborted_io() -> None:
    """When one array of a step fails to read or write, orbax closes its event loop while tensorstore still
    completes the other reads or writes; their callbacks then raise "Event loop is closed" (printed as
    tracebacks from tensorstore's threads, also after the restore or save has returned) and leave "Future
    exception was never retrieved" log records. That is noise about a failure reported by name (a warning, or
    a CheckpointError): from the first save or restore on, this process drops exactly those (and the
    "coroutine was never awaited" warnings of the same aborted operation, and the errors its coroutines and
    threads leave unraised: `_library_noise`). JAXFORMER_DEBUG=1 keeps them all."""
    global _QUIETED
    if _QUIETED or os.environ.get("JAXFORMER_DEBUG"):     # JAXFORMER_DEBUG=1: every traceback, as it comes
        return
    _QUIETED = True
    closed = lambda e: isinstance(e, RuntimeError) and str(e) == "Event loop is closed"       # noqa: E731
    unraisable, excepthook, thread_hook = sys.unraisablehook, sys.excepthook, threading.excepthook
    sys.unraisablehook = lambda u: None if _library_noise(u.exc_value) else unraisable(u)
    sys.excepthook = lambda t, e, tb: None if closed(e) else excepthook(t, e, tb)    # tensorstore's threads
    threading.excepthook = lambda a: None if _library_noise(a.exc_value) else thread_hook(a)
    logging.getLogger("asyncio").addFilter(lambda record: not re.match(
        r"(Future|_GatheringFuture|Task) exception was never retrieved", record.getMessage()))
    logging.getLogger("absl").addFilter(lambda record: not (      # a failed save's threads, after it raised
        record.levelno >= logging.ERROR and "_SignalingThread.run() raised an exception" in record.getMessage()))
    for coroutine in ("Store._get_array_metadatas", "async_serialize_from_host.<locals>.write_fragment"):
        warnings.filterwarnings("ignore", message=f"coroutine '{re.escape(coroutine)}' was never awaited",
                                category=RuntimeWarning)   # the same aborted read or write, seen from tensorstore


_QUIETED = False
