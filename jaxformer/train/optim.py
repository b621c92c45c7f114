"""The optimizer and its learning-rate schedule, from `optim.*` (`OptimConfig`): AdamW, Lion, Muon (with AdamW for
what is not a hidden matrix), SGD and schedule-free AdamW; warmup then constant, cosine, linear or WSD decay;
clipping, weight decay on the matrices only, gradient accumulation, EMA and float32 master weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer.config import OptimConfig
from jaxformer.train.weights import with_ema, with_master_weights


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """constant | noam (linear warmup to lr, then lr·sqrt(warmup/step)) | warmup_cosine (to 0 at total_steps) |
    wsd (warmup-stable-decay: linear warmup, lr held, then linear to 0 over the last optim.decay_fraction).

    Schedule-free AdamW (optim.name "schedule_free") has its own: a linear warmup, then constant.

    Args:
      cfg: the optimizer config: its schedule, lr (the peak), warmup_steps and decay_fraction.
      total_steps: the run's steps (train.steps): where warmup_cosine and wsd reach 0.

    Returns:
      The optax schedule: step (an int, or a traced int array) -> the learning rate.

    Examples:
      >>> from jaxformer.config import OptimConfig
      >>> from jaxformer.train.optim import schedule
      >>> noam = schedule(OptimConfig(lr=1e-3, schedule="noam", warmup_steps=4), total_steps=100)
      >>> [round(float(noam(step)), 6) for step in (0, 3, 15)]        # warmup, peak, then 1/sqrt(step)
      [0.00025, 0.001, 0.0005]
      >>> wsd = schedule(OptimConfig(lr=1e-3, schedule="wsd", warmup_steps=10, decay_fraction=0.2), 100)
      >>> [round(float(wsd(step)), 6) for step in (0, 50, 90, 99)]
      [0.0001, 0.001, 0.0005, 5e-05]
    """
    if cfg.name == "schedule_free":                     # its own: a linear warmup, then constant
        return (optax.warmup_constant_schedule(0.0, cfg.lr, cfg.warmup_steps) if cfg.warmup_steps else
                optax.constant_schedule(cfg.lr))
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.schedule == "wsd":
        w, total = cfg.warmup_steps, max(total_steps, 1)
        decay = max(int(round(cfg.decay_fraction * total)), 1)
        start = max(total - decay, w)

        def wsd(step):
            warm = jnp.minimum((step + 1) / max(w, 1), 1.0) if w else 1.0
            down = jnp.clip((total - step) / max(total - start, 1), 0.0, 1.0)
            return cfg.lr * warm * jnp.where(step < start, 1.0, down)
        return wsd
    if cfg.schedule == "noam":
        w = max(cfg.warmup_steps, 1)
        return lambda step: cfg.lr * jnp.minimum((step + 1) / w, jnp.sqrt(w / jnp.maximum(step + 1, 1)))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1))


def optimizer(cfg: OptimConfig, total_steps: int, matrices=None, muon_dims=None,
              master: bool = False, hidden_lr=None) -> optax.GradientTransformation:
    """AdamW (default), Lion, Muon (the projection matrices; AdamW for the rest), schedule-free AdamW or SGD,
    from optax; optional global-norm clipping first (seed 000 uses SGD + clipping); optim.ema > 0 keeps an EMA
    of the weights in the optimizer state (`train.weights`). matrices: a pytree of bools over the parameters
    (`nn.params.matrix_mask`); with cfg.weight_decay_mask='matrices' only those decay (not biases, norm scales
    or embeddings). muon_dims: Muon's matrix axes per parameter (`nn.params.muon_dims`). master: the parameters
    are stored in a lower precision; the optimizer (inside the EMA) runs on a float32 master copy
    (`train.weights.with_master_weights`). hidden_lr: (mask, factor): the masked parameters' updates times
    factor (µP's learning rate of the hidden matrices, D₀/D: `jaxformer.mup`).

    Args:
      cfg: the optimizer config (name, lr and schedule, weight decay and its mask, betas, clip_norm, ema).
      total_steps: the run's steps, for the schedule (`schedule`).
      matrices: a pytree of bools over the parameters (`nn.params.matrix_mask`); needed when
        cfg.weight_decay_mask is "matrices" (the default) and the optimizer decays.
      muon_dims: Muon's matrix axes per parameter (`nn.params.muon_dims`); Muon only.
      master: run the optimizer on a float32 master copy of lower-precision parameters.
      hidden_lr: (mask, factor) or None.

    Returns:
      The optax GradientTransformation (init, update), over the pytree of parameters it is given.

    Raises:
      ValueError: cfg.weight_decay_mask "matrices" without `matrices` (any optimizer but SGD).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import OptimConfig
      >>> from jaxformer.train.optim import optimizer
      >>> tx = optimizer(OptimConfig(name="sgd", lr=0.1, schedule="constant", clip_norm=0.0), total_steps=10)
      >>> params = {"w": jnp.ones(2)}
      >>> updates, opt_state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
      >>> updates["w"]
      Array([-0.1, -0.1], dtype=float32)
      >>> optimizer(OptimConfig(name="adamw"), total_steps=10)          # decays the matrices: which are they?
      Traceback (most recent call last):
      ...
      ValueError: optim.weight_decay_mask='matrices' needs the parameters' matrix mask
    """
    lr = schedule(cfg, total_steps)
    mask = None
    if cfg.name != "sgd" and cfg.weight_decay_mask == "matrices":
        if matrices is None:
            raise ValueError("optim.weight_decay_mask='matrices' needs the parameters' matrix mask")
        mask = matrices
    if cfg.name == "schedule_free":
        tx = _schedule_free(cfg, lr, mask)
    else:
        tx = _base(cfg, lr, mask, muon_dims)
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx) if cfg.clip_norm > 0 else tx
    if hidden_lr is not None:
        mask, factor = hidden_lr
        tx = optax.chain(tx, optax.masked(optax.scale(factor), mask))
    tx = with_master_weights(tx) if master else tx
    return with_ema(tx, cfg.ema) if cfg.ema else tx


def _schedule_free(cfg: OptimConfig, lr, mask) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw's chain (RMS scaling without momentum, decoupled weight decay, the
    warmup-constant lr) with our clipping and weight-decay mask inside, schedule-free outermost (so its state's
    z and b1 are where `train.weights` looks)."""
    base = optax.chain(*([optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []),
                       optax.scale_by_rms(decay=cfg.b2, eps=1e-8, eps_in_sqrt=False, bias_correction=True),
                       optax.add_decayed_weights(cfg.weight_decay, mask), optax.scale_by_learning_rate(lr))
    return optax.contrib.schedule_free(base, learning_rate=lr, b1=cfg.b1)


def _base(cfg: OptimConfig, lr, mask, muon_dims) -> optax.GradientTransformation:
    if cfg.name == "adamw":
        return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "lion":
        return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "muon":
        if muon_dims is None:
            raise ValueError("optim.name='muon' needs the parameters' Muon axes (nn.params.muon_dims)")
        adam_lr = lr if cfg.muon_adam_lr is None else _scaled(lr, cfg.muon_adam_lr / cfg.lr)
        tx = optax.contrib.muon(lr, weight_decay=cfg.weight_decay, weight_decay_mask=mask, adam_b1=cfg.b1,
                                adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay if mask is None else 0.0,
                                adam_learning_rate=adam_lr, muon_weight_dimension_numbers=muon_dims)
        if mask is None or not cfg.weight_decay:
            return tx
        return optax.chain(tx, _decayed_by(adam_lr, cfg.weight_decay, _adam_part(mask, muon_dims)))
    return optax.sgd(lr)


def _adam_part(mask, muon_dims):
    """The decay mask restricted to the parameters Muon hands to its AdamW (no Muon axes)."""
    from optax.contrib import MuonDimensionNumbers
    value = lambda x: x.value if isinstance(x, nnx.Variable) else x                  # noqa: E731
    return jax.tree.map(lambda m, d: bool(value(m)) and value(d) is None, mask, muon_dims,
                        is_leaf=lambda x: x is None or isinstance(x, (MuonDimensionNumbers, nnx.Variable)))


def _decayed_by(lr, weight_decay: float, mask) -> optax.GradientTransformation:
    """Decoupled weight decay added after the update: -lr(step)·λ·p on the parameters of `mask`.
    optax.contrib.muon's AdamW part decays every parameter it holds (its adam_weight_decay takes no mask): this
    is its decay, limited to optim.weight_decay_mask's parameters."""
    def init(params):
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        step = -lr(state.count) * weight_decay
        updates = jax.tree.map(lambda u, p: u + step * p, updates, params)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
    return optax.masked(optax.GradientTransformation(init, update), mask)


def _scaled(sched, factor: float):
    return lambda step: sched(step) * factor
