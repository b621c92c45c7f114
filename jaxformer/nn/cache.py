"""What a model's cached call carries: the decoder's KV cache, one layer's slice of it, and the encoder memory
prepared for decoding. All are pytrees passed in and returned (`model.init_cache`, `model.step`).

Axis legend: L decoder layers, B batch, S cache slots (or source length), T new tokens, K kv heads, H head dim.

The cache: k, v [L,B,S,K,H] (int8 values with a float32 scale per slot and kv head when its dtype is "int8"),
per-slot absolute positions [B,S] and segment ids [B,S] (0 = empty or padding: never attended), and the next
write slot. A decoding program lays k and v out per layer (`KVCache.unstacked`: a list of L tensors, each stored
heads-major [B,K,S,H]), so that each layer of its token loop reads and writes its own buffer in place, with no slice
of a stacked one, and a one-token query reads each head's S·H block contiguously (benchmarks/cache_layout.md);
`layer_kv` gives layer i (a `HeadsMajorKV`), which attention contracts in that layout.
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
    """One attention layer's keys and values: k, v [B,S,K,H] (a stack of them [L,B,S,K,H] when scanned), float
    or `QuantizedKV`."""
    k: jax.Array
    v: jax.Array

    def readable(self, dtype) -> "LayerKV":
        """As float arrays of `dtype` (an int8 cache is dequantized)."""
        return type(self)(_readable(self.k, dtype), _readable(self.v, dtype))


class HeadsMajorKV(LayerKV):
    """One layer's keys and values stored heads-major: k, v [B,K,S,H] (float or `QuantizedKV`): a layer of a
    cache laid out for decoding (`KVCache.unstacked`, `layer_kv`). Attention contracts them in this layout
    (ops.dot_product_attention's kv_layout="BKSH")."""


def _readable(a, dtype):
    return a.dequantize(dtype) if isinstance(a, QuantizedKV) else a


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
        """The per-layer keys/values as the layer stack reads them: stacked [L,B,S,K,H], or lists of L [B,K,S,H]."""
        return LayerKV(self.k, self.v)

    def unstacked(self) -> "KVCache":
        """The same cache with k and v laid out per layer: lists of L tensors stored heads-major [B,K,S,H] (one
        copy, made once, before a token loop; a cache already laid out so is returned as it is)."""
        lay = lambda t: t if isinstance(t, list) else [heads_major(x) for x in per_layer(t)]   # noqa: E731
        return KVCache(lay(self.k), lay(self.v), self.positions, self.segments, self.index)

    def without_slots(self) -> "KVCache":
        """The same cache with no slots (S = 0): what a prefill into an empty cache attends over."""
        cut = lambda t: jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, 0, axis=SLOT_AXIS), t)   # noqa: E731
        return KVCache(cut(self.k), cut(self.v), self.positions[:, :0], self.segments[:, :0], self.index)

    def write(self, new: LayerKV, positions: jax.Array, segments: jax.Array) -> "KVCache":
        """Write T new entries (new k/v [L,B,T,K,H] or lists of L [B,T,K,H], float: rounded here for an int8
        cache; positions and segments [B,T]) at slots [index, index+T), in place."""
        i = self.index

        def put_kv(buf, x):
            if not isinstance(buf, list):
                x = jnp.stack(x) if isinstance(x, list) else x
                return jax.tree.map(lambda a: constrain(a, CACHE), _put(buf, x, i))
            return [jax.tree.map(lambda a: constrain(a, _LAYER), _put(b, x[j], i, heads_first=True))
                    for j, b in enumerate(buf)]
        put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, axis=1)  # noqa: E731
        return KVCache(put_kv(self.k, new.k), put_kv(self.v, new.v), put(self.positions, positions),
                       put(self.segments, segments), i + positions.shape[1])

    def take(self, rows: jax.Array) -> "KVCache":
        """The cache with its batch rows reordered / repeated: rows [B'] int (e.g. beam search's surviving beams)."""
        kv = lambda t: _on_layers(t, lambda a, ax: jnp.take(a, rows, axis=ax))    # noqa: E731
        return KVCache(kv(self.k), kv(self.v), self.positions[rows], self.segments[rows], self.index)


_LAYER = (CACHE[1], CACHE[3], CACHE[2], CACHE[4])          # one layer's buffer, heads-major [B,K,S,H]


def heads_major(x):
    """A pytree of [B,S,K,H] arrays (float or QuantizedKV) <-> [B,K,S,H] (swapping S and K is its own inverse)."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), x)


def layer_kv(kv: LayerKV, i: int) -> HeadsMajorKV:
    """Layer i of a per-layer LayerKV (lists of L heads-major [B,K,S,H]: `KVCache.unstacked`,
    `prepare_memory` after `for_decoding`)."""
    return HeadsMajorKV(kv.k[i], kv.v[i])


def _put(buf, new, index, heads_first: bool = False):
    """buf (a float array or QuantizedKV) with float `new` written at slot `index`, in place; heads_first: new
    [B,T,K,H] goes into a heads-major buffer [B,K,S,H]."""
    if isinstance(buf, QuantizedKV):
        new = quantize_kv(new)
    if heads_first:
        new = heads_major(new)
    put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), index, axis=SLOT_AXIS)  # noqa: E731
    return jax.tree.map(put, buf, new)


def per_layer(x) -> list:
    """A stacked per-layer pytree (leaves [L,...]; e.g. a cache tensor, a LayerKV) -> a list of L pytrees
    (leaves [...]); a list is returned as it is."""
    if isinstance(x, list):
        return x
    return [jax.tree.map(lambda a: a[j], x) for j in range(jax.tree.leaves(x)[0].shape[0])]


def _on_layers(t, fn):
    """fn(array, batch_axis) over each array of a cache tensor: stacked [L,B,...] (batch axis 1) or a per-layer
    list of [B,...] (batch axis 0)."""
    if isinstance(t, list):
        return [jax.tree.map(lambda a: fn(a, 0), x) for x in t]
    return jax.tree.map(lambda a: fn(a, 1), t)


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
