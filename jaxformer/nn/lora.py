"""Low-rank adapters (LoRA, Hu et al. 2021) on the layer stacks' projections (model.lora).

A target weight W (an nnx.Param [L, in..., out...], e.g. wq [L,D,N,H]) becomes an `Adapted` module holding W
frozen (`base`) and two trainable nnx.LoRAParam factors, A [L, in..., r] and B [L, r, out...], B from zero. The
frozen projections' precision (model.lora.base: bfloat16, or int8) is set by `jaxformer.nn.weights.frozen_base`
(the modules never import a quantizer). Read like the parameter it replaces (`adapted[...]`),
it gives a `LoraWeight`, a weight that brings its own matmul to `nn.params.project`:

    y = x·W + (alpha / r) · dropout(x)·A·B                  (dropout on the adapter's input, training only)

so the modules, the scanned stack, the KV-cached decoder and the parallel plans run it unchanged. Training
differentiates and updates only nnx.LoRAParam (`trainable`); `merged` folds every adapter into its weight
(W + (alpha/r)·A·B: what an export writes and what `train.init_from` starts from). Targets: q, k, v, o of every
attention (self and cross), gate (wg), up (w1) and down (w2) of a dense FFN (`config.sections.LORA_TARGETS`).
qwix 0.1.8 also ships LoRA (`qwix.LoraProvider`), by intercepting the matmuls of a module's call and creating
the adapters during it; that cannot reach weights read inside the stack's `jax.lax.scan` (tests/test_lora.py
shows its error), hence this module.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxformer.axes import contracted_axes
from jaxformer.config import LoraConfig, ModelConfig
from jaxformer.nn.params import dequantized, project

# each target: the module attribute it adapts, in MultiHeadAttention / FeedForward
ATTRIBUTES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "wg", "up": "w1", "down": "w2"}
R = "z"                                                       # the rank's letter in the adapter's equations


@struct.dataclass
class LoraWeight:
    """A weight with its adapter, as one layer's (or the stack's) arrays: what `nn.params.project` multiplies by
    (y = x·W + scale · dropout(x)·A·B).

    Attributes:
      base: W [..., in..., out...]: an array, or a weight with its own matmul (e.g. int8).
      a: A [..., in..., r].
      b: B [..., r, out...].
      key: the adapter input's dropout key (None: no dropout).
      scale: alpha / r.
      rate: the adapter input's dropout rate.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.lora import LoraWeight
      >>> w = LoraWeight(jnp.eye(2), a=jnp.ones((2, 1)), b=jnp.ones((1, 2)), scale=0.5)
      >>> w.project("BD,DF->BF", jnp.array([[1.0, 2.0]])).tolist()     # [1, 2] + 0.5 · 3 · [1, 1]
      [[2.5, 3.5]]
      >>> w.dequantize().tolist()                                       # W + 0.5 · A·B
      [[1.5, 0.5], [0.5, 1.5]]
    """
    base: object
    a: jax.Array
    b: jax.Array
    key: jax.Array | None = None
    scale: float = struct.field(pytree_node=False, default=1.0)
    rate: float = struct.field(pytree_node=False, default=0.0)

    @property
    def shape(self):
        return self.base.shape

    def project(self, eq: str, x: jax.Array) -> jax.Array:
        """einsum(eq, x, W) + scale · einsum(dropout(x), A, B) -> x's dtype; eq "rows+inputs,inputs+outputs->
        rows+outputs" as every projection reads."""
        y = project(eq, x, self.base)
        (xs, ws), out = eq.split("->")[0].split(","), eq.split("->")[1]
        inputs = "".join(c for c in ws if c in xs)
        outputs = ws[len(inputs):]
        if R in eq or ws != inputs + outputs:
            raise ValueError(f"LoraWeight.project: {eq!r} is not rows+inputs,inputs+outputs->rows+outputs")
        rows = xs[:len(xs) - len(inputs)]
        if self.key is not None and self.rate > 0:
            keep = jax.random.bernoulli(self.key, 1.0 - self.rate, x.shape)
            x = jnp.where(keep, x / (1.0 - self.rate), 0).astype(x.dtype)
        h = jnp.einsum(f"{xs},{inputs}{R}->{rows}{R}", x, self.a.astype(x.dtype))
        delta = jnp.einsum(f"{rows}{R},{R}{outputs}->{out}", h, self.b.astype(x.dtype))
        return (y + (self.scale * delta).astype(y.dtype)).astype(x.dtype)

    def dequantize(self) -> jax.Array:
        """W + scale · A·B as one float32 array in W's shape (the merged weight)."""
        n_lead = (self.a.ndim - 1) + (self.b.ndim - 1) - len(self.shape)     # stacked (layer) axes
        batch = self.a.shape[:n_lead]
        a = self.a.reshape(*batch, -1, self.a.shape[-1]).astype(jnp.float32)
        b = self.b.reshape(*batch, self.b.shape[n_lead], -1).astype(jnp.float32)
        delta = (a @ b).reshape(self.shape)
        return dequantized(self.base).astype(jnp.float32) + self.scale * delta


class Adapted(nnx.Module):
    """A frozen projection weight with its low-rank adapter. adapted[...] -> `LoraWeight` (no dropout; any other
    index: TypeError); `weight(rngs)` -> with a dropout key. Made by `with_adapters`.

    Attributes:
      base: the nnx.Param it replaces (metadata kept), frozen.
      a: nnx.LoRAParam [..., in..., r].
      b: nnx.LoRAParam [..., r, out...], from zero.
      scale: alpha / r.
      rate: the adapter input's dropout rate (training only).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.nn.lora import Adapted
      >>> w = Adapted(nnx.Param(jnp.eye(2)), nnx.LoRAParam(jnp.ones((2, 1))), nnx.LoRAParam(jnp.zeros((1, 2))),
      ...             scale=2.0, rate=0.0)
      >>> type(w[...]).__name__, w[...].dequantize().tolist()           # B = 0: the adapter changes nothing yet
      ('LoraWeight', [[1.0, 0.0], [0.0, 1.0]])
    """

    def __init__(self, base: nnx.Param, a: nnx.LoRAParam, b: nnx.LoRAParam, scale: float, rate: float):
        self.base, self.a, self.b = base, a, b
        self.scale, self.rate = scale, rate

    def __getitem__(self, key) -> LoraWeight:
        if key is not Ellipsis:
            raise TypeError("an adapted weight is read whole: adapted[...]")
        return LoraWeight(self.base[...], self.a[...], self.b[...], None, self.scale, self.rate)

    def weight(self, rngs: nnx.Rngs | None) -> LoraWeight:
        """The weight of a training call (rngs: its dropout stream: the adapter's input dropout) or not (None)."""
        w = self[...]
        return w.replace(key=rngs.dropout()) if rngs is not None and self.rate > 0 else w


def trainable(cfg: ModelConfig):
    """What training differentiates and updates (an nnx filter).

    Args:
      cfg: the model's config.

    Returns:
      nnx.LoRAParam (the adapters) with model.lora.rank > 0, else nnx.Param.

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.lora import trainable
      >>> trainable(ModelConfig()).__name__, trainable(replaced(ModelConfig(), lora__rank=2)).__name__
      ('Param', 'LoRAParam')
    """
    return nnx.LoRAParam if cfg.lora.rank else nnx.Param


def _adapter(w: nnx.Param, cfg: LoraConfig, key: jax.Array) -> Adapted:
    """Adapter factors for the weight `w` (stacked [L, ...] in a layer stack): A uniform in ±1/sqrt(fan-in) (the
    bound PyTorch's and PEFT's kaiming_uniform(a=√5) gives), B zero."""
    names = tuple(w.get_metadata().get("out_sharding") or ())
    lead = sum(n == "layers" for n in names)
    n_in = len(contracted_axes(names))
    shape = w.shape
    ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
    bound = 1.0 / math.sqrt(math.prod(ins))
    a = jax.random.uniform(key, (*shape[:lead], *ins, cfg.rank), jnp.float32, -bound, bound)
    b = jnp.zeros((*shape[:lead], cfg.rank, *outs), jnp.float32)
    meta = dict(eager_sharding=False, matrix=True)
    a = nnx.LoRAParam(a, out_sharding=(*names[:lead + n_in], None), **meta)
    b = nnx.LoRAParam(b, out_sharding=(*names[:lead], None, *names[lead + n_in:]), **meta)
    return Adapted(w, a, b, cfg.alpha / cfg.rank, cfg.dropout)


def with_adapters(model: nnx.Module, cfg: LoraConfig, seed: int | jax.Array = 0) -> nnx.Module:
    """`model` with the adapters of `cfg` (model.lora) on its targets, in place (no-op at rank 0).

    Args:
      model: a module holding MultiHeadAttention and FeedForward modules (a model, or one of them).
      cfg: model.lora: the rank, alpha, dropout and targets.
      seed: an int or a key: each adapter's A is drawn from its own key, folded from it by the order of the
        model's modules.

    Returns:
      `model`, each target's weight now an `Adapted`.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import LoraConfig, ModelConfig, replaced
      >>> from jaxformer.nn.attention import MultiHeadAttention
      >>> from jaxformer.nn.lora import with_adapters
      >>> attn = MultiHeadAttention(replaced(ModelConfig(), d_model=16, num_heads=2), self_attention=True,
      ...                           rngs=nnx.Rngs(0))
      >>> attn = with_adapters(attn, LoraConfig(rank=2, alpha=4.0))     # targets q and v
      >>> type(attn.wq).__name__, type(attn.wk).__name__, attn.wq.a.shape, attn.wq.b.shape, attn.wq.scale
      ('Adapted', 'Param', (16, 2), (2, 2, 8), 2.0)
    """
    if not cfg.rank:
        return model
    from jaxformer.nn.attention import MultiHeadAttention
    from jaxformer.nn.layers import FeedForward
    root = jax.random.fold_in(jax.random.key(seed) if isinstance(seed, int) else seed, 0x10A)   # not the params'
    count = 0
    for _, module in list(nnx.iter_modules(model)):
        kinds = ("q", "k", "v", "o") if isinstance(module, MultiHeadAttention) else (
            ("gate", "up", "down") if isinstance(module, FeedForward) else ())
        for t in kinds:
            attr = ATTRIBUTES[t]
            w = getattr(module, attr, None)
            if t in cfg.targets and isinstance(w, nnx.Param):
                setattr(module, attr, _adapter(w, cfg, jax.random.fold_in(root, count)))
                count += 1
    return model


def merged(model: nnx.Module) -> nnx.Module:
    """`model` with every adapter folded into its weight, in place.

    Args:
      model: a module, maybe with `Adapted` weights.

    Returns:
      `model`, each `Adapted` replaced by its nnx.Param holding W + scale·A·B (in W's float dtype; an int8
        base becomes float32); a model without adapters as it is.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import LoraConfig, ModelConfig, replaced
      >>> from jaxformer.nn.attention import MultiHeadAttention
      >>> from jaxformer.nn.lora import merged, with_adapters
      >>> attn = MultiHeadAttention(replaced(ModelConfig(), d_model=16, num_heads=2), self_attention=True,
      ...                           rngs=nnx.Rngs(0))
      >>> attn = merged(with_adapters(attn, LoraConfig(rank=2)))
      >>> type(attn.wq).__name__, attn.wq.shape
      ('Param', (16, 2, 8))
    """
    for _, module in list(nnx.iter_modules(model)):
        for attr, value in list(vars(module).items()):
            if isinstance(value, Adapted):
                base = value.base
                old = base.get_value()
                dtype = old.dtype if hasattr(old, "dtype") and jnp.issubdtype(old.dtype, jnp.floating) else jnp.float32
                base.set_value(value[...].dequantize().astype(dtype))
                setattr(module, attr, base)
    return model
