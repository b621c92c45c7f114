"""Autoregressive decoding over a model's cached call, compiled end to end: this module samples, loops and
searches; the model owns its decoding state and its cached call (`model.init_cache`, `model(..., cache=,
mode=)`, and for an encoder-decoder `model.encode`, whose memory `init_cache` prepares once).

Each program first makes its decoding state inside the program (`model.init_cache`: the per-layer cache and the
decoder laid out for the loop, every layer's weights copied out of the stacked arrays once; the model is
unchanged), so that no token of the loop slices weights or cache out of stacked arrays. A prompt batch is
prefilled in one pass (mode "prefill": the plain forward pass), then cached calls (mode "decode") run in a
`lax.while_loop` that stops when every row has emitted EOS (beam search: when every beam has finished). Each
step reads every layer's cache once, as the first of two attention segments (cache, new keys) that are never
concatenated, and writes only its new slots, in place: per-token time grows only with the bytes of cache read
(`benchmarks/decode.py`; `benchmarks/cache_layout.py` measures the alternative layout [L,B,K,S,H]).
Axis legend: B batch, P prompt length, S cache slots / source length, T step length, V vocab.
`greedy_naive` recomputes the full forward pass each step (the baseline the cache is measured against;
`benchmarks/decode.py` times the same for decoder-only models).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.errors import ConfigError, DataError
from jaxformer.platforms.lowering import unrolled_threefry
from jaxformer.ops.masks import positions_from_segments
from jaxformer.parallel import replicate


def sample_logits(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """logits [B,V] -> tokens [B]: greedy, or sampled after top-k and nucleus (top-p) filtering.

    temperature 0 = greedy (the argmax; key, top_k and top_p are not read); top_k > 0 keeps the k best; top_p < 1
    keeps the smallest set of tokens whose probability reaches top_p (nucleus; the best token is always kept).
    The filters apply in that order to the logits divided by the temperature, and the tokens left are sampled.
    The settings are not checked here: `generate_lm` and `generate_seq2seq` refuse those out of range.

    Args:
      logits: [B, V] next-token logits (any float dtype; filtered and sampled in float32).
      key: a `jax.random` key (not read at temperature 0).
      temperature: the softmax temperature; 0 = greedy.
      top_k: how many of the best tokens each row keeps (0 = all).
      top_p: the nucleus' probability mass (1 = all tokens).

    Returns:
      [B] int32 token ids.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.decode import sample_logits
      >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
      >>> sample_logits(logits, jax.random.key(0)).tolist()                          # greedy
      [1, 0]
      >>> sample_logits(logits, jax.random.key(0), temperature=1.0, top_p=0.4).tolist()   # the best alone reaches 0.4
      [1, 0]
      >>> sample_logits(logits, jax.random.key(0), temperature=1.0, top_k=2).shape
      (2,)
    """
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


def _check_padding(model, tokens, segment_ids, what: str) -> None:
    """DataError when `tokens` [B,P] hold the model's padding id (model.pad_id; -1: none) and no segment ids say
    which tokens are real: the padding would be read, and continued, as tokens. Concrete arrays only (a traced or
    another process's array is not looked at)."""
    pad_id = model.cfg.pad_id
    if segment_ids is not None or pad_id < 0 or isinstance(tokens, jax.core.Tracer) \
            or not getattr(tokens, "is_fully_addressable", True):
        return
    hits = np.argwhere(np.asarray(tokens) == pad_id)         # a refusal, never a mask: segment ids say what is real
    if len(hits):
        r, c = (int(x) for x in hits[0])
        raise DataError(f"{what} {list(np.shape(tokens))}: row {r} holds the padding id (model.pad_id={pad_id}) at "
                        f"position {c} and no segment_ids are given, so the padding would be decoded as tokens; "
                        f"pass segment_ids (0 on padding, `arch.prompt_batch` makes them) or unpadded rows")


def _check_inputs(model, tokens, segment_ids, what: str, bos_id: int | None = None) -> None:
    """DataError for input that decoding would misread rather than refuse: tokens that are not [B,P] integers with
    P >= 1, an id outside [0, model.vocab_size) at a real position (the embedding lookup would read no row of the
    table; a padding position, segment id 0, may hold anything: a pretrained tokenizer pads with -1), segment_ids
    of another shape or with a negative id, a bos_id outside the vocabulary; then `_check_padding`. Values of
    concrete arrays only (a traced or another process's array is not looked at)."""
    shape, vocab = tuple(np.shape(tokens)), model.cfg.vocab_size
    if len(shape) != 2 or 0 in shape:
        raise DataError(f"{what} of shape {list(shape)}: decoding reads a [batch, length] array of token ids with "
                        f"at least one row and one token")
    if segment_ids is not None and tuple(np.shape(segment_ids)) != shape:
        raise DataError(f"segment_ids of shape {list(np.shape(segment_ids))} do not match {what} {list(shape)}")
    for name, x, low, high in ((what, tokens, 0, vocab), ("segment_ids", segment_ids, 0, None)):
        if x is None:
            continue
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        if not np.issubdtype(dtype, np.integer):
            raise DataError(f"{name} are {dtype}: token and segment ids are integers (a cast would round them)")
        if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
            continue
        v = np.asarray(x)
        real = True if name != what or segment_ids is None or not hasattr(segment_ids, "shape") else (
            np.asarray(segment_ids) != 0)
        bad = np.argwhere(((v < low) | (v >= high if high is not None else False)) & real)
        if len(bad):
            r, c = (int(i) for i in bad[0])
            within = f"the vocabulary [0, {high}) (model.vocab_size)" if high is not None else "ids >= 0 (0: padding)"
            raise DataError(f"{name} {list(shape)}: row {r}, position {c} holds {int(v[r, c])}, outside {within}")
    if bos_id is not None and not 0 <= bos_id < vocab:
        raise DataError(f"bos_id={bos_id} is outside the vocabulary [0, {vocab}) (model.vocab_size)")
    _check_padding(model, tokens, segment_ids, what)


def _check_room(cfg, prompt_len: int, max_new: int, cache_len: int | None):
    if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
        raise ConfigError(f"max_new={max_new!r} must be an integer >= 1")
    total = prompt_len + max_new
    if cache_len is not None and total > cache_len:
        raise ConfigError(f"prompt length {prompt_len} + max_new {max_new} = {total} exceeds the cache length "
                          f"{cache_len}")
    cfg.check_length(total, "prompt + generated")


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "eos_id", "sampling", "cache_len", "kv_cache",
                                             "patch"))
def _generate_lm(graphdef, state, prompts, segment_ids, key, *, max_new, eos_id, sampling, cache_len, kv_cache,
                 patch=None):
    model = nnx.merge(graphdef, state)
    patch = dict(patch) if patch else None
    pad = model.cfg.pad_id
    if segment_ids is None:                                 # every prompt token real: one document per row
        valid = jnp.ones(prompts.shape, bool)
        pos = jnp.broadcast_to(jnp.arange(prompts.shape[1], dtype=jnp.int32), prompts.shape)
    else:                                                   # padding and packed documents: the last one continues
        valid = segment_ids != 0
        pos = positions_from_segments(segment_ids)
    cache = model.init_cache(prompts.shape[0], cache_len, dtype=kv_cache)
    logits, out = model(prompts, pos, segment_ids=segment_ids, cache=cache, mode="prefill", patch=patch)
    last = jnp.argmax(jnp.where(valid, jnp.arange(prompts.shape[1]), -1), 1)               # last real token
    first = jnp.take_along_axis(logits, last[:, None, None], 1)[:, 0]
    start = jnp.take_along_axis(pos, last[:, None], 1)[:, 0] + 1
    seg = None if segment_ids is None else jnp.take_along_axis(segment_ids, last[:, None], 1)
    step = lambda c, t, p: _step(model(t, p, segment_ids=seg, cache=c, mode="decode", patch=patch))  # noqa: E731
    return replicate(_loop(step, first, start, out["cache"], key, max_new, eos_id, pad, sampling))


def _step(result):
    """A cached call's (logits, out) -> (logits, the new cache), as the loops carry them."""
    return result[0], result[1]["cache"]


def generate_lm(model, prompts, *, max_new: int, key=None, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, eos_id: int | None = None, cache_len: int | None = None,
                segment_ids=None, kv_cache: str = "auto", patch: dict | None = None):
    """Decoder-only sampling: prompts [B,P] -> [B,max_new] new tokens (pad after EOS).

    prompts [B,P] int, every token real; or, with segment_ids [B,P] (0 = padding, documents from 1), padded rows
    (left or right; `arch.prompt_batch` makes both) or rows of packed documents, each row continuing its last
    document (which alone it attends to). The pad id only fills: which tokens are real is said by segment_ids
    alone, and it is never generated. One compiled program: prefill + while_loop of cached steps, which stops
    once every row has emitted eos_id.

    Args:
      model: a decoder-only model (`jaxformer.nn.build_model` of a config with arch="decoder_only").
      prompts: [B, P] int token ids in [0, V) at every real position; B, P >= 1.
      max_new: how many tokens each row generates (an int >= 1).
      key: a `jax.random` key for sampling (None: `jax.random.key(0)`; not read when greedy).
      temperature: the sampling temperature, >= 0 (0 = greedy: `sample_logits`).
      top_k: how many of the best tokens sampling keeps, in [0, V] (0 = all).
      top_p: the nucleus' probability mass, in (0, 1] (1 = all tokens).
      eos_id: the end-of-sequence id: a row that emits it stops, and its later slots hold model.pad_id; None =
        every row generates max_new tokens.
      cache_len: the KV cache's slots S, at least P + max_new (None: P + max_new).
      segment_ids: [B, P] int, 0 on padding and documents numbered from 1; None = every prompt token real.
      kv_cache: the cache's dtype: "auto" (the model's) or "int8".
      patch: activation sites replaced at every step, prefill included ({site: fn(value, layer)}, `nn.sites`;
        e.g. a steering vector); the functions are constants of the compiled program (a new function compiles a
        new one).

    Returns:
      [B, max_new] int32 new tokens (the prompts not included), model.pad_id after a row's EOS.

    Raises:
      DataError: prompts decoding would misread rather than refuse: not a [B, P] integer array with B, P >= 1;
        an id outside [0, V) at a real position; segment_ids of another shape, not integers or negative; the
        padding id (model.pad_id) in prompts without segment_ids.
      ConfigError: max_new not an int >= 1; P + max_new more than cache_len, or than model.max_len where
        positions come from a table (sinusoidal, learned); temperature < 0, top_k outside [0, V] or top_p
        outside (0, 1]; a kv_cache other than "auto" or "int8"; a patch of a site the model does not have.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.decode import generate_lm
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> alone = generate_lm(model, jnp.array([[5, 6, 7]]), max_new=4)               # greedy
      >>> alone.shape, alone.dtype
      ((1, 4), dtype('int32'))
      >>> prompts = jnp.array([[0, 5, 6, 7], [3, 4, 5, 6]])       # row 0 left-padded with the pad id (0)
      >>> out = generate_lm(model, prompts, max_new=4, segment_ids=(prompts != 0).astype(jnp.int32))
      >>> out.shape, out[0].tolist() == alone[0].tolist()       # padding does not change what a row continues
      ((2, 4), True)
      >>> generate_lm(model, prompts, max_new=4)                  # without segment_ids the padding reads as a token
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: prompts [2, 4]: row 0 holds the padding id (model.pad_id=0) at position 0 ...
    """
    _check_inputs(model, prompts, segment_ids, "prompts")
    unrolled_threefry()                                            # sampling's bits: jaxformer.platforms.lowering
    prompts = jnp.asarray(prompts, jnp.int32)
    cache_len = cache_len or prompts.shape[1] + max_new
    _check_room(model.cfg, prompts.shape[1], max_new, cache_len)
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    return _generate_lm(graphdef, state, prompts, _ids(segment_ids), key, max_new=max_new, eos_id=eos_id,
                        sampling=_sampling(temperature, top_k, top_p, model.cfg.vocab_size), cache_len=cache_len,
                        kv_cache=kv_cache, patch=tuple(sorted(patch.items())) if patch else None)


def _ids(segment_ids):
    return None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)


def _seq2seq_cache(model, src, segment_ids, length: int, kv_cache: str):
    """The decoding state of an encoder-decoder over src [B,S]: the encoder run once, its memory's
    cross-attention keys/values computed once (`init_cache(..., memory=)`)."""
    memory = model.encode(src, segment_ids=segment_ids)
    return model.init_cache(src.shape[0], length, dtype=kv_cache, memory=memory)


def _seq2seq_step(model, cache, tokens, positions):
    return _step(model(None, tokens, tgt_positions=positions, cache=cache, mode="decode"))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "sampling", "kv_cache"))
def _generate_seq2seq(graphdef, state, src, segment_ids, key, *, max_new, bos_id, eos_id, sampling, kv_cache):
    model = nnx.merge(graphdef, state)
    b = src.shape[0]
    cache = _seq2seq_cache(model, src, segment_ids, max_new, kv_cache)                 # encoder once per call
    step = functools.partial(_seq2seq_step, model)
    logits, cache = step(cache, jnp.full((b, 1), bos_id, jnp.int32), jnp.zeros((b, 1), jnp.int32))
    return replicate(_loop(step, logits[:, 0], jnp.ones((b,), jnp.int32), cache, key, max_new, eos_id,
                           model.cfg.pad_id, sampling))


def generate_seq2seq(model, src, *, max_new: int, bos_id: int, eos_id: int | None, key=None,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, kv_cache: str = "auto",
                     segment_ids=None):
    """Encoder-decoder sampling: src [B,S] -> [B,max_new] (pad after EOS).

    The encoder and the cross-attention k/v run once; the decoder starts from bos_id and runs cached steps in a
    while_loop, which stops once every row has emitted eos_id. One compiled program.

    Args:
      model: an encoder-decoder model (`jaxformer.nn.build_model` of a config with arch="encoder_decoder").
      src: [B, S] int source token ids in [0, V) at every real position; B, S >= 1.
      max_new: how many tokens each row generates (an int >= 1; at most model.max_len where positions come from
        a table).
      bos_id: the id the decoder starts from, in [0, V) (not part of the output).
      eos_id: the end-of-sequence id: a row that emits it stops, and its later slots hold model.pad_id; None =
        every row generates max_new tokens.
      key: a `jax.random` key for sampling (None: `jax.random.key(0)`; not read when greedy).
      temperature: the sampling temperature, >= 0 (0 = greedy: `sample_logits`).
      top_k: how many of the best tokens sampling keeps, in [0, V] (0 = all).
      top_p: the nucleus' probability mass, in (0, 1] (1 = all tokens).
      kv_cache: the decoder cache's dtype: "auto" (the model's) or "int8".
      segment_ids: [B, S] int, 0 on padding; None = every source token real.

    Returns:
      [B, max_new] int32 generated tokens, model.pad_id after a row's EOS.

    Raises:
      DataError: sources decoding would misread rather than refuse (as `generate_lm`'s prompts: shape, dtype, an
        id outside [0, V), segment_ids, padding without segment_ids), or a bos_id outside [0, V).
      ConfigError: max_new not an int >= 1, or beyond model.max_len where positions come from a table;
        temperature < 0, top_k outside [0, V] or top_p outside (0, 1]; a kv_cache other than "auto" or "int8".

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.decode import generate_seq2seq
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                              num_encoder_layers=1, num_decoder_layers=1, max_len=16), seed=0)
      >>> src = jnp.array([[3, 4, 5, 6]])
      >>> out = generate_seq2seq(model, src, max_new=5, bos_id=1, eos_id=None)      # greedy, no early stop
      >>> out.shape
      (1, 5)
      >>> eos = int(out[0, 1])                                     # pretend the second token was EOS
      >>> generate_seq2seq(model, src, max_new=5, bos_id=1, eos_id=eos)[0, 2:].tolist()   # pad (0) after it
      [0, 0, 0]
      >>> generate_seq2seq(model, src, max_new=5, bos_id=16, eos_id=None)
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: bos_id=16 is outside the vocabulary [0, 16) (model.vocab_size)
    """
    _check_inputs(model, src, segment_ids, "src", bos_id)
    _check_room(model.cfg, 0, max_new, None)                       # positions 0 .. max_new-1
    unrolled_threefry()                                            # sampling's bits: jaxformer.platforms.lowering
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    return _generate_seq2seq(graphdef, state, jnp.asarray(src, jnp.int32), _ids(segment_ids), key, max_new=max_new,
                             bos_id=bos_id, eos_id=eos_id, sampling=_sampling(temperature, top_k, top_p, model.cfg.vocab_size),
                             kv_cache=kv_cache)


def finish_after_eos(tokens: jax.Array, eos_id: int, pad_id: int) -> jax.Array:
    """tokens [B,T] -> same with every position after the first EOS set to pad.

    Args:
      tokens: [B, T] int token ids.
      eos_id: the end-of-sequence id; a row's first one is kept.
      pad_id: the id that fills every position after it.

    Returns:
      [B, T] tokens, in tokens' dtype; a row without EOS is unchanged.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.decode import finish_after_eos
      >>> finish_after_eos(jnp.array([[5, 2, 7, 2], [5, 6, 7, 8]]), eos_id=2, pad_id=0).tolist()
      [[5, 2, 0, 0], [5, 6, 7, 8]]
    """
    seen = jnp.cumsum(tokens == eos_id, axis=1) - (tokens == eos_id)
    return jnp.where(seen > 0, pad_id, tokens)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "pad_id"))
def _greedy_naive(graphdef, state, src, segment_ids, *, max_new, bos_id, eos_id, pad_id):
    model = nnx.merge(graphdef, state)
    memory = model.encode(src, segment_ids=segment_ids)
    b = src.shape[0]
    buf = jnp.full((b, max_new + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)

    def body(i, buf):
        logits = model(memory, buf[:, :-1])[0]                       # [B,T,V], full recomputation
        nxt = jnp.argmax(_no_pad(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), pad_id), -1)
        return jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None].astype(jnp.int32), i + 1, axis=1)

    buf = jax.lax.fori_loop(0, max_new, body, buf)
    return replicate(finish_after_eos(buf[:, 1:], eos_id, pad_id))


def greedy_naive(model, src: jax.Array, max_new: int, *, bos_id: int, eos_id: int, segment_ids=None) -> jax.Array:
    """Encoder-decoder greedy decoding by full recomputation (no cache). src [B,S] (segment_ids as
    `generate_seq2seq`) -> [B,max_new].

    The baseline the cache is measured against: the encoder runs once, then every step reruns the decoder over
    all the tokens so far, for exactly max_new steps (EOS is applied afterwards, `finish_after_eos`).

    Args:
      model: an encoder-decoder model (arch="encoder_decoder").
      src: [B, S] int source token ids in [0, V) at every real position.
      max_new: how many tokens each row generates.
      bos_id: the id the decoder starts from, in [0, V) (not part of the output).
      eos_id: the end-of-sequence id (an int): every position after a row's first one holds model.pad_id.
      segment_ids: [B, S] int, 0 on padding; None = every source token real.

    Returns:
      [B, max_new] int32 tokens, model.pad_id after a row's EOS: `generate_seq2seq`'s greedy output.

    Raises:
      DataError: sources decoding would misread (as `generate_seq2seq`'s), or a bos_id outside [0, V).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.decode import generate_seq2seq, greedy_naive
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                              num_encoder_layers=1, num_decoder_layers=1, max_len=16), seed=0)
      >>> src = jnp.array([[3, 4, 5, 6]])
      >>> naive = greedy_naive(model, src, 5, bos_id=1, eos_id=2)
      >>> naive.shape, naive.tolist() == generate_seq2seq(model, src, max_new=5, bos_id=1, eos_id=2).tolist()
      ((1, 5), True)
    """
    _check_inputs(model, src, segment_ids, "src", bos_id)
    graphdef, state = nnx.split(model)
    return _greedy_naive(graphdef, state, jnp.asarray(src), _ids(segment_ids), max_new=max_new, bos_id=bos_id, eos_id=eos_id,
                         pad_id=model.cfg.pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "bos_id", "eos_id", "beam", "length_penalty",
                                             "kv_cache"))
def _beam_search(graphdef, state, src, segment_ids, *, max_new, bos_id, eos_id, beam, length_penalty, kv_cache):
    model = nnx.merge(graphdef, state)
    b, w, pad = src.shape[0], beam, model.cfg.pad_id
    seg = None if segment_ids is None else jnp.repeat(segment_ids, w, axis=0)
    cache = _seq2seq_cache(model, jnp.repeat(src, w, axis=0), seg, max_new, kv_cache)  # memory [B*W, S, D]
    neg = jnp.finfo(jnp.float32).min / 4
    scores = jnp.where(jnp.arange(w) == 0, 0.0, neg)[None].repeat(b, 0)               # [B,W]: start from beam 0
    seqs = jnp.full((b, w, max_new), pad, jnp.int32)
    finished = jnp.zeros((b, w), bool)
    lengths = jnp.zeros((b, w), jnp.int32)
    tok = jnp.full((b * w, 1), bos_id, jnp.int32)

    def cond(c):
        i, finished = c[0], c[5]
        return (i < max_new) & ~jnp.all(finished)             # stop once every beam has finished

    def body(c):
        i, tok, cache, scores, seqs, finished, lengths = c
        logits, cache = _seq2seq_step(model, cache, tok, jnp.full((b * w, 1), i, jnp.int32))
        logp = jax.nn.log_softmax(logits[:, 0], -1).reshape(b, w, -1)
        v = logp.shape[-1]
        only_pad = jnp.where(jnp.arange(v) == pad, 0.0, neg)
        logp = jnp.where(finished[..., None], only_pad, _no_pad(logp, pad))              # finished beams stay put
        top, idx = jax.lax.top_k((scores[..., None] + logp).reshape(b, w * v), w)
        src_beam, new_tok = idx // v, (idx % v).astype(jnp.int32)
        gather = lambda a: jnp.take_along_axis(a, src_beam, 1)                         # noqa: E731
        was_done = gather(finished)
        seqs = jnp.take_along_axis(seqs, src_beam[..., None], 1).at[:, :, i].set(new_tok)
        lengths = gather(lengths) + (~was_done).astype(jnp.int32)
        finished = was_done | (new_tok == eos_id) if eos_id is not None else was_done
        cache = cache.take((jnp.arange(b)[:, None] * w + src_beam).reshape(-1))         # reorder the cache rows
        return i + 1, new_tok.reshape(b * w, 1), cache, top, seqs, finished, lengths

    init = (jnp.zeros((), jnp.int32), tok, cache, scores, seqs, finished, lengths)
    _, _, _, scores, seqs, finished, lengths = jax.lax.while_loop(cond, body, init)
    norm = ((5.0 + lengths) / 6.0) ** length_penalty                                    # GNMT length penalty
    best = jnp.argmax(scores / norm, -1)
    return replicate(jnp.take_along_axis(seqs, best[:, None, None], 1)[:, 0])


def beam_search(model, src, *, max_new: int, bos_id: int, eos_id: int | None, beam: int = 4,
                length_penalty: float = 0.6, kv_cache: str = "auto", segment_ids=None):
    """Encoder-decoder beam search. src [B,S] (segment_ids as `generate_seq2seq`) -> best hypothesis [B,max_new]
    (pad after EOS).

    Hypotheses are ranked by log-probability / ((5 + length) / 6) ** length_penalty (GNMT's length penalty).
    beam=1 is greedy decoding. Stops as soon as every beam has finished. One compiled program; the encoder and
    the cross-attention k/v run once.

    Args:
      model: an encoder-decoder model (arch="encoder_decoder").
      src: [B, S] int source token ids in [0, V) at every real position.
      max_new: the longest hypothesis (an int >= 1; at most model.max_len where positions come from a table).
      bos_id: the id the decoder starts from, in [0, V) (not part of the output).
      eos_id: the end-of-sequence id: a beam that emits it has finished; None = beams never finish early.
      beam: the beam width W, an int in [1, V].
      length_penalty: the exponent of the length penalty (0 = rank by log-probability alone).
      kv_cache: the decoder cache's dtype: "auto" (the model's) or "int8".
      segment_ids: [B, S] int, 0 on padding; None = every source token real.

    Returns:
      [B, max_new] int32 tokens of each row's best hypothesis, model.pad_id after its EOS.

    Raises:
      ConfigError: a beam that is not an int in [1, V]; max_new not an int >= 1, or beyond model.max_len where
        positions come from a table; a kv_cache other than "auto" or "int8".
      DataError: sources decoding would misread (as `generate_seq2seq`'s), or a bos_id outside [0, V).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.decode import beam_search
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                              num_encoder_layers=1, num_decoder_layers=1, max_len=16), seed=0)
      >>> src = jnp.array([[3, 4, 5, 6]])
      >>> best = beam_search(model, src, max_new=5, bos_id=1, eos_id=2, beam=3)
      >>> best.shape, best.dtype
      ((1, 5), dtype('int32'))
      >>> beam_search(model, src, max_new=5, bos_id=1, eos_id=2, beam=0)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: beam=0 must be an integer in [1, vocab_size=16]
    """
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1 or beam > model.cfg.vocab_size:
        raise ConfigError(f"beam={beam!r} must be an integer in [1, vocab_size={model.cfg.vocab_size}]")
    _check_inputs(model, src, segment_ids, "src", bos_id)
    _check_room(model.cfg, 0, max_new, None)
    graphdef, state = nnx.split(model)
    return _beam_search(graphdef, state, jnp.asarray(src, jnp.int32), _ids(segment_ids), max_new=max_new, bos_id=bos_id,
                        eos_id=eos_id, beam=beam, length_penalty=float(length_penalty), kv_cache=kv_cache)
