"""Normalisations over the last axis (D), computed in float32 and cast back, and the registry of the norms a
config may name (`model.norm.type`): `NORMS` maps a name to a function (x [..., D], scale [D], bias [D] | None,
eps) -> [..., D]; `register_norm` adds one (the `Norm` module creates a bias parameter only for norms registered
with bias=True, and passes None otherwise)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def layer_norm(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    """Layer normalisation over the last axis: (x - mean) / sqrt(var + eps) * scale + bias, in float32.

    Args:
      x: [..., D] input.
      scale: [D] gain, or None (no gain).
      bias: [D] offset, or None (no offset).
      eps: added to the variance.

    Returns:
      [..., D] in x's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.norms import layer_norm
      >>> [round(v, 3) for v in layer_norm(jnp.array([1.0, 2.0, 3.0]), None, None).tolist()]
      [-1.225, 0.0, 1.225]
    """
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
    """RMS normalisation over the last axis: x / sqrt(mean(x^2) + eps) * scale, in float32.

    Args:
      x: [..., D] input.
      scale: [D] gain, or None (no gain).
      eps: added to the mean square.

    Returns:
      [..., D] in x's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.norms import rms_norm
      >>> [round(v, 3) for v in rms_norm(jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0])).tolist()]
      [0.849, 2.263]
    """
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
    validating a config that names it (in every process that loads such a run).

    Args:
      name: the name a config gives as model.norm.type; a non-empty string not registered yet.
      fn: the norm, fn(x [..., D], scale [D], bias [D] | None, eps) -> [..., D].
      bias: whether the Norm module creates a bias [D] for it (else it passes None).

    Returns:
      fn, unchanged.

    Raises:
      ValueError: an empty or non-string name, or a name already registered (norms are not silently replaced).
      TypeError: fn is not callable, or bias is not True or False.

    Examples:
      >>> from jaxformer.ops.norms import NORM_BIAS, NORMS, register_norm, rms_norm
      >>> def scaled_rms(x, scale, bias, eps):                     # registered with bias=False: bias is None
      ...     return 2.0 * rms_norm(x, scale, eps)
      >>> register_norm("scaled_rms", scaled_rms, bias=False) is scaled_rms, NORM_BIAS["scaled_rms"]
      (True, False)
      >>> register_norm("rmsnorm", scaled_rms, bias=False)
      Traceback (most recent call last):
      ...
      ValueError: norm 'rmsnorm' is already registered (registered: (...)); choose another name
      >>> del NORMS["scaled_rms"], NORM_BIAS["scaled_rms"]         # (the example leaves the registry as it was)
    """
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
