"""The command line's arguments: `parser()` builds jaxformer's argparse parser, one builder per group of verbs
(what `jaxformer.cli` runs is there; this is only what each verb accepts)."""
from __future__ import annotations

import argparse

QUANT = ("int8", "int4", "w8a8")          # jaxformer.quantize.MODES (not imported here: it loads qwix)
QUANT_HELP = ("quantize the restored weights (post-training): int8 or int4 weight-only, or w8a8 (int8 weights and "
              "per-token int8 activations)")
WEIGHTS = ("trained", "ema")
WEIGHTS_HELP = ("trained: the weights the run's eval/* metrics are of (schedule-free AdamW: its averaged iterate); "
                "ema: the EMA of a run trained with optim.ema set")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxformer")
    sub = p.add_subparsers(dest="cmd", required=True)
    _runs(sub)
    _studies(sub)
    _data(sub)
    _tasks(sub)
    return p


def _tasks(sub) -> None:
    """eval-tasks: downstream evaluation of a language-model run on local task files."""
    t = sub.add_parser("eval-tasks", help="score a language-model run on task files (JSONL): multiple choice by "
                       "log-likelihood (acc, acc_norm, acc_bytes), generation by exact match; results to "
                       "RUN/eval_tasks/")
    t.add_argument("--workdir", required=True)
    t.add_argument("--tasks", nargs="+", required=True, metavar="FILE", help="JSONL task files: {context, choices, "
                   "answer} (multiple choice) or {prompt, answer} (generation) per line")
    t.add_argument("--which", choices=("best", "latest"), default="best")
    t.add_argument("--quantize", choices=QUANT, help=QUANT_HELP)
    t.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    t.add_argument("--max-new", type=int, default=64, help="generation tasks: tokens to generate at most")
    t.add_argument("--until", action="append", help="generation tasks: a stop string (repeatable; default a blank "
                   "line)")
    t.add_argument("--answer-regex", help="generation tasks: compare the first match of this regex (its first "
                   "non-empty group if it has groups) in the output and in the answer, e.g. '#### (-?[0-9.,]+)' "
                   "for GSM8K")
    t.add_argument("--batch-rows", type=int, default=32, help="rows per compiled scoring call")
    t.add_argument("--chat-template", metavar="DIR", help="render each context/prompt as a user turn with this "
                   "pretrained folder's chat template (for a chat-tuned run)")


def _runs(sub) -> None:
    """train, eval, params, plan, generate: a config or a run directory."""
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


def _studies(sub) -> None:
    """sweep, report, viz: sweeps and what is drawn from runs."""
    w = sub.add_parser("sweep", help="run a sweep file's grid of config values x seeds (finished runs are skipped)")
    w.add_argument("sweep")
    w.add_argument("--jobs", type=int, default=1, help="run N at a time as child processes (default: one after "
                   "another in this process)")
    w.add_argument("--run", action="append", metavar="INDEX|ID", help="only this run (repeatable): its index "
                   "(as printed by --list; a job array's task id) or ARM/seed-S")
    show = w.add_mutually_exclusive_group()              # each prints the runs its own way
    show.add_argument("--print-commands", action="store_true", help="print one shell command per run for a "
                      "scheduler, run nothing")
    show.add_argument("--list", action="store_true", help="list the runs, their status and overrides, run nothing")
    w.add_argument("--root", default="runs/sweeps", help="where run directories go (ROOT/NAME/ARM/seed-S)")
    r = sub.add_parser("report", help="aggregate a sweep's runs into Markdown, CSV, plots and TensorBoard HParams")
    r.add_argument("sweep")
    r.add_argument("--root", default="runs/sweeps")
    r.add_argument("--out", default="docs/ablations", help="directory for NAME.md, PNGs and CSVs")
    r.add_argument("--verdict-only", action="store_true", help="recompute only the verdict of OUT/NAME.md from "
                   "OUT/NAME_runs.csv (no run directories needed)")
    c = sub.add_parser("mup-check", help="µP's coordinate check: activation sizes per width at init and after a "
                       "few steps, under SP and µP, plotted, with a verdict each (flat or growing)")
    c.add_argument("config")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512], help="d_model values (d_ff in "
                   "the config's ratio); µP's base width is the smallest")
    c.add_argument("--steps", type=int, default=4, help="training steps after initialisation")
    c.add_argument("--out", default="runs/mup-check", help="folder for mup_check.json and mup_check.png")
    a = sub.add_parser("sae", help="train a sparse autoencoder on a run's activation site over its own training "
                       "data; writes it in SAELens' format with its report, frequency histogram and top contexts")
    a.add_argument("--workdir", required=True)
    a.add_argument("--site", default="resid_post", help="a per-layer activation site (default resid_post)")
    a.add_argument("--layer", type=int, required=True)
    a.add_argument("--steps", type=int, default=1000)
    a.add_argument("--d-sae", type=int, default=0, help="latents (default 8 x the site's width)")
    a.add_argument("--k", type=int, default=32, help="topk: active latents per position")
    a.add_argument("--architecture", choices=("topk", "standard", "jumprelu"), default="topk")
    a.add_argument("--batch-size", type=int, default=0, help="rows per step (default the run's data.batch_size)")
    a.add_argument("--which", choices=("best", "latest"), default="best")
    a.add_argument("--out", help="output folder, new or empty: nothing in it is replaced (default RUN/sae/SITE-LAYER, "
                   "or SITE-LAYER-2, -3, ... when that is taken)")
    v = sub.add_parser("viz", help="write per-layer attention heatmaps, the logit lens or the head-ablation table "
                       "(PNG) of a run's best (or latest) checkpoint")
    v.add_argument("--workdir", required=True)
    v.add_argument("--prompt", action="append", help="an input (repeatable; one set of figures each). Default: the "
                   "run's first held-out inputs. An encoder-decoder run is shown decoding its own greedy answer")
    v.add_argument("--which", choices=("best", "latest"), default="best")
    v.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    v.add_argument("--out", help="output folder (default: RUN/viz/); files of the same names that jaxformer did not "
                   "write there are refused, never replaced")
    v.add_argument("--corrupt", help="--plot patching: the corrupted input (as many tokens as the one --prompt)")
    v.add_argument("--site", help="--plot patching: the site patched (default resid_pre; encoder-decoder: "
                   "encoder.resid_pre)")
    v.add_argument("--over", choices=("position", "head", "both"), default="position",
                   help="--plot patching: the cells, per (layer, position), (layer, head) or both")
    v.add_argument("--plot", action="append", choices=("attention", "lens", "heads", "patching"),
                   help="what to draw (repeatable; default attention): attention heatmaps per layer; lens: the "
                   "logit lens of each prompt (each layer's probability of the next token); heads: the loss "
                   "increase when each head is zeroed, over the prompts (an encoder-decoder: a table each for the "
                   "self-attention, cross-attention and encoder heads); patching: the patching grid and its attribution "
                   "estimate for --prompt against --corrupt")


def _data(sub) -> None:
    """data prepare, import-hf, export-hf: corpora and checkpoints in and out."""
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
                    "train; model.runtime.*, e.g. model.runtime.dropout)")
    eh = sub.add_parser("export-hf", help="a run's best (or latest) checkpoint -> a Hugging Face checkpoint folder")
    eh.add_argument("--workdir", required=True)
    eh.add_argument("--out", required=True, help="output folder (must not exist or be empty; written as "
                    "OUT.partial first, renamed when complete)")
    eh.add_argument("--which", choices=("best", "latest"), default="best")
    eh.add_argument("--weights", choices=WEIGHTS, default="trained", help=WEIGHTS_HELP)
    eh.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the tensors' dtype (with --adapter: the adapters')")
    eh.add_argument("--adapter", action="store_true", help="only the run's low-rank adapters (model.lora), as a "
                    "PEFT adapter folder over the model it started from; default: the model, adapters merged")
    eh.add_argument("--family", choices=("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma"),
                    help="default: the one family whose config expresses the model (with --adapter: the base "
                    "model's; a family that cannot express the model is refused)")
