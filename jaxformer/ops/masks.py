"""Boolean attention masks: True = may attend. Shapes broadcast to [B,N,T,S].

Axis legend: B batch, N query heads, T query length, S key length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def padding_mask(tokens: jax.Array, pad_id: int) -> jax.Array:
    """tokens [B,S] int -> [B,1,1,S] bool, True where the key is not padding."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B,S]; got shape {tokens.shape}")
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(t: int, s: int | None = None) -> jax.Array:
    """[T,S] bool lower-triangular mask. With t < s the T queries are the last t positions:
    query i sits at absolute position s - t + i (as in cached decoding) and sees keys j <= s - t + i."""
    s = t if s is None else s
    if t > s:
        raise ValueError(f"causal_mask needs t <= s; got t={t}, s={s}")
    q_pos = jnp.arange(t)[:, None] + (s - t)
    return jnp.arange(s)[None, :] <= q_pos


def position_causal_mask(q_positions: jax.Array, k_positions: jax.Array,
                         k_valid: jax.Array | None = None) -> jax.Array:
    """Causal mask from explicit absolute positions (ragged batches, KV caches).

    q_positions [B,T] int, k_positions [B,S] int, k_valid [B,S] bool (None = all valid)
    -> [B,1,T,S] bool, True where k_position <= q_position and the key is valid.
    """
    m = k_positions[:, None, :] <= q_positions[:, :, None]
    if k_valid is not None:
        m = m & k_valid[:, None, :]
    return m[:, None]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of broadcastable boolean masks; None entries are ignored (None if all are None)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for m in present:
        if m.dtype != jnp.bool_:
            raise TypeError(f"masks must be boolean; got dtype {m.dtype}")
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out
