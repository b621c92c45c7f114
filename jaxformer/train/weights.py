"""Weights kept by the optimizer. `with_ema` wraps any optax transformation and keeps an exponential moving average
of the weights, EMA ← d·EMA + (1 − d)·params after every update (the EMA starts at the initial parameters).
`with_master_weights` keeps a float32 master copy of low-precision parameters (model.runtime.param_dtype) and
runs the optimizer on it. It lives
in the optimizer's state, so shardings and resuming carry it; what a run evaluates from it (and from
schedule-free AdamW's z) and how checkpoints hold that is `jaxformer.inference.weights`."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class EmaState(NamedTuple):
    inner: optax.OptState
    ema: optax.Params


def with_ema(inner: optax.GradientTransformation, decay: float) -> optax.GradientTransformation:
    """`inner`, plus an exponential moving average of the parameters after each of its updates (decay d in
    [0, 1): EMA ← d·EMA + (1 − d)·params; it starts at the initial parameters, in float32)."""
    def init(params):
        return EmaState(inner.init(params), jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner, params)
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p.astype(jnp.float32), state.ema, new)
        return updates, EmaState(inner_state, ema)
    return optax.GradientTransformation(init, update)


class MasterState(NamedTuple):
    master: optax.Params          # the float32 parameters the optimizer updates
    inner: optax.OptState


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on a float32 master copy of the parameters, for a model whose parameters are stored in a lower
    precision (model.runtime.param_dtype='bfloat16'): the gradients (in the parameters' dtype) are cast to float32,
    `inner` updates the master copy, and the update returned is master − params in float32, so that
    `optax.apply_updates` (params + update, then cast to the parameters' dtype) makes the parameters the master
    copy rounded once. Without it, a bfloat16 parameter would lose every update smaller than half its spacing
    (2⁻⁸ relative). The master copy starts at the initial parameters."""
    def init(params):
        master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
        return MasterState(master, inner.init(master))

    def update(updates, state, params=None):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        steps, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, steps)
        return (jax.tree.map(lambda m, p: m - p.astype(jnp.float32), master, params),
                MasterState(master, inner_state))
    return optax.GradientTransformation(init, update)
