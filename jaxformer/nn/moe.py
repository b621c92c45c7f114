"""The Mixture-of-Experts FFN module: parameters + a call into `jaxformer.ops.moe.moe_ffn`.

Axis legend: B batch, T length, D model width, F FFN width (each expert's), E experts.
"""
from __future__ import annotations

import jax
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.nn.params import dense, dense_init, param, zeros
from jaxformer.ops import activations, moe


class MoEFeedForward(nnx.Module):
    """E expert FFNs (w1/wg [E,D,F], w2 [E,F,D], each initialised as a dense FFN) and a router [D,E] applied in
    float32. Training (a dropout stream passed) uses model.moe_capacity_factor; inference runs dropless (as
    model.moe_dropless says), so a token's output never depends on the other tokens in its batch (cached decoding
    equals the full forward)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
        self.activation, self.use_bias = cfg.activation, cfg.has_bias("ffn")
        self.top_k, self.capacity_factor, self.dropless = cfg.moe_top_k, cfg.moe_capacity_factor, cfg.moe_dropless
        self.router = param(rngs, dense_init(0, 1), (d, e), ("embed", None), matrix=True)
        expert = dense_init(1, 2, 0)
        w = lambda shape, axes: param(rngs, expert, shape, axes, matrix=True, quantizable=True)   # noqa: E731
        self.w1 = w((e, d, f), ("expert", "embed", "mlp"))
        if self.activation in activations.GATED:
            self.wg = w((e, d, f), ("expert", "embed", "mlp"))
        self.w2 = w((e, f, d), ("expert", "mlp", "embed"))
        if self.use_bias:
            self.b1 = param(rngs, zeros, (e, f), ("expert", "mlp"))
            self.b2 = param(rngs, zeros, (e, d), ("expert", "embed"))
            if self.activation in activations.GATED:
                self.bg = param(rngs, zeros, (e, f), ("expert", "mlp"))

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, *, train: bool = False):
        """x [B,T,D], valid [B,T] bool (padding takes no expert slot) -> ([B,T,D], {"moe": ops.moe.MoEStats})."""
        b, t, d = x.shape
        get = lambda name: dense(getattr(self, name)[...]) if hasattr(self, name) else None   # quantized: dequantized
        y, stats = moe.moe_ffn(x.reshape(b * t, d), self.router[...], get("w1"), get("w2"),
                               top_k=self.top_k, capacity_factor=self.capacity_factor if train else 0.0,
                               activation=self.activation, valid=None if valid is None else valid.reshape(-1),
                               b1=get("b1"), b2=get("b2"), wg=get("wg"), bg=get("bg"), dropless=self.dropless)
        return y.reshape(b, t, d), {"moe": stats}
