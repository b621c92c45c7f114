"""Seed 004's digit reversal as shipped (configs/reverse.py, the README's main job), over seeds."""
import math

from jaxformer.stats import within
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    arm = rep.arms[0]
    s = lambda lab: rep.stat(lab, arm)
    loss, one = s("steps to train loss < 0.1 (mean of 5 logs)"), s("steps to train loss < 0.1 (one batch)")
    em95, final = s("steps to 95% exact match"), s("held-out exact match")
    em = within(final, 0.95, math.inf)
    return "\n".join([
        f"- Seed 004: train loss below 0.1 after about 500 steps (read as: by 550). Measured: the mean of 5 "
        f"consecutive logged losses (steps 10 apart) first falls below 0.1 at step {loss.fmt()} "
        f"(a single batch first does at {one.fmt()}): {within(loss, -math.inf, 550)}, on the 95% interval over seeds.",
        f"- Seed 004: 95% validation accuracy. Steps to 95% held-out exact match (evaluated every 50): "
        f"{em95.fmt()}; final exact match {100 * final.mean:.1f} ± {100 * final.std:.1f}% "
        f"[{100 * final.lo:.1f}, {100 * final.hi:.1f}]: {em}.",
    ])


def get_sweep():
    return Sweep(
        name="reversal", title="Digit reversal (seed 004)", base="configs/reverse.py",
        doc="configs/reverse.py as shipped: 1,000 training strings of 3-6 digits, 500 disjoint held-out strings, "
            "2+2 Pre-LN layers, D=64, batch 64, 1,500 steps, AdamW 3e-3 with warmup and cosine decay; evaluated "
            "every 50 steps. Exact match = the whole greedy-decoded answer is right.",
        set=("train.eval_every=50", "train.log_every=10", "train.checkpoint_every=1500", "train.num_examples=0"),
        metrics={"steps to train loss < 0.1 (mean of 5 logs)": "train/loss<0.1~5",
                 "steps to train loss < 0.1 (one batch)": "train/loss<0.1", "steps to 95% exact match": "eval/exact_match>0.949",
                 "held-out exact match": "eval/exact_match", "held-out loss": "eval/loss"},
        curves=("train/loss", "eval/exact_match"), summary=summary)
