"""A run directory as one thing: what train writes and what eval and generate read.

    RUN/config.json       the resolved config (model.vocab_size filled in)
    RUN/tokenizer.json    the tokenizer (a run restores without its training data)
    RUN/metrics.jsonl     one object per line: step, split, metrics; exactly one history, no duplicate steps
    RUN/tb/               TensorBoard events of the same metrics
    RUN/checkpoints/      orbax checkpoints: latest/ (newest N) and best/ (jaxformer.checkpoints)
    RUN/attic/            what was set aside, never deleted: unreadable or superseded checkpoints, the history
                          of an attempt that left no checkpoint
    RUN/.lock             held (flock) by the one trainer allowed at a time

`RunDir.lock()` opens a run for training; `load_model` restores a model (no optimizer, no data) for inference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import jax
from flax import nnx

from jaxformer.checkpoints import Checkpoints
from jaxformer.config import Config, ConfigError, resolve_vocab, to_dict
from jaxformer.configio import from_dict
from jaxformer.data import load_tokenizer, save_tokenizer
from jaxformer.errors import CheckpointError, RunDirError
from jaxformer.distributed import is_primary
from jaxformer.nn import build_model
from jaxformer.quantize import MODES, quantize_model
from jaxformer.parallel import Plan, no_mesh

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
        lines = self.metrics_path.exists() and self.metrics_path.read_text(encoding="utf-8").strip()
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

    def write(self, cfg: Config, tokenizer) -> None:
        """Write config.json (resolved) and tokenizer.json, each atomically."""
        _atomic_write(self.config_path, json.dumps(to_dict(cfg), indent=2))
        tmp = self.tokenizer_path.with_suffix(".tmp")
        save_tokenizer(tokenizer, tmp)
        os.replace(tmp, self.tokenizer_path)

    def checkpoints(self, cfg: Config, read_only: bool = False) -> Checkpoints:
        t = cfg.train
        return Checkpoints(self.checkpoints_path, keep=t.keep_checkpoints, best_metric=t.best_metric,
                           best_mode=t.best_mode, read_only=read_only,
                           set_aside=self.set_aside if is_primary() else None)     # one process moves files

    def read_metrics(self) -> list[dict]:
        """The records of metrics.jsonl (a torn last line, from a crash mid-write, is skipped)."""
        if not self.metrics_path.exists():
            return []
        out = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    out.append(rec)
        return out

    def truncate_metrics(self, step: int) -> None:
        """Keep only the records up to `step` (those after it are recomputed from the checkpoint at `step`)."""
        recs = self.read_metrics()
        keep = [r for r in recs if r["step"] <= step]
        if self.metrics_path.exists():
            _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        if len(keep) < len(recs):
            log.info("%s: %d metric records after step %d are recomputed from that checkpoint",
                     self.metrics_path, len(recs) - len(keep), step)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- inference: model-only restore

@dataclasses.dataclass
class LoadedModel:
    cfg: Config              # resolved (vocab_size filled in)
    tokenizer: object
    model: nnx.Module
    step: int                # the restored checkpoint's step
    which: str               # "best" | "latest": where it actually came from


def load_model(workdir: str | Path, which: str = "best", plan: Plan | None = None,
               quantize: str | None = None) -> LoadedModel:
    """Restore a run's model (no optimizer, no training data) from its `which` checkpoint ("best" or "latest");
    when that kind has no readable step, the other kind is used with a warning, and `which` of the result
    says so. plan: restore straight into that plan's shardings, else onto one device, whatever mesh the run
    was saved from. quantize: "int8" | "int4" | "w8a8" quantizes the restored weights for inference
    (`jaxformer.quantize`).
    Never writes to the run directory."""
    if which not in ("best", "latest"):
        raise ConfigError(f"which={which!r} must be 'best' or 'latest'")
    if quantize is not None and quantize not in MODES:
        raise ConfigError(f"quantize={quantize!r} is not one of {MODES}")
    run = RunDir(workdir)
    if not run.path.is_dir():
        raise ConfigError(f"{str(run.path)!r} is not a run directory")
    cfg = run.read_config()
    if not run.tokenizer_path.exists():
        raise ConfigError(f"{run.path} has no tokenizer.json (not a run directory)")
    tokenizer = run.read_tokenizer()
    cfg = resolve_vocab(cfg, tokenizer.vocab_size)
    with no_mesh():
        graph, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg.model, seed=cfg.train.seed)))
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = plan.state_shardings(abstract) if plan is not None else jax.tree.map(lambda _: one, abstract)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    ckpt = run.checkpoints(cfg, read_only=True)
    try:
        other = "latest" if which == "best" else "best"
        errors = []
        for kind in (which, other):
            try:
                restored = ckpt.restore({"model": abstract}, (kind,))
            except CheckpointError as e:
                errors.append(str(e))
                continue
            if restored is not None:
                if kind != which:
                    log.warning("%s has no readable %s checkpoint; using the %s one (step %d)", run.path, which,
                                kind, restored.step)
                model = nnx.merge(graph, restored.items["model"])
                if quantize is not None:
                    quantize_model(model, quantize)
                return LoadedModel(cfg, tokenizer, model, restored.step, kind)
    finally:
        ckpt.close()
    raise CheckpointError("; ".join(errors) if errors else f"{run.path} has no checkpoint yet (train saves one "
                          f"every train.checkpoint_every={cfg.train.checkpoint_every} steps and at the end)")
