"""Two masking bugs of seed 004 on digit reversal: 0 as the masked-logit value, and triu as the causal mask."""
from jaxformer.sweep import Sweep


def summary(rep) -> str:
    base, zero, triu = rep.arms
    st = lambda lab, a: rep.stat(lab, a)
    lines = [
        f"- Correct masks: train loss {st('train loss', base).fmt()}, exact match "
        f"{st('held-out exact match', base).fmt()}.",
        f"- Seed 004: with 0 as the mask value, masked positions leak and the loss won't fall. Measured train "
        f"loss {st('train loss', zero).fmt()}, held-out exact match {st('held-out exact match', zero).fmt()}: "
        + (("does not hold: the loss falls, " + ("even below the correct model's (the leak lets the decoder see "
            "the answer)" if st("train loss", zero).mean < st("train loss", base).mean else "about as far as the "
            "correct model's") + ", and the bug shows only in decoding") if st("train loss", zero).mean
           < 0.5 * st("first train loss", zero).mean else "holds: the loss does not fall") + ".",
        f"- A triu causal mask (the decoder sees the future): train loss {st('train loss', triu).fmt()}, "
        f"held-out teacher-forced loss {st('held-out loss', triu).fmt()}, greedy exact match "
        f"{st('held-out exact match', triu).fmt()}: "
        + ("the loss falls while greedy decoding fails, as expected of a future-seeing decoder." if
           st("held-out exact match", triu).mean < 0.1 else "decoding does not fail here."),
    ]
    return "\n".join(lines)


def get_sweep():
    return Sweep(
        name="masking", title="Masking bugs: 0 as mask value, triu as causal mask (seed 004)",
        base="configs/reverse.py",
        doc="configs/reverse.py (the README's main job: 2+2 Pre-LN layers, D=64) trained 800 steps with the "
            "ablation switches `model.ablation_mask_value` (masked logits set to 0 instead of float32's minimum, "
            "for padding, causal and cross-attention masks alike, and not zeroed after the softmax) and "
            "`model.ablation_causal` (the decoder attends to itself and later positions). Exact match is greedy "
            "decoding with the KV cache, which applies the same masks.",
        arms=({"name": "correct (min, tril)"}, {"name": "mask value 0", "model.ablation_mask_value": "zero"},
              {"name": "triu causal mask", "model.ablation_causal": "triu"}),
        set=("train.steps=800", "train.log_every=20", "train.eval_every=200", "train.checkpoint_every=800",
             "train.num_examples=0"),
        metrics={"first train loss": "train/loss@first", "train loss": "train/loss", "held-out loss": "eval/loss",
                 "held-out exact match": "eval/exact_match"},
        curves=("train/loss", "eval/exact_match"), summary=summary)
