"""The weights a run evaluates, other than the ones it steps: an exponential moving average kept by the optimizer,
and schedule-free AdamW's averaged iterate.

Both live in the optimizer's state (so checkpoints, shardings and resuming carry them with no extra item):
`with_ema` wraps any optax transformation and keeps EMA ← d·EMA + (1 − d)·params after every update (the EMA
starts at the initial parameters); optax.contrib.schedule_free keeps z, from which the evaluation point is
x = (y − (1 − β1)·z) / β1 (y: the parameters the gradients are taken at, i.e. the model's).

`evaluated(cfg, graphs, state)` gives what a run reports and decodes with: {"eval": the model's weights, or
schedule-free's x; "eval_ema": the EMA, when optim.ema is set}.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


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


def load_model(workdir, which: str = "best", plan=None, quantize: str | None = None, weights: str = "trained"):
    """`jaxformer.inference.load_model` that can also read the weights kept in the optimizer state: weights=
    "trained" (schedule-free runs: their averaged iterate x) or "ema" (optim.ema runs)."""
    from jaxformer.inference.restore import load_model as load
    from jaxformer.train.step import abstract_state

    def from_optimizer(cfg, plan_):
        graphs, target = abstract_state(cfg, plan_)
        split = "eval_ema" if weights == "ema" else "eval"
        return target, lambda items: evaluated(cfg, graphs, items)[split]
    return load(workdir, which, plan, quantize, weights, from_optimizer)


def _pure(tree) -> dict:
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _with_params(graph: nnx.GraphDef, model_state: nnx.State, params: dict) -> nnx.State:
    """The model state with its parameters replaced by `params` (a pure dict mirroring nnx.Param leaves)."""
    model = nnx.merge(graph, model_state, copy=True)          # new Variables: model_state is left as it was
    ps = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(ps, jax.tree.map(lambda new, old: new.astype(old.dtype), params, nnx.to_pure_dict(ps)))
    nnx.update(model, ps)
    return nnx.state(model)


def evaluated(cfg, graphs, state: dict) -> dict[str, nnx.State]:
    """-> {"eval": model state to evaluate (schedule-free: its x), and "eval_ema": the EMA's (optim.ema > 0)}:
    what the held-out metrics of those names are computed from. state: the training state {"model", "opt"};
    graphs: `step.Graphs`."""
    opt = state["opt"]["opt_state"]
    out = {"eval": state["model"]}
    if cfg.optim.name == "schedule_free":
        b1 = opt["b1"][...]
        y = nnx.to_pure_dict(nnx.state(nnx.merge(graphs.model, state["model"]), nnx.Param))
        x = jax.tree.map(lambda yi, zi: (yi - (1.0 - b1) * zi) / b1, y, _pure(opt["z"]))
        out["eval"] = _with_params(graphs.model, state["model"], x)
    if cfg.optim.ema:
        out["eval_ema"] = _with_params(graphs.model, state["model"], _pure(opt["ema"]))
    return out
