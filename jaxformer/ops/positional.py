"""Positional encodings: sinusoidal table, RoPE, ALiBi.

Axis legend: B batch, T length, N heads, H head dim, D model width.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("sinusoidal", "learned", "rope", "alibi", "none")


def sinusoidal_table(max_len: int, d_model: int, dtype=jnp.float32) -> jax.Array:
    """[max_len, D] table, PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...).

    Computed in float64 with NumPy (seed 000: in float32 the high-frequency terms lose precision at
    large positions), then cast to `dtype`. It is a constant, not a parameter.
    """
    if max_len <= 0 or d_model <= 0:
        raise ValueError(f"max_len and d_model must be positive; got {max_len}, {d_model}")
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    pe = np.zeros((max_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)[:, : d_model // 2]
    return jnp.asarray(pe, dtype=dtype)


def rope_frequencies(head_dim: int, base: float = 10000.0) -> jax.Array:
    """[H/2] inverse frequencies base^(-2i/H)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim H; got H={head_dim}")
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (half-split convention, as GPT-NeoX/Llama).

    x [B,T,N,H], positions [B,T] or [T] integer absolute positions -> [B,T,N,H] in x's dtype.
    Rotation is computed in float32. q·k after RoPE depends only on the position difference.
    """
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be integers; got dtype {positions.dtype}")
    h = x.shape[-1]
    inv = rope_frequencies(h, base)
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B,T,H/2] or [T,H/2]
    if ang.ndim == 2:
        ang = ang[None]
    sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> jax.Array:
    """[N] ALiBi head slopes (Press et al. 2022), geometric; non-powers of two as in the paper's code."""
    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(num_heads).is_integer():
        slopes = pow2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, dtype=jnp.float32)


def alibi_bias(num_heads: int, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """q_positions [B,T], k_positions [B,S] int -> [B,N,T,S] float32 bias −slope·|q − k|."""
    dist = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)  # [B,T,S]
    return -alibi_slopes(num_heads)[None, :, None, None] * dist[:, None]
