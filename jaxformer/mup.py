"""µP (the Maximal Update Parametrization, Yang et al. 2022, "Tensor Programs V") and its coordinate check.

`model.parametrization=mup` with `model.base_width=D₀` makes a model of width D (width multiplier m = D/D₀)
train like its base: hyperparameters tuned at D₀ (the learning rate first) hold at D. The rules, for Adam and
Lion (µP's Table 3 in the form of the `mup` package: output multiplier, not a zero-initialised readout):

  hidden matrices (attention q, k, v, o; FFN)   init as SP (variance ∝ 1/fan)     learning rate × 1/m
  MoE router [D, E] (fan-in the width)          init as SP                        learning rate × 1/m
  token embedding (and learned positions)       N(0, 1/D₀), multiplier √D₀        learning rate unchanged
  output head (untied; a tied one is the table)  N(0, 1/D₀) (MuReadout), × 1/m     learning rate unchanged
  attention logits                              q·k · √H₀ / H instead of q·k/√H   —
  biases, norm scales                           unchanged                         unchanged

(`nn.init`, `nn.embed.Embedder`, `nn.attention.logit_scale`, `train.optim.optimizer`). At D = D₀ every rule
is the identity: µP there is SP, bit for bit (tests/test_mup.py). SGD, Muon and schedule-free AdamW need other
rules and are refused.

`coord_check(cfg, widths, steps)` is the paper's coordinate check: the same batches through models of each
width, under SP and under µP (base width = the first width), the mean |x| of each activation site at
initialisation and after each of the first steps (an encoder-decoder's decoder sites, and its encoder's too:
ENCODER_SITES), and the learned logit update (how far training moved the correct token's logit: a head left at
SP's init shrinks it with width, while mean |logits| shrinks by design); `verdict` fits the slope of log mean|x| against log width at the last step: flat (|slope| ≤
FLAT at every site) is what µP promises, growth is what SP does with Adam. The widths must be distinct; two
give a slope without an interval (a line through two points), which the verdict says.
`jaxformer mup-check CONFIG` runs it, plots it and prints the verdicts.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.config import Config
from jaxformer.configio import apply_overrides
from jaxformer.errors import ConfigError, Interrupted
from jaxformer.signals import pending
from jaxformer.stats import resampler

SITES = ("embed", "attn_out", "mlp_out", "resid_post", "logits", "logit_update")
ENCODER_SITES = ("encoder.attn_out", "encoder.mlp_out", "memory")      # an encoder-decoder's encoder
_WHOLE = ("embed", "logits", "memory")                               # model-level sites (the others: per layer)
LEARNED = "logit_update"      # not an activation: |correct token's logit now − at init|, averaged (coord_check)
FLAT = 0.15                   # |slope| of log mean|x| per log width that still counts as flat


def widened(cfg: Config, width: int, parametrization: str, base: int) -> Config:
    """cfg at d_model=width (d_ff in the config's ratio to it), under `parametrization` with base width `base`,
    at a constant learning rate (the coordinate check looks at the config's peak rate) and without dropout."""
    m = cfg.model
    ff = max(1, round(m.d_ff * width / m.d_model))
    return apply_overrides(cfg, [f"model.d_model={width}", f"model.d_ff={ff}",
                                 f"model.parametrization={parametrization}",
                                 f"model.base_width={base if parametrization == 'mup' else 0}",
                                 "optim.schedule=constant", "optim.warmup_steps=0", "model.runtime.dropout=0.0"])


def coord_check(cfg: Config, widths: tuple[int, ...], steps: int = 4, seed: int = 0, log=None) -> dict:
    """{"widths", "steps", "sites", "sp"/"mup": {site: [steps+1][widths] mean |x|}} (module docstring); the
    per-layer sites are read at the last layer. Every width sees the same batches and initialisation seed.
    "logit_update" is what training did to the output: the mean |z_t − z_0| of the correct next token's logit
    z on the first batch (0 at step 0). µP makes it Θ(1) in width; an output head left at SP's init (std 1/√D
    under the 1/m multiplier) makes it shrink, which mean |logits| alone does not show (it shrinks by design)."""
    from jaxformer.data.build import resolve
    from jaxformer.train.step import init_state, make_train_step
    widths = _check_widths(widths)
    for w in widths:
        if w % cfg.model.num_heads:
            raise ConfigError(f"mup-check width {w} is not a multiple of model.num_heads={cfg.model.num_heads}")
    cfg, task = resolve(cfg)
    rows = cfg.data.batch_size
    it = iter(task.train_dataset(rows, seed))
    batches = []
    for _ in range(steps + 1):
        _stop_if_asked("while reading its batches")
        batches.append(jax.tree.map(jnp.asarray, next(it)))
    sites = SITES + (ENCODER_SITES if cfg.model.arch == "encoder_decoder" else ())
    out = {"widths": list(widths), "steps": steps, "sites": list(sites), "lr": cfg.optim.lr}
    for par in ("sp", "mup"):
        table = {s: [[0.0] * len(widths) for _ in range(steps + 1)] for s in sites}
        for j, w in enumerate(widths):
            c = apply_overrides(widened(cfg, w, par, widths[0]), [f"train.seed={seed}"])
            graphs, state = init_state(c)
            train_step = make_train_step(graphs, c)
            sizes = _sizes_fn(graphs.model, tuple(s for s in sites if s != LEARNED))
            z0 = None
            for t in range(steps + 1):
                _stop_if_asked(f"at {par} width {w}, step {t} of {steps}")
                if t:
                    state, _ = train_step(state, batches[t], jax.random.key(seed))
                size, z = sizes(state["model"], batches[0])
                z0 = z if z0 is None else z0
                for s, v in zip([s for s in sites if s != LEARNED], np.asarray(size)):
                    table[s][t][j] = float(v)
                table[LEARNED][t][j] = float(jnp.mean(jnp.abs(z - z0)))
            if log:
                log(f"{par} D={w}: " + ", ".join(f"{s} {table[s][-1][j]:.3g}" for s in sites))
        out[par] = table
    return out


def _stop_if_asked(where: str) -> None:
    """Interrupted when a stop signal arrived (SIGINT/SIGTERM/SIGHUP, held by the command line: `signals.pending`):
    the check stops between steps, before anything is written."""
    if pending():
        raise Interrupted(f"mup-check stopped on {pending()} {where}; nothing was written", pending())


def _check_widths(widths) -> tuple[int, ...]:
    """The widths sorted; ConfigError unless they are at least two, positive and distinct (a repeated width is
    no second point of the slope's fit)."""
    widths = tuple(sorted(widths))
    if not widths or widths[0] <= 0:
        raise ConfigError(f"mup-check widths={list(widths)!r}: give at least two distinct positive widths")
    repeated = sorted({w for w in widths if widths.count(w) > 1})
    if repeated:
        raise ConfigError(f"mup-check widths={list(widths)!r}: width {repeated[0]} is given more than once; "
                          f"give at least two distinct widths")
    if len(widths) < 2:
        raise ConfigError(f"mup-check widths={list(widths)!r}: a slope per width needs at least two distinct "
                          f"widths (three or more for it to have an interval)")
    return widths


def _sizes_fn(graphdef, sites: tuple[str, ...]):
    """jit(model state, batch) -> ([len(sites)] mean |x| of each site (a per-layer one at the last layer), the
    correct next token's logit [B,T] float32)."""
    @jax.jit
    def sizes(model_state, batch):
        model = nnx.merge(graphdef, model_state)
        args, kw = _forward_args(batch)
        cap = model(*args, **kw, capture=sites + ("logits",))[1]["captured"]
        targets = batch["targets"] if "targets" in batch else batch["tgt_out"]
        z = jnp.take_along_axis(cap["logits"].astype(jnp.float32), targets[..., None], axis=-1)[..., 0]
        return jnp.stack([jnp.mean(jnp.abs((cap[s] if s in _WHOLE else cap[s][-1]).astype(jnp.float32)))
                          for s in sites]), z
    return sizes


def _forward_args(batch: dict) -> tuple[tuple, dict]:
    """The model call's arguments and keywords for a training batch of either layout (`jaxformer.arch`): an
    encoder-decoder's {"src", "tgt_in", ...} or a language model's {"inputs", ...}."""
    if "src" in batch:
        return (batch["src"], batch["tgt_in"]), {f"{side}_{k}": batch.get(f"{side}_{k}") for side in ("src", "tgt")
                                                  for k in ("positions", "segment_ids")}
    return (batch["inputs"],), {"positions": batch.get("positions"), "segment_ids": batch.get("segment_ids")}


def slopes(result: dict, par: str, step: int = -1) -> dict[str, float]:
    """Per site: the least-squares slope of log mean|x| against log width at `step` (default the last).
    ConfigError unless the widths are at least two and distinct."""
    _check_widths(result["widths"])
    lw = np.log(np.asarray(result["widths"], np.float64))
    return {s: float(np.polyfit(lw, np.log(np.asarray(result[par][s][step], np.float64)), 1)[0])
            for s in result["sites"]}


def verdict(result: dict, par: str) -> str:
    """"flat" when every site's slope at the last step is within ±FLAT, else "grows" naming the steepest; from
    two widths it says that the slopes have no interval."""
    sl = slopes(result, par)
    site = max(sl, key=lambda s: abs(sl[s]))
    word = "flat" if abs(sl[site]) <= FLAT else ("grows" if sl[site] > 0 else "shrinks")
    two = len(result["widths"]) == 2
    return (f"{word} (steepest: {site}, slope {sl[site]:+.2f} per log width; flat is within ±{FLAT}"
            + ("; from 2 widths: a line through two points, with no interval (give 3 or more widths for one)"
               if two else "") + ")")


def plot(result: dict, path) -> None:
    """One panel per site and parametrization: mean |x| against width, one line per step (log-log)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    sites, widths = result["sites"], result["widths"]
    fig = Figure(figsize=(3.0 * len(sites), 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(sites), squeeze=False)
    for r, par in enumerate(("sp", "mup")):
        for c, s in enumerate(sites):
            ax = axes[r][c]
            for t, row in enumerate(result[par][s]):
                ax.plot(widths, row, marker="o", ms=3, lw=1.2, label=f"step {t}",
                        color=(0.15 + 0.7 * t / max(1, len(result[par][s]) - 1), 0.3, 0.6))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{'µP' if par == 'mup' else 'SP'}: {s}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if r == 1:
                ax.set_xlabel("width D", fontsize=8)
            if c == 0:
                ax.set_ylabel("mean |x|", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"coordinate check at lr {result['lr']:g}: SP {verdict(result, 'sp').split(' (')[0]}, "
                 f"µP {verdict(result, 'mup').split(' (')[0]}", fontsize=10)
    fig.savefig(path, dpi=80)


def log2_widths(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2·lo, ... up to hi."""
    return tuple(lo * 2 ** i for i in range(int(math.log2(hi // lo)) + 1))


def lr_optimum(lrs, losses) -> float:
    """log2 of the loss-minimising learning rate: the vertex of the parabola through the grid's best mean loss
    and its two neighbours (log2 lr against loss); losses [seeds][len(lrs)]. A best rate at the grid's edge is
    not bracketed: -inf (the lowest rate) or +inf (the highest), so an interval that reaches it is unresolved.
    NaN where no rate has a loss yet, or the best one's neighbour has none (a sweep still running)."""
    return float(_optima(lrs, np.asarray(losses, np.float64)[None])[0])


def _optima(lrs, losses: np.ndarray) -> np.ndarray:
    """`lr_optimum` of each of R grids at once: losses [R, seeds, len(lrs)] -> [R] (the bootstrap's resamples)."""
    x = np.log2(np.asarray(lrs, np.float64))
    seen = (~np.isnan(losses)).sum(axis=1)
    y = np.where(seen > 0, np.nansum(losses, axis=1) / np.maximum(seen, 1), np.nan)  # mean over the seeds that ran
    empty = np.isnan(y).all(axis=1)
    i = np.nanargmin(np.where(empty[:, None], 0.0, y), axis=1)
    j = np.clip(i, 1, len(x) - 2)[:, None] + np.arange(-1, 2)                     # the best and its neighbours
    (x0, x1, x2), (y0, y1, y2) = x[j].T, np.take_along_axis(y, j, axis=1).T
    with np.errstate(divide="ignore", invalid="ignore"):
        a = ((y2 - y1) / (x2 - x1) - (y1 - y0) / (x1 - x0)) / (x2 - x0)    # the parabola through the three
        b = (y1 - y0) / (x1 - x0) - a * (x0 + x1)
        v = -b / (2 * a)                              # a > 0: the middle point is the lowest of the three
    v = np.where(np.isnan(y0) | np.isnan(y1) | np.isnan(y2), np.nan, v)
    v = np.where(i == 0, -np.inf, np.where(i == len(x) - 1, np.inf, v))
    return np.where(empty, np.nan, v)


def optimum_shift(lrs, base: list, other: list, n: int = 2000, seed: int = 0,
                  other_lrs=None) -> tuple[float, float, float]:
    """How far the loss-minimising learning rate moves from one width to another, in factors of 2: (shift,
    lo, hi), the point estimate and its 95% bootstrap interval over seeds (each width's seeds resampled with
    replacement, a seed's losses at every rate together, their spread rescaled for the small sample as the
    scaling fits' are: `stats.resampled`; both optima refitted; an unbracketed optimum counts with the whole range it can lie in, so a
    best rate at the edge of a grid that stops short of the other width's optimum leaves the interval open on
    that side). base: losses [seeds][len(lrs)] of one width; other: losses [seeds][len(other_lrs)] of the
    other, at its own grid of rates (default: lrs)."""
    base, other = np.asarray(base, np.float64), np.asarray(other, np.float64)
    olrs = lrs if other_lrs is None else other_lrs
    rng = np.random.default_rng(seed)
    shift = lr_optimum(olrs, other) - lr_optimum(lrs, base)
    draw_other, draw_base = resampler(other, np.zeros(len(other))), resampler(base, np.zeros(len(base)))
    draws = [(draw_other(rng)[1], draw_base(rng)[1]) for _ in range(n)]
    o_lo, o_hi = _optimum_range(olrs, np.stack([o for o, _ in draws]))
    b_lo, b_hi = _optimum_range(lrs, np.stack([b for _, b in draws]))
    # the order statistics themselves (no interpolation: between two infinite ends it is undefined)
    lo, hi = np.percentile(o_lo - b_hi, 2.5, method="lower"), np.percentile(o_hi - b_lo, 97.5, method="higher")
    return float(shift), float(lo), float(hi)


def _optimum_range(lrs, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each grid's optimum can lie (log2 lr), losses [R, seeds, len(lrs)] -> (lo [R], hi [R]): the vertex
    twice when bracketed; below the grid's second rate when the best is the lowest rate (the loss rises from
    there), above the second-highest when it is the highest."""
    v = _optima(lrs, losses)
    x = np.log2(np.asarray(lrs, np.float64))
    return np.where(v == np.inf, x[-2], v), np.where(v == -np.inf, x[1], v)


def shift_text(shift: float, lo: float, hi: float) -> str:
    """An optimum's shift and its interval as a report writes them: "-0.46 [-0.68, -0.30]"; an unbracketed
    optimum (its best rate at the grid's edge) as "below its grid [-inf, -3.29]" or "above its grid [...]"; a
    missing one (runs not finished) as "not measured"."""
    if math.isnan(shift):
        return "not measured"
    point = f"{shift:+.2f}" if math.isfinite(shift) else f"{'below' if shift < 0 else 'above'} its grid"
    return f"{point} [{lo:+.2f}, {hi:+.2f}]"


def transfer_verdict(lo: float, hi: float, tolerance: float = 0.5) -> str:
    """The verdict on an optimum's shift interval [lo, hi] (factors of 2): "holds" within ±tolerance, "does not
    hold" entirely beyond it (an unbracketed optimum included: it left the grid), else "not resolved"."""
    if -tolerance <= lo and hi <= tolerance:
        return "holds"
    return "does not hold" if hi < -tolerance or lo > tolerance else "not resolved"
