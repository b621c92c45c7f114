"""FFN activations. relu/gelu/gelu_tanh act on one tensor [..., F]; swiglu/geglu/geglu_tanh gate two ([..., F]
each)."""
from __future__ import annotations

import math

import jax

_SQRT_HALF = 1.0 / math.sqrt(2.0)


def relu(x: jax.Array) -> jax.Array:
    """ReLU, max(x, 0).

    Args:
      x: [..., F] input.

    Returns:
      [..., F] in x's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import relu
      >>> relu(jnp.array([-1.0, 2.0])).tolist()
      [0.0, 2.0]
    """
    return jax.nn.relu(x)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, x·Φ(x) = 0.5·x·(1 + erf(x/√2)), computed as torch.nn.GELU() computes it. [..., F] ->
    [..., F].

    Not jax.nn.gelu(approximate=False), which writes the same function with erfc (0.5·x·erfc(−x/√2)): accurate
    in the far negative tail, but XLA expands erfc into both of its branches (a polynomial and an exp-times-
    rational) where erf is one rational, and XLA:CPU duplicates that expansion into each backward fusion that
    reads it. The erf form against the erfc one, the op alone and in the char model's step: benchmarks/levers.py
    (`gelu_erf`; benchmarks/results/levers.md, rows `gelu_erf`). Accuracy is float32's: absolute error
    ≲ 1e-7·max(1, |x|) against float64 (what torch's GELU gives); below about x = −3 the output
    (|y| < 4e-3) carries erf's rounding next to −1, so its relative error grows there, as torch's.

    Args:
      x: [..., F] input.

    Returns:
      [..., F] in x's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import gelu
      >>> [round(v, 4) for v in gelu(jnp.array([-1.0, 0.0, 1.0])).tolist()]
      [-0.1587, 0.0, 0.8413]
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (GPT-2's gelu_new, torch's approximate='tanh'). [..., F] -> [..., F].

    Args:
      x: [..., F] input.

    Returns:
      [..., F] in x's dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import gelu_tanh
      >>> [round(v, 4) for v in gelu_tanh(jnp.array([-1.0, 0.0, 1.0])).tolist()]
      [-0.1588, 0.0, 0.8412]
    """
    return jax.nn.gelu(x, approximate=True)


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """GELU(gate) * up, exact GELU (Shazeer 2020). gate, up [..., F] -> [..., F].

    Args:
      gate: [..., F] the gate's pre-activation.
      up: [..., F] the values it gates.

    Returns:
      [..., F] in their dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import geglu
      >>> [round(v, 4) for v in geglu(jnp.array([1.0, -1.0]), jnp.array([2.0, 2.0])).tolist()]
      [1.6827, -0.3173]
    """
    return gelu(gate) * up


def geglu_tanh(gate: jax.Array, up: jax.Array) -> jax.Array:
    """tanh-GELU(gate) * up (Gemma, T5 v1.1). gate, up [..., F] -> [..., F].

    Args:
      gate: [..., F] the gate's pre-activation.
      up: [..., F] the values it gates.

    Returns:
      [..., F] in their dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import geglu_tanh
      >>> [round(v, 4) for v in geglu_tanh(jnp.array([1.0, -1.0]), jnp.array([2.0, 2.0])).tolist()]
      [1.6824, -0.3176]
    """
    return gelu_tanh(gate) * up


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up (Shazeer 2020). gate, up [..., F] -> [..., F].

    Args:
      gate: [..., F] the gate's pre-activation.
      up: [..., F] the values it gates.

    Returns:
      [..., F] in their dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.activations import swiglu
      >>> [round(v, 4) for v in swiglu(jnp.array([1.0, -1.0]), jnp.array([2.0, 2.0])).tolist()]
      [1.4621, -0.5379]
    """
    return jax.nn.silu(gate) * up


GATED = {"swiglu": swiglu, "geglu": geglu, "geglu_tanh": geglu_tanh}
UNGATED = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh}
NAMES = tuple(UNGATED) + tuple(GATED)
