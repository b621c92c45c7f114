"""Optimizers and schedules at equal steps on the Alice char LM: AdamW with cosine or warmup-stable-decay, Lion,
Muon (AdamW for the non-matrix parameters) and schedule-free AdamW, each at three peak learning rates, with an EMA
of the weights evaluated alongside every non-schedule-free arm."""
from jaxformer.stats import difference, equivalence
from jaxformer.sweep import Sweep

MARGIN = 0.02       # nats per character: a held-out loss difference we call negligible (~1% of the loss)
EMA = 0.98          # the weights' EMA decay (a half-life of ~34 of the 300 steps)

OPTIMIZERS = {      # name -> (overrides, three peak learning rates around its usual one)
    "AdamW, cosine": ({"optim.name": "adamw", "optim.schedule": "warmup_cosine"}, (1e-3, 3e-3, 1e-2)),
    "AdamW, WSD": ({"optim.name": "adamw", "optim.schedule": "wsd"}, (1e-3, 3e-3, 1e-2)),
    "Lion, cosine": ({"optim.name": "lion", "optim.schedule": "warmup_cosine"}, (1e-4, 3e-4, 1e-3)),
    "Muon, cosine": ({"optim.name": "muon", "optim.schedule": "warmup_cosine", "optim.muon_adam_lr": 3e-3},
                     (6e-3, 2e-2, 6e-2)),
    "schedule-free AdamW": ({"optim.name": "schedule_free", "optim.schedule": "constant"}, (1e-3, 3e-3, 1e-2)),
}
ARMS = tuple({"name": f"{name}, lr={lr:g}", **ov, "optim.lr": lr,
              "optim.ema": 0.0 if ov["optim.name"] == "schedule_free" else EMA}
             for name, (ov, lrs) in OPTIMIZERS.items() for lr in lrs)


def best_arm(rep, name: str):
    """The optimizer's arm with the lowest mean final held-out loss over its learning rates."""
    arms = [a for a in rep.arms if a.name.startswith(name + ", lr=")]
    return min(arms, key=lambda a: rep.stat("held-out loss", a).mean)


def summary(rep) -> str:
    base = best_arm(rep, "AdamW, cosine")
    lines = []
    for name in OPTIMIZERS:
        arm = best_arm(rep, name)
        st = rep.stat("held-out loss", arm)
        vs = "" if arm is base else (" − AdamW, cosine: " + equivalence(
            difference(rep.values("held-out loss", arm), rep.values("held-out loss", base)), MARGIN))
        lrs = OPTIMIZERS[name][1]
        edge = {lrs[0]: " (the lowest rate tried: its best may lie below)",
                lrs[-1]: " (the highest rate tried: its best may lie above)"}.get(arm.values["optim.lr"], "")
        lines.append(f"- {name}: best of its three rates is lr={arm.values['optim.lr']:g}{edge}, held-out loss "
                     f"{st.fmt()}{vs}.")
    ema = rep.values("held-out loss (EMA)", base)
    lines.append(f"- EMA of the weights (decay {EMA}) on the best AdamW arm: held-out loss "
                 f"{rep.stat('held-out loss (EMA)', base).fmt()} vs the trained weights' "
                 f"{rep.stat('held-out loss', base).fmt()}; EMA − trained: "
                 + equivalence(difference(ema, rep.values("held-out loss", base)), MARGIN) + ".")
    lines.append(f"- Equal means within ±{MARGIN} nats on the 95% (Welch) interval of the difference. Each "
                 "optimizer's best rate is picked on these same runs, which favours every arm alike (three rates "
                 "each) but makes each best a little optimistic.")
    return "\n".join(lines)


def get_sweep():
    return Sweep(
        name="optimizers", title="Optimizers and schedules at equal steps: AdamW, WSD, Lion, Muon, schedule-free",
        base="configs/alice.py",
        doc="configs/alice.py (Alice char LM, D=64, 4 heads, d_ff=128, blocks of 10, batch 32) as a 4-layer "
            "Pre-LN model, 300 steps, 30 warmup steps, gradient clipping at 1.0, weight decay 0.01 on matrices. "
            "Schedules: cosine to 0 after the warmup; WSD holds the peak and decays linearly to 0 over the last "
            "20%; schedule-free AdamW holds the peak after its warmup and is evaluated at its averaged iterate. "
            "Muon updates the attention and FFN matrices (Newton–Schulz orthogonalised momentum) and AdamW at "
            "peak 3e-3 the embeddings, norms and biases. Every arm but schedule-free also keeps an EMA of the "
            f"weights (decay {EMA}), evaluated alongside (`eval_ema/*`). Held-out loss: the final evaluation.",
        arms=ARMS,
        set=("model.norm.position=pre", "model.num_decoder_layers=4", "optim.warmup_steps=30", "optim.clip_norm=1.0",
             "train.steps=300", "train.log_every=10", "train.eval_every=50", "train.checkpoint_every=300",
             "train.num_examples=0"),
        metrics={"held-out loss": "eval/loss", "held-out loss (EMA)": "eval_ema/loss",
                 "best held-out loss": "eval/loss@min", "train loss": "train/loss@tail:5",
                 "diverged (NaN)": "diverged"},
        curves=("train/loss", "eval/loss"), summary=summary)
