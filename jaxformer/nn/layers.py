"""Norm, FeedForward, Encoder/Decoder blocks. Thin: parameters + calls into jaxformer.ops.

Axis legend: B batch, T target length, S source length, D model width, F FFN width.
Norm placement: "post" = LN(x + Sublayer(x)) (2017 paper, seed 000); "pre" = x + Sublayer(LN(x)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.moe import MoEFeedForward
from jaxformer.nn.params import dense_init, ones, param, zeros
from jaxformer.ops import activations, norms
from jaxformer.quantize import QuantizedKV, project


def dropout(layer: nnx.Dropout, x: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
    """Dropout only when training, i.e. when a dropout key stream is passed; inference passes none."""
    if rngs is None or layer.rate == 0.0:
        return x
    return layer(x, deterministic=False, rngs=rngs)


class Norm(nnx.Module):
    """The norm named by cfg.norm_type, looked up in `ops.norms.NORMS`: LayerNorm (scale + bias), RMSNorm
    (scale), or any registered with `ops.norms.register_norm`. A scale [D] (ones) always; a bias [D] (zeros)
    only for norms registered with bias=True."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kind, self.eps = cfg.norm_type, cfg.norm_eps
        self.scale = param(rngs, ones, (cfg.d_model,), ("embed",))
        if norms.NORM_BIAS[self.kind]:
            self.bias = param(rngs, zeros, (cfg.d_model,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., D] -> [..., D]."""
        bias = self.bias[...] if norms.NORM_BIAS[self.kind] else None
        return norms.NORMS[self.kind](x, self.scale[...], bias, self.eps)


class FeedForward(nnx.Module):
    """Position-wise FFN: w2(act(w1 x)), or w2(swiglu(wg x, w1 x)). w1/wg [D,F], w2 [F,D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.activation, self.use_bias = cfg.activation, cfg.use_bias
        self.w1 = param(rngs, dense_init(0, 1), (d, f), ("embed", "mlp"), matrix=True)
        if self.activation in activations.GATED:
            self.wg = param(rngs, dense_init(0, 1), (d, f), ("embed", "mlp"), matrix=True)
        self.w2 = param(rngs, dense_init(0, 1), (f, d), ("mlp", "embed"), matrix=True)
        if cfg.use_bias:
            self.b1 = param(rngs, zeros, (f,), ("mlp",))
            self.b2 = param(rngs, zeros, (d,), ("embed",))
            if self.activation in activations.GATED:
                self.bg = param(rngs, zeros, (f,), ("mlp",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B,T,D] -> [B,T,D]."""
        def dense(w, b, y, eq):
            out = project(eq, y, w[...])
            return (out + b[...]).astype(y.dtype) if self.use_bias else out
        h = dense(self.w1, getattr(self, "b1", None), x, "BTD,DF->BTF")
        if self.activation in activations.GATED:
            h = activations.GATED[self.activation](dense(self.wg, getattr(self, "bg", None), x, "BTD,DF->BTF"), h)
        else:
            h = activations.UNGATED[self.activation](h)
        return dense(self.w2, getattr(self, "b2", None), h, "BTF,FD->BTD")


class Residual(nnx.Module):
    """One sublayer's residual wiring with pre/post norm placement and training-only dropout."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.pre = cfg.norm_position == "pre"
        self.norm = Norm(cfg, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, sublayer, rngs: nnx.Rngs | None):
        """x [B,T,D]; sublayer: [B,T,D] -> [B,T,D] or ([B,T,D], extra). Returns (x, extra)."""
        out = sublayer(self.norm(x) if self.pre else x)
        out, extra = out if isinstance(out, tuple) else (out, None)
        y = x + dropout(self.drop, out, rngs)
        return (y if self.pre else self.norm(y)), extra


def make_ffn(cfg: ModelConfig, moe: bool, rngs: nnx.Rngs) -> nnx.Module:
    """The block's FFN: dense, or (moe=True) the Mixture-of-Experts FFN."""
    if moe:
        return MoEFeedForward(cfg, rngs=rngs)
    return FeedForward(cfg, rngs=rngs)


def _ffn_sublayer(block, x, valid, rngs, extras: dict):
    """The FFN residual sublayer; a MoE FFN's statistics go to extras["moe"]."""
    if block.moe:
        x, extras["moe"] = block.res_ffn(x, lambda y: block.ffn(y, valid, train=rngs is not None), rngs)
        return x
    return block.res_ffn(x, block.ffn, rngs)[0]


class EncoderBlock(nnx.Module):
    """Self-attention -> FFN (dense, or Mixture-of-Experts with moe=True), each wrapped by Residual.

    Returns x, or (x, extras) when there is anything extra: {"self": weights} with return_weights, {"moe":
    ops.moe.MoEStats} from a MoE FFN."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, self_attention=True, rngs=rngs)
        self.moe = moe
        self.ffn = make_ffn(cfg, moe, rngs)
        self.res_attn = Residual(cfg, rngs=rngs)
        self.res_ffn = Residual(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None, positions: jax.Array | None,
                 rngs: nnx.Rngs | None = None, return_weights: bool = False, valid: jax.Array | None = None):
        """x [B,S,D], mask [B,1,S,S]-broadcastable, positions [B,S], valid [B,S] (non-padding; MoE routing
        only) -> [B,S,D]; with return_weights also {"self": attention weights [B,N,S,S] float32}."""
        x, w = self.res_attn(x, lambda y: self.self_attn(y, mask=mask, q_positions=positions,
                                                         return_weights=return_weights), rngs)
        extras = {"self": w} if return_weights else {}
        x = _ffn_sublayer(self, x, valid, rngs, extras)
        return (x, extras) if extras else x


class DecoderBlock(nnx.Module):
    """Masked self-attention -> cross-attention over encoder memory (if cross) -> FFN (dense, or
    Mixture-of-Experts with moe=True).

    With `cache=(k, v)` ([B,S,K,H] each: this layer's cached keys/values) the self-attention attends over
    the S cached keys followed by this step's T new keys, as two segments (no copy of the cache); the
    caller's mask [B,1,T,S+T] and kv_positions [B,S+T] decide what is visible. The block then also returns
    the new (k, v) [B,T,K,H] for the caller to write into its cache.

    Returns x, or (x, extras) when there is anything extra: {"cache": (k, v)} with a cache, {"self", "cross"}
    weights with return_weights, {"moe": ops.moe.MoEStats} from a MoE FFN.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, self_attention=True, rngs=rngs)
        self.res_self = Residual(cfg, rngs=rngs)
        self.cross = cross
        if cross:
            self.cross_attn = MultiHeadAttention(cfg, self_attention=False, rngs=rngs)
            self.res_cross = Residual(cfg, rngs=rngs)
        self.moe = moe
        self.ffn = make_ffn(cfg, moe, rngs)
        self.res_ffn = Residual(cfg, rngs=rngs)

    def _self_attention(self, y, mask, positions, cache, kv_positions, return_weights=False):
        if cache is None:
            return self.self_attn(y, mask=mask, q_positions=positions, return_weights=return_weights)
        k_cache, v_cache = cache
        if isinstance(k_cache, QuantizedKV):                                # an int8 cache: attend dequantized
            k_cache, v_cache = k_cache.dequantize(y.dtype), v_cache.dequantize(y.dtype)
        q = self.self_attn.project_q(y, positions)
        k, v = self.self_attn.project_kv(y, positions)
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
        keys, values = (k_cache, k), (v_cache, v)                          # segments: S cached + T new
        out = self.self_attn.attend(q, keys, values, mask=mask, q_positions=positions, kv_positions=kv_positions)
        return out, (k, v)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None, positions: jax.Array | None,
                 memory: jax.Array | None = None, memory_kv: tuple[jax.Array, jax.Array] | None = None,
                 memory_mask: jax.Array | None = None, rngs: nnx.Rngs | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None, kv_positions: jax.Array | None = None,
                 return_weights: bool = False, valid: jax.Array | None = None):
        """x [B,T,D]; memory [B,S,D] (or its precomputed cross k/v [B,S,K,H] x2); masks broadcast to
        [B,N,T,S]; valid [B,T] (non-padding; MoE routing only). Returns [B,T,D], or ([B,T,D], extras):
        "cache" (k, v) [B,T,K,H] when a cache is given; with return_weights (no cache) "self" [B,N,T,T] and
        "cross" [B,N,T,S] (if cross) float32 weights; "moe" statistics."""
        if return_weights and cache is not None:
            raise ValueError("return_weights is for uncached passes (cache=None)")
        x, extra = self.res_self(x, lambda y: self._self_attention(y, mask, positions, cache, kv_positions,
                                                                   return_weights), rngs)
        extras = {"cache": extra} if cache is not None else {"self": extra} if return_weights else {}
        if self.cross:
            def cross(y):
                if memory_kv is not None:
                    q = self.cross_attn.project_q(y)
                    return self.cross_attn.attend(q, *memory_kv, mask=memory_mask, return_weights=return_weights)
                return self.cross_attn(y, memory, mask=memory_mask, return_weights=return_weights)
            x, w = self.res_cross(x, cross, rngs)
            if return_weights:
                extras["cross"] = w
        x = _ffn_sublayer(self, x, valid, rngs, extras)
        return (x, extras) if extras else x
