"""What a model's cached call carries: the decoder's KV cache, one layer's slice of it, and the encoder memory
prepared for decoding. All are pytrees passed in and returned (`model.init_cache`, `model.step`).

Axis legend: L decoder layers, B batch, S cache slots (or source length), T new tokens, K kv heads, H head dim.

The cache: k, v [L,B,S,K,H] (int8 values with a float32 scale per slot and kv head when its dtype is "int8"),
per-slot absolute positions [B,S] and segment ids [B,S] (0 = empty or padding: never attended), and the next
write slot. A decoding program lays k and v out per layer (`KVCache.unstacked` -> `LayerwiseKVCache`: tuples of
L tensors, each stored heads-major [B,K,S,H]), so that each layer of its token loop reads and writes its own
buffer in place, with no slice of a stacked one, and a one-token query reads each head's S·H block contiguously
(benchmarks/cache_layout.md); `LayerwiseKV.layer(i)` gives layer i (a `HeadsMajorKV`), which attention contracts
in that layout. Each cache type writes the new keys/values in the form the layer stack returns for it
(`LayerKV.collect`: stacked, or per layer), so no code asks which layout it holds.
Attention over the cache is causal over *positions* and skips empty slots, so left-, right- or
un-padded prompt batches decode exactly as each prompt alone; with explicit segment ids, a query also sees only
its own document's slots.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.axes import CACHE
from jaxformer.parallel import constrain

SLOT_AXIS = 2       # S in both layouts: stacked [L,B,S,K,H] and per layer, heads-major [B,K,S,H]


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
    """Keys and values of attention layers, stacked: k, v [B,S,K,H] for one layer, [L,B,S,K,H] for a stack (float
    or `QuantizedKV`)."""
    k: jax.Array
    v: jax.Array

    def readable(self, dtype) -> "LayerKV":
        """As float arrays of `dtype` (an int8 cache is dequantized)."""
        return type(self)(_readable(self.k, dtype), _readable(self.v, dtype))

    def layer(self, i: int) -> "LayerKV":
        """Layer i of a stack [L,...] -> [B,S,K,H]."""
        return jax.tree.map(lambda a: a[i], self)

    @classmethod
    def collect(cls, parts: list["LayerKV"]) -> "LayerKV":
        """L layers' new keys/values [B,T,K,H] -> the stack [L,B,T,K,H] (what a stacked cache writes)."""
        return cls(*(jax.tree.map(lambda *a: jnp.stack(a), *[getattr(p, f) for p in parts]) for f in cls._fields))


class HeadsMajorKV(LayerKV):
    """One layer's keys and values stored heads-major: k, v [B,K,S,H] (float or `QuantizedKV`): a layer of a
    cache laid out for decoding (`LayerwiseKV.layer`). Attention contracts them in this layout
    (ops.dot_product_attention's kv_layout="BKSH")."""


class LayerwiseKV(LayerKV):
    """Keys and values of L layers kept apart: k, v tuples of L arrays, each stored heads-major [B,K,S,H] (float or
    `QuantizedKV`); what a token loop reads (`LayerwiseKVCache.layers`, `model.prepare_memory` with a layout)."""

    def layer(self, i: int) -> HeadsMajorKV:
        return HeadsMajorKV(self.k[i], self.v[i])

    @classmethod
    def collect(cls, parts: list[LayerKV]) -> "LayerwiseKV":
        """L layers' new keys/values [B,T,K,H], kept per layer (a `LayerwiseKVCache` writes each in place)."""
        return cls(tuple(p.k for p in parts), tuple(p.v for p in parts))


def _readable(a, dtype):
    return a.dequantize(dtype) if isinstance(a, QuantizedKV) else a


class KVCache(NamedTuple):
    """A decoder's KV cache (see the module docstring), its keys and values stacked: k, v [L,B,S,K,H] (or
    QuantizedKV), read by the scanned layer stack. `unstacked()` gives the same cache laid out per layer."""
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
        """The per-layer keys/values as the layer stack reads them: stacked [L,B,S,K,H]."""
        return LayerKV(self.k, self.v)

    def unstacked(self) -> "LayerwiseKVCache":
        """The same cache with k and v laid out per layer: tuples of L tensors stored heads-major [B,K,S,H] (one
        copy, made once, before a token loop)."""
        lay = lambda t: tuple(heads_major(jax.tree.map(lambda a: a[j], t)) for j in range(_depth(t)))  # noqa: E731
        return LayerwiseKVCache(lay(self.k), lay(self.v), self.positions, self.segments, self.index)

    def without_slots(self) -> "KVCache":
        """The same cache with no slots (S = 0): what a prefill into an empty cache attends over."""
        cut = lambda t: jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, 0, axis=SLOT_AXIS), t)   # noqa: E731
        return type(self)(cut(self.k), cut(self.v), self.positions[:, :0], self.segments[:, :0], self.index)

    def write(self, new: LayerKV, positions: jax.Array, segments: jax.Array) -> "KVCache":
        """Write T new entries (new k/v as the layer stack returns them for this cache: [L,B,T,K,H] here, float:
        rounded here for an int8 cache; positions and segments [B,T]) at slots [index, index+T), in place."""
        i = self.index
        put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, axis=1)  # noqa: E731
        return type(self)(self._put_kv(self.k, new.k, i), self._put_kv(self.v, new.v, i),
                          put(self.positions, positions), put(self.segments, segments), i + positions.shape[1])

    def take(self, rows: jax.Array) -> "KVCache":
        """The cache with its batch rows reordered / repeated: rows [B'] int (e.g. beam search's surviving beams)."""
        return type(self)(self._take_kv(self.k, rows), self._take_kv(self.v, rows), self.positions[rows],
                          self.segments[rows], self.index)

    @staticmethod
    def _put_kv(buf, new, i):
        return jax.tree.map(lambda a: constrain(a, CACHE), _put(buf, new, i))

    @staticmethod
    def _take_kv(t, rows):
        return jax.tree.map(lambda a: jnp.take(a, rows, axis=1), t)


class LayerwiseKVCache(KVCache):
    """The cache laid out for a token loop: k, v tuples of L tensors, each stored heads-major [B,K,S,H] (or
    QuantizedKV), so that each layer reads and writes its own buffer in place, with no slice of a stacked one
    (`KVCache.unstacked`; `model.init_cache(..., layout=...)`). Positions, segments and index as `KVCache`."""

    @property
    def layers(self) -> LayerwiseKV:
        """The per-layer keys/values as a laid-out layer stack reads them: tuples of L heads-major [B,K,S,H]."""
        return LayerwiseKV(self.k, self.v)

    def unstacked(self) -> "LayerwiseKVCache":
        return self

    @staticmethod
    def _put_kv(buf, new, i):
        return tuple(jax.tree.map(lambda a: constrain(a, _LAYER), _put(b, n, i, heads_first=True))
                     for b, n in zip(buf, new))

    @staticmethod
    def _take_kv(t, rows):
        return tuple(jax.tree.map(lambda a: jnp.take(a, rows, axis=0), x) for x in t)


_LAYER = (CACHE[1], CACHE[3], CACHE[2], CACHE[4])          # one layer's buffer, heads-major [B,K,S,H]


def heads_major(x):
    """A pytree of [B,S,K,H] arrays (float or QuantizedKV) <-> [B,K,S,H] (swapping S and K is its own inverse)."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), x)


def _depth(t) -> int:
    """L of a stacked cache tensor (an array or QuantizedKV, leaves [L,...])."""
    return jax.tree.leaves(t)[0].shape[0]


def _put(buf, new, index, heads_first: bool = False):
    """buf (a float array or QuantizedKV) with float `new` written at slot `index`, in place; heads_first: new
    [B,T,K,H] goes into a heads-major buffer [B,K,S,H]."""
    if isinstance(buf, QuantizedKV):
        new = quantize_kv(new)
    if heads_first:
        new = heads_major(new)
    put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), index, axis=SLOT_AXIS)  # noqa: E731
    return jax.tree.map(put, buf, new)


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
