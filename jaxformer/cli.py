"""Command line: `jaxformer train CONFIG [--set k=v ...] [--workdir DIR]`, `jaxformer eval`, `jaxformer params`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jaxformer.config import ConfigError, apply_overrides, load_config_file

console = Console()


def _config(args):
    cfg = load_config_file(args.config)
    return apply_overrides(cfg, args.set or [])


def params_table(model) -> Table:
    from jaxformer.nn import count_params
    t = Table(title="parameters per component")
    t.add_column("component")
    t.add_column("params", justify="right")
    for k, v in count_params(model).items():
        t.add_row(k, f"{v:,}", style="bold" if k == "total" else None)
    return t


def show_examples(rows):
    t = Table(title="decoded held-out examples")
    for c in ("input", "target", "prediction", "ok"):
        t.add_column(c)
    for r in rows:
        t.add_row(repr(r["input"]), repr(r["target"]), repr(r["prediction"]), "✓" if r["ok"] else "✗")
    console.print(t)


def show_eval(ev: dict, title: str):
    console.print(f"[bold]{title}[/bold]: " + ", ".join(f"{k}={v:.4f}" for k, v in ev.items()))


def cmd_train(args) -> int:
    from jaxformer.train.loop import setup, train
    cfg = _config(args)
    workdir = Path(args.workdir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    rcfg, _, graphdef, state = setup(cfg, workdir if workdir.exists() else None)
    from flax import nnx
    console.print(params_table(nnx.merge(graphdef, state)[0]))
    console.print(f"workdir: {workdir}")
    out = train(cfg, workdir, progress=not args.no_progress)
    console.print(f"status: {out['status']} after {out['wall_s']:.1f} s")
    show_eval(out["eval"], f"held-out (step {out['step']})")
    if "exact_match" in out["eval"]:
        console.print(f"[bold green]held-out exact-match accuracy: {100 * out['eval']['exact_match']:.1f}%[/]")
    show_examples(out["examples"])
    return 0


def cmd_eval(args) -> int:
    from jaxformer.train.loop import evaluate_run
    out = evaluate_run(args.workdir, args.which)
    show_eval(out["eval"], f"held-out ({args.which} checkpoint, step {out['step']})")
    show_examples(out["examples"])
    return 0


def cmd_params(args) -> int:
    import jax
    import jax.numpy as jnp
    from jaxformer.nn import build_model
    cfg = _config(args)
    m = cfg.model
    if m.vocab_size == 0:
        import dataclasses
        from jaxformer.data import build_task
        m = dataclasses.replace(m, vocab_size=build_task(cfg.data).tokenizer.vocab_size)
    model = build_model(m)
    console.print(params_table(model))
    x = jnp.ones((2, 8), jnp.int32)
    y = model(x, x) if m.arch == "encoder_decoder" else model(x)
    console.print(f"forward pass: tokens {x.shape} -> logits {y.shape}, finite={bool(jax.numpy.isfinite(y).all())}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxformer")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a config (resumes if --workdir has checkpoints)")
    t.add_argument("config")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. optim.lr=3e-4")
    t.add_argument("--workdir")
    t.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("eval", help="evaluate a run directory's best (or latest) checkpoint")
    e.add_argument("--workdir", required=True)
    e.add_argument("--which", choices=("best", "latest"), default="best")
    q = sub.add_parser("params", help="build a config's model, print its parameter table, run a forward pass")
    q.add_argument("config")
    q.add_argument("--set", action="append", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        return {"train": cmd_train, "eval": cmd_eval, "params": cmd_params}[args.cmd](args)
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
