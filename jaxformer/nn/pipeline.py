"""Pipeline parallelism (GPipe) of a layer stack over the "stage" mesh axis, in GSPMD (as MaxText's pipeline):
the stack's stacked parameters [G, ...] (G groups of its pattern of blocks, `nn.stack.LayerStack`) are split over
P stages ([P, G/P, ...], each stage's devices holding G/P groups: rule "layers" -> stage), the batch into M
micro-batches, and one scan of M+P-1 iterations runs every stage at once (vmapped over the stage axis): stage p
applies its groups to micro-batch t-p at iteration t, then the stages' outputs shift one stage forward (a roll of
the stage axis, which GSPMD turns into a collective-permute). `LayerStack.__call__` takes this path when the active
plan has parallel.stage > 1; nothing else in the model changes.

Axis legend: B batch, T length, D width, L layers (G groups of them), P stages, M micro-batches.

The micro-batches are strided (row r in micro-batch r mod M, as optim.accumulate's), so each spans every batch shard.
A batch whose rows parallel.microbatches does not divide (an evaluation's, a decode's prefill) runs in the largest
number of micro-batches ≤ parallel.microbatches that divides them. Dropout: each layer's key as unpipelined, folded
with the micro-batch's index. Limitation: blocks that return aux (MoE router statistics, captured activation sites)
are refused (ValueError): pipelined stacks return no aux.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer.axes import ACTIVATION


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle share of the (iteration, stage) slots: (P-1)/(M+P-1).

    Args:
      stages: number of pipeline stages P.
      microbatches: number of micro-batches M.

    Returns:
      The bubble fraction, a float in [0, 1).

    Examples:
      >>> from jaxformer.nn.pipeline import bubble_fraction
      >>> bubble_fraction(2, 3), bubble_fraction(1, 4)
      (0.25, 0.0)
    """
    return (stages - 1) / (microbatches + stages - 1)


def held(t, stages: int, xp=jnp):
    """The micro-batch each stage holds at iteration t: t-p for stage p; outside [0, M) the slot is a bubble.

    Args:
      t: the iteration, an int or int array (traced inside `run`; [I, 1] in `schedule`).
      stages: number of pipeline stages P.
      xp: the array module, jnp (default) or np.

    Returns:
      [P] ints t - p (broadcast against t's shape).

    Examples:
      >>> import numpy as np
      >>> from jaxformer.nn.pipeline import held
      >>> held(1, 3, xp=np).tolist()          # stage 0 on micro-batch 1, stage 1 on 0, stage 2 in a bubble
      [1, 0, -1]
    """
    return t - xp.arange(stages)


def schedule(stages: int, microbatches: int) -> np.ndarray:
    """The micro-batch that `run` has each stage work on at each iteration (-1: a bubble), from the same `held`
    the schedule runs with.

    Args:
      stages: number of pipeline stages P.
      microbatches: number of micro-batches M.

    Returns:
      [M+P-1, P] int array of micro-batch indices, -1 in a bubble.

    Examples:
      >>> from jaxformer.nn.pipeline import schedule
      >>> schedule(2, 3).tolist()             # every micro-batch visits every stage once, in order
      [[0, -1], [1, 0], [2, 1], [-1, 2]]
    """
    it = np.arange(microbatches + stages - 1)[:, None]
    m = held(it, stages, xp=np)
    return np.where((m >= 0) & (m < microbatches), m, -1)


def counted_bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of (iteration, stage) slots of `schedule` holding no micro-batch (equals `bubble_fraction`).

    Args:
      stages: number of pipeline stages P.
      microbatches: number of micro-batches M.

    Returns:
      The counted bubble fraction, a float in [0, 1).

    Examples:
      >>> from jaxformer.nn.pipeline import counted_bubble_fraction
      >>> counted_bubble_fraction(2, 3)
      0.25
    """
    return float(np.mean(schedule(stages, microbatches) < 0))


def usable_microbatches(rows: int, microbatches: int) -> int:
    """The largest number of micro-batches ≤ `microbatches` that divides `rows`.

    Args:
      rows: the batch's rows B (≥ 1).
      microbatches: the most micro-batches wanted (parallel.microbatches, ≥ 1).

    Returns:
      The number of micro-batches M to run, an int dividing `rows`.

    Raises:
      ValueError: rows or microbatches below 1.

    Examples:
      >>> from jaxformer.nn.pipeline import usable_microbatches
      >>> usable_microbatches(12, 8), usable_microbatches(7, 4)
      (6, 1)
    """
    return max(m for m in range(1, min(rows, microbatches) + 1) if rows % m == 0)


def split_rows(a: jax.Array, m: int) -> jax.Array:
    """Split a batch into strided micro-batches: row r in micro-batch r mod M.

    Args:
      a: [B, ...] array, B divisible by m.
      m: number of micro-batches M.

    Returns:
      [M, B/M, ...] the micro-batches.

    Examples:
      >>> import numpy as np
      >>> from jaxformer.nn.pipeline import split_rows
      >>> split_rows(np.arange(6), 2).tolist()
      [[0, 2, 4], [1, 3, 5]]
    """
    return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def merge_rows(a: jax.Array) -> jax.Array:
    """Join micro-batches back into a batch, the inverse of `split_rows`.

    Args:
      a: [M, B/M, ...] micro-batches.

    Returns:
      [B, ...] the batch, rows in their original order.

    Examples:
      >>> import numpy as np
      >>> from jaxformer.nn.pipeline import merge_rows, split_rows
      >>> merge_rows(split_rows(np.arange(6), 2)).tolist()
      [0, 1, 2, 3, 4, 5]
    """
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def _ctx_splitter(ctx, rows: int, m: int):
    """ctx (`nn.layers.Context`) -> (its [B, ...] leaves split [M, B/M, ...], at(i): ctx with those leaves replaced
    by micro-batch i's [B/M, ...]). Scalars, broadcast leaves (a leading 1), None and the hooks stay as they are."""
    hooks = ctx.hooks
    leaves, tree = jax.tree.flatten(ctx._replace(hooks=None))
    batched = [getattr(a, "ndim", 0) >= 1 and a.shape[0] == rows for a in leaves]
    parts = [split_rows(a, m) if b else None for a, b in zip(leaves, batched)]

    def at(i):
        new = [p[i] if b else a for a, p, b in zip(leaves, parts, batched)]
        return jax.tree.unflatten(tree, new)._replace(hooks=hooks)
    return at


def run(make_body: Callable, xs, carry, ctx, *, plan, stages: int, microbatches: int):
    """The GPipe schedule of a layer stack: equal to scanning make_body(ctx) over the G groups, run as P stages.

    Args:
      make_body: make_body(ctx) -> body(carry, (states, keys, layer)) -> (carry, aux): the stack's per-group step
        (remat as the stack's) over the layer driver's carry (`nn.stack.Block`); aux must be empty.
      xs: (states with leaves [G, ...], dropout keys [G, n] or None, layer indices [G, n]); G divisible by P.
      carry: the carry, leaves with B rows first (x [B, T, D]; passed: a dict of [B, T, ...] arrays).
      ctx: what every block reads (`nn.layers.Context`); its [B, ...] leaves are split with the rows.
      plan: the active `parallel.Plan` (its mesh has the "stage" axis).
      stages: number of pipeline stages P.
      microbatches: the most micro-batches M (`usable_microbatches` of B is used).

    Returns:
      The carry after the last group, leaves as `carry`'s ([B, T, D] ...).

    Raises:
      ValueError: a body that returns aux (MoE router statistics, captured sites).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.config import ParallelConfig
      >>> from jaxformer.nn import Context
      >>> from jaxformer.nn.pipeline import run
      >>> from jaxformer.parallel import Plan
      >>> plan = Plan(ParallelConfig(), jax.devices()[:1])          # one device: the stage axis is vmapped
      >>> make_body = lambda ctx: lambda h, xs: (h * xs[0] + xs[2][0], {})   # group g: h * w[g] + g
      >>> w, layer, x = jnp.array([2.0, 3.0, 1.0, 2.0]), jnp.arange(4)[:, None], jnp.arange(4.0).reshape(4, 1, 1)
      >>> with plan.use():
      ...     y = run(make_body, (w, None, layer), x, Context(), plan=plan, stages=2, microbatches=2)
      >>> y[:, 0, 0].tolist()                # ((((x·2 + 0)·3 + 1)·1 + 2)·2 + 3) = 12x + 9, row by row
      [9.0, 21.0, 33.0, 45.0]
    """
    p, rows = stages, jax.tree.leaves(carry)[0].shape[0]
    m = usable_microbatches(rows, microbatches)
    per_stage = jax.tree.map(lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:]), xs)   # [P, G/P, ...]
    inputs, ctx_at = jax.tree.map(lambda a: split_rows(a, m), carry), _ctx_splitter(ctx, rows, m)  # [M, B/M, ...]
    flat, tree = jax.tree.flatten(inputs)
    act = [plan.spec(ACTIVATION if i == 0 else ("batch", "length") + (None,) * (a.ndim - 3), a.shape[1:],
                     strict=False) for i, a in enumerate(flat)]        # x; what is passed on: rows and length
    on_stages = jax.tree.unflatten(tree, [NamedSharding(plan.mesh, PartitionSpec("stage", *s)) for s in act])
    gathered = jax.tree.unflatten(tree, [NamedSharding(plan.mesh, PartitionSpec(None, *s)) for s in act])

    def stage(h, stage_xs, i):
        """One stage: its G/P groups over micro-batch i. h: the carry of micro-batch i ([B/M,T,...] leaves)."""
        states, keys, layer = stage_xs
        if keys is not None:
            keys = jax.vmap(jax.vmap(jax.random.fold_in, (0, None)), (0, None))(keys, i)
        h, aux = jax.lax.scan(make_body(ctx_at(i)), h, (states, keys, layer))
        if jax.tree.leaves(aux):
            raise ValueError("parallel.stage > 1 (pipeline parallelism) cannot return the blocks' aux (MoE router "
                             "statistics, captured activation sites): run such models with parallel.stage=1")
        return h

    def step(carry, t):
        buf, out = carry                                    # buf [P, B/M, T, ...]: each stage's input
        buf = jax.tree.map(lambda b, x: b.at[0].set(jnp.where(t < m, x[jnp.minimum(t, m - 1)], b[0])), buf, inputs)
        buf = jax.lax.with_sharding_constraint(buf, on_stages)
        i = jnp.clip(held(t, p), 0, m - 1)             # the micro-batch each stage holds (clipped in bubbles)
        y = jax.vmap(stage, spmd_axis_name="stage")(buf, per_stage, i)
        y = jax.lax.with_sharding_constraint(y, on_stages)
        done = jnp.clip(t - (p - 1), 0, m - 1)             # the micro-batch the last stage finished
        out = jax.tree.map(lambda o, y: o.at[done].set(jnp.where(t >= p - 1, y[p - 1], o[done])), out, y)
        return (jax.tree.map(lambda y: jnp.roll(y, 1, axis=0), y), jax.lax.with_sharding_constraint(out, gathered)), None

    buf = jax.lax.with_sharding_constraint(jax.tree.map(lambda a: jnp.zeros((p, *a.shape[1:]), a.dtype), inputs),
                                           on_stages)
    out = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, inputs), gathered)
    (_, out), _ = jax.lax.scan(step, (buf, out), jnp.arange(m + p - 1))
    return jax.tree.map(merge_rows, out)
