"""Token-level losses as pure functions (what training and evaluation both sum).

Axis legend: B batch, T length, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_losses(logits: jax.Array, targets: jax.Array, pad_id: int, label_smoothing: float = 0.0) -> dict:
    """logits [B,T,V] float32, targets [B,T] -> dict of sums over non-pad tokens:
    objective (label-smoothed CE), nll, correct, count. Pad targets contribute nothing (nor gradient)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    objective = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    w = (targets != pad_id).astype(jnp.float32)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return {"objective": (objective * w).sum(), "nll": (nll * w).sum(), "correct": (correct * w).sum(),
            "count": w.sum()}
