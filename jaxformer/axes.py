"""The one axis table: the mesh's axes, the logical axis names, and the named layouts of the arrays that are
constrained with them. Parameters carry logical names where they are created (`jaxformer.nn.params`); the
rule table mapping logical names onto mesh axes is `jaxformer.parallel.RULES`.

Axis legend: B batch, T query length, S key length / cache slots, D model width, N query heads, K kv heads,
H head dim, F FFN width, V vocab, L layers, E experts.
Stacked layers [L, ...] are split over the "stage" mesh axis (pipeline parallelism: `jaxformer.nn.pipeline`).
"""
from __future__ import annotations

MESH_AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")   # stage: pipeline stages (outermost)

# Logical axis names. "embed" is a parameter's D; "act_embed" is an activation's D.
LOGICAL_AXES = ("batch", "length", "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "layers",
                "act_embed", "cache_slots", "expert")

# Named layouts of activations and caches (what `jaxformer.parallel.constrain` takes).
ACTIVATION = ("batch", "length", "act_embed")                       # the residual stream [B,T,D]
LOGITS = ("batch", "length", "vocab")                               # [B,T,V]
CACHE = ("layers", "batch", "cache_slots", "kv_heads", "head_dim")  # KV cache k, v [L,B,S,K,H]

# Parameter axes that index independent matrices (a quantization scale each), never contracted.
BATCH_LIKE = ("layers", "expert")


def contracted_axes(names: tuple[str, ...]) -> tuple[int, ...]:
    """A projection weight's input (contracted) axes from its logical names: "embed" when it comes first (D -> ...
    projections: wq/wk/wv, w1/wg), else every axis but "embed" (... -> D: wo [N,H,D], w2 [F,D]); "layers" and
    "expert" are never contracted."""
    core = [i for i, n in enumerate(names) if n not in BATCH_LIKE]
    if names[core[0]] == "embed":
        return (core[0],)
    return tuple(i for i in core if names[i] != "embed")
