"""Held-out evaluation of a model: teacher-forced loss and token accuracy, greedy exact match for seq2seq,
decoded examples; `evaluate_run` does it for a run directory's checkpoint."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxformer.config import Config
from jaxformer.data import Task, build_task
from jaxformer.decode import generate_seq2seq
from jaxformer.parallel import Plan, replicate
from jaxformer.runs import load_model
from jaxformer.train.step import make_eval_step


def evaluate(cfg: Config, task: Task, model: nnx.Module, eval_step=None, plan: Plan | None = None) -> dict:
    """Held-out loss and token accuracy (teacher forced); exact match by greedy decoding for seq2seq.
    eval_step: `make_eval_step(nnx.graphdef(model), cfg, plan)`, built once by a caller that evaluates often.
    Batches have one shape (the last is padded with all-pad rows that count nowhere), so each compiles once;
    under a plan they are global arrays of which this process reads only its rows."""
    graph, state = nnx.split(model)
    eval_step = eval_step or make_eval_step(graph, cfg, plan)
    n_eval, pad = len(next(iter(task.eval.values()))), cfg.model.pad_id
    size = min(cfg.train.eval_batch_size, n_eval)
    if plan is not None:
        size = -(-size // plan.batch_shards) * plan.batch_shards
        mine = plan.local_rows(size)
    tot = {"nll": 0.0, "correct": 0.0, "count": 0.0}
    exact, n = 0, 0
    for host in task.eval_batches(size, pad_id=pad):
        batch = host if plan is None else plan.global_batch({k: v[mine] for k, v in host.items()}, size)
        s = eval_step(state, batch)
        for k in tot:
            tot[k] += float(s[k])
        if task.kind == "seq2seq":     # decoded tokens come back replicated: every process reads them whole
            pred = np.asarray(predict(model, task, batch["src"], host["tgt_out"].shape[1]))
            real = (host["tgt_out"] != pad).any(1)
            exact += int((real & (pred == host["tgt_out"]).all(1)).sum())
            n += int(real.sum())
    out = {"loss": tot["nll"] / tot["count"], "token_accuracy": tot["correct"] / tot["count"]}
    if task.kind == "seq2seq":
        out["exact_match"] = exact / n
    return out


def predict(model, task: Task, src, width: int):
    tok = task.tokenizer
    return generate_seq2seq(model, src, max_new=width, bos_id=tok.bos_id, eos_id=tok.eos_id)


def examples(task: Task, model: nnx.Module, k: int, batch_rows: int = 0) -> list[dict]:
    """k decoded held-out examples: input, target, prediction, ok (greedy answers for seq2seq; next-character
    predictions for a language model). batch_rows: decode that many held-out rows and keep the first k (pass
    evaluation's batch size, and the decoder compiled for evaluation serves these too)."""
    tok, ev = task.tokenizer, {a: b[:k] for a, b in task.eval.items()}
    rows = []
    if k <= 0:
        return rows
    if task.kind == "seq2seq":
        src = task.eval["src"][:max(k, batch_rows)]
        pred = np.asarray(predict(model, task, src, ev["tgt_out"].shape[1]))[:k]
        pairs = zip(ev["src"], ev["tgt_out"], pred)
    else:
        graph, state = nnx.split(model)
        best = jax.jit(lambda st, x: replicate(nnx.merge(graph, st)(x).argmax(-1)))(state, ev["inputs"])
        pairs = zip(ev["inputs"], ev["targets"], np.asarray(best))
    for x, y, p in pairs:
        rows.append({"input": tok.decode(x), "target": tok.decode(y), "prediction": tok.decode(p),
                     "ok": bool(np.all(p == y))})
    return rows


def evaluate_run(workdir: str | Path, which: str = "best", quantize: str | None = None) -> dict:
    """Restore a run's best (or latest) model (quantized: see `jaxformer.quantize`) and evaluate it on the
    held-out set (needs the run's data). -> {"step", "which" (the checkpoint actually used), "eval", "examples"}."""
    loaded = load_model(workdir, which, quantize=quantize)
    task = build_task(loaded.cfg.data, loaded.tokenizer)
    return {"step": loaded.step, "which": loaded.which, "eval": evaluate(loaded.cfg, task, loaded.model),
            "examples": examples(task, loaded.model, loaded.cfg.train.num_examples)}
