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
    """`block` (a copy of one layer's parameters, changed in place) with its weights laid out for a token loop
    over `batch` rows (None: not known) -> the block."""
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
    """An encoder-decoder's memory as a token loop reads it: each decoder layer's cross-attention keys/values of
    the encoder output memory [B,S,D], computed once, heads-major [B,K,S,H] like the cache (`stack`: the laid-out
    decoder, `nn.stack.DecodingLayers`)."""
    return LayerwiseKV.collect([heads_major(blk.cross_attn.project_kv(memory)) for blk in stack.blocks])

