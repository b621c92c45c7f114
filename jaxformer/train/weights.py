"""An exponential moving average of the weights, kept by the optimizer: `with_ema` wraps any optax transformation
and keeps EMA ← d·EMA + (1 − d)·params after every update (the EMA starts at the initial parameters). It lives
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
