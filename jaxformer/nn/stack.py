"""A stack of L blocks whose parameters are stacked on a leading "layers" axis and applied with jax.lax.scan:
one compiled body whatever L is (training, evaluation, prefill).

Cached calls run on the stack laid out for a token loop (`lay_out` -> a `DecodingLayers` value, made once by
`model.init_cache` and kept in the cache; the stack is unchanged): each layer's parameters copied out once, with
the decoding-layout arrays its levers ask for, the L blocks applied one after another with a per-layer KV cache
(`nn.cache.KVCache`). Scanned, each decoded token would slice every layer's weights and cache out of the stacked
arrays again (benchmarks/decode_profile.py profiles the laid-out loop; results/decode_profile.md).

A stack may repeat a pattern of n block kinds (e.g. n-1 dense blocks then one Mixture-of-Experts block): each
kind is stacked separately over its L/n layers and one scan step applies one group of n blocks in order.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.axes import ACTIVATION
from jaxformer.nn.cache import LayerKV, LayerwiseKV
from jaxformer.nn.layout import laid_out
from jaxformer.nn.params import lever
from jaxformer import parallel
from jaxformer.nn import pipeline
from jaxformer.parallel import constrain

REMAT = {"none": None, "full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
         "dots_attention": jax.checkpoint_policies.save_from_both_policies(
             jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
             jax.checkpoint_policies.save_only_these_names("attention_out"))}

Make = Callable[[nnx.Rngs], nnx.Module]


class BlockOut(NamedTuple):
    """What a block, a layer stack and an encoder/decoder return.

    Attributes:
      x: [B, T, D] output activations.
      aux: a dict that may be empty ("moe", "captured"; for a stack, each key's leaves stacked over the layers
        that returned it).
      kv: the new keys/values of a cached call (a LayerKV [B, T, K, H] from a block; from a laid-out stack, a
        LayerwiseKV of L of them), else None.
      passed: what a block passes on to the next layer besides x (`Block.passes`; None: what it was given).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.stack import BlockOut
      >>> out = BlockOut(jnp.zeros((1, 3, 16)), {})
      >>> out.x.shape, out.aux, out.kv, out.passed
      ((1, 3, 16), {}, None, None)
    """
    x: jax.Array
    aux: dict
    kv: LayerKV | None = None
    passed: dict | None = None


class Block(nnx.Module):
    """A layer of a stack, as the layer driver (`drive`) calls it: block(x [B,T,D], ctx, layer=, passed=, ...) ->
    BlockOut. Between layers the driver carries x and `passed`, a dict of arrays [B,T,...] a block kind declares
    (`passes`: their values before the first layer) and each block may replace (ResFormer's first-layer values,
    say); the scan, the token loop and the pipeline stages carry it alike.

    Attributes:
      passes: the method giving what this kind passes on before the first layer ({}: nothing, by default).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn import EncoderBlock
      >>> from jaxformer.nn.stack import Block
      >>> issubclass(EncoderBlock, Block), Block().passes(jnp.zeros((1, 3, 16)))
      (True, {})
    """

    def passes(self, x: jax.Array) -> dict:
        """What this kind of block passes on besides the residual stream x [B,T,D], as it is before the first
        layer: {} (nothing) unless a block kind says otherwise."""
        return {}


def drive(block, x: jax.Array, passed: dict, ctx, **kw) -> tuple[jax.Array, dict, BlockOut]:
    """The layer driver: one block applied to the carry. What the scan, the token loop and the pipeline stages
    each run per layer.

    Args:
      block: a `Block`.
      x: [B, T, D] the residual stream at the block boundary (sharded by the active plan's rules).
      passed: what the previous layer passed on (`Block.passes`).
      ctx: what every block reads (`nn.layers.Context`).
      **kw: the block's other keywords (layer=, rngs=, cache=, ...).

    Returns:
      (x [B, T, D], passed for the next layer, the block's BlockOut).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, EncoderBlock
      >>> from jaxformer.nn.stack import drive
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> block = EncoderBlock(cfg, rngs=nnx.Rngs(0))
      >>> x, passed, out = drive(block, jnp.ones((1, 3, 16)), {}, Context(positions=jnp.arange(3)[None]), layer=0)
      >>> x.shape, passed, out.aux
      ((1, 3, 16), {}, {})
    """
    out = block(constrain(x, ACTIVATION), ctx, passed=passed, **kw)
    return out.x, passed if out.passed is None else out.passed, out


def blocks_path(stack: str = "decoder") -> tuple[str, str, str]:
    """Where a model's state keeps the blocks of its `stack`, parameters [L, ...]: the model's stack module, its
    `layers` (a LayerStack), their `blocks`. The one spelling of that path (HF mapping, per-layer gradient norms,
    diagnostics read it).

    Args:
      stack: "encoder" or "decoder".

    Returns:
      The path as a tuple of three attribute names.

    Examples:
      >>> from jaxformer.nn.stack import blocks_path
      >>> blocks_path(), blocks_path("encoder")
      (('decoder', 'layers', 'blocks'), ('encoder', 'layers', 'blocks'))
    """
    return (stack, "layers", "blocks")


class LayerStack(nnx.Module):
    """L blocks with stacked parameters, applied with jax.lax.scan: `make(rngs) -> block` is called once under
    nnx.vmap, giving parameters [L, ...]. With a sequence of n makers, layer i is made by make[i % n] (L a
    multiple of n). Lever `unrolled_layers` (`jaxformer.platforms`) unrolls the scan.

    Attributes:
      blocks: the stacked blocks, parameters [L, ...]; with n makers an nnx.List, kind j's parameters [L/n, ...].
      num_layers: L.
      pattern: n, the number of block kinds.
      remat: what each block (each group of n blocks) keeps for the backward pass (`jax.checkpoint` around the
        scanned body): "none" everything; "full" only its input; "dots" its input and the outputs of matmuls
        without batch dimensions (projections, FFN), recomputing the rest (attention, norms, activations);
        "dots_attention" those and each attention's output (named "attention_out").

    Raises:
      ValueError: num_layers is not a multiple of the pattern's length, or remat is not a name of `REMAT`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import Context, EncoderBlock, LayerStack
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> stack = LayerStack(lambda r: EncoderBlock(cfg, rngs=r), 2, rngs=nnx.Rngs(0))
      >>> out = stack(jnp.ones((1, 3, 16)), Context(positions=jnp.arange(3)[None]))
      >>> stack.blocks.ffn.w1.shape, out.x.shape, out.aux
      ((2, 16, 32), (1, 3, 16), {})
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

    def lay_out(self, batch: int | None = None) -> "DecodingLayers":
        """The stack laid out for a token loop over `batch` rows (None: not known), as a new value (this stack
        is unchanged): the L blocks, each with its own copy of its parameters in the decoding layout
        (`nn.layout.laid_out`: weight kinds with their own matmul, e.g. a self-attention's q/k/v as one
        matrix). `model.init_cache` makes it, inside a compiled decoding program, before its loop."""
        return DecodingLayers([laid_out(self.layer(i), batch) for i in range(self.num_layers)])

    def _kinds(self) -> list[nnx.Module]:
        return [self.blocks] if self.pattern == 1 else list(self.blocks)

    def __call__(self, x: jax.Array, ctx, *, rngs: nnx.Rngs | None = None) -> BlockOut:
        """Apply the L blocks in order: block(x, ctx, layer=i, rngs=) -> BlockOut. x [B,T,D] -> BlockOut(x
        [B,T,D], aux, None).

        ctx: what every block reads (`nn.layers.Context`). layer: each block's index (int32, scanned), from which
        it computes what varies with depth (`nn.per_layer`). Under a plan with parallel.stage > 1 the groups run
        in a GPipe schedule over the stages (`nn.pipeline`; no aux there), unless ctx.hooks captures sites.
        aux: each key's leaves stacked on a leading axis over the layers that returned it, in layer order (L for
        all layers). rngs: a dropout stream (training); each layer gets its own key. (Cached calls run the
        laid-out stack, `lay_out`.)
        """
        n, groups = self.pattern, self.num_layers // self.pattern
        graphdefs, states = zip(*(nnx.split(k) for k in self._kinds()))
        keys = None
        if rngs is not None:
            keys = jax.random.split(rngs.dropout(), self.num_layers)
            keys = keys.reshape(groups, n, *keys.shape[1:])
        index = jnp.arange(self.num_layers, dtype=jnp.int32).reshape(groups, n)     # every block's index

        def make_body(ctx):
            def body(carry, xs):
                (h, passed), (layer_states, key, layer) = carry, xs
                outs = []
                for j in range(n):
                    block = nnx.merge(graphdefs[j], layer_states[j])
                    r = nnx.Rngs(dropout=key[j]) if key is not None else None
                    h, passed, out = drive(block, h, passed, ctx, layer=layer[j], rngs=r)
                    outs.append(out.aux)
                return (h, passed), tuple(outs)
            if self.remat != "none":
                body = jax.checkpoint(body, policy=REMAT[self.remat], prevent_cse=False)
            return body

        plan, hooks = parallel.active_plan(), ctx.hooks
        carry = (x, self._kinds()[0].passes(x))
        if plan is not None and plan.sizes["stage"] > 1 and not (hooks is not None and hooks.capture):
            # pipeline parallelism over the stages (a pass capturing activation sites runs the plain scan)
            x, passed = pipeline.run(make_body, (tuple(states), keys, index), carry, ctx, plan=plan,
                                     stages=plan.sizes["stage"], microbatches=plan.cfg.microbatches)
            return BlockOut(constrain(x, ACTIVATION), {}, passed=passed)
        (x, passed), auxes = jax.lax.scan(make_body(ctx), carry, (tuple(states), keys, index),
                                          unroll=lever("unrolled_layers"))
        return BlockOut(constrain(x, ACTIVATION), _interleave(_every_layers_sites(auxes, ctx.hooks)), passed=passed)

    def layer(self, i: int) -> nnx.Module:
        """Block i as a standalone module (a copy of its parameters), for inspection and tests."""
        graphdef, state = nnx.split(self._kinds()[i % self.pattern])
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i // self.pattern], state))


class DecodingLayers(nnx.Module):
    """A decoder stack laid out for a token loop (`LayerStack.lay_out`; kept in the cache `model.init_cache`
    makes). Called with the cache's per-layer keys/values, it applies the blocks one after another, unrolled,
    reading each layer's buffer without a copy. Inference only: a call with a dropout stream (training) raises
    ValueError, since gradients would reach the copies, not the stacked parameters.

    Attributes:
      blocks: the L blocks (an nnx.List), each with its own copy of its parameters in the decoding layout.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import DecoderBlock, LayerStack
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, d_ff=32)
      >>> stack = LayerStack(lambda r: DecoderBlock(cfg, cross=False, rngs=r), 2, rngs=nnx.Rngs(0))
      >>> laid = stack.lay_out(batch=1)
      >>> type(laid).__name__, len(laid.blocks), laid.blocks[1].ffn.w1.shape
      ('DecodingLayers', 2, (16, 32))
    """

    def __init__(self, blocks: list):
        self.blocks = nnx.List(blocks)

    def __call__(self, x: jax.Array, ctx, *, cache: LayerwiseKV, memory_kv: LayerwiseKV | None = None,
                 rngs: nnx.Rngs | None = None) -> BlockOut:
        """x [B,T,D] -> BlockOut(x [B,T,D], aux stacked over layers, kv: a LayerwiseKV of every layer's new
        keys/values [B,T,K,H]). Block i is told layer=i (as in the scan) with its slice of cache and memory_kv
        (L heads-major [B,K,S,H]: the cached keys/values; an encoder-decoder's cross-attention keys/values)."""
        if rngs is not None:
            raise ValueError("a cached call runs on a copy of the weights laid out for decoding, so it cannot "
                             "train (no dropout stream); train with the uncached call")
        per_layer = {"cache": cache, "memory_kv": memory_kv}
        auxes, kvs, passed = [], [], self.blocks[0].passes(x)
        for i, block in enumerate(self.blocks):
            extra = {name: v.layer(i) for name, v in per_layer.items() if v is not None}   # heads-major [B,K,S,H]
            extra["layer"] = jnp.asarray(i, jnp.int32)                 # every block's index, as in the scan
            x, passed, out = drive(block, x, passed, ctx, **extra)
            auxes.append(out.aux)
            kvs.append(out.kv)
        aux = {name: jax.tree.map(lambda *a: jnp.stack(a), *[a[name] for a in auxes if name in a])
               for name in dict.fromkeys(k for a in auxes for k in a)}
        return BlockOut(constrain(x, ACTIVATION), aux, LayerwiseKV.collect(kvs), passed)


def _every_layers_sites(auxes: tuple[dict, ...], hooks) -> tuple[dict, ...]:
    """The kinds' aux with only the captured sites every kind of block has: a site some layers do not compute
    (a dense FFN's mlp_hidden beside MoE layers) is no site of the stack, so a model's `sites()`, which
    captures everything (`nn.sites.discover`), does not list it."""
    names = [set(a.get("captured", {})) for a in auxes]
    partial = set().union(*names) - set.intersection(*names)
    if not partial:
        return auxes
    for name in partial if hooks.reached is not None else ():
        hooks.reached.pop(name, None)
    return tuple({**a, "captured": {k: v for k, v in a["captured"].items() if k not in partial}}
                 if "captured" in a else a for a in auxes)


def _interleave(ys: tuple[dict, ...]) -> dict:
    """Per-kind dicts with leaves [L/n, ...] -> one dict: each key's leaves [(L/n)·m, ...] in layer order, over
    the m kinds that produced it."""
    out = {}
    for name in dict.fromkeys(k for y in ys for k in y):
        parts = [y[name] for y in ys if name in y]
        out[name] = parts[0] if len(parts) == 1 else jax.tree.map(
            lambda *a: jnp.stack(a, 1).reshape(-1, *a[0].shape[1:]), *parts)
    return out
