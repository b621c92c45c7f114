"""Optimizer, schedules, loss, the training state, and the pure jitted train/eval steps over it.

The training state is a dict {"model": State, "opt": State} of the model's and the optimizer's nnx.split
states (one checkpoint item each, so a model restores without its optimizer); `Graphs` holds their graphdefs.
Batches: seq2seq {"src" [B,S], "tgt_in" [B,T], "tgt_out" [B,T]}; LM {"inputs" [B,T], "targets" [B,T]}.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer.config import Config, OptimConfig
from jaxformer.nn import build_model
from jaxformer.nn.params import matrix_mask


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """constant | noam (linear warmup to lr, then lr·sqrt(warmup/step)) | warmup_cosine (to 0 at total_steps)."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.schedule == "noam":
        w = max(cfg.warmup_steps, 1)
        return lambda step: cfg.lr * jnp.minimum((step + 1) / w, jnp.sqrt(w / jnp.maximum(step + 1, 1)))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1))


def optimizer(cfg: OptimConfig, total_steps: int, matrices=None) -> optax.GradientTransformation:
    """AdamW (default) or SGD; optional global-norm clipping first (seed 000 uses SGD + clipping).
    matrices: a pytree of bools over the parameters (`nn.params.matrix_mask`); with
    cfg.weight_decay_mask='matrices' AdamW decays only those (not biases, norm scales or embeddings)."""
    lr = schedule(cfg, total_steps)
    if cfg.name == "adamw":
        if cfg.weight_decay_mask == "matrices" and matrices is None:
            raise ValueError("optim.weight_decay_mask='matrices' needs the parameters' matrix mask")
        mask = matrices if cfg.weight_decay_mask == "matrices" else None
        base = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    else:
        base = optax.sgd(lr)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), base) if cfg.clip_norm > 0 else base


class Graphs(NamedTuple):
    """The static halves of the training state: nnx graphdefs of the model and of its optimizer."""
    model: nnx.GraphDef
    opt: nnx.GraphDef


def _build(cfg: Config):
    model = build_model(cfg.model, seed=cfg.train.seed)
    opt = nnx.Optimizer(model, optimizer(cfg.optim, cfg.train.steps, matrix_mask(model)), wrt=nnx.Param)
    return model, opt


def _split(model, opt) -> tuple[Graphs, dict]:
    (mg, ms), (og, os_) = nnx.split(model), nnx.split(opt)
    return Graphs(mg, og), {"model": ms, "opt": os_}


def init_state(cfg: Config) -> tuple[Graphs, dict]:
    """A fresh training state for a resolved config (model.vocab_size filled in): (graphs, state)."""
    return _split(*_build(cfg))


def abstract_state(cfg: Config) -> tuple[Graphs, dict]:
    """As init_state, but shapes and dtypes only (nothing allocated): the target to restore a checkpoint into."""
    return _split(*nnx.eval_shape(lambda: _build(cfg)))


def token_losses(logits: jax.Array, targets: jax.Array, pad_id: int, label_smoothing: float = 0.0):
    """logits [B,T,V] float32, targets [B,T] -> dict of sums over non-pad tokens:
    objective (label-smoothed CE), nll, correct, count. Pad targets contribute nothing (nor gradient)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    objective = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    w = (targets != pad_id).astype(jnp.float32)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return {"objective": (objective * w).sum(), "nll": (nll * w).sum(), "correct": (correct * w).sum(),
            "count": w.sum()}


def forward(model, batch: dict, rngs: nnx.Rngs | None = None):
    """-> (logits [B,T,V], targets [B,T]) for either batch kind."""
    if "src" in batch:
        return model(batch["src"], batch["tgt_in"], rngs=rngs), batch["tgt_out"]
    return model(batch["inputs"], rngs=rngs), batch["targets"]


def make_train_step(graphs: Graphs, cfg: Config):
    """train_step(state, batch, rng) -> (state, metrics); state {"model", "opt"} (see `init_state`), donated."""
    pad, ls = cfg.model.pad_id, cfg.optim.label_smoothing

    def loss_fn(model, batch, rng):
        logits, targets = forward(model, batch, nnx.Rngs(dropout=rng))
        s = token_losses(logits, targets, pad, ls)
        n = jnp.maximum(s["count"], 1.0)
        return s["objective"] / n, s

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch, rng):
        model, opt = nnx.merge(graphs.model, state["model"]), nnx.merge(graphs.opt, state["opt"])
        (_, s), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rng)
        opt.update(model, grads)
        n = jnp.maximum(s["count"], 1.0)
        metrics = {"loss": s["nll"] / n, "objective": s["objective"] / n, "token_accuracy": s["correct"] / n,
                   "tokens": s["count"], "grad_norm": optax.global_norm(grads)}
        return {"model": nnx.state(model), "opt": nnx.state(opt)}, metrics

    return train_step


def make_eval_step(model_graph: nnx.GraphDef, cfg: Config):
    """eval_step(model_state, batch) -> sums {nll, correct, count} (teacher forced, no dropout)."""
    pad = cfg.model.pad_id

    @jax.jit
    def eval_step(model_state, batch):
        model = nnx.merge(model_graph, model_state)
        logits, targets = forward(model, batch)
        s = token_losses(logits, targets, pad)
        return {k: s[k] for k in ("nll", "correct", "count")}

    return eval_step
