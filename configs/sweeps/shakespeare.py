"""The GPT-style character model of configs/shakespeare_char.py on tiny Shakespeare, held-out loss over seeds."""
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    s = rep.stat("held-out loss", rep.arms[0])
    return (f"- Held-out loss after 1,000 steps (12,000 blocks of 64 characters, 0.77 epoch): {s.fmt()} nats per "
            f"character ({s.mean / 0.6931:.2f} bits). A uniform guess over the 65 characters is ln 65 = 4.17.")


def get_sweep():
    return Sweep(
        name="shakespeare", title="GPT-style character model on tiny Shakespeare", base="configs/shakespeare_char.py",
        doc="configs/shakespeare_char.py: decoder-only, Pre-LN, GELU, learned positions, D=128, 4 layers, 4 heads, "
            "d_ff=512, blocks of 64, batch 12, AdamW 1e-3 (warmup 100, cosine), the whole corpus with the last 10% "
            "held out. CPU-sized: 1,000 steps instead of the config's 5,000.",
        set=("train.steps=1000", "train.eval_every=250", "train.checkpoint_every=1000", "train.log_every=50",
             "train.num_examples=0"),
        metrics={"held-out loss": "eval/loss", "held-out accuracy": "eval/token_accuracy",
                 "train loss": "train/loss"},
        curves=("train/loss", "eval/loss"), summary=summary)
