"""Assembled models: Transformer (encoder-decoder, encode/decode) and TransformerLM (decoder-only).

Axis legend: B batch, S source length, T target length, D model width, V vocab, L layers, N heads.
Attention weights (`attention_weights`, or return_weights=True) are [L,B,N,T,S]: query rows T, key columns S.
"""
from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import ops
from jaxformer.config import ConfigError, ModelConfig
from jaxformer.errors import BackendError
from jaxformer.nn.layers import DecoderBlock, EncoderBlock, Norm, dropout
from jaxformer.nn.params import param
from jaxformer.nn.stack import LayerStack
from jaxformer.parallel import constrain
from jaxformer.ops import positional

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_positions(tokens: jax.Array) -> jax.Array:
    """tokens [B,T] -> positions [B,T] = 0..T-1 for every row."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def decoder_self_mask(cfg: ModelConfig, q_positions: jax.Array, k_positions: jax.Array,
                      k_valid: jax.Array | None = None):
    """The decoder's self-attention mask: causal over positions, valid keys only. [B,T], [B,S], [B,S] ->
    a lazy ops.masks.CausalMask ([B,1,T,S] by its .dense()). With the ablation switch
    model.ablation_causal='triu' a query sees itself and the future (a dense [B,1,T,S] array)."""
    if cfg.ablation_causal == "triu":
        m = (k_positions[:, None, :] >= q_positions[:, :, None])[:, None]
        return m if k_valid is None else m & k_valid[:, None, None, :]
    return ops.masks.CausalMask(q_positions, k_positions, k_valid)     # lazy: the chunked backend tiles it


class Embedder(nnx.Module):
    """Token embedding [V,D] (scaled by sqrt(D) if configured) plus absolute positions (sinusoidal/learned),
    and the output head (tied: x·Eᵀ, else its own [D,V])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.tokens = param(rngs, jax.nn.initializers.normal(d ** -0.5), (cfg.vocab_size, d), ("vocab", "embed"))
        if cfg.positional == "learned":
            self.positions = param(rngs, jax.nn.initializers.normal(0.02), (cfg.max_len, d), (None, "embed"))
        if cfg.positional == "sinusoidal":
            self.table = nnx.Variable(positional.sinusoidal_table(cfg.max_len, d))  # a constant, not a Param
        if not cfg.tie_embeddings:
            self.head = param(rngs, jax.nn.initializers.normal(d ** -0.5), (d, cfg.vocab_size), ("embed", "vocab"),
                              matrix=True)
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, tokens: jax.Array, positions: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """tokens [B,T] int, positions [B,T] int -> [B,T,D] in the compute dtype."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer [B,T] array; got {tokens.shape} {tokens.dtype}")
        self.cfg.check_length(tokens.shape[1])
        if self.cfg.positional in ("sinusoidal", "learned") and not isinstance(positions, jax.core.Tracer):
            # eager inputs only: under jit an out-of-table position cannot raise; it gives NaN (generate and
            # the data pipeline check lengths up front)
            top = int(np.max(np.asarray(positions), initial=-1))
            if top >= self.cfg.max_len:
                raise ConfigError(f"position {top} is outside model.max_len={self.cfg.max_len} "
                                  f"(model.positional={self.cfg.positional!r} has no position beyond it)")
        # under a plan, rows are looked up straight into the batch layout (constraining the table too, to
        # gather its D first, silences an XLA resharding warning on 3-axis meshes but more than doubles FSDP's
        # temporary memory in the train step: benchmarks/parallel.py)
        x = constrain(jnp.take(self.tokens[...], tokens, axis=0), ("batch", "length", "act_embed"))
        if self.cfg.scale_embeddings:
            x = x * math.sqrt(self.cfg.d_model)
        if self.cfg.positional == "sinusoidal":
            x = x + jnp.take(self.table[...], positions, axis=0)
        elif self.cfg.positional == "learned":
            x = x + jnp.take(self.positions[...], positions, axis=0)
        return dropout(self.drop, x, rngs).astype(DTYPES[self.cfg.dtype])

    def logits(self, x: jax.Array) -> jax.Array:
        """x [B,T,D] -> logits [B,T,V] in float32."""
        if self.cfg.tie_embeddings:
            out = jnp.einsum("BTD,VD->BTV", x, self.tokens[...].astype(x.dtype), preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("BTD,DV->BTV", x, self.head[...].astype(x.dtype), preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "vocab"))


def _makers(cfg: ModelConfig, block):
    """The stack's repeating pattern of block kinds: all dense; all MoE; or model.moe_every-1 dense then MoE."""
    if cfg.ffn != "moe":
        return lambda r: block(moe=False, rngs=r)
    return [lambda r, m=(j == cfg.moe_every - 1): block(moe=m, rngs=r) for j in range(cfg.moe_every)]


class Encoder(nnx.Module):
    """L encoder blocks (+ final norm for pre-LN) over embedded inputs."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: EncoderBlock(cfg, **kw)), cfg.num_encoder_layers,
                                 remat=cfg.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, *, mask, positions, rngs=None, **kwargs):
        """x [B,S,D], mask [B,1,1|S,S], positions [B,S] -> memory [B,S,D], or (memory, extras) when the blocks
        return extras, stacked over layers: "self" weights [L,B,N,S,S] with return_weights=True, "moe"
        statistics."""
        x, ys = self.layers(x, mask=mask, positions=positions, rngs=rngs, **kwargs)
        x = self.final_norm(x) if self.final_norm is not None else x
        return (x, ys) if ys else x


class Decoder(nnx.Module):
    """L decoder blocks (with cross-attention when `cross`) (+ final norm for pre-LN)."""

    def __init__(self, cfg: ModelConfig, *, cross: bool, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: DecoderBlock(cfg, cross=cross, **kw)),
                                 cfg.num_decoder_layers, remat=cfg.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, *, rngs=None, per_layer=None, **kwargs):
        """x [B,T,D] -> x [B,T,D], or (x, extras) when the blocks return extras, stacked over layers [L,...]:
        "cache" when per_layer holds one, "self"/"cross" weights with return_weights=True, "moe" statistics."""
        x, ys = self.layers(x, rngs=rngs, per_layer=per_layer, **kwargs)
        x = self.final_norm(x) if self.final_norm is not None else x
        return (x, ys) if ys else x


def _split(out) -> tuple[jax.Array, dict]:
    """An Encoder/Decoder result -> (x, extras dict)."""
    return out if isinstance(out, tuple) else (out, {})


def _aux(*ys: dict) -> dict:
    """The auxiliary outputs of the stacks: {"moe": ops.moe.MoEStats, leaves [L_moe, ...] over every MoE layer
    (encoder first)} or {} for a dense model."""
    stats = [y["moe"] for y in ys if "moe" in y]
    if not stats:
        return {}
    return {"moe": stats[0] if len(stats) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *stats)}


class Transformer(nnx.Module):
    """Encoder-decoder Transformer (Vaswani et al. 2017) with one shared vocabulary and embedding."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "encoder_decoder":
            raise ValueError(f"Transformer needs model.arch='encoder_decoder'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=True, rngs=rngs)

    def _encode(self, src, rngs, return_weights=False):
        src_mask = ops.padding_mask(src, self.cfg.pad_id)
        pos = default_positions(src)
        x = self.embed(src, pos, rngs)
        memory, ys = _split(self.encoder(x, mask=src_mask, positions=pos, rngs=rngs,
                                         return_weights=return_weights, valid=src != self.cfg.pad_id))
        return memory, src_mask, ys

    def encode(self, src: jax.Array, *, rngs: nnx.Rngs | None = None, return_weights: bool = False):
        """src [B,S] tokens (pad = cfg.pad_id) -> (memory [B,S,D], src_mask [B,1,1,S]); with return_weights
        also the encoder's self-attention weights [L,B,N,S,S]."""
        memory, src_mask, ys = self._encode(src, rngs, return_weights)
        return (memory, src_mask, ys["self"]) if return_weights else (memory, src_mask)

    def _decode(self, tgt, memory, src_mask, rngs, return_weights=False):
        pos = default_positions(tgt)
        valid = tgt != self.cfg.pad_id
        mask = decoder_self_mask(self.cfg, pos, pos, valid)
        y = self.embed(tgt, pos, rngs)
        y, ys = _split(self.decoder(y, mask=mask, positions=pos, memory=memory, memory_mask=src_mask, rngs=rngs,
                                    return_weights=return_weights, valid=valid))
        return self.embed.logits(y), ys

    def decode(self, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array, *,
               rngs: nnx.Rngs | None = None, return_weights: bool = False):
        """tgt [B,T] decoder input tokens, memory [B,S,D], src_mask [B,1,1,S] -> logits [B,T,V] (float32);
        with return_weights also {"self": [L,B,N,T,T], "cross": [L,B,N,T,S]} weights.
        Self-attention is causal and ignores padded target keys."""
        logits, ys = self._decode(tgt, memory, src_mask, rngs, return_weights)
        return (logits, {k: ys[k] for k in ("self", "cross")}) if return_weights else logits

    def __call__(self, src: jax.Array, tgt: jax.Array, *, rngs: nnx.Rngs | None = None,
                 return_weights: bool = False, return_aux: bool = False):
        """src [B,S], tgt [B,T] (teacher-forced decoder input) -> logits [B,T,V]; with return_weights
        (logits, `attention_weights`'s dict); with return_aux (logits, aux): aux {"moe": ops.moe.MoEStats
        stacked over the MoE layers, encoder's first} for a MoE model, {} for a dense one."""
        if return_weights and return_aux:
            raise ValueError("return_weights and return_aux are separate calls")
        memory, src_mask, enc = self._encode(src, rngs, return_weights)
        logits, dec = self._decode(tgt, memory, src_mask, rngs, return_weights)
        if return_aux:
            return logits, _aux(enc, dec)
        if return_weights:
            return logits, {"encoder_self": enc["self"], "decoder_self": dec["self"], "decoder_cross": dec["cross"]}
        return logits

    def attention_weights(self, src: jax.Array, tgt: jax.Array) -> dict[str, jax.Array]:
        """Every layer's attention weights (float32, a distribution over the visible keys; 0 on masked ones) for
        src [B,S] and decoder input tgt [B,T]: {"encoder_self": [L,B,N,S,S], "decoder_self": [L,B,N,T,T],
        "decoder_cross": [L,B,N,T,S]} (L layers, N heads, T queries, S keys)."""
        return self(src, tgt, return_weights=True)[1]


class TransformerLM(nnx.Module):
    """Decoder-only causal language model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "decoder_only":
            raise ValueError(f"TransformerLM needs model.arch='decoder_only'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 rngs: nnx.Rngs | None = None, return_weights: bool = False, return_aux: bool = False):
        """tokens [B,T] -> logits [B,T,V] (float32). positions [B,T] default 0..T-1; the mask is causal over
        positions and ignores pad keys, so left-padded rows with shifted positions work unchanged.
        With return_weights: (logits, `attention_weights`'s dict); with return_aux: (logits, aux), aux
        {"moe": ops.moe.MoEStats stacked over the MoE layers} for a MoE model, {} for a dense one."""
        if return_weights and return_aux:
            raise ValueError("return_weights and return_aux are separate calls")
        pos = default_positions(tokens) if positions is None else positions
        valid = tokens != self.cfg.pad_id
        mask = decoder_self_mask(self.cfg, pos, pos, valid)
        x = self.embed(tokens, pos, rngs)
        x, ys = _split(self.decoder(x, mask=mask, positions=pos, rngs=rngs, return_weights=return_weights,
                                    valid=valid))
        logits = self.embed.logits(x)
        if return_aux:
            return logits, _aux(ys)
        return (logits, {"self": ys["self"]}) if return_weights else logits

    def attention_weights(self, tokens: jax.Array, *, positions: jax.Array | None = None) -> dict[str, jax.Array]:
        """Every layer's causal self-attention weights for tokens [B,T] (float32, a distribution over the
        visible keys; 0 on masked ones): {"self": [L,B,N,T,T]} (L layers, N heads, T queries and keys)."""
        return self(tokens, positions=positions, return_weights=True)[1]


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer | TransformerLM:
    """The model class named by cfg.arch, initialised from `seed`. Raises BackendError (before anything is
    traced) when cfg.attention_backend cannot run on this machine."""
    why = ops.fused.problem(cfg.attention_backend, dtype=DTYPES[cfg.dtype])
    if why:
        raise BackendError(f"model.attention_backend={cfg.attention_backend!r}: {why}")
    cls = Transformer if cfg.arch == "encoder_decoder" else TransformerLM
    return cls(cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> dict[str, int]:
    """Parameter counts per component: embedding, positions, head, and per stack its attention, cross-attention,
    FFN (a MoE FFN's experts; its router separately) and norms (totals over L layers), plus "total"; for a MoE
    model also "active per token": the total less the experts a token does not use (each token runs top_k of
    the E experts of each MoE layer)."""
    counts: dict[str, int] = collections.OrderedDict()
    experts = 0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        keys = [str(p) for p in path if not isinstance(p, int)]          # kinds of a patterned stack: blocks/j
        if keys[0] == "embed":
            name = {"tokens": "embedding", "positions": "learned positions", "head": "output head"}[keys[1]]
        else:
            sub = keys[3] if keys[1] == "layers" else keys[1]
            kind = {"self_attn": "self-attention", "cross_attn": "cross-attention", "ffn": "FFN"}.get(sub, "norms")
            kind = "MoE router" if kind == "FFN" and keys[-1] == "router" else kind
            name = f"{keys[0]} {kind}"
        counts[name] = counts.get(name, 0) + int(v[...].size)
        if "expert" in (v.get_metadata().get("out_sharding") or ()):
            experts += int(v[...].size)
    counts["total"] = sum(counts.values())
    if experts:
        cfg = model.cfg
        counts["active per token"] = counts["total"] - experts + experts * cfg.moe_top_k // cfg.num_experts
    return counts
