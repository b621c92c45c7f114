"""Per-layer settings, computed in one place from a block's layer index.

Every block of a stack is called with its layer index (`layer`: an int32 scalar, traced inside the layer scan,
a constant in a decoding program's token loop), so what varies with depth is a function of (config, layer) here,
not an input threaded through the stack, the decoding layout and the model. The rules themselves are written
beside their config fields (`ModelConfig.per_layer`: a new rule for an existing setting is one line there); a new
setting is also a field of `LayerSettings`, read by the module that uses it.

Today: the decoder's sliding windows (model.attention.windows, repeated over the layers) and the layers that
skip RoPE (model.rope.nope_every: SmolLM3's / Llama 4's NoPE layers). Both are read by the self-attention
(`nn.attention.MultiHeadAttention`, its `layer` argument), which the blocks hand these settings to unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.config import ModelConfig


class LayerSettings(NamedTuple):
    """What one layer does differently from the others. window: its self-attention's sliding window (an int32
    scalar, 0 = global), or None when no layer has one (the mask stays as built). rope: whether its
    self-attention rotates q and k (a bool scalar), or None when every layer does as model.positional says.
    softcap: its self-attention's logit soft-cap (a float32 scalar, 0 = none), or None when every layer takes
    model.attention.softcap. scale: its self-attention's logit scale (a float32 scalar), or None when every
    layer takes the config's (`nn.attention.logit_scale`). index: the layer's index (int32; 0 outside a stack),
    for what a module derives from depth itself."""
    window: jax.Array | None = None
    rope: jax.Array | None = None
    softcap: jax.Array | None = None
    scale: jax.Array | None = None
    index: jax.Array | int = 0


UNIFORM = LayerSettings()       # a layer like every other (a standalone attention call)


def settings(cfg: ModelConfig, layer: jax.Array | int, stack: str = "decoder") -> LayerSettings:
    """The settings of layer `layer` (0-based, its stack's) of `stack` ("encoder" | "decoder"): the config's
    per-layer rules (`ModelConfig.per_layer`) at this index."""
    rules = cfg.per_layer(stack)
    return LayerSettings(**{name: None if rule is None else jnp.asarray(rule)[layer] for name, rule in rules.items()},
                         index=layer)
