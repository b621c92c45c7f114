"""Positional encodings: sinusoidal table, RoPE, ALiBi.

Axis legend: B batch, T length, N heads, H head dim, D model width.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("sinusoidal", "learned", "rope", "alibi", "none")


def sinusoidal_table(max_len: int, d_model: int, dtype=jnp.float32) -> jax.Array:
    """[max_len, D] table, PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...).

    Computed in float64 with NumPy (seed 000: in float32 the high-frequency terms lose precision at
    large positions), then cast to `dtype`. It is a constant, not a parameter.

    Args:
      max_len: number of positions (rows), > 0.
      d_model: model width D (columns), > 0.
      dtype: the table's dtype.

    Returns:
      [max_len, D] table in `dtype`.

    Raises:
      ValueError: max_len or d_model is not positive.

    Examples:
      >>> from jaxformer.ops.positional import sinusoidal_table
      >>> pe = sinusoidal_table(3, 4)
      >>> pe.shape, [round(x, 3) for x in pe[2].tolist()]        # position 2: sin, cos, sin, cos
      ((3, 4), [0.909, -0.416, 0.02, 1.0])
    """
    if max_len <= 0 or d_model <= 0:
        raise ValueError(f"max_len and d_model must be positive; got {max_len}, {d_model}")
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    pe = np.zeros((max_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)[:, : d_model // 2]
    return jnp.asarray(pe, dtype=dtype)


SCALINGS = ("none", "linear", "llama3", "yarn", "dynamic")


class RopeScaling(NamedTuple):
    """How RoPE's frequencies are rescaled for a longer context. kind "linear": every frequency / factor
    (positions interpolated); "llama3" (Llama 3.1): wavelengths longer than original_max_len / low_freq_factor
    are divided by factor, those shorter than original_max_len / high_freq_factor kept, and the band between
    interpolated smoothly; "dynamic" (dynamic NTK): once a call's positions reach past original_max_len, the base
    grows to base·(factor·L/original_max_len − (factor − 1))^(H/(H−2)), L = the call's largest position + 1 (each
    call's own L, as transformers computes it for a model that has not seen a longer call); "yarn" (Peng et al.
    2023, as transformers computes it): dimensions that turn fewer than
    beta_slow times over original_max_len interpolated (/ factor), more than beta_fast times kept, a linear ramp
    between (its ends rounded outwards when truncate), and cos/sin scaled by attention_factor (0: 0.1·ln(factor)
    + 1), so every attention logit by its square.

    Attributes:
      kind: one of SCALINGS: "none", "linear", "llama3", "yarn" or "dynamic".
      factor: the context extension factor.
      original_max_len: the context length the model was trained at.
      low_freq_factor: "llama3": wavelengths longer than original_max_len / low_freq_factor are divided by factor.
      high_freq_factor: "llama3": wavelengths shorter than original_max_len / high_freq_factor are kept.
      beta_fast: "yarn": dimensions turning more than beta_fast times over original_max_len are kept.
      beta_slow: "yarn": dimensions turning fewer than beta_slow times are interpolated.
      attention_factor: "yarn": what cos/sin are scaled by (0: 0.1·ln(factor) + 1).
      truncate: "yarn": round the ramp's ends outwards.

    Examples:
      >>> from jaxformer.ops.positional import RopeScaling, rope_frequencies
      >>> [round(f, 4) for f in rope_frequencies(4).tolist()]
      [1.0, 0.01]
      >>> [round(f, 4) for f in rope_frequencies(4, scaling=RopeScaling("linear", factor=4.0)).tolist()]
      [0.25, 0.0025]
    """
    kind: str
    factor: float = 1.0
    original_max_len: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    truncate: bool = True


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1·ln(factor) + 1 for factor > 1),
    else 1.

    Args:
      scaling: the RoPE scaling, or None.

    Returns:
      The factor, a Python float (1.0 unless scaling is "yarn").

    Examples:
      >>> from jaxformer.ops.positional import RopeScaling, rope_attention_factor
      >>> round(rope_attention_factor(RopeScaling("yarn", factor=4.0)), 4), rope_attention_factor(None)
      (1.1386, 1.0)
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor:
        return float(scaling.attention_factor)
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def _dynamic_ntk(head_dim: int, base: float, s: RopeScaling, positions: jax.Array) -> jax.Array:
    """[H/2] frequencies of dynamic NTK scaling for a call at `positions` (traced: no host read)."""
    m = float(s.original_max_len)
    length = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1.0, m)
    grown = base * (s.factor * length / m - (s.factor - 1.0)) ** (head_dim / (head_dim - 2))
    return 1.0 / (grown ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def _yarn(inv: jax.Array, head_dim: int, base: float, s: RopeScaling) -> jax.Array:
    def dim_of(rotations: float) -> float:       # the dimension that turns `rotations` times over original_max_len
        return head_dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    keep = 1.0 - jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv / s.factor * (1.0 - keep) + inv * keep


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None) -> jax.Array:
    """[H/2] inverse frequencies base^(-2i/H), rescaled by `scaling` when given.

    Args:
      head_dim: head dim H, even.
      base: the RoPE base (theta).
      scaling: how the frequencies are rescaled for a longer context (`RopeScaling`), or None. "dynamic" returns
        the unscaled frequencies: `apply_rope` rescales the base from the call's positions.

    Returns:
      [H/2] float32 inverse frequencies.

    Raises:
      ValueError: an odd head_dim, or an unknown scaling kind.

    Examples:
      >>> from jaxformer.ops.positional import rope_frequencies
      >>> [round(f, 4) for f in rope_frequencies(8).tolist()]
      [1.0, 0.1, 0.01, 0.001]
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim H; got H={head_dim}")
    inv = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None or scaling.kind == "none":
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        s = scaling
        wavelen = 2 * math.pi / inv
        low, high = s.original_max_len / s.low_freq_factor, s.original_max_len / s.high_freq_factor
        smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        mid = (1 - smooth) * inv / s.factor + smooth * inv
        return jnp.where(wavelen > low, inv / s.factor, jnp.where(wavelen < high, inv, mid))
    if scaling.kind == "yarn":
        return _yarn(inv, head_dim, base, scaling)
    if scaling.kind == "dynamic":
        return inv                                        # apply_rope rescales the base from the call's positions
    raise ValueError(f"RoPE scaling {scaling.kind!r} is not one of {SCALINGS}")


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0,
               scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding (half-split convention, as GPT-NeoX/Llama).

    Rotation is computed in float32. q·k after RoPE depends only on the position difference. With YaRN scaling,
    cos and sin carry its attention factor (`rope_attention_factor`), as transformers applies it.

    Args:
      x: [B, T, N, H] queries or keys (H even).
      positions: [B, T] or [T] integer absolute positions.
      base: the RoPE base (theta).
      scaling: how the frequencies are rescaled for a longer context (`RopeScaling`), or None.

    Returns:
      [B, T, N, H] in x's dtype.

    Raises:
      TypeError: positions are not integers.
      ValueError: an odd head dim H, or an unknown scaling kind.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.positional import apply_rope
      >>> q = apply_rope(jnp.ones((1, 3, 1, 4)), jnp.arange(3))
      >>> k = apply_rope(jnp.ones((1, 3, 1, 4)), jnp.arange(3) + 5)           # every position shifted by 5
      >>> q.shape, bool(jnp.allclose(q[0, 2] @ q[0, 0].T, k[0, 2] @ k[0, 0].T, atol=1e-5))
      ((1, 3, 1, 4), True)
    """
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be integers; got dtype {positions.dtype}")
    h = x.shape[-1]
    inv = rope_frequencies(h, base, scaling)
    if scaling is not None and scaling.kind == "dynamic":
        inv = _dynamic_ntk(h, base, scaling, positions)
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B,T,H/2] or [T,H/2]
    if ang.ndim == 2:
        ang = ang[None]
    af = rope_attention_factor(scaling)
    sin, cos = af * jnp.sin(ang)[:, :, None, :], af * jnp.cos(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> jax.Array:
    """[N] ALiBi head slopes (Press et al. 2022), geometric; non-powers of two as in the paper's code.

    Args:
      num_heads: number of heads N.

    Returns:
      [N] float32 slopes.

    Examples:
      >>> from jaxformer.ops.positional import alibi_slopes
      >>> alibi_slopes(4).tolist()
      [0.25, 0.0625, 0.015625, 0.00390625]
    """
    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(num_heads).is_integer():
        slopes = pow2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, dtype=jnp.float32)


def alibi_bias(num_heads: int, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """ALiBi's additive attention bias −slope·|q − k|, one slope per head (`alibi_slopes`).

    Args:
      num_heads: number of heads N.
      q_positions: [B, T] int query positions.
      k_positions: [B, S] int key positions.

    Returns:
      [B, N, T, S] float32 bias −slope·|q − k|.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.positional import alibi_bias
      >>> pos = jnp.arange(3)[None]
      >>> b = alibi_bias(4, pos, pos)
      >>> b.shape, b[0, 0, 2].tolist()                    # head 0 (slope 1/4), query 2
      ((1, 4, 3, 3), [-0.5, -0.25, -0.0])
    """
    dist = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)  # [B,T,S]
    return -alibi_slopes(num_heads)[None, :, None, None] * dist[:, None]


class AlibiBias(NamedTuple):
    """A lazy `alibi_bias`: −slope_n·|q − k| built on demand. `materialize()` gives [B,N,T,S]; the chunked attention
    backend builds it one tile at a time (`tile`), never the whole [B,N,T,S] array.

    Attributes:
      slopes: [N] float32 head slopes (`alibi_slopes`).
      q_positions: [B, T] int query positions.
      k_positions: [B, S] int key positions.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.positional import AlibiBias, alibi_bias, alibi_slopes
      >>> pos = jnp.arange(3)[None]
      >>> lazy = AlibiBias(alibi_slopes(4), pos, pos)
      >>> lazy.shape, bool(jnp.array_equal(lazy.materialize(), alibi_bias(4, pos, pos)))
      ((1, 4, 3, 3), True)
    """
    slopes: jax.Array
    q_positions: jax.Array
    k_positions: jax.Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The materialised bias's shape (B, N, T, S)."""
        return (self.q_positions.shape[0], self.slopes.shape[0], self.q_positions.shape[1],
                self.k_positions.shape[1])

    def _bias(self, qp: jax.Array, kp: jax.Array) -> jax.Array:
        dist = jnp.abs(qp[:, :, None] - kp[:, None, :]).astype(jnp.float32)
        return -self.slopes.astype(jnp.float32)[None, :, None, None] * dist[:, None]

    def materialize(self) -> jax.Array:
        """The whole bias as an array.

        Returns:
          [B, N, T, S] float32.
        """
        return self._bias(self.q_positions, self.k_positions)

    def tile(self, q0, tq: int, k0, tk: int) -> jax.Array:
        """The [B,N,tq,tk] tile at query q0, key k0.

        Args:
          q0: first query index of the tile (an int, may be traced).
          tq: number of queries in the tile.
          k0: first key index of the tile (an int, may be traced).
          tk: number of keys in the tile.

        Returns:
          [B, N, tq, tk] float32.
        """
        return self._bias(jax.lax.dynamic_slice_in_dim(self.q_positions, q0, tq, axis=1),
                          jax.lax.dynamic_slice_in_dim(self.k_positions, k0, tk, axis=1))

    def pad(self, t: int, s: int) -> "AlibiBias":
        """The same bias over t >= T queries and s >= S keys (zeros' positions for the extra ones).

        Args:
          t: the new number of queries, >= T.
          s: the new number of keys, >= S.

        Returns:
          An `AlibiBias` of shape [B, N, t, s].
        """
        grow = lambda x, n: x if x.shape[1] == n else jnp.pad(x, [(0, 0), (0, n - x.shape[1])])
        return AlibiBias(self.slopes, grow(self.q_positions, t), grow(self.k_positions, s))
