"""A stack of L identical blocks whose parameters are stacked on a leading "layers" axis and applied with
jax.lax.scan: one compiled block body whatever L is (the cached decoder scans the stacked cache alongside).
"""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from jaxformer.parallel import constrain

ACTIVATION = ("batch", "length", "act_embed")     # the residual stream [B,T,D] between blocks
REMAT = {"none": None, "full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class LayerStack(nnx.Module):
    """`make(rngs) -> block` is called once under nnx.vmap, giving parameters [L, ...].

    remat: what each block keeps for the backward pass (`jax.checkpoint` around the scanned block):
    "none" everything; "full" only its input (all of it is recomputed); "dots" its input and the outputs of
    matmuls without batch dimensions (projections, FFN), recomputing the rest (attention, norms, activations).
    """

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *, remat: str = "none",
                 rngs: nnx.Rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(r: nnx.Rngs):
            return make(r)

        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT)}")
        self.num_layers = num_layers
        self.remat = remat
        self.blocks = create(rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None, per_layer=None, **kwargs):
        """Apply the L blocks in order. x [B,T,D] -> [B,T,D].

        per_layer: optional dict of keyword arguments whose leaves have a leading axis L (e.g. the KV cache), sliced
        per layer and passed to block i; then blocks return (x, y) and this returns (x, ys stacked over L).
        kwargs are passed to every block unchanged. Whenever the blocks return (x, y) (per_layer, or a kwarg such
        as return_weights=True), this returns (x, ys) with every leaf of y stacked on a leading axis L.
        rngs: a dropout stream (training); each layer gets its own key.
        """
        graphdef, state = nnx.split(self.blocks)
        keys = jax.random.split(rngs.dropout(), self.num_layers) if rngs is not None else None

        def body(h, xs):
            h = constrain(h, ACTIVATION)                   # block boundary: sharded by the active plan's rules
            layer_state, key, extra = xs
            block = nnx.merge(graphdef, layer_state)
            r = nnx.Rngs(dropout=key) if key is not None else None
            out = block(h, rngs=r, **(extra or {}), **kwargs)
            return out if isinstance(out, tuple) else (out, None)

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT[self.remat], prevent_cse=False)
        x, ys = jax.lax.scan(body, x, (state, keys, per_layer))
        x = constrain(x, ACTIVATION)
        return x if ys is None else (x, ys)

    def map(self, fn):
        """Stacked results of fn(block) over the L blocks (e.g. each layer's cross-attention k/v)."""
        graphdef, state = nnx.split(self.blocks)
        return jax.lax.map(lambda st: fn(nnx.merge(graphdef, st)), state)

    def layer(self, i: int) -> nnx.Module:
        """Block i as a standalone module (a copy of its parameters), for inspection and tests."""
        graphdef, state = nnx.split(self.blocks)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
