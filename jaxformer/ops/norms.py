"""Normalisations over the last axis (D), computed in float32 and cast back, and the registry of the norms a
config may name (`model.norm.type`): `NORMS` maps a name to a function (x [..., D], scale [D], bias [D] | None,
eps) -> [..., D]; `register_norm` adds one (the `Norm` module creates a bias parameter only for norms registered
with bias=True, and passes None otherwise)."""
from __future__ import annotations

from typing import Callable

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


NormFn = Callable[[jax.Array, jax.Array, "jax.Array | None", float], jax.Array]

NORMS: dict[str, NormFn] = {}        # model.norm.type name -> fn(x [..., D], scale [D], bias [D] | None, eps)
NORM_BIAS: dict[str, bool] = {}      # name -> whether the Norm module creates a bias [D] (else passes None)


def register_norm(name: str, fn: NormFn, *, bias: bool) -> NormFn:
    """Make `fn(x, scale, bias, eps) -> y` ([..., D] -> [..., D]) available as model.norm.type=`name`; `bias`
    says whether the Norm module creates a bias parameter [D] (zeros) for it. Register before building or
    validating a config that names it (in every process that loads such a run). Returns fn.
    Raises ValueError for a name already registered (norms are not silently replaced)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a norm name must be a non-empty string; got {name!r}")
    if name in NORMS:
        raise ValueError(f"norm {name!r} is already registered (registered: {tuple(NORMS)}); choose another name")
    if not callable(fn):
        raise TypeError(f"norm {name!r}: fn must be callable (x, scale, bias, eps) -> y; got {fn!r}")
    if not isinstance(bias, bool):
        raise TypeError(f"norm {name!r}: bias must be True or False; got {bias!r}")
    NORMS[name], NORM_BIAS[name] = fn, bias
    return fn


def _rms_norm(x: jax.Array, scale: jax.Array | None, bias: None, eps: float) -> jax.Array:
    return rms_norm(x, scale, eps)          # registered with bias=False: the module passes bias=None


register_norm("layernorm", layer_norm, bias=True)
register_norm("rmsnorm", _rms_norm, bias=False)
