"""Boolean attention masks: True = may attend. Shapes broadcast to [B,N,T,S].

Axis legend: B batch, N query heads, T query length, S key length.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def padding_mask(tokens: jax.Array, pad_id: int) -> jax.Array:
    """Key-padding mask: True where the key is not padding.

    Args:
      tokens: [B, S] int token ids of the keys.
      pad_id: the padding token id.

    Returns:
      [B, 1, 1, S] bool, True where the key is not padding.

    Raises:
      ValueError: tokens is not [B, S].

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import padding_mask
      >>> padding_mask(jnp.array([[5, 7, 0]]), pad_id=0).tolist()
      [[[[True, True, False]]]]
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B,S]; got shape {tokens.shape}")
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(t: int, s: int | None = None) -> jax.Array:
    """[T,S] bool lower-triangular mask. With t < s the T queries are the last t positions:
    query i sits at absolute position s - t + i (as in cached decoding) and sees keys j <= s - t + i.

    Args:
      t: number of queries T.
      s: number of keys S (default t).

    Returns:
      [T, S] bool, True where query i may attend to key j.

    Raises:
      ValueError: t > s.

    Examples:
      >>> from jaxformer.ops import causal_mask
      >>> causal_mask(2, 3).tolist()                # 2 queries at positions 1 and 2 of 3 keys
      [[True, True, False], [True, True, True]]
    """
    s = t if s is None else s
    if t > s:
        raise ValueError(f"causal_mask needs t <= s; got t={t}, s={s}")
    q_pos = jnp.arange(t)[:, None] + (s - t)
    return jnp.arange(s)[None, :] <= q_pos


def position_causal_mask(q_positions: jax.Array, k_positions: jax.Array, k_valid: jax.Array | None = None, *,
                         q_segments: jax.Array | None = None, k_segments: jax.Array | None = None,
                         window=None) -> jax.Array:
    """Causal mask from explicit absolute positions (ragged batches, KV caches, packed documents).

    Args:
      q_positions: [B, T] int absolute positions of the queries.
      k_positions: [B, S] int absolute positions of the keys.
      k_valid: [B, S] bool, False for keys that are not there (None = all valid).
      q_segments: optional [B, T] int segment (document) ids of the queries: a query sees only keys of its own
        segment (given with k_segments).
      k_segments: optional [B, S] int segment ids of the keys.
      window: an int scalar, may be traced: a query sees only the `window` most recent positions, itself
        included; 0 = no limit (None: no window).

    Returns:
      [B, 1, T, S] bool, True where k_position <= q_position and the key is valid (and in the segment and
        window).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import position_causal_mask
      >>> pos = jnp.arange(3)[None]
      >>> position_causal_mask(pos, pos, window=2)[0, 0].astype(int).tolist()
      [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
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
    """Packed documents without causality (an encoder, cross-attention): True where the key is in the query's
    document (padding is seen by no query, and a padding query sees nothing).

    Args:
      q_segments: [B, T] int document ids of the queries, 0 = padding, documents numbered from 1.
      k_segments: [B, S] int document ids of the keys, likewise.

    Returns:
      [B, 1, T, S] bool, True where the key is in the query's document.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import segment_mask
      >>> seg = jnp.array([[1, 1, 2, 0]])
      >>> segment_mask(seg, seg)[0, 0].astype(int).tolist()
      [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    """
    return ((q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] != 0))[:, None]


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Positions within packed documents: a token's column less its document's first column, where a document
    starts at a token whose id differs from the last non-padding id before it (padding inside a document does not
    restart it, so positions never run backwards within an id: causality by position stays causality by column);
    padding gets 0.

    Args:
      segment_ids: [B, T] int document ids (0 = padding).

    Returns:
      [B, T] int32 positions.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import positions_from_segments
      >>> positions_from_segments(jnp.array([[1, 1, 0, 1, 2, 2, 0]])).tolist()
      [[0, 1, 0, 3, 0, 1, 0]]
    """
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(segment_ids != 0, idx, -1), axis=1)           # last real column so far
    last = jnp.pad(last[:, :-1], [(0, 0), (1, 0)], constant_values=-1)              # ... before this one
    prev = jnp.where(last >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last, 0), 1), -1)
    start = jnp.where((segment_ids != 0) & (segment_ids != prev), idx, 0)
    pos = idx - jax.lax.cummax(start, axis=1)
    return jnp.where(segment_ids != 0, pos, 0).astype(jnp.int32)


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of broadcastable boolean masks; None entries are ignored (None if all are None).

    Args:
      *masks: boolean masks broadcastable to one shape (e.g. [B, N, T, S]), or None.

    Returns:
      Their AND, broadcast to their common shape; None when every mask is None.

    Raises:
      TypeError: a mask that is not boolean.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import causal_mask, combine_masks, padding_mask
      >>> m = combine_masks(causal_mask(3), None, padding_mask(jnp.array([[4, 4, 0]]), pad_id=0))
      >>> m.shape, m[0, 0].astype(int).tolist()
      ((1, 1, 3, 3), [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
      >>> combine_masks(None, None) is None
      True
    """
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

    Attributes:
      q_positions: [B, T] int absolute positions of the queries.
      k_positions: [B, S] int absolute positions of the keys.
      k_valid: [B, S] bool, or None (all valid).
      q_segments: [B, T] int segment ids of the queries, or None (no document boundaries).
      k_segments: [B, S] int segment ids of the keys, or None.
      window: an int scalar (0 = unlimited) or None: a query sees only the `window` most recent positions.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import CausalMask
      >>> pos = jnp.arange(4)[None]
      >>> m = CausalMask(pos, pos, window=jnp.int32(2))
      >>> m.shape, m.materialize().dtype
      ((1, 1, 4, 4), dtype('bool'))
      >>> m.tile(2, 2, 0, 2)[0, 0].astype(int).tolist()         # queries 2..3 against keys 0..1
      [[0, 1], [0, 0]]
    """
    q_positions: jax.Array
    k_positions: jax.Array
    k_valid: jax.Array | None = None
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    window: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The materialised mask's shape (B, 1, T, S)."""
        return (self.q_positions.shape[0], 1, self.q_positions.shape[1], self.k_positions.shape[1])

    def materialize(self) -> jax.Array:
        """The whole mask as an array.

        Returns:
          [B, 1, T, S] bool.
        """
        return position_causal_mask(self.q_positions, self.k_positions, self.k_valid, q_segments=self.q_segments,
                                    k_segments=self.k_segments, window=self.window)

    def tile(self, q0, tq: int, k0, tk: int) -> jax.Array:
        """The [B,1,tq,tk] tile at query q0, key k0.

        Args:
          q0: first query index of the tile (an int, may be traced).
          tq: number of queries in the tile.
          k0: first key index of the tile (an int, may be traced).
          tk: number of keys in the tile.

        Returns:
          [B, 1, tq, tk] bool.
        """
        return position_causal_mask(_rows(self.q_positions, q0, tq), _rows(self.k_positions, k0, tk),
                                    _rows(self.k_valid, k0, tk), q_segments=_rows(self.q_segments, q0, tq),
                                    k_segments=_rows(self.k_segments, k0, tk), window=self.window)

    def pad(self, t: int, s: int) -> "CausalMask":
        """The same mask over t >= T queries and s >= S keys (the extra keys invalid).

        Args:
          t: the new number of queries, >= T.
          s: the new number of keys, >= S.

        Returns:
          A `CausalMask` of shape [B, 1, t, s].
        """
        valid = self.k_valid if self.k_valid is not None else jnp.ones(self.k_positions.shape, bool)
        return CausalMask(_grow(self.q_positions, t, 0), _grow(self.k_positions, s, 0), _grow(valid, s, False),
                          _grow(self.q_segments, t, 0), _grow(self.k_segments, s, 0), self.window)


def materialized_mask(mask) -> jax.Array | None:
    """A mask as a boolean array: lazy masks (`CausalMask`) materialised, arrays and None unchanged.

    Args:
      mask: a boolean array (broadcastable to [B, N, T, S]), a lazy mask (an object with `materialize()`), or
        None.

    Returns:
      The boolean array (a `CausalMask` gives [B, 1, T, S]), or None for None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops import CausalMask
      >>> from jaxformer.ops.masks import materialized_mask
      >>> pos = jnp.arange(3)[None]
      >>> materialized_mask(CausalMask(pos, pos)).shape
      (1, 1, 3, 3)
      >>> materialized_mask(None) is None
      True
    """
    return mask.materialize() if hasattr(mask, "materialize") else mask
