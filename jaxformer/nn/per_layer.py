"""Per-layer settings, computed in one place from a block's layer index.

Every block of a stack is called with its layer index (`layer`: an int32 scalar, traced inside the layer scan,
a constant in a decoding program's token loop), so what varies with depth is a function of (config, layer) here,
not an input threaded through the stack, the decoding layout and the model. Adding a per-layer variant is one
field of `LayerSettings` and one line of `settings`, read by the block that uses it.

Today: the decoder's sliding windows (model.attention.windows, repeated over the layers).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.config import ModelConfig


class LayerSettings(NamedTuple):
    """What one layer does differently from the others. window: its self-attention's sliding window (an int32
    scalar, 0 = global), or None when no layer has one (the mask stays as built)."""
    window: jax.Array | None


def settings(cfg: ModelConfig, layer: jax.Array | int, stack: str = "decoder") -> LayerSettings:
    """The settings of layer `layer` (0-based, its stack's) of `stack` ("encoder" | "decoder")."""
    windows = cfg.layer_windows() if stack == "decoder" and any(cfg.attention.windows) else None
    window = None if windows is None else jnp.asarray(windows, jnp.int32)[layer]
    return LayerSettings(window)
