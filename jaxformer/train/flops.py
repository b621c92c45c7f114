"""Model FLOPs utilisation (MFU) on the log line: the model's FLOPs per target token against the devices' peak.

FLOPs per token (as nanoGPT's estimate_mfu, after PaLM's appendix B): 6·P for the matmuls of forward and
backward, P every parameter (a tied embedding counts once: its lookup is free, its head matmul is not), plus
12·L·N·H·T for attention's scores and mixing over a context of T (data.block_size for a language model; the
longest source + target for seq2seq), not halved for causality. MFU = FLOPs per token × target tokens/s ÷
(peak FLOP/s per device × devices). The peak is train.peak_flops when set, else measured once at the start: the
best of 5 timed float32 [1024,1024] matmuls on the first device (a CPU's real peak is higher: XLA:CPU does not
reach it, which makes MFU there an upper bound on what the chip's datasheet would give).

`run_size`: a run's sizes (parameters, tokens, FLOPs by the same formula), which a sweep records for its report's
scaling fits.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.nn import build_model, count_params


def flops_per_token(cfg, params: int) -> float:
    """Training FLOPs per target token of a model with `params` parameters under `cfg` (a resolved Config)."""
    m = cfg.model
    layers = m.num_decoder_layers + (m.num_encoder_layers if m.arch == "encoder_decoder" else 0)
    context = cfg.data.block_size if m.arch == "decoder_only" else 2 * (cfg.data.eval_lengths[1] + 1)
    return 6.0 * params + 12.0 * layers * m.num_heads * m.head_size * context


def run_size(cfg) -> dict[str, float]:
    """A run's sizes from its resolved Config (`cfg`), the axes of a scaling fit (jaxformer.scaling.AXES):
    "params" (`count_params` on the abstract model: no weights allocated), "non_embedding_params" (without the
    token embedding, learned positions and an untied head: Kaplan et al.'s N), "tokens" (train.steps ×
    data.batch_size × data.block_size: rows × positions per step) and "flops" (tokens × `flops_per_token`)."""
    counts = count_params(nnx.eval_shape(lambda: build_model(cfg.model)))
    embedding = sum(counts.get(k, 0) for k in ("embedding", "learned positions", "output head"))
    tokens = cfg.train.steps * cfg.data.batch_size * cfg.data.block_size
    return {"params": float(counts["total"]), "non_embedding_params": float(counts["total"] - embedding),
            "tokens": float(tokens), "flops": float(tokens * flops_per_token(cfg, counts["total"]))}


def measure_peak_flops(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of the first device on a float32 [n,n] @ [n,n] matmul: the best of `reps` timed calls."""
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), jnp.float32)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / max(best, 1e-9)
