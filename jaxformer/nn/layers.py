"""Norm, FeedForward, Encoder/Decoder blocks. Thin: parameters + calls into jaxformer.ops.

Axis legend: B batch, T target length, S source length, D model width, F FFN width.
Norm placement: "post" = LN(x + Sublayer(x)) (2017 paper, seed 000); "pre" = x + Sublayer(LN(x)).

Return convention: every sublayer returns (y, aux), aux a dict that may be empty: "moe" router statistics (a MoE
FFN) (an attention sublayer given a cache also puts its new keys/values under "kv", which its block takes out);
attention probabilities are the `pattern` activation site (`nn.sites`), the one route to them. Blocks and stacks
return a typed `nn.stack.BlockOut(x, aux, kv)`: kv the new keys/values (a LayerKV [B,T,K,H]) when a cache slice
was passed in, else None. Leaf layers (Norm) return their one array.
"""
from __future__ import annotations

import contextlib
import importlib
import traceback
from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxformer.config import ATTENTION_KINDS, ConfigError, ModelConfig
from jaxformer.errors import JaxformerError
from jaxformer.nn.attention import MultiHeadAttention
from jaxformer.nn.cache import LayerKV
from jaxformer.nn.moe import MoEFeedForward
from jaxformer.nn import init, per_layer
from jaxformer.nn.params import ones, param, project, project_each, weight, zeros
from jaxformer.nn.sites import NO_SITES, Sites
from jaxformer.nn.stack import Block, BlockOut
from jaxformer.ops import activations, norms


class Context(NamedTuple):
    """What every block of a stack reads besides its input (the same for every layer).

    Attributes:
      positions: [B, T] int positions of the tokens.
      mask: the self-attention mask over the keys (a cache's S slots then the T new tokens when cached),
        broadcastable to [B, N, T, S], or a lazy ops.masks.CausalMask; None: every key is visible.
      kv_positions: [B, S] int positions of those keys (None = positions).
      valid: [B, T] bool, the real tokens (MoE routing only).
      memory: [B, S_src, D] encoder output for cross-attention when its keys/values are not precomputed
        per layer.
      memory_mask: its mask, broadcastable to [B, N, T, S_src].
      hooks: the activation sites asked for (`nn.sites`), or None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn import Context
      >>> from jaxformer.ops import causal_mask
      >>> ctx = Context(positions=jnp.arange(3)[None], mask=causal_mask(3))
      >>> ctx.mask.shape, ctx.kv_positions, ctx.memory
      ((3, 3), None, None)
    """
    positions: jax.Array | None = None
    mask: Any = None
    kv_positions: jax.Array | None = None
    valid: jax.Array | None = None
    memory: jax.Array | None = None
    memory_mask: Any = None
    hooks: Any = None


def dropout(layer: nnx.Dropout, x: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
    """Dropout only when training, i.e. when a dropout key stream is passed; inference passes none.

    Args:
      layer: the nnx.Dropout holding the rate.
      x: the activations, any shape.
      rngs: a training call's dropout stream, or None (inference).

    Returns:
      x with dropout applied (kept entries scaled by 1/(1-rate)); x itself without rngs or at rate 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.nn.layers import dropout
      >>> x = jnp.ones((1, 4, 16))
      >>> dropout(nnx.Dropout(0.5), x, None) is x
      True
      >>> sorted(set(dropout(nnx.Dropout(0.5), x, nnx.Rngs(dropout=0)).ravel().tolist()))
      [0.0, 2.0]
    """
    if rngs is None or layer.rate == 0.0:
        return x
    return layer(x, deterministic=False, rngs=rngs)


class Norm(nnx.Module):
    """The norm named by cfg.norm.type, looked up in `ops.norms.NORMS`: LayerNorm (scale + bias), RMSNorm
    (scale), or any registered with `ops.norms.register_norm`. Called on [..., D] -> [..., D].

    Attributes:
      kind: the norm's name (cfg.norm.type).
      eps: its epsilon (cfg.norm.eps).
      scale: [D] nnx.Param, initialised to ones.
      bias: [D] nnx.Param (zeros), only for norms registered with bias=True.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Norm
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> norm = Norm(cfg, rngs=nnx.Rngs(0))
      >>> y = norm(jnp.arange(16.0)[None])
      >>> norm.kind, y.shape, abs(round(float(y.mean()), 4)), round(float(y.std()), 3)
      ('layernorm', (1, 16), 0.0, 1.0)
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kind, self.eps = cfg.norm.type, cfg.norm.eps
        self.scale = param(rngs, ones, (cfg.d_model,), ("embed",))
        if norms.NORM_BIAS[self.kind]:
            self.bias = param(rngs, zeros, (cfg.d_model,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., D] -> [..., D]."""
        bias = self.bias[...] if norms.NORM_BIAS[self.kind] else None
        return norms.NORMS[self.kind](x, self.scale[...], bias, self.eps)


class FeedForward(nnx.Module):
    """Position-wise FFN: w2(act(w1 x)), or w2(swiglu(wg x, w1 x)). Called on x [B,T,D] -> ([B,T,D], {}).

    Attributes:
      w1: [D, F] input projection; wg: [D, F] the gate's, for a gated activation (cfg.activation).
      w2: [F, D] output projection.
      b1, bg, b2: their biases [F], [F], [D] when cfg.has_bias("ffn").
      activation: cfg.activation's name.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import FeedForward
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> ffn = FeedForward(cfg, rngs=nnx.Rngs(0))
      >>> y, aux = ffn(jnp.ones((1, 3, 16)))
      >>> ffn.w1.shape, ffn.w2.shape, y.shape, aux
      ((16, 32), (32, 16), (1, 3, 16), {})
    """

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

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, *, train: bool = False,
                 rngs: nnx.Rngs | None = None, sites: Sites = NO_SITES):
        """[B,T,D] -> ([B,T,D], {}). (valid and train: the FFN interface a MoE FFN shares; unused here.) rngs: a
        training call's dropout stream (adapters' input dropout, model.lora). sites: the block's activation sites
        (mlp_hidden, `nn.sites`)."""
        def biased(y, name):
            return (y + getattr(self, name)[...]).astype(x.dtype) if self.use_bias else y
        if self.activation in activations.GATED:             # gate and input: one matmul where they allow
            gate, h = project_each(("BTD,DF->BTF", "BTD,DF->BTF"), x, (weight(self.wg, rngs), weight(self.w1, rngs)),
                                   then=(lambda y: biased(y, "bg"), lambda y: biased(y, "b1")))
            h = activations.GATED[self.activation](gate, h)
        else:
            h = activations.UNGATED[self.activation](biased(project("BTD,DF->BTF", x, weight(self.w1, rngs)), "b1"))
        h = sites("mlp_hidden", h)
        return biased(project("BTF,FD->BTD", h, weight(self.w2, rngs)), "b2"), {}


class Residual(nnx.Module):
    """One sublayer's residual wiring (model.norm.position) with training-only dropout:
    post LN(x + f(x)); pre x + f(LN(x)); sandwich x + LN'(f(LN(x))) (two norms); deepnorm LN(α·x + f(x))
    (DeepNet: α per stack, `init.deepnorm`, with its β in the init); rezero x + g·f(x), g a learnable scalar from 0.
    Called as residual(x [B,T,D], f, rngs) with f: [B,T,D] -> ([B,T,D], aux) -> (x [B,T,D], aux).

    Attributes:
      kind: the placement (cfg.norm.position).
      norm: the `Norm` (all but rezero); post_norm: sandwich's second `Norm`.
      gate: rezero's scalar nnx.Param g (from 0).
      alpha: deepnorm's α (1.0 for the others).

    Examples:
      >>> import jax
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.layers import Residual
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> x = jax.random.normal(jax.random.key(0), (1, 3, 16))
      >>> zero = lambda h: (h * 0, {})                          # a sublayer that adds nothing
      >>> y, _ = Residual(cfg, rngs=nnx.Rngs(0))(x, zero, None)  # post: LN(x)
      >>> y.shape, round(float(y[0, 0].std()), 3)
      ((1, 3, 16), 1.0)
      >>> pre = replaced(cfg, norm=replaced(cfg.norm, position="pre"))
      >>> bool((Residual(pre, rngs=nnx.Rngs(0))(x, zero, None)[0] == x).all())   # pre: x + 0
      True
    """

    def __init__(self, cfg: ModelConfig, *, stack: str = "decoder", rngs: nnx.Rngs):
        self.kind = cfg.norm.position
        if self.kind != "rezero":
            self.norm = Norm(cfg, rngs=rngs)
        if self.kind == "sandwich":
            self.post_norm = Norm(cfg, rngs=rngs)
        if self.kind == "rezero":
            self.gate = param(rngs, zeros, (), ())
        self.alpha = init.deepnorm(cfg, stack)[0] if self.kind == "deepnorm" else 1.0
        self.drop = nnx.Dropout(cfg.runtime.dropout)

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


def self_attention(cfg: ModelConfig) -> type[MultiHeadAttention]:
    """The self-attention class model.attention.kind names (a name of config.ATTENTION_KINDS or a
    "package.module:Class" path), imported and checked against the config (its `options` and `check`). A research
    variant of attention is one file: a subclass of `MultiHeadAttention` (e.g. overriding `context`, as
    nn.differential does), named by its path.

    Args:
      cfg: the model config; cfg.attention.kind names the class.

    Returns:
      The class (a subclass of `MultiHeadAttention`, or itself).

    Raises:
      ConfigError: naming the field, when the class cannot be imported (a missing module or class, or its module
        failing: any exception, a syntax error), is not such a class, or its options or check fail with anything
        but a jaxformer error (which passes unchanged).

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.layers import self_attention
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> self_attention(cfg).__name__
      'MultiHeadAttention'
      >>> self_attention(replaced(cfg, attention=replaced(cfg.attention, kind="differential"))).__name__
      'DifferentialAttention'
      >>> self_attention(replaced(cfg, attention=replaced(cfg.attention, kind="no.such:Thing")))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.attention.kind='no.such:Thing' cannot be imported: ModuleNotFoundError: ...
    """
    kind = cfg.attention.kind
    module, _, name = ATTENTION_KINDS.get(kind, kind).partition(":")
    with _variants_own(kind, " cannot be imported:"):      # a missing module or class, its module failing
        cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, MultiHeadAttention)):
        raise ConfigError(f"model.attention.kind={kind!r} is {cls!r}, not a subclass of "
                          f"jaxformer.nn.attention.MultiHeadAttention")
    with _variants_own(kind, ": its check(cfg) raised"):   # an assert, or a bug, in the variant's check
        cls.options(cfg)                                     # model.attention.options: its own knobs
        cls.check(cfg)
    return cls


@contextlib.contextmanager
def _variants_own(kind: str, what: str):
    """Runs code of the module model.attention.kind names (importing it, its check): any exception but a
    jaxformer error (the variant's own refusal, passed unchanged) becomes a ConfigError naming the field, `what`
    went wrong and `_failure`'s line for it (chained: JAXFORMER_DEBUG=1 prints the original traceback)."""
    try:
        yield
    except JaxformerError:
        raise
    except Exception as e:
        raise ConfigError(f"model.attention.kind={kind!r}{what} {_failure(e)}") from e


def _failure(e: Exception) -> str:
    """One line for an exception of a user's module: its type and message, and where it was raised (a syntax
    error: the file and line it is in; else the innermost frame's file and line, when that is not here)."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    message = " ".join(str(e).split()[:60])
    frames = traceback.extract_tb(e.__traceback__)
    inner = frames[-1] if frames and not isinstance(e, ImportError) else None
    where = f" ({inner.filename}, line {inner.lineno})" if inner and inner.filename != __file__ else ""
    return f"{type(e).__name__}{': ' + message if message else ''}{where}"


def make_ffn(cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, stack: str = "decoder") -> nnx.Module:
    """The block's FFN: dense, or (moe=True) the Mixture-of-Experts FFN; both return (y, aux).

    Args:
      cfg: the model config (a MoE FFN reads model.moe).
      moe: True for a `nn.moe.MoEFeedForward`, else a `FeedForward`.
      rngs: the parameters' key stream.
      stack: "encoder" or "decoder" (its initialisation may differ, `nn.init`).

    Returns:
      The FFN module, called as ffn(x [B,T,D], valid, train=, rngs=, sites=) -> ([B,T,D], aux).

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.layers import make_ffn
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> type(make_ffn(cfg, False, nnx.Rngs(0))).__name__
      'FeedForward'
      >>> type(make_ffn(replaced(cfg, ffn="moe"), True, nnx.Rngs(0))).__name__
      'MoEFeedForward'
    """
    if moe:
        return MoEFeedForward(cfg, stack=stack, rngs=rngs)
    return FeedForward(cfg, stack=stack, rngs=rngs)


class EncoderBlock(Block):
    """Self-attention -> FFN (dense, or Mixture-of-Experts with moe=True), each wrapped by Residual.

    Attributes:
      self_attn: the self-attention (the class model.attention.kind names, `self_attention`).
      ffn: the FFN (`make_ffn`).
      res_attn, res_ffn: their `Residual` wirings.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, EncoderBlock
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> block = EncoderBlock(cfg, rngs=nnx.Rngs(0))
      >>> out = block(jnp.ones((1, 3, 16)), Context(positions=jnp.arange(3)[None]), layer=0)   # no mask: all see all
      >>> out.x.shape, out.aux, out.kv
      ((1, 3, 16), {}, None)
    """

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn = self_attention(cfg)(cfg, self_attention=True, stack="encoder", rngs=rngs)
        self.ffn = make_ffn(cfg, moe, rngs, stack="encoder")
        self.res_attn = Residual(cfg, stack="encoder", rngs=rngs)
        self.res_ffn = Residual(cfg, stack="encoder", rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context, *, layer: jax.Array | int, passed: dict | None = None,
                 rngs: nnx.Rngs | None = None) -> BlockOut:
        """x [B,S,D] -> BlockOut([B,S,D], aux, None): aux "moe" from a MoE FFN, "captured": the activation sites
        ctx.hooks captures (`nn.sites`). layer: this block's index in its stack (`nn.per_layer`). passed: what
        the previous layer passed on (`nn.stack.Block`; this kind passes nothing)."""
        sites, settings = Sites(ctx.hooks, layer), per_layer.settings(self.cfg, layer, "encoder")
        x, _ = self.res_attn(sites("resid_pre", x), lambda y: sites.output("attn_out", self.self_attn(
            sites("attn_in", y), mask=ctx.mask, positions=ctx.positions, rngs=rngs, sites=sites,
            layer=settings)), rngs)
        x, f = self.res_ffn(sites("resid_mid", x), lambda y: sites.output("mlp_out", self.ffn(
            sites("mlp_in", y), ctx.valid, train=rngs is not None, rngs=rngs, sites=sites)), rngs)
        x = sites("resid_post", x)
        return BlockOut(x, {**f, **({"captured": sites.captured} if sites.captured else {})})


class DecoderBlock(Block):
    """Masked self-attention -> cross-attention over encoder memory (if cross) -> FFN (dense, or
    Mixture-of-Experts with moe=True), each wrapped by Residual.

    Attributes:
      self_attn: the self-attention (the class model.attention.kind names, `self_attention`).
      cross_attn: a `MultiHeadAttention` over the encoder memory (only with cross=True).
      ffn: the FFN (`make_ffn`).
      res_self, res_cross, res_ffn: their `Residual` wirings.
      cross: whether the block has cross-attention.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, DecoderBlock
      >>> from jaxformer.ops import causal_mask
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> block = DecoderBlock(cfg, cross=False, rngs=nnx.Rngs(0))
      >>> out = block(jnp.ones((1, 3, 16)), Context(positions=jnp.arange(3)[None], mask=causal_mask(3)), layer=0)
      >>> out.x.shape, out.aux, out.kv                     # kv: the new keys/values of a cached call only
      ((1, 3, 16), {}, None)
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, moe: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn = self_attention(cfg)(cfg, self_attention=True, rngs=rngs)
        self.res_self = Residual(cfg, rngs=rngs)
        self.cross = cross
        if cross:
            self.cross_attn = MultiHeadAttention(cfg, self_attention=False, rngs=rngs)
            self.res_cross = Residual(cfg, rngs=rngs)
        self.ffn = make_ffn(cfg, moe, rngs)
        self.res_ffn = Residual(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context, *, layer: jax.Array | int, passed: dict | None = None,
                 cache: LayerKV | None = None, memory_kv: LayerKV | None = None,
                 rngs: nnx.Rngs | None = None) -> BlockOut:
        """x [B,T,D] -> BlockOut([B,T,D], aux, kv). passed: what the previous layer passed on (`nn.stack.Block`;
        this kind passes nothing).

        layer: this block's index in its stack (what varies with depth follows from it: `nn.per_layer`, e.g. its
        sliding window and whether it rotates, handed to the self-attention; activation patches receive it).
        cache: this layer's cached keys/values [B,S,K,H]: the self-attention attends over them followed by the T
        new keys (ctx.mask and ctx.kv_positions cover S+T keys), and kv holds the new keys/values [B,T,K,H] for
        the caller to write into its cache (None without a cache). memory_kv: this layer's cross-attention
        keys/values of the encoder memory [B,S,K,H] (else they are projected from ctx.memory). aux holds "moe"
        statistics, "captured": the activation sites ctx.hooks captures (`nn.sites`)."""
        settings = per_layer.settings(self.cfg, layer)
        sites = Sites(ctx.hooks, layer)
        x = sites("resid_pre", x)
        x, a = self.res_self(x, lambda y: sites.output("attn_out", self.self_attn(
            sites("attn_in", y), mask=ctx.mask, positions=ctx.positions, kv_positions=ctx.kv_positions, cache=cache,
            rngs=rngs, sites=sites, layer=settings)), rngs)
        x = sites("resid_mid", x)
        kv = a.pop("kv", None)
        if self.cross:
            source = memory_kv if memory_kv is not None else ctx.memory
            cross = sites.view("cross_")
            x, _ = self.res_cross(x, lambda y: cross.output("out", self.cross_attn(
                cross("in", y), source, mask=ctx.memory_mask, rngs=rngs, sites=cross)), rngs)
            x = sites("resid_cross", x)
        x, f = self.res_ffn(x, lambda y: sites.output("mlp_out", self.ffn(
            sites("mlp_in", y), ctx.valid, train=rngs is not None, rngs=rngs, sites=sites)), rngs)
        x = sites("resid_post", x)
        captured = {"captured": sites.captured} if sites.captured else {}
        return BlockOut(x, {**f, **captured}, kv)
