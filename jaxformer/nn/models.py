"""Assembled models: Transformer (encoder-decoder) and TransformerLM (decoder-only). Each owns its forward pass
(written once, `_decoder_pass`), its decoding state (`init_cache`) and its cached call.

Axis legend: B batch, S source length / cache slots, T target length, D model width, V vocab, L layers, N heads.

One call, one return convention: `model(tokens, positions, *, segment_ids, cache, mode, capture, patch, features,
rngs) -> (logits [B,T,V] float32, out)` (an encoder-decoder: `model(src, tgt, ...)`), out a dict that may be
empty: "cache" (a cached call's new decoding state), "moe" (router statistics stacked over the MoE layers,
encoder's first) for a MoE model, "captured" (the activation sites asked for with capture=, `nn.sites`, in every
mode). mode: "train" (no cache: training, evaluation, a whole sequence), "prefill" (the cache is empty: its
slots are skipped, the first pass costs a plain forward pass) or "decode" (the T new tokens attend over the
cache's slots then themselves). The public surface is the call, `init_cache`, `sites` (and `encode` for an
encoder-decoder); how the stack is laid out for a token loop is the model's own business, kept in the cache.
Attention probabilities are the `pattern` sites, the one route to them.

Attention inputs are explicit: `positions` and `segment_ids` (int [B,T]: 0 = padding, documents numbered from 1;
for the encoder-decoder one of each per side). A query sees only keys of its own document (causally in a
decoder), and positions default to restarting at each document, so a row of packed documents gives each the
logits it has alone. Without segment_ids every token is real (one document per row) and positions are 0..T-1:
the pad id only fills, it never says what attends (the data's batches carry the segment ids of their padding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ConfigError, ModelConfig
from jaxformer.nn.cache import KVCache, Memory, init_cache
from jaxformer.nn.embed import Embedder
from jaxformer.nn.layout import laid_out_memory
from jaxformer.nn.inputs import AttentionInputs, decoder_self_mask, default_positions  # noqa: F401 (re-exported)
from jaxformer.nn.layers import Context, DecoderBlock, EncoderBlock, Norm
from jaxformer.nn.sites import Hooks, Sites, discover, hooks as make_hooks, with_captured
from jaxformer.nn.params import DTYPES
from jaxformer.nn.stack import BlockOut, LayerStack


def _makers(cfg: ModelConfig, block):
    """The stack's repeating pattern of block kinds: all dense; all MoE; or model.moe.every-1 dense then MoE."""
    if cfg.ffn != "moe":
        return lambda r: block(moe=False, rngs=r)
    return [lambda r, m=(j == cfg.moe.every - 1): block(moe=m, rngs=r) for j in range(cfg.moe.every)]


class Encoder(nnx.Module):
    """L encoder blocks (+ final norm for pre-LN) over embedded inputs: x [B,S,D], ctx -> BlockOut.

    Attributes:
      layers: the `LayerStack` of model.num_encoder_layers `EncoderBlock`s.
      final_norm: a `Norm` when model.norm.final says so (None: for pre and sandwich), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, Encoder
      >>> cfg = replaced(ModelConfig(), vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
      ...                num_decoder_layers=1, max_len=16)
      >>> out = Encoder(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)), Context(positions=jnp.arange(3)[None]))
      >>> out.x.shape, out.aux
      ((1, 3, 16), {})
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: EncoderBlock(cfg, **kw)), cfg.num_encoder_layers,
                                 remat=cfg.runtime.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, ctx: Context, *, rngs=None) -> BlockOut:
        """x [B,S,D] -> BlockOut(memory [B,S,D], aux stacked over layers: "moe", "captured")."""
        out = self.layers(x, ctx, rngs=rngs)
        return out._replace(x=self.final_norm(out.x)) if self.final_norm is not None else out


class Decoder(nnx.Module):
    """L decoder blocks (with cross-attention when `cross`) (+ final norm for pre-LN): x [B,T,D], ctx -> BlockOut.

    Attributes:
      layers: the `LayerStack` of model.num_decoder_layers `DecoderBlock`s.
      final_norm: a `Norm` when model.norm.final says so (None: for pre and sandwich), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, Decoder
      >>> from jaxformer.ops import causal_mask
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> decoder = Decoder(cfg, cross=False, rngs=nnx.Rngs(0))
      >>> out = decoder(jnp.ones((1, 3, 16)), Context(positions=jnp.arange(3)[None], mask=causal_mask(3)))
      >>> out.x.shape, out.aux, out.kv
      ((1, 3, 16), {}, None)
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, rngs: nnx.Rngs):
        self.layers = LayerStack(_makers(cfg, lambda **kw: DecoderBlock(cfg, cross=cross, **kw)),
                                 cfg.num_decoder_layers, remat=cfg.runtime.remat, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs) if cfg.use_final_norm else None

    def __call__(self, x, ctx: Context, *, cache: KVCache | None = None, rngs=None) -> BlockOut:
        """x [B,T,D] -> BlockOut(x [B,T,D], aux stacked over layers [L,...]: "moe", "captured"; kv: the new
        keys/values when cached). Uncached: the scanned stack. Cached: the stack laid out for decoding that the
        cache holds (`_Model.init_cache`), over its per-layer keys/values (and its memory's cross-attention
        keys/values)."""
        if cache is None:
            out = self.layers(x, ctx, rngs=rngs)
        else:
            memory_kv = None if cache.memory is None else cache.memory.kv
            out = cache.stack(x, ctx, cache=cache.layers, memory_kv=memory_kv, rngs=rngs)
        return out._replace(x=self.final_norm(out.x)) if self.final_norm is not None else out


def _moe_aux(*auxes: dict) -> dict:
    """{"moe": ops.moe.MoEStats, leaves [L_moe, ...] over every MoE layer (encoder first)} or {}."""
    stats = [a["moe"] for a in auxes if "moe" in a]
    if not stats:
        return {}
    return {"moe": stats[0] if len(stats) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *stats)}


MODES = ("train", "prefill", "decode")


_SITES: dict = {}       # (model class, ModelConfig) -> its site names (`_Model.sites`): a memo of a pure function


class _Model(nnx.Module):
    """What both architectures share: the decoder pass (uncached, or one cached call) and the decoding state."""

    def init_cache(self, batch: int, length: int, *, dtype: str = "auto", memory: Memory | None = None) -> KVCache:
        """An empty decoding state of `length` slots for `batch` rows (`nn.cache.KVCache`): per layer k, v
        [B,K,S,H] in the compute dtype (dtype="auto", or model.runtime.kv_cache_dtype when set) or int8 with a
        float32 scale per slot and kv head (dtype="int8"), and the decoder laid out for a token loop over `batch`
        rows (each layer's weights copied out of the stacked arrays once: make it inside a compiled decoding
        program, before its loop; the model is unchanged). memory: an encoder-decoder's encoder memory (`encode`),
        whose cross-attention keys/values are computed here once."""
        cfg = self.cfg
        dtype = cfg.runtime.kv_cache_dtype if dtype == "auto" else dtype
        if dtype not in ("auto", "int8"):
            raise ConfigError(f"KV cache dtype={dtype!r} is not one of ('auto', 'int8')")
        if (memory is None) != (cfg.arch == "decoder_only"):
            raise ValueError("an encoder-decoder's cache needs the encoder memory (init_cache(..., memory="
                             "model.encode(src))); a decoder-only model's takes none")
        stack = self.decoder.layers.lay_out(batch)
        if memory is not None:           # each layer's cross-attention keys/values, laid out once
            memory = memory._replace(kv=laid_out_memory(stack, memory.x))
        return init_cache(cfg.num_decoder_layers, batch, length, cfg.kv_heads, cfg.head_size,
                          "int8" if dtype == "int8" else DTYPES[cfg.runtime.dtype], stack, memory)

    def sites(self) -> tuple[str, ...]:
        """The activation sites the call can capture and patch, in the order the pass reaches them
        (`jaxformer.nn.sites`): those its modules pass through `Sites`, found by tracing the call abstractly
        (`nn.sites.discover`), once per model class and config."""
        return tuple(self._site_table())

    def site_layers(self, site: str) -> int:
        """How many layers `site` has a value for (L of its [L, ...] capture: the encoder's for an "encoder."
        site, else the decoder's), 0 for a model-level site (embed, final_norm, logits, memory, ...).
        ConfigError for a name that is no site of the model."""
        table = self._site_table()
        if site not in table:
            raise ConfigError(f"activation site {site!r} does not exist; the model's sites: {list(table)}")
        if not table[site]:
            return 0
        return self.cfg.num_encoder_layers if site.startswith("encoder.") else self.cfg.num_decoder_layers

    def _site_table(self) -> dict[str, bool]:
        key = (type(self), self.cfg)
        if key not in _SITES:
            graphdef, state = nnx.split(self)
            t = jnp.zeros((1, 2), jnp.int32)
            args = (t,) if self.cfg.arch == "decoder_only" else (t, t)
            _SITES[key] = discover(lambda p: nnx.merge(graphdef, state)(*args, capture=p))
        return _SITES[key]

    def _hooks(self, capture, patch) -> Hooks | None:
        """The call's hooks: `capture` itself when `sites()` traces with one, else the validated names. A patch
        function that says which layer it is for (an attribute `layer`, as `jaxformer.sae.sae_patch`'s) is
        checked against the site's layers: ConfigError for a layer the site does not have (it would change
        nothing)."""
        if isinstance(capture, Hooks):
            return capture
        hooks = make_hooks(capture, patch, self.sites())
        for name, fn in (patch or {}).items():
            at = getattr(fn, "layer", None)
            if at is not None and not 0 <= at < self.site_layers(name):
                has = (f"has {self.site_layers(name)} layers (0..{self.site_layers(name) - 1})"
                       if self.site_layers(name) else "is model-level (no layers)")
                raise ConfigError(f"patch[{name!r}] is for layer {at}, but site {name!r} {has}: it would change "
                                  f"nothing")
        return hooks

    def _decoder_pass(self, tokens, side: AttentionInputs, *, memory: Memory | None = None,
                      cache: KVCache | None = None, mode: str = "train", rngs=None, features: bool = False,
                      hooks=None):
        """The forward pass, written once: embed -> decoder stack -> logits. Uncached (mode "train"), or over a
        cache: the T new tokens attend over the cache's slots (none for "prefill") then themselves, and their
        keys/values are written at slots [index, index+T). -> (logits [B,T,V] float32, aux: "moe", "captured",
        "cache" the new cache); features=True: the output head's input [B,T,D] instead of the logits. hooks:
        activation sites to capture or patch (`nn.sites`)."""
        pos, valid = side.positions, side.valid
        past = None
        if cache is None:
            kv_pos, k_valid, k_seg = pos, valid, side.segments
        else:
            memory = cache.memory
            past = cache.without_slots() if mode == "prefill" else cache
            kv_pos = jnp.concatenate([past.positions, pos], axis=1)                        # [B,S+T]
            k_valid = jnp.concatenate([past.valid, valid], axis=1)
            k_seg = None if side.segments is None else jnp.concatenate([past.segments, side.segments], axis=1)
        mask = decoder_self_mask(self.cfg, pos, kv_pos, k_valid, side.segments, k_seg)
        ctx = Context(pos, mask, kv_pos, valid,
                      memory=None if memory is None or memory.kv is not None else memory.x,
                      memory_mask=None if memory is None else side.cross_mask(memory), hooks=hooks)
        sites = Sites(hooks)
        x = sites("embed", self.embed(tokens, pos, rngs))
        out = self.decoder(x, ctx, cache=past, rngs=rngs)
        h = sites("final_norm", out.x)
        y = h if features else sites("logits", self.embed.logits(h))
        aux = dict(with_captured(out.aux, sites.captured))
        if cache is not None:
            aux["cache"] = cache.write(out.kv, pos, side.slot_segments)
        return y, aux


def _check_mode(mode: str, cache) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if (cache is None) != (mode == "train"):
        raise ValueError(f"mode={mode!r} {'needs' if cache is None else 'takes no'} cache (mode 'train' is "
                         "the uncached call; 'prefill' and 'decode' read and return a cache: `init_cache`)")


def _out(aux: dict, *more: dict) -> dict:
    """The call's out: "cache" (cached), "moe" (over every MoE layer, encoder first), "captured"."""
    out = _moe_aux(*more, aux)
    out.update({k: aux[k] for k in ("cache",) if k in aux})
    captured = {k: v for a in (*more, aux) for k, v in a.get("captured", {}).items()}
    if captured:
        out["captured"] = captured
    return out


class Transformer(_Model):
    """Encoder-decoder Transformer (Vaswani et al. 2017) with one shared vocabulary and embedding.

    Attributes:
      cfg: the model config (model.arch="encoder_decoder", else ValueError).
      embed: the `Embedder` both sides share (and the output head).
      encoder: the `Encoder`; decoder: the `Decoder`, with cross-attention.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Transformer
      >>> cfg = replaced(ModelConfig(), vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
      ...                num_decoder_layers=1, max_len=16)
      >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
      >>> src, tgt = jnp.array([[3, 4, 5, 6]]), jnp.array([[1, 3]])
      >>> logits, out = model(src, tgt)
      >>> memory = model.encode(src)                               # encode once, decode many targets
      >>> logits.shape, out, memory.x.shape, bool(jnp.allclose(model(memory, tgt)[0], logits, atol=1e-5))
      ((1, 2, 16), {}, (1, 4, 16), True)
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "encoder_decoder":
            raise ValueError(f"Transformer needs model.arch='encoder_decoder'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=True, rngs=rngs)

    def _encode(self, src, positions, segment_ids, rngs, hooks=None):
        side = AttentionInputs(self.cfg, src, positions, segment_ids)
        enc = None if hooks is None else hooks._replace(prefix="encoder.")
        ctx = Context(side.positions, side.self_mask(), valid=side.valid, hooks=enc)
        sites = Sites(hooks)
        out = self.encoder(sites("encoder.embed", self.embed(src, side.positions, rngs)), ctx, rngs=rngs)
        memory = Memory(sites("memory", out.x), side.valid, side.segments)
        return memory, with_captured(out.aux, sites.captured)

    def encode(self, src: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               rngs: nnx.Rngs | None = None) -> Memory:
        """src [B,S] tokens -> the encoder memory (`nn.cache.Memory`: x [B,S,D], the source's validity and
        segment ids): what `init_cache(..., memory=)` prepares for decoding, or what the call reads in place of
        src (so a decoder pass over many targets encodes once)."""
        return self._encode(src, positions, segment_ids, rngs)[0]

    def __call__(self, src: jax.Array | Memory | None, tgt: jax.Array, *, src_positions=None, tgt_positions=None,
                 src_segment_ids=None, tgt_segment_ids=None, cache: KVCache | None = None, mode: str = "train",
                 capture=(), patch=None, features: bool = False,
                 rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """src [B,S] tokens (or their encoded Memory, `encode`), tgt [B,T] decoder input (teacher forced: causal
        self-attention, within documents when segment ids are given) -> (logits [B,T,V] float32, out) as the
        module docstring says. Cached (mode "prefill" | "decode"): src None, the cache holding the memory
        (`init_cache(..., memory=)`), tgt the new tokens at tgt_positions. features=True: the output head's input
        [B,T,D] in place of the logits (`embed.head_fn()` makes them). capture / patch: activation sites
        (`nn.sites`: decoder, cross-attention and, when src is encoded here, encoder sites)."""
        _check_mode(mode, cache)
        if cache is not None and src is not None:
            raise ValueError("a cached call reads the memory its cache was made with (init_cache(..., memory=)); "
                             "pass src=None")
        hooks = self._hooks(capture, patch)
        enc, memory = {}, src
        if src is not None and not isinstance(src, Memory):
            memory, enc = self._encode(src, src_positions, src_segment_ids, rngs, hooks)
        side = AttentionInputs(self.cfg, tgt, tgt_positions, tgt_segment_ids)
        logits, dec = self._decoder_pass(tgt, side, memory=memory, cache=cache, mode=mode, rngs=rngs,
                                         features=features, hooks=hooks)
        return logits, _out(dec, enc)


class TransformerLM(_Model):
    """Decoder-only causal language model.

    Attributes:
      cfg: the model config (model.arch="decoder_only", else ValueError).
      embed: the `Embedder` (token embedding, positions, output head).
      decoder: the `Decoder`, without cross-attention.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import TransformerLM
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> model = TransformerLM(cfg, rngs=nnx.Rngs(0))
      >>> tokens = jnp.array([[1, 2, 3]])
      >>> logits, out = model(tokens)
      >>> again, cached = model(tokens, cache=model.init_cache(1, 4), mode="prefill")
      >>> logits.shape, logits.dtype, out, list(cached), bool(jnp.allclose(again, logits, atol=1e-5))
      ((1, 3, 16), dtype('float32'), {}, ['cache'], True)
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.arch != "decoder_only":
            raise ValueError(f"TransformerLM needs model.arch='decoder_only'; got {cfg.arch!r}")
        self.cfg = cfg
        self.embed = Embedder(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, cross=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, cache: KVCache | None = None, mode: str = "train",
                 capture=(), patch=None, features: bool = False,
                 rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """tokens [B,T] -> (logits [B,T,V] float32, out) as the module docstring says. The mask is causal over
        positions (and within documents with segment_ids), so left-padded rows with shifted positions work
        unchanged. Cached (mode "prefill" | "decode", cache from `init_cache`): the T new tokens at `positions`,
        out["cache"] the cache with their keys/values written at slots [index, index+T); with segment_ids
        (0 = padding, whose slots are never attended) each query sees only its own document's slots (pass them to
        every call of a packed row). features=True: the output head's input [B,T,D] in place of the logits
        (`embed.head_fn()` makes them). capture: activation site names (`sites()`), their values in
        out["captured"] (per-layer ones [L, ...]); patch: {site: fn(value, layer) -> value} (`nn.sites`; e.g. a
        steering vector added to a layer's residual stream at every decoding step)."""
        _check_mode(mode, cache)
        tokens = jnp.asarray(tokens)
        side = AttentionInputs(self.cfg, tokens, positions, segment_ids)
        logits, aux = self._decoder_pass(tokens, side, cache=cache, mode=mode, rngs=rngs, features=features,
                                         hooks=self._hooks(capture, patch))
        return logits, _out(aux)

    def positions(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """The positions a call without explicit ones gives its tokens [B,T] -> [B,T] int32: 0..T-1 per row, or
        restarting at each document of `segment_ids` (`nn.inputs.AttentionInputs`)."""
        return AttentionInputs(self.cfg, jnp.asarray(tokens), None, segment_ids).positions
