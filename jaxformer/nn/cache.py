"""What a model's cached calls carry: the decoding state (`KVCache`: the decoder's KV cache, the decoder laid out
for a token loop and, for an encoder-decoder, the encoder memory prepared for decoding), one layer's slice of it,
and the memory. All are pytrees passed in and returned (`model.init_cache`, `model(..., cache=, mode=)`).

Axis legend: L decoder layers, B batch, S cache slots (or source length), T new tokens, K kv heads, H head dim.

The cache: per layer k, v stored heads-major [B,K,S,H] (int8 values with a float32 scale per slot and kv head
when its dtype is "int8"), so that each layer of a token loop reads and writes its own buffer in place, with no
slice of a stacked one, and a one-token query reads each head's S·H block contiguously
(benchmarks/cache_layout.md); per-slot absolute positions [B,S] and segment ids [B,S] (0 = empty or padding:
never attended), and the next write slot. `LayerwiseKV.layer(i)` gives layer i (a `HeadsMajorKV`), which
attention contracts in that layout.
Attention over the cache is causal over *positions* and skips empty slots, so left-, right- or
un-padded prompt batches decode exactly as each prompt alone; with explicit segment ids, a query also sees only
its own document's slots.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.axes import CACHE
from jaxformer.parallel import constrain

SLOT_AXIS = 2       # S of a heads-major layer buffer [B,K,S,H]


class QuantizedKV(NamedTuple):
    """An int8 KV cache tensor: int8 values and a float32 scale per slot and kv head. Keys and values are rounded
    when written and dequantized when attended.

    Attributes:
      values: [..., H] int8 (a cache layer's: [B, K, S, H]).
      scale: [..., 1] float32, one per vector of H values ([B, K, S, 1]).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import quantize_kv
      >>> q = quantize_kv(jnp.array([[0.5, -1.0, 0.25]]))
      >>> q.dtype, q.values.shape, q.scale.shape
      (dtype('int8'), (1, 3), (1, 1))
    """
    values: jax.Array
    scale: jax.Array

    @property
    def dtype(self):
        return self.values.dtype

    def dequantize(self, dtype) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_kv(x: jax.Array) -> QuantizedKV:
    """Round keys or values to int8 with a symmetric scale over each vector's H values.

    Args:
      x: [..., H] float keys or values.

    Returns:
      `QuantizedKV`: values [..., H] int8 in [-127, 127], scale [..., 1] float32 (max |x| / 127; 0 for a zero
        vector).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import quantize_kv
      >>> q = quantize_kv(jnp.array([[0.5, -1.0, 0.25]]))           # one vector, H = 3
      >>> q.values.tolist(), round(float(q.scale[0, 0]) * 127, 4)
      ([[64, -127, 32]], 1.0)
      >>> q.dequantize(jnp.float32).round(2).tolist()
      [[0.5, -1.0, 0.25]]
    """
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
    q = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0))
    return QuantizedKV(jnp.clip(q, -127, 127).astype(jnp.int8), scale)


class LayerKV(NamedTuple):
    """Keys and values of attention layers, stacked (float or `QuantizedKV`). As what attention reads, k and v may
    each be a tuple of segments along S (`then`). The methods keep `layout`, so attention code never names one.

    Attributes:
      k: [B, S, K, H] keys of one layer, [L, B, S, K, H] of a stack.
      v: the values, likewise.
      layout: the axis order, "BSKH" (ops.dot_product_attention's kv_layout).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import LayerKV
      >>> kv = LayerKV(jnp.zeros((2, 1, 3, 2, 8)), jnp.zeros((2, 1, 3, 2, 8)))    # L=2 layers [L, B, S, K, H]
      >>> kv.layout, kv.layer(1).k.shape
      ('BSKH', (1, 3, 2, 8))
      >>> both, new = kv.layer(0).then(LayerKV(jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8))))
      >>> len(both.k), both.values_bskh().shape              # the cache's 3 slots then 1 new token
      (2, (1, 4, 2, 8))
    """
    k: jax.Array
    v: jax.Array
    layout = "BSKH"

    def own(self, kv: "LayerKV") -> "LayerKV":
        """kv [B,T,K,H] (float) in this view's layout."""
        return kv

    def then(self, new: "LayerKV") -> tuple["LayerKV", "LayerKV"]:
        """This (readable) cache slice followed by T new keys/values [B,T,K,H] -> (the two as segments along S,
        in this layout: what the queries attend over, the cache never copied; new cast to the cache's dtype, as
        it will be written)."""
        new = LayerKV(new.k.astype(self.k.dtype), new.v.astype(self.v.dtype))
        now = self.own(new)
        return type(self)((self.k, now.k), (self.v, now.v)), new

    def grouped_values(self, g: int) -> "LayerKV":
        """The same view with each g adjacent kv heads' values side by side, as K/g heads of g·H (e.g. a
        differential head's pair): v [B,S,K,H] -> [B,S,K/g,g·H], segment by segment."""
        return self._replace(v=_segments(self.v, lambda v: v.reshape(*v.shape[:2], v.shape[2] // g, g * v.shape[3])))

    def values_bskh(self) -> jax.Array:
        """The values as one [B,S,K,H] array (segments joined along S)."""
        return jnp.concatenate(_parts(self.v), axis=1)

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
    """One layer's keys and values stored heads-major (float or `QuantizedKV`): a layer of a cache laid out for
    decoding (`LayerwiseKV.layer`). Attention contracts them in this layout.

    Attributes:
      k: [B, K, S, H] keys.
      v: [B, K, S, H] values.
      layout: "BKSH" (ops.dot_product_attention's kv_layout).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import HeadsMajorKV
      >>> kv = HeadsMajorKV(jnp.zeros((1, 2, 3, 8)), jnp.zeros((1, 2, 3, 8)))     # [B, K, S, H]
      >>> kv.layout, kv.values_bskh().shape, kv.grouped_values(2).v.shape
      ('BKSH', (1, 3, 2, 8), (1, 1, 3, 16))
    """
    layout = "BKSH"

    def own(self, kv: LayerKV) -> "HeadsMajorKV":
        return HeadsMajorKV(*heads_major(kv))

    def grouped_values(self, g: int) -> "HeadsMajorKV":
        def group(v):                                                   # [B,K,S,H] -> [B,K/g,S,g·H]
            b, k, s, h = v.shape
            return jnp.swapaxes(v.reshape(b, k // g, g, s, h), 2, 3).reshape(b, k // g, s, g * h)
        return self._replace(v=_segments(self.v, group))

    def values_bskh(self) -> jax.Array:
        return jnp.concatenate([jnp.swapaxes(v, 1, 2) for v in _parts(self.v)], axis=1)


def _parts(x) -> tuple:
    """A view's k or v as its segments along S (a lone array: one)."""
    return x if isinstance(x, tuple) else (x,)


def _segments(x, fn):
    """fn applied to an array, or to each segment of a tuple of them."""
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)


class LayerwiseKV(LayerKV):
    """Keys and values of L layers kept apart, each stored heads-major (float or `QuantizedKV`): what a token loop
    reads (`KVCache.layers`; a memory prepared by `model.init_cache(..., memory=)`).

    Attributes:
      k: tuple of L [B, K, S, H] keys.
      v: tuple of L [B, K, S, H] values.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import LayerKV, LayerwiseKV
      >>> kv = LayerwiseKV.collect([LayerKV(jnp.zeros((1, 2, 3, 8)), jnp.zeros((1, 2, 3, 8)))] * 2)
      >>> len(kv.k), type(kv.layer(1)).__name__, kv.layer(1).k.shape
      (2, 'HeadsMajorKV', (1, 2, 3, 8))
    """

    def layer(self, i: int) -> HeadsMajorKV:
        return HeadsMajorKV(self.k[i], self.v[i])

    @classmethod
    def collect(cls, parts: list[LayerKV]) -> "LayerwiseKV":
        """L layers' new keys/values [B,T,K,H], kept per layer (a `LayerwiseKVCache` writes each in place)."""
        return cls(tuple(p.k for p in parts), tuple(p.v for p in parts))


def _readable(a, dtype):
    return a.dequantize(dtype) if isinstance(a, QuantizedKV) else a


class KVCache(NamedTuple):
    """A model's decoding state (`model.init_cache`; see the module docstring), passed to and returned by its
    cached calls. Each layer of a token loop reads and writes its own buffer in place, with no slice of a stacked
    one.

    Attributes:
      k: tuple of L [B, K, S, H] keys (or `QuantizedKV`).
      v: tuple of L [B, K, S, H] values, likewise.
      positions: [B, S] int32 absolute position of the token in each slot.
      segments: [B, S] int32 segment (document) id of each slot; 0 = empty or padding.
      index: [] int32, the next slot to write.
      stack: the decoder laid out for the token loop (`nn.stack.DecodingLayers`: each layer's weights copied out
        of the stacked arrays once, when the cache was made; read by the model's cached call), or None.
      memory: an encoder-decoder's `Memory` with each layer's cross-attention keys/values computed once, else None.
      valid: [B, S] bool, the slot holds a real token (a property).
      layers: the keys/values as a `LayerwiseKV` (a property).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import LayerKV, LayerwiseKV, init_cache
      >>> cache = init_cache(2, batch=1, length=4, kv_heads=2, head_dim=8, dtype=jnp.float32)
      >>> new = LayerwiseKV.collect([LayerKV(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)))] * 2)   # [B, T, K, H]
      >>> cache = cache.write(new, jnp.arange(3)[None], jnp.ones((1, 3), jnp.int32))
      >>> int(cache.index), cache.valid.tolist(), cache.without_slots().k[0].shape
      (3, [[True, True, True, False]], (1, 2, 0, 8))
    """
    k: tuple              # L x [B,K,S,H] (or a QuantizedKV)
    v: tuple              # likewise
    positions: jax.Array  # [B,S] int32 absolute position of the token in each slot
    segments: jax.Array   # [B,S] int32 segment (document) id of each slot; 0 = empty or padding
    index: jax.Array      # [] int32, next slot to write
    stack: Any = None     # the decoder laid out for decoding (nn.stack.DecodingLayers)
    memory: Any = None    # Memory with kv (a LayerwiseKV) for an encoder-decoder, else None

    @property
    def valid(self) -> jax.Array:
        """[B,S] bool: the slot holds a real token."""
        return self.segments != 0

    @property
    def layers(self) -> "LayerwiseKV":
        """The per-layer keys/values as the laid-out stack reads them: tuples of L heads-major [B,K,S,H]."""
        return LayerwiseKV(self.k, self.v)

    def without_slots(self) -> "KVCache":
        """The same cache with no slots (S = 0): what a prefill into an empty cache attends over."""
        cut = lambda t: jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, 0, axis=SLOT_AXIS), t)   # noqa: E731
        return self._replace(k=cut(self.k), v=cut(self.v), positions=self.positions[:, :0],
                             segments=self.segments[:, :0])

    def write(self, new: "LayerwiseKV", positions: jax.Array, segments: jax.Array) -> "KVCache":
        """Write T new entries (new k/v per layer [B,T,K,H], float: rounded here for an int8 cache; positions
        and segments [B,T]) at slots [index, index+T), each layer's buffer in place."""
        i = self.index
        put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, axis=1)  # noqa: E731
        kv = lambda buf, new: tuple(jax.tree.map(lambda a: constrain(a, _LAYER), _put(b, n, i))   # noqa: E731
                                    for b, n in zip(buf, new))
        return self._replace(k=kv(self.k, new.k), v=kv(self.v, new.v), positions=put(self.positions, positions),
                             segments=put(self.segments, segments), index=i + positions.shape[1])

    def take(self, rows: jax.Array) -> "KVCache":
        """The cache with its batch rows reordered / repeated: rows [B'] int (e.g. beam search's surviving
        beams). The memory is not reordered (beams of one source share it)."""
        take = lambda t: tuple(jax.tree.map(lambda a: jnp.take(a, rows, axis=0), x) for x in t)  # noqa: E731
        return self._replace(k=take(self.k), v=take(self.v), positions=self.positions[rows],
                             segments=self.segments[rows])


_LAYER = (CACHE[1], CACHE[3], CACHE[2], CACHE[4])          # one layer's buffer, heads-major [B,K,S,H]


def heads_major(x):
    """Swap the slot and head axes: [B,S,K,H] <-> [B,K,S,H] (its own inverse).

    Args:
      x: a pytree of [B, S, K, H] (or [B, K, S, H]) arrays, float or `QuantizedKV`.

    Returns:
      The same pytree with axes 1 and 2 swapped: [B, K, S, H] (or [B, S, K, H]).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import heads_major
      >>> heads_major(jnp.zeros((1, 3, 2, 8))).shape
      (1, 2, 3, 8)
    """
    return jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), x)


def _put(buf, new, index):
    """A heads-major buffer [B,K,S,H] (a float array or QuantizedKV) with float new [B,T,K,H] written at slot
    `index`, in place."""
    new = heads_major(quantize_kv(new) if isinstance(buf, QuantizedKV) else new)
    put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), index, axis=SLOT_AXIS)  # noqa: E731
    return jax.tree.map(put, buf, new)


def init_cache(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype,
               stack=None, memory=None) -> KVCache:
    """An empty cache of `length` slots, no valid slot. Models call this through `model.init_cache`, which passes
    the laid-out stack (and memory) the cached call reads.

    Args:
      num_layers: number of decoder layers L.
      batch: rows B.
      length: cache slots S.
      kv_heads: kv heads K.
      head_dim: head dim H.
      dtype: a jnp dtype, or "int8": int8 values with float32 scales [B, K, S, 1] (`QuantizedKV`).
      stack: the decoder laid out for the token loop (`nn.stack.DecodingLayers`), or None.
      memory: an encoder-decoder's `Memory`, or None.

    Returns:
      `KVCache` with per layer k, v [B, K, S, H] zeros, positions and segments [B, S] zeros, index 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import init_cache
      >>> cache = init_cache(2, batch=1, length=4, kv_heads=2, head_dim=8, dtype="int8")
      >>> len(cache.k), cache.k[0].values.shape, cache.k[0].scale.shape, bool(cache.valid.any())
      (2, (1, 2, 4, 8), (1, 2, 4, 1), False)
    """
    shape = (batch, kv_heads, length, head_dim)

    def zeros():
        if isinstance(dtype, str) and dtype == "int8":
            return QuantizedKV(constrain(jnp.zeros(shape, jnp.int8), _LAYER),
                               constrain(jnp.zeros(shape[:-1] + (1,), jnp.float32), _LAYER))
        return constrain(jnp.zeros(shape, dtype), _LAYER)
    k = tuple(zeros() for _ in range(num_layers))
    v = tuple(zeros() for _ in range(num_layers))
    return KVCache(k, v, jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch, length), jnp.int32),
                   jnp.zeros((), jnp.int32), stack, memory)


class Memory(NamedTuple):
    """The encoder's output as the decoder reads it.

    Attributes:
      x: [B, S, D] the encoder output.
      valid: [B, S] bool, the source positions that are real tokens.
      segments: [B, S] int segment ids, or None (given: a target token sees only its own document's source).
      kv: each decoder layer's cross-attention keys/values (a `LayerwiseKV` of L heads-major [B, K, S, H],
        computed once for decoding by `model.init_cache(..., memory=)`), or None (computed from x in each layer).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.cache import Memory
      >>> mem = Memory(jnp.zeros((1, 3, 16)), jnp.array([[True, True, False]]))
      >>> mem.x.shape, mem.segments is None, mem.kv is None
      ((1, 3, 16), True, True)
    """
    x: jax.Array
    valid: jax.Array
    segments: jax.Array | None = None
    kv: LayerKV | None = None
