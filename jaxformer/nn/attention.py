"""Multi-head attention (self and cross; MHA/GQA/MQA) as a thin module over ops.dot_product_attention.

Axis legend: B batch, T query length, S key length, D model width, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxformer import ops
from jaxformer.config import ConfigError, ModelConfig
from jaxformer.nn.cache import LayerKV
from jaxformer.nn import init
from jaxformer.nn.per_layer import UNIFORM, LayerSettings
from jaxformer.nn.params import lever, ones, param, project, project_each, weight, zeros
from jaxformer.nn.sites import NO_SITES, Sites
from jaxformer.ops import norms, positional
from jaxformer.nn.ring import over_context


class MultiHeadAttention(nnx.Module):
    """Multi-head attention (MHA/GQA/MQA), self or cross. RoPE/ALiBi apply to self-attention only. A call returns
    (out [B,T,D], aux): aux {"kv": LayerKV} (this call's new keys/values [B,T,K,H]) when a cache is passed, else
    {}. Its probabilities [B,N,T,S] float32 are the `pattern` site (`nn.sites`).

    Attributes:
      wq: [D, N, H] query projection; wk, wv: [D, K, H]; wo: [N, H, D] output projection.
      bq, bk, bv, bo: their biases ([N, H], [K, H], [K, H], [D]) for the names model.has_bias gives.
      q_norm, k_norm: [H] QK-norm scales, with model.attention.qk_norm.
      self_attention: whether it attends over its own input (else over a source: cross-attention).
      cfg: the model config.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import MultiHeadAttention
      >>> from jaxformer.ops import causal_mask
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> attn = MultiHeadAttention(cfg, self_attention=True, rngs=nnx.Rngs(0))
      >>> out, aux = attn(jnp.ones((1, 3, 16)), mask=causal_mask(3), positions=jnp.arange(3)[None])
      >>> attn.wq.shape, attn.wo.shape, out.shape, aux
      ((16, 2, 8), (2, 8, 16), (1, 3, 16), {})
    """

    def __init__(self, cfg: ModelConfig, *, self_attention: bool, stack: str = "decoder", rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
        self.cfg = cfg
        self.self_attention = self_attention
        w = lambda init, shape, axes: param(rngs, init, shape, axes, matrix=True, quantizable=True)  # noqa: E731
        self.wq = w(init.weight(cfg, "q", stack=stack), (d, n, h), ("embed", "q_heads", "head_dim"))
        self.wk = w(init.weight(cfg, "k", stack=stack), (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wv = w(init.weight(cfg, "v", stack=stack), (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wo = w(init.weight(cfg, "o", stack=stack), (n, h, d), ("q_heads", "head_dim", "embed"))
        for name, shape, axes in (("q", (n, h), ("q_heads", "head_dim")), ("k", (k, h), ("kv_heads", "head_dim")),
                                  ("v", (k, h), ("kv_heads", "head_dim")), ("o", (d,), ("embed",))):
            if cfg.has_bias(name):
                setattr(self, f"b{name}", param(rngs, zeros, shape, axes))
        if cfg.attention.qk_norm:
            self.q_norm = param(rngs, ones, (h,), ("head_dim",))
            self.k_norm = param(rngs, ones, (h,), ("head_dim",))

    @dataclasses.dataclass(frozen=True)
    class Options:
        """The attention kind's own knobs, set by model.attention.options ("name=value" each): none for
        softmax. A variant declares its own: a frozen dataclass of typed fields (bool, int, float, str) with
        defaults, read with `self.options(self.cfg)`."""

    @classmethod
    def options(cls, cfg: ModelConfig) -> "MultiHeadAttention.Options":
        """model.attention.options as this kind's `Options` (each value parsed as its field's type). ConfigError
        naming the field for an option the kind does not declare or a value of the wrong type."""
        fields = typing.get_type_hints(cls.Options)
        given = dict(o.partition("=")[::2] for o in cfg.attention.options)
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ConfigError(f"model.attention.options: {unknown} not options of model.attention.kind="
                              f"{cfg.attention.kind!r} (its options: {sorted(fields) or 'none'})")
        return cls.Options(**{n: _typed(f"model.attention.options {n}={v!r}", v, fields[n]) for n, v in given.items()})

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """What this module asks of the config beyond its own validation (ConfigError naming the field); a
        variant named by model.attention.kind overrides it. Called once when the model is built."""

    def _bias(self, name: str):
        return getattr(self, f"b{name}")[...] if self.cfg.has_bias(name) else 0.0

    def _biased(self, name: str, dtype):
        """A projection's output -> plus its bias (when configured), in `dtype`: the one rule for q, k and v
        whether projected apart or together."""
        return lambda a: (a + self._bias(name)).astype(dtype)

    def _norm(self, x: jax.Array, norm: str) -> jax.Array:
        """QK-norm (when configured) of q or k [B,T,N|K,H]."""
        if self.cfg.attention.qk_norm:
            return norms.rms_norm(x, getattr(self, norm)[...], self.cfg.norm.eps)
        return x

    def _positions(self, q: jax.Array, k: jax.Array, positions: jax.Array | None,
                   layer: LayerSettings) -> tuple[jax.Array, jax.Array]:
        """q [B,T,N,H], k [B,T,K,H] of a self-attention at positions [B,T], rotated when model.positional='rope'
        and this layer rotates (`nn.per_layer`: layer.rope, a traced bool; None = every layer): the one place
        RoPE is applied."""
        if self.cfg.positional != "rope":
            return q, k
        if positions is None:
            raise ValueError("positional='rope' needs explicit positions")
        rope = lambda x: positional.apply_rope(x, positions, self.cfg.rope.base,  # noqa: E731
                                               self.cfg.rope.frequency_scaling())
        if layer.rope is None:
            return rope(q), rope(k)
        return jnp.where(layer.rope, rope(q), q), jnp.where(layer.rope, rope(k), k)

    def project_q(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """x [B,T,D] -> q [B,T,N,H] (normed with QK-norm; positions are applied by the call). rngs: a training
        call's dropout stream (an adapter's input dropout, model.lora)."""
        return self._norm(self._biased("q", x.dtype)(project("BTD,DNH->BTNH", x, weight(self.wq, rngs))), "q_norm")

    def project_qkv(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, LayerKV]:
        """A self-attention's projections of x [B,T,D] -> (q [B,T,N,H], LayerKV(k, v) [B,T,K,H]), normed with
        QK-norm (positions are applied by the call); one matmul where the weights allow it
        (`nn.params.project_each`)."""
        biased = lambda name: self._biased(name, x.dtype)                               # noqa: E731
        q, k, v = project_each(("BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"), x,
                               tuple(weight(w, rngs) for w in (self.wq, self.wk, self.wv)),
                               then=(lambda a: self._norm(biased("q")(a), "q_norm"), biased("k"), biased("v")))
        return q, LayerKV(self._norm(k, "k_norm"), v)

    def project_kv(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> LayerKV:
        """x [B,S,D] -> LayerKV(k, v) [B,S,K,H] (k normed with QK-norm; positions are applied by the call)."""
        k = self._biased("k", x.dtype)(project("BSD,DKH->BSKH", x, weight(self.wk, rngs)))
        v = self._biased("v", x.dtype)(project("BSD,DKH->BSKH", x, weight(self.wv, rngs)))
        return LayerKV(self._norm(k, "k_norm"), v)

    def __call__(self, x: jax.Array, source: jax.Array | LayerKV | None = None, *, mask=None,
                 positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
                 cache: LayerKV | None = None, rngs: nnx.Rngs | None = None, sites: Sites = NO_SITES,
                 layer: LayerSettings = UNIFORM) -> tuple[jax.Array, dict]:
        """x [B,T,D] queries at positions [B,T].

        source: None (self-attention over x), or the keys/values' source for cross-attention: an array [B,S,D],
        or its keys/values already projected (a LayerKV view, `project_kv`, computed once for decoding).
        cache: self-attention only: this layer's cached keys/values (a LayerKV view in the cache's layout,
        `nn.cache`); the queries attend over the S cached slots followed by this call's T new keys, as two
        segments (the cache is never copied);
        kv_positions [B,S+T] and mask (broadcastable to [B,N,T,S+T], or an ops.masks.CausalMask) decide what is
        visible. Without a cache, kv_positions defaults to positions. rngs: a training call's dropout
        stream (adapters' input dropout, model.lora). sites: the block's activation sites (q, k, v, pattern, z;
        `nn.sites`; the attention probabilities are the `pattern` site: capture it to read them). layer: what
        this layer does differently (`nn.per_layer.settings` of its index: its sliding window, whether it
        rotates); a self-attention applies them here. -> (out [B,T,D], aux: "kv", a cached call's new keys/values)."""
        aux = {}
        if source is None:
            if layer.window is not None:
                mask = mask._replace(window=layer.window)             # a lazy ops.masks.CausalMask
            q, new = self.project_qkv(x, rngs)
            q, k = self._positions(q, new.k, positions, layer)
            q, kv = sites("q", q), LayerKV(sites("k", k), sites("v", new.v))
            kv_positions = positions if kv_positions is None else kv_positions
            if cache is not None:
                kv, aux["kv"] = cache.readable(x.dtype).then(kv)          # segments: S cached + T new
        else:
            q = self.project_q(x, rngs)
            kv = source if isinstance(source, LayerKV) else self.project_kv(source, rngs=rngs)
            q, kv = sites("q", q), kv._replace(k=sites("k", kv.k), v=sites("v", kv.v))
        ctx = self.context(q, kv, mask, positions, kv_positions, sites, layer)
        ctx = checkpoint_name(sites("z", ctx), "attention_out")   # what model.runtime.remat="dots_attention" keeps
        if "kv" in aux and lever("cache_write_order"):
            aux["kv"] = _after(aux["kv"], ctx)
        out = (project("BTNH,NHD->BTD", ctx, weight(self.wo, rngs)) + self._bias("o")).astype(q.dtype)
        return out, aux

    def context(self, q: jax.Array, kv: LayerKV, mask, q_positions, kv_positions, sites: Sites,
                layer: LayerSettings) -> jax.Array:
        """What the heads read: queries q [B,T,N,H] over the keys/values `kv` (a LayerKV view [B,S,K,H] in its
        own layout, k and v maybe segments along S), the mask and positions as in the call -> the context
        [B,T,N,H], its probabilities [B,N,T,S] through the `pattern` site (a patched pattern makes the
        context). The one method an attention variant overrides (model.attention.kind: e.g. `nn.differential`);
        layer: this layer's settings."""
        ctx, w = self.attend(q, kv, mask, q_positions, kv_positions, sites, layer)
        if sites.wants("pattern"):
            patched = sites("pattern", w)
            if sites.patches("pattern"):                          # the context from the replaced probabilities
                ctx = mix(patched, kv).astype(ctx.dtype)
        return ctx

    def attend(self, q, kv: LayerKV, mask, q_positions, kv_positions, sites: Sites,
               layer: LayerSettings = UNIFORM, probs: bool = False):
        """Scaled dot-product attention as configured (the logit scale, soft-cap, ALiBi, the backend
        model.runtime.attention_backend, ring attention over a context plan): q [B,T,N,H] over a LayerKV view
        (k/v [B,S,K,H] in its own layout, or segments along S) -> (context [B,T,N,H], probabilities [B,N,T,S]
        float32 when `probs` or the pattern site wants them, else None). layer: this layer's settings (its
        soft-cap and logit scale, when a per-layer rule sets them). What a variant's `context` builds on (e.g.
        `nn.differential` asks for the probabilities and mixes them itself)."""
        cfg = self.cfg
        softcap = cfg.attention.softcap if layer.softcap is None else layer.softcap
        scale = logit_scale(cfg) if layer.scale is None else layer.scale
        k, v = kv
        bias = None
        if self.self_attention and cfg.positional == "alibi":
            if q_positions is None or kv_positions is None:
                raise ValueError("positional='alibi' needs explicit query and key positions")
            bias = positional.AlibiBias(positional.alibi_slopes(cfg.num_heads), q_positions, kv_positions)
        scores = sites.wants("attn_scores")                  # the logits: read in the materialising backend
        plain = not (bias is not None or probs or scores or sites.wants("pattern") or cfg.ablation.mask_value == "zero")
        if plain:            # parallel.context_attention="ring" over the plan (not over a cache's segments)
            ring = over_context(q, k, v, mask, scale=scale, softcap=softcap,
                                block_size=cfg.runtime.attention_block)
            if ring is not None:
                return ring, None
        res = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_probs=probs or sites.wants("pattern"),
                                        scale=scale,
                                        mask_value=0.0 if cfg.ablation.mask_value == "zero" else None,
                                        backend="reference" if scores else cfg.runtime.attention_backend,
                                        block_size=cfg.runtime.attention_block,
                                        score_mod=(lambda x: sites("attn_scores", x)) if scores else None,
                                        softcap=softcap, kv_layout=kv.layout,
                                        softmax_grad="gemv" if lever("softmax_gemv") else "jax")
        return res.out, res.probs


def mix(w: jax.Array, kv: LayerKV) -> jax.Array:
    """Attention probabilities applied to the values: what a patched `pattern` site gives (no attention dropout).

    Args:
      w: [B, N, T, S] attention probabilities.
      kv: a LayerKV view (values [B, S, K, H] in its layout, maybe segments along S); query head n reads kv head
        n // (N/K).

    Returns:
      [B, T, N, H] float32 context.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn import LayerKV
      >>> from jaxformer.nn.attention import mix
      >>> v = jnp.arange(3.0)[None, :, None, None] * jnp.ones((1, 3, 1, 4))     # values 0, 1, 2; K=1, H=4
      >>> ctx = mix(jnp.full((1, 2, 1, 3), 1 / 3), LayerKV(jnp.zeros_like(v), v))  # N=2 heads, uniform
      >>> ctx.shape, ctx[0, 0, :, 0].tolist()
      ((1, 1, 2, 4), [1.0, 1.0])
    """
    v = kv.values_bskh()                                                           # [B,S,K,H]
    b, n, t, s = w.shape
    k = v.shape[2]
    ctx = jnp.einsum("BKGTS,BSKH->BTKGH", w.reshape(b, k, n // k, t, s), v.astype(jnp.float32))
    return ctx.reshape(b, t, n, v.shape[-1])


def logit_scale(cfg) -> float | None:
    """The attention logits' scale: 1/√H, 1/√model.attention.scale_dim, or 1 ("none"); under µP times √(H₀/H),
    H₀ the base width's head size (1/H·√H₀ for the default: q·k of correlated coordinates grows like H, Yang et
    al. 2022 §4).

    Args:
      cfg: the model config (model.attention.scale and scale_dim, head size, width_mult).

    Returns:
      The scale as a float, or None for the op's default 1/√H.

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.attention import logit_scale
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> logit_scale(cfg), logit_scale(replaced(cfg, attention=replaced(cfg.attention, scale="none")))
      (None, 1.0)
    """
    h = cfg.head_size
    sp = 1.0 if cfg.attention.scale == "none" else (cfg.attention.scale_dim or h) ** -0.5
    if cfg.width_mult == 1.0:
        return None if cfg.attention.scale != "none" and not cfg.attention.scale_dim else sp
    h0 = h if cfg.head_dim is not None else h / cfg.width_mult         # heads of a fixed head_dim do not widen
    return sp * (h0 / h) ** 0.5


def _after(new: LayerKV, out: jax.Array) -> LayerKV:
    """new keys/values made to depend on this layer's attention output (+ 0·one of its elements: exact). In a
    token loop the cache write then follows this layer's read of the cache, and XLA updates the buffer in place;
    with no data dependence between them XLA:CPU may order the write first, and copies each layer's whole
    buffer twice at every token (benchmarks/decode_profile.py counts them: 0 with this)."""
    zero = out.reshape(-1)[0].astype(jnp.float32) * 0.0
    return LayerKV(*(a + zero.astype(a.dtype) for a in new))


def _typed(what: str, raw: str, typ) -> bool | int | float | str:
    """An option's text as its declared type (bool: true/false, int, float or str); ConfigError naming `what`
    else."""
    if typ not in (bool, int, float, str):
        raise ConfigError(f"{what}: an attention option's type must be bool, int, float or str; got {typ}")
    if typ is bool:
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    else:
        try:
            return typ(raw)
        except ValueError:
            pass
    raise ConfigError(f"{what} is not {'an' if typ is int else 'a'} {typ.__name__}")
