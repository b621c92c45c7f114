"""Attention logits scaled by 1/sqrt(H) vs not scaled, as the head dim H grows (D=128 fixed: N = 16, 4, 1)."""
from jaxformer.stats import difference
from jaxformer.sweep import Sweep

HEADS = (16, 4, 1)          # H = 128 / N = 8, 32, 128


def summary(rep) -> str:
    lines, slower = [], []
    for n in HEADS:
        arm = lambda sc: rep.select(num_heads=n, attention_scale=sc)[0]
        st = {sc: (rep.stat("train loss", arm(sc)), rep.stat("best held-out loss", arm(sc)),
                   rep.stat("failed", arm(sc))) for sc in ("rsqrt", "none")}
        (ts, hs, _), (tu, hu, fu) = st["rsqrt"], st["none"]
        slower.append(difference(rep.values("train loss", arm("none")), rep.values("train loss", arm("rsqrt"))))
        lines.append(f"- H={128 // n}: final train loss scaled {ts.fmt()} vs unscaled {tu.fmt()}; best held-out "
                     f"loss scaled {hs.fmt()} vs unscaled {hu.fmt()}; unscaled failed in {fu.mean * fu.n:.0f}/{fu.n}.")
    failed = sum(round(rep.stat("failed", a).mean * rep.stat("failed", a).n) for a in rep.select(attention_scale="none"))
    higher = [d.lo > 0 for d in slower]           # Welch's 95% interval of unscaled − scaled lies above 0
    gaps = ", ".join(f"{d.mean:+.2f} [{d.lo:+.2f}, {d.hi:+.2f}]" for d in slower)
    lines.append("- Seed 004: without the scale, training blows up. " + (
        f"Does not hold as stated at this size: no unscaled run diverged or stalled ({failed} failed), but "
        + (f"without the scale the training loss falls more slowly at every head dim (final train loss higher by "
           f"{gaps} at H = 8, 32, 128: Welch's 95% interval of the difference lies above 0 at each)"
           if all(higher) else f"the final train loss is higher without the scale at {sum(higher)} of "
           f"{len(higher)} head dims on Welch's 95% interval (differences {gaps} at H = 8, 32, 128)")
        + ". Post-LN, AdamW and clipping at 1.0 keep the unscaled logits trainable here." if failed == 0 else
        f"Holds in part: {failed} unscaled runs failed."))
    return "\n".join(lines)


def get_sweep():
    return Sweep(
        name="attention_scale", title="Attention scale 1/sqrt(H) vs none (seed 004)", base="configs/alice.py",
        doc="configs/alice.py (Alice char LM, 2 Post-LN layers, AdamW 3e-3, clip 1.0) widened to D=128, d_ff=256, "
            "with 16, 4 or 1 heads so that the head dim H is 8, 32 or 128 at the same parameter count; 300 steps. "
            "'failed' = a non-finite loss, or a final training loss above 2.9 (no better than character "
            "frequencies). At D=128 the model overfits the 9,000 training characters within 300 steps, so the "
            "best held-out loss (over evaluations every 50 steps) is reported beside the final one.",
        grid={"model.num_heads": HEADS, "model.attention.scale": ("rsqrt", "none")},
        set=("model.d_model=128", "model.d_ff=256", "train.steps=300", "train.log_every=10", "train.eval_every=50",
             "train.checkpoint_every=300", "train.num_examples=0"),
        metrics={"best held-out loss": "eval/loss@min", "held-out loss": "eval/loss", "train loss": "train/loss", "steps to train loss < 2.4":
                 "train/loss<2.4", "failed": "failed:train/loss>2.9"},
        curves=("train/loss",), panels="model.num_heads", summary=summary)
