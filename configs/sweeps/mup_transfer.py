"""Does the learning rate tuned at width 64 hold at larger widths? The tiny Shakespeare char model (2 layers)
under SP and under µP (base width 64), a grid of peak learning rates at each width, 3 seeds; the verdict from
the 95% bootstrap interval of the optimum's shift (jaxformer.mup.optimum_shift)."""
from jaxformer.mup import lr_optimum, optimum_shift, transfer_verdict
from jaxformer.sweep import Sweep

WIDTHS = (64, 128, 256)
LRS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)
STEPS = 300
METRIC = "held-out loss"


def _losses(rep, par, width):
    """[seeds][lrs] held-out losses of one parametrization and width."""
    cols = [rep.values(METRIC, rep.select(parametrization=par, d_model=width, lr=lr)[0]) for lr in LRS]
    return [[c[s] if isinstance(c[s], float) else float("nan") for c in cols] for s in range(len(cols[0]))]


def summary(rep) -> str:
    lines = [f"The optimum is the vertex of the parabola through the best mean held-out loss and its two neighbours "
             f"on the grid of peak learning rates {', '.join(f'{x:g}' for x in LRS)} (log2 scale; a best rate at "
             f"the grid's edge leaves the optimum unbracketed); its shift from width {WIDTHS[0]} is "
             f"in factors of 2 (−1: half the rate), with a 95% bootstrap interval over the 3 seeds. Transfer holds "
             f"where the interval lies within ±0.5 (the optimum stays within a factor √2)."]
    for par in ("sp", "mup"):
        base = _losses(rep, par, WIDTHS[0])
        words = []
        for w in WIDTHS[1:]:
            shift, lo, hi = optimum_shift(LRS, base, _losses(rep, par, w))
            v = transfer_verdict(lo, hi)
            words.append(f"D={w}: shift {shift:+.2f} [{lo:+.2f}, {hi:+.2f}]: {v}")
        opt = 2 ** lr_optimum(LRS, base)
        lines.append(f"- {'µP' if par == 'mup' else 'SP'} (optimum at D={WIDTHS[0]}: lr {opt:.2g}): "
                     + "; ".join(words) + ".")
    return "\n".join(lines)


def extra(rep) -> str:
    """The transfer figure: mean held-out loss against the peak learning rate, one line per width (seed band:
    min–max), SP and µP side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, par in zip(axes, ("sp", "mup")):
        for w in WIDTHS:
            y = np.asarray(_losses(rep, par, w))
            ax.plot(LRS, np.nanmean(y, 0), marker="o", ms=3, label=f"D={w}")
            ax.fill_between(LRS, np.nanmin(y, 0), np.nanmax(y, 0), alpha=0.2, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate")
        ax.set_title("µP (base width 64)" if par == "mup" else "SP")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(METRIC)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path, link = rep.figure("transfer")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return link


def get_sweep():
    arms = tuple({"name": f"{par}, D={d}", "model.parametrization": par, "model.d_model": d, "model.d_ff": 4 * d,
                  **({"model.base_width": WIDTHS[0]} if par == "mup" else {})}
                 for par in ("sp", "mup") for d in WIDTHS)
    return Sweep(
        name="mup_transfer", title="Learning-rate transfer across width: SP against µP (tiny Shakespeare)",
        base="configs/shakespeare_char.py",
        doc=f"configs/shakespeare_char.py with 2 layers (4 heads, d_ff = 4D, blocks of 64, batch 12, AdamW, "
            f"warmup 30 then cosine, no clipping) at widths {', '.join(map(str, WIDTHS))}, {STEPS} steps, peak "
            f"learning rates {', '.join(f'{x:g}' for x in LRS)}; µP with base width {WIDTHS[0]} "
            "(jaxformer.mup). Held-out loss on the last 10% of the corpus, evaluated once at the end.",
        arms=arms, grid={"optim.lr": LRS},
        set=("model.num_decoder_layers=2", "model.runtime.remat=none", f"train.steps={STEPS}",
             "optim.warmup_steps=30", "optim.clip_norm=0.0", f"train.eval_every={STEPS}",
             f"train.checkpoint_every={STEPS}", "train.num_examples=0"),
        metrics={METRIC: "eval/loss"}, curves=(), summary=summary, extra=extra)
