"""Optimizer, schedules, loss, and the pure jitted train/eval steps over nnx.split state.

Batches: seq2seq {"src" [B,S], "tgt_in" [B,T], "tgt_out" [B,T]}; LM {"inputs" [B,T], "targets" [B,T]}.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer.config import Config, OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """constant | noam (linear warmup to lr, then lr·sqrt(warmup/step)) | warmup_cosine (to 0 at total_steps)."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.schedule == "noam":
        w = max(cfg.warmup_steps, 1)
        return lambda step: cfg.lr * jnp.minimum((step + 1) / w, jnp.sqrt(w / jnp.maximum(step + 1, 1)))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1))


def optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (default) or SGD; optional global-norm clipping first (seed 000 uses SGD + clipping)."""
    lr = schedule(cfg, total_steps)
    base = (optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay) if cfg.name == "adamw"
            else optax.sgd(lr))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), base) if cfg.clip_norm > 0 else base


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


def make_train_step(graphdef: nnx.GraphDef, cfg: Config):
    """train_step(state, batch, rng) -> (state, metrics); state = nnx.split((model, optimizer))[1], donated."""
    pad, ls = cfg.model.pad_id, cfg.optim.label_smoothing

    def loss_fn(model, batch, rng):
        logits, targets = forward(model, batch, nnx.Rngs(dropout=rng))
        s = token_losses(logits, targets, pad, ls)
        n = jnp.maximum(s["count"], 1.0)
        return s["objective"] / n, s

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch, rng):
        model, opt = nnx.merge(graphdef, state)
        (_, s), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rng)
        opt.update(model, grads)
        n = jnp.maximum(s["count"], 1.0)
        metrics = {"loss": s["nll"] / n, "objective": s["objective"] / n, "token_accuracy": s["correct"] / n,
                   "tokens": s["count"], "grad_norm": optax.global_norm(grads)}
        return nnx.state((model, opt)), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: Config):
    """eval_step(state, batch) -> sums {nll, correct, count} (teacher forced, no dropout)."""
    pad = cfg.model.pad_id

    @jax.jit
    def eval_step(state, batch):
        model, _ = nnx.merge(graphdef, state)
        logits, targets = forward(model, batch)
        s = token_losses(logits, targets, pad)
        return {k: s[k] for k in ("nll", "correct", "count")}

    return eval_step
