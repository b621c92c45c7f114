"""Seed 004's digit reversal as shipped (configs/reverse.py, the README's main job), over seeds."""
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    arm = rep.arms[0]
    s = lambda lab: rep.stat(lab, arm)
    loss, em95, final = s("steps to train loss < 0.1"), s("steps to 95% exact match"), s("held-out exact match")
    return "\n".join([
        f"- Seed 004: train loss below 0.1 after about 500 steps. Measured {loss.fmt()} steps: "
        + ("holds (sooner)." if loss.mean <= 550 else "does not hold (later)."),
        f"- Seed 004: 95% validation accuracy. Steps to 95% held-out exact match (evaluated every 50): "
        f"{em95.fmt()}; final exact match {100 * final.mean:.1f} ± {100 * final.std:.1f}%: "
        + ("holds." if final.mean >= 0.95 else "does not hold."),
    ])


def get_sweep():
    return Sweep(
        name="reversal", title="Digit reversal (seed 004)", base="configs/reverse.py",
        doc="configs/reverse.py as shipped: 1,000 training strings of 3-6 digits, 500 disjoint held-out strings, "
            "2+2 Pre-LN layers, D=64, batch 64, 1,500 steps, AdamW 3e-3 with warmup and cosine decay; evaluated "
            "every 50 steps. Exact match = the whole greedy-decoded answer is right.",
        set=("train.eval_every=50", "train.log_every=10", "train.checkpoint_every=1500", "train.num_examples=0"),
        metrics={"steps to train loss < 0.1": "train/loss<0.1", "steps to 95% exact match": "eval/exact_match>0.949",
                 "held-out exact match": "eval/exact_match", "held-out loss": "eval/loss"},
        curves=("train/loss", "eval/exact_match"), summary=summary)
