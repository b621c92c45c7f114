"""What the training loop watches and reports: the device-side finiteness and token bookkeeping of each step
(read on the host only at log, eval and checkpoint steps), stopping a diverged run, the train log record, and
where metrics go (JSONL, TensorBoard, the progress bar or one line per interval; stdout that went away)."""
from __future__ import annotations

import math
import os
import sys
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxformer.checkpoints import Checkpoints
from jaxformer.config import Config
from jaxformer.distributed import is_primary
from jaxformer.errors import NonFiniteLoss
from jaxformer.runs import RunDir


def detach_stdout() -> None:
    """Point stdout at /dev/null after a write to it failed (`| head` exited, a `less` quit, the terminal closed):
    later prints, and the interpreter's final flush, then go nowhere instead of raising. STDOUT_CLOSED records
    it: a training loop stops as on SIGTERM, saving its checkpoint."""
    global STDOUT_CLOSED
    STDOUT_CLOSED = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):      # no real file descriptor behind sys.stdout
        sys.stdout = open(os.devnull, "w")


STDOUT_CLOSED = False


class Progress:
    """A tqdm bar when stdout is a terminal; otherwise one printed line per log interval (a log file gets no
    carriage-return frames)."""

    def __init__(self, mode: str, total: int, start: int):
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode, self.total = mode, total
        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True) if mode == "bar" else None

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            try:
                self.bar.update(n)
            except OSError:
                detach_stdout()

    def log(self, step: int, split: str, metrics: dict) -> None:
        if self.bar is not None and split == "train":
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:,.0f}")
        elif self.mode != "none":
            text = "  ".join(f"{k} {v:,.0f}" if abs(v) >= 1e4 else f"{k} {v:.4g}" for k, v in metrics.items()
                             if "/" not in k)             # per-expert loads go to the logs only
            line = f"{split} step {step}/{self.total}  {text}"
            try:
                (self.bar.write(line) if self.bar is not None else print(line, flush=True))
            except OSError:                              # stdout went away: see detach_stdout
                detach_stdout()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@jax.jit
def _track(bad, bad_loss, tokens, step, m):
    """Device-side bookkeeping of one step: the first step whose loss or gradient norm is not finite (−1: none
    yet; a non-finite gradient makes that step's update, and so its parameters, non-finite), its loss, and the
    target tokens since the last log."""
    new = (bad < 0) & ~(jnp.isfinite(m["loss"]) & jnp.isfinite(m["grad_norm"]))
    seen = jnp.stack([m["loss"], m["grad_norm"]]).astype(jnp.float32)
    return jnp.where(new, step, bad), jnp.where(new, seen, bad_loss), tokens + m["tokens"]


class Watch:
    """What the loop learns about its steps without reading them back each step (see `_track`)."""

    def __init__(self):
        self.bad, self.bad_loss, self.tokens = jnp.int32(-1), jnp.zeros(2, jnp.float32), jnp.float32(0)
        self.since = time.perf_counter()

    def add(self, step: int, m: dict) -> None:
        self.bad, self.bad_loss, self.tokens = _track(self.bad, self.bad_loss, self.tokens, jnp.int32(step), m)

    def first_bad(self) -> tuple[int | None, float, float]:
        """-> (the first step whose loss or gradient norm was not finite, its loss, its gradient norm), or
        (None, 0, 0)."""
        bad, seen = jax.device_get((self.bad, self.bad_loss))
        return (int(bad), float(seen[0]), float(seen[1])) if bad >= 0 else (None, 0.0, 0.0)

    def take_rate(self) -> float:
        """Target tokens per second since the last call (or the start), a host read."""
        now = time.perf_counter()
        rate = float(self.tokens) / max(now - self.since, 1e-9)
        self.tokens, self.since = jnp.float32(0), now
        return rate


def diverged(ckpt: Checkpoints, first_bad: int, what: str):
    """Stop a diverged run: the weights after step `first_bad` (and every later step's) gave a non-finite loss,
    gradient or held-out loss, so the checkpoints of those steps are moved to the attic (kept, never resumed or
    loaded); raise NonFiniteLoss naming the newest checkpoint left, whose own forward pass and gradient were
    finite (the next step's, computed with its weights)."""
    moved = ckpt.set_aside_from(first_bad, "non-finite")
    good = max(((s, k) for k in ("latest", "best") for s in ckpt.steps(k)), default=None)
    where = (f"last good checkpoint: step {good[0]} in {ckpt.root / good[1]}" if good else
             f"no {'good ' if moved else ''}checkpoint was saved before it")
    if moved:
        where += (f" (the checkpoint(s) of step {', '.join(sorted({str(s) for _, s in moved}))}, whose weights "
                  f"were not finite in use, moved to the run's attic)")
    raise NonFiniteLoss(f"{what}; {where}. Train again in a new --workdir (a run resumes only with its own "
                        f"optim.*) with a lower optim.lr, a higher optim.warmup_steps or optim.clip_norm set"
                        + (", or start it from this one with --set train.init_from=RUN" if good else ""))


def train_record(cfg: Config, m: dict, lr: float, tokens_per_s: float, mfu_per_token: float) -> dict:
    """The "train" log record of a step's metrics `m`: loss, accuracy, gradient norms (also per layer:
    grad_norm/decoder/0 .. L-1), the router's losses and load per expert (moe_load/0 .. E-1), lr, tokens/s and
    MFU (tokens/s × mfu_per_token: FLOPs per token over the devices' peak FLOP/s)."""
    rec = {k: m[k] for k in ("loss", "token_accuracy", "grad_norm")}
    if cfg.optim.z_loss:
        rec["log_z2"] = m["log_z2"]
    for stack in ("encoder", "decoder"):
        if f"{stack}_grad_norm" in m:
            rec.update({f"grad_norm/{stack}/{i}": v for i, v in enumerate(m[f"{stack}_grad_norm"])})
    rec.update({k: v for k, v in m.items() if k.startswith("moe_") and k != "moe_load"})
    if "moe_load" in m:
        rec.update({f"moe_load/{e}": v for e, v in enumerate(m["moe_load"])})
    rec.update(lr=lr, tokens_per_s=tokens_per_s, mfu=tokens_per_s * mfu_per_token)
    return rec


class Emitter:
    """Where metrics go: the run's JSONL log, TensorBoard and the progress bar (the primary process only)."""

    def __init__(self, run: RunDir, steps: int, start: int, progress: str):
        self.primary = is_primary()
        self.log = run.metrics_log() if self.primary else None
        self.tb = run.board(purge_step=start or None) if self.primary else None
        self.bar = Progress(progress if self.primary else "none", steps, start)

    def __call__(self, step: int, split: str, metrics: dict) -> None:
        rec = {k: float(v) for k, v in metrics.items()}
        if not self.primary:
            return
        self.log.write(step, split, rec)
        for k, v in rec.items():
            self.tb.add_scalar(f"{split}/{k}", v, step)
        self.bar.log(step, split, rec)

    def close(self) -> None:
        self.bar.close()
        if self.primary:
            self.log.close()
            self.tb.close()     # neither raises: a failed write was reported (or raised) where it happened


def check_finite(watch: Watch, ckpt: Checkpoints) -> None:
    """The one host read of the hot loop (at log, eval and checkpoint steps): stop naming the first step whose
    loss or gradient norm was not finite, before any checkpoint could hold its state (a non-finite gradient
    poisons that step's parameters even while its loss is finite). That step's loss was computed with the
    previous step's weights, so those weights are not good either."""
    bad, loss, gnorm = watch.first_bad()
    if bad is not None:
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {gnorm} (loss {loss:.4g})"
        diverged(ckpt, bad - 1, f"{what} at step {bad}")
