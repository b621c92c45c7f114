"""Seed 000's char LM at three widths: the first 10,000 characters of Alice, D = 32, 64, 128 (d_ff = 2D)."""
from jaxformer.stats import within
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    def at(d, label):
        return rep.stat(label, rep.select(d_model=d)[0])
    l64, l32 = at(64, "train loss (last epoch)"), at(32, "train loss (last epoch)")
    h64, h32 = at(64, "held-out loss"), at(32, "held-out loss")
    acc, tacc = at(64, "held-out accuracy"), at(64, "train accuracy (last epoch)")
    acc_verdicts = {within(acc, 0.78, 1.0), within(tacc, 0.78, 1.0)}
    acc_v = ("holds" if "holds" in acc_verdicts else "does not hold" if acc_verdicts == {"does not hold"} else
             "not resolved")
    return "\n".join([
        "Train loss is the mean over the last epoch of training batches (the last 28 steps = 8,960 of the 9,000 "
        "training characters), not one batch; each verdict is decided on its 95% interval over the seeds.",
        f"- Seed 000: loss ≈ 1.8 after 10 epochs at D=64 (tolerance ±10%: [1.62, 1.98]). Measured train loss "
        f"{l64.fmt()}, held-out {h64.fmt()}: {within(l64, 1.62, 1.98)}"
        + (f" ({'lower' if l64.hi < 1.62 else 'higher'})." if within(l64, 1.62, 1.98) == "does not hold" else "."),
        f"- Seed 000: loss > 3.2 at D=32. Measured train loss {l32.fmt()}, held-out {h32.fmt()}: "
        + {"holds": "holds.", "does not hold": "does not hold: D=32 learns well below 3.2.",
           "not resolved": "not resolved."}[within(l32, 3.2, float("inf"))],
        f"- Seed 000: 83% character accuracy (tolerance 5 points: ≥ 78%). Measured at D=64: "
        f"{100 * tacc.mean:.1f} ± {100 * tacc.std:.1f}% on the last epoch's training batches, {100 * acc.mean:.1f} "
        f"± {100 * acc.std:.1f}% on held-out text: {acc_v}"
        + (", on training and on held-out text." if acc_v == "does not hold" else "."),
    ] + ([f"- With the seed's own optimizer (SGD at 1e-3, clipping at 1.0) the D=64 model barely trains in the "
          f"same 250 steps: train loss {sgd.fmt()} over the last epoch (ln V = 4.19 is a uniform guess); the "
          f"figures above use AdamW."]
         if (sgd := rep.stat("train loss (last epoch)", rep.arms[3])) else []))


def get_sweep():
    return Sweep(
        name="width", title="Char LM width on Alice (seed 000)", base="configs/alice.py",
        doc="configs/alice.py as shipped (2 Post-LN layers, 4 heads, blocks of 10, batch 32, 250 steps ≈ 10 "
            "epochs of the 9,000 training characters, AdamW 3e-3) at three widths, and at D=64 with the seed's own "
            "optimizer (plain SGD at 1e-3, clipping at 1.0). Train loss (last epoch) is the mean of the last 28 "
            "logged training batches (one pass over the training text); train loss is the last batch alone; "
            "held-out is the last 10% of the 10,000 characters.",
        arms=tuple({"name": f"D={d}", "model.d_model": d, "model.d_ff": 2 * d} for d in (32, 64, 128))
        + ({"name": "D=64, the seed's SGD lr 1e-3", "optim.name": "sgd", "optim.lr": 1e-3},),
        set=("train.num_examples=0", "train.log_every=1"),
        metrics={"train loss (last epoch)": "train/loss@tail:28", "train loss": "train/loss",
                 "train accuracy (last epoch)": "train/token_accuracy@tail:28", "train accuracy": "train/token_accuracy", "held-out loss": "eval/loss", "best held-out loss": "eval/loss@min",
                 "held-out accuracy": "eval/token_accuracy", "steps to held-out loss < 2.4": "eval/loss<2.4"},
        curves=("train/loss", "eval/loss"), summary=summary)
