"""Mixture-of-Experts FFN as pure functions: a float32 router, top-1/top-2 choice, expert FFNs run either with a
fixed capacity per expert (tokens over it are dropped) or dropless (grouped matmuls, `jax.lax.ragged_dot`),
and the router's auxiliary losses.

Axis legend (besides the package's): M tokens (B·T flattened), E experts, C capacity (slots per expert),
A assignments (M·top_k), D model width, F FFN width.

Semantics, as Switch Transformer (top-1) and GShard/Mixtral (top-2):
- router: probs = softmax(x·Wr) in float32; each token picks its top_k experts; the combine weight is the
  router probability for top_k=1 and the top-2 probabilities renormalised to sum 1 for top_k=2.
- capacity mode: C = ceil(capacity_factor · M · top_k / E). Slots are filled in priority order: every token's
  first choice before any second choice, earlier tokens first. An assignment over capacity is dropped: that
  token gets nothing from that expert (with a residual connection around the FFN, a token dropped by all its
  experts passes through unchanged).
- dropless mode (capacity_factor=0): every assignment is computed, either (dropless="ragged") with tokens sorted
  by expert and the experts run as grouped matmuls over the sorted rows (M·k rows of work), or
  (dropless="padded") as the capacity mode with C = M slots, which no expert can overflow (E·M rows of work, as
  plain batched matmuls: for where grouped matmuls are slow, e.g. XLA:CPU, while E/k is small; the two modes'
  forward pass: docs/ablations/moe.md, "ragged" against "padded").
- invalid tokens (padding; `valid` False) take no slot, output zeros and count in no statistic or loss.
Both modes work under jit and grad; the capacity mode also under vmap. The dropless mode does not vmap
(`jax.lax.ragged_dot` has no batching rule in JAX 0.10): flatten token groups into M instead.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.ops import activations


class Routing(NamedTuple):
    """The router's decision for M tokens (`route`), computed in float32.

    Attributes:
      probs: [M, E] float32 router probabilities.
      experts: [M, k] int32 chosen experts, best first.
      gates: [M, k] float32 combine gates: each chosen expert's share (0 for invalid tokens).
      logits: [M, E] float32 router logits.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import route
      >>> r = route(jnp.array([[1.0, 0.0], [0.0, 1.0]]), 2.0 * jnp.eye(2), top_k=1)   # M=2 tokens, E=2 experts
      >>> r.probs.shape, r.experts.shape, r.gates.shape, r.logits.shape
      ((2, 2), (2, 1), (2, 1), (2, 2))
    """
    probs: jax.Array      # [M,E] float32 router probabilities
    experts: jax.Array    # [M,k] int32 chosen experts, best first
    gates: jax.Array      # [M,k] float32 combine gates: each chosen expert's share (0 for invalid tokens)
    logits: jax.Array     # [M,E] float32 router logits


def route(x: jax.Array, router: jax.Array, top_k: int, valid: jax.Array | None = None) -> Routing:
    """Route M tokens to their top_k experts, computed in float32 whatever x's dtype: probs = softmax(x·router);
    the combine gate is the router probability for top_k=1 and the top-2 probabilities renormalised to sum 1 for
    top_k=2.

    Args:
      x: [M, D] tokens.
      router: [D, E] router weights.
      top_k: experts per token, 1 or 2.
      valid: [M] bool, False for tokens that take no expert (gates 0), or None (all valid).

    Returns:
      `Routing(probs, experts, gates, logits)`: probs [M, E] float32, experts [M, k] int32 (best first),
        gates [M, k] float32, logits [M, E] float32.

    Raises:
      ValueError: top_k is not 1 or 2.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import route
      >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0]])                  # M=2 tokens, D=2
      >>> r = route(x, 2.0 * jnp.eye(2), top_k=1)                  # E=2 experts
      >>> r.experts.tolist(), [round(g, 3) for g in r.gates[:, 0].tolist()]
      ([[0], [1]], [0.881, 0.881])
    """
    if top_k not in (1, 2):
        raise ValueError(f"top_k={top_k} must be 1 or 2")
    logits = jnp.einsum("MD,DE->ME", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = jax.lax.top_k(probs, top_k)                                    # [M,k]
    gates = top if top_k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    if valid is not None:
        gates = jnp.where(valid[:, None], gates, 0.0)
    return Routing(probs, experts.astype(jnp.int32), gates, logits)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor · M · top_k / E), at least 1.

    Args:
      num_tokens: M.
      num_experts: E.
      top_k: experts per token.
      capacity_factor: slots per expert relative to an even share of the assignments.

    Returns:
      C, a Python int.

    Examples:
      >>> from jaxformer.ops.moe import capacity
      >>> capacity(num_tokens=8, num_experts=4, top_k=2, capacity_factor=1.25)
      5
    """
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def load_balancing_loss(r: Routing, valid: jax.Array | None = None) -> jax.Array:
    """Switch Transformer's auxiliary loss, E · Σ_e f_e · P_e, where f_e is the fraction of assignments routed
    to expert e (all top_k choices, before any capacity drop) and P_e the mean router probability of e, both
    over valid tokens. 1 when routing is uniform; multiply by α (0.01 in the paper) in the objective.

    Args:
      r: the `Routing` of M tokens over E experts.
      valid: [M] bool tokens counted, or None (all).

    Returns:
      [] float32 loss.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import load_balancing_loss, route
      >>> r = route(jnp.array([[1.0, 0.0], [0.0, 1.0]]), 2.0 * jnp.eye(2), top_k=1)
      >>> round(float(load_balancing_loss(r)), 4)                   # one token per expert: balanced
      1.0
    """
    m, e = r.probs.shape
    w = jnp.ones((m,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    chosen = jax.nn.one_hot(r.experts, e, dtype=jnp.float32).sum(1)              # [M,E] assignments per expert
    f = jnp.einsum("M,ME->E", w, chosen) / (n * r.experts.shape[1])
    p = jnp.einsum("M,ME->E", w, r.probs) / n
    return e * jnp.sum(f * p)


def router_z_loss(r: Routing, valid: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: mean over valid tokens of logsumexp(logits)².

    Args:
      r: the `Routing` of M tokens over E experts.
      valid: [M] bool tokens counted, or None (all).

    Returns:
      [] float32 loss (0 when no token is valid).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import route, router_z_loss
      >>> r = route(jnp.array([[1.0, 0.0], [0.0, 1.0]]), 2.0 * jnp.eye(2), top_k=1)   # logits [2, 0], [0, 2]
      >>> round(float(router_z_loss(r)), 4)                         # log(e² + 1)²
      4.5238
    """
    z = jax.nn.logsumexp(r.logits, axis=-1) ** 2
    if valid is None:
        return z.mean()
    w = valid.astype(jnp.float32)
    return jnp.sum(z * w) / jnp.maximum(w.sum(), 1.0)


def _slots(r: Routing, num_experts: int, cap: int, valid: jax.Array | None):
    """Each assignment's slot in its expert's queue, filled choice-major (all first choices, then seconds).
    -> (slot [M,k] int32, kept [M,k] bool)."""
    m, k = r.experts.shape
    onehot = jax.nn.one_hot(r.experts.T, num_experts, dtype=jnp.int32)            # [k,M,E] choice-major
    if valid is not None:
        onehot = onehot * valid[None, :, None].astype(jnp.int32)
    flat = onehot.reshape(k * m, num_experts)
    slot = (jnp.cumsum(flat, axis=0) - 1) * flat                                   # queue position, 0-based
    slot = slot.sum(-1).reshape(k, m).T                                            # [M,k]
    kept = (flat.sum(-1).reshape(k, m).T > 0) & (slot < cap)
    return slot, kept


def _expert_ffn(h_in, w1, w2, activation, b1=None, b2=None, wg=None, bg=None, matmul=None):
    """The E expert FFNs over their rows. matmul(x, w) applies each expert's [D,F] or [F,D] weight."""
    h = matmul(h_in, w1) + (b1 if b1 is not None else 0)
    if activation in activations.GATED:
        g = matmul(h_in, wg) + (bg if bg is not None else 0)
        h = activations.GATED[activation](g, h)
    else:
        h = activations.UNGATED[activation](h)
    return matmul(h, w2) + (b2 if b2 is not None else 0)


class MoEStats(NamedTuple):
    """What `moe_ffn` reports beside its output: the router's auxiliary losses and the experts' load.

    Attributes:
      balance: [] `load_balancing_loss`.
      z: [] `router_z_loss`.
      load: [E] fraction of valid assignments routed to each expert (before drops).
      dropped: [] fraction of valid assignments dropped for capacity (0 when dropless).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import moe_ffn
      >>> x, router = jnp.ones((4, 2)), jnp.zeros((2, 3))           # M=4 tokens, D=2, E=3 experts
      >>> w1, w2 = jnp.ones((3, 2, 5)), jnp.ones((3, 5, 2))         # F=5
      >>> _, stats = jax.jit(moe_ffn)(x, router, w1, w2)            # all 4 tie: expert 0 (capacity 2)
      >>> [round(f, 3) for f in stats.load.tolist()], float(stats.dropped)
      ([1.0, 0.0, 0.0], 0.5)
    """
    balance: jax.Array    # [] load_balancing_loss
    z: jax.Array          # [] router_z_loss
    load: jax.Array       # [E] fraction of valid assignments routed to each expert (before drops)
    dropped: jax.Array    # [] fraction of valid assignments dropped for capacity (0 when dropless)


def moe_ffn(x: jax.Array, router: jax.Array, w1: jax.Array, w2: jax.Array, *, top_k: int = 1,
            capacity_factor: float = 1.25, activation: str = "relu", valid: jax.Array | None = None,
            b1=None, b2=None, wg=None, bg=None, dropless: str = "ragged") -> tuple[jax.Array, MoEStats]:
    """Mixture-of-Experts FFN: each token through its top_k experts' FFNs, weighted by its gates (see the module
    docstring for capacity, dropping and the dropless modes). capacity_factor > 0: fixed capacity with dropping;
    0: dropless, computed as `dropless` says ("ragged" | "padded").

    Args:
      x: [M, D] tokens.
      router: [D, E] router weights.
      w1: [E, D, F] the experts' first (up) projections.
      w2: [E, F, D] the experts' second (down) projections.
      top_k: experts per token, 1 or 2.
      capacity_factor: slots per expert relative to an even share (`capacity`); 0: dropless.
      activation: an FFN activation name of `ops.activations` (a gated one uses wg).
      valid: [M] bool, False for padding tokens (no slot, output zeros, in no statistic), or None (all valid).
      b1: optional [E, F] bias of w1.
      b2: optional [E, D] bias of w2.
      wg: [E, D, F] the experts' gate projections, for a gated activation.
      bg: optional [E, F] bias of wg.
      dropless: how capacity_factor=0 is computed: "ragged" (grouped matmuls) or "padded" (C = M slots).

    Returns:
      y: [M, D] in x's dtype.
      stats: `MoEStats(balance [], z [], load [E], dropped [])`.

    Raises:
      ValueError: dropless is not "ragged" or "padded", or top_k is not 1 or 2.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jaxformer.ops.moe import moe_ffn
      >>> x, router = jnp.ones((4, 2)), jnp.zeros((2, 3))           # M=4 tokens, D=2, E=3 experts
      >>> w1, w2 = jnp.ones((3, 2, 5)), jnp.ones((3, 5, 2))         # F=5
      >>> y, stats = jax.jit(moe_ffn)(x, router, w1, w2)            # top_k=1, capacity ceil(1.25·4/3) = 2
      >>> y.shape, [round(v, 3) for v in y[:, 0].tolist()]          # tokens over capacity: dropped, zeros
      ((4, 2), [3.333, 3.333, 0.0, 0.0])
    """
    if dropless not in ("ragged", "padded"):
        raise ValueError(f"dropless={dropless!r} must be 'ragged' or 'padded'")
    m, _ = x.shape
    e = router.shape[1]
    r = route(x, router, top_k, valid)
    w = jnp.ones((m,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    n_assign = jnp.maximum(w.sum() * top_k, 1.0)
    chosen = jnp.einsum("M,MkE->E", w, jax.nn.one_hot(r.experts, e, dtype=jnp.float32))
    cast = lambda a: None if a is None else a.astype(x.dtype)
    b1, b2, wg, bg = cast(b1), cast(b2), cast(wg), cast(bg)
    if capacity_factor > 0 or dropless == "padded":
        cap = capacity(m, e, top_k, capacity_factor) if capacity_factor > 0 else m       # C = M: nothing drops
        slot, kept = _slots(r, e, cap, valid)
        # each kept assignment's row in the [E·C] expert buffer; dropped ones point past its end (E·C)
        row = jnp.where(kept, r.experts * cap + slot, e * cap).reshape(-1)                 # [A] token-major
        xs = jnp.broadcast_to(x[:, None, :], (m, top_k, x.shape[1])).reshape(m * top_k, -1)
        xe = jnp.zeros((e * cap, x.shape[1]), x.dtype).at[row].set(xs, mode="drop").reshape(e, cap, -1)
        mm = lambda h, wt: jnp.einsum("ECX,EXY->ECY", h, wt.astype(x.dtype))
        ye = _expert_ffn(xe, w1, w2, activation, None if b1 is None else b1[:, None], None if b2 is None
                         else b2[:, None], wg, None if bg is None else bg[:, None], matmul=mm)    # [E,C,D]
        back = jnp.take(ye.reshape(e * cap, -1), row, axis=0, mode="fill", fill_value=0)    # [A,D]
        w_kept = (r.gates * kept).astype(x.dtype).reshape(-1, 1)
        y = (back * w_kept).reshape(m, top_k, -1).sum(1)
        dropped = 1.0 - jnp.einsum("M,Mk->", w, kept.astype(jnp.float32)) / n_assign
    else:
        flat = r.experts.reshape(-1)                                                      # [A] token-major
        order = jnp.argsort(flat, stable=True)
        tokens = order // top_k                                                           # [A] source row
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)                            # [E]
        xs = x[tokens]                                                                    # [A,D] sorted by expert
        gid = flat[order]
        mm = lambda h, wt: jax.lax.ragged_dot(h, wt.astype(x.dtype), sizes)
        ys = _expert_ffn(xs, w1, w2, activation, None if b1 is None else b1[gid], None if b2 is None
                         else b2[gid], wg, None if bg is None else bg[gid], matmul=mm)    # [A,D]
        ys = ys * r.gates.reshape(-1)[order][:, None].astype(x.dtype)
        y = jnp.zeros_like(x).at[tokens].add(ys)
        dropped = jnp.zeros((), jnp.float32)
    stats = MoEStats(load_balancing_loss(r, valid), router_z_loss(r, valid), chosen / n_assign, dropped)
    return y.astype(x.dtype), stats
