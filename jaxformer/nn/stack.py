"""A stack of L blocks whose parameters are stacked on a leading "layers" axis and applied with jax.lax.scan:
one compiled body whatever L is (training, evaluation, prefill).

A decoding program lays the stack out for its token loop first (`unstack`): each layer's parameters copied out
once, the loop's body applying the L blocks one after another with a per-layer KV cache (`KVCache.unstacked`).
Scanned, each decoded token would slice every layer's weights and cache out of the stacked arrays again: at
base size, batch 1, context 64, those slices took 6.0 ms of op time per token against 2.5 ms of matmuls
(benchmarks/decode_profile.py profiles the laid-out loop).

A stack may repeat a pattern of n block kinds (e.g. n-1 dense blocks then one Mixture-of-Experts block): each
kind is stacked separately over its L/n layers and one scan step applies one group of n blocks in order.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.axes import ACTIVATION
from jaxformer.nn.cache import LayerKV, layer_kv
from jaxformer.parallel import constrain

REMAT = {"none": None, "full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

Make = Callable[[nnx.Rngs], nnx.Module]


def blocks_path(stack: str = "decoder") -> tuple[str, str, str]:
    """Where a model's state keeps the blocks of its `stack` ("encoder" | "decoder"), parameters [L, ...]: the
    model's stack module, its `layers` (a LayerStack), their `blocks`. The one spelling of that path (HF
    mapping, per-layer gradient norms, diagnostics read it)."""
    return (stack, "layers", "blocks")


class LayerStack(nnx.Module):
    """`make(rngs) -> block` is called once under nnx.vmap, giving parameters [L, ...] (in `self.blocks`).
    With a sequence of n makers, layer i is made by make[i % n] (L a multiple of n); kind j's parameters are
    [L/n, ...], in `self.blocks[j]`.

    remat: what each block (each group of n blocks) keeps for the backward pass (`jax.checkpoint` around the
    scanned body): "none" everything; "full" only its input (all of it is recomputed); "dots" its input and the
    outputs of matmuls without batch dimensions (projections, FFN), recomputing the rest (attention, norms,
    activations).
    """

    def __init__(self, make: Make | Sequence[Make], num_layers: int, *, remat: str = "none", rngs: nnx.Rngs):
        makes = [make] if callable(make) else list(make)
        if not makes or num_layers % len(makes):
            raise ValueError(f"{num_layers} layers cannot repeat a pattern of {len(makes)} block kinds")
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT)}")
        groups = num_layers // len(makes)

        def stacked(mk: Make):
            @nnx.split_rngs(splits=groups)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(r: nnx.Rngs):
                return mk(r)
            return create(rngs)

        self.num_layers = num_layers
        self.remat = remat
        self.pattern = len(makes)
        self.blocks = stacked(makes[0]) if len(makes) == 1 else nnx.List([stacked(m) for m in makes])
        self.unstacked = nnx.data(None)

    def unstack(self, batch: int | None = None) -> None:
        """Lay the stack out for a token loop: `self.unstacked` = the L blocks, each with its own copy of its
        parameters (the stacked ones stay), each of their modules then laid out by its own
        `lay_out_for_decoding(batch)` where it has one (a self-attention's q/k/v weights as one matrix; with
        batch=1, the loop's rows, an FFN's output weight in [out,in] order; batch None: not known). Called inside
        a compiled decoding program, before its loop, on the model merged there; from then on a call applies the
        blocks one by one (unrolled), reading per-layer inputs laid out per layer (`KVCache.unstacked`) without a
        copy. Inference only: a call with a dropout stream (training) raises, since gradients would reach the
        copies, not the stacked parameters."""
        if self.unstacked is None:
            blocks = [self.layer(i) for i in range(self.num_layers)]
            mods = [m for b in blocks for _, m in nnx.iter_graph(b) if hasattr(m, "lay_out_for_decoding")]
            for m in mods:                                         # listed first: laying out adds attributes
                m.lay_out_for_decoding(batch)
            self.unstacked = nnx.data(nnx.List(blocks))

    def _kinds(self) -> list[nnx.Module]:
        return [self.blocks] if self.pattern == 1 else list(self.blocks)

    def __call__(self, x: jax.Array, ctx, *, cache: LayerKV | None = None, memory_kv: LayerKV | None = None,
                 window: jax.Array | None = None, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Apply the L blocks in order: block(x, ctx, ...) -> (x, aux). x [B,T,D] -> (x [B,T,D], aux).

        ctx: what every block reads (`nn.layers.Context`). cache, memory_kv, window: per-layer inputs, leaves with
        a leading axis L (the decoder's cached keys/values; the cross-attention keys/values of the memory; each
        layer's sliding window, int [L]), sliced per layer and passed to block i under the same names.
        aux: each key's leaves stacked on a leading axis over the layers that returned it, in layer order (L for
        all layers). rngs: a dropout stream (training); each layer gets its own key.
        """
        if self.unstacked is not None:
            if rngs is not None:
                raise ValueError("this layer stack is laid out for decoding (for_decoding): its per-layer weights "
                                 "are copies, so it cannot train; train the model as built or restored")
            return self._unrolled(x, ctx, {"cache": cache, "memory_kv": memory_kv, "window": window})
        n, groups = self.pattern, self.num_layers // self.pattern
        graphdefs, states = zip(*(nnx.split(k) for k in self._kinds()))
        keys = None
        if rngs is not None:
            keys = jax.random.split(rngs.dropout(), self.num_layers)
            keys = keys.reshape(groups, n, *keys.shape[1:])
        per_layer = {k: v for k, v in (("cache", cache), ("memory_kv", memory_kv), ("window", window))
                     if v is not None}
        per_layer = jax.tree.map(lambda a: a.reshape(groups, n, *a.shape[1:]), per_layer)

        def body(h, xs):
            layer_states, key, extra = xs
            auxes = []
            for j in range(n):
                h = constrain(h, ACTIVATION)               # block boundary: sharded by the active plan's rules
                block = nnx.merge(graphdefs[j], layer_states[j])
                r = nnx.Rngs(dropout=key[j]) if key is not None else None
                h, aux = block(h, ctx, rngs=r, **jax.tree.map(lambda a: a[j], extra))
                auxes.append(aux)
            return h, tuple(auxes)

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT[self.remat], prevent_cse=False)
        x, auxes = jax.lax.scan(body, x, (tuple(states), keys, per_layer))
        x = constrain(x, ACTIVATION)
        return x, _interleave(auxes)

    def _unrolled(self, x, ctx, per_layer: dict) -> tuple[jax.Array, dict]:
        """The L blocks of `self.unstacked` one after another; per-layer inputs are laid out per layer (read as
        they are) or stacked [L,...] (sliced). aux as __call__'s, but "kv" (keys/values for a per-layer cache)
        as a LayerKV of lists of L."""
        auxes = []
        for i, block in enumerate(self.unstacked):
            extra = {name: _layer(v, i) for name, v in per_layer.items() if v is not None}
            x = constrain(x, ACTIVATION)
            x, aux = block(x, ctx, **extra)
            auxes.append(aux)
        out = {}
        for name in dict.fromkeys(k for a in auxes for k in a):
            parts = [a[name] for a in auxes if name in a]
            out[name] = (LayerKV([p.k for p in parts], [p.v for p in parts]) if name == "kv"    # per layer, as
                         else jax.tree.map(lambda *a: jnp.stack(a), *parts))             # the cache it goes to
        return constrain(x, ACTIVATION), out

    def map(self, fn):
        """Stacked results of fn(block) over the L blocks, in layer order (e.g. each layer's cross k/v)."""
        outs = []
        for kind in self._kinds():
            graphdef, state = nnx.split(kind)
            outs.append({"out": jax.lax.map(lambda st: fn(nnx.merge(graphdef, st)), state)})
        return _interleave(tuple(outs))["out"]

    def layer(self, i: int) -> nnx.Module:
        """Block i as a standalone module (a copy of its parameters), for inspection and tests."""
        graphdef, state = nnx.split(self._kinds()[i % self.pattern])
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i // self.pattern], state))


def _layer(x, i: int):
    """Layer i of a per-layer input: a LayerKV of lists of L (`KVCache.unstacked`) or a stacked pytree [L,...]."""
    if isinstance(x, LayerKV) and isinstance(x.k, list):
        return layer_kv(x, i)
    return jax.tree.map(lambda a: a[i], x)


def _interleave(ys: tuple[dict, ...]) -> dict:
    """Per-kind dicts with leaves [L/n, ...] -> one dict: each key's leaves [(L/n)·m, ...] in layer order, over
    the m kinds that produced it."""
    out = {}
    for name in dict.fromkeys(k for y in ys for k in y):
        parts = [y[name] for y in ys if name in y]
        out[name] = parts[0] if len(parts) == 1 else jax.tree.map(
            lambda *a: jnp.stack(a, 1).reshape(-1, *a[0].shape[1:]), *parts)
    return out
