"""Boolean attention masks: True = may attend. Shapes broadcast to [B,N,T,S].

Axis legend: B batch, N query heads, T query length, S key length.
"""
from __future__ import annotations

from typing import NamedTuple

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


def position_causal_mask(q_positions: jax.Array, k_positions: jax.Array, k_valid: jax.Array | None = None, *,
                         q_segments: jax.Array | None = None, k_segments: jax.Array | None = None,
                         window=None) -> jax.Array:
    """Causal mask from explicit absolute positions (ragged batches, KV caches, packed documents).

    q_positions [B,T] int, k_positions [B,S] int, k_valid [B,S] bool (None = all valid); optionally
    q_segments [B,T] / k_segments [B,S] int (a query sees only keys of its own segment) and window (an int
    scalar, may be traced: a query sees only the `window` most recent positions, itself included; 0 = no limit)
    -> [B,1,T,S] bool, True where k_position <= q_position and the key is valid (and in the segment and window).
    """
    m = k_positions[:, None, :] <= q_positions[:, :, None]
    if k_valid is not None:
        m = m & k_valid[:, None, :]
    if q_segments is not None:
        m = m & (q_segments[:, :, None] == k_segments[:, None, :])
    if window is not None:
        near = q_positions[:, :, None] - k_positions[:, None, :] < window
        m = m & (near | (window <= 0))
    return m[:, None]


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """Packed documents without causality (an encoder, cross-attention): q_segments [B,T], k_segments [B,S] int,
    0 = padding, documents numbered from 1 -> [B,1,T,S] bool, True where the key is in the query's document
    (padding is seen by no query, and a padding query sees nothing)."""
    return ((q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] != 0))[:, None]


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """segment_ids [B,T] int (0 = padding) -> positions [B,T] int32: a token's column less its document's first
    column, where a document starts at a token whose id differs from the last non-padding id before it (padding
    inside a document does not restart it, so positions never run backwards within an id: causality by position
    stays causality by column); padding gets 0."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(segment_ids != 0, idx, -1), axis=1)           # last real column so far
    last = jnp.pad(last[:, :-1], [(0, 0), (1, 0)], constant_values=-1)              # ... before this one
    prev = jnp.where(last >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last, 0), 1), -1)
    start = jnp.where((segment_ids != 0) & (segment_ids != prev), idx, 0)
    pos = idx - jax.lax.cummax(start, axis=1)
    return jnp.where(segment_ids != 0, pos, 0).astype(jnp.int32)


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


def _rows(x: jax.Array | None, start, size: int) -> jax.Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _grow(x: jax.Array | None, to: int, value) -> jax.Array | None:
    if x is None or x.shape[1] == to:
        return x
    return jnp.pad(x, [(0, 0), (0, to - x.shape[1])], constant_values=value)


class CausalMask(NamedTuple):
    """A lazy `position_causal_mask`: key s is visible to query t iff k_positions[s] <= q_positions[t] and
    k_valid[s] (and, when given, the same segment id, and within `window` positions). `materialize()` gives the
    [B,1,T,S] array; the chunked attention backend builds it one tile at a time (`tile`), so a causal mask over
    long sequences costs O(T + S) memory, not O(T·S).

    q_positions [B,T] int, k_positions [B,S] int, k_valid [B,S] bool or None (all valid), q_segments [B,T] /
    k_segments [B,S] int or None (no document boundaries), window an int scalar (0 = unlimited) or None.
    """
    q_positions: jax.Array
    k_positions: jax.Array
    k_valid: jax.Array | None = None
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    window: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.q_positions.shape[0], 1, self.q_positions.shape[1], self.k_positions.shape[1])

    def materialize(self) -> jax.Array:
        """-> [B,1,T,S] bool."""
        return position_causal_mask(self.q_positions, self.k_positions, self.k_valid, q_segments=self.q_segments,
                                    k_segments=self.k_segments, window=self.window)

    def tile(self, q0, tq: int, k0, tk: int) -> jax.Array:
        """The [B,1,tq,tk] tile at query q0, key k0."""
        return position_causal_mask(_rows(self.q_positions, q0, tq), _rows(self.k_positions, k0, tk),
                                    _rows(self.k_valid, k0, tk), q_segments=_rows(self.q_segments, q0, tq),
                                    k_segments=_rows(self.k_segments, k0, tk), window=self.window)

    def pad(self, t: int, s: int) -> "CausalMask":
        """The same mask over t >= T queries and s >= S keys (the extra keys invalid)."""
        valid = self.k_valid if self.k_valid is not None else jnp.ones(self.k_positions.shape, bool)
        return CausalMask(_grow(self.q_positions, t, 0), _grow(self.k_positions, s, 0), _grow(valid, s, False),
                          _grow(self.q_segments, t, 0), _grow(self.k_segments, s, 0), self.window)


def materialized_mask(mask) -> jax.Array | None:
    """A mask as a boolean array: lazy masks (`CausalMask`) materialised, arrays and None unchanged."""
    return mask.materialize() if hasattr(mask, "materialize") else mask
