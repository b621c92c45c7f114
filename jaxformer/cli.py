"""Command line: `jaxformer train CONFIG [--set k=v ...] [--workdir DIR]`, `jaxformer eval --workdir RUN`,
`jaxformer generate --workdir RUN [--prompt TEXT ...]`, `jaxformer params CONFIG`, `jaxformer plan CONFIG`,
`jaxformer sweep SWEEP.py`, `jaxformer report SWEEP.py`,
`jaxformer viz --workdir RUN [--prompt TEXT ...] [--out DIR]` (attention heatmaps)."""
from __future__ import annotations

import argparse
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

from jaxformer.configio import apply_overrides, load_config_file
from jaxformer.errors import Interrupted, JaxformerError
from jaxformer.signals import hold_from_start, pending

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
    from jaxformer.arch import adapter
    from jaxformer.inference import default_prompts, generate_text, load_model
    run = load_model(args.workdir, args.which, quantize=args.quantize, weights=args.weights)
    prompts = args.prompt or default_prompts(run)
    outs = generate_text(run, prompts, max_new=args.max_new, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, beam=args.beam, seed=args.seed, kv_cache=args.kv_cache)
    how = f"beam {args.beam}" if args.beam > 1 else ("greedy" if args.temperature == 0 else
                                                      f"temperature {args.temperature}, top-k {args.top_k}, "
                                                      f"top-p {args.top_p}, seed {args.seed}")
    quant = (f", weights {args.quantize}" if args.quantize else "") + (
        f", KV cache {args.kv_cache}" if args.kv_cache != "auto" else "")
    console.print(f"{args.workdir}: {run.which} checkpoint (step {run.step}){quant}, {how}")
    sep = adapter(run.cfg.model.arch).separator
    for p, o in zip(prompts, outs):
        console.print(Text.assemble((p, "bold"), (sep, "dim"), (o, "green")))
    return 0


def cmd_viz(args) -> int:
    from jaxformer.viz import write_heatmaps
    paths = write_heatmaps(args.workdir, args.prompt, args.which, args.out, weights=args.weights)
    console.print(f"{len(paths)} attention heatmap(s) written:")
    for p in paths:
        console.print(str(p), markup=False, highlight=False)
    return 0


def cmd_params(args) -> int:
    import jax
    from jaxformer.arch import adapter
    from jaxformer.nn import build_model
    cfg = _config(args, resolved=True)
    model = build_model(cfg.model)
    console.print(params_table(model))
    arch = adapter(cfg.model.arch)
    batch = arch.example_batch(2, 8)
    y = arch.forward(model, batch)[0]
    console.print(f"forward pass: tokens {arch.inputs(batch).shape} -> logits {y.shape}, "
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


QUANT = ("int8", "int4", "w8a8")          # jaxformer.quantize.MODES (not imported here: it loads qwix)
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
                         weights=args.weights)
    what = "" if args.weights == "trained" else f", its {args.weights} weights"
    console.print(f"exported {args.workdir} ({args.which} checkpoint{what}) to {args.out}: {written['model_type']}, "
                  f"{args.dtype}", markup=False)
    return 0


QUANT_HELP = ("quantize the restored weights (post-training): int8 or int4 weight-only, or w8a8 (int8 weights and "
              "per-token int8 activations)")
WEIGHTS = ("trained", "ema")
WEIGHTS_HELP = ("trained: the weights the run's eval/* metrics are of (schedule-free AdamW: its averaged iterate); "
                "ema: the EMA of a run trained with optim.ema set")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxformer")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a config (resumes if --workdir has checkpoints)")
    t.add_argument("config")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. optim.lr=3e-4")
    t.add_argument("--workdir")
    t.add_argument("--no-progress", action="store_true", help="print one line per log interval instead of a "
                   "progress bar (the default when stdout is not a terminal)")
    e = sub.add_parser("eval", help="evaluate a run directory's best (or latest) checkpoint")
    e.add_argument("--workdir", required=True)
    e.add_argument("--which", choices=("best", "latest"), default="best")
    e.add_argument("--quantize", choices=QUANT, help=QUANT_HELP)
    e.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    e.add_argument("--data", help="score this UTF-8 text file instead of the held-out set: strided (sliding-window) "
                   "perplexity and bits per byte with the run's tokenizer (language models)")
    e.add_argument("--stride", type=int, help="with --data: tokens between windows (default: half the window)")
    q = sub.add_parser("params", help="build a config's model, print its parameter table, run a forward pass")
    q.add_argument("config")
    q.add_argument("--set", action="append", metavar="KEY=VALUE")
    m = sub.add_parser("plan", help="show how a config's mesh and rules shard its parameters on this machine's "
                       "devices (XLA_FLAGS=--xla_force_host_platform_device_count=N previews N devices on a CPU)")
    m.add_argument("config")
    m.add_argument("--set", action="append", metavar="KEY=VALUE")
    g = sub.add_parser("generate", help="decode prompts with a run's best (or latest) checkpoint (KV-cached)")
    g.add_argument("--workdir", required=True)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable; batched in one call). Default: three "
                   "held-out inputs of the run's task")
    g.add_argument("--which", choices=("best", "latest"), default="best")
    g.add_argument("--quantize", choices=QUANT, help=QUANT_HELP)
    g.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    g.add_argument("--kv-cache", choices=("auto", "int8"), default="auto", help="the decoding cache's storage: "
                   "auto (the model's dtype) or int8 (a float32 scale per slot and kv head)")
    g.add_argument("--max-new", type=int, default=None, help="tokens to generate (default: enough for a seq2seq "
                   "answer; up to 200 characters for an LM)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--beam", type=int, default=1, help="beam width (encoder-decoder runs)")
    g.add_argument("--seed", type=int, default=0, help="sampling PRNG seed")
    w = sub.add_parser("sweep", help="run a sweep file's grid of config values x seeds (finished runs are skipped)")
    w.add_argument("sweep")
    w.add_argument("--jobs", type=int, default=1, help="run N at a time as child processes (default: one after "
                   "another in this process)")
    w.add_argument("--run", action="append", metavar="INDEX|ID", help="only this run (repeatable): its index "
                   "(as printed by --list; a job array's task id) or ARM/seed-S")
    w.add_argument("--print-commands", action="store_true", help="print one shell command per run for a "
                   "scheduler, run nothing")
    w.add_argument("--list", action="store_true", help="list the runs, their status and overrides, run nothing")
    w.add_argument("--root", default="runs/sweeps", help="where run directories go (ROOT/NAME/ARM/seed-S)")
    r = sub.add_parser("report", help="aggregate a sweep's runs into Markdown, CSV, plots and TensorBoard HParams")
    r.add_argument("sweep")
    r.add_argument("--root", default="runs/sweeps")
    r.add_argument("--out", default="docs/ablations", help="directory for NAME.md, PNGs and CSVs")
    r.add_argument("--verdict-only", action="store_true", help="recompute only the verdict of OUT/NAME.md from "
                   "OUT/NAME_runs.csv (no run directories needed)")
    v = sub.add_parser("viz", help="write per-layer attention heatmaps (PNG) of a run's best (or latest) checkpoint")
    v.add_argument("--workdir", required=True)
    v.add_argument("--prompt", action="append", help="an input (repeatable; one set of figures each). Default: the "
                   "run's first held-out inputs. An encoder-decoder run is shown decoding its own greedy answer")
    v.add_argument("--which", choices=("best", "latest"), default="best")
    v.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    v.add_argument("--out", help="output folder (default: RUN/viz/)")
    d = sub.add_parser("data", help="prepare corpora: a tokenizer and token shards (see `jaxformer data prepare -h`)")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dp = dsub.add_parser("prepare", help="text files -> a tokenizer and token shards with a JSON index, streamed")
    dp.add_argument("inputs", nargs="+", metavar="INPUT")
    dp.add_argument("--tokenizer", default="bpe", help="char, byte, bpe (byte-level BPE), unigram (byte-level "
                    "unigram), both trained here on the training split, or PATH to a tokenizer.json, a "
                    "SentencePiece .model (pip install sentencepiece) or a Hugging Face checkpoint folder")
    dp.add_argument("--vocab-size", type=int, default=2048, help="for bpe and unigram")
    dp.add_argument("--out", required=True, help="output folder (must not exist; written as OUT.partial first)")
    dp.add_argument("--docs", default="auto", help="documents: file (one per input), jsonl (a \"text\" field "
                    "per line; the default for *.jsonl), blank-lines, or separator=STR")
    dp.add_argument("--eval-fraction", type=float, default=0.1, help="the held-out split's share of the text")
    dp.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file at most")
    dp.add_argument("--dtype", default="auto", help="auto (uint16 when the vocabulary fits), uint16 or uint32")
    dp.add_argument("--no-progress", action="store_true")
    ih = sub.add_parser("import-hf", help="a Hugging Face checkpoint folder (config.json, *.safetensors, "
                        "tokenizer.json) -> a run directory at step 0 that eval, generate, viz and train accept")
    ih.add_argument("source", metavar="DIR")
    ih.add_argument("--workdir", required=True)
    ih.add_argument("--data", help="prepared shards to fine-tune and evaluate on (made with `jaxformer data "
                    "prepare INPUT --tokenizer DIR`); default: the built-in corpus, prepared into RUN/data")
    ih.add_argument("--set", action="append", metavar="KEY=VALUE", help="override the run's config (data, optim, "
                    "train; model fields that change no weight, e.g. model.dropout)")
    eh = sub.add_parser("export-hf", help="a run's best (or latest) checkpoint -> a Hugging Face checkpoint folder")
    eh.add_argument("--workdir", required=True)
    eh.add_argument("--out", required=True)
    eh.add_argument("--which", choices=("best", "latest"), default="best")
    eh.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    eh.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    eh.add_argument("--family", choices=("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma"),
                    help="default: the one family whose config expresses the model")
    args = p.parse_args(argv)
    cmds = {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "params": cmd_params, "generate": cmd_generate,
            "plan": cmd_plan, "sweep": cmd_sweep, "report": cmd_report, "viz": cmd_viz, "import-hf": cmd_import_hf,
            "export-hf": cmd_export_hf}
    try:
        if getattr(args, "workdir", None) == "":
            from jaxformer.errors import ConfigError
            raise ConfigError("--workdir '' names no directory")
        with _log_to_console():
            if pending():                    # Ctrl-C while Python started: nothing done yet
                raise Interrupted(f"jaxformer {args.cmd} stopped on {pending()} before it started; nothing was done")
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
        from jaxformer.train.loop import detach_stdout
        detach_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)
    except OSError as e:                     # the machine's doing, not ours: a full disk, a vanished mount
        console.print(Text.assemble(("I/O error:", "red"), " ", str(e)), soft_wrap=True)
        return 2
    except (RuntimeError, AssertionError) as e:
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
