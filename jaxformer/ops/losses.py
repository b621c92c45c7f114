"""Token-level losses as pure functions (what training and evaluation both sum).

Axis legend: B batch, T length, D model width, V vocab.

`token_losses` reads logits [B,T,V]; `chunked_token_losses` reads the features before the output head and makes
the logits one slice of the sequence at a time, forward and backward, so a [B,T,V] float32 array never exists
(the "chunked_loss" lever of `jaxformer.platforms`: same sums, to float32 rounding).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

CHUNK_TOKENS = 8192       # B·c tokens of logits per slice in chunked_token_losses: [B,c,V] float32 at a time


def token_losses(logits: jax.Array, targets: jax.Array, pad_id: int, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> dict:
    """Sums over non-pad tokens: objective (label-smoothed CE, plus z_loss · log(Z)² per token: PaLM's output
    z-loss, Z the softmax normaliser), nll, correct, count, and log_z2 (the sum of log(Z)²). Pad targets
    contribute nothing (nor gradient).

    Args:
      logits: [B, T, V] float32 logits.
      targets: [B, T] int target ids.
      pad_id: the padding id: targets equal to it are not counted.
      label_smoothing: the label-smoothing weight (0 = plain cross-entropy).
      z_loss: the output z-loss weight (0 = none).

    Returns:
      dict of [] float32 sums: "objective", "nll", "correct" (argmax hits), "count" (tokens counted), "log_z2".

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.losses import token_losses
      >>> s = token_losses(jnp.zeros((1, 3, 4)), jnp.array([[1, 2, 0]]), pad_id=0)   # uniform over V=4
      >>> sorted(s), float(s["count"]), round(float(s["nll"] / s["count"]), 4)       # log 4
      (['correct', 'count', 'log_z2', 'nll', 'objective'], 2.0, 1.3863)
    """
    return weighted_token_losses(logits, targets, (targets != pad_id).astype(jnp.float32), label_smoothing, z_loss)


def weighted_token_losses(logits: jax.Array, targets: jax.Array, w: jax.Array, label_smoothing: float = 0.0,
                          z_loss: float = 0.0) -> dict:
    """`token_losses` with explicit per-token weights w [B,T] (1 = counted, 0 = not) in place of the padding id.

    Args:
      logits: [B, T, V] float32 logits.
      targets: [B, T] int target ids.
      w: [B, T] float32 weights.
      label_smoothing: the label-smoothing weight (0 = plain cross-entropy).
      z_loss: the output z-loss weight (0 = none).

    Returns:
      dict of [] float32 weighted sums: "objective", "nll", "correct", "count" (the sum of w), "log_z2".

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.losses import weighted_token_losses
      >>> s = weighted_token_losses(jnp.zeros((1, 3, 4)), jnp.array([[1, 2, 0]]), jnp.array([[1.0, 0.5, 0.0]]))
      >>> float(s["count"]), round(float(s["nll"]), 4)                                 # 1.5 · log 4
      (1.5, 2.0794)
    """
    x = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(x, axis=-1)
    logp = x - log_z[..., None]
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    objective = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1) if label_smoothing else nll
    if z_loss:
        objective = objective + z_loss * jnp.square(log_z)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return {"objective": (objective * w).sum(), "nll": (nll * w).sum(), "correct": (correct * w).sum(),
            "count": w.sum(), "log_z2": (jnp.square(log_z) * w).sum()}


def mean_nll(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The mean negative log-likelihood of targets [B,T] under logits [B,T,V] over the positions weights [B,T]
    keep (all by default; 0 where none is kept): `weighted_token_losses`' nll / count.

    Args:
      logits: [B, T, V] logits.
      targets: [B, T] int target ids.
      weights: [B, T] weights, or None (every position).

    Returns:
      [] float32 mean NLL.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.losses import mean_nll
      >>> round(float(mean_nll(jnp.zeros((1, 3, 4)), jnp.array([[1, 2, 0]]))), 4)     # log 4
      1.3863
    """
    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    s = weighted_token_losses(logits, targets, w)
    return s["nll"] / jnp.maximum(s["count"], 1.0)


def chunked_token_losses(x: jax.Array, head: Callable[[jax.Array], jax.Array], targets: jax.Array, pad_id: int,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """The sums of `token_losses`, computed from the features before the output head without ever holding the
    [B,T,V] logits.

    The sequence is cut into slices of c = max(1, chunk_tokens // B) positions (the last one padded, its padding
    weighted 0), scanned one at a time; each slice is rematerialised (`jax.checkpoint`), so its logits are made
    again in the backward pass instead of kept: at most one [B,c,V] float32 array of logits (and its gradient)
    is alive, against [B,T,V] for `head(x)` then `token_losses`. The batch axis stays whole, so its sharding does
    too.

    Args:
      x: [B, T, D] the features the output head reads.
      head: [B, c, D] -> logits [B, c, V] float32, a pure function of its input; the weights it closes over get
        their gradients.
      targets: [B, T] int target ids.
      pad_id: the padding id: targets equal to it are not counted.
      label_smoothing: the label-smoothing weight (0 = plain cross-entropy).
      z_loss: the output z-loss weight (0 = none).
      chunk_tokens: B·c, the tokens of logits per slice.

    Returns:
      dict of [] float32 sums, as `token_losses`: "objective", "nll", "correct", "count", "log_z2".

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.losses import chunked_token_losses
      >>> w_out = jnp.zeros((2, 4))                                                   # D=2 -> V=4
      >>> s = chunked_token_losses(jnp.ones((1, 3, 2)), lambda h: h @ w_out, jnp.array([[1, 2, 0]]), pad_id=0,
      ...                          chunk_tokens=2)                                    # slices of 2 positions
      >>> float(s["count"]), round(float(s["nll"]), 4)
      (2.0, 2.7726)
    """
    b, t, d = x.shape
    c = max(1, min(t, chunk_tokens // max(b, 1)))
    m = -(-t // c)
    w = (targets != pad_id).astype(jnp.float32)
    if m * c != t:
        x, targets, w = (jnp.pad(a, ((0, 0), (0, m * c - t)) + ((0, 0),) * (a.ndim - 2)) for a in (x, targets, w))

    def slices(a):                                                  # [B,m·c,...] -> [m,B,c,...]
        return a.reshape(b, m, c, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def one(xc, tc, wc):
        return weighted_token_losses(head(xc), tc, wc, label_smoothing, z_loss)

    def body(acc, xs):
        return jax.tree.map(jnp.add, acc, one(*xs)), None

    zero = {k: jnp.zeros((), jnp.float32) for k in ("objective", "nll", "correct", "count", "log_z2")}
    out, _ = jax.lax.scan(body, zero, (slices(x), slices(targets), slices(w)))
    return out
