"""The training loop: progress bar, JSONL + TensorBoard metrics, periodic eval, checkpoints, exact resume,
SIGINT/SIGTERM handling and a NaN/Inf guard."""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm

from jaxformer.config import Config, ConfigError, to_dict
from jaxformer.data import Task, build_task, load_tokenizer, save_tokenizer
from jaxformer.decode import generate_seq2seq
from jaxformer.nn import build_model
from jaxformer.train.checkpoint import Checkpoints, check_compatible
from jaxformer.train.step import make_eval_step, make_train_step, optimizer, schedule


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN/Inf; the message names the step. Checkpoints before it are kept."""


def resolve(cfg: Config, tokenizer) -> Config:
    """Fill model.vocab_size from the tokenizer (0 = auto) and check it is large enough."""
    v = tokenizer.vocab_size
    if cfg.model.vocab_size == 0:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=v))
    if cfg.model.vocab_size < v:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {v}")
    return cfg


def model_and_optimizer(cfg: Config):
    """-> (graphdef, state) of (model, optimizer) for a resolved config: the training state and the
    checkpoint layout."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    opt = nnx.Optimizer(model, optimizer(cfg.optim, cfg.train.steps), wrt=nnx.Param)
    return nnx.split((model, opt))


def setup(cfg: Config, workdir: Path | None):
    """-> (cfg resolved, task, graphdef, state). Reuses a run's saved tokenizer when present."""
    tok_path = workdir / "tokenizer.json" if workdir else None
    task = build_task(cfg.data, load_tokenizer(tok_path) if tok_path and tok_path.exists() else None)
    cfg = resolve(cfg, task.tokenizer)
    graphdef, state = model_and_optimizer(cfg)
    return cfg, task, graphdef, state


def evaluate(cfg: Config, task: Task, graphdef, state, eval_step=None) -> dict:
    """Held-out loss and token accuracy (teacher forced); exact-match by greedy decoding for seq2seq."""
    eval_step = eval_step or make_eval_step(graphdef, cfg)
    tot = {"nll": 0.0, "correct": 0.0, "count": 0.0}
    exact, n = 0, 0
    model = nnx.merge(graphdef, state)[0]
    for batch in task.eval_batches(cfg.train.eval_batch_size):
        s = eval_step(state, batch)
        for k in tot:
            tot[k] += float(s[k])
        if task.kind == "seq2seq":
            pred = np.asarray(predict(model, task, batch["src"], batch["tgt_out"].shape[1]))
            exact += int(np.all(pred == batch["tgt_out"], axis=1).sum())
            n += len(pred)
    out = {"loss": tot["nll"] / tot["count"], "token_accuracy": tot["correct"] / tot["count"]}
    if task.kind == "seq2seq":
        out["exact_match"] = exact / n
    return out


def predict(model, task: Task, src, width: int):
    tok = task.tokenizer
    return generate_seq2seq(model, src, max_new=width, bos_id=tok.bos_id, eos_id=tok.eos_id)


def examples(cfg: Config, task: Task, graphdef, state, k: int) -> list[dict]:
    """k decoded held-out examples: input, target, prediction, ok."""
    model = nnx.merge(graphdef, state)[0]
    tok, ev = task.tokenizer, {a: b[:k] for a, b in task.eval.items()}
    rows = []
    if task.kind == "seq2seq":
        pred = np.asarray(predict(model, task, ev["src"], ev["tgt_out"].shape[1]))
        for s, t, p in zip(ev["src"], ev["tgt_out"], pred):
            rows.append({"input": tok.decode(s), "target": tok.decode(t), "prediction": tok.decode(p),
                         "ok": bool(np.all(p == t))})
    else:
        logits = jax.jit(lambda st, x: nnx.merge(graphdef, st)[0](x))(state, ev["inputs"])
        for x, y, p in zip(ev["inputs"], ev["targets"], np.asarray(logits.argmax(-1))):
            rows.append({"input": tok.decode(x), "target": tok.decode(y), "prediction": tok.decode(p),
                         "ok": bool(np.all(p == y))})
    return rows


class _Signals:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and returns."""

    def __init__(self):
        self.received = None

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


def train(cfg: Config, workdir: str | Path, *, stop_after: int | None = None, progress: bool = True) -> dict:
    """Train (or resume) `cfg` in `workdir`. stop_after: stop at that step as if interrupted (tests).
    Returns a summary dict with the final eval metrics and the run status."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    check_compatible(workdir, cfg)
    cfg, task, graphdef, state = setup(cfg, workdir)
    check_compatible(workdir, cfg)
    (workdir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    save_tokenizer(task.tokenizer, workdir / "tokenizer.json")

    tc = cfg.train
    ckpt = Checkpoints(workdir, tc.keep_checkpoints, tc.best_metric, tc.best_mode)
    data_iter = iter(task.train_dataset(cfg.data.batch_size, cfg.train.seed))
    start = 0
    restored = ckpt.restore(state)
    if restored is not None:
        start, state, data_state = restored
        data_iter.set_state(data_state)
    train_step, eval_step = make_train_step(graphdef, cfg), make_eval_step(graphdef, cfg)
    lr_at = schedule(cfg.optim, tc.steps)
    base_key = jax.random.key(tc.seed)
    log = (workdir / "metrics.jsonl").open("a")
    tb = SummaryWriter(str(workdir / "tb"))

    def emit(step, split, metrics):
        rec = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        for k, v in metrics.items():
            tb.add_scalar(f"{split}/{k}", float(v), step)

    status, last_eval, step = "completed", None, start
    bar = tqdm(total=tc.steps, initial=start, disable=not progress, desc="train", dynamic_ncols=True)
    t0, toks = time.perf_counter(), 0.0
    try:
        with _Signals() as sig:
            for step in range(start, tc.steps):
                batch = next(data_iter)
                state, m = train_step(state, batch, jax.random.fold_in(base_key, step))
                loss = float(m["loss"])
                if not math.isfinite(loss):
                    raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; last good checkpoint: step "
                                        f"{ckpt.latest.latest_step()} in {workdir / 'checkpoints'}")
                toks += float(m["tokens"])
                done = step + 1
                bar.update(1)
                if done % tc.log_every == 0 or done == tc.steps:
                    dt = time.perf_counter() - t0
                    rec = {k: m[k] for k in ("loss", "token_accuracy", "grad_norm")}
                    rec.update(lr=lr_at(step), tokens_per_s=toks / max(dt, 1e-9))
                    emit(done, "train", rec)
                    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{toks / max(dt, 1e-9):,.0f}")
                eval_now = done % tc.eval_every == 0 or done == tc.steps
                if eval_now:
                    last_eval = evaluate(cfg, task, graphdef, state, eval_step)
                    emit(done, "eval", last_eval)
                if eval_now or done % tc.checkpoint_every == 0:
                    ckpt.save(done, state, data_iter.get_state(), last_eval if eval_now else None)
                if sig.received or (stop_after is not None and done >= stop_after):
                    status = f"interrupted ({sig.received or 'stop_after'}) at step {done}"
                    if not eval_now and done % tc.checkpoint_every:
                        ckpt.save(done, state, data_iter.get_state())
                    break
    finally:
        bar.close()
        log.close()
        tb.close()
        ckpt.close()
    if last_eval is None:
        last_eval = evaluate(cfg, task, graphdef, state, eval_step)
    return {"status": status, "step": step + 1 if start < tc.steps else start, "eval": last_eval,
            "examples": examples(cfg, task, graphdef, state, tc.num_examples), "workdir": str(workdir),
            "wall_s": time.perf_counter() - t0}


def restore_run(workdir: str | Path, cfg: Config, which: str = "best"):
    """A run's `which` checkpoint ("best", falling back to "latest"; or "latest") for its resolved config
    -> (step, graphdef, state) of (model, optimizer)."""
    workdir = Path(workdir)
    if which not in ("best", "latest"):
        raise ConfigError(f"which={which!r} must be 'best' or 'latest'")
    graphdef, state = model_and_optimizer(cfg)
    ckpt = Checkpoints(workdir, cfg.train.keep_checkpoints, cfg.train.best_metric, cfg.train.best_mode)
    try:
        restored = ckpt.restore(state, which) or ckpt.restore(state, "latest")
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {workdir / 'checkpoints'}")
    step, state, _ = restored
    return step, graphdef, state


def evaluate_run(workdir: str | Path, which: str = "best") -> dict:
    """Restore a run's best (or latest) checkpoint and evaluate it on the held-out set."""
    from jaxformer.train.checkpoint import load_run_config
    workdir = Path(workdir)
    cfg = load_run_config(workdir)
    tok_path = workdir / "tokenizer.json"
    task = build_task(cfg.data, load_tokenizer(tok_path) if tok_path.exists() else None)
    cfg = resolve(cfg, task.tokenizer)
    step, graphdef, state = restore_run(workdir, cfg, which)
    return {"step": step, "eval": evaluate(cfg, task, graphdef, state),
            "examples": examples(cfg, task, graphdef, state, cfg.train.num_examples)}
