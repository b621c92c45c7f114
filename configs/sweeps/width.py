"""Seed 000's char LM at three widths: the first 10,000 characters of Alice, D = 32, 64, 128 (d_ff = 2D)."""
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    def at(d, label):
        return rep.stat(label, rep.select(d_model=d)[0])
    l64, l32, acc, tacc = at(64, "train loss"), at(32, "train loss"), at(64, "held-out accuracy"), at(64, "train accuracy")
    return "\n".join([
        f"- Seed 000: loss ≈ 1.8 after 10 epochs at D=64. Measured train loss {l64.fmt()} at D=64: "
        + ("holds." if l64.lo <= 1.8 * 1.1 and l64.hi >= 1.8 * 0.9 else
           f"does not hold as stated ({'lower' if l64.mean < 1.8 else 'higher'})."),
        f"- Seed 000: loss > 3.2 at D=32. Measured {l32.fmt()}: " + ("holds." if l32.mean > 3.2 else
                                                                    "does not hold: D=32 learns well below 3.2."),
        f"- Seed 000: 83% character accuracy. Measured at D=64: {100 * tacc.mean:.1f} ± {100 * tacc.std:.1f}% on "
        f"the last training batch, {100 * acc.mean:.1f} ± {100 * acc.std:.1f}% on held-out text: "
        + ("holds." if max(acc.mean, tacc.mean) >= 0.8 else "does not hold, on training or held-out text."),
    ] + ([f"- With the seed's own optimizer (SGD at 1e-3, clipping at 1.0) the D=64 model barely trains in the "
          f"same 250 steps: train loss {sgd.fmt()} (ln V = 4.19 is a uniform guess); the figures above use AdamW."]
         if (sgd := rep.stat("train loss", rep.arms[3])) else []))


def get_sweep():
    return Sweep(
        name="width", title="Char LM width on Alice (seed 000)", base="configs/alice.py",
        doc="configs/alice.py as shipped (2 Post-LN layers, 4 heads, blocks of 10, batch 32, 250 steps ≈ 10 "
            "epochs of the 9,000 training characters, AdamW 3e-3) at three widths, and at D=64 with the seed's own "
            "optimizer (plain SGD at 1e-3, clipping at 1.0). Train loss is the last logged "
            "training batch; held-out is the last 10% of the 10,000 characters.",
        arms=tuple({"name": f"D={d}", "model.d_model": d, "model.d_ff": 2 * d} for d in (32, 64, 128))
        + ({"name": "D=64, the seed's SGD lr 1e-3", "optim.name": "sgd", "optim.lr": 1e-3},),
        set=("train.num_examples=0",),
        metrics={"train loss": "train/loss", "train accuracy": "train/token_accuracy", "held-out loss": "eval/loss", "best held-out loss": "eval/loss@min",
                 "held-out accuracy": "eval/token_accuracy", "steps to held-out loss < 2.4": "eval/loss<2.4"},
        curves=("train/loss", "eval/loss"), summary=summary)
