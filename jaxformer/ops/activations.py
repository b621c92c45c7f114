"""FFN activations. relu/gelu act on one tensor [..., F]; swiglu gates two ([..., F] each)."""
from __future__ import annotations

import jax


def relu(x: jax.Array) -> jax.Array:
    """[..., F] -> [..., F]."""
    return jax.nn.relu(x)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as torch.nn.GELU() by default. [..., F] -> [..., F]."""
    return jax.nn.gelu(x, approximate=False)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up (Shazeer 2020). gate, up [..., F] -> [..., F]."""
    return jax.nn.silu(gate) * up


GATED = {"swiglu": swiglu}
UNGATED = {"relu": relu, "gelu": gelu}
NAMES = tuple(UNGATED) + tuple(GATED)
