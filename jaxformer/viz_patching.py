"""Activation patching of a trained run, drawn: `jaxformer viz --workdir RUN --plot patching --prompt CLEAN
--corrupt CORRUPT [--site SITE] [--over position|head|both]`.

The corrupted prompt (the same number of tokens as the clean one) runs with one cell of a site taken from the
clean run, every cell (`jaxformer.patching.patching_grid`), beside attribution patching's estimate of the same
cells from one backward pass. The metric is the clean run's own answer: the log-probability of the tokens the
clean run predicts (a language model: the token after the prompt, its greedy choice; an encoder-decoder: its
greedy answer and EOS, the decoder fed that answer in both runs). 1 = that cell restores the clean answer's
log-probability, 0 = it does nothing. Default site: resid_pre (an encoder-decoder: encoder.resid_pre, whose
positions are the source tokens).

Files: OUT/patching-{site}.png (the grid and the estimate side by side) and OUT/patching-{site}.json (both, the
tokens, the site, the metric's clean and corrupted values). Axis legend: L layers, T positions, N heads.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxformer.errors import ConfigError, DataError
from jaxformer.inference import load_model
from jaxformer.runs import RunDir
from jaxformer.viz import encode_prompt, next_tokens, token_label, write_figures

log = logging.getLogger("jaxformer")


def _inputs(run, clean: str, corrupt: str):
    """(clean inputs, corrupted inputs, scored positions [T] weights, targets [T], the patched stack's tokens)."""
    nt = next_tokens(run, [clean])
    bad = encode_prompt(run, corrupt)
    good = encode_prompt(run, clean)
    if len(bad) != len(good):
        raise DataError(f"--corrupt {corrupt[:40]!r} is {len(bad)} tokens and --prompt {clean[:40]!r} {len(good)}: "
                        f"patching pairs positions, so both need the same length")
    if run.cfg.model.arch == "decoder_only":
        tokens = nt.args[0]
        weights = np.zeros(tokens.shape[1], np.float32)
        weights[len(good) - 1] = 1.0                                   # the prediction after the prompt
        targets = np.zeros(tokens.shape[1], np.int32)
        targets[len(good) - 1] = int(np.argmax(run.model(jnp.asarray(tokens))[0][0, len(good) - 1]))
        return (tokens,), (jnp.asarray(bad)[None],), weights, targets, good
    src, tgt = nt.args
    return (src, tgt), (jnp.asarray(bad)[None], tgt), nt.weights[0], nt.targets[0], good


def patching_maps(workdir, clean: str, corrupt: str, site: str | None = None, over: str = "position",
                  which: str = "best", weights: str = "trained") -> dict:
    """The patching grid and attribution map of a run's model for one clean / corrupted prompt pair (module
    docstring). -> {site, over, grid, attribution, tokens, metric_clean, metric_corrupt, step}. DataError when
    the prompts differ in length or the corruption does not change the metric."""
    from jaxformer.patching import attribution_patching, patching_grid
    run = load_model(workdir, which, weights=weights)
    site = site or ("resid_pre" if run.cfg.model.arch == "decoder_only" else "encoder.resid_pre")
    good, bad, w, targets, tokens = _inputs(run, clean, corrupt)
    w, targets = jnp.asarray(w), jnp.asarray(targets)

    def metric(logits):
        lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), -1)
        return jnp.sum(w * jnp.take_along_axis(lp, targets[:, None], -1)[:, 0])
    top, base = float(metric(run.model(*good)[0])), float(metric(run.model(*bad)[0]))
    if abs(top - base) < 1e-6:
        raise DataError(f"--corrupt {corrupt[:40]!r} does not change the clean answer's log-probability "
                        f"({top:.4g}): there is no effect to restore")
    grid = np.asarray(patching_grid(run.model, good, bad, site, metric, over=over))
    est = np.asarray(attribution_patching(run.model, good, bad, site, metric, over=over))
    stack = tokens if site.startswith("encoder.") or run.cfg.model.arch == "decoder_only" else np.asarray(good[1][0])
    return {"site": site, "over": over, "grid": grid.tolist(), "attribution": est.tolist(),
            "tokens": [token_label(run.tokenizer, t) for t in stack], "metric_clean": top, "metric_corrupt": base,
            "step": run.step, "clean": clean, "corrupt": corrupt}


def plot_patching(maps: dict, dpi: int = 100) -> Figure:
    """The grid and the attribution map side by side ([L,T] or [L,N]; [L,T,N] summed over heads)."""
    grid, est = (np.asarray(maps[k]) for k in ("grid", "attribution"))
    if grid.ndim == 3:
        grid, est = grid.sum(-1), est.sum(-1)
    layers, cols = grid.shape
    fig = Figure(figsize=(2 * (0.45 * cols + 1.6), 0.45 * layers + 1.8), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    top = float(max(np.abs(grid).max(), np.abs(est).max())) or 1.0
    labels = maps["tokens"] if maps["over"] != "head" else [str(h) for h in range(cols)]
    for ax, values, title in zip(fig.subplots(1, 2), (grid, est), ("patched", "attribution estimate")):
        image = ax.imshow(values, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(cols), labels[:cols], rotation=90, fontsize=7, parse_math=False)
        ax.set_yticks(range(layers), [f"layer {i}" for i in range(layers)], fontsize=7)
        ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=fig.axes, shrink=0.8).set_label("share of the clean answer's log-probability restored",
                                                           fontsize=7)
    fig.suptitle(f"{maps['site']} over {maps['over']}: {maps['clean'][:40]!r} vs {maps['corrupt'][:40]!r}",
                 fontsize=8, parse_math=False)
    return fig


def write_patching(workdir, prompts: list[str] | None, corrupt: str | None, site: str | None = None,
                   over: str = "position", which: str = "best", out=None, *, dpi: int = 100,
                   weights: str = "trained") -> list[Path]:
    """OUT/patching-{site}.png and .json for the one --prompt and --corrupt (module docstring). A file in OUT of
    either name that jaxformer did not write raises OutputError, nothing written (`viz.write_figures`)."""
    if not prompts or len(prompts) != 1 or corrupt is None:
        raise ConfigError("--plot patching takes exactly one --prompt (the clean input) and one --corrupt")
    maps = patching_maps(workdir, prompts[0], corrupt, site, over, which, weights)
    named, out = out is not None, RunDir(workdir).viz_path if out is None else Path(out)
    name = maps["site"].replace(".", "-")
    paths = write_figures(out, {
        f"patching-{name}.png": lambda path: plot_patching(maps, dpi).savefig(path, dpi=dpi),
        f"patching-{name}.json": lambda path: path.write_text(json.dumps(maps, indent=1) + "\n")}, named)
    log.info("%s: step %d; patching of %s into %s", workdir, maps["step"], maps["site"], out)
    return paths
