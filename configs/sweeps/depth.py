"""Why Post-LN fails at depth: 12 and 24 layers × norm placement (post, pre, sandwich, deepnorm, post + QK-norm) ×
initialisation (glorot, pytorch, gpt2) on the Alice char LM, with learning-rate, warmup and head-tying arms, the
per-layer gradient norms at initialisation, and an independent PyTorch run of the Post-LN arms side by side
(experiments/torch_postln.py)."""
import json
import statistics
from pathlib import Path

from jaxformer.stats import difference, equivalence, more_often
from jaxformer.sweep import Sweep

PLACEMENTS = {"post": {"model.norm.position": "post"}, "pre": {"model.norm.position": "pre"},
              "sandwich": {"model.norm.position": "sandwich"}, "deepnorm": {"model.norm.position": "deepnorm"},
              "post+qknorm": {"model.norm.position": "post", "model.attention.qk_norm": True}}
INITS = ("glorot", "pytorch", "gpt2")
BASE = {"lr": 1e-3, "warmup": 50, "head": "untied"}


def arm(placement: str, init: str, layers: int, lr: float = 1e-3, warmup: int = 50, head: str = "untied") -> dict:
    """One arm: its name lists what differs from the study's base (lr 1e-3, warmup 50, untied head)."""
    extra = [f"lr={lr:g}"] * (lr != BASE["lr"]) + [f"warmup={warmup}"] * (warmup != BASE["warmup"]) \
        + ["tied head"] * (head == "tied")
    return {"name": ", ".join([placement, init, f"L={layers}", *extra]), **PLACEMENTS[placement],
            "model.runtime.init": init, "model.num_decoder_layers": layers, "optim.lr": lr,
            "optim.warmup_steps": warmup, "model.tie_embeddings": head == "tied"}


FOUR = ("post", "pre", "deepnorm", "post+qknorm")        # the side arms leave sandwich out (CPU time)
ARMS = tuple(
    [arm(p, i, 12) for p in PLACEMENTS for i in INITS]                                       # the main grid
    + [arm(p, i, 24) for p in PLACEMENTS for i in INITS if i != "gpt2" or p in ("post", "pre")]
    + [arm(p, i, 12, lr=5e-3) for p in FOUR for i in ("glorot", "pytorch")]                  # a 5× larger lr
    + [arm(p, i, 12, warmup=0) for p in FOUR for i in ("glorot", "pytorch")]                 # no warmup
    + [arm(p, i, 12, head="tied") for p in ("post", "pre") for i in INITS])                  # the default head


TORCH = Path(__file__).resolve().parents[2] / "docs" / "ablations" / "depth_torch.json"
MARGIN = 0.05       # nats per character: held-out loss differences we call negligible (~2% of the loss)


def _by_name(rep) -> dict:
    return {a.name: a for a in rep.arms}


def _fails(rep, arm) -> tuple[int, int]:
    st = rep.stat("failed", arm)
    return (round(st.mean * st.n), st.n) if st else (0, 0)


def torch_runs() -> list[dict]:
    """experiments/torch_postln.py's runs (docs/ablations/depth_torch.json); [] before it has run."""
    return json.loads(TORCH.read_text(encoding="utf-8"))["runs"] if TORCH.is_file() else []


def torch_table(rep) -> list[str]:
    """jaxformer's Post-LN arms beside the independent PyTorch runs of the same model, data and schedule."""
    arms = _by_name(rep)
    rows = ["| layers | init | head | jaxformer: failed | jaxformer: final train loss | PyTorch: failed | "
            "PyTorch: final train loss | jaxformer − PyTorch, held-out loss |", "|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in torch_runs():
        groups.setdefault((r["layers"], r["init"], "tied" if r["tied"] else "untied"), []).append(r)
    for (layers, init, head), runs in sorted(groups.items()):
        arm = arms.get(arm_name("post", init, layers, head=head))
        if arm is None:
            continue
        k, n = _fails(rep, arm)
        mine = rep.stat("train loss", arm)
        theirs = [r["train loss"] for r in runs]
        diff = equivalence(difference(rep.values("held-out loss", arm), [r["held-out loss"] for r in runs]), MARGIN)
        rows.append(f"| {layers} | {init} | {head} | {k}/{n} | {mine.mean:.3f} ± {mine.std:.3f} | "
                    f"{sum(r['failed'] for r in runs)}/{len(runs)} | {statistics.fmean(theirs):.3f} ± "
                    f"{statistics.stdev(theirs) if len(theirs) > 1 else 0:.3f} | {diff} |")
    return rows


def arm_name(placement: str, init: str, layers: int, lr: float = 1e-3, warmup: int = 50, head: str = "untied"):
    return arm(placement, init, layers, lr, warmup, head)["name"]


def _short(rep, arm) -> str:
    """A table cell: failed k/n · mean held-out loss."""
    if arm is None:
        return "—"
    k, n = _fails(rep, arm)
    st = rep.stat("held-out loss", arm)
    return f"{k}/{n} · {st.mean:.3f}" if st else f"{k}/{n}"


def grid_table(rep) -> list[str]:
    arms = _by_name(rep)
    cols = (("12 layers", {"layers": 12}), ("24 layers", {"layers": 24}),
            ("12, lr 5e-3", {"layers": 12, "lr": 5e-3}), ("12, no warmup", {"layers": 12, "warmup": 0}),
            ("12, tied head", {"layers": 12, "head": "tied"}))
    rows = ["| placement | init | " + " | ".join(c for c, _ in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for pl in PLACEMENTS:
        for init in INITS:
            cells = [_short(rep, arms.get(arm_name(pl, init, **kw))) for _, kw in cols]
            rows.append(f"| {pl} | {init} | " + " | ".join(cells) + " |")
    return rows


def _sum_fails(rep, placement, init, depths=(12, 24), **kw) -> tuple[int, int]:
    arms = _by_name(rep)
    got = [_fails(rep, arms[arm_name(placement, init, d, **kw)]) for d in depths
           if arm_name(placement, init, d, **kw) in arms]
    return sum(k for k, _ in got), sum(n for _, n in got)


def summary(rep) -> str:
    (gk, gn), (pk, pn) = _sum_fails(rep, "post", "glorot"), _sum_fails(rep, "post", "pytorch")
    verdict, p = more_often(gk, gn, pk, pn)
    qk, qn = _sum_fails(rep, "post", "gpt2")
    lines = [f"- Is it the init? Post-LN (untied head, lr 1e-3, 50 warmup steps) failed {gk}/{gn} runs under glorot, "
             f"{pk}/{pn} under pytorch and {qk}/{qn} under gpt2 at 12 and 24 layers (glorot vs pytorch, Fisher's "
             f"exact test, one-sided: p = {p:.2g}: "
             + ("the init decides whether Post-LN trains at this depth" if verdict == "holds" else "not resolved")
             + ")."]
    rescue, not_rescue = [], []
    for pl in ("pre", "sandwich", "deepnorm", "post+qknorm"):
        k, n = _sum_fails(rep, pl, "glorot")
        (rescue if k == 0 else not_rescue).append(f"{pl} {k}/{n}")
    lines.append("- Under glorot, the init Post-LN fails with, failures at 12 and 24 layers: "
                 + ", ".join(rescue + not_rescue) + f" (Post-LN {gk}/{gn}). "
                 + (f"{', '.join(r.split()[0] for r in rescue)} train in every run; " if rescue else "")
                 + (f"{', '.join(r.split()[0] for r in not_rescue)} "
                    f"{'does' if len(not_rescue) == 1 else 'do'} not rescue it." if not_rescue else ""))
    tk, tn = _sum_fails(rep, "post", "pytorch", depths=(12,), head="tied")
    uk, un = _sum_fails(rep, "post", "pytorch", depths=(12,))
    pk_, pn_ = _sum_fails(rep, "pre", "pytorch", depths=(12,), head="tied")
    lines.append(f"- The head: with pytorch's init (embeddings N(0, 1), times √D on the way in), Post-LN at 12 layers "
                 f"failed {tk}/{tn} runs with the output head tied to the embedding (jaxformer's default) and {uk}/{un} "
                 f"with its own head; Pre-LN failed {pk_}/{pn_} tied.")
    for label, kw in (("A 5× larger lr (5e-3)", {"lr": 5e-3}), ("No warmup", {"warmup": 0})):
        lines.append(f"- {label}, 12 layers, failures: " + "; ".join(
            f"{pl} " + ", ".join(f"{i} {'/'.join(map(str, _sum_fails(rep, pl, i, depths=(12,), **kw)))}"
                                 for i in ("glorot", "pytorch")) for pl in FOUR) + ".")
    ok = [a for a in rep.arms if "lr=" not in a.name and "warmup=" not in a.name and "tied" not in a.name
          and _fails(rep, a)[0] == 0 and rep.stat("held-out loss", a)]
    if ok:
        best = min(ok, key=lambda a: rep.stat("held-out loss", a).mean)
        pre = _by_name(rep)[arm_name("pre", "glorot", 12)]
        lines.append(f"- Best arm of the main grid: {best.name}, held-out loss {rep.stat('held-out loss', best).fmt()}; "
                     f"it − pre, glorot, L=12: " + equivalence(difference(rep.values("held-out loss", best),
                                                                            rep.values("held-out loss", pre)), MARGIN)
                     + ".")
    if torch_runs():
        arms, tr = _by_name(rep), {}
        for r in torch_runs():
            tr.setdefault((r["layers"], r["init"], "tied" if r["tied"] else "untied"), []).append(r["failed"])
        agree = [key for key, v in tr.items() if (sum(v) > 0) == (_fails(rep, arms[arm_name(
            "post", key[1], key[0], head=key[2])])[0] > 0)]
        lines.append(f"- PyTorch cross-check (experiments/torch_postln.py, torch.nn.TransformerEncoder with "
                     f"norm_first=False, its own init code): in {len(agree)} of {len(tr)} Post-LN settings jaxformer "
                     "and PyTorch agree on whether any run fails (table below).")
    lines += ["", "Failed runs / runs · mean held-out loss, per arm (lr 1e-3, 50 warmup steps and an untied head "
              "unless the column says otherwise; — = not run):", "", *grid_table(rep), "",
              f"Equal held-out losses mean within ±{MARGIN} nats on the 95% (Welch) interval of the difference; "
              "'failed' = a final training loss above 2.9 (no better than character frequencies) or not finite."]
    return "\n".join(lines)


def extra(rep) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from jaxformer.train.diagnostics import init_grad_norms
    seeds = list(rep.sweep.seeds)
    rows = ["| placement | init | layers | W2 gradient, first layer | last layer | last / first | whole layer, "
            "last / first |", "|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(INITS), figsize=(4 * len(INITS), 4), sharey=True)
    for ax, init in zip(axes, INITS):
        for pl, ov in PLACEMENTS.items():
            sets = [f"{k}={v}" for k, v in ov.items()] + [f"model.runtime.init={init}", "model.num_decoder_layers=12",
                                                           "model.tie_embeddings=false"]
            runs = [init_grad_norms(sets, seed=s) for s in seeds]
            w2 = [statistics.fmean(v) for v in zip(*(r["w2"] for r in runs))]
            layer = [statistics.fmean(v) for v in zip(*(r["layer"] for r in runs))]
            ax.plot(range(1, 13), w2, "o-", ms=3, label=pl)
            rows.append(f"| {pl} | {init} | 12 | {w2[0]:.3g} | {w2[-1]:.3g} | {w2[-1] / w2[0]:.2f} | "
                        f"{layer[-1] / layer[0]:.2f} |")
        ax.set_yscale("log")
        ax.set_title(f"init={init}, 12 layers")
        ax.set_xlabel("layer (1 = nearest the input)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("‖∂loss/∂W2‖ at initialisation")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"Per-layer FFN W2 gradient norm at init, Alice batch of 32, mean over seeds {seeds}")
    fig.tight_layout()
    path, link = rep.figure("init_grad_norms")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    out = ["## Gradient norms at initialisation", "",
           "Xiong et al. (2020): at initialisation Post-LN's gradients grow toward the output layers, Pre-LN's are "
           "about equal across layers. Per placement and init (12 layers, untied head, mean over the seeds):", "",
           *rows, "", link]
    if torch_runs():
        out += ["", "## PyTorch cross-check of the Post-LN arms", "",
                "experiments/torch_postln.py: torch.nn.TransformerEncoder(norm_first=False) under a causal mask, the "
                "same data, AdamW and schedule, its own init code (docs/ablations/depth_torch.json). Same seeds, "
                "not the same random numbers: agreement is on outcomes, not bits.", "", *torch_table(rep)]
    return "\n".join(out)


def get_sweep():
    return Sweep(
        name="depth", title="Depth: why Post-LN fails, and what rescues it (placement × init × lr × warmup × head)",
        base="configs/alice.py",
        doc="configs/alice.py (Alice char LM, D=64, 4 heads, d_ff=128, ReLU, sinusoidal positions, blocks of 10, "
            "batch 32) with 12 or 24 decoder layers; AdamW (β 0.9, 0.98, weight decay 0.01 on matrices), a linear "
            "warmup from 0 then cosine to 0, **no gradient clipping**, 300 steps. Placements: post = LN(x + f(x)), no "
            "final norm; pre = x + f(LN(x)) and a final norm; sandwich = x + LN'(f(LN(x))) and a final norm; "
            "deepnorm = LN(α·x + f(x)) with α = (2L)^¼ and the v, o and FFN matrices' init scaled by β = (8L)^-¼; "
            "post+qknorm = post with RMSNorm over each query and key head. Inits (model.runtime.init): glorot "
            "(Glorot-uniform per projection, embeddings N(0, 1/D)), pytorch (PyTorch's module defaults), gpt2 (N(0, 0.02²), residual "
            "outputs / √(2L)). Unless the arm says otherwise: peak lr 1e-3, warmup 50 steps, an untied output head "
            "(the PyTorch reference's nn.Linear; 'tied head' arms use jaxformer's default, the embedding transposed). "
            "'failed' = a non-finite loss or a final training loss above 2.9 (no better than character "
            "frequencies).",
        arms=ARMS,
        set=("optim.schedule=warmup_cosine", "optim.clip_norm=0", "train.steps=300", "train.log_every=10",
             "train.eval_every=50", "train.checkpoint_every=300", "train.num_examples=0"),
        metrics={"held-out loss": "eval/loss", "train loss": "train/loss",
                 "steps to train loss < 2.4": "train/loss<2.4", "failed": "failed:train/loss>2.9",
                 "diverged (NaN)": "diverged"},
        curves=("train/loss",), summary=summary, extra=extra)
