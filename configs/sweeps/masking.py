"""Two masking bugs of seed 004 on digit reversal: 0 as the masked-logit value, and triu as the causal mask."""
from jaxformer.stats import below, difference
from jaxformer.sweep import Sweep

FAILS = 0.1        # greedy decoding "fails": held-out exact match below 10%


def summary(rep) -> str:
    """Each verdict on a 95% interval: "the loss falls" = the final train loss's interval lies below half the
    lower end of the first loss's; "below the correct model's" = Welch's interval of the difference lies below
    0; "decoding fails" = the exact-match interval lies below FAILS."""
    base, zero, triu = rep.arms
    st = lambda lab, a: rep.stat(lab, a)                                                   # noqa: E731
    falls = below(st("train loss", zero), 0.5 * st("first train loss", zero).lo)
    d = difference(rep.values("train loss", zero), rep.values("train loss", base))
    vs = (f"{'below' if d.hi < 0 else 'above' if d.lo > 0 else 'about as low as'} the correct model's (difference "
          f"{d.mean:+.3g}, 95% interval [{d.lo:+.3g}, {d.hi:+.3g}])")
    leak = {"holds": f"does not hold: the loss falls, {vs}, and the bug shows only in decoding",
            "does not hold": "holds: the loss does not fall",
            "not resolved": "not resolved: the interval of the final loss straddles half the first loss"}[falls]
    fails = below(st("held-out exact match", triu), FAILS)
    lines = [
        f"- Correct masks: train loss {st('train loss', base).fmt()}, exact match "
        f"{st('held-out exact match', base).fmt()}.",
        f"- Seed 004: with 0 as the mask value, masked positions leak and the loss won't fall. Measured train "
        f"loss {st('train loss', zero).fmt()} (first {st('first train loss', zero).fmt()}), held-out exact match "
        f"{st('held-out exact match', zero).fmt()}: {leak}.",
        f"- A triu causal mask (the decoder sees the future): train loss {st('train loss', triu).fmt()}, "
        f"held-out teacher-forced loss {st('held-out loss', triu).fmt()}, greedy exact match "
        f"{st('held-out exact match', triu).fmt()}: "
        + {"holds": f"the loss falls while greedy decoding fails (exact match below {FAILS:.0%} on the interval), "
                    "as expected of a future-seeing decoder.",
           "does not hold": "decoding does not fail here.",
           "not resolved": f"not resolved: the exact-match interval straddles {FAILS:.0%}."}[fails],
    ]
    return "\n".join(lines)


def get_sweep():
    return Sweep(
        name="masking", title="Masking bugs: 0 as mask value, triu as causal mask (seed 004)",
        base="configs/reverse.py",
        doc="configs/reverse.py (the README's main job: 2+2 Pre-LN layers, D=64) trained 800 steps with the "
            "ablation switches `model.ablation.mask_value` (masked logits set to 0 instead of float32's minimum, "
            "for padding, causal and cross-attention masks alike, and not zeroed after the softmax) and "
            "`model.ablation.causal` (the decoder attends to itself and later positions). Exact match is greedy "
            "decoding with the KV cache, which applies the same masks.",
        arms=({"name": "correct (min, tril)"}, {"name": "mask value 0", "model.ablation.mask_value": "zero"},
              {"name": "triu causal mask", "model.ablation.causal": "triu"}),
        set=("train.steps=800", "train.log_every=20", "train.eval_every=200", "train.checkpoint_every=800",
             "train.num_examples=0"),
        metrics={"first train loss": "train/loss@first", "train loss": "train/loss", "held-out loss": "eval/loss",
                 "held-out exact match": "eval/exact_match"},
        curves=("train/loss", "eval/exact_match"), summary=summary)
