"""Mixture of Experts against dense FFNs on the tiny-Shakespeare character model (seed 004: "MoE: the parameters
double, the inference compute hardly changes"). Three arms: the dense model; MoE with 4 experts of half the
width, each token routed to 2 (its active FFN equals the dense one, its FFN parameters double); a dense model with
the MoE's total FFN parameters (d_ff doubled)."""
import time

from jaxformer.stats import difference, equivalence
from jaxformer.sweep import Sweep

MARGIN = 0.05       # nats per character: a best held-out loss difference we call negligible (~2% of the loss)

ARMS = ({"name": "dense d_ff=512"},
        {"name": "MoE 4 experts × d_ff=256, top-2", "model.ffn": "moe", "model.moe.num_experts": 4,
         "model.moe.top_k": 2,
         "model.d_ff": 256},
        {"name": "dense d_ff=1024", "model.d_ff": 1024})


def _forward_ms(cfg) -> float:
    """Median ms of the jitted forward pass (inference) on one batch of the config's shape, random weights."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxformer.nn import build_model
    graphdef, state = nnx.split(build_model(cfg.model))
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    x = jax.numpy.asarray(np.random.default_rng(0).integers(1, 65, (cfg.data.batch_size, cfg.data.block_size)),
                          jax.numpy.int32)
    fwd(state, x).block_until_ready()
    times = []
    for _ in range(30):
        t = time.perf_counter()
        fwd(state, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def _params_and_forward(rep):
    """Per arm: total and active parameters, and the forward pass's median ms on one batch (inference, this
    machine, now); for the MoE with its dropless experts computed both ways (model.runtime.moe_dropless)."""
    from jaxformer.configio import apply_overrides
    from jaxformer.nn import build_model, count_params
    from jaxformer.sweep import _fmt, base_config

    out = {}
    for arm in rep.arms:
        cfg = apply_overrides(base_config(rep.sweep), [f"{k}={_fmt(v)}" for k, v in arm.values.items()]
                              + ["model.vocab_size=65"])
        n = count_params(build_model(cfg.model))
        out[arm.name] = {"total": n["total"], "active": n.get("active per token", n["total"]),
                         "ffn": sum(v for k, v in n.items() if "FFN" in k), "forward_ms": _forward_ms(cfg)}
        if cfg.model.ffn == "moe":
            out[arm.name]["forward_padded_ms"] = _forward_ms(apply_overrides(cfg,
                                                                             ["model.runtime.moe_dropless=padded"]))
    return out


def summary(rep) -> str:
    info = rep.info or _params_and_forward(rep)           # from moe_info.json when rebuilt from the CSVs
    rep.info = info
    dense, moe, big = rep.arms
    i_d, i_m, i_b = info[dense.name], info[moe.name], info[big.name]
    l_d, l_m, l_b = (rep.stat("best held-out loss", a) for a in rep.arms)
    t_d, t_m, t_b = (rep.stat("train tokens/s", a) for a in rep.arms)

    def vs(a, b):          # MoE − dense on the best held-out loss, against the declared margin
        return equivalence(difference(rep.values("best held-out loss", a), rep.values("best held-out loss", b)),
                           MARGIN)
    train_ratio, fwd_ratio = t_m.mean / t_d.mean, i_d["forward_ms"] / i_m["forward_padded_ms"]
    return "\n".join([
        f"- Parameters: MoE {i_m['total']:,} total, {i_m['active']:,} active per token; dense d_ff=512 "
        f"{i_d['total']:,} ({i_m['total'] / i_d['total']:.2f}× total; FFN parameters {i_m['ffn'] / i_d['ffn']:.2f}×); "
        f"dense d_ff=1024 {i_b['total']:,}.",
        f"- Compute: the MoE's active parameters are {i_m['active'] / i_d['total']:.3f}× the dense model's (the "
        f"router adds {i_m['active'] - i_d['total']:,}). Measured on this CPU: training throughput "
        f"{train_ratio:.2f}× the dense model's ({t_m.fmt()} vs {t_d.fmt()} tokens/s, each run's median "
        f"over its logged intervals); dense d_ff=1024 trains at {t_b.mean / t_d.mean:.2f}×. Forward pass "
        f"(inference, dropless): {i_m['forward_ms']:.1f} ms with grouped matmuls (`jax.lax.ragged_dot`, slow on "
        f"XLA:CPU), {i_m['forward_padded_ms']:.1f} ms padded (every expert over every token, 2× the FLOPs), "
        f"vs {i_d['forward_ms']:.1f} ms dense.",
        f"- Quality: best held-out loss MoE {l_m.fmt()}, dense equal-active {l_d.fmt()} (MoE − dense: "
        f"{vs(moe, dense)}), dense equal-total {l_b.fmt()} (MoE − dense: {vs(moe, big)}); equal means within "
        f"±{MARGIN} nats on the 95% (Welch) interval of the difference.",
        "- Seed 004's claim \"twice the parameters, about the same compute\": the FFN parameters double and the "
        "active path's FLOPs equal the dense model's, by construction. Measured time: training "
        + (f"about the same ({train_ratio:.2f}×); " if train_ratio >= 0.8 else f"slower ({train_ratio:.2f}×); ")
        + (f"inference about the same ({fwd_ratio:.2f}× at best)." if fwd_ratio >= 0.8 else
           f"inference slower ({fwd_ratio:.2f}× the dense speed at best): routing, sorting/scattering tokens to "
           "experts and gathering them back cost more than the matmuls at this size on a CPU."),
    ])


def extra(rep) -> str:
    info = getattr(rep, "info", None) or _params_and_forward(rep)
    rows = ["| arm | parameters | active per token | FFN parameters | forward ms (batch 12 × 64) |",
            "|---|---:|---:|---:|---:|"]
    for k, v in info.items():
        fwd = f"{v['forward_ms']:.2f}" + (f" ragged, {v['forward_padded_ms']:.2f} padded" if "forward_padded_ms" in v
                                          else "")
        rows.append(f"| {k} | {v['total']:,} | {v['active']:,} | {v['ffn']:,} | {fwd} |")
    return "## Parameters and forward time\n\n" + "\n".join(rows)


def get_sweep():
    return Sweep(
        name="moe", title="Mixture of Experts vs dense FFNs, char model on tiny Shakespeare (seed 004)",
        base="configs/shakespeare_char.py",
        doc="configs/shakespeare_char.py (decoder-only, Pre-LN, GELU, D=128, 4 layers, blocks of 64, batch 12), "
            "1,000 steps (cosine to 0), evaluated every 200 steps on the held-out 10%. MoE on every layer: "
            "Switch/GShard routing in float32, capacity factor 1.25 while training (dropless when evaluating), "
            "balancing loss α = 0.01, router z-loss β = 0.001.",
        arms=ARMS,
        set=("train.steps=1000", "train.eval_every=200", "train.checkpoint_every=1000", "train.num_examples=0"),
        metrics={"best held-out loss": "eval/loss@min", "held-out loss": "eval/loss", "train loss": "train/loss",
                 "train tokens/s": "train/tokens_per_s@median", "dropped (MoE)": "train/moe_dropped",
                 "balance loss (MoE)": "train/moe_balance"},
        curves=("train/loss", "eval/loss"), summary=summary, extra=extra)
