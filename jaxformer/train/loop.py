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
import time
from pathlib import Path
from typing import Callable

import jax
from flax import nnx

from jaxformer import ops, platforms
from jaxformer.checkpoints import Checkpoints
from jaxformer.config import Config, resume_differences
from jaxformer.data import Task, resolve
from jaxformer.distributed import initialize, is_primary
from jaxformer.errors import IncompatibleCheckpoint
from jaxformer.nn import count_params
from jaxformer.memory import check_fits
from jaxformer.parallel import Plan
from jaxformer.runs import RunDir
from jaxformer.signals import Held, stderr_line
from jaxformer.inference.evaluate import evaluate, examples, make_eval_step
from jaxformer.inference.weights import checkpoint_items, evaluated
from jaxformer.train import monitor
from jaxformer.train.flops import flops_per_token, measure_peak_flops
from jaxformer.train.monitor import Emitter, Watch, check_finite, diverged, train_record
from jaxformer.train.optim import schedule
from jaxformer.train.step import Graphs, abstract_state, init_state, make_train_step, state_around


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


_clock = time.perf_counter         # the phase timings' own reference (tests fake `monitor.time` for tokens/s)
TIMINGS = ("setup", "first_step", "steps", "eval", "checkpoint", "examples")


def train(cfg: Config, workdir: str | Path, *, stop_after: int | None = None, progress: str = "auto",
          on_start: Callable[[Prepared], None] | None = None) -> dict:
    """Train (or resume) `cfg` in `workdir`.

    The run directory holds config.json, tokenizer.json, metrics.jsonl (and TensorBoard's tb/), timings.jsonl
    and checkpoints/ (latest and best); rerunning the same call resumes from the newest readable checkpoint
    (module docstring). Stopped by SIGINT/SIGTERM, it saves and returns "interrupted".

    Args:
      cfg: the run's `Config` (model.vocab_size 0: taken from the data's tokenizer).
      workdir: the run directory: new, or one this config trained in before (resumed).
      stop_after: stop at that step as if interrupted (tests).
      progress: "bar" (tqdm), "lines" (one line per log interval, for logs and pipes), "none", or "auto" (a bar
        when stdout is a terminal, else lines).
      on_start: on_start(prepared): called once the state is built or restored.

    Returns:
      {"status": "completed" | "interrupted", "signal": "SIGINT" | "SIGTERM" | None, "step", "eval"
        (held-out metrics at "step"; empty after a signal unless that step evaluated), "examples" (decoded
        held-out rows; none after a signal), "workdir", "wall_s", "timings"}. timings (seconds, this attempt;
        also appended to RUN/timings.jsonl): setup (config, data, building or restoring the state), first_step
        (tracing, XLA compilation and the first step), steps (every later step, with the loop's host reads),
        eval (held-out evaluation), checkpoint (saving: each save returns once written), examples (the final
        decoded examples).

    Raises:
      ConfigError: a config the data or the devices cannot run (vocabulary, pad id, batch rows against the
        mesh, a model that cannot fit); IncompatibleCheckpoint (a ConfigError) when `workdir` holds checkpoints
        of another config or was trained on other text.
      DataError: the data cannot be read (`jaxformer.data.build_task`).
      RunDirError: `workdir` is a file, not writable, or in use by another trainer.
      NonFiniteLoss: the loss became NaN or infinite (naming the step and the newest checkpoint left).

    Examples:
      >>> import os, tempfile
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.train.loop import train
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16,
      ...                data__num_train=64, data__num_eval=16, data__batch_size=16, train__steps=2,
      ...                train__eval_batch_size=16, train__num_examples=1, train__peak_flops=1e12)
      >>> workdir = tempfile.mkdtemp()
      >>> out = train(cfg, workdir, progress="none")               # digit reversal, shrunk to 2 steps
      >>> out["status"], out["step"], sorted(out["eval"]), len(out["examples"])
      ('completed', 2, ['bits_per_byte', 'exact_match', 'loss', 'token_accuracy'], 1)
      >>> [f for f in sorted(os.listdir(workdir)) if not f.startswith(".")]
      ['checkpoints', 'config.json', 'data.json', 'levers.jsonl', 'metrics.jsonl', 'tb', 'timings.jsonl',
       'tokenizer.json']
      >>> train(cfg, workdir, progress="none")["step"]             # the same call again: resumed, done
      2
    """
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
        plan.check_pipeline(cfg)                            # layers and rows against the pipeline stages
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
            run.append_levers(start, platforms.in_force())      # what the steps about to be traced are built with
    except BaseException:
        ckpt.close()
        raise
    return Prepared(cfg, task, graphs, state, start, data_state, ckpt, plan)


def _evaluate_views(p: Prepared, views: dict, step: int, eval_step, emit) -> dict:
    """Evaluate each view of the weights (eval, eval_ema) on the held-out set and emit it; stop the run when one
    gives a non-finite loss (those weights' own forward pass). -> the "eval" metrics."""
    out = None
    for split, weights in views.items():
        metrics = evaluate(p.cfg, p.task, nnx.merge(p.graphs.model, weights), eval_step, p.plan)
        emit(step, split, metrics)
        out = metrics if split == "eval" else out
        if not math.isfinite(metrics["loss"]):
            diverged(p.ckpt, step, f"held-out {split} loss is {metrics['loss']} at step {step}")
    return out


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
    emit = Emitter(run, tc.steps, p.start, progress)
    state, step, last_eval = p.state, p.start, None
    watch = Watch()
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
                if monitor.STDOUT_CLOSED and sig.received is None:
                    sig.received = "SIGPIPE"                 # stdout closed: stop as on SIGTERM
                    stderr_line(f"stdout was closed: stopping at step {step} with a checkpoint, as on SIGTERM")
                stopping = sig.received or (stop_after is not None and step >= stop_after)
                saving = eval_now or step % tc.checkpoint_every == 0 or stopping
                if step % tc.log_every == 0 or step == tc.steps or saving:
                    check_finite(watch, ckpt)
                if step % tc.log_every == 0 or step == tc.steps:
                    emit(step, "train", train_record(cfg, m, lr_at(step - 1), watch.take_rate(), fpt / peak))
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
