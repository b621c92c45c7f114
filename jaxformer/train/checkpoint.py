"""Run directories: saved config/tokenizer, orbax checkpoints (latest N + best), compatibility checks."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxformer.config import Config, ConfigError, from_dict, to_dict

# Sections that must match to resume from a checkpoint (train.* may change, e.g. more steps).
_MUST_MATCH = ("model", "data", "optim")


class IncompatibleCheckpoint(ConfigError):
    """The run directory holds checkpoints of a different config."""


def check_compatible(workdir: Path, cfg: Config) -> None:
    saved = workdir / "config.json"
    if not saved.exists() or not (workdir / "checkpoints").exists():
        return
    old, new = json.loads(saved.read_text()), to_dict(cfg)
    diffs = [f"{sec}.{k}: {old[sec].get(k)!r} -> {v!r}" for sec in _MUST_MATCH for k, v in new[sec].items()
             if old.get(sec, {}).get(k) != v]
    if diffs:
        raise IncompatibleCheckpoint(f"{workdir} holds checkpoints of another config; differing keys: "
                                     + "; ".join(diffs) + ". Use a new --workdir.")


def load_run_config(workdir: Path) -> Config:
    p = Path(workdir) / "config.json"
    if not p.exists():
        raise ConfigError(f"{workdir} is not a run directory (no config.json)")
    return from_dict(json.loads(p.read_text()))


class Checkpoints:
    """Two orbax managers: `latest` keeps the newest N, `best` keeps the best by an eval metric."""

    def __init__(self, workdir: Path, keep: int, best_metric: str, best_mode: str):
        root = (Path(workdir) / "checkpoints").absolute()
        self.latest = ocp.CheckpointManager(root / "latest", options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True))
        self.best = ocp.CheckpointManager(root / "best", options=ocp.CheckpointManagerOptions(
            max_to_keep=1, create=True, best_fn=lambda m: m[best_metric], best_mode=best_mode))

    def save(self, step: int, state, data_state: dict, metrics: dict | None = None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
        self.latest.save(step, args=args, force=True)
        if metrics is not None:
            self.best.save(step, args=args, metrics=metrics, force=True)
        self.wait()

    def wait(self) -> None:
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def restore(self, state, which: str = "latest", step: int | None = None):
        """-> (step, state, data_state) or None. `state` is the live state, used as the abstract target."""
        mgr = self.latest if which == "latest" else self.best
        step = step if step is not None else (mgr.latest_step() if which == "latest" else mgr.best_step())
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                        data=ocp.args.JsonRestore()))
        return step, out["state"], out["data"]

    def close(self) -> None:
        self.latest.close()
        self.best.close()
