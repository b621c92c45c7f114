"""Attention inputs, resolved once per call from explicit inputs only: positions and segment ids (int [B,T]:
0 = padding, documents numbered from 1). Without segment ids every token is real (one document per row) and
positions are 0..T-1; a token id never says what attends (model.pad_id only fills).

Axis legend: B batch, T query length, S key length (or cache slots).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer import ops
from jaxformer.config import ModelConfig
from jaxformer.nn.cache import Memory


def default_positions(tokens: jax.Array) -> jax.Array:
    """tokens [B,T] -> positions [B,T] = 0..T-1 for every row."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def decoder_self_mask(cfg: ModelConfig, q_positions: jax.Array, k_positions: jax.Array,
                      k_valid: jax.Array | None = None, q_segments: jax.Array | None = None,
                      k_segments: jax.Array | None = None):
    """The decoder's self-attention mask: causal over positions, valid keys only (and, with segment ids, keys of
    the query's own document). [B,T], [B,S], [B,S] (, [B,T], [B,S]) -> a lazy ops.masks.CausalMask ([B,1,T,S] by
    its .materialize()). With the ablation switch model.ablation.causal='triu' a query sees itself and the future (a
    dense [B,1,T,S] array)."""
    if cfg.ablation.causal == "triu":
        m = (k_positions[:, None, :] >= q_positions[:, :, None])[:, None]
        if q_segments is not None:
            m = m & (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
        return m if k_valid is None else m & k_valid[:, None, None, :]
    return ops.masks.CausalMask(q_positions, k_positions, k_valid, q_segments, k_segments)


class AttentionInputs:
    """One side's attention inputs, resolved once: positions, validity and (explicit only) segment ids [B,T]."""

    def __init__(self, cfg: ModelConfig, tokens, positions=None, segment_ids=None):
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer [B,T] array; got {tokens.shape} {tokens.dtype}")
        for name, a in (("positions", positions), ("segment_ids", segment_ids)):
            if a is not None and a.shape != tokens.shape:
                raise ValueError(f"{name} must be [B,T] like the tokens {tokens.shape}; got {a.shape}")
        if segment_ids is None:                         # one document per row, every token real
            self.segments, self.valid = None, jnp.ones(tokens.shape, bool)
            self.positions = default_positions(tokens) if positions is None else positions
        else:
            self.segments, self.valid = segment_ids.astype(jnp.int32), segment_ids != 0
            self.positions = ops.positions_from_segments(segment_ids) if positions is None else positions
        self.positions = self.positions.astype(jnp.int32)

    @property
    def slot_segments(self) -> jax.Array:
        """Segment ids as a cache stores them: the explicit ones, else 1 for a real token, 0 for padding."""
        return self.segments if self.segments is not None else self.valid.astype(jnp.int32)

    def self_mask(self):
        """Non-causal self-attention (the encoder): [B,1,1,S] key padding, or [B,1,S,S] within documents."""
        if self.segments is None:
            return self.valid[:, None, None, :]
        return ops.segment_mask(self.segments, self.segments)

    def cross_mask(self, memory: Memory):
        """Cross-attention of these queries over the memory: its key padding [B,1,1,S], or [B,1,T,S] within
        documents when both sides have segment ids."""
        if self.segments is None or memory.segments is None:
            return memory.valid[:, None, None, :]
        return ops.segment_mask(self.segments, memory.segments)
