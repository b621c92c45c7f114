"""Building the configured model: `build_model(cfg, seed)` makes the class named by model.arch, its parameters in
model.runtime.param_dtype, with model.lora's adapters around a frozen base in model.lora.base (`configured`);
`count_params` counts what was built. The builder, not the modules, knows weight kinds (a frozen int8 base:
`nn.weights`): the modules (`nn.models`) never import one.
"""
from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import ops
from jaxformer.config import ModelConfig
from jaxformer.errors import BackendError
from jaxformer.nn.lora import with_adapters
from jaxformer.nn.models import Transformer, TransformerLM
from jaxformer.nn.params import DTYPES
from jaxformer.parallel import check_model_size
from jaxformer.nn.weights import frozen_base


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer | TransformerLM:
    """The configured model: the class named by cfg.arch, initialised from `seed`, its parameters in
    model.runtime.param_dtype, with model.lora's adapters around a frozen base in model.lora.base (`configured`).
    Raises BackendError (before anything is traced) when cfg.runtime.attention_backend cannot run on this
    machine."""
    why = ops.fused.problem(cfg.runtime.attention_backend, dtype=DTYPES[cfg.runtime.dtype])
    if why:
        raise BackendError(f"model.runtime.attention_backend={cfg.runtime.attention_backend!r}: {why}")
    check_model_size(cfg)                               # by arithmetic, before any table or array exists
    cls = Transformer if cfg.arch == "encoder_decoder" else TransformerLM
    model = with_param_dtype(cls(cfg, rngs=nnx.Rngs(params=seed)))    # initialised in float32, rounded once
    return configured(model, cfg, seed)


def configured(model, cfg: ModelConfig, seed: int | jax.Array = 0):
    """A built model (weights as initialised, trained or imported) with what cfg adds around its weights, in
    place; returned: model.lora's adapters (none at rank 0; A drawn from `seed`) and their frozen base in
    model.lora.base (bfloat16 or int8, `nn.weights.frozen_base`). The one place a model becomes what its config
    says (`build_model`, and fine-tuning around given weights: `train.step.state_around`)."""
    return frozen_base(with_adapters(model, cfg.lora, seed), cfg.lora)


def with_param_dtype(model):
    """The model with its floating-point parameters (nnx.Param; not constants such as a sinusoidal table) in
    model.runtime.param_dtype, in place; returned."""
    to = DTYPES[model.cfg.runtime.param_dtype]
    params = nnx.state(model, nnx.Param)
    if any(x.dtype != to for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)):
        nnx.update(model, jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                       params))
    return model


def count_params(model: nnx.Module) -> dict[str, int]:
    """Parameter counts per component: embedding, positions, head, and per stack its attention, cross-attention,
    FFN (a MoE FFN's experts; its router separately) and norms (totals over L layers), plus "total"; for a MoE
    model also "active per token": the total less the experts a token does not use (each token runs top_k of
    the E experts of each MoE layer); with model.lora, "LoRA adapters" (what trains) apart from the frozen rest."""
    counts: dict[str, int] = collections.OrderedDict()
    experts = 0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        keys = [str(p) for p in path if not isinstance(p, int)]          # kinds of a patterned stack: blocks/j
        if keys[0] == "embed":
            name = {"tokens": "embedding", "positions": "learned positions", "head": "output head"}[keys[1]]
        else:
            sub = keys[3] if keys[1] == "layers" else keys[1]
            kind = {"self_attn": "self-attention", "cross_attn": "cross-attention", "ffn": "FFN"}.get(sub, "norms")
            kind = "MoE router" if kind == "FFN" and keys[-1] == "router" else kind
            name = f"{keys[0]} {kind}"
        name = "LoRA adapters" if isinstance(v, nnx.LoRAParam) else name
        raw = v.get_value()                  # an abstract model's ShapeDtypeStruct; an int8 weight: its values
        size = math.prod((raw if isinstance(raw, jax.ShapeDtypeStruct) else v[...]).shape)
        counts[name] = counts.get(name, 0) + size
        if "expert" in (v.get_metadata().get("out_sharding") or ()):
            experts += size
    counts["total"] = sum(counts.values())
    if experts:
        cfg = model.cfg
        counts["active per token"] = counts["total"] - experts + experts * cfg.moe.top_k // cfg.moe.num_experts
    return counts
