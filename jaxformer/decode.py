"""Autoregressive decoding with an explicit KV cache, compiled end to end.

The cache is a pytree passed in and returned: k, v [L,B,S,K,H] (int8 with per-slot scales when
model.kv_cache_dtype='int8'), per-slot absolute positions [B,S] and validity [B,S], and the next write slot. Attention over the cache is causal over *positions* and ignores invalid slots,
so left-, right- or un-padded prompt batches all decode exactly as each prompt alone.

Each step reads every layer's cache once, as the first of two attention segments (cache, new keys) that are
never concatenated, and writes only its T new slots, in place inside the compiled loop: per-token time grows
only with the bytes of cache read (`benchmarks/decode.py`). `benchmarks/cache_layout.py` measures the
alternative layout [L,B,K,S,H] (kv-heads before slots), which XLA:CPU attends over without a transpose.
Axis legend: B batch, P prompt length, S cache slots / source length, T step length, V vocab, L layers,
K kv heads, H head dim.
`greedy_naive` recomputes the full forward pass each step (the baseline the cache is measured against;
`benchmarks/decode.py` times the same for decoder-only models).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ConfigError
from jaxformer.nn.models import DTYPES, decoder_self_mask
from jaxformer.parallel import constrain, replicate
from jaxformer.quantize import QuantizedKV, quantize_kv

CACHE_AXES = ("layers", "batch", "cache_slots", "kv_heads", "head_dim")   # k, v [L,B,S,K,H] under a plan


class KVCache(NamedTuple):
    k: jax.Array          # [L,B,S,K,H] (or a quantize.QuantizedKV with model.kv_cache_dtype='int8')
    v: jax.Array          # [L,B,S,K,H] (likewise)
    positions: jax.Array  # [B,S] int32 absolute position of the token in each slot
    valid: jax.Array      # [B,S] bool, slot holds a real token
    index: jax.Array      # [] int32, next slot to write


def _kv_map(fn, cache: KVCache) -> KVCache:
    """The cache with fn applied to every array of k and v (values and scales of an int8 cache alike)."""
    return cache._replace(k=jax.tree.map(fn, cache.k), v=jax.tree.map(fn, cache.v))


def init_cache(cfg, batch: int, length: int) -> KVCache:
    """An empty cache of `length` slots for a model config: k, v [L,B,S,K,H] zeros (int8 values with float32
    scales [L,B,S,K,1] when cfg.kv_cache_dtype='int8'), no valid slot."""
    shape = (cfg.num_decoder_layers, batch, length, cfg.kv_heads, cfg.head_dim)
    if cfg.kv_cache_dtype == "int8":
        z = QuantizedKV(constrain(jnp.zeros(shape, jnp.int8), CACHE_AXES),
                        constrain(jnp.zeros(shape[:-1] + (1,), jnp.float32), CACHE_AXES))
    else:
        z = constrain(jnp.zeros(shape, DTYPES[cfg.dtype]), CACHE_AXES)
    return KVCache(z, z, jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch, length), bool),
                   jnp.zeros((), jnp.int32))


def decoder_step(model, cache: KVCache, tokens, positions, valid, memory_kv=None, memory_mask=None, *,
                 prefill: bool = False):
    """Run T new tokens [B,T] (positions [B,T], valid [B,T]) through the decoder, writing their k/v into the
    cache at slots [index, index+T). -> (logits [B,T,V], cache).

    Each layer attends over its S cached slots followed by the T new keys (slots [index, index+T) are still
    invalid in the old cache, so nothing is seen twice). prefill=True declares the cache empty, so the cached
    slots are skipped and a prompt's first pass costs exactly a plain forward pass. memory_kv: cross-attention
    k/v of the encoder memory, [L,B,S,K,H] each (`cross_kv`). An int8 cache stores the new k/v rounded; this
    step's own keys are attended unrounded."""
    i = cache.index
    positions = positions.astype(jnp.int32)
    past = cache if not prefill else KVCache(*_kv_map(lambda a: a[:, :, :0], cache)[:2], cache.positions[:, :0],
                                             cache.valid[:, :0], i)
    kv_pos = jnp.concatenate([past.positions, positions], axis=1)                      # [B,S+T]
    mask = decoder_self_mask(model.cfg, positions, kv_pos, jnp.concatenate([past.valid, valid], axis=1))
    per_layer = {"cache": (past.k, past.v)}
    if memory_kv is not None:
        per_layer["memory_kv"] = memory_kv
    x = model.embed(tokens, positions)
    x, ys = model.decoder(x, per_layer=per_layer, mask=mask, positions=positions, kv_positions=kv_pos,
                          memory_mask=memory_mask, valid=valid)
    k, v = ys["cache"]                                                                  # [L,B,T,K,H] each
    if isinstance(cache.k, QuantizedKV):
        k, v = quantize_kv(k), quantize_kv(v)

    def write(buf, new, axis):
        return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, axis=axis),
                            buf, new)
    on = lambda t: jax.tree.map(lambda a: constrain(a, CACHE_AXES), t)                 # noqa: E731
    new_cache = KVCache(on(write(cache.k, k, 2)), on(write(cache.v, v, 2)), write(cache.positions, positions, 1),
                        write(cache.valid, valid, 1), i + tokens.shape[1])
    return model.embed.logits(x), new_cache


def cross_kv(model, memory):
    """Each decoder layer's cross-attention k, v of the encoder memory [B,S,D], computed once: 2 x [L,B,S,K,H]."""
    return model.decoder.layers.map(lambda blk: blk.cross_attn.project_kv(memory))


def sample_logits(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """logits [B,V] -> tokens [B]. temperature 0 = greedy; top_k > 0 keeps the k best; top_p < 1 keeps the
    smallest set of tokens whose probability reaches top_p (nucleus)."""
    if temperature == 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        srt = jnp.sort(logits, -1)[:, ::-1]
        probs = jax.nn.softmax(srt, -1)
        keep = (jnp.cumsum(probs, -1) - probs) < top_p                  # always keeps the best token
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), -1, keepdims=True)
        logits = jnp.where(logits < cutoff, neg, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def _loop(step_fn, first_logits, start_pos, cache, key, max_new, eos_id, pad_id, sampling):
    """Shared sampling loop: lax.while_loop until max_new tokens or every row has emitted EOS."""
    b = first_logits.shape[0]
    out = jnp.full((b, max_new), pad_id, jnp.int32)

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, logits, pos, cache, done, out = c
        tok = sample_logits(_no_pad(logits, pad_id), jax.random.fold_in(key, i), *sampling)
        tok = jnp.where(done, pad_id, tok)
        out = out.at[:, i].set(tok)
        done = done | (tok == eos_id) if eos_id is not None else done
        logits, cache = step_fn(cache, tok[:, None], pos[:, None])
        return i + 1, logits[:, 0], pos + 1, cache, done, out

    init = (jnp.zeros((), jnp.int32), first_logits, start_pos, cache, jnp.zeros((b,), bool), out)
    return jax.lax.while_loop(cond, body, init)[-1]


def _no_pad(logits, pad_id: int):
    """logits [...,V] with the pad id made impossible: padding is never a generated token (it fills the slots
    after EOS, and the loss never trains it), so decoded output is unambiguous."""
    return jnp.where(jnp.arange(logits.shape[-1]) == pad_id, jnp.finfo(logits.dtype).min, logits)


def _sampling(temperature: float, top_k: int, top_p: float, vocab_size: int) -> tuple[float, int, float]:
    """Validated, hashable sampling settings (a static argument of the compiled programs)."""
    if not temperature >= 0.0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 <= top_k <= vocab_size:
        raise ConfigError(f"top_k={top_k} must be in [0, vocab_size={vocab_size}] (0 = off)")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (1 = off)")
    return float(temperature), int(top_k), float(top_p)


def _check_room(cfg, prompt_len: int, max_new: int, cache_len: int | None):
    if max_new < 1:
        raise ConfigError(f"max_new={max_new} must be >= 1")
    total = prompt_len + max_new
    if cache_len is not None and total > cache_len:
        raise ConfigError(f"prompt length {prompt_len} + max_new {max_new} = {total} exceeds the cache length "
                          f"{cache_len}")
    cfg.check_length(total, "prompt + generated")


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "eos_id", "sampling", "cache_len"))
def _generate_lm(graphdef, state, prompts, key, *, max_new, eos_id, sampling, cache_len):
    model = nnx.merge(graphdef, state)
    pad = model.cfg.pad_id
    valid = prompts != pad
    pos = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0).astype(jnp.int32)
    cache = init_cache(model.cfg, prompts.shape[0], cache_len)
    logits, cache = decoder_step(model, cache, prompts, pos, valid, prefill=True)      # one plain pass
    last = jnp.argmax(jnp.where(valid, jnp.arange(prompts.shape[1]), -1), 1)          # last real token's slot
    first = jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0]
    step = lambda c, t, p: decoder_step(model, c, t, p, jnp.ones_like(t, bool))
    return replicate(_loop(step, first, valid.sum(1).astype(jnp.int32), cache, key, max_new, eos_id, pad,
                           sampling))


def generate_lm(model, prompts, *, max_new: int, key=None, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, eos_id: int | None = None, cache_len: int | None = None):
    """TransformerLM sampling. prompts [B,P] int, padded with cfg.pad_id anywhere (left, right or ragged).
    -> [B,max_new] new tokens (pad after EOS). One compiled program: prefill + while_loop of cached steps."""
    prompts = jnp.asarray(prompts, jnp.int32)
    cache_len = cache_len or prompts.shape[1] + max_new
    _check_room(model.cfg, prompts.shape[1], max_new, cache_len)
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    return _generate_lm(graphdef, state, prompts, key, max_new=max_new, eos_id=eos_id,
                        sampling=_sampling(temperature, top_k, top_p, model.cfg.vocab_size), cache_len=cache_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "sampling"))
def _generate_seq2seq(graphdef, state, src, key, *, max_new, bos_id, eos_id, sampling):
    model = nnx.merge(graphdef, state)
    memory, src_mask = model.encode(src)
    mkv = cross_kv(model, memory)                                                       # once per call
    b = src.shape[0]
    cache = init_cache(model.cfg, b, max_new)
    step = lambda c, t, p: decoder_step(model, c, t, p, jnp.ones_like(t, bool), mkv, src_mask)
    logits, cache = step(cache, jnp.full((b, 1), bos_id, jnp.int32), jnp.zeros((b, 1), jnp.int32))
    return replicate(_loop(step, logits[:, 0], jnp.ones((b,), jnp.int32), cache, key, max_new, eos_id,
                           model.cfg.pad_id, sampling))


def generate_seq2seq(model, src, *, max_new: int, bos_id: int, eos_id: int | None, key=None,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """Transformer (encoder-decoder) sampling. src [B,S] (pad = cfg.pad_id) -> [B,max_new] (pad after EOS).
    The encoder and the cross-attention k/v run once; the decoder runs cached steps in a while_loop."""
    _check_room(model.cfg, 0, max_new, None)                       # positions 0 .. max_new-1
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    return _generate_seq2seq(graphdef, state, jnp.asarray(src, jnp.int32), key, max_new=max_new, bos_id=bos_id,
                             eos_id=eos_id, sampling=_sampling(temperature, top_k, top_p, model.cfg.vocab_size))


def finish_after_eos(tokens: jax.Array, eos_id: int, pad_id: int) -> jax.Array:
    """tokens [B,T] -> same with every position after the first EOS set to pad."""
    seen = jnp.cumsum(tokens == eos_id, axis=1) - (tokens == eos_id)
    return jnp.where(seen > 0, pad_id, tokens)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "pad_id"))
def _greedy_naive(graphdef, state, src, *, max_new, bos_id, eos_id, pad_id):
    model = nnx.merge(graphdef, state)
    memory, src_mask = model.encode(src)
    b = src.shape[0]
    buf = jnp.full((b, max_new + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)

    def body(i, buf):
        logits = model.decode(buf[:, :-1], memory, src_mask)          # [B,T,V], full recomputation
        nxt = jnp.argmax(_no_pad(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), pad_id), -1)
        return jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None].astype(jnp.int32), i + 1, axis=1)

    buf = jax.lax.fori_loop(0, max_new, body, buf)
    return replicate(finish_after_eos(buf[:, 1:], eos_id, pad_id))


def greedy_naive(model, src: jax.Array, max_new: int, *, bos_id: int, eos_id: int) -> jax.Array:
    """Encoder-decoder greedy decoding by full recomputation (no cache). src [B,S] -> [B,max_new]."""
    graphdef, state = nnx.split(model)
    return _greedy_naive(graphdef, state, jnp.asarray(src), max_new=max_new, bos_id=bos_id, eos_id=eos_id,
                         pad_id=model.cfg.pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "beam", "length_penalty"))
def _beam_search(graphdef, state, src, *, max_new, bos_id, eos_id, beam, length_penalty):
    model = nnx.merge(graphdef, state)
    b, w, pad = src.shape[0], beam, model.cfg.pad_id
    memory, src_mask = model.encode(jnp.repeat(src, w, axis=0))                        # [B*W, S, D]
    mkv = cross_kv(model, memory)
    cache = init_cache(model.cfg, b * w, max_new)
    neg = jnp.finfo(jnp.float32).min / 4
    scores = jnp.where(jnp.arange(w) == 0, 0.0, neg)[None].repeat(b, 0)               # [B,W]: start from beam 0
    seqs = jnp.full((b, w, max_new), pad, jnp.int32)
    finished = jnp.zeros((b, w), bool)
    lengths = jnp.zeros((b, w), jnp.int32)
    tok = jnp.full((b * w, 1), bos_id, jnp.int32)

    def body(i, c):
        tok, cache, scores, seqs, finished, lengths = c
        logits, cache = decoder_step(model, cache, tok, jnp.full((b * w, 1), i, jnp.int32),
                                     jnp.ones((b * w, 1), bool), mkv, src_mask)
        logp = jax.nn.log_softmax(logits[:, 0], -1).reshape(b, w, -1)
        v = logp.shape[-1]
        only_pad = jnp.where(jnp.arange(v) == pad, 0.0, neg)
        logp = jnp.where(finished[..., None], only_pad, _no_pad(logp, pad))              # finished beams stay put
        top, idx = jax.lax.top_k((scores[..., None] + logp).reshape(b, w * v), w)
        src_beam, new_tok = idx // v, (idx % v).astype(jnp.int32)
        gather = lambda a: jnp.take_along_axis(a, src_beam, 1)
        was_done = gather(finished)
        seqs = jnp.take_along_axis(seqs, src_beam[..., None], 1).at[:, :, i].set(new_tok)
        lengths = gather(lengths) + (~was_done).astype(jnp.int32)
        finished = was_done | (new_tok == eos_id) if eos_id is not None else was_done
        flat = (jnp.arange(b)[:, None] * w + src_beam).reshape(-1)                      # reorder the cache rows
        cache = _kv_map(lambda a: a[:, flat], cache)._replace(positions=cache.positions[flat],
                                                              valid=cache.valid[flat])
        return new_tok.reshape(b * w, 1), cache, top, seqs, finished, lengths

    _, _, scores, seqs, finished, lengths = jax.lax.fori_loop(
        0, max_new, body, (tok, cache, scores, seqs, finished, lengths))
    norm = ((5.0 + lengths) / 6.0) ** length_penalty                                    # GNMT length penalty
    best = jnp.argmax(scores / norm, -1)
    return replicate(jnp.take_along_axis(seqs, best[:, None, None], 1)[:, 0])


def beam_search(model, src, *, max_new: int, bos_id: int, eos_id: int | None, beam: int = 4,
                length_penalty: float = 0.6):
    """Encoder-decoder beam search. src [B,S] -> best hypothesis [B,max_new] (pad after EOS), ranked by
    log-probability / ((5 + length) / 6) ** length_penalty. beam=1 is greedy decoding."""
    if beam < 1 or beam > model.cfg.vocab_size:
        raise ConfigError(f"beam={beam} must be in [1, vocab_size={model.cfg.vocab_size}]")
    _check_room(model.cfg, 0, max_new, None)
    graphdef, state = nnx.split(model)
    return _beam_search(graphdef, state, jnp.asarray(src, jnp.int32), max_new=max_new, bos_id=bos_id,
                        eos_id=eos_id, beam=beam, length_penalty=float(length_penalty))
