"""Local (sliding-window) against global attention at equal compute on a long-context task: the tiny-Shakespeare
character model with 256-character blocks, every layer global, every layer local, or three local layers then
one global ("LLLG")."""
from jaxformer.stats import difference, equivalence
from jaxformer.sweep import Sweep

MARGIN = 0.02       # nats per character: a held-out loss difference we call negligible (~1.5% of the loss)
WINDOW = 16

ARMS = ({"name": "global", "model.attention.windows": ()},
        {"name": f"LLLG (window {WINDOW}, layer 4 global)", "model.attention.windows": (WINDOW, WINDOW, WINDOW, 0)},
        {"name": f"local (window {WINDOW}, every layer)", "model.attention.windows": (WINDOW,)})


def summary(rep) -> str:
    glob, lllg, local = rep.arms
    vals = {a.name: rep.values("held-out loss", a) for a in rep.arms}
    st = {a.name: rep.stat("held-out loss", a) for a in rep.arms}
    return "\n".join([
        f"- Held-out loss at 256 characters of context: global {st[glob.name].fmt()}, {lllg.name} "
        f"{st[lllg.name].fmt()}, {local.name} {st[local.name].fmt()}.",
        f"- LLLG − global: {equivalence(difference(vals[lllg.name], vals[glob.name]), MARGIN)}.",
        f"- all-local − global: {equivalence(difference(vals[local.name], vals[glob.name]), MARGIN)}.",
        f"- Equal means within ±{MARGIN} nats on the 95% (Welch) interval of the difference. Compute is equal by "
        "construction here: the same model, steps and tokens, and jaxformer's CPU attention computes every score "
        "and masks it (a window only saves compute with a kernel that skips the masked tiles, e.g. the chunked "
        f"backend's at long contexts). With 4 layers of window {WINDOW} a local-only model sees at most "
        f"{4 * (WINDOW - 1) + 1} characters back.",
    ])


def get_sweep():
    return Sweep(
        name="local_attention", title="Local vs global attention at equal compute (256-character context)",
        base="configs/shakespeare_char.py",
        doc="configs/shakespeare_char.py (decoder-only, Pre-LN, GELU, learned positions, 4 layers, 4 heads) made "
            "CPU-sized: D=64, d_ff=256, blocks of 256 characters, batch 4, 400 steps (40 warmup, cosine to 0, peak "
            "lr 2e-3). model.attention.windows: "
            f"() every layer global; ({WINDOW},) every layer sees its {WINDOW} most recent positions; "
            f"({WINDOW}, {WINDOW}, {WINDOW}, 0) three local layers, then a global one. Held-out loss: the final "
            "evaluation on the held-out 10% in 256-character blocks.",
        arms=ARMS,
        set=("model.d_model=64", "model.d_ff=256", "data.block_size=256", "model.max_len=256", "data.batch_size=4",
             "optim.lr=2e-3", "optim.warmup_steps=40", "train.steps=400", "train.log_every=20",
             "train.eval_every=200", "train.checkpoint_every=400", "train.num_examples=0"),
        metrics={"held-out loss": "eval/loss", "train loss": "train/loss@tail:5",
                 "train tokens/s": "train/tokens_per_s@median"},
        curves=("train/loss", "eval/loss"), summary=summary)
