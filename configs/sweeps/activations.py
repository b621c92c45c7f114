"""FFN activation at equal parameter count: ReLU and GELU with d_ff=128, SwiGLU with d_ff=85 (3·D·85 ≈ 2·D·128)."""
from jaxformer.stats import difference, equivalence
from jaxformer.sweep import Sweep

# The equivalence margin of "GELU ≈ ReLU": a best held-out loss within 0.05 nats per character (~2% of the
# loss, ~3x its seed-to-seed std) is a difference we call negligible.
MARGIN = 0.05


def summary(rep) -> str:
    label = "best held-out loss"
    relu, gelu, swi = (rep.stat(label, rep.arms[i]) for i in range(3))
    diff = difference(rep.values(label, rep.arms[1]), rep.values(label, rep.arms[0]))
    verdict = equivalence(diff, MARGIN)
    return "\n".join([
        f"- Seed 004: GELU ≈ ReLU. Best held-out loss ReLU {relu.fmt()}, GELU {gelu.fmt()}; GELU − ReLU: "
        f"{verdict}. " + next(text for start, text in (
            ("equivalent", "The claim holds here."),
            ("lower", "The claim does not hold here: GELU is measurably better."),
            ("higher", "The claim does not hold here: GELU is measurably worse."),
            ("not resolved", "Not resolved with these seeds: the interval is wider than the margin, so neither "
                             "equality nor a difference is shown.")) if verdict.startswith(start)),
        f"- SwiGLU at the same parameter count: {swi.fmt()} "
        f"({'better' if swi.mean < min(relu.mean, gelu.mean) else 'not better'} than both on the mean).",
    ])


def get_sweep():
    return Sweep(
        name="activations", title="FFN activations at equal parameter count (seed 004)", base="configs/alice.py",
        doc="configs/alice.py (D=64, 2 Post-LN layers) trained 500 steps (≈ 20 epochs) with ReLU, GELU (exact, "
            "erf) and SwiGLU. FFN parameters: ReLU/GELU 2·64·128 = 16,384 weights; SwiGLU 3·64·85 = 16,320. The model overfits "
            "the 9,000 training characters well before 500 steps, so the best held-out loss (evaluated every 50 "
            "steps) is the measure of each activation; the final one mostly measures overfitting.",
        arms=({"name": "relu", "model.activation": "relu"}, {"name": "gelu", "model.activation": "gelu"},
              {"name": "swiglu (d_ff=85)", "model.activation": "swiglu", "model.d_ff": 85}),
        set=("train.steps=500", "train.log_every=25", "train.eval_every=50", "train.checkpoint_every=500",
             "train.num_examples=0"),
        metrics={"best held-out loss": "eval/loss@min", "held-out loss": "eval/loss", "held-out accuracy": "eval/token_accuracy",
                 "train loss": "train/loss", "steps to held-out loss < 2.4": "eval/loss<2.4"},
        curves=("eval/loss",), summary=summary)
