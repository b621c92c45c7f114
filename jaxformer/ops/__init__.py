"""Pure, jit/grad/vmap-compatible Transformer ops. No Flax import here.

Axis legend: B batch, T query length, S key length, D model width, N query heads,
K kv heads, H head dim, F FFN width, V vocab, L layers; ops.moe adds M tokens, E experts, C capacity.
"""
from jaxformer.ops import activations, attention, flash, fused, masks, moe, norms, positional
from jaxformer.ops.attention import Attention, attention_probs, dot_product_attention
from jaxformer.ops.masks import (CausalMask, causal_mask, combine_masks, padding_mask, position_causal_mask,
                                 positions_from_segments, segment_mask)

__all__ = [
    "activations", "attention", "flash", "fused", "masks", "moe", "norms", "positional",
    "Attention", "attention_probs", "dot_product_attention", "CausalMask", "causal_mask", "combine_masks",
    "padding_mask", "position_causal_mask", "positions_from_segments", "segment_mask",
]
