"""Activation patching as one compiled program, and its linear estimate from one backward pass.

A clean and a corrupted input of the same shapes; a per-layer activation site (`jaxformer.nn.sites`); a metric of
the logits (e.g. the logit difference of the right and the wrong answer). Patching one cell (a layer, and a
position and/or a head) of the corrupted run with the clean run's value measures how much of the clean behaviour
that cell carries (Meng et al. 2022; Heimersheim & Nanda 2024). Axis legend: L layers, B batch, T positions,
N heads (a site's own head axis: K for k/v), H head dim, D width.

    grid = patching_grid(model, clean, corrupt, "z", metric, over="head")         # [L,N]
    est = attribution_patching(model, clean, corrupt, "z", metric, over="head")   # [L,N], one backward pass

`over` names the cells: "position" -> [L,T], "head" -> [L,N] (every position of that head), "both" -> [L,T,N].
Both return (metric(patched) − metric(corrupt)) / (metric(clean) − metric(corrupt)) with normalize=True (1:
that cell restores the clean behaviour; 0: it does nothing), else the metric's change itself.

`patching_grid` runs every cell's patched pass inside one jitted program (`jax.lax.map` over the cells,
`batch` of them vmapped together), not a Python loop of passes. `attribution_patching` (Nanda 2023; Syed et
al. 2023) is the first-order estimate of every cell at once: (clean − corrupt) · ∂metric/∂value at the corrupted
run, summed over the cell, from one clean and one corrupted forward and one backward pass. It is exact for a
metric linear in the site and fails where the model is far from linear between the two runs: a saturated softmax
(an attention pattern near one-hot) has a near-zero gradient however much a patch would move it (AtP*'s
"attention saturation", Kramár et al. 2024). Patching a row of `attn_scores` and patching that row of `pattern`
are the same patch; estimated at `pattern`, past the softmax, the saturation is not in the way
(tests/test_patching.py shows both on a model whose q is scaled ×30).

Where the axes are: a site whose name ends in "pattern" or "attn_scores" is [B,N,T,S] (heads on axis 1, query
positions on axis 2); every other per-layer site is [B,T,...] (positions on axis 1) and, when it has four axes
([B,T,N,H]: q, k, v, z), heads on axis 2.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.errors import ConfigError

OVER = ("position", "head", "both")


def _axes(site: str, value: jax.Array, over: str) -> tuple[int, int | None]:
    """(position axis, head axis or None) of one layer's value of `site` ([B,...], no L axis); ConfigError when
    `over` asks for heads the site does not have."""
    if site.endswith("pattern") or site.endswith("attn_scores"):
        return 2, 1
    if over != "position" and value.ndim != 4:
        raise ConfigError(f"over={over!r}: site {site!r} {tuple(value.shape)} has no head axis (head-wise sites: "
                          f"q, k, v, z, pattern, attn_scores and their cross_ / encoder. kin)")
    return 1, (2 if value.ndim == 4 else None)


def _check(model, site: str, over: str) -> None:
    if over not in OVER:
        raise ConfigError(f"over={over!r} is not one of {OVER}")
    if site not in model.sites():
        raise ConfigError(f"activation site {site!r} does not exist; the model's sites: {list(model.sites())}")


def _cells(saved: jax.Array, site: str, over: str) -> tuple[jax.Array, tuple[int, ...]]:
    """Every cell as an int32 row (layer, position, head), -1 where the cell spans that axis, and the grid's
    shape. saved: the site's values [L,B,...]."""
    position, head = _axes(site, saved[0], over)
    lengths = (saved.shape[0], saved.shape[1 + position] if over != "head" else 0,
               saved.shape[1 + head] if over != "position" else 0)
    axes = [jnp.arange(n) if n else jnp.array([-1]) for n in lengths]
    grid = jnp.stack(jnp.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    return grid.astype(jnp.int32), tuple(n for n in lengths if n)


def _selected(value: jax.Array, site: str, position, head) -> jax.Array:
    """A bool mask broadcastable to one layer's value [B,...]: the cell's position and head (-1: all)."""
    pos_axis, head_axis = _axes(site, value, "position")
    shape = [1] * value.ndim

    def along(axis, index):
        s = list(shape)
        s[axis] = value.shape[axis]
        return ((jnp.arange(value.shape[axis]) == index) | (index < 0)).reshape(s)
    sel = along(pos_axis, position)
    return sel if head_axis is None else sel & along(head_axis, head)


def _per_layer(site: str) -> Callable:
    def refuse(at):
        if at is None:
            raise ConfigError(f"activation site {site!r} is model-level (one value, not one per layer): patching "
                              f"grids take a per-layer site")
    return refuse


def patching_grid(model, clean: tuple, corrupt: tuple, site: str, metric: Callable[[jax.Array], jax.Array], *,
                  over: str = "position", normalize: bool = True, batch: int | None = None) -> jax.Array:
    """Activation patching of every cell of a per-layer `site`: the corrupted inputs run with one cell's value
    taken from the clean run, every cell inside one jitted program (compiled once per model structure, site,
    metric function, over, normalize and batch: call again with the same `metric` object and new inputs or
    weights, no recompilation). clean, corrupt: the model's inputs ((tokens,) or (src, tgt), same shapes);
    metric: logits [B,T,V] -> a scalar; over: "position" [L,T] | "head" [L,N] | "both" [L,T,N]; batch: cells
    vmapped together (None: one at a time, the least memory). ConfigError for an unknown or model-level site, an
    `over` the site has no axis for."""
    _check(model, site, over)
    graphdef, state = nnx.split(model)
    return _grid(state, tuple(clean), tuple(corrupt), graphdef=graphdef, site=site, metric=metric, over=over,
                 normalize=normalize, batch=batch)


@functools.partial(jax.jit, static_argnames=("graphdef", "site", "metric", "over", "normalize", "batch"))
def _grid(state, clean, corrupt, *, graphdef, site, metric, over, normalize, batch):
    refuse = _per_layer(site)
    m = nnx.merge(graphdef, state)
    logits, aux = m(*clean, capture=(site,))
    saved = aux["captured"][site]                                                  # [L,B,...]
    base, top = metric(m(*corrupt)[0]), metric(logits)
    cells, shape = _cells(saved, site, over)

    def patched(cell):
        def fn(value, at):
            refuse(at)
            here = (at == cell[0]) & _selected(value, site, cell[1], cell[2])
            return jnp.where(here, saved[at].astype(value.dtype), value)
        return metric(nnx.merge(graphdef, state)(*corrupt, patch={site: fn})[0])
    effect = jax.lax.map(patched, cells, batch_size=batch) - base
    return (effect / (top - base) if normalize else effect).reshape(shape)


def attribution_patching(model, clean: tuple, corrupt: tuple, site: str, metric: Callable[[jax.Array], jax.Array],
                         *, over: str = "position", normalize: bool = True) -> jax.Array:
    """Attribution patching: the linear estimate of `patching_grid` (same arguments and shape), every cell from
    one gradient: Σ_cell (clean − corrupt) · ∂metric/∂value at the corrupted run (the module docstring says where
    it fails). One jitted program of two forward passes and one backward pass, compiled once as the grid's is."""
    _check(model, site, over)
    graphdef, state = nnx.split(model)
    return _attribution(state, tuple(clean), tuple(corrupt), graphdef=graphdef, site=site, metric=metric,
                        over=over, normalize=normalize)


@functools.partial(jax.jit, static_argnames=("graphdef", "site", "metric", "over", "normalize"))
def _attribution(state, clean, corrupt, *, graphdef, site, metric, over, normalize):
    refuse = _per_layer(site)
    logits, aux = nnx.merge(graphdef, state)(*clean, capture=(site,))
    saved, top = aux["captured"][site], metric(logits)

    def corrupted(delta):
        def fn(value, at):
            refuse(at)
            return value + delta[at].astype(value.dtype)
        out, aux = nnx.merge(graphdef, state)(*corrupt, patch={site: fn}, capture=(site,))
        return metric(out), aux["captured"][site]
    (base, was), grad = jax.value_and_grad(corrupted, has_aux=True)(jnp.zeros(saved.shape, jnp.float32))
    contrib = (saved.astype(jnp.float32) - was.astype(jnp.float32)) * grad               # [L,B,...]
    pos_axis, head_axis = _axes(site, saved[0], over)
    keep = {"position": (pos_axis,), "head": (head_axis,), "both": (pos_axis, head_axis)}[over]
    effect = jnp.sum(contrib, axis=tuple(a for a in range(1, saved.ndim) if a - 1 not in keep))
    if over == "both" and head_axis < pos_axis:
        effect = jnp.swapaxes(effect, 1, 2)                                            # [L,T,N]
    return effect / (top - base) if normalize else effect
