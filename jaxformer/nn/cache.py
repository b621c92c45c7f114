"""What a model's cached call carries: the decoder's KV cache, one layer's slice of it, and the encoder memory
prepared for decoding. All are pytrees passed in and returned (`model.init_cache`, `model.step`).

Axis legend: L decoder layers, B batch, S cache slots (or source length), T new tokens, K kv heads, H head dim.

The cache: k, v [L,B,S,K,H] (int8 values with a float32 scale per slot and kv head when its dtype is "int8"),
per-slot absolute positions [B,S] and segment ids [B,S] (0 = empty or padding: never attended), and the next
write slot. Attention over the cache is causal over *positions* and skips empty slots, so left-, right- or
un-padded prompt batches decode exactly as each prompt alone; with explicit segment ids, a query also sees only
its own document's slots.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.axes import CACHE
from jaxformer.parallel import constrain


class QuantizedKV(NamedTuple):
    """An int8 KV cache tensor: values [...,S,K,H] int8 and a float32 scale per slot and kv head [...,S,K,1].
    Keys and values are rounded when written and dequantized when attended."""
    values: jax.Array
    scale: jax.Array

    @property
    def dtype(self):
        return self.values.dtype

    def dequantize(self, dtype) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_kv(x: jax.Array) -> QuantizedKV:
    """[..., H] float -> QuantizedKV with a symmetric int8 scale over each vector's H values."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
    q = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0))
    return QuantizedKV(jnp.clip(q, -127, 127).astype(jnp.int8), scale)


class LayerKV(NamedTuple):
    """One attention layer's keys and values: k, v [B,S,K,H] (a stack of them [L,B,S,K,H] when scanned), float
    or `QuantizedKV`."""
    k: jax.Array
    v: jax.Array

    def readable(self, dtype) -> "LayerKV":
        """As float arrays of `dtype` (an int8 cache is dequantized)."""
        f = lambda a: a.dequantize(dtype) if isinstance(a, QuantizedKV) else a     # noqa: E731
        return LayerKV(f(self.k), f(self.v))


class KVCache(NamedTuple):
    """A decoder's KV cache (see the module docstring)."""
    k: jax.Array          # [L,B,S,K,H] (or a QuantizedKV)
    v: jax.Array          # [L,B,S,K,H] (likewise)
    positions: jax.Array  # [B,S] int32 absolute position of the token in each slot
    segments: jax.Array   # [B,S] int32 segment (document) id of each slot; 0 = empty or padding
    index: jax.Array      # [] int32, next slot to write

    @property
    def valid(self) -> jax.Array:
        """[B,S] bool: the slot holds a real token."""
        return self.segments != 0

    @property
    def layers(self) -> LayerKV:
        """The stacked per-layer slices [L,B,S,K,H], as the layer stack scans them."""
        return LayerKV(self.k, self.v)

    def without_slots(self) -> "KVCache":
        """The same cache with no slots (S = 0): what a prefill into an empty cache attends over."""
        cut = lambda t: jax.tree.map(lambda a: a[:, :, :0], t)                    # noqa: E731
        return KVCache(cut(self.k), cut(self.v), self.positions[:, :0], self.segments[:, :0], self.index)

    def write(self, new: LayerKV, positions: jax.Array, segments: jax.Array) -> "KVCache":
        """Write T new entries (new k/v [L,B,T,K,H], float: rounded here for an int8 cache; positions and
        segments [B,T]) at slots [index, index+T), in place."""
        if isinstance(self.k, QuantizedKV):
            new = LayerKV(quantize_kv(new.k), quantize_kv(new.v))
        i = self.index

        def put(buf, x, axis):
            return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, axis=axis),
                                buf, x)
        on = lambda t: jax.tree.map(lambda a: constrain(a, CACHE), t)             # noqa: E731
        return KVCache(on(put(self.k, new.k, 2)), on(put(self.v, new.v, 2)), put(self.positions, positions, 1),
                       put(self.segments, segments.astype(jnp.int32), 1), i + positions.shape[1])

    def take(self, rows: jax.Array) -> "KVCache":
        """The cache with its batch rows reordered / repeated: rows [B'] int (e.g. beam search's surviving beams)."""
        kv = lambda t: jax.tree.map(lambda a: a[:, rows], t)                      # noqa: E731
        return KVCache(kv(self.k), kv(self.v), self.positions[rows], self.segments[rows], self.index)


def init_cache(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty cache of `length` slots: k, v [L,B,S,K,H] zeros of `dtype` (a jnp dtype, or "int8": int8
    values with float32 scales [L,B,S,K,1]), no valid slot. Models call this through `model.init_cache`."""
    shape = (num_layers, batch, length, kv_heads, head_dim)
    if isinstance(dtype, str) and dtype == "int8":
        z = QuantizedKV(constrain(jnp.zeros(shape, jnp.int8), CACHE),
                        constrain(jnp.zeros(shape[:-1] + (1,), jnp.float32), CACHE))
    else:
        z = constrain(jnp.zeros(shape, dtype), CACHE)
    return KVCache(z, z, jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch, length), jnp.int32),
                   jnp.zeros((), jnp.int32))


class Memory(NamedTuple):
    """The encoder's output as the decoder reads it: x [B,S,D], the source positions' validity and segment ids
    [B,S] (segment ids None unless given: then a target token sees only its own document's source), and kv: each
    decoder layer's cross-attention keys/values [L,B,S,K,H] (`model.prepare_memory`: computed once for decoding)
    or None (computed from x in each layer)."""
    x: jax.Array
    valid: jax.Array
    segments: jax.Array | None = None
    kv: LayerKV | None = None
