"""Positional encodings and length generalisation: train on digit strings of length 3..L (L=8), test on
strings of exactly L, 1.5L, 2L and 4L digits, for reversal and copy."""
from jaxformer.stats import above
from jaxformer.sweep import Sweep

L = 8
LENGTHS = {"L": L, "1.5L": 3 * L // 2, "2L": 2 * L, "4L": 4 * L}
KINDS = ("sinusoidal", "learned", "rope", "alibi", "none")


def summary(rep) -> str:
    def em(kind, task, name):
        s = rep.stat(f"exact {name}", rep.select(positional=kind, task=task)[0])
        return s
    lines = []
    for task in ("reverse", "copy"):
        row = []
        for kind in KINDS:
            a, b = em(kind, task, "L"), em(kind, task, "2L")
            row.append(f"{kind} {100 * a.mean:.0f}% → {100 * b.mean:.0f}%" if a and b else f"{kind} n/a")
        lines.append(f"- {task}, exact match at L → 2L: " + "; ".join(row) + ".")
    sin2 = [em("sinusoidal", t, "2L") for t in ("reverse", "copy")]
    rope2 = [em("rope", t, "2L") for t in ("reverse", "copy")]
    def verdict(ss):
        """"Generalises" = at least 50% exact match at 2L on both tasks, decided on each 95% interval."""
        each = [above(s, 0.5) for s in ss]
        v = "holds" if all(e == "holds" for e in each) else "does not hold" if "does not hold" in each else \
            "not resolved"
        return v, ", ".join(f"{100 * s.mean:.0f}% [{100 * s.lo:.0f}, {100 * s.hi:.0f}]" for s in ss if s)
    v, shown = verdict(sin2)
    lines.append("- Seed 000: sin/cos generalises beyond the training length (≥ 50% exact match at 2L on both "
                 "tasks, on the 95% interval): " + {"holds": f"holds: {shown}.",
                 "does not hold": f"does not hold for whole answers here: exact match at 2L is {shown} (reverse, "
                                  "copy); see token accuracy for partial credit.",
                 "not resolved": f"not resolved: {shown}."}[v])
    v, shown = verdict(rope2)
    lines.append("- Seed 004: RoPE extrapolates well (the same test): " + {"holds": f"holds: {shown}.",
                 "does not hold": f"does not hold here: exact match at 2L is {shown} (reverse, copy).",
                 "not resolved": f"not resolved: {shown}."}[v])
    return "\n".join(lines)


def get_sweep():
    evals = {name: (f"data.eval_min_len={n}", f"data.eval_max_len={n}", "data.num_eval=200")
             for name, n in LENGTHS.items()}
    metrics = {}
    for name in LENGTHS:
        metrics[f"exact {name}"] = f"evals:{name}/exact_match"
    for name in ("2L", "4L"):
        metrics[f"token acc {name}"] = f"evals:{name}/token_accuracy"
    return Sweep(
        name="positional", title="Positional encodings and length generalisation (seeds 000, 004)",
        base="configs/reverse.py",
        doc=f"configs/reverse.py (2+2 Pre-LN layers, D=64, 4 heads) trained 800 steps on 1,000 strings of 3..{L} "
            f"digits, for reversal and for copy, with each positional encoding; model.max_len=40 so that the "
            f"tables reach 4L+2 = {4 * L + 2} positions (learned rows past L+1 are never trained). Tested on 200 "
            f"held-out strings of exactly {', '.join(f'{k} = {v}' for k, v in LENGTHS.items())} digits: exact match "
            f"(greedy, KV-cached) and teacher-forced token accuracy. RoPE and ALiBi act in self-attention only; "
            f"cross-attention has no positional term. 'none' has no position information in the encoder at all.",
        grid={"data.task": ("reverse", "copy"), "model.positional": KINDS},
        set=("model.max_len=40", f"data.max_len={L}", "train.steps=800", "train.log_every=20",
             "train.eval_every=800", "train.checkpoint_every=800", "train.num_examples=0"),
        evals=evals, metrics=metrics, curves=("train/loss",), panels="data.task", summary=summary)
