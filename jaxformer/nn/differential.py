"""Differential attention (Ye et al. 2024, "Differential Transformer"; model.attention.kind="differential").

Axis legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.

The N query heads are N/2 pairs (heads 2j and 2j+1, as the paper's reference code lays out q), each pair one
differential head: its two softmax maps subtracted, A_j = softmax(q_2j·k) − λ·softmax(q_2j+1·k), read over
values of 2H (kv heads 2i and 2i+1 side by side: v [B,S,K/2,2H]), then RMS-normalised over 2H (a learned scale)
and scaled by 1 − λ_init. λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, four learned vectors [H] per layer, and
λ_init = 0.8 − 0.6·exp(−0.3·l) from the layer's index l (`nn.per_layer`). Everything else (projections, RoPE,
QK-norm, the cache, the sites) is `MultiHeadAttention`'s: this module replaces its `context` only. The
`pattern` site holds the N softmax maps [B,N,T,S] before the subtraction.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.errors import ConfigError
from jaxformer.nn.attention import MultiHeadAttention, mix
from jaxformer.nn.params import ones, param
from jaxformer.nn.per_layer import LayerSettings
from jaxformer.nn.sites import Sites
from jaxformer.ops import norms


def lambda_init(layer) -> jax.Array:
    """The paper's λ_init of a layer: 0.8 − 0.6·exp(−0.3·layer).

    Args:
      layer: the layer's 0-based index (an int or an int scalar, may be traced).

    Returns:
      A float32 scalar.

    Examples:
      >>> from jaxformer.nn.differential import lambda_init
      >>> round(float(lambda_init(0)), 4), round(float(lambda_init(3)), 4)
      (0.2, 0.5561)
    """
    return 0.8 - 0.6 * jnp.exp(-0.3 * jnp.asarray(layer, jnp.float32))


class DifferentialAttention(MultiHeadAttention):
    """`MultiHeadAttention` whose heads read the difference of paired softmax maps (module docstring); built
    and called as it is (`check`: ConfigError unless the query and kv heads are even).

    Attributes:
      lambda_q1, lambda_k1, lambda_q2, lambda_k2: [H] the learned vectors of λ (normal, std 0.1).
      sub_norm: [2H] the scale of each differential head's RMS norm.
      cfg: the model's config; wq, wk, wv, wo: the projections, as `MultiHeadAttention`'s.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.differential import DifferentialAttention
      >>> from jaxformer.ops import causal_mask
      >>> cfg = replaced(ModelConfig(), d_model=16, num_heads=2, num_kv_heads=2, attention__kind="differential")
      >>> attn = DifferentialAttention(cfg, self_attention=True, rngs=nnx.Rngs(0))
      >>> out, _ = attn(jnp.ones((1, 3, 16)), mask=causal_mask(3))      # x [B, T, D] -> [B, T, D]
      >>> out.shape, attn.lambda_q1.shape, attn.sub_norm.shape
      ((1, 3, 16), (8,), (16,))
    """

    def __init__(self, cfg: ModelConfig, *, self_attention: bool, stack: str = "decoder", rngs: nnx.Rngs):
        super().__init__(cfg, self_attention=self_attention, stack=stack, rngs=rngs)
        h = cfg.head_size
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, param(rngs, nnx.initializers.normal(0.1), (h,), ("head_dim",)))
        self.sub_norm = param(rngs, ones, (2 * h,), (None,))

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """Heads are paired: ConfigError unless model.num_heads and the kv heads are even."""
        if cfg.num_heads % 2 or cfg.kv_heads % 2:
            raise ConfigError(f"model.attention.kind={cfg.attention.kind!r} pairs heads: model.num_heads="
                              f"{cfg.num_heads} and its kv heads ({cfg.kv_heads}) must be even")

    def lam(self, layer) -> jax.Array:
        """λ of this layer (a float32 scalar)."""
        dot = lambda a, b: jnp.sum(getattr(self, a)[...] * getattr(self, b)[...])  # noqa: E731
        return jnp.exp(dot("lambda_q1", "lambda_k1")) - jnp.exp(dot("lambda_q2", "lambda_k2")) + lambda_init(layer)

    def context(self, q, kv, mask, q_positions, kv_positions, sites: Sites, layer: LayerSettings) -> jax.Array:
        """As `MultiHeadAttention.context`: q [B,T,N,H] -> the context [B,T,N,H] (N/2 heads of 2H, laid out as
        N of H for the output projection wo [N,H,D])."""
        _, w = self.attend(q, kv, mask, q_positions, kv_positions, sites, layer, probs=True)
        w = sites("pattern", w)                                                    # [B,N,T,S] float32
        b, n, t, s = w.shape
        pairs = w.reshape(b, n // 2, 2, t, s)
        diff = pairs[:, :, 0] - self.lam(layer.index) * pairs[:, :, 1]           # [B,N/2,T,S]
        ctx = mix(diff, kv.grouped_values(2))                    # kv heads 2i, 2i+1 side by side: [B,T,N/2,2H]
        ctx = norms.rms_norm(ctx, self.sub_norm[...], self.cfg.norm.eps) * (1.0 - lambda_init(layer.index))
        return ctx.reshape(b, t, n, -1).astype(q.dtype)
