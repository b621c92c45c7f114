"""A run directory as one thing: what train writes and what eval and generate read.

    RUN/config.json       the resolved config (model.vocab_size filled in)
    RUN/tokenizer.json    the tokenizer (a run restores without its training data)
    RUN/data.json         the fingerprint (sha256) of the text trained on: a resume refuses another corpus
    RUN/metrics.jsonl     one object per line: step, split, metrics; exactly one history, no duplicate steps
    RUN/timings.jsonl     one object per training attempt: where the time went (jaxformer.train.loop)
    RUN/levers.jsonl      one object per training attempt, written as it starts: from_step, the platform and
                          every lever in force, on or off (jaxformer.platforms.in_force)
    RUN/sweep.json        a sweep run's final status (sweep.partial: the wall time of interrupted attempts)
    RUN/viz/              attention heatmaps (jaxformer viz)
    RUN/tb/               TensorBoard events of the same metrics
    RUN/checkpoints/      orbax checkpoints: latest/ (newest N) and best/ (jaxformer.checkpoints)
    RUN/attic/            what was set aside, never deleted: unreadable or superseded checkpoints, the history
                          of an attempt that left no checkpoint
    RUN/.lock             held (flock) by the one trainer allowed at a time

`RunDir.lock()` opens a run for training. This module is the only writer of run files (restoring a model for
inference is `jaxformer.inference.load_model`'s job: it reads them).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from jaxformer.checkpoints import Checkpoints
from jaxformer.config import Config, ConfigError, to_dict
from jaxformer.configio import from_dict
from jaxformer.data import load_tokenizer, save_tokenizer
from jaxformer.errors import RunDirError
from jaxformer.distributed import is_primary

try:
    import fcntl
except ImportError:  # no flock on this platform: a single trainer per run is then the user's responsibility
    fcntl = None

log = logging.getLogger("jaxformer")


class RunDir:
    """Paths and files of one run directory (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / "config.json"
        self.tokenizer_path = self.path / "tokenizer.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.tb_path = self.path / "tb"
        self.checkpoints_path = self.path / "checkpoints"
        self.attic_path = self.path / "attic"
        self.timings_path = self.path / "timings.jsonl"
        self.levers_path = self.path / "levers.jsonl"
        self.sweep_status_path = self.path / "sweep.json"
        self.sweep_partial_path = self.path / "sweep.partial"
        self.viz_path = self.path / "viz"
        self.data_path = self.path / "data.json"

    # ------------------------------------------------------------------ opening for training

    @contextlib.contextmanager
    def lock(self):
        """Create the directory if needed and hold its lock while training. RunDirError if it is not a
        directory, cannot be written, or another process holds the lock."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"workdir {str(self.path)!r} is a file, not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot write to workdir {str(self.path)!r}: {e.strerror or e}") from None
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise RunDirError(f"workdir {str(self.path)!r} is in use by another trainer (pid {holder}); "
                                      f"wait for it to finish, or use another --workdir") from None
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield self
        finally:
            os.close(fd)                               # releases the flock

    def set_aside(self, path: Path, reason: str) -> Path:
        """Move `path` into a new RUN/attic/<time>-<reason>/ and return its new location."""
        return Path(shutil.move(str(path), str(self._attic(reason) / Path(path).name)))

    def has_history(self) -> bool:
        """Metrics from an earlier attempt (lines in metrics.jsonl or TensorBoard events)."""
        lines = self.metrics_path.exists() and self.metrics_path.read_text(encoding="utf-8", errors="replace").strip()
        return bool(lines) or (self.tb_path.exists() and any(self.tb_path.iterdir()))

    def set_aside_history(self, why: str) -> None:
        """Move metrics.jsonl and tb/ of an attempt that left no checkpoint into the attic, with a warning."""
        if not self.has_history():
            return
        dest = self._attic("history")
        for p in (self.metrics_path, self.tb_path):
            if p.exists():
                shutil.move(str(p), str(dest / p.name))
        log.warning("%s: %s; starting at step 0, the earlier metrics are kept in %s", self.path, why, dest)

    def _attic(self, reason: str) -> Path:
        dest = self.attic_path / f"{time.strftime('%Y%m%d-%H%M%S')}-{reason}"
        while dest.exists():
            dest = dest.with_name(dest.name + "~")
        dest.mkdir(parents=True)
        return dest

    # ------------------------------------------------------------------ files

    def read_config(self) -> Config:
        if not self.config_path.exists():
            raise ConfigError(f"{self.path} is not a run directory (no config.json)")
        try:
            return from_dict(json.loads(self.config_path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{self.config_path} is unreadable: {type(e).__name__}: {e}") from None

    def read_tokenizer(self):
        return load_tokenizer(self.tokenizer_path)

    def read_fingerprint(self) -> str | None:
        """The sha256 of the text this run trained on (None: generated data, or a run from before it was kept)."""
        try:
            return json.loads(self.data_path.read_text(encoding="utf-8")).get("sha256")
        except (OSError, ValueError, AttributeError):
            return None

    def write(self, cfg: Config, tokenizer, fingerprint: str | None = None) -> None:
        """Write config.json (resolved), tokenizer.json and data.json (the data's fingerprint), each atomically."""
        _atomic_write(self.config_path, json.dumps(to_dict(cfg), indent=2))
        _atomic_write(self.data_path, json.dumps({"sha256": fingerprint}))
        tmp = self.tokenizer_path.with_suffix(".tmp")
        save_tokenizer(tokenizer, tmp)
        os.replace(tmp, self.tokenizer_path)

    def has_checkpoint(self) -> bool:
        """Whether any checkpoint step was saved (a step folder in checkpoints/latest or checkpoints/best); a
        directory without one holds no run yet: train and import-hf start it afresh."""
        return any(p.name.isdigit() for kind in ("latest", "best") if (self.checkpoints_path / kind).is_dir()
                   for p in (self.checkpoints_path / kind).iterdir())

    def checkpoints(self, cfg: Config, read_only: bool = False) -> Checkpoints:
        t = cfg.train
        return Checkpoints(self.checkpoints_path, keep=t.keep_checkpoints, best_metric=t.best_metric,
                           best_mode=t.best_mode, read_only=read_only,
                           set_aside=self.set_aside if is_primary() else None)     # one process moves files

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.metrics_path)

    def metrics_log(self) -> "MetricsLog":
        """metrics.jsonl opened for appending one record per step and split (close it when done)."""
        return MetricsLog(self.metrics_path)

    def board(self, purge_step: int | None = None) -> "Board":
        """The TensorBoard event writer of RUN/tb (close it when done)."""
        return Board(self.tb_path, purge_step)

    def append_timings(self, record: dict) -> None:
        with self.timings_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def append_levers(self, from_step: int, in_force: dict) -> None:
        """Append the attempt starting at `from_step`'s platform levers ({"platform", "levers"}: what
        `jaxformer.platforms.in_force` returns) to levers.jsonl."""
        with self.levers_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"from_step": from_step, **in_force}) + "\n")

    def read_sweep_status(self) -> dict | None:
        """sweep.json's status, or None (absent or unreadable)."""
        try:
            return json.loads(self.sweep_status_path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, ValueError):
            return None

    def write_sweep_status(self, status: dict) -> None:
        _atomic_write(self.sweep_status_path, json.dumps(status, indent=1))

    def read_partial_wall(self) -> float:
        """Wall seconds of a sweep run's earlier, interrupted attempts (0 if none)."""
        try:
            return float(self.sweep_partial_path.read_text())
        except (OSError, ValueError):
            return 0.0

    def write_partial_wall(self, seconds: float) -> None:
        _atomic_write(self.sweep_partial_path, str(seconds))

    def truncate_metrics(self, step: int) -> None:
        """Keep only the records up to `step` (those after it are recomputed from the checkpoint at `step`)."""
        recs = self.read_metrics()
        keep = [r for r in recs if r["step"] <= step]
        if self.metrics_path.exists():
            _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        if len(keep) < len(recs):
            log.info("%s: %d metric records after step %d are recomputed from that checkpoint",
                     self.metrics_path, len(recs) - len(keep), step)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl (none if it does not exist). A line that is not a JSON object with an int
    "step" (a torn last line from a crash mid-write, bytes that are not UTF-8, a stray value) is skipped."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n"):      # JSONL: only \n ends a record (splitlines also splits at \x1c, \u2028...)
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):    # torn or garbled JSON; a number too long to convert
            continue
        if isinstance(rec, dict) and type(rec.get("step")) is int:
            out.append(rec)
    return out


class MetricsLog:
    """Appends metrics records to a run's metrics.jsonl, one line each, flushed as written. A failed write (a
    full disk) is a RunDirError: the metrics are the run's record, so the run stops."""

    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("a", encoding="utf-8")

    def write(self, step: int, split: str, metrics: dict) -> None:
        try:
            self._f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
            self._f.flush()
        except OSError as e:
            raise RunDirError(f"cannot write {self.path}: {e.strerror or e}; free space (or fix the disk) and "
                              f"rerun the same command: it resumes from the newest checkpoint") from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:         # the failed write was reported already; its buffered tail is recomputed on resume
            pass


class Board:
    """TensorBoard scalars of a run (tensorboardX). Events that cannot be written (a full disk) are a warning,
    once: metrics.jsonl holds the same records. Its writer thread and exit handler are then kept quiet."""

    def __init__(self, path: Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter
        self.failed = False
        self._w = SummaryWriter(str(path), purge_step=purge_step)
        self._quiet_writer_threads()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if not self.failed:
            self._guard(self._w.add_scalar, tag, value, step)

    def close(self) -> None:
        if not self.failed:
            self._guard(self._w.close)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self.failed = True
        log.warning("TensorBoard events in %s are no longer written (%s); metrics.jsonl has the same records",
                    self._w.logdir, e.strerror or e)
        writer = self._w.file_writer.event_writer if self._w.file_writer is not None else None
        if writer is not None:                             # stop its thread; its exit handler would flush
            try:                                           # again, and fail again
                if writer._worker is not None:
                    writer._worker.stop()
            except Exception:       # noqa: BLE001 (the thread's own write failure, already reported above)
                pass
            writer._closed = True

    @staticmethod
    def _quiet_writer_threads() -> None:
        """A failed write kills tensorboardX's logger thread with a printed traceback: keep that one quiet."""
        import threading

        from tensorboardX.event_file_writer import _EventLoggerThread
        hook = threading.excepthook
        if getattr(hook, "_jaxformer", False):
            return

        def quiet(a):
            if not (isinstance(a.thread, _EventLoggerThread) and isinstance(a.exc_value, OSError)):
                hook(a)
        quiet._jaxformer = True
        threading.excepthook = quiet


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
