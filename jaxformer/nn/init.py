"""Initialisation schemes (model.runtime.init): the distribution each parameter starts from, by its role.

Axis legend: D model width, N query heads, K kv heads, H head dim, F FFN width, V vocab, L layers, E experts.

- glorot (the default): Glorot-uniform over each projection's own fan-in and fan-out (q, k, v and o apart);
  token embedding and untied head N(0, 1/D); learned positions N(0, 0.02²). Under µP (model.parametrization
  "mup") the token embedding and the untied head are N(0, 1/D₀), D₀ = model.base_width: as at the base width
  (microsoft/mup's MuReadout rescales its SP init by √m to exactly this), so the head's learned update, not its
  init, sets the logits as the width grows (a tied head is the embedding table: N(0, 1/D₀) already).
- pytorch: what PyTorch's modules do by default (nn.MultiheadAttention, nn.Linear, nn.Embedding): Xavier-uniform
  over the fused q/k/v block [D, N·H + 2·K·H]; the attention output, the FFN matrices and an untied head
  kaiming-uniform(a=√5), i.e. U(±1/√fan_in) (the head's fan-in D₀ under µP); FFN biases U(±1/√fan_in); attention biases 0; embeddings N(0, 1).
- gpt2: every matrix and embedding N(0, 0.02²), the residual outputs (attention o, FFN w2) N(0, (0.02/√(2L))²)
  with L all the model's layers; biases 0.

Norm scales start at 1 and biases (but pytorch's FFN ones) at 0 in every scheme; a MoE router is Glorot-uniform
in every scheme but gpt2 (no reference scheme has one).

With model.norm.position="deepnorm" (DeepNet, Wang et al. 2022) the v, o and FFN matrices of every scheme are
scaled by the stack's β, and the residual by its α (`deepnorm`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.nn.params import Init, dense_init

SCHEMES = ("glorot", "pytorch", "gpt2")


def _uniform(bound: float) -> Init:
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def _normal(std: float) -> Init:
    return jax.nn.initializers.normal(std)


def deepnorm(cfg, stack: str) -> tuple[float, float]:
    """DeepNet's (α, β) for the "encoder" or "decoder" stack: decoder-only (or encoder-only) α = (2L)^¼,
    β = (8L)^-¼; an encoder-decoder of N encoder and M decoder layers: encoder α = 0.81 (N⁴M)^1/16,
    β = 0.87 (N⁴M)^-1/16, decoder α = (3M)^¼, β = (12M)^-¼."""
    n, m = cfg.num_encoder_layers, cfg.num_decoder_layers
    if cfg.arch != "encoder_decoder":
        return (2 * m) ** 0.25, (8 * m) ** -0.25
    if stack == "encoder":
        return 0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)
    return (3 * m) ** 0.25, (12 * m) ** -0.25


def weight(cfg, role: str, experts: bool = False, stack: str = "decoder") -> Init:
    """The initializer of a weight by role: q, k, v [D,N|K,H]; o [N,H,D]; ffn_in (w1, wg) [D,F]; ffn_out (w2)
    [F,D] (experts=True: a leading E axis); router [D,E]; embed [V,D]; head [D,V]; positions [P,D]. stack: the
    block's stack ("encoder" | "decoder"), for DeepNorm's β."""
    base = _weight(cfg, role, experts)
    if cfg.norm.position == "deepnorm" and role in ("v", "o", "ffn_in", "ffn_out"):
        beta = deepnorm(cfg, stack)[1]
        return lambda key, shape, dtype=jnp.float32: beta * base(key, shape, dtype)
    return base


def _weight(cfg, role: str, experts: bool) -> Init:
    scheme = cfg.runtime.init
    d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff
    base = d / cfg.width_mult                   # D₀ under µP (model.base_width), else D
    e = 1 if experts else 0                      # the expert axis comes first
    if role == "router":
        return _normal(0.02) if scheme == "gpt2" else dense_init(0, 1)
    if scheme == "glorot":
        return {"q": dense_init(0, (1, 2)), "k": dense_init(0, (1, 2)), "v": dense_init(0, (1, 2)),
                "o": dense_init((0, 1), 2), "ffn_in": dense_init(e, e + 1, (0,) if experts else ()),
                "ffn_out": dense_init(e, e + 1, (0,) if experts else ()),
                "embed": _normal(base ** -0.5), "head": _normal(base ** -0.5),   # µP: as at the base width
                "positions": _normal(0.02)}[role]
    if scheme == "pytorch":
        fan_in = {"o": n * h, "ffn_in": d, "ffn_out": f, "head": base}
        if role in ("q", "k", "v"):
            return _uniform(math.sqrt(6.0 / (d + n * h + 2 * k * h)))
        if role in fan_in:
            return _uniform(1.0 / math.sqrt(fan_in[role]))
        return _normal(1.0)                                              # embed, positions: nn.Embedding
    layers = cfg.num_decoder_layers + (cfg.num_encoder_layers if cfg.arch == "encoder_decoder" else 0)
    return _normal(0.02 / math.sqrt(2 * layers) if role in ("o", "ffn_out") else 0.02)


def bias(cfg, role: str) -> Init:
    """The initializer of an FFN bias: ffn_in (b1, bg; fan-in D) or ffn_out (b2; fan-in F): U(±1/√fan_in) under
    pytorch, else 0. Attention biases are always 0."""
    if cfg.runtime.init == "pytorch":
        return _uniform(1.0 / math.sqrt(cfg.d_model if role == "ffn_in" else cfg.d_ff))
    return jax.nn.initializers.zeros
