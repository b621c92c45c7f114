"""Multi-head attention (self and cross; MHA/GQA/MQA) as a thin module over ops.dot_product_attention.

Axis legend: B batch, T query length, S key length, D model width, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import ops
from jaxformer.config import ModelConfig
from jaxformer.nn.params import dense_init, param, zeros
from jaxformer.ops import positional
from jaxformer.quantize import project


class MultiHeadAttention(nnx.Module):
    """Projections wq [D,N,H], wk/wv [D,K,H], wo [N,H,D] (+ biases). RoPE/ALiBi apply to self-attention only."""

    def __init__(self, cfg: ModelConfig, *, self_attention: bool, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.self_attention = self_attention
        self.wq = param(rngs, dense_init(0, (1, 2)), (d, n, h), ("embed", "q_heads", "head_dim"), matrix=True)
        self.wk = param(rngs, dense_init(0, (1, 2)), (d, k, h), ("embed", "kv_heads", "head_dim"), matrix=True)
        self.wv = param(rngs, dense_init(0, (1, 2)), (d, k, h), ("embed", "kv_heads", "head_dim"), matrix=True)
        self.wo = param(rngs, dense_init((0, 1), 2), (n, h, d), ("q_heads", "head_dim", "embed"), matrix=True)
        if cfg.use_bias:
            self.bq = param(rngs, zeros, (n, h), ("q_heads", "head_dim"))
            self.bk = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
            self.bv = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
            self.bo = param(rngs, zeros, (d,), ("embed",))

    def _bias(self, name: str):
        return getattr(self, name)[...] if self.cfg.use_bias else 0.0

    def _rope(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        if self.self_attention and self.cfg.positional == "rope":
            if positions is None:
                raise ValueError("positional='rope' needs explicit positions")
            return positional.apply_rope(x, positions, self.cfg.rope_base)
        return x

    def project_q(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """x [B,T,D], positions [B,T] -> q [B,T,N,H] (rotated when RoPE)."""
        q = project("BTD,DNH->BTNH", x, self.wq[...]) + self._bias("bq")
        return self._rope(q.astype(x.dtype), positions)

    def project_kv(self, x: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B,S,D], positions [B,S] -> k, v [B,S,K,H] (k rotated when RoPE)."""
        k = (project("BSD,DKH->BSKH", x, self.wk[...]) + self._bias("bk")).astype(x.dtype)
        v = (project("BSD,DKH->BSKH", x, self.wv[...]) + self._bias("bv")).astype(x.dtype)
        return self._rope(k, positions), v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
               q_positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               return_weights: bool = False):
        """q [B,T,N,H], k/v [B,S,K,H] (or sequences of segments, see ops.dot_product_attention), mask
        broadcastable to [B,N,T,S] (or an ops.masks.CausalMask) -> [B,T,D] (and weights [B,N,T,S]), by the
        attention backend model.attention_backend."""
        bias = None
        if self.self_attention and self.cfg.positional == "alibi":
            if q_positions is None or kv_positions is None:
                raise ValueError("positional='alibi' needs explicit query and key positions")
            bias = positional.AlibiBias(positional.alibi_slopes(self.cfg.num_heads), q_positions, kv_positions)
        cfg = self.cfg
        res = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_weights=return_weights,
                                        scale=1.0 if cfg.attention_scale == "none" else None,
                                        mask_value=0.0 if cfg.ablation_mask_value == "zero" else None,
                                        backend=cfg.attention_backend, block_size=cfg.attention_block)
        ctx, w = res if return_weights else (res, None)
        out = (project("BTNH,NHD->BTD", ctx, self.wo[...]) + self._bias("bo")).astype(q.dtype)
        return (out, w) if return_weights else out

    def __call__(self, x: jax.Array, kv: jax.Array | None = None, *, mask: jax.Array | None = None,
                 q_positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
                 return_weights: bool = False):
        """x [B,T,D] queries; kv [B,S,D] keys/values source (None = x, self-attention) -> [B,T,D]."""
        if kv is None:
            kv, kv_positions = x, q_positions
        q = self.project_q(x, q_positions)
        k, v = self.project_kv(kv, kv_positions)
        return self.attend(q, k, v, mask=mask, q_positions=q_positions, kv_positions=kv_positions,
                           return_weights=return_weights)
