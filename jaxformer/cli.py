"""Command line: `jaxformer train CONFIG [--set k=v ...] [--workdir DIR]`, `jaxformer eval --workdir RUN`,
`jaxformer generate --workdir RUN [--prompt TEXT ...]`, `jaxformer eval-tasks --workdir RUN --tasks FILE ...`,
`jaxformer params CONFIG`, `jaxformer plan CONFIG`, `jaxformer mup-check CONFIG` (µP's coordinate check),
`jaxformer sweep SWEEP.py`, `jaxformer report SWEEP.py`,
`jaxformer viz --workdir RUN [--prompt TEXT ...] [--plot attention|lens|heads|patching] [--out DIR]` (attention
heatmaps, the logit lens, the head-ablation table, the patching grid with its attribution estimate),
`jaxformer sae --workdir RUN --layer L` (a sparse autoencoder on a site)."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":            # `python -m jaxformer.cli`: malloc settings first (jaxformer.platforms.launch)
    from jaxformer.platforms.launch import hugepage_malloc
    from jaxformer.signals import hold_from_start
    hold_from_start()
    hugepage_malloc()

from rich.console import Console
from rich.table import Table
from rich.text import Text

from jaxformer.cli_parser import parser
from jaxformer.configio import apply_overrides, load_config_file
from jaxformer.errors import Interrupted, JaxformerError
from jaxformer.signals import hold_from_start, pending, unheld

console = Console(soft_wrap=True)       # long lines stay whole in logs and pipes


def _config(args, resolved: bool = False):
    """The config file with its --set overrides; resolved=True: with model.vocab_size taken from the data when
    it is 0 (`data.resolve`)."""
    cfg = apply_overrides(load_config_file(args.config), args.set or [])
    if resolved and cfg.model.vocab_size == 0:
        from jaxformer.data import resolve
        cfg = resolve(cfg)[0]
    return cfg


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
    import jax

    from jaxformer.distributed import is_primary
    from jaxformer.train.loop import train
    cfg = _config(args)
    workdir = Path(args.workdir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")

    def on_start(p):
        if is_primary():                      # one process of a multi-host run reports
            console.print(params_table(p.model))
            console.print(f"workdir: {workdir}" + (f" (resuming at step {p.start})" if p.start else "")
                          + f"; mesh {p.plan.describe()}")

    out = train(cfg, workdir, progress="lines" if args.no_progress else "auto", on_start=on_start)
    primary = is_primary()
    if jax.distributed.is_initialized():     # every process leaves together, here, not in its exit handlers
        jax.distributed.shutdown()           # (which wait behind threads and printing; the peers' wait is bounded)
    if not primary:
        return 0 if out["signal"] is None else 128 + signal.Signals[out["signal"]].value
    console.print(f"status: {out['status']}" + (f" by {out['signal']}" if out["signal"] else "")
                  + f" at step {out['step']} after {out['wall_s']:.1f} s")
    console.print("time (s): " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in out["timings"].items()))
    if out["eval"]:
        show_eval(out["eval"], f"held-out (step {out['step']})")
    if "exact_match" in out["eval"]:
        console.print(f"[bold green]held-out exact-match accuracy: {100 * out['eval']['exact_match']:.1f}%[/]")
    if out["examples"]:
        show_examples(out["examples"])
    if out["signal"]:                        # a scheduler must tell an interrupted run from a finished one
        return 128 + signal.Signals[out["signal"]].value
    return 0


def cmd_eval(args) -> int:
    from jaxformer.inference import evaluate_run
    if args.stride is not None and args.stride < 1:
        from jaxformer.errors import ConfigError
        raise ConfigError(f"--stride {args.stride} must be at least 1 (tokens between scored windows)")
    if args.stride is not None and not args.data:
        from jaxformer.errors import ConfigError
        raise ConfigError(f"--stride {args.stride} needs --data FILE: the held-out set is scored in whole blocks "
                          f"(strided windows are for a text file)")
    if args.data:
        from jaxformer.inference import load_model
        from jaxformer.inference.evaluate import evaluate_text
        run = load_model(args.workdir, args.which, quantize=args.quantize, weights=args.weights)
        out = evaluate_text(run, args.data, stride=args.stride)
        console.print(f"{args.data}: {out['tokens']:,} tokens ({out['bytes']:,} bytes of text), windows of "
                      f"{out['window']} every {out['stride']} ({run.which} checkpoint, step {run.step})")
        show_eval({k: out[k] for k in ("loss", "perplexity", "bits_per_byte")}, "text")
        return 0
    out = evaluate_run(args.workdir, args.which, args.quantize, args.weights)
    quant = f", weights {args.quantize}" if args.quantize else ""
    show_eval(out["eval"], f"held-out ({out['which']} checkpoint, step {out['step']}{quant})")
    show_examples(out["examples"])
    return 0


def cmd_generate(args) -> int:
    from jaxformer.arch import architecture
    from jaxformer.inference import default_prompts, generate_text, load_model
    run = load_model(args.workdir, args.which, quantize=args.quantize, weights=args.weights)
    prompts = args.prompt or default_prompts(run)
    with unheld("generate"):                 # one compiled call that writes nothing: Ctrl-C ends it at once
        outs = generate_text(run, prompts, max_new=args.max_new, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, beam=args.beam, seed=args.seed, kv_cache=args.kv_cache)
    how = f"beam {args.beam}" if args.beam > 1 else ("greedy" if args.temperature == 0 else
                                                      f"temperature {args.temperature}, top-k {args.top_k}, "
                                                      f"top-p {args.top_p}, seed {args.seed}")
    quant = (f", weights {args.quantize}" if args.quantize else "") + (
        f", KV cache {args.kv_cache}" if args.kv_cache != "auto" else "")
    console.print(f"{args.workdir}: {run.which} checkpoint (step {run.step}){quant}, {how}")
    sep = architecture(run.cfg.model.arch).separator
    for p, o in zip(prompts, outs):
        console.print(Text.assemble((p, "bold"), (sep, "dim"), (o, "green")))
    return 0


def cmd_sae(args) -> int:
    from jaxformer.sae_run import train_run_sae
    r = train_run_sae(args.workdir, args.site, args.layer, steps=args.steps, d_sae=args.d_sae, k=args.k,
                      architecture=args.architecture, batch_size=args.batch_size, out=args.out, which=args.which)
    console.print(f"SAE on {args.site} layer {args.layer}: variance explained {r['fve']:.3f}, L0 {r['l0']:.1f}, "
                  f"dead {r['dead']:.1%}, loss recovered {r['recovered']:.3f} -> {r['out']}", markup=False)
    return 0


def cmd_viz(args) -> int:
    from jaxformer.viz import write_heatmaps, write_probes
    plots = list(dict.fromkeys(args.plot or ["attention"]))
    if "patching" in plots:    # its two programs compile for seconds each: a later viz of this model loads them from
        from jaxformer import compile_cache     # disk (benchmarks/results/patching_tl.md, the warm-cache row)
        compile_cache.enable()
    paths = write_heatmaps(args.workdir, args.prompt, args.which, args.out, weights=args.weights) \
        if "attention" in plots else []
    if set(plots) - {"attention", "patching"}:
        paths += write_probes(args.workdir, args.prompt, plots, args.which, args.out, weights=args.weights)
    if "patching" in plots:
        from jaxformer.viz_patching import write_patching
        paths += write_patching(args.workdir, args.prompt, args.corrupt, args.site, args.over, args.which, args.out,
                                weights=args.weights)
    console.print(f"{len(paths)} figure(s) written ({', '.join(plots)}):")
    for p in paths:
        console.print(str(p), markup=False, highlight=False)
    return 0


def cmd_mup_check(args) -> int:
    import json

    from jaxformer import mup
    from jaxformer.errors import ConfigError
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if Path(args.out).exists() and not Path(args.out).is_dir():      # said before the check runs, not after
        raise ConfigError(f"--out {args.out} exists and is not a folder (mup-check writes mup_check.json and "
                          f"mup_check.png into a folder); choose another --out")
    cfg = _config(args)
    result = mup.coord_check(cfg, tuple(args.widths), args.steps, log=lambda s: console.print(s, markup=False))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["verdict"] = {p: mup.verdict(result, p) for p in ("sp", "mup")}
    result["slopes"] = {p: mup.slopes(result, p) for p in ("sp", "mup")}
    from jaxformer.stats import machine
    result["command"] = "jaxformer mup-check " + " ".join(
        [args.config, *(f"--set {s}" for s in args.set or []), "--widths", *map(str, args.widths),
         "--steps", str(args.steps)])
    result["machine"], result["date"] = machine(), time.strftime("%Y-%m-%d")
    (out / "mup_check.json").write_text(json.dumps(result, indent=1) + "\n")
    mup.plot(result, out / "mup_check.png")
    t = Table(title=f"coordinate check after {args.steps} steps: slope of log mean|x| per log width")
    for c in ("site", "SP", "µP"):
        t.add_column(c, justify="right" if c != "site" else "left")
    for s in result["sites"]:
        t.add_row(s, f"{result['slopes']['sp'][s]:+.2f}", f"{result['slopes']['mup'][s]:+.2f}")
    console.print(t)
    console.print(f"SP: {result['verdict']['sp']}\nµP: {result['verdict']['mup']}", markup=False)
    console.print(f"written: {out / 'mup_check.json'}, {out / 'mup_check.png'}", markup=False)
    return 0


def cmd_params(args) -> int:
    import jax
    from jaxformer.arch import architecture
    from jaxformer.nn import build_model
    cfg = _config(args, resolved=True)
    model = build_model(cfg.model)
    console.print(params_table(model))
    arch = architecture(cfg.model.arch)
    batch = arch.example_batch(2, 8)
    y = arch.forward(model, batch)[0]
    console.print(f"forward pass: tokens {arch.prompts(batch)[0].shape} -> logits {y.shape}, "
                  f"finite={bool(jax.numpy.isfinite(y).all())}")
    return 0


def cmd_sweep(args) -> int:
    from jaxformer.sweep import command, load_sweep, run_sweep, runs, select
    sweep = load_sweep(args.sweep)
    if args.print_commands or args.list:
        all_runs = runs(sweep, args.root)
        for r in select(all_runs, args.run) if args.run else all_runs:
            if args.print_commands:
                print(command(sweep, r))
            else:
                from jaxformer.sweep import read_status
                st = read_status(r)
                print(f"{r.index:4d}  {r.id}  {st['status'] if st else 'not finished'}  "
                      f"{' '.join(r.overrides)}")
        return 0
    run_sweep(sweep, args.root, jobs=args.jobs, only=args.run, echo=lambda m: console.print(m, markup=False))
    return 0


def cmd_report(args) -> int:
    from jaxformer.report import write_report
    from jaxformer.sweep import load_sweep
    from jaxformer.verdicts import rewrite_verdict
    sweep = load_sweep(args.sweep)
    path = rewrite_verdict(sweep, args.out) if args.verdict_only else write_report(sweep, args.root, args.out)
    console.print(f"report: {path}" + (" (verdict recomputed from its CSVs)" if args.verdict_only else ""))
    return 0


def cmd_plan(args) -> int:
    """The parallel plan of a config on this machine's devices, computed from shapes (nothing compiled)."""
    import math

    import jax
    from flax import nnx
    from jaxformer.parallel import Plan, rules_table
    from jaxformer.train.step import abstract_state
    cfg = _config(args, resolved=True)
    plan = Plan(cfg.parallel)
    plan.check_batch(cfg.data.batch_size, "data.batch_size")
    plan.check_pipeline(cfg)
    _, state = abstract_state(cfg, plan)
    console.print(f"mesh: {plan.describe()} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    console.print(rules_table(cfg.parallel))
    console.print("model parameters: shape, sharding (optimizer moments are sharded alike)")
    for path, a in nnx.to_flat_state(state["model"]):
        console.print(f"  {'/'.join(map(str, path)):56} {str(a.shape):18} {tuple(a.sharding.spec)}", markup=False)
    per_device = lambda tree: sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                                  for a in jax.tree.leaves(tree))
    total = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
    for part in ("model", "opt"):
        console.print(f"{part} state: {total(state[part]) / 2**20:,.1f} MiB in all, "
                      f"{per_device(state[part]) / 2**20:,.1f} MiB per device")
    return 0


def cmd_data(args) -> int:
    from jaxformer.data.prepare import prepare
    index = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, docs=args.docs,
                    eval_fraction=args.eval_fraction, shard_tokens=args.shard_tokens, dtype=args.dtype,
                    progress=not args.no_progress and sys.stderr.isatty())
    tok = index["tokenizer"]
    print(f"prepared {args.out}: {tok['kind']} tokenizer of {tok['vocab_size']:,} ids, {index['dtype']} shards, "
          f"{index['seconds']:.1f} s")
    for split, info in index["splits"].items():
        print(f"  {split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {info['text_bytes']:,} bytes "
              f"of text ({info['text_bytes'] / max(info['tokens'], 1):.2f} bytes per token), "
              f"{len(info['shards'])} shard(s)")
    return 0


def cmd_import_hf(args) -> int:
    from jaxformer.train.pretrained import import_run
    m = import_run(args.source, args.workdir, data=args.data, overrides=args.set or [],
                   progress=sys.stderr.isatty())
    console.print(f"imported {args.source} into {args.workdir} (step 0): held-out loss {m['loss']:.4f}, bits per "
                  f"byte {m.get('bits_per_byte', float('nan')):.4f}; fine-tune with `jaxformer train "
                  f"{args.workdir}/config.json --workdir {args.workdir} --set train.steps=N`", markup=False)
    return 0


def cmd_export_hf(args) -> int:
    from jaxformer.inference.export import export_run
    written = export_run(args.workdir, args.out, which=args.which, dtype=args.dtype, family=args.family,
                         weights=args.weights, adapter=args.adapter)
    what = "" if args.weights == "trained" else f", its {args.weights} weights"
    if args.adapter:
        console.print(f"exported the adapters of {args.workdir} ({args.which} checkpoint{what}) to {args.out}: "
                      f"LoRA r={written['r']} on {', '.join(written['target_modules'])}, {args.dtype}", markup=False)
        return 0
    console.print(f"exported {args.workdir} ({args.which} checkpoint{what}) to {args.out}: {written['model_type']}, "
                  f"{args.dtype}", markup=False)
    return 0


def cmd_eval_tasks(args) -> int:
    from jaxformer.errors import ConfigError
    from jaxformer.inference import load_model
    from jaxformer.inference.tasks import evaluate_tasks
    for name, v in (("--max-new", args.max_new), ("--batch-rows", args.batch_rows)):
        if v < 1:
            raise ConfigError(f"{name} {v} must be at least 1")
    run = load_model(args.workdir, args.which, quantize=args.quantize, weights=args.weights)
    results = evaluate_tasks(run, args.workdir, args.tasks, max_new=args.max_new,
                             until=tuple(args.until or ("\n\n",)), answer_regex=args.answer_regex,
                             batch_rows=args.batch_rows, chat_template=args.chat_template)
    t = Table(title=f"{args.workdir}: {run.which} checkpoint (step {run.step})")
    for c in ("task", "kind", "metric", "value", "stderr", "n"):
        t.add_column(c)
    for name, r in results.items():
        for metric, st in r["metrics"].items():
            t.add_row(name, r["kind"], metric, f"{st['value']:.4f}", "n/a" if st["stderr"] is None else
                      f"{st['stderr']:.4f}", str(st["n"]))
    console.print(t)
    console.print(f"results and predictions: {Path(args.workdir) / 'eval_tasks'}", markup=False)
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cmds = {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "params": cmd_params, "generate": cmd_generate,
            "plan": cmd_plan, "sweep": cmd_sweep, "report": cmd_report, "viz": cmd_viz, "sae": cmd_sae, "import-hf": cmd_import_hf,
            "export-hf": cmd_export_hf, "eval-tasks": cmd_eval_tasks, "mup-check": cmd_mup_check}
    try:
        for flag in ("workdir", "out"):      # '' would be the working directory, which no one asked for
            if getattr(args, flag, None) == "":
                from jaxformer.errors import ConfigError
                raise ConfigError(f"--{flag} '' names no directory")
        with _log_to_console():
            if pending():                    # Ctrl-C while Python started: nothing done yet
                raise Interrupted(f"jaxformer {args.cmd} stopped on {pending()} before it started; nothing was done",
                                  pending())
            rc = cmds[args.cmd](args)
            if pending() and rc == 0:        # a short command holds a signal until it is done
                console.print(f"[red]interrupted:[/red] {pending()} arrived while jaxformer {args.cmd} ran; it "
                              f"finished first")
                return 128 + signal.Signals[pending()].value
            return rc
    except JaxformerError as e:
        if os.environ.get("JAXFORMER_DEBUG"):
            import traceback
            traceback.print_exc()
        console.print(Text.assemble((f"{e.label}:", "red"), " ", str(e)), soft_wrap=True)   # one unbroken line
        return e.exit_code
    except BrokenPipeError:                  # stdout closed (`| head`, a quitting `less`) outside the train loop
        from jaxformer.train.monitor import detach_stdout
        detach_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)
    except OSError as e:                     # the machine's doing, not ours: a full disk, a vanished mount
        console.print(Text.assemble(("I/O error:", "red"), " ", str(e)), soft_wrap=True)
        return 2
    except (RuntimeError, AssertionError) as e:
        if "RESOURCE_EXHAUSTED" in str(e):   # XLA's allocator: a size asked for (e.g. generate --max-new) too big
            why = str(e).splitlines()[0][:300].rstrip(".") + "; ask for less (a smaller --max-new, batch or model)"
            console.print(Text.assemble(("out of memory:", "red"), " ", why), soft_wrap=True)
            return 2
        why = _platform_failure(e)
        if why is None:
            raise
        console.print(Text.assemble(("platform error:", "red"), " ", why), soft_wrap=True)
        return 2
    except KeyboardInterrupt:                # a Ctrl-C outside the training loop
        console.print("[red]interrupted[/red]")
        return 128 + signal.SIGINT.value


def _platform_failure(e: BaseException) -> str | None:
    """If JAX could not start the platform $JAX_PLATFORMS names (no GPU, no plugin, a typo): the sentence to
    print instead of the traceback; else None. (JAX raises RuntimeError, or for 'cuda' without its plugin an
    AssertionError; asking again raises again, which tells them from other errors.)"""
    import jax
    try:
        jax.devices()
        return None
    except (RuntimeError, AssertionError) as again:
        text = str(again) or str(e)
        first = text.splitlines()[0] if text else "no such backend is installed"
        want = os.environ.get("JAX_PLATFORMS", "")
        return (f"JAX cannot start the platform JAX_PLATFORMS={want!r} asks for on this machine ({first[:300]}); "
                f"unset JAX_PLATFORMS (JAX then picks what is there) or install that platform's jax plugin")


@contextlib.contextmanager
def _log_to_console():
    """While a command runs, jaxformer's log records (e.g. a checkpoint skipped as unreadable) go to stderr
    as 'WARNING: ...' lines, and only there."""
    logger = logging.getLogger("jaxformer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


if __name__ == "__main__":
    hold_from_start()
    sys.exit(main())
