"""Character vs byte-level BPE tokens on tiny Shakespeare at equal compute, compared in held-out bits per byte.

Prepare the three shard folders first (from the repository root; each takes seconds):

    jaxformer data prepare ../shared/data/tiny_shakespeare.txt --tokenizer char --out runs/data/shakespeare-char
    jaxformer data prepare ../shared/data/tiny_shakespeare.txt --tokenizer bpe --vocab-size 512 \\
        --out runs/data/shakespeare-bpe512
    jaxformer data prepare ../shared/data/tiny_shakespeare.txt --tokenizer bpe --vocab-size 2048 \\
        --out runs/data/shakespeare-bpe2048
"""
from jaxformer.stats import difference
from jaxformer.sweep import Sweep

ARMS = (("char", "runs/data/shakespeare-char"), ("bpe 512", "runs/data/shakespeare-bpe512"),
        ("bpe 2048", "runs/data/shakespeare-bpe2048"))


def summary(rep) -> str:
    lines = []
    for arm in rep.arms:
        lines.append(f"- {arm.name}: held-out bits per byte {rep.stat('held-out bits per byte', arm).fmt()} (best "
                     f"{rep.stat('best held-out bits per byte', arm).fmt()}), held-out loss per token "
                     f"{rep.stat('held-out loss per token', arm).fmt()}.")
    char = rep.arms[0]
    for arm in rep.arms[1:]:
        d = difference(rep.values("best held-out bits per byte", arm), rep.values("best held-out bits per byte", char))
        if d is None:
            continue
        word = "lower" if d.hi < 0 else "higher" if d.lo > 0 else "not resolved"
        lines.append(f"- {arm.name} − char, best held-out bits per byte: {d.mean:+.3f}, Welch 95% interval "
                     f"[{d.lo:+.3f}, {d.hi:+.3f}]: {word}.")
    return "\n".join(lines)


def get_sweep():
    return Sweep(
        name="tokenizers", title="Characters vs byte-level BPE at equal compute (tiny Shakespeare, bits per byte)",
        base="configs/shakespeare_tokens.py",
        doc="configs/shakespeare_tokens.py (decoder-only, Pre-LN, GELU, learned positions, D=128, 4 layers, 4 "
            "heads, windows of 64 tokens, batch 12, AdamW 1e-3, 1,500 steps) on the same text prepared three ways: "
            "characters, byte-level BPE with 512 and with 2,048 ids (trained here on the training split). Equal "
            "compute: the same model, steps and tokens per step (the embedding table and output head grow with the "
            "vocabulary: +0.25M parameters at 2,048 ids); a BPE token carries ~2-3 bytes of text, so BPE arms see "
            "more text. Bits per byte: held-out nll of the text tokens over ln 2 × their UTF-8 bytes, which does "
            "not depend on the tokenizer.",
        arms=tuple({"name": n, "data.path": p} for n, p in ARMS),
        set=("train.num_examples=0",),
        metrics={"held-out bits per byte": "eval/bits_per_byte", "best held-out bits per byte": "eval/bits_per_byte@min",
                 "held-out loss per token": "eval/loss", "train loss per token": "train/loss"},
        curves=("eval/bits_per_byte", "train/loss"), summary=summary)
