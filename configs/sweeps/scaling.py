"""Loss against model size on tiny Shakespeare: the char model at five widths, equal steps and tokens, a power
law with an irreducible term fitted to the held-out loss (jaxformer.scaling), with a bootstrap interval over
seeds on the exponent."""
from jaxformer.scaling import Scaling, fits, fmt
from jaxformer.sweep import Sweep

WIDTHS = (16, 32, 48, 64, 128)
STEPS = 800


def summary(rep) -> str:
    lines = []
    for spec, f in zip(rep.sweep.scaling, fits(rep)):
        lo = f.intervals["alpha"][0] if f.intervals else float("nan")
        p = f.lack_of_fit_p
        verdict = ("not resolved (the exponent's interval reaches 0)" if not lo > 0 else
                   "does not hold: the arm means stray from the law by more than the seeds scatter" if p is not None
                   and p < 0.05 else "holds: the law fits within the seeds' scatter")
        lines.append(f"- Held-out loss against {spec.x.replace('_', '-')}: L = E + A·N^(−α) with α = "
                     f"{fmt(f, 'alpha')}, E = {fmt(f, 'E')} nats (lack-of-fit p = "
                     f"{'—' if p is None else f'{p:.2g}'}, {f.n_points} runs at {f.n_sizes} sizes): {verdict}.")
    return "\n".join(
        ["A power law with an irreducible term (Kaplan et al. 2020; Hoffmann et al. 2022) is the claim; each "
         "verdict is decided on the exponent's 95% bootstrap interval over seeds and the lack-of-fit F-test. "
         f"Every run sees the same {STEPS} steps of 12 × 64 characters, so the fit is loss against size at a "
         "fixed token budget, not at convergence: its exponent is not Kaplan's α_N."] + lines)


def get_sweep():
    return Sweep(
        name="scaling", title="Held-out loss against model size (tiny Shakespeare char model)",
        base="configs/shakespeare_char.py",
        doc=f"configs/shakespeare_char.py (Pre-LN, GELU, learned positions, 4 layers, 4 heads, blocks of 64, batch "
            f"12, AdamW 1e-3, warmup 100 then cosine) at widths D = {', '.join(map(str, WIDTHS))} with d_ff = 4D, "
            f"each trained {STEPS} steps (614,400 characters, about 0.6 epochs), evaluated once at the end on the "
            "held-out last 10% of the corpus. Parameters counted by the model (token embedding and learned "
            "positions included; non-embedding without them).",
        arms=tuple({"name": f"D={d}", "model.d_model": d, "model.d_ff": 4 * d} for d in WIDTHS),
        set=(f"train.steps={STEPS}", f"train.eval_every={STEPS}", f"train.checkpoint_every={STEPS}",
             "train.num_examples=0"),
        metrics={"held-out loss": "eval/loss", "train loss (last 10 logs)": "train/loss@tail:10"},
        curves=("train/loss",),
        scaling=(Scaling("held-out loss", x="params", bootstrap=1000),
                 Scaling("held-out loss", x="non_embedding_params", bootstrap=1000)),
        summary=summary)
