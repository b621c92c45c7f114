"""The weights a run evaluates, other than the ones it steps, and the checkpoint items that hold them.

Two optimizers keep them in their state: `optim.ema` (an exponential moving average of the parameters,
`jaxformer.train.weights.with_ema`) and schedule-free AdamW (optax.contrib.schedule_free), whose evaluation point
is x = (y − (1 − β1)·z) / β1 (y: the parameters the gradients are taken at, i.e. the model's). A checkpoint
saves each such view as a model item of its own ("eval": schedule-free's x, "eval_ema": the EMA), so that
restoring them needs the model's shapes only, never the optimizer's (`load_model` reads them like "model").
Checkpoints saved before those items existed are read through `evaluated` on the optimizer state as saved.
"""
from __future__ import annotations

import jax
from flax import nnx

from jaxformer.nn.lora import trainable

def item_for(optim, weights: str) -> str:
    """The checkpoint item with the weights asked for. optim: the run's OptimConfig; weights: "trained" (what
    the run's eval/* metrics are of) | "ema" (its eval_ema/*)."""
    if weights == "ema":
        return "eval_ema"
    return "eval" if optim.name == "schedule_free" else "model"


def plain(tree) -> dict:
    """A pure dict of arrays from an nnx.State or from orbax's restore without a target (each Variable saved as
    {"value": array})."""
    if isinstance(tree, nnx.State):
        return nnx.to_pure_dict(tree)
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: plain(v) for k, v in tree.items()}
    return tree


def with_params(graph: nnx.GraphDef, model_state: nnx.State, params: dict) -> nnx.State:
    """The model state with its trained parameters replaced by `params` (a pure dict mirroring the leaves of
    `nn.lora.trainable`'s: every nnx.Param, or the adapters)."""
    model = nnx.merge(graph, model_state, copy=True)          # new Variables: model_state is left as it was
    ps = nnx.state(model, trainable(model.cfg))
    nnx.replace_by_pure_dict(ps, jax.tree.map(lambda new, old: new.astype(old.dtype), params, nnx.to_pure_dict(ps)))
    nnx.update(model, ps)
    return nnx.state(model)


def evaluated(optim, graph: nnx.GraphDef, model_state: nnx.State, opt_state) -> dict[str, nnx.State]:
    """-> {"eval": model state to evaluate (schedule-free: its x), and "eval_ema": the EMA's (optim.ema > 0)}:
    what the held-out metrics of those names are computed from. opt_state: the optimizer's state as trained
    (an nnx.State) or as restored without a target (`plain` reads both)."""
    opt = plain(opt_state)["opt_state"]
    out = {"eval": model_state}
    if optim.name == "schedule_free":
        b1 = opt["b1"]
        model = nnx.merge(graph, model_state)
        y = nnx.to_pure_dict(nnx.state(model, trainable(model.cfg)))
        x = jax.tree.map(lambda yi, zi: (yi - (1.0 - b1) * zi) / b1, y, opt["z"])
        out["eval"] = with_params(graph, model_state, x)
    if optim.ema:
        out["eval_ema"] = with_params(graph, model_state, opt["ema"])
    return out


def checkpoint_items(optim, graph: nnx.GraphDef, state: dict, views: dict | None = None) -> dict:
    """The items a training checkpoint saves: the state {"model", "opt"}, plus each evaluated view that is not
    the model itself ("eval" of a schedule-free run, "eval_ema"). views: `evaluated`'s result when already computed."""
    views = evaluated(optim, graph, state["model"], state["opt"]) if views is None else views
    return {**state, **{k: v for k, v in views.items() if k != "eval" or optim.name == "schedule_free"}}
