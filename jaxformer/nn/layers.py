"""Norm, FeedForward, Encoder/Decoder blocks. Thin: parameters + calls into jaxformer.ops.

Axis legend: B batch, T target length, S source length, D model width, F FFN width.
Norm placement: "post" = LN(x + Sublayer(x)) (2017 paper, seed 000); "pre" = x + Sublayer(LN(x)).

Return convention: every sublayer, block and stack returns (y, aux), aux a dict that may be empty:
"self" / "cross" attention weights [B,N,T,S] (when ctx.weights), "moe" router statistics (a MoE FFN), "kv" the
layer's new keys/values (a LayerKV [B,T,K,H], when a cache slice was passed in). Leaf layers (Norm) return
their one array.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.cache import LayerKV
from jaxformer.nn.moe import MoEFeedForward
from jaxformer.nn import init
from jaxformer.nn.params import lever, ones, param, project, zeros
from jaxformer.ops import activations, norms


class Context(NamedTuple):
    """What every block of a stack reads besides its input (the same for every layer).

    positions [B,T] int: the tokens' positions. mask: the self-attention mask over the keys (a cache's S slots
    then the T new tokens when cached), broadcastable to [B,N,T,S] or a lazy ops.masks.CausalMask.
    kv_positions [B,S] of those keys (None = positions). valid [B,T] bool: real tokens (MoE routing only).
    memory [B,S_src,D]: the encoder output for cross-attention when its keys/values are not precomputed per
    layer; memory_mask its mask, broadcastable to [B,N,T,S_src]. weights: collect attention weights into aux."""
    positions: jax.Array | None = None
    mask: Any = None
    kv_positions: jax.Array | None = None
    valid: jax.Array | None = None
    memory: jax.Array | None = None
    memory_mask: Any = None
    weights: bool = False


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

    def __init__(self, cfg: ModelConfig, *, stack: str = "decoder", rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.activation, self.use_bias = cfg.activation, cfg.has_bias("ffn")
        w = lambda role, shape, axes: param(rngs, init.weight(cfg, role, stack=stack), shape, axes,  # noqa: E731
                                            matrix=True, quantizable=True)
        self.w1 = w("ffn_in", (d, f), ("embed", "mlp"))
        if self.activation in activations.GATED:
            self.wg = w("ffn_in", (d, f), ("embed", "mlp"))
        self.w2 = w("ffn_out", (f, d), ("mlp", "embed"))
        if self.use_bias:
            self.b1 = param(rngs, init.bias(cfg, "ffn_in"), (f,), ("mlp",))
            self.b2 = param(rngs, init.bias(cfg, "ffn_out"), (d,), ("embed",))
            if self.activation in activations.GATED:
                self.bg = param(rngs, init.bias(cfg, "ffn_in"), (f,), ("mlp",))

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, *, train: bool = False):
        """[B,T,D] -> ([B,T,D], {}). (valid and train: the FFN interface a MoE FFN shares; unused here.)"""
        def dense(w, b, y, eq):
            out = project(eq, y, w[...])
            return (out + b[...]).astype(y.dtype) if self.use_bias else out
        h = dense(self.w1, getattr(self, "b1", None), x, "BTD,DF->BTF")
        if self.activation in activations.GATED:
            h = activations.GATED[self.activation](dense(self.wg, getattr(self, "bg", None), x, "BTD,DF->BTF"), h)
        else:
            h = activations.UNGATED[self.activation](h)
        if getattr(self, "w2_out_in", None) is not None:                      # laid out for one row
            return dense(self.w2_out_in, getattr(self, "b2", None), h, "BTF,DF->BTD"), {}
        return dense(self.w2, getattr(self, "b2", None), h, "BTF,FD->BTD"), {}

    def lay_out_for_decoding(self, batch: int | None) -> None:
        """The decoding layout of a token loop (`nn.stack.LayerStack.unstack` calls it on each layer's copy): over
        one row (batch 1), w2 [F,D] also stored as `w2_out_in` [D,F], which the call then contracts on its last
        axis. With one row a projection is a matrix-vector product, and XLA:CPU reads a weight whose input is
        wider than its output (F > D) faster in that order, each output a dot product over a contiguous row:
        benchmarks/levers.py `decode_w2_out_in`; for more rows it is slower (a matmul with a transposed operand),
        so a layout for a batch (or batch None: not known) keeps w2 as it is, and so does F <= D. The transposing
        copy is made once per decoding call (at base size, 2-core AMD EPYC, two readings: the layout takes 19.2 ms
        instead of 13.6, and 24.3 instead of 16.9; the loop saves about 0.4 ms per token, so 14-19 tokens repay
        it). A weight that brings its own matmul (quantized) stays."""
        w = self.w2[...]
        if batch == 1 and not hasattr(w, "project") and w.shape[0] > w.shape[1] and lever("decode_w2_out_in"):
            self.w2_out_in = nnx.data(jnp.transpose(w))


class Residual(nnx.Module):
    """One sublayer's residual wiring (model.norm_position) with training-only dropout:
    post LN(x + f(x)); pre x + f(LN(x)); sandwich x + LN'(f(LN(x))) (two norms); deepnorm LN(α·x + f(x)) (DeepNet:
    α per stack, `init.deepnorm`, with its β in the init); rezero x + g·f(x), g a learnable scalar from 0."""

    def __init__(self, cfg: ModelConfig, *, stack: str = "decoder", rngs: nnx.Rngs):
        self.kind = cfg.norm_position
        if self.kind != "rezero":
            self.norm = Norm(cfg, rngs=rngs)
        if self.kind == "sandwich":
            self.post_norm = Norm(cfg, rngs=rngs)
        if self.kind == "rezero":
            self.gate = param(rngs, zeros, (), ())
        self.alpha = init.deepnorm(cfg, stack)[0] if self.kind == "deepnorm" else 1.0
        self.drop = nnx.Dropout(cfg.dropout)

    def sublayer_input(self, x: jax.Array) -> jax.Array:
        """What the sublayer reads: LN(x) for pre and sandwich, else x. [B,T,D] -> [B,T,D]."""
        return self.norm(x) if self.kind in ("pre", "sandwich") else x

    def __call__(self, x: jax.Array, sublayer, rngs: nnx.Rngs | None) -> tuple[jax.Array, dict]:
        """x [B,T,D]; sublayer: [B,T,D] -> ([B,T,D], aux). -> (x [B,T,D], the sublayer's aux)."""
        out, aux = sublayer(self.sublayer_input(x))
        if self.kind == "sandwich":
            out = self.post_norm(out)
        elif self.kind == "rezero":
            out = (out * self.gate[...]).astype(x.dtype)
        out = dropout(self.drop, out, rngs)
        if self.kind in ("post", "deepnorm"):
            return self.norm(x * self.alpha + out if self.alpha != 1.0 else x + out), aux
        return x + out, aux


def make_ffn(cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, stack: str = "decoder") -> nnx.Module:
    """The block's FFN: dense, or (moe=True) the Mixture-of-Experts FFN; both return (y, aux)."""
    if moe:
        return MoEFeedForward(cfg, stack=stack, rngs=rngs)
    return FeedForward(cfg, stack=stack, rngs=rngs)


def _renamed(aux: dict, name: str) -> dict:
    """An attention sublayer's aux with its weights under `name` ("self" / "cross")."""
    return {(name if k == "weights" else k): v for k, v in aux.items()}


class EncoderBlock(nnx.Module):
    """Self-attention -> FFN (dense, or Mixture-of-Experts with moe=True), each wrapped by Residual."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, self_attention=True, stack="encoder", rngs=rngs)
        self.moe = moe
        self.ffn = make_ffn(cfg, moe, rngs, stack="encoder")
        self.res_attn = Residual(cfg, stack="encoder", rngs=rngs)
        self.res_ffn = Residual(cfg, stack="encoder", rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context, *, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """x [B,S,D] -> ([B,S,D], aux): "self" weights [B,N,S,S] with ctx.weights, "moe" from a MoE FFN."""
        x, a = self.res_attn(x, lambda y: self.self_attn(y, mask=ctx.mask, positions=ctx.positions,
                                                         weights=ctx.weights), rngs)
        x, f = self.res_ffn(x, lambda y: self.ffn(y, ctx.valid, train=rngs is not None), rngs)
        return x, {**_renamed(a, "self"), **f}


class DecoderBlock(nnx.Module):
    """Masked self-attention -> cross-attention over encoder memory (if cross) -> FFN (dense, or
    Mixture-of-Experts with moe=True)."""

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

    def __call__(self, x: jax.Array, ctx: Context, *, cache: LayerKV | None = None,
                 memory_kv: LayerKV | None = None, window: jax.Array | None = None,
                 rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """x [B,T,D] -> ([B,T,D], aux).

        cache: this layer's cached keys/values [B,S,K,H]: the self-attention attends over them followed by the T
        new keys (ctx.mask and ctx.kv_positions cover S+T keys), and aux["kv"] holds the new keys/values
        [B,T,K,H] for the caller to write into its cache. memory_kv: this layer's cross-attention keys/values of
        the encoder memory [B,S,K,H] (else they are projected from ctx.memory). window: this layer's sliding
        window (an int scalar, 0 = global) applied to ctx.mask (a lazy ops.masks.CausalMask). aux also holds
        "self" [B,N,T,S] and "cross" [B,N,T,S_src] weights with ctx.weights (uncached passes), "moe" statistics."""
        if ctx.weights and cache is not None:
            raise ValueError("attention weights are for uncached passes (cache=None)")
        mask = ctx.mask if window is None else ctx.mask._replace(window=window)
        x, a = self.res_self(x, lambda y: self.self_attn(y, mask=mask, positions=ctx.positions,
                                                         kv_positions=ctx.kv_positions, cache=cache,
                                                         weights=ctx.weights), rngs)
        aux = _renamed(a, "self")
        if self.cross:
            source = memory_kv if memory_kv is not None else ctx.memory
            x, c = self.res_cross(x, lambda y: self.cross_attn(y, source, mask=ctx.memory_mask,
                                                               weights=ctx.weights), rngs)
            aux.update(_renamed(c, "cross"))
        x, f = self.res_ffn(x, lambda y: self.ffn(y, ctx.valid, train=rngs is not None), rngs)
        return x, {**aux, **f}
