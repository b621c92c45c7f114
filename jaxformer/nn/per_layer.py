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
    """What one layer does differently from the others (`UNIFORM`: a layer like every other).

    Attributes:
      window: its self-attention's sliding window (an int32 scalar, 0 = global), or None when no layer has one
        (the mask stays as built).
      rope: whether its self-attention rotates q and k (a bool scalar), or None when every layer does as
        model.positional says.
      softcap: its self-attention's logit soft-cap (a float32 scalar, 0 = none), or None when every layer takes
        model.attention.softcap.
      scale: its self-attention's logit scale (a float32 scalar), or None when every layer takes the config's
        (`nn.attention.logit_scale`).
      index: the layer's index (int32; 0 outside a stack), for what a module derives from depth itself.

    Examples:
      >>> from jaxformer.nn.per_layer import UNIFORM
      >>> UNIFORM.window is None, UNIFORM.index
      (True, 0)
    """
    window: jax.Array | None = None
    rope: jax.Array | None = None
    softcap: jax.Array | None = None
    scale: jax.Array | None = None
    index: jax.Array | int = 0


UNIFORM = LayerSettings()       # a layer like every other (a standalone attention call)


def settings(cfg: ModelConfig, layer: jax.Array | int, stack: str = "decoder") -> LayerSettings:
    """The settings of one layer: the config's per-layer rules (`ModelConfig.per_layer`) at its index.

    Args:
      cfg: the model's config.
      layer: the layer's 0-based index in its stack (an int, or an int32 scalar, may be traced).
      stack: "encoder" | "decoder".

    Returns:
      The layer's `LayerSettings` (a setting no layer varies is None).

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.per_layer import settings
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", num_decoder_layers=2, attention__windows=(4, 0),
      ...                positional="rope", rope__nope_every=2)      # layer 0: window 4; layer 1: global, NoPE
      >>> s = settings(cfg, 1)
      >>> int(s.window), bool(s.rope), s.softcap, s.index
      (0, False, None, 1)
    """
    rules = cfg.per_layer(stack)
    return LayerSettings(**{name: None if rule is None else jnp.asarray(rule)[layer] for name, rule in rules.items()},
                         index=layer)
