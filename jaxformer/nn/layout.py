"""The decoding layout: one block's weights laid out for a token loop, as weight kinds (`nn.weights`) that bring
their own matmul, so the modules that use them (attention, FFNs, a variant's own) name no layout.

`laid_out(block, batch)` replaces, in a block that is already its own copy (`nn.stack.LayerStack.lay_out`), the
parameters a platform lever asks to lay out (`jaxformer.platforms`; each lever's results row in
benchmarks/results/levers.md):
  decode_fused_qkv   a self-attention's wq, wk, wv as one matrix [D,(N+2K)·H] (`Fused`, held by wq; wk and wv
                     hold `Within`): one matmul a step, at any batch;
  decode_w2_out_in   over one row (batch 1), a 2-D projection whose input is wider than its output (a dense FFN's
                     w2 [F,D], F > D) stored [out,in] (`OutIn`): XLA:CPU's matrix-vector product reads it faster.
Only plain float parameters are laid out: a weight that brings its own matmul (quantized, adapted) stays as it is.
The KV cache's own layout (heads-major [B,K,S,H]) is the cache's: `nn.cache`'s views say it; an encoder-decoder's
memory is laid out in it once (`laid_out_memory`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.cache import LayerwiseKV, heads_major
from jaxformer.nn.params import lever, side_by_side
from jaxformer.nn.weights import Fused, OutIn, Within


def laid_out(block: nnx.Module, batch: int | None) -> nnx.Module:
    """A block's weights laid out for a token loop, as the platform levers ask (see the module docstring).

    Args:
      block: a copy of one layer's parameters (e.g. a `DecoderBlock`), changed in place.
      batch: the token loop's rows B (None: not known).

    Returns:
      The block: a self-attention's wq holds `Fused` [D, (N+2K)·H] (wk, wv `Within`) with decode_fused_qkv; with
        batch 1 and decode_w2_out_in, each 2-D projection wider in than out (an FFN's w2 [F, D]) holds `OutIn`.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer import platforms
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import DecoderBlock
      >>> from jaxformer.nn.layout import laid_out
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> with platforms.override(decode_fused_qkv=True, decode_w2_out_in=True):
      ...     block = laid_out(DecoderBlock(cfg, cross=False, rngs=nnx.Rngs(0)), batch=1)
      >>> wq, wk, w2 = (p.get_value() for p in (block.self_attn.wq, block.self_attn.wk, block.ffn.w2))
      >>> type(wq).__name__, wq.array.shape, type(wk).__name__, type(w2).__name__, w2.array.shape
      ('Fused', (16, 48), 'Within', 'OutIn', (16, 32))
    """
    for _, module in nnx.iter_graph(block):
        if not isinstance(module, nnx.Module):
            continue
        if isinstance(module, MultiHeadAttention) and module.self_attention and lever("decode_fused_qkv"):
            _fuse(module, ("wq", "wk", "wv"))
        if batch == 1 and lever("decode_w2_out_in"):
            for name, p in list(vars(module).items()):
                w = _plain(p)
                if w is not None and w.ndim == 2 and p.get_metadata().get("quantizable") and w.shape[0] > w.shape[1]:
                    p.set_value(OutIn(jnp.transpose(w)))
    return block


def _plain(p) -> jax.Array | None:
    """The float array an nnx.Param holds, or None (not a parameter, or a weight kind)."""
    if not isinstance(p, nnx.Param):
        return None
    w = p.get_value()
    return w if isinstance(w, jax.Array) else None


def _fuse(module: nnx.Module, names: tuple[str, ...]) -> None:
    """The module's parameters `names` (reading the same input, on their first axis) as one `Fused` matrix."""
    params = [getattr(module, n) for n in names]
    ws = [_plain(p) for p in params]
    if any(w is None for w in ws):
        return
    params[0].set_value(Fused(side_by_side(ws), tuple(w.shape for w in ws)))
    for p, w in zip(params[1:], ws[1:]):
        p.set_value(Within(w.shape))


def laid_out_memory(stack, memory: jax.Array) -> LayerwiseKV:
    """An encoder-decoder's memory as a token loop reads it: each decoder layer's cross-attention keys/values,
    computed once, heads-major like the cache.

    Args:
      stack: the laid-out decoder (`nn.stack.DecodingLayers`), its blocks with cross-attention.
      memory: [B, S, D] the encoder output.

    Returns:
      `LayerwiseKV` of L keys and L values [B, K, S, H].

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import DecoderBlock
      >>> from jaxformer.nn.layout import laid_out_memory
      >>> from jaxformer.nn.stack import DecodingLayers
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> stack = DecodingLayers([DecoderBlock(cfg, cross=True, rngs=nnx.Rngs(0))])
      >>> kv = laid_out_memory(stack, jnp.ones((1, 3, 16)))                  # memory [B, S, D]
      >>> type(kv).__name__, len(kv.k), kv.k[0].shape
      ('LayerwiseKV', 1, (1, 2, 3, 8))
    """
    return LayerwiseKV.collect([heads_major(blk.cross_attn.project_kv(memory)) for blk in stack.blocks])

