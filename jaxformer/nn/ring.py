"""Context parallelism in the model: a self-attention's keys and values passed round the active plan's context
axis (parallel.context_attention="ring", `ops.context.ring_attention`) instead of all-gathered by GSPMD.

Axis legend: B batch, T length (of the whole sequence, split over the context axis), N query heads, K kv heads,
H head dim.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxformer.ops.context import ring_attention as ring
from jaxformer.ops.masks import CausalMask
from jaxformer.parallel import active_plan


def over_context(q: jax.Array, k, v, mask, *, scale: float | None, softcap,
                 block_size: int) -> jax.Array | None:
    """Attention by `ops.context.ring_attention` over the active plan's context axis when the plan asks for it
    (parallel.context > 1, parallel.context_attention="ring"), inside a shard_map over the whole mesh (rows over
    the batch axes, T over context, heads over tensor where N and K both split).

    Args:
      q: [B, T, N, H] queries (T: the whole sequence).
      k: [B, T, K, H] keys (a tuple of segments, as a cache gives them: no ring).
      v: [B, T, K, H] values.
      mask: an `ops.masks.CausalMask` over [B, T] (a dense mask: no ring).
      scale: the logits' scale (None: 1/sqrt(H)); a traced one: no ring.
      softcap: the logits' soft-cap (0: none); a traced one: no ring.
      block_size: the chunked backend's tile, as ring_attention's.

    Returns:
      [B, T, N, H] attention output, or None where the ring does not apply (no such plan; keys in segments; a
        dense mask; T not split evenly; a traced per-layer soft-cap or scale): the caller then attends as on one
        device and GSPMD gathers the keys, which gives the same result.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.ring import over_context
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> over_context(q, q, q, None, scale=None, softcap=0.0, block_size=2) is None    # no plan: no ring
      True
    """
    plan = active_plan()
    if (plan is None or plan.mode != "jit" or plan.sizes["context"] == 1 or plan.cfg.context_attention != "ring"
            or not isinstance(mask, CausalMask) or isinstance(k, (tuple, list)) or q.shape[1] != k.shape[1]
            or not all(isinstance(n, (int, float)) for n in (softcap, 1.0 if scale is None else scale))
            or q.shape[1] % plan.sizes["context"]):
        return None
    qs = plan.spec(("batch", "length", "q_heads", "head_dim"), q.shape, strict=False)
    ks = plan.spec(("batch", "length", "kv_heads", "head_dim"), k.shape, strict=False)
    if qs[2] != ks[2]:                                # heads split on one side only: keep every head together
        qs, ks = P(*qs[:2], None, None), P(*ks[:2], None, None)
    rows = P(*qs[:2])
    mspec = jax.tree.map(lambda a: P() if a.ndim == 0 else rows, mask)

    def local(q, k, v, mask):
        return ring(q, k, v, mask, axis="context", scale=scale, softcap=softcap, block_size=block_size)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(qs, ks, ks, mspec), out_specs=qs,
                         check_vma=False)(q, k, v, mask)
