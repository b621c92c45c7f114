"""Autoregressive decoding.

`greedy_naive` recomputes the full forward pass at every step (the baseline that issue C's KV cache beats).
Axis legend: B batch, S source length, T generated length, V vocab.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


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
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), -1)
        return jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None].astype(jnp.int32), i + 1, axis=1)

    buf = jax.lax.fori_loop(0, max_new, body, buf)
    return finish_after_eos(buf[:, 1:], eos_id, pad_id)


def greedy_naive(model, src: jax.Array, max_new: int, *, bos_id: int, eos_id: int) -> jax.Array:
    """Encoder-decoder greedy decoding by full recomputation. src [B,S] -> tokens [B,max_new] (pad after EOS)."""
    graphdef, state = nnx.split(model)
    return _greedy_naive(graphdef, state, jnp.asarray(src), max_new=max_new, bos_id=bos_id, eos_id=eos_id,
                         pad_id=model.cfg.pad_id)
