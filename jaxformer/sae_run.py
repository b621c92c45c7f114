"""A sparse autoencoder on a trained run: `jaxformer sae --workdir RUN --site resid_post --layer L [--steps N]
[--d-sae F] [--k K] [--architecture topk|standard|jumprelu] [--out DIR]`.

Trains `jaxformer.sae` on the site's activations as the run's model reads its own training data (the run's
data.* config, its tokenizer; batches streamed, padding left out), then writes into OUT (default RUN/sae/SITE-L,
SITE-L-2, -3, ... when that is taken; an explicit --out must be new or empty; written whole, `jaxformer.staging`):
sae/ (SAELens' folder: cfg.json + sae_weights.safetensors), report.json (evaluate_sae on the first held-out batch:
variance explained, L0, dead latents, the spliced-in loss; the training curve), frequencies.png (a histogram of
each latent's firing frequency on the held-out batch, log10, the dead ones counted apart) and top_contexts.json
(for the most frequent latents, the held-out positions where each fires most, each with the tokens up to it).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxformer.data import build_task
from jaxformer.errors import ConfigError
from jaxformer.inference import load_model
from jaxformer.runs import RunDir
from jaxformer.sae import (SAESpec, SiteInputs, check_site, encode, evaluate_sae, save_saelens, site_rows, site_width,
                           train_sae)
from jaxformer.staging import check_free, fresh, staged

log = logging.getLogger("jaxformer")


def run_inputs(cfg, batch: dict, site: str) -> tuple[SiteInputs, np.ndarray, np.ndarray]:
    """A task batch as the model call's inputs (positional, keywords, the valid positions of the stack `site`
    is in) -> (inputs, targets [B,T], their weights [B,T])."""
    pad = cfg.model.pad_id
    if cfg.model.arch == "decoder_only":
        kw = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
        valid = batch["segment_ids"] != 0 if "segment_ids" in batch else np.ones_like(batch["inputs"], bool)
        return SiteInputs((batch["inputs"],), kw, valid), batch["targets"], batch["targets"] != pad
    kw = {f"{side}_{k}": batch[f"{side}_{k}"] for side in ("src", "tgt") for k in ("segment_ids", "positions")
          if f"{side}_{k}" in batch}
    side = "src" if site.startswith("encoder.") else "tgt"
    token = batch["src"] if side == "src" else batch["tgt_in"]
    valid = batch[f"{side}_segment_ids"] != 0 if f"{side}_segment_ids" in batch else token != pad
    return SiteInputs((batch["src"], batch["tgt_in"]), kw, valid), batch["tgt_out"], batch["tgt_out"] != pad


def _frequencies(freq: np.ndarray, dpi: int = 100) -> Figure:
    fig = Figure(figsize=(5, 3), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    live = freq[freq > 0]
    ax.hist(np.log10(live), bins=30, color="tab:blue")
    ax.set_xlabel("log10 firing frequency on the held-out batch", fontsize=8)
    ax.set_ylabel("latents", fontsize=8)
    ax.set_title(f"{len(live)} live latents, {int((freq == 0).sum())} never fired", fontsize=8)
    return fig


def top_contexts(run, params, spec, inputs: SiteInputs, latents: int = 8, per: int = 5, width: int = 8) -> list:
    """For the `latents` most frequent latents, the `per` held-out positions where each fires most, with the
    (up to `width`) tokens of the patched stack that end there."""
    x, w = site_rows(run.model, inputs, spec)
    f = np.asarray(encode(params, x, spec)) * np.asarray(w)[:, None]
    stack = inputs.args[0] if spec.site.startswith("encoder.") or len(inputs.args) == 1 else inputs.args[1]
    stack = np.asarray(stack)
    t = stack.shape[1]
    out = []
    for latent in np.argsort(-(f > 0).sum(0))[:latents]:
        rows = np.argsort(-f[:, latent])[:per]
        out.append({"latent": int(latent), "frequency": float((f[:, latent] > 0).sum() / max(float(w.sum()), 1.0)),
                    "top": [{"activation": float(f[r, latent]), "row": int(r // t), "position": int(r % t),
                             "context": run.tokenizer.decode([int(i) for i in stack[r // t, max(0, r % t - width + 1):
                                                                                          r % t + 1]])}
                            for r in rows if f[r, latent] > 0]})
    return out


def train_run_sae(workdir, site: str, layer: int, *, steps: int = 1000, d_sae: int = 0, k: int = 32,
                  architecture: str = "topk", batch_size: int = 0, out=None, which: str = "best",
                  seed: int = 0) -> dict:
    """Train, evaluate and save an SAE on a run (module docstring). d_sae 0: 8 × the site's width; batch_size 0:
    the run's data.batch_size. -> the report (also in OUT/report.json). An explicit `out` must not exist or be
    an empty folder (OutputError naming what it holds, before anything is trained); the default RUN/sae/SITE-L
    goes to SITE-L-2, -3, ... when taken. OUT is written whole (`jaxformer.staging.staged`)."""
    for flag, value, least in (("--steps", steps, 1), ("--batch-size", batch_size, 0), ("--d-sae", d_sae, 0),
                               ("--k", k, 1), ("--layer", layer, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{flag} {value!r} must be an integer >= {least}")
    if out:
        check_free(out, what="--out")         # refused now, not after the training
    run = load_model(workdir, which)
    check_site(run.model, site, layer)        # a per-layer site of vectors, a layer its stack has
    width = site_width(run.model, site)
    spec = SAESpec(d_in=width, d_sae=d_sae or 8 * width, site=site, layer=layer, architecture=architecture, k=k)
    task = build_task(run.cfg.data, run.tokenizer)
    rows = batch_size or run.cfg.data.batch_size
    stream = (run_inputs(run.cfg, b, site)[0] for b in task.train_dataset(rows, seed))
    params, curve = train_sae(run.model, (b for _, b in zip(range(steps), stream)), spec, steps,
                              seed=seed)              # batches built as the steps take them
    held, targets, weights = run_inputs(run.cfg, next(task.eval_batches(rows)), site)
    report = {**evaluate_sae(run.model, params, spec, held, targets, weights), "step": run.step, "steps": steps,
              "spec": dataclasses.asdict(spec), "curve": [{k: float(v) for k, v in m.items()} for m in curve[:: max(1, steps // 50)]]}
    f = np.asarray(encode(params, site_rows(run.model, held, spec)[0], spec))
    valid = np.asarray(held.valid).reshape(-1) > 0
    figure, contexts = _frequencies((f[valid] > 0).mean(0)), top_contexts(run, params, spec, held)
    named = bool(out)
    out = Path(out) if named else fresh(RunDir(workdir).path / "sae" / f"{site}-{layer}")
    with staged(out, "sae", what="--out" if named else None) as tmp:     # OUT whole, or nothing
        save_saelens(params, spec, tmp / "sae", model_name=str(workdir))
        figure.savefig(tmp / "frequencies.png")
        (tmp / "top_contexts.json").write_text(json.dumps(contexts, indent=1) + "\n")
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log.info("%s: SAE on %s layer %d: fve %.3f, l0 %.1f, recovered %.3f -> %s", workdir, site, layer,
             report["fve"], report["l0"], report["recovered"], out)
    return report | {"out": str(out)}
