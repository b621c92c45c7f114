"""The GPT-style character model of configs/shakespeare_char.py on tiny Shakespeare, held-out loss over seeds."""
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    s = rep.stat("held-out loss", rep.arms[0])
    b = rep.stat("best held-out loss", rep.arms[0])
    return (f"- Held-out loss after 5,000 steps (60,000 blocks of 64 characters, 3.9 epochs): {s.fmt()} nats per "
            f"character ({s.mean / 0.6931:.2f} bits); best over the evaluations every 500 steps {b.fmt()}. A "
            f"uniform guess over the 65 characters is ln 65 = 4.17.")


def get_sweep():
    return Sweep(
        name="shakespeare", title="GPT-style character model on tiny Shakespeare", base="configs/shakespeare_char.py",
        doc="configs/shakespeare_char.py: decoder-only, Pre-LN, GELU, learned positions, D=128, 4 layers, 4 heads, "
            "d_ff=512, blocks of 64, batch 12, AdamW 1e-3 (warmup 100, cosine to 0), the whole corpus with the "
            "last 10% held out (15,443 training and 1,715 held-out blocks), 5,000 steps as configured.",
        set=("train.num_examples=0",),
        metrics={"held-out loss": "eval/loss", "best held-out loss": "eval/loss@min",
                 "held-out accuracy": "eval/token_accuracy",
                 "train loss": "train/loss"},
        curves=("train/loss", "eval/loss"), summary=summary)
