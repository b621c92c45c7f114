"""JumpReLU and its step function with straight-through gradients (Rajamanoharan et al. 2024, "Jumping Ahead"), the
activation of JumpReLU sparse autoencoders and transcoders, written as SAELens 6 trains them (its `JumpReLU` and
`Step` autograd functions, `sae_lens/saes/jumprelu_sae.py`).

Forward: jumprelu(x, θ) = x · [x > θ], step(x, θ) = [x > θ]. Both are flat in θ almost everywhere, so the threshold
learns through a kernel estimate of the jump: with the rectangle kernel K(u) = [−½ < u < ½] of width ε (the
bandwidth), ∂jumprelu/∂θ ≈ −(θ/ε)·K((x − θ)/ε) and ∂step/∂θ ≈ −(1/ε)·K((x − θ)/ε), summed over the rows the
threshold is shared by. The input's gradient is jumprelu's own, [x > θ] (step's: none), plus, with
`ste_to_input=True` (Anthropic's setup), the negation of the threshold's estimate: SAELens' option of that name.

Axis legend: R rows (any leading axes), F latents; the threshold is [F] (or a scalar), shared by the rows.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def rectangle(u: jax.Array) -> jax.Array:
    """The rectangle kernel: 1 inside (−½, ½), else 0, in u's dtype.

    Args:
      u: an array of any shape.

    Returns:
      An array of u's shape and dtype, 1.0 where −½ < u < ½.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.sparse import rectangle
      >>> rectangle(jnp.array([-0.5, -0.2, 0.0, 0.49, 0.5])).tolist()
      [0.0, 1.0, 1.0, 1.0, 0.0]
    """
    return ((u > -0.5) & (u < 0.5)).astype(u.dtype)


def _shared(t: jax.Array, threshold: jax.Array) -> jax.Array:
    """A per-element gradient summed over the axes the threshold is broadcast along."""
    return jnp.sum(t, axis=tuple(range(t.ndim - threshold.ndim))).reshape(threshold.shape)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def jumprelu(x: jax.Array, threshold: jax.Array, bandwidth: float, ste_to_input: bool = False) -> jax.Array:
    """x · [x > threshold], with the straight-through threshold gradient (module docstring).

    Args:
      x: [..., F] pre-activations.
      threshold: [F] (or a scalar) thresholds, shared by the rows.
      bandwidth: ε > 0, the rectangle kernel's width of the threshold's gradient estimate.
      ste_to_input: pass the estimate's negation on to x as well (SAELens' `jumprelu_ste_to_input`).

    Returns:
      [..., F] in x's dtype: x where it exceeds the threshold, else 0.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.ops.sparse import jumprelu
      >>> x, theta = jnp.array([[0.5, 1.02, 2.0]]), jnp.array([1.0, 1.0, 1.0])
      >>> jumprelu(x, theta, 0.1).tolist()
      [[0.0, 1.0199999809265137, 2.0]]
      >>> (jax.grad(lambda t: jumprelu(x, t, 0.1).sum())(theta) + 0.0).tolist()    # −θ/ε where x is within ε/2
      [0.0, -10.0, 0.0]
    """
    return x * (x > threshold)


def _jumprelu_fwd(x, threshold, bandwidth, ste_to_input):
    return x * (x > threshold), (x, threshold)


def _jumprelu_bwd(bandwidth, ste_to_input, res, g):
    x, threshold = res
    ste = (threshold / bandwidth) * rectangle((x - threshold) / bandwidth) * g
    x_grad = (x > threshold) * g + (ste if ste_to_input else 0.0)
    return x_grad.astype(x.dtype), _shared(-ste, threshold).astype(threshold.dtype)


jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def step(x: jax.Array, threshold: jax.Array, bandwidth: float, ste_to_input: bool = False) -> jax.Array:
    """[x > threshold] in x's dtype, with the straight-through threshold gradient: JumpReLU's L0 (module docstring).

    Args:
      x: [..., F] pre-activations.
      threshold: [F] (or a scalar) thresholds, shared by the rows.
      bandwidth: ε > 0, the rectangle kernel's width.
      ste_to_input: pass the estimate's negation on to x (else x gets no gradient).

    Returns:
      [..., F] in x's dtype: 1.0 where x exceeds the threshold, else 0.0.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.ops.sparse import step
      >>> x, theta = jnp.array([[0.5, 1.02, 2.0]]), jnp.array([1.0, 1.0, 1.0])
      >>> step(x, theta, 0.1).tolist()
      [[0.0, 1.0, 1.0]]
      >>> (jax.grad(lambda t: step(x, t, 0.1).sum())(theta) + 0.0).tolist()        # −1/ε where x is within ε/2
      [0.0, -10.0, 0.0]
    """
    return (x > threshold).astype(x.dtype)


def _step_fwd(x, threshold, bandwidth, ste_to_input):
    return (x > threshold).astype(x.dtype), (x, threshold)


def _step_bwd(bandwidth, ste_to_input, res, g):
    x, threshold = res
    ste = (1.0 / bandwidth) * rectangle((x - threshold) / bandwidth) * g
    x_grad = ste if ste_to_input else jnp.zeros_like(x)
    return x_grad.astype(x.dtype), _shared(-ste, threshold).astype(threshold.dtype)


step.defvjp(_step_fwd, _step_bwd)
