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

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.errors import ConfigError, DataError

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


def _check(model, site: str, over: str, metric) -> None:
    if over not in OVER:
        raise ConfigError(f"over={over!r} is not one of {OVER}")
    if site not in model.sites():
        raise ConfigError(f"activation site {site!r} does not exist; the model's sites: {list(model.sites())}")
    if not callable(metric):
        raise ConfigError(f"metric={metric!r} is not callable: it is a function of the logits [B,T,V] to a scalar")


def _inputs(model, clean, corrupt) -> tuple[tuple, tuple]:
    """clean, corrupt as tuples, checked before anything is traced. DataError for what the model would refuse
    from inside the program, or read silently wrong: not a tuple (a bare array would be split into its rows), a
    number of inputs the model does not take or that differs between the two, an input that is not a
    [batch, length] integer array, clean and corrupt inputs of different shapes (patching pairs every cell of
    one with the other), a token id outside the vocabulary (the embedding would read another row), an LM's
    position outside model.max_len where positions index a table (NaN). Values of concrete arrays only (a traced
    one is not looked at)."""
    arch, vocab = model.cfg.arch, model.cfg.vocab_size
    takes, arity = (("(tokens,) or (tokens, positions)", (1, 2)) if arch == "decoder_only" else
                    ("(src, tgt)", (2,)))
    for what, x in (("clean", clean), ("corrupt", corrupt)):
        if not isinstance(x, (tuple, list)):
            shape = f"an array {list(np.shape(x))}" if hasattr(x, "shape") else f"a {type(x).__name__}"
            raise DataError(f"{what} must be a tuple of the model's inputs, {takes}; got {shape}")
        if len(x) not in arity:
            raise DataError(f"{what} holds {len(x)} input(s); model.arch={arch!r} takes {takes}")
    if len(clean) != len(corrupt):
        raise DataError(f"clean holds {len(clean)} input(s) and corrupt {len(corrupt)}: patching pairs the two "
                        f"runs, so both need the same inputs")
    clean, corrupt = tuple(jnp.asarray(x) for x in clean), tuple(jnp.asarray(x) for x in corrupt)
    for i, (a, b) in enumerate(zip(clean, corrupt)):
        for what, x in (("clean", a), ("corrupt", b)):
            if x.ndim != 2 or 0 in x.shape:
                raise DataError(f"{what} input {i} is {list(x.shape)}: the model reads a [batch, length] array "
                                f"with at least one row and one token")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise DataError(f"{what} input {i} is {x.dtype} {list(x.shape)}: token ids and positions are "
                                f"integers (a cast would round them)")
        if a.shape != b.shape:
            raise DataError(f"clean input {i} is {list(a.shape)} and corrupt input {i} {list(b.shape)}: patching "
                            f"pairs every position of one run with the other's, so both need the same shapes")
    # what each input may hold: token ids, and an LM's positions where they index a table (sinusoidal, learned)
    table = model.cfg.positional in ("sinusoidal", "learned")
    ranges = [(vocab, "the vocabulary", "model.vocab_size")] * (len(clean) if arch != "decoder_only" else 1)
    if arch == "decoder_only" and len(clean) == 2 and table:
        ranges.append((model.cfg.max_len, "the position table", "model.max_len"))
    for what, xs in (("clean", clean), ("corrupt", corrupt)):
        for i, (high, within, field) in enumerate(ranges):
            if isinstance(xs[i], jax.core.Tracer) or not xs[i].is_fully_addressable:
                continue
            v = np.asarray(xs[i])
            bad = np.argwhere((v < 0) | (v >= high))
            if len(bad):
                r, c = (int(j) for j in bad[0])
                raise DataError(f"{what} input {i} {list(v.shape)}: row {r}, position {c} holds {int(v[r, c])}, "
                                f"outside {within} [0, {high}) ({field})")
    return clean, corrupt


def _batch(batch) -> None:
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1):
        raise ConfigError(f"batch={batch!r} must be None or an integer >= 1 (the cells vmapped together)")


def _scalar(value, logits: jax.Array, grad: bool = False) -> jax.Array:
    """metric(logits) as an array, checked while the program is traced (before anything runs): ConfigError for a
    value that is not a real scalar (a float one where it is differentiated)."""
    try:
        v = jnp.asarray(value)
    except (TypeError, ValueError):
        raise ConfigError(f"metric returned a {type(value).__name__}: it must return a scalar of the logits "
                          f"{list(logits.shape)}") from None
    if v.shape != ():
        raise ConfigError(f"metric returned shape {list(v.shape)} ({v.dtype}) for logits {list(logits.shape)}: it "
                          f"must return a scalar (reduce over the batch and positions, e.g. a mean)")
    if not (jnp.issubdtype(v.dtype, jnp.floating) or (not grad and jnp.issubdtype(v.dtype, jnp.integer))):
        raise ConfigError(f"metric returned {v.dtype}: " + ("attribution patching differentiates it, so it must be a "
                                                            "float scalar" if grad else "it must be a real scalar"))
    return v


def _normalized(effect: jax.Array, top: jax.Array, base: jax.Array, normalize: bool) -> jax.Array:
    """`effect`, or DataError where every cell is NaN or Inf: metric(clean) or metric(corrupt) not finite, or
    (normalize=True) the two equal (values this process holds only: not traced, not another host's)."""
    if isinstance(top, jax.core.Tracer) or not getattr(top, "is_fully_addressable", True):
        return effect
    t, b = float(top), float(base)
    if not (np.isfinite(t) and np.isfinite(b)):
        raise DataError(f"metric(clean) = {t:.6g}, metric(corrupt) = {b:.6g}: a metric that is not finite makes "
                        f"every cell NaN or Inf (the metric's own arithmetic, e.g. a log of 0?)")
    if normalize and t == b:
        raise DataError(f"metric(clean) = {t:.6g}, metric(corrupt) = {b:.6g}: normalize=True divides by their "
                        f"difference, so every cell would be NaN or Inf; pick a corruption that moves the metric "
                        f"(or pass normalize=False for the raw changes)")
    return effect


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
    taken from the clean run, every cell inside one jitted program.

    The program is compiled once per model structure, site, metric function, over, normalize and batch: call
    again with the same `metric` object and new inputs or weights, no recompilation. Each cell's value is
    (metric(patched) − metric(corrupt)) / (metric(clean) − metric(corrupt)) with normalize=True (1: that cell
    restores the clean behaviour; 0: it does nothing), else the metric's change itself.

    Args:
      model: a model of `jaxformer.nn` (decoder-only or encoder-decoder).
      clean: the model's inputs as a tuple: (tokens,) or (tokens, positions) for a decoder-only model, (src, tgt)
        for an encoder-decoder; each a [B, T] int array.
      corrupt: the corrupted inputs: as many as clean's, of the same shapes.
      site: a per-layer activation site (`model.sites()`, `jaxformer.nn.sites`), e.g. "resid_pre", "z".
      metric: logits [B, T, V] -> a scalar (e.g. the mean logit difference of the right and the wrong answer).
      over: the cells: "position" (layer, position), "head" (layer, head: every position of that head) or "both"
        (layer, position, head).
      normalize: divide each cell's change by metric(clean) − metric(corrupt).
      batch: how many cells are vmapped together (None: one at a time, the least memory).

    Returns:
      float32 [L, T] (over="position"), [L, N] (over="head") or [L, T, N] (over="both"); N is the site's own head
        axis (K for k and v).

    Raises:
      ConfigError: an unknown or model-level site; an `over` not in OVER or one the site has no axis for (heads
        of a site without them); a metric that is not callable or returns no real scalar; a batch that is not a
        positive integer.
      DataError: inputs the model does not take (not a tuple, another number of them, not [B, T] integer
        arrays), clean and corrupt inputs of other shapes, ids outside the vocabulary (or an LM's positions
        outside a position table), a metric that is not finite on clean or corrupt, and (normalize=True) a
        metric the corruption does not change (every cell 0/0).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.patching import patching_grid
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> clean, corrupt = (jnp.array([[3, 4, 5, 6]]),), (jnp.array([[7, 4, 5, 6]]),)   # position 0 differs
      >>> metric = lambda logits: logits[0, -1, 1] - logits[0, -1, 2]     # the last position's logit difference
      >>> grid = patching_grid(model, clean, corrupt, "resid_pre", metric)   # over="position": [L, T]
      >>> grid.shape
      (2, 4)
      >>> grid[0].round(2).tolist()        # layer 0's input differs at position 0 only: patching it restores all
      [1.0, 0.0, 0.0, 0.0]
      >>> patching_grid(model, clean, corrupt, "z", metric, over="head").shape                  # [L, N]
      (2, 2)
      >>> patching_grid(model, clean, corrupt, "resid_pre", metric, over="head")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: over='head': site 'resid_pre' (1, 4, 16) has no head axis ...
    """
    _check(model, site, over, metric)
    _batch(batch)
    clean, corrupt = _inputs(model, clean, corrupt)
    graphdef, state = nnx.split(model)
    grid, top, base = _grid(state, clean, corrupt, graphdef=graphdef, site=site, metric=metric, over=over,
                            normalize=normalize, batch=batch)
    return _normalized(grid, top, base, normalize)


def _grid_program(state, clean, corrupt, *, graphdef, site, metric, over, normalize, batch):
    refuse = _per_layer(site)
    m = nnx.merge(graphdef, state)
    logits, aux = m(*clean, capture=(site,))
    saved = aux["captured"][site]                                                  # [L,B,...]
    top = _scalar(metric(logits), logits)
    base = metric(m(*corrupt)[0])
    cells, shape = _cells(saved, site, over)

    def patched(cell):
        def fn(value, at):
            refuse(at)
            here = (at == cell[0]) & _selected(value, site, cell[1], cell[2])
            return jnp.where(here, saved[at].astype(value.dtype), value)
        return metric(nnx.merge(graphdef, state)(*corrupt, patch={site: fn})[0])
    effect = jax.lax.map(patched, cells, batch_size=batch) - base
    return (effect / (top - base) if normalize else effect).reshape(shape), top, base


# jitted by assignment, not decorated: a mutation tester (tools/mutation.py) mutates the body of an undecorated one
_grid = jax.jit(_grid_program, static_argnames=("graphdef", "site", "metric", "over", "normalize", "batch"))


def attribution_patching(model, clean: tuple, corrupt: tuple, site: str, metric: Callable[[jax.Array], jax.Array],
                         *, over: str = "position", normalize: bool = True) -> jax.Array:
    """Attribution patching: the linear estimate of `patching_grid` (same arguments and shape), every cell from
    one gradient: Σ_cell (clean − corrupt) · ∂metric/∂value at the corrupted run (the module docstring says where
    it fails). One jitted program of two forward passes and one backward pass, compiled once as the grid's is.

    Args:
      model: a model of `jaxformer.nn` (decoder-only or encoder-decoder).
      clean: the model's inputs as a tuple ((tokens,), (tokens, positions) or (src, tgt)), each [B, T] int.
      corrupt: the corrupted inputs: as many as clean's, of the same shapes.
      site: a per-layer activation site (`model.sites()`), e.g. "resid_pre", "z", "pattern".
      metric: logits [B, T, V] -> a float scalar, differentiated at the corrupted run.
      over: the cells: "position", "head" or "both" (as `patching_grid`).
      normalize: divide each cell's estimate by metric(clean) − metric(corrupt).

    Returns:
      float32 [L, T] (over="position"), [L, N] (over="head") or [L, T, N] (over="both"), as `patching_grid`.

    Raises:
      ConfigError: the grid's (an unknown or model-level site, an `over` the site has no axis for, a metric
        that is not callable or returns no scalar), and a metric that is not a float scalar (it is
        differentiated).
      DataError: the grid's: inputs the model does not take, clean and corrupt inputs of other shapes, ids
        outside the vocabulary, a metric not finite on clean or corrupt, and (normalize=True) a metric the
        corruption does not change.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.patching import attribution_patching
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> clean, corrupt = (jnp.array([[3, 4, 5, 6]]),), (jnp.array([[7, 4, 5, 6]]),)   # position 0 differs
      >>> metric = lambda logits: logits[0, -1, 1] - logits[0, -1, 2]
      >>> est = attribution_patching(model, clean, corrupt, "resid_pre", metric)     # [L, T]
      >>> est.shape, bool((est[0, 1:] == 0).all())        # clean − corrupt is 0 where the inputs agree
      ((2, 4), True)
      >>> attribution_patching(model, clean, corrupt, "resid_pre", lambda logits: jnp.argmax(logits[0, -1]))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: metric returned int32: attribution patching differentiates it, so it must be ...
    """
    _check(model, site, over, metric)
    clean, corrupt = _inputs(model, clean, corrupt)
    graphdef, state = nnx.split(model)
    effect, top, base = _attribution(state, clean, corrupt, graphdef=graphdef, site=site, metric=metric, over=over,
                                     normalize=normalize)
    return _normalized(effect, top, base, normalize)


def _attribution_program(state, clean, corrupt, *, graphdef, site, metric, over, normalize):
    refuse = _per_layer(site)
    logits, aux = nnx.merge(graphdef, state)(*clean, capture=(site,))
    saved, top = aux["captured"][site], _scalar(metric(logits), logits, grad=True)

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
    return (effect / (top - base) if normalize else effect), top, base


_attribution = jax.jit(_attribution_program, static_argnames=("graphdef", "site", "metric", "over", "normalize"))
