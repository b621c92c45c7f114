"""Normalisations over the last axis (D), computed in float32 and cast back."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_norm(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    """x [..., D], scale/bias [D] (or None) -> [..., D]. (x - mean) / sqrt(var + eps) * scale + bias."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float = 1e-6) -> jax.Array:
    """x [..., D], scale [D] (or None) -> [..., D]. x / sqrt(mean(x^2) + eps) * scale."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)
