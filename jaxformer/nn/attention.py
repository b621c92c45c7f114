"""Multi-head attention (self and cross; MHA/GQA/MQA) as a thin module over ops.dot_product_attention.

Axis legend: B batch, T query length, S key length, D model width, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxformer import ops
from jaxformer.config import ModelConfig
from jaxformer.nn.cache import HeadsMajorKV, LayerKV, heads_major
from jaxformer.nn import init
from jaxformer.nn.per_layer import UNIFORM, LayerSettings
from jaxformer.nn.params import lever, ones, param, project, weight, zeros
from jaxformer.nn.sites import NO_SITES, Sites
from jaxformer.ops import norms, positional
from jaxformer.nn.ring import over_context


class MultiHeadAttention(nnx.Module):
    """Projections wq [D,N,H], wk/wv [D,K,H], wo [N,H,D] (+ the biases model.has_bias names; QK-norm scales
    q_norm/k_norm [H] with model.attention.qk_norm). RoPE/ALiBi apply to self-attention only.

    Returns (out [B,T,D], aux): aux {"kv": LayerKV} (this call's new keys/values [B,T,K,H]) when a cache is
    passed; else {}. Its probabilities [B,N,T,S] float32 are the `pattern` site (`nn.sites`)."""

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

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """What this module asks of the config beyond its own validation (ConfigError naming the field); a
        variant named by model.attention.kind overrides it. Called once when the model is built."""

    def _bias(self, name: str):
        return getattr(self, f"b{name}")[...] if self.cfg.has_bias(name) else 0.0

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
        q = project("BTD,DNH->BTNH", x, weight(self.wq, rngs)) + self._bias("q")
        return self._norm(q.astype(x.dtype), "q_norm")

    def fused_qkv(self) -> jax.Array | None:
        """The decoding layout of a self-attention (`nn.stack.LayerStack.lay_out` asks each layer; the same at any
        batch): wq, wk and wv as one matrix wqkv [D,(N+2K)·H] (a new array; the module is unchanged), so that a
        step projects q, k and v in one matmul: lever `decode_fused_qkv` (`jaxformer.platforms`; its results row
        in benchmarks/results/levers.md). None where it does not apply: cross-attention, the lever off on this
        platform, or weights that bring their own matmul (quantized)."""
        return self._concat_qkv() if lever("decode_fused_qkv") else None

    def _concat_qkv(self) -> jax.Array | None:
        """wq, wk, wv as one new matrix [D,(N+2K)·H]; None for cross-attention or quantized weights."""
        ws = (self.wq[...], self.wk[...], self.wv[...])
        if self.self_attention and not any(hasattr(w, "project") for w in ws):
            return jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1)
        return None

    def _project_qkv(self, x: jax.Array, wqkv: jax.Array) -> tuple[jax.Array, LayerKV]:
        """project_q and project_kv of the same x [B,T,D], as one matmul over wqkv (`fused_qkv`) -> (q [B,T,N,H],
        LayerKV)."""
        cfg = self.cfg
        n, k, h = cfg.num_heads, cfg.kv_heads, cfg.head_size
        y = project("BTD,DE->BTE", x, wqkv)
        q, kk, v = jnp.split(y, [n * h, (n + k) * h], axis=-1)
        heads = lambda a, m, name: (a.reshape(*a.shape[:-1], m, h) + self._bias(name)).astype(x.dtype)  # noqa: E731
        return (self._norm(heads(q, n, "q"), "q_norm"),
                LayerKV(self._norm(heads(kk, k, "k"), "k_norm"), heads(v, k, "v")))

    def project_kv(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> LayerKV:
        """x [B,S,D] -> LayerKV(k, v) [B,S,K,H] (k normed with QK-norm; positions are applied by the call)."""
        k = (project("BSD,DKH->BSKH", x, weight(self.wk, rngs)) + self._bias("k")).astype(x.dtype)
        v = (project("BSD,DKH->BSKH", x, weight(self.wv, rngs)) + self._bias("v")).astype(x.dtype)
        return LayerKV(self._norm(k, "k_norm"), v)

    def __call__(self, x: jax.Array, source: jax.Array | LayerKV | None = None, *, mask=None,
                 positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
                 cache: LayerKV | None = None, wqkv: jax.Array | None = None, rngs: nnx.Rngs | None = None,
                 sites: Sites = NO_SITES, layer: LayerSettings = UNIFORM) -> tuple[jax.Array, dict]:
        """x [B,T,D] queries at positions [B,T].

        source: None (self-attention over x), or the keys/values' source for cross-attention: an array [B,S,D],
        or its keys/values already projected (a LayerKV [B,S,K,H], `project_kv`, computed once for decoding; or a
        HeadsMajorKV [B,K,S,H] in a decoding layout).
        cache: self-attention only: this layer's cached keys/values [B,S,K,H] (a `HeadsMajorKV` [B,K,S,H] when
        laid out for decoding); the queries attend over the S cached slots followed by this call's T new keys, as
        two segments (the cache is never copied);
        kv_positions [B,S+T] and mask (broadcastable to [B,N,T,S+T], or an ops.masks.CausalMask) decide what is
        visible. Without a cache, kv_positions defaults to positions. wqkv: the decoding layout's fused q/k/v
        weight (`fused_qkv`), used for a self-attention's projections when given. rngs: a training call's dropout
        stream (adapters' input dropout, model.lora). sites: the block's activation sites (q, k, v, pattern, z;
        `nn.sites`; the attention probabilities are the `pattern` site: capture it to read them). layer: what
        this layer does differently (`nn.per_layer.settings` of its index: its sliding window, whether it
        rotates); a self-attention applies them here. -> (out [B,T,D], aux: "kv", a cached call's new keys/values)."""
        aux = {}
        if source is None and layer.window is not None:
            mask = mask._replace(window=layer.window)             # a lazy ops.masks.CausalMask
        heads_first = isinstance(cache if source is None else source, HeadsMajorKV)   # [B,K,S,H]: a laid-out cache
        if source is None and wqkv is None and lever("fused_projections"):      # one matmul for q, k and v
            wqkv = self._concat_qkv()
        if source is None and wqkv is not None:                                    # laid out for decoding
            q, new = self._project_qkv(x, wqkv)
        else:
            q = self.project_q(x, rngs)
            new = self.project_kv(x, rngs) if source is None else None
        if source is None:
            q, k = self._positions(q, new.k, positions, layer)
            new = LayerKV(k, new.v)
            q = sites("q", q)
            new = LayerKV(sites("k", new.k), sites("v", new.v))
            kv_positions = positions if kv_positions is None else kv_positions
            if cache is None:
                keys, values = new
            else:
                past = cache.readable(x.dtype)
                new = LayerKV(new.k.astype(past.k.dtype), new.v.astype(past.v.dtype))
                now = heads_major(new) if heads_first else new
                keys, values = (past.k, now.k), (past.v, now.v)                # segments: S cached + T new
                aux["kv"] = new
        else:
            keys, values = source if isinstance(source, LayerKV) else self.project_kv(source, rngs=rngs)
            q, keys, values = sites("q", q), sites("k", keys), sites("v", values)
        ctx = self.context(q, keys, values, mask, positions, kv_positions, sites, heads_first, layer)
        ctx = checkpoint_name(sites("z", ctx), "attention_out")   # what model.runtime.remat="dots_attention" keeps
        if "kv" in aux and lever("cache_write_order"):
            aux["kv"] = _after(aux["kv"], ctx)
        out = (project("BTNH,NHD->BTD", ctx, weight(self.wo, rngs)) + self._bias("o")).astype(q.dtype)
        return out, aux

    def context(self, q, keys, values, mask, q_positions, kv_positions, sites: Sites, heads_first: bool,
                layer: LayerSettings) -> jax.Array:
        """What the heads read: queries q [B,T,N,H] over keys/values [B,S,K,H] (heads_first: [B,K,S,H]; or
        segments along S), the mask and positions as in the call -> the context [B,T,N,H], its probabilities
        [B,N,T,S] through the `pattern` site (a patched pattern makes the context). The one method an attention
        variant overrides (model.attention.kind: e.g. `nn.differential`); layer: this layer's settings."""
        ctx, w = self._attend(q, keys, values, mask, q_positions, kv_positions, sites,
                              "BKSH" if heads_first else "BSKH")
        if sites.wants("pattern"):
            patched = sites("pattern", w)
            if sites.patches("pattern"):                          # the context from the replaced probabilities
                ctx = mix(patched, values, heads_first).astype(ctx.dtype)
        return ctx

    def _attend(self, q, k, v, mask, q_positions, kv_positions, sites: Sites, kv_layout: str,
                probs: bool = False):
        """q [B,T,N,H], k/v [B,S,K,H] (kv_layout "BSKH") or [B,K,S,H] ("BKSH"), or segments -> (context
        [B,T,N,H], probabilities [B,N,T,S] when asked or the pattern site wants them, else None), by the backend
        model.runtime.attention_backend."""
        cfg = self.cfg
        bias = None
        if self.self_attention and cfg.positional == "alibi":
            if q_positions is None or kv_positions is None:
                raise ValueError("positional='alibi' needs explicit query and key positions")
            bias = positional.AlibiBias(positional.alibi_slopes(cfg.num_heads), q_positions, kv_positions)
        scores = sites.wants("attn_scores")                  # the logits: read in the materialising backend
        plain = not (bias is not None or probs or scores or sites.wants("pattern") or kv_layout != "BSKH"
                     or cfg.ablation.mask_value == "zero")
        if plain:                                            # parallel.context_attention="ring" over the plan
            ring = over_context(q, k, v, mask, scale=logit_scale(cfg), softcap=cfg.attention.softcap,
                                block_size=cfg.runtime.attention_block)
            if ring is not None:
                return ring, None
        res = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, return_probs=probs or sites.wants("pattern"),
                                        scale=logit_scale(cfg),
                                        mask_value=0.0 if cfg.ablation.mask_value == "zero" else None,
                                        backend="reference" if scores else cfg.runtime.attention_backend,
                                        block_size=cfg.runtime.attention_block,
                                        score_mod=(lambda x: sites("attn_scores", x)) if scores else None,
                                        softcap=cfg.attention.softcap, kv_layout=kv_layout,
                                        softmax_grad="gemv" if lever("softmax_gemv") else "jax")
        return res.out, res.probs


def mix(w: jax.Array, values, heads_first: bool = False) -> jax.Array:
    """Attention probabilities w [B,N,T,S] applied to values [B,S,K,H] (heads_first: [B,K,S,H]; or a tuple of
    segments along S) -> the context [B,T,N,H], query head n reading kv head n // (N/K): what a patched `pattern`
    site gives (no attention dropout)."""
    values = values if isinstance(values, tuple) else (values,)
    v = jnp.concatenate([jnp.swapaxes(s, 1, 2) if heads_first else s for s in values], axis=1)   # [B,S,K,H]
    b, n, t, s = w.shape
    k = v.shape[2]
    ctx = jnp.einsum("BKGTS,BSKH->BTKGH", w.reshape(b, k, n // k, t, s), v.astype(jnp.float32))
    return ctx.reshape(b, t, n, v.shape[-1])


def logit_scale(cfg) -> float | None:
    """The attention logits' scale: 1/√H (None: the op's default), 1/√model.attention.scale_dim, or 1 ("none");
    under µP times √(H₀/H), H₀ the base width's head size (1/H·√H₀ for the default: q·k of correlated
    coordinates grows like H, Yang et al. 2022 §4)."""
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
