"""The loss, the training state, and the pure jitted train/eval steps over it (the optimizer: `train.optim`).

The training state is a dict {"model": State, "opt": State} of the model's and the optimizer's nnx.split
states (one checkpoint item each, so a model restores without its optimizer); `Graphs` holds their graphdefs.
Batches are the architecture's (`jaxformer.arch`: seq2seq {"src", "tgt_in", "tgt_out"}; LM {"inputs", "targets"}).

Under a `jaxformer.parallel.Plan` the state is created sharded (a jitted init with the plan's out-shardings:
no device ever holds more than its shards) and the steps are jitted with explicit in/out shardings; with
parallel.mode="shard_map" the train step is per-device code with an explicit all-reduce of the gradients.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxformer.arch import architecture
from jaxformer.config import Config, LoraConfig, OptimConfig
from jaxformer.nn import build_model
from jaxformer.nn.lora import trainable
from jaxformer.nn.build import configured, with_param_dtype
from jaxformer.nn.params import hidden_mask, matrix_mask, muon_dims
from jaxformer.nn.stack import blocks_path
from jaxformer.ops.losses import chunked_token_losses, token_losses
from jaxformer.parallel import Plan, abstract_with_shardings, no_mesh
from jaxformer.platforms import enabled
from jaxformer.platforms.lowering import train_compiler_options, unrolled_threefry
from jaxformer.train.optim import optimizer


class Graphs(NamedTuple):
    """The static halves of the training state: nnx graphdefs of the model and of its optimizer.

    `nnx.merge(graphs.model, state["model"])` is the model of a training state (`init_state`), and
    `nnx.merge(graphs.opt, state["opt"])` its optimizer.

    Attributes:
      model: the model's `nnx.GraphDef`.
      opt: the optimizer's (`nnx.Optimizer` over what trains).

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.train.step import abstract_state
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16)
      >>> graphs, state = abstract_state(cfg)
      >>> graphs._fields, type(graphs.model).__name__
      (('model', 'opt'), 'GraphDef')
      >>> type(nnx.merge(graphs.model, state["model"])).__name__
      'Transformer'
    """
    model: nnx.GraphDef
    opt: nnx.GraphDef


def _build(cfg: Config, key: jax.Array | None = None):
    model = build_model(cfg.model, seed=cfg.train.seed if key is None else key)
    return model, _optimizer_of(cfg, model)


def _optimizer_of(cfg: Config, model) -> nnx.Optimizer:
    """The optimizer over what trains (`nn.lora.trainable`: the adapters with model.lora, else every parameter)."""
    wrt = trainable(cfg.model)
    dims = muon_dims(model, wrt) if cfg.optim.name == "muon" else None
    mult = cfg.model.width_mult
    tx = optimizer(cfg.optim, cfg.train.steps, matrix_mask(model, wrt), dims,
                   cfg.model.runtime.param_dtype != "float32",
                   None if mult == 1.0 else (hidden_mask(model, wrt), 1.0 / mult))
    return nnx.Optimizer(model, tx, wrt=wrt)


def _split(model, opt) -> tuple[Graphs, dict]:
    (mg, ms), (og, os_) = nnx.split(model), nnx.split(opt)
    return Graphs(mg, og), {"model": ms, "opt": os_}


def abstract_state(cfg: Config, plan: Plan | None = None) -> tuple[Graphs, dict]:
    """Shapes and dtypes of the training state (nothing allocated), with the plan's shardings when given:
    the target to create or restore a state into. -> (graphs, {"model": State, "opt": State}).

    Args:
      cfg: a resolved `Config` (model.vocab_size filled in).
      plan: a `jaxformer.parallel.Plan`: every leaf with its sharding (checking every sharded dimension).

    Returns:
      (`Graphs`, {"model": State, "opt": State}), the states' leaves `jax.ShapeDtypeStruct`s.

    Examples:
      >>> import jax
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.train.step import abstract_state
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16)
      >>> graphs, state = abstract_state(cfg)
      >>> sorted(state), type(jax.tree.leaves(state["model"])[0]).__name__
      (['model', 'opt'], 'ShapeDtypeStruct')
    """
    with no_mesh():
        graphs, state = _split(*nnx.eval_shape(lambda: _build(cfg)))
    return graphs, (abstract_with_shardings(state, plan) if plan is not None else state)


def shardings_of(state):
    """The shardings of an abstract state (`abstract_state(cfg, plan)`), same pytree."""
    return jax.tree.map(lambda a: a.sharding, state)


def init_state(cfg: Config, plan: Plan | None = None) -> tuple[Graphs, dict]:
    """A fresh training state for a resolved config (model.vocab_size filled in): (graphs, state).
    One jitted init: under a plan its outputs are created directly in their shards. The seed is an argument,
    not a constant of the program, so runs that differ only in train.seed compile the same program (a
    persistent compilation cache then serves every seed after the first).

    Args:
      cfg: a resolved `Config` (train.seed: the initial weights).
      plan: a `jaxformer.parallel.Plan`: create every array in its shards (None: one device).

    Returns:
      (`Graphs`, {"model": State, "opt": State}): the model's and the optimizer's states, as `make_train_step`
        takes them.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.train.step import init_state
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16)
      >>> graphs, state = init_state(cfg)
      >>> model = nnx.merge(graphs.model, state["model"])
      >>> model.cfg.d_model, sorted(state)
      (16, ['model', 'opt'])
    """
    graphs, abstract = abstract_state(cfg, plan)
    out = shardings_of(abstract) if plan is not None else None
    init = jax.jit(lambda key: _split(*_build(cfg, key))[1], out_shardings=out)
    return graphs, init(jax.random.key(cfg.train.seed))


def state_around(cfg: Config, model_state: nnx.State, plan: Plan | None = None) -> tuple[Graphs, dict]:
    """A fresh training state around given model weights (fine-tuning: train.init_from; a model without
    adapters: with model.lora, fresh adapters are added around them): the optimizer state initialised from them
    in one jitted init, in the plan's shardings; no random model is ever built."""
    graphs, abstract = abstract_state(cfg, plan)
    if cfg.model.lora.rank:
        plain = dataclasses.replace(cfg.model, lora=LoraConfig())
        with no_mesh():
            graph = nnx.graphdef(nnx.eval_shape(lambda: build_model(plain)))
        model = configured(nnx.merge(graph, model_state), cfg.model, cfg.train.seed)   # `plain`'s graph
    else:
        model = nnx.merge(graphs.model, model_state)
    model_state = nnx.state(with_param_dtype(model))                  # e.g. float32 weights, bf16

    def init(ms):
        return nnx.split(_optimizer_of(cfg, nnx.merge(graphs.model, ms)))[1]
    out = shardings_of(abstract)["opt"] if plan is not None else None
    return graphs, {"model": model_state, "opt": jax.jit(init, out_shardings=out)(model_state)}


def forward(model, batch: dict, rngs: nnx.Rngs | None = None, features: bool = False):
    """-> (logits [B,T,V], targets [B,T], aux) for the model's architecture (`jaxformer.arch`); aux: the model's
    auxiliary outputs ({"moe": statistics} for a Mixture-of-Experts model, else {}). features=True: the output
    head's input [B,T,D] in place of the logits."""
    return architecture(model.cfg.arch).forward(model, batch, rngs, features=features)


def batch_losses(model, batch: dict, rngs: nnx.Rngs | None, pad: int, label_smoothing: float = 0.0,
                 z_loss: float = 0.0):
    """-> (the sums of `ops.losses.token_losses` over the batch, aux). Lever `chunked_loss` (`jaxformer.platforms`):
    from the head's input, the logits made a slice at a time (`ops.losses.chunked_token_losses`), else from the
    whole [B,T,V] logits."""
    if enabled("chunked_loss"):
        x, targets, aux = forward(model, batch, rngs, features=True)
        return chunked_token_losses(x, model.embed.head_fn(), targets, pad, label_smoothing, z_loss), aux
    logits, targets, aux = forward(model, batch, rngs)
    return token_losses(logits, targets, pad, label_smoothing, z_loss), aux


def moe_metrics(aux: dict) -> dict:
    """A MoE model's router statistics averaged over its MoE layers: moe_balance (Switch loss, 1 = uniform),
    moe_z (router z-loss), moe_dropped (fraction of assignments over capacity), moe_load [E] (fraction of
    assignments per expert). {} for a dense model."""
    if "moe" not in aux:
        return {}
    st = aux["moe"]
    return {"moe_balance": st.balance.mean(), "moe_z": st.z.mean(), "moe_dropped": st.dropped.mean(),
            "moe_load": st.load.mean(0)}


def objective(s: dict, moe: dict, cfg: OptimConfig, denominator=None, shards: int = 1):
    """The training objective: token objective / tokens + α·balance + β·z (MoE, α and β from cfg, the optimizer
    config; divided by `shards` in per-device code, whose gradients are summed over devices). denominator: the
    global token count (per-device code)."""
    loss = s["objective"] / jnp.maximum(s["count"] if denominator is None else denominator, 1.0)
    if moe:
        loss = loss + (cfg.moe_balance_weight * moe["moe_balance"] + cfg.moe_z_weight * moe["moe_z"]) / shards
    return loss


def layer_grad_norms(grads) -> dict:
    """{"encoder_grad_norm" / "decoder_grad_norm": [L] float32}: each layer's gradient norm over all its
    parameters, in layer order (a patterned stack's kinds interleaved), for each stack the model has."""
    out = {}
    for stack in ("encoder", "decoder"):
        kinds: dict = {}
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
            if tuple(keys[:3]) == blocks_path(stack):
                j = keys[3] if isinstance(keys[3], int) else 0
                sq = jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(g.shape[0], -1), axis=1)
                kinds[j] = kinds.get(j, 0.0) + sq
        if kinds:
            per = jnp.stack([kinds[j] for j in sorted(kinds)], axis=1)        # [L/n, n] -> layer g·n + j
            out[f"{stack}_grad_norm"] = jnp.sqrt(per.reshape(-1))
    return out


def _metrics(s: dict, grads, moe: dict) -> dict:
    n = jnp.maximum(s["count"], 1.0)
    return {"loss": s["nll"] / n, "objective": s["objective"] / n, "token_accuracy": s["correct"] / n,
            "tokens": s["count"], "grad_norm": optax.global_norm(grads), "log_z2": s["log_z2"] / n,
            **layer_grad_norms(grads), **moe}


def make_train_step(graphs: Graphs, cfg: Config, plan: Plan | None = None):
    """train_step(state, batch, rng) -> (state, metrics); state {"model", "opt"} (see `init_state`), donated.
    Under a plan: in/out shardings from it (mode "jit"), or the shard_map data-parallel step. On CPU the
    dropout bits' hash is lowered unrolled (`jaxformer.platforms.lowering.unrolled_threefry`: same bits, fewer ops), and
    the step compiles with `jaxformer.platforms.lowering.train_compiler_options()` (fewer copies, same results).

    One step: the batch's gradients (optim.accumulate micro-batches, summed), then the optimizer's update; the
    objective is the mean token loss (label smoothing, z-loss) plus a MoE model's router losses.

    Args:
      graphs: the state's `Graphs` (`init_state`, `abstract_state`).
      cfg: the resolved `Config` (its model, optim and parallel sections).
      plan: a `jaxformer.parallel.Plan` (None: one device).

    Returns:
      train_step(state, batch, rng) -> (state, metrics): batch in the architecture's layout ([B, T] per field),
        rng a `jax.random.key` (dropout); the state argument is donated (use the one returned). metrics: "loss"
        (mean nll per target token), "objective", "token_accuracy", "tokens", "grad_norm", "log_z2", each
        stack's per-layer gradient norms ("encoder_grad_norm", "decoder_grad_norm": [L]) and a MoE model's
        router statistics.

    Examples:
      >>> import jax
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.train.step import init_state, make_train_step
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16, data__num_train=64,
      ...                              data__num_eval=16, data__batch_size=16))          # digit reversal
      >>> graphs, state = init_state(cfg)
      >>> train_step = make_train_step(graphs, cfg)
      >>> batch = next(iter(task.train_dataset(batch_size=16, seed=0)))
      >>> state, metrics = train_step(state, batch, jax.random.key(0))
      >>> sorted(metrics)
      ['decoder_grad_norm', 'encoder_grad_norm', 'grad_norm', 'log_z2', 'loss', 'objective', 'token_accuracy',
       'tokens']
      >>> metrics["decoder_grad_norm"].shape                         # [L]
      (1,)
    """
    unrolled_threefry()
    pad, ls, zl = cfg.model.pad_id, cfg.optim.label_smoothing, cfg.optim.z_loss

    def loss_fn(model, batch, rng, total=None, shards=1):
        """-> (objective (tokens: of the global batch, `total` in per-device code), (sums, MoE metrics))."""
        s, aux = batch_losses(model, batch, nnx.Rngs(dropout=rng), pad, ls, zl)
        moe = moe_metrics(aux)
        return objective(s, moe, cfg.optim, total, shards), (s, moe)

    k = cfg.optim.accumulate
    wrt = nnx.DiffState(0, trainable(cfg.model))             # every parameter, or only the adapters (model.lora)

    def gradients(model, batch, rng):
        """(sums, MoE metrics), grads of the batch's objective. With optim.accumulate = k: the rows in k strided
        micro-batches (row r in micro-batch r mod k, so each spans every data shard), scanned one at a time;
        each objective is over the whole batch's target tokens, so the summed gradients are the batch's."""
        if k == 1:
            (_, aux), grads = nnx.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(model, batch, rng)
            return aux, grads
        total = (architecture(cfg.model.arch).targets(batch) != pad).sum().astype(jnp.float32)
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)
        graph, params = nnx.split(model)

        def grad_of(ps, i, mb):
            (_, aux), g = nnx.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(nnx.merge(graph, ps), mb,
                                                                    jax.random.fold_in(rng, i), total, k)
            return aux, g

        def one(carry, xs):                  # the parameters ride in the carry: the scan's own trace level
            acc, ps = carry
            return (jax.tree.map(jnp.add, acc, grad_of(ps, *xs)), ps), None
        first = grad_of(params, 0, jax.tree.map(lambda x: x[0], micro))
        (((s, moe), grads), _), _ = jax.lax.scan(one, (first, params),
                                                 (jnp.arange(1, k), jax.tree.map(lambda x: x[1:], micro)))
        return (s, jax.tree.map(lambda x: x / k, moe)), grads

    zigzag = plan is not None and plan.cfg.context_order == "zigzag"

    def train_step(state, batch, rng):
        model, opt = nnx.merge(graphs.model, state["model"]), nnx.merge(graphs.opt, state["opt"])
        if zigzag:                            # parallel.context_order: each device's causal work balanced
            batch = architecture(cfg.model.arch).balanced(model, batch, plan.sizes["context"])
        (s, moe), grads = gradients(model, batch, rng)
        opt.update(model, grads)
        return {"model": nnx.state(model), "opt": nnx.state(opt)}, _metrics(s, grads, moe)

    options = train_compiler_options()
    if plan is None:
        return jax.jit(train_step, donate_argnums=0, compiler_options=options)
    state_sh = shardings_of(abstract_state(cfg, plan)[1])
    batch_sh, rep = plan.batch_sharding(2), plan.replicated
    if plan.mode == "shard_map":
        train_step = _shard_map_step(graphs, cfg, plan, loss_fn)
    return jax.jit(train_step, donate_argnums=0, in_shardings=(state_sh, batch_sh, rep),
                   out_shardings=(state_sh, rep), compiler_options=options)


def _shard_map_step(graphs: Graphs, cfg: Config, plan: Plan, loss_fn):
    """Data parallelism written per device, as with pmap: each device holds the whole (replicated) state and
    its rows of the batch, computes gradients of its tokens' objective divided by the global token count,
    and all-reduces them with an explicit `lax.psum` (the token-weighted mean over devices: `lax.pmean` of
    per-device means would weight a device with fewer target tokens too heavily). Dropout keys are folded
    with the device's index, so masks differ per device (same distribution as one device, not the same bits).
    A MoE model routes each device's rows on that device: expert capacity and the router losses are per device
    (each device a token group, as GShard), a slightly different objective from one device's; the router losses'
    gradients are divided by the device count before the all-reduce, so the objective is their mean."""
    axes = plan.batch_axes
    pad = cfg.model.pad_id

    def per_device(state, batch, rng):
        model, opt = nnx.merge(graphs.model, state["model"]), nnx.merge(graphs.opt, state["opt"])
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
        targets = architecture(cfg.model.arch).targets(batch)
        total = jax.lax.psum((targets != pad).sum().astype(jnp.float32), axes)
        shards = plan.batch_shards
        wrt = nnx.DiffState(0, trainable(cfg.model))
        (_, (s, moe)), grads = nnx.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(model, batch, rng, total,
                                                                                       shards)
        grads, s = jax.lax.psum((grads, s), axes)                     # the explicit gradient all-reduce
        moe = jax.lax.pmean(moe, axes)
        opt.update(model, grads)
        return {"model": nnx.state(model), "opt": nnx.state(opt)}, _metrics(s, grads, moe)

    return jax.shard_map(per_device, mesh=plan.mesh, in_specs=(P(), P(axes), P()), out_specs=(P(), P()),
                         check_vma=False)
