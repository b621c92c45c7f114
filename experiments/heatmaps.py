"""Attention heatmaps of the README's main job (digit reversal, configs/reverse.py) and a check of the
anti-diagonal that reversal needs; writes docs/heatmaps/ (PNGs + README.md).

  .venv/bin/python experiments/heatmaps.py [--workdir RUN] [--out docs/heatmaps]

Without --workdir it trains configs/reverse.py into runs/heatmaps-<time> (about a minute on 2 CPU cores); a
--workdir that already holds a trained run is reused as it is (not retrained). Then it draws `jaxformer viz`'s
figures of the first two held-out inputs into OUT (dpi 80), and measures, for each decoder cross-attention layer
and head, the mean attention mass that output position i puts on source position len-1-i (the digit it must
copy): over the two inputs shown and over the whole held-out set, decoding the model's own greedy answers as the
figures do. Uniform attention over the len+1 source keys (digits + EOS) would put 1/(len+1) there.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from jaxformer.configio import load_config_file
from jaxformer.data import build_task
from jaxformer.inference import load_model
from jaxformer.runs import RunDir
from jaxformer.train.loop import train
from jaxformer.viz import attention_maps, write_maps

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = 0.5                      # a head "shows the anti-diagonal" when its mean mass there is at least this


def anti_diagonal(maps) -> tuple[np.ndarray, np.ndarray]:
    """Mean cross-attention mass on source position len-1-i from output position i (decoder input row i:
    BOS + the answer so far), over the given prompts' maps and their rows -> ([L,N] mass, [L,N] uniform baseline)."""
    total, base, count = 0.0, 0.0, 0
    for m in maps:
        w = m.probs["decoder_cross"]                                        # [L,N,T,S], S = len + 1 (EOS)
        n = w.shape[-1] - 1
        rows = np.arange(min(n, w.shape[2]))
        total = total + w[:, :, rows, n - 1 - rows].sum(-1)
        base, count = base + len(rows) / (n + 1), count + len(rows)
    return total / count, np.full_like(total, base / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="a trained configs/reverse.py run to reuse (default: train a new one)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "heatmaps"))
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args()
    t0 = time.perf_counter()
    workdir = Path(args.workdir or ROOT / "runs" / f"heatmaps-{time.strftime('%Y%m%d-%H%M%S')}")
    trained = not RunDir(workdir).config_path.exists()
    if trained:
        print(f"training configs/reverse.py into {workdir} ...", flush=True)
        train(load_config_file(ROOT / "configs/reverse.py"), workdir, progress="lines")
    train_s = time.perf_counter() - t0
    run = load_model(workdir, "best")
    task = build_task(run.cfg.data, run.tokenizer)
    tok = run.tokenizer
    held_out = [tok.decode(s) for s in task.eval["src"]]
    evals = [r for r in RunDir(workdir).read_metrics() if r["split"] == "eval" and r["step"] == run.step]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("prompt*.png"):
        old.unlink()
    shown = attention_maps(run, held_out[:2])
    paths = [p for i, m in enumerate(shown) for p in write_maps(m, i, out, args.dpi)]
    everything = attention_maps(run, held_out)
    exact = np.mean([m.answer == p[::-1] for m, p in zip(everything, held_out)])
    mass2, base2 = anti_diagonal(shown)
    mass, base = anti_diagonal(everything)

    layers, heads = mass.shape
    showing = [(layer, h) for layer in range(layers) for h in range(heads) if mass[layer, h] >= THRESHOLD]
    from jaxformer.stats import machine
    cmd = "python experiments/heatmaps.py" + ("" if trained else f" --workdir {args.workdir}")
    m = run.cfg.model
    md = ["# Attention heatmaps: digit reversal", "",
          f"Written by `.venv/bin/{cmd}` on {time.strftime('%Y-%m-%d')}, {machine()}"
          + (f"; training took {train_s:.0f} s." if trained else "."), "Do not edit by hand; rerun the command "
          "(without --workdir it trains configs/reverse.py afresh, about a minute on 2 CPU cores).", "",
          f"Model: configs/reverse.py ({m.num_encoder_layers}+{m.num_decoder_layers} layers, {m.num_heads} heads, "
          f"D={m.d_model}, {m.norm.position}-LN), its {run.which} checkpoint (step {run.step}"
          + (f", held-out exact match {100 * evals[-1]['exact_match']:.1f}%" if evals and "exact_match" in evals[-1]
             else "") + f"). Greedy answers on all {len(held_out)} held-out inputs here: {100 * exact:.1f}% exact.", "",
          "Each figure: one layer and attention kind, one subplot per head, rows = queries, columns = keys. "
          "The decoder input is BOS + the model's own greedy answer, so row i is the step that emits output "
          "digit i. The same figures for any run and prompt: `jaxformer viz --workdir RUN [--prompt DIGITS]`.", ""]
    for i, s in enumerate(shown):
        md += [f"## Held-out input {i}: `{s.prompt}` -> `{s.answer}`", ""]
        md += [f"![{p.stem}]({p.name})" for p in paths if p.name.startswith(f"prompt{i}-decoder_cross")]
        md += ["", "Also: " + ", ".join(f"[{p.stem}]({p.name})" for p in paths
                                        if p.name.startswith(f"prompt{i}-") and "cross" not in p.name), ""]
    md += ["## The anti-diagonal, measured", "",
           "Mean cross-attention weight that output position i (decoder input row i) puts on source position "
           "len-1-i, the digit it must copy, averaged over positions i < len and over inputs. Uniform attention "
           f"over the len+1 source keys would give {base[0, 0]:.3f} on the held-out set ({base2[0, 0]:.3f} on the "
           f"two inputs shown). A head shows the anti-diagonal here when its mass is >= {THRESHOLD}.", "",
           f"| layer | head | two inputs shown | all {len(held_out)} held-out inputs | anti-diagonal |",
           "|---|---|---|---|---|"]
    md += [f"| {layer} | {h} | {mass2[layer, h]:.3f} | {mass[layer, h]:.3f} | "
           f"{'yes' if mass[layer, h] >= THRESHOLD else 'no'} |" for layer in range(layers) for h in range(heads)]
    verdict = ("Heads showing the anti-diagonal: " + ", ".join(f"layer {a} head {b}" for a, b in showing) + "."
               if showing else "No head reaches the threshold.")
    verdict += " Per layer, on the held-out set: " + "; ".join(
        f"layer {layer} {mass[layer].min():.2f}-{mass[layer].max():.2f} (best head {int(mass[layer].argmax())})"
        for layer in range(layers)) + "."
    md += ["", verdict, ""]
    (out / "README.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    print(f"wrote {len(paths)} PNGs and README.md to {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
