"""The Mixture-of-Experts FFN module: parameters + a call into `jaxformer.ops.moe.moe_ffn`.

Axis legend: B batch, T length, D model width, F FFN width (each expert's), E experts.
"""
from __future__ import annotations

import jax
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.nn import init
from jaxformer.nn.params import dequantized, param
from jaxformer.ops import activations, moe


class MoEFeedForward(nnx.Module):
    """E expert FFNs (w1/wg [E,D,F], w2 [E,F,D], each initialised as a dense FFN) and a router [D,E] applied in
    float32. Training (a dropout stream passed) uses model.runtime.moe_capacity_factor; inference runs dropless
    (as model.runtime.moe_dropless says), so a token's output never depends on the other tokens in its batch
    (cached decoding equals the full forward)."""

    def __init__(self, cfg: ModelConfig, *, stack: str = "decoder", rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.moe.num_experts
        self.activation, self.use_bias = cfg.activation, cfg.has_bias("ffn")
        self.top_k = cfg.moe.top_k
        self.capacity_factor, self.dropless = cfg.runtime.moe_capacity_factor, cfg.runtime.moe_dropless
        self.router = param(rngs, init.weight(cfg, "router"), (d, e), ("embed", None), matrix=True, hidden=True)
        w = lambda role, shape, axes: param(rngs, init.weight(cfg, role, experts=True, stack=stack), shape, axes,  # noqa: E731
                                            matrix=True, quantizable=True)
        self.w1 = w("ffn_in", (e, d, f), ("expert", "embed", "mlp"))
        if self.activation in activations.GATED:
            self.wg = w("ffn_in", (e, d, f), ("expert", "embed", "mlp"))
        self.w2 = w("ffn_out", (e, f, d), ("expert", "mlp", "embed"))
        if self.use_bias:
            self.b1 = param(rngs, init.bias(cfg, "ffn_in"), (e, f), ("expert", "mlp"))
            self.b2 = param(rngs, init.bias(cfg, "ffn_out"), (e, d), ("expert", "embed"))
            if self.activation in activations.GATED:
                self.bg = param(rngs, init.bias(cfg, "ffn_in"), (e, f), ("expert", "mlp"))

    def __call__(self, x: jax.Array, valid: jax.Array | None = None, *, train: bool = False,
                 rngs: nnx.Rngs | None = None, sites=None):
        """x [B,T,D], valid [B,T] bool (padding takes no expert slot) -> ([B,T,D], {"moe": ops.moe.MoEStats})."""
        b, t, d = x.shape
        get = lambda name: dequantized(getattr(self, name)[...]) if hasattr(self, name) else None   # quantized: dequantized
        y, stats = moe.moe_ffn(x.reshape(b * t, d), self.router[...], get("w1"), get("w2"),
                               top_k=self.top_k, capacity_factor=self.capacity_factor if train else 0.0,
                               activation=self.activation, valid=None if valid is None else valid.reshape(-1),
                               b1=get("b1"), b2=get("b2"), wg=get("wg"), bg=get("bg"), dropless=self.dropless)
        return y.reshape(b, t, d), {"moe": stats}
