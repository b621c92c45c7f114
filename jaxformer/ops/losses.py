"""Token-level losses as pure functions (what training and evaluation both sum).

Axis legend: B batch, T length, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_losses(logits: jax.Array, targets: jax.Array, pad_id: int, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> dict:
    """logits [B,T,V] float32, targets [B,T] -> dict of sums over non-pad tokens: objective (label-smoothed
    CE, plus z_loss · log(Z)² per token: PaLM's output z-loss, Z the softmax normaliser), nll, correct, count,
    and log_z2 (the sum of log(Z)²). Pad targets contribute nothing (nor gradient)."""
    x = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(x, axis=-1)
    logp = x - log_z[..., None]
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    objective = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    if z_loss:
        objective = objective + z_loss * jnp.square(log_z)
    w = (targets != pad_id).astype(jnp.float32)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return {"objective": (objective * w).sum(), "nll": (nll * w).sum(), "correct": (correct * w).sum(),
            "count": w.sum(), "log_z2": (jnp.square(log_z) * w).sum()}
