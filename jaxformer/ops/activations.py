"""FFN activations. relu/gelu/gelu_tanh act on one tensor [..., F]; swiglu/geglu/geglu_tanh gate two ([..., F]
each)."""
from __future__ import annotations

import jax


def relu(x: jax.Array) -> jax.Array:
    """[..., F] -> [..., F]."""
    return jax.nn.relu(x)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as torch.nn.GELU() by default. [..., F] -> [..., F]."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (GPT-2's gelu_new, torch's approximate='tanh'). [..., F] -> [..., F]."""
    return jax.nn.gelu(x, approximate=True)


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """GELU(gate) * up, exact GELU (Shazeer 2020). gate, up [..., F] -> [..., F]."""
    return gelu(gate) * up


def geglu_tanh(gate: jax.Array, up: jax.Array) -> jax.Array:
    """tanh-GELU(gate) * up (Gemma, T5 v1.1). gate, up [..., F] -> [..., F]."""
    return gelu_tanh(gate) * up


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up (Shazeer 2020). gate, up [..., F] -> [..., F]."""
    return jax.nn.silu(gate) * up


GATED = {"swiglu": swiglu, "geglu": geglu, "geglu_tanh": geglu_tanh}
UNGATED = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh}
NAMES = tuple(UNGATED) + tuple(GATED)
