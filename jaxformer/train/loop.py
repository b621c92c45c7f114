"""The training loop: prepare (resolve the config once, check it once, build or restore the state), loop
(one jitted step per batch; metrics to JSONL + TensorBoard; periodic eval and checkpoints; SIGINT/SIGTERM save
and stop; a NaN/Inf loss stops the run naming the step), finish (final eval and decoded examples).

A run directory is resumable whatever happened to it: rerunning the same command continues from the newest
readable checkpoint (an unreadable one is skipped with a warning and set aside), metrics.jsonl keeps exactly
one record per step and split, and a directory whose earlier attempt left no checkpoint starts afresh, its
earlier metrics set aside (jaxformer.runs).

Scale-out is configuration (`parallel.*`): the run connects to its peer processes (jaxformer.distributed),
builds the mesh and rules (jaxformer.parallel.Plan), creates or restores the state in its shards, and each
process feeds only its rows of every global batch. Process 0 alone writes metrics, TensorBoard and the run's
files; every process takes part in each step, evaluation and checkpoint.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from jaxformer import ops
from jaxformer.checkpoints import Checkpoints
from jaxformer.config import Config, resume_differences
from jaxformer.data import Task, resolve
from jaxformer.distributed import initialize, is_primary
from jaxformer.errors import IncompatibleCheckpoint, NonFiniteLoss
from jaxformer.nn import count_params
from jaxformer.parallel import Plan, check_fits
from jaxformer.runs import RunDir
from jaxformer.signals import Held, stderr_line
from jaxformer.inference.evaluate import evaluate, examples, make_eval_step
from jaxformer.inference.weights import checkpoint_items, evaluated
from jaxformer.train.flops import flops_per_token, measure_peak_flops
from jaxformer.train.step import Graphs, abstract_state, init_state, make_train_step, schedule, state_around


@dataclasses.dataclass
class Prepared:
    """Everything the loop needs, built once: the resolved config, the data, the state and where it starts."""
    cfg: Config
    task: Task
    graphs: Graphs
    state: dict
    start: int
    data_state: dict | None
    ckpt: Checkpoints
    plan: Plan

    @property
    def model(self) -> nnx.Module:
        return nnx.merge(self.graphs.model, self.state["model"])


_clock = time.perf_counter         # the phase timings' own reference (tests fake `time` for tokens/s)
TIMINGS = ("setup", "first_step", "steps", "eval", "checkpoint", "examples")


def train(cfg: Config, workdir: str | Path, *, stop_after: int | None = None, progress: str = "auto",
          on_start: Callable[[Prepared], None] | None = None) -> dict:
    """Train (or resume) `cfg` in `workdir`.

    progress: "bar" (tqdm), "lines" (one line per log interval, for logs and pipes), "none", or "auto" (a bar
    when stdout is a terminal, else lines). on_start(prepared): called once the state is built or restored.
    stop_after: stop at that step as if interrupted (tests).
    Returns {"status": "completed" | "interrupted", "signal": "SIGINT" | "SIGTERM" | None, "step", "eval"
    (held-out metrics at "step"; empty after a signal unless that step evaluated), "examples" (decoded held-out
    rows; none after a signal), "workdir", "wall_s", "timings"}. timings (seconds, this attempt; also appended
    to RUN/timings.jsonl): setup (config, data, building or restoring the state), first_step (tracing, XLA
    compilation and the first step), steps (every later step, with the loop's host reads), eval (held-out
    evaluation), checkpoint (saving: each save returns once written), examples (the final decoded examples)."""
    initialize(cfg.parallel)                       # multi-host: before any JAX computation
    if cfg.model.runtime.attention_backend == "pallas" and ops.fused.platform() == "cpu":
        logging.getLogger("jaxformer").warning("model.runtime.attention_backend='pallas' on CPU runs the GPU kernel in "
                                               "Pallas interpret mode: correct, and orders of magnitude slower")
    if cfg.model.ablations:
        logging.getLogger("jaxformer").warning("ablation switches set, this model is wrong on purpose: %s",
                                               ", ".join(cfg.model.ablations))
    run, plan = RunDir(workdir), Plan(cfg.parallel)
    with run.lock() if is_primary() else contextlib.nullcontext():
        t_setup = _clock()
        p = prepare(cfg, run, plan)
        clock = collections.Counter(setup=_clock() - t_setup)
        try:
            if on_start is not None:
                on_start(p)
            t0 = time.perf_counter()
            with plan.use():
                state, step, signame, last_eval = _loop(p, run, stop_after, progress, clock)
                views = evaluated(p.cfg.optim, p.graphs.model, state["model"], state["opt"])
                model, rows = nnx.merge(p.graphs.model, views["eval"]), []
                if signame is None:     # after a signal, exit promptly (a scheduler's grace period is short)
                    t = _clock()
                    if last_eval is None:               # nothing ran, or the loop stopped between evals
                        last_eval = evaluate(p.cfg, p.task, model, plan=plan)
                    n_eval = len(next(iter(p.task.eval.values())))
                    rows = examples(p.task, model, p.cfg.train.num_examples,
                                    min(p.cfg.train.eval_batch_size, n_eval))
                    clock["examples"] += _clock() - t
            status = "completed" if step >= p.cfg.train.steps else "interrupted"
            timings = {k: round(clock[k], 4) for k in TIMINGS}
            if is_primary():
                run.append_timings({"from_step": p.start, "to_step": step, **timings})
            return {"status": status, "signal": signame, "step": step, "eval": last_eval or {}, "examples": rows,
                    "workdir": str(run.path), "wall_s": time.perf_counter() - t0, "timings": timings}
        finally:
            p.ckpt.close()


def prepare(cfg: Config, run: RunDir, plan: Plan) -> Prepared:
    """Resolve the config, check it against the run's checkpoints and the plan (before anything compiles),
    and build or restore the training state in the plan's shardings."""
    ckpt = run.checkpoints(cfg)
    try:
        resuming, restored = not ckpt.empty(), None
        cfg, task = resolve(cfg, run.read_tokenizer() if resuming and run.tokenizer_path.exists() else None)
        if resuming:
            diffs = resume_differences(run.read_config(), cfg)
            if diffs:
                raise IncompatibleCheckpoint(f"{run.path} holds checkpoints of another config; differing keys: "
                                             + "; ".join(diffs) + ". Use a new --workdir.")
            saved = run.read_fingerprint()
            if saved is not None and saved != task.fingerprint:
                raise IncompatibleCheckpoint(f"{run.path} was trained on other text than {cfg.data.path!r} holds "
                                             f"now (sha256 {saved[:12]}… then, {str(task.fingerprint)[:12]}… now); "
                                             f"restore the file or use a new --workdir")
        plan.check_batch(cfg.data.batch_size, "data.batch_size")
        graphs, target = abstract_state(cfg, plan)          # checks every sharded dimension
        check_fits(target)                                  # and that it can fit at all
        if resuming:
            rows = cfg.data.batch_size

            def fits(items):          # a data state this run's input pipeline cannot take is skipped, too
                iter(task.train_dataset(rows, cfg.train.seed, plan.local_rows(rows))).set_state(items["data"])
            restored = ckpt.restore(target, ("latest", "best"), data=True, check=fits)
        primary = is_primary()
        if restored is not None:
            state, start, data_state = {k: restored.items[k] for k in target}, restored.step, restored.items["data"]
            if primary:
                run.truncate_metrics(start)
        else:
            if cfg.train.init_from:                         # fine-tuning: the weights loaded, the optimizer fresh
                from jaxformer.inference.restore import pretrained_state
                graphs, state = state_around(cfg, pretrained_state(cfg.train.init_from, cfg.model, plan,
                                                                     task.tokenizer), plan)
            else:
                graphs, state = init_state(cfg, plan)
            start, data_state = 0, None
            if primary:
                run.set_aside_history("no checkpoint to resume from")
        if primary:
            run.write(cfg, task.tokenizer, task.fingerprint)
    except BaseException:
        ckpt.close()
        raise
    return Prepared(cfg, task, graphs, state, start, data_state, ckpt, plan)


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


class _Progress:
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


class _Watch:
    """What the loop learns about its steps without reading them back each step (see `_track`)."""

    def __init__(self):
        self.bad, self.bad_loss, self.tokens = jnp.int32(-1), jnp.zeros(2, jnp.float32), jnp.float32(0)

    def add(self, step: int, m: dict) -> None:
        self.bad, self.bad_loss, self.tokens = _track(self.bad, self.bad_loss, self.tokens, jnp.int32(step), m)

    def first_bad(self) -> tuple[int | None, float, float]:
        """-> (the first step whose loss or gradient norm was not finite, its loss, its gradient norm), or
        (None, 0, 0)."""
        bad, seen = jax.device_get((self.bad, self.bad_loss))
        return (int(bad), float(seen[0]), float(seen[1])) if bad >= 0 else (None, 0.0, 0.0)

    def take_tokens(self) -> float:
        tokens, self.tokens = float(self.tokens), jnp.float32(0)
        return tokens


def _diverged(ckpt: Checkpoints, first_bad: int, what: str):
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


def _train_record(cfg: Config, m: dict, lr: float, tokens_per_s: float) -> dict:
    """The "train" log record of a step's metrics `m`: loss, accuracy, gradient norms (also per layer:
    grad_norm/decoder/0 .. L-1), the router's losses and load per expert (moe_load/0 .. E-1), lr, tokens/s."""
    rec = {k: m[k] for k in ("loss", "token_accuracy", "grad_norm")}
    if cfg.optim.z_loss:
        rec["log_z2"] = m["log_z2"]
    for stack in ("encoder", "decoder"):
        if f"{stack}_grad_norm" in m:
            rec.update({f"grad_norm/{stack}/{i}": v for i, v in enumerate(m[f"{stack}_grad_norm"])})
    rec.update({k: v for k, v in m.items() if k.startswith("moe_") and k != "moe_load"})
    if "moe_load" in m:
        rec.update({f"moe_load/{e}": v for e, v in enumerate(m["moe_load"])})
    rec.update(lr=lr, tokens_per_s=tokens_per_s)
    return rec


def _evaluate_views(p: Prepared, views: dict, step: int, eval_step, emit) -> dict:
    """Evaluate each view of the weights (eval, eval_ema) on the held-out set and emit it; stop the run when one
    gives a non-finite loss (those weights' own forward pass). -> the "eval" metrics."""
    out = None
    for split, weights in views.items():
        metrics = evaluate(p.cfg, p.task, nnx.merge(p.graphs.model, weights), eval_step, p.plan)
        emit(step, split, metrics)
        out = metrics if split == "eval" else out
        if not math.isfinite(metrics["loss"]):
            _diverged(p.ckpt, step, f"held-out {split} loss is {metrics['loss']} at step {step}")
    return out


class _Emitter:
    """Where metrics go: the run's JSONL log, TensorBoard and the progress bar (the primary process only)."""

    def __init__(self, run: RunDir, p: Prepared, progress: str):
        self.primary = is_primary()
        self.log = run.metrics_log() if self.primary else None
        self.tb = run.board(purge_step=p.start or None) if self.primary else None
        self.bar = _Progress(progress if self.primary else "none", p.cfg.train.steps, p.start)

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


def _check(watch: _Watch, ckpt) -> None:
    """The one host read of the hot loop (at log, eval and checkpoint steps): stop naming the first step whose
    loss or gradient norm was not finite, before any checkpoint could hold its state (a non-finite gradient
    poisons that step's parameters even while its loss is finite). That step's loss was computed with the
    previous step's weights, so those weights are not good either."""
    bad, loss, gnorm = watch.first_bad()
    if bad is not None:
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {gnorm} (loss {loss:.4g})"
        _diverged(ckpt, bad - 1, f"{what} at step {bad}")


def _data_stream(p: Prepared, rows: int):
    """The training batches' iterator, resumed at the checkpoint's data state."""
    data_iter = iter(p.task.train_dataset(rows, p.cfg.train.seed, p.plan.local_rows(rows)))
    if p.data_state is not None:
        data_iter.set_state(p.data_state)
    return data_iter


def _loop(p: Prepared, run: RunDir, stop_after: int | None, progress: str, clock: collections.Counter):
    """-> (state, last step done, signal name or None, last eval metrics or None). Adds its seconds to clock
    (first_step, steps, eval, checkpoint)."""
    cfg, tc, ckpt, plan = p.cfg, p.cfg.train, p.ckpt, p.plan
    rows = cfg.data.batch_size
    data_iter = _data_stream(p, rows)
    train_step = make_train_step(p.graphs, cfg, plan)
    bytes_of = getattr(p.task.tokenizer, "token_bytes", None)
    eval_step = make_eval_step(p.graphs.model, cfg, plan, bytes_of() if bytes_of else None)
    lr_at, base_key = schedule(cfg.optim, tc.steps), jax.random.key(tc.seed)
    emit = _Emitter(run, p, progress)
    state, step, last_eval = p.state, p.start, None
    t_log, watch = time.perf_counter(), _Watch()
    params = count_params(nnx.merge(p.graphs.model, state["model"]))["total"]
    fpt, peak = flops_per_token(cfg, params), (tc.peak_flops or measure_peak_flops()) * jax.device_count()

    # The loop never waits for the device between those reads: the next batch is fetched and put on the
    # device while the current step runs (the data state saved with a checkpoint is the one of its step).
    batch = plan.global_batch(next(data_iter), rows) if p.start < tc.steps else None
    t_loop = _clock()
    try:
        with Held() as sig:
            for step in range(p.start + 1, tc.steps + 1):
                state, m = train_step(state, batch, jax.random.fold_in(base_key, step - 1))
                if step == p.start + 1:           # the one extra wait of a run: how long compiling took
                    jax.block_until_ready(m)
                    clock["first_step"] += _clock() - t_loop
                watch.add(step, m)
                data_state = data_iter.get_state()
                if step < tc.steps:
                    batch = plan.global_batch(next(data_iter), rows)
                emit.bar.step()
                eval_now = step % tc.eval_every == 0 or step == tc.steps
                if STDOUT_CLOSED and sig.received is None:
                    sig.received = "SIGPIPE"                 # stdout closed: stop as on SIGTERM
                    stderr_line(f"stdout was closed: stopping at step {step} with a checkpoint, as on SIGTERM")
                stopping = sig.received or (stop_after is not None and step >= stop_after)
                saving = eval_now or step % tc.checkpoint_every == 0 or stopping
                if step % tc.log_every == 0 or step == tc.steps or saving:
                    _check(watch, ckpt)
                if step % tc.log_every == 0 or step == tc.steps:
                    now = time.perf_counter()
                    rec = _train_record(cfg, m, lr_at(step - 1), watch.take_tokens() / max(now - t_log, 1e-9))
                    rec["mfu"] = rec["tokens_per_s"] * fpt / peak
                    emit(step, "train", rec)
                    t_log = now
                last_eval, views = None, None
                if eval_now:
                    t = _clock()
                    views = evaluated(cfg.optim, p.graphs.model, state["model"], state["opt"])
                    last_eval = _evaluate_views(p, views, step, eval_step, emit)
                    clock["eval"] += _clock() - t
                if saving:
                    t = _clock()
                    ckpt.save(step, checkpoint_items(cfg.optim, p.graphs.model, state, views), data_state, last_eval)
                    clock["checkpoint"] += _clock() - t
                if stopping:
                    return state, step, sig.received, last_eval
    finally:
        clock["steps"] += (_clock() - t_loop - clock["first_step"] - clock["eval"]
                           - clock["checkpoint"])
        emit.close()
    return state, step, None, last_eval
