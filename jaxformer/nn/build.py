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
from jaxformer.memory import check_model_size
from jaxformer.nn.weights import frozen_base


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer | TransformerLM:
    """The configured model: the class named by cfg.arch, initialised from `seed`, its parameters in
    model.runtime.param_dtype, with model.lora's adapters around a frozen base in model.lora.base (`configured`).

    Args:
      cfg: the model's config; cfg.arch picks `Transformer` ("encoder_decoder") or `TransformerLM`.
      seed: the parameters' initialisation seed (and the LoRA adapters' A).

    Returns:
      The `Transformer` or `TransformerLM`, ready to call.

    Raises:
      BackendError: cfg.runtime.attention_backend cannot run on this machine (before anything is traced).
      ConfigError: a model of cfg's sizes cannot fit this process's memory (counted before anything is built).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> model = build_model(cfg, seed=0)
      >>> logits, out = model(jnp.array([[1, 2, 3]]))
      >>> type(model).__name__, logits.shape, out
      ('TransformerLM', (1, 3, 16), {})
    """
    why = ops.fused.problem(cfg.runtime.attention_backend, dtype=DTYPES[cfg.runtime.dtype])
    if why:
        raise BackendError(f"model.runtime.attention_backend={cfg.runtime.attention_backend!r}: {why}")
    check_model_size(cfg)                               # by arithmetic, before any table or array exists
    cls = Transformer if cfg.arch == "encoder_decoder" else TransformerLM
    model = with_param_dtype(cls(cfg, rngs=nnx.Rngs(params=seed)))    # initialised in float32, rounded once
    return configured(model, cfg, seed)


def configured(model, cfg: ModelConfig, seed: int | jax.Array = 0):
    """A built model (weights as initialised, trained or imported) with what cfg adds around its weights, in
    place: model.lora's adapters and their frozen base. The one place a model becomes what its config says
    (`build_model`, and fine-tuning around given weights: `train.step.state_around`).

    Args:
      model: a `Transformer` or `TransformerLM`.
      cfg: the config whose model.lora applies (adapters at rank > 0, their A drawn from `seed`; the frozen
        projections in lora.base: bfloat16 or int8, `nn.weights.frozen_base`).
      seed: an int or a key for the adapters' A.

    Returns:
      `model` itself, changed in place (unchanged at lora.rank 0).

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import TransformerLM, count_params
      >>> from jaxformer.nn.build import configured
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> model = TransformerLM(cfg, rngs=nnx.Rngs(0))
      >>> lora = replaced(cfg.lora, rank=2, base="bfloat16")      # adapters on q and v
      >>> configured(model, replaced(cfg, lora=lora)) is model
      True
      >>> count_params(model)["LoRA adapters"], model.decoder.layers.blocks.self_attn.wk.dtype
      (128, dtype(bfloat16))
    """
    return frozen_base(with_adapters(model, cfg.lora, seed), cfg.lora)


def with_param_dtype(model):
    """The model with its floating-point parameters (nnx.Param; not constants such as a sinusoidal table) in
    model.runtime.param_dtype, in place.

    Args:
      model: a module with a `cfg` (a `Transformer` or `TransformerLM`), parameters as initialised (float32).

    Returns:
      `model` itself, its floating-point parameters cast (unchanged when they already are in that dtype).

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import TransformerLM
      >>> from jaxformer.nn.build import with_param_dtype
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> cfg = replaced(cfg, runtime=replaced(cfg.runtime, dtype="bfloat16", param_dtype="bfloat16"))
      >>> model = TransformerLM(cfg, rngs=nnx.Rngs(0))
      >>> model.embed.tokens.dtype, with_param_dtype(model).embed.tokens.dtype
      (dtype('float32'), dtype(bfloat16))
    """
    to = DTYPES[model.cfg.runtime.param_dtype]
    params = nnx.state(model, nnx.Param)
    if any(x.dtype != to for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)):
        nnx.update(model, jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                       params))
    return model


def count_params(model: nnx.Module) -> dict[str, int]:
    """Parameter counts per component: embedding, positions, head, and per stack its attention, cross-attention,
    FFN (a MoE FFN's experts; its router separately) and norms (totals over L layers), plus "total".

    Args:
      model: a built `Transformer` or `TransformerLM` (or an abstract one: its shapes are counted).

    Returns:
      {component: count} in the order met, then "total"; for a MoE model also "active per token" (the total
      less the experts a token does not use: each token runs top_k of the E experts of each MoE layer); with
      model.lora, "LoRA adapters" (what trains) apart from the frozen rest.

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model, count_params
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> counts = count_params(build_model(cfg))
      >>> counts["embedding"], counts["decoder FFN"], counts["total"]          # FFN: 2·D·F + F + D
      (256, 1072, 2480)
    """
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
