"""Assembled models: Transformer (encoder-decoder) and TransformerLM (decoder-only). Each owns its forward pass
(written once, `_decoder_pass`), its KV cache (`init_cache`) and its cached step (`step`).

Axis legend: B batch, S source length / cache slots, T target length, D model width, V vocab, L layers, N heads.

Calls: `model(...) -> logits [B,T,V]` (float32); `model.forward(...) -> (logits, aux)` with aux a dict that may
be empty: "moe" (router statistics stacked over the MoE layers, encoder's first) for a MoE model, "captured" (the
activation sites asked for with capture=, `nn.sites`). Attention probabilities are the `pattern` sites, the one
route to them (`attention_weights` captures them).

Attention inputs are explicit: `positions` and `segment_ids` (int [B,T]: 0 = padding, documents numbered from 1;
for the encoder-decoder one of each per side). A query sees only keys of its own document (causally in a
decoder), and positions default to restarting at each document, so a row of packed documents gives each the
logits it has alone. Without segment_ids every token is real (one document per row) and positions are 0..T-1:
the pad id only fills, it never says what attends (the data's batches carry the segment ids of their padding).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import ops
from jaxformer.axes import ACTIVATION, LOGITS
from jaxformer.config import ConfigError, ModelConfig
from jaxformer.nn import init
from jaxformer.nn.cache import KVCache, LayerKV, LayerwiseKV, Memory, heads_major, init_cache
from jaxformer.nn.inputs import AttentionInputs, decoder_self_mask, default_positions  # noqa: F401 (re-exported)
from jaxformer.nn.layers import Context, DecoderBlock, EncoderBlock, Norm, dropout
from jaxformer.nn.sites import Sites, available as available_sites, probe as sites_probe, with_captured
from jaxformer.nn.params import DTYPES, param
from jaxformer.nn.stack import BlockOut, DecodingLayers, LayerStack
from jaxformer.ops import positional
from jaxformer.parallel import constrain


class Embedder(nnx.Module):
    """Token embedding [V,D] (scaled by sqrt(D) if configured) plus absolute positions (sinusoidal/learned),
    and the output head (tied: x·Eᵀ, else its own [D,V])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.tokens = param(rngs, init.weight(cfg, "embed"), (cfg.vocab_size, d), ("vocab", "embed"))
        if cfg.positional == "learned":
            self.positions = param(rngs, init.weight(cfg, "positions"), (cfg.max_len, d), (None, "embed"))
        if cfg.positional == "sinusoidal":
            self.table = nnx.Variable(positional.sinusoidal_table(cfg.max_len, d))  # a constant, not a Param
        if not cfg.tie_embeddings:
            self.head = param(rngs, init.weight(cfg, "head"), (d, cfg.vocab_size), ("embed", "vocab"),
                              matrix=True)
        self.drop = nnx.Dropout(cfg.runtime.dropout)

    def __call__(self, tokens: jax.Array, positions: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """tokens [B,T] int, positions [B,T] int -> [B,T,D] in the compute dtype."""
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
        # mode="clip": padding written as -1 (model.pad_id=-1: no token id is padding) reads row 0, never NaN
        x = constrain(jnp.take(self.tokens[...], tokens, axis=0, mode="clip"), ACTIVATION)
        if self.cfg.scale_embeddings:                    # µP: √D₀, a constant of the width (`jaxformer.mup`)
            x = x * math.sqrt(self.cfg.d_model / self.cfg.width_mult)
        if self.cfg.positional == "sinusoidal":
            x = x + jnp.take(self.table[...], positions, axis=0)
        elif self.cfg.positional == "learned":
            x = x + jnp.take(self.positions[...], positions, axis=0)
        return dropout(self.drop, x, rngs).astype(DTYPES[self.cfg.runtime.dtype])

    def logits(self, x: jax.Array) -> jax.Array:
        """x [B,T,D] -> logits [B,T,V] in float32 (× D₀/D under µP; soft-capped: cap · tanh(logits / cap), with
        model.logit_softcap)."""
        return constrain(self.head_fn()(x), LOGITS)

    def head_fn(self):
        """The output head as a pure function of x [B,T,D] -> logits [B,T,V] float32 (unconstrained), closing over
        the weights read now: what `ops.losses.chunked_token_losses` calls on one slice at a time."""
        cap, tied, mult = self.cfg.logit_softcap, self.cfg.tie_embeddings, 1.0 / self.cfg.width_mult
        w = self.tokens[...] if tied else self.head[...]

        def head(x):
            out = jnp.einsum("BTD,VD->BTV" if tied else "BTD,DV->BTV", x, w.astype(x.dtype),
                             preferred_element_type=jnp.float32)
            out = out * mult if mult != 1.0 else out          # µP's output multiplier D₀/D (`jaxformer.mup`)
            return cap * jnp.tanh(out / cap) if cap else out
        return head


def _makers(cfg: ModelConfig, block):
    """The stack's repeating pattern of block kinds: all dense; all MoE; or model.moe.every-1 dense then MoE."""
    if cfg.ffn != "moe":
        return lambda r: block(moe=False, rngs=r)
    return [lambda r, m=(j == cfg.moe.every - 1): block(moe=m, rngs=r) for j in range(cfg.moe.every)]


class Encoder(nnx.Module):
    """L encoder blocks (+ final norm for pre-LN) over embedded inputs."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: EncoderBlock(cfg, **kw)), cfg.num_encoder_layers,
                                 remat=cfg.runtime.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, ctx: Context, *, rngs=None) -> BlockOut:
        """x [B,S,D] -> BlockOut(memory [B,S,D], aux stacked over layers: "moe", "captured")."""
        out = self.layers(x, ctx, rngs=rngs)
        return out._replace(x=self.final_norm(out.x)) if self.final_norm is not None else out


class Decoder(nnx.Module):
    """L decoder blocks (with cross-attention when `cross`) (+ final norm for pre-LN)."""

    def __init__(self, cfg: ModelConfig, *, cross: bool, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: DecoderBlock(cfg, cross=cross, **kw)),
                                 cfg.num_decoder_layers, remat=cfg.runtime.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, ctx: Context, *, cache: LayerKV | None = None, memory_kv: LayerKV | None = None,
                 layout: DecodingLayers | None = None, rngs=None) -> BlockOut:
        """x [B,T,D] -> BlockOut(x [B,T,D], aux stacked over layers [L,...]: "moe", "captured";
        kv: the new keys/values when cached). Layers with a sliding window (model.attention.windows) see only
        that many recent positions. layout: the stack laid out for a token loop (`_Model.decoding_layout`),
        applied instead of the scanned stack."""
        stack = self.layers if layout is None else layout
        out = stack(x, ctx, cache=cache, memory_kv=memory_kv, rngs=rngs)
        return out._replace(x=self.final_norm(out.x)) if self.final_norm is not None else out


def _moe_aux(*auxes: dict) -> dict:
    """{"moe": ops.moe.MoEStats, leaves [L_moe, ...] over every MoE layer (encoder first)} or {}."""
    stats = [a["moe"] for a in auxes if "moe" in a]
    if not stats:
        return {}
    return {"moe": stats[0] if len(stats) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *stats)}


class _Model(nnx.Module):
    """What both architectures share: the decoder pass (uncached, or one cached step) and the cache."""

    def init_cache(self, batch: int, length: int, *, dtype: str = "auto",
                   layout: DecodingLayers | None = None) -> KVCache:
        """An empty decoder KV cache of `length` slots for `batch` rows: k, v [L,B,S,K,H] in the compute dtype
        (dtype="auto", or model.runtime.kv_cache_dtype when set) or int8 with a float32 scale per slot and kv head
        (dtype="int8"). With a decoding layout, the cache type it reads: a `LayerwiseKVCache` (L heads-major
        [B,K,S,H] tensors)."""
        cfg = self.cfg
        dtype = cfg.runtime.kv_cache_dtype if dtype == "auto" else dtype
        if dtype not in ("auto", "int8"):
            raise ConfigError(f"KV cache dtype={dtype!r} is not one of ('auto', 'int8')")
        cache = init_cache(cfg.num_decoder_layers, batch, length, cfg.kv_heads, cfg.head_size,
                           "int8" if dtype == "int8" else DTYPES[cfg.runtime.dtype])
        return cache if layout is None else cache.unstacked()

    def decoding_layout(self, batch: int | None = None) -> DecodingLayers:
        """The decoder laid out for a token loop, as a value (`nn.stack.LayerStack.lay_out`; the model is
        unchanged): each layer's weights copied out of the stacked arrays once, with the decoding-layout arrays
        its platform's levers ask for. Pass it to `init_cache`, `step` (and `prepare_memory`) of a compiled
        decoding program, made inside it before its loop. batch: the loop's rows (each step one token per row),
        when known; batch 1 also orders the FFN's output weight for a matrix-vector product."""
        return self.decoder.layers.lay_out(batch)

    def _decoder_pass(self, tokens, side: AttentionInputs, *, memory: Memory | None = None,
                      cache: KVCache | None = None, prefill: bool = False, rngs=None,
                      layout=None, features: bool = False, probe=None):
        """The forward pass, written once: embed -> decoder stack -> logits. Uncached (cache=None), or over a
        cache: the T new tokens attend over the cache's slots then themselves, and their keys/values are written
        at slots [index, index+T). -> (logits [B,T,V] float32, aux, the new cache or None); features=True: the
        output head's input [B,T,D] instead of the logits. probe: activation sites to capture or patch
        (`nn.sites`): aux["captured"] then holds the captured ones."""
        pos, valid = side.positions, side.valid
        past = None
        if cache is None:
            kv_pos, k_valid, k_seg = pos, valid, side.segments
        else:
            past = cache.without_slots() if prefill else cache
            kv_pos = jnp.concatenate([past.positions, pos], axis=1)                        # [B,S+T]
            k_valid = jnp.concatenate([past.valid, valid], axis=1)
            k_seg = None if side.segments is None else jnp.concatenate([past.segments, side.segments], axis=1)
        mask = decoder_self_mask(self.cfg, pos, kv_pos, k_valid, side.segments, k_seg)
        ctx = Context(pos, mask, kv_pos, valid,
                      memory=None if memory is None or memory.kv is not None else memory.x,
                      memory_mask=None if memory is None else side.cross_mask(memory), probe=probe)
        sites = Sites(probe)
        x = sites("embed", self.embed(tokens, pos, rngs))
        out = self.decoder(x, ctx, cache=None if past is None else past.layers,
                           memory_kv=None if memory is None else memory.kv, layout=layout, rngs=rngs)
        new_cache = None if cache is None else cache.write(out.kv, pos, side.slot_segments)
        h = sites("final_norm", out.x)
        y = h if features else sites("logits", self.embed.logits(h))
        return y, with_captured(out.aux, sites.captured), new_cache

    def sites(self) -> tuple[str, ...]:
        """The activation sites `forward` can capture and patch (`jaxformer.nn.sites`)."""
        return available_sites(self.cfg)

    def _step(self, tokens, positions, cache: KVCache, memory, segment_ids, prefill, layout, patch):
        tokens = jnp.asarray(tokens)
        side = AttentionInputs(self.cfg, tokens, positions, segment_ids)
        logits, _, cache = self._decoder_pass(tokens, side, memory=memory, cache=cache, prefill=prefill,
                                              layout=layout, probe=sites_probe((), patch, self.sites()))
        return logits, cache


class Transformer(_Model):
    """Encoder-decoder Transformer (Vaswani et al. 2017) with one shared vocabulary and embedding."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "encoder_decoder":
            raise ValueError(f"Transformer needs model.arch='encoder_decoder'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=True, rngs=rngs)

    def _encode(self, src, positions, segment_ids, rngs, probe=None):
        side = AttentionInputs(self.cfg, src, positions, segment_ids)
        enc = None if probe is None else probe._replace(prefix="encoder.")
        ctx = Context(side.positions, side.self_mask(), valid=side.valid, probe=enc)
        sites = Sites(probe)
        out = self.encoder(sites("encoder.embed", self.embed(src, side.positions, rngs)), ctx, rngs=rngs)
        memory = Memory(sites("memory", out.x), side.valid, side.segments)
        return memory, with_captured(out.aux, sites.captured)

    def encode(self, src: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               rngs: nnx.Rngs | None = None) -> Memory:
        """src [B,S] tokens -> the encoder memory (`nn.cache.Memory`: x [B,S,D], the source's validity and
        segment ids)."""
        return self._encode(src, positions, segment_ids, rngs)[0]

    def prepare_memory(self, memory: Memory, *, layout: DecodingLayers | None = None) -> Memory:
        """The memory with each decoder layer's cross-attention keys/values computed once (kv [L,B,S,K,H], or
        with a decoding layout a LayerwiseKV of L heads-major [B,K,S,H]), as cached decoding reads them at every
        step."""
        if layout is not None:                     # a token loop's: L layers, heads-major [B,K,S,H]
            kv = [heads_major(blk.cross_attn.project_kv(memory.x)) for blk in layout.blocks]
            return memory._replace(kv=LayerwiseKV.collect(kv))
        layers = self.decoder.layers
        return memory._replace(kv=LayerKV(*layers.map(lambda blk: blk.cross_attn.project_kv(memory.x))))

    def decode(self, tgt: jax.Array, memory: Memory, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, rngs: nnx.Rngs | None = None) -> jax.Array:
        """tgt [B,T] decoder input tokens over an encoder memory -> logits [B,T,V] (float32), teacher forced:
        causal self-attention (within documents when segment ids are given)."""
        side = AttentionInputs(self.cfg, tgt, positions, segment_ids)
        return self._decoder_pass(tgt, side, memory=memory, rngs=rngs)[0]

    def forward(self, src: jax.Array, tgt: jax.Array, *, src_positions=None, tgt_positions=None,
                src_segment_ids=None, tgt_segment_ids=None, rngs: nnx.Rngs | None = None,
                features: bool = False, capture=(), patch=None) -> tuple[jax.Array, dict]:
        """src [B,S], tgt [B,T] (teacher-forced decoder input) -> (logits [B,T,V], aux): "moe" for a MoE model.
        features=True: the output head's input [B,T,D] in place of the logits
        (`embed.head_fn()` makes them). capture / patch: activation sites, as `TransformerLM.forward`."""
        probe = sites_probe(capture, patch, self.sites())
        memory, enc = self._encode(src, src_positions, src_segment_ids, rngs, probe)
        side = AttentionInputs(self.cfg, tgt, tgt_positions, tgt_segment_ids)
        logits, dec, _ = self._decoder_pass(tgt, side, memory=memory, rngs=rngs, features=features, probe=probe)
        aux = _moe_aux(enc, dec)
        if probe is not None and probe.capture:
            aux["captured"] = {**enc.get("captured", {}), **dec.get("captured", {})}
        return logits, aux

    def __call__(self, src: jax.Array, tgt: jax.Array, **kw) -> jax.Array:
        """src [B,S], tgt [B,T] -> logits [B,T,V] (float32); keywords as `forward`."""
        return self.forward(src, tgt, **kw)[0]

    def step(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, *, memory: Memory,
             segment_ids: jax.Array | None = None, prefill: bool = False,
             layout: DecodingLayers | None = None, patch=None) -> tuple[jax.Array, KVCache]:
        """One cached decoder call: tokens, positions [B,T] over an encoder memory (`prepare_memory` computes its
        keys/values once) -> (logits [B,T,V], the cache with the T new keys/values written). prefill=True declares
        the cache empty (its slots are skipped: the first pass costs a plain forward pass). layout: the decoder
        laid out for a token loop (`decoding_layout`), with the cache and memory made for it. patch: activation
        sites replaced, as `forward` (`nn.sites`)."""
        return self._step(tokens, positions, cache, memory, segment_ids, prefill, layout, patch)

    def attention_weights(self, src: jax.Array, tgt: jax.Array, **kw) -> dict[str, jax.Array]:
        """Every layer's attention weights (float32, a distribution over the visible keys; 0 on masked ones) for
        src [B,S] and decoder input tgt [B,T]: {"encoder_self": [L,B,N,S,S], "decoder_self": [L,B,N,T,T],
        "decoder_cross": [L,B,N,T,S]} (L layers, N heads, T queries, S keys): the `pattern` sites, captured."""
        names = {"encoder_self": "encoder.pattern", "decoder_self": "pattern", "decoder_cross": "cross_pattern"}
        captured = self.forward(src, tgt, capture=tuple(names.values()), **kw)[1]["captured"]
        return {key: captured[site] for key, site in names.items()}


class TransformerLM(_Model):
    """Decoder-only causal language model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "decoder_only":
            raise ValueError(f"TransformerLM needs model.arch='decoder_only'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=False, rngs=rngs)

    def forward(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, rngs: nnx.Rngs | None = None,
                features: bool = False, capture=(), patch=None) -> tuple[jax.Array, dict]:
        """tokens [B,T] -> (logits [B,T,V] float32, aux): "moe" for a MoE model. The mask is causal over positions (and within documents with segment_ids), so
        left-padded rows with shifted positions work unchanged. features=True: the output head's input [B,T,D]
        in place of the logits (`embed.head_fn()` makes them). capture: activation site names (`sites()`), their
        values in aux["captured"] (per-layer ones [L, ...]); patch: {site: fn(value, layer) -> value}
        (`jaxformer.nn.sites`)."""
        side = AttentionInputs(self.cfg, tokens, positions, segment_ids)
        logits, aux, _ = self._decoder_pass(tokens, side, rngs=rngs, features=features,
                                            probe=sites_probe(capture, patch, self.sites()))
        out = _moe_aux(aux)
        if "captured" in aux:
            out["captured"] = aux["captured"]
        return logits, out


    def __call__(self, tokens: jax.Array, **kw) -> jax.Array:
        """tokens [B,T] -> logits [B,T,V] (float32); keywords as `forward`."""
        return self.forward(tokens, **kw)[0]

    def step(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, *, memory: None = None,
             segment_ids: jax.Array | None = None, prefill: bool = False,
             layout: DecodingLayers | None = None, patch=None) -> tuple[jax.Array, KVCache]:
        """One cached call: tokens, positions [B,T] -> (logits [B,T,V], the cache with the T new keys/values
        written at slots [index, index+T)). Without segment_ids every token is real; with them (0 = padding,
        whose slots are never attended), each query sees only its own document's slots (pass them to every step
        of a packed row). prefill=True declares the cache empty (its slots are skipped). layout: the decoder laid
        out for a token loop (`decoding_layout`), with the cache made for it (`init_cache(..., layout=)`).
        patch: activation sites replaced, as `forward` (`nn.sites`; e.g. a steering vector added to a layer's
        residual stream at every step)."""
        if memory is not None:
            raise ValueError("a decoder-only model attends over no memory")
        return self._step(tokens, positions, cache, None, segment_ids, prefill, layout, patch)

    def attention_weights(self, tokens: jax.Array, **kw) -> dict[str, jax.Array]:
        """Every layer's causal self-attention weights for tokens [B,T] (float32, a distribution over the
        visible keys; 0 on masked ones): {"self": [L,B,N,T,T]} (L layers, N heads, T queries and keys): the
        `pattern` site, captured."""
        return {"self": self.forward(tokens, capture=("pattern",), **kw)[1]["captured"]["pattern"]}
