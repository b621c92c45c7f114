"""Diagnostics of a model before it trains: per-layer gradient norms at initialisation (the quantity Xiong et
al. 2020 analyse to explain why Post-LN needs warmup), for any config.

Axis legend: L decoder layers, F FFN width, D model width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.nn.stack import blocks_path


def init_grad_norms(overrides: list[str], base: str = "configs/alice.py", seed: int = 0, rows: int = 32) -> dict:
    """Per-layer gradient norms at initialisation of `base` with `overrides`, on its first `rows` training rows:
    the FFN's output matrix W2 [F,D] (Xiong et al.'s W^(2)) and all of each layer's parameters, nearest the
    input first. -> {"w2": [L] floats, "layer": [L] floats}."""
    from jaxformer.configio import apply_overrides, load_config_file
    from jaxformer.data import resolve
    from jaxformer.nn import build_model
    from jaxformer.ops.losses import token_losses
    from jaxformer.train.step import forward

    cfg, task = resolve(apply_overrides(load_config_file(base), list(overrides)))
    depth = cfg.model.num_decoder_layers
    model = build_model(cfg.model, seed)
    batch = {k: jnp.asarray(v[:rows]) for k, v in task.train.items()}

    def loss(m):
        logits, targets, _ = forward(m, batch)
        t = token_losses(logits, targets, cfg.model.pad_id)
        return t["objective"] / t["count"]
    grads = nnx.jit(nnx.grad(loss))(model)
    stack, layers, blocks = blocks_path("decoder")
    blocks = grads[stack][layers][blocks]
    per_leaf = [jnp.sum(jnp.square(x[...]).reshape(depth, -1), axis=1) for x in jax.tree.leaves(blocks)]
    w2 = blocks["ffn"]["w2"][...]
    return {"w2": [float(v) for v in jnp.sqrt(jnp.sum(jnp.square(w2).reshape(depth, -1), axis=1))],
            "layer": [float(v) for v in jnp.sqrt(sum(per_leaf))]}
