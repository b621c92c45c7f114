"""The input pipeline against the train step: is reading and packing token shards ever the bottleneck?

  .venv/bin/python benchmarks/pipeline.py [--corpus-mb 64] [--reps 5] [--batches 200]

Generates a JSONL corpus of random-word documents (--corpus-mb), then measures, on this machine:
  prepare     `jaxformer data prepare` (prepare()) with the byte tokenizer and with byte-level BPE (2,048 ids,
              trained on the training split): MB of text per second, end to end (three passes);
  pipeline    the tokens task's training batches (grain, memory-mapped shards), windows and packed documents,
              at the base training shape (batch 16, 64 tokens) and the GPT-style char model's (batch 12, 64):
              tokens per second delivered, median of --reps passes of --batches batches each;
and sets the pipeline beside the train step's own consumption at those shapes (tokens/s, from
benchmarks/results/train_step.json, written by benchmarks/train_step.py on this machine). Writes
benchmarks/results/pipeline.json and .md.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxformer.config import DataConfig  # noqa: E402
from jaxformer.data.prepare import prepare  # noqa: E402
from jaxformer.data.tokens import TokensTask  # noqa: E402
from jaxformer.stats import machine  # noqa: E402

SHAPES = {"base": (16, 64), "gpt": (12, 64)}      # (batch, tokens) of benchmarks/train_step.py's configs


def corpus(path: Path, mb: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(5000)]
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb << 20:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 400)))}) + "\n"
            f.write(line)
            size += len(line)
    return size


def pipeline_rate(shards: Path, packing: str, batch: int, block: int, batches: int, reps: int) -> float:
    task = TokensTask(DataConfig(task="tokens", path=str(shards), block_size=block, packing=packing,
                                 batch_size=batch))
    rates = []
    for r in range(reps):
        it = iter(task.train_dataset(batch, seed=r))
        next(it)                                       # the first batch builds the pipeline
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        rates.append(batches * batch * block / (time.perf_counter() - t))
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    steps = json.loads((ROOT / "benchmarks" / "results" / "train_step.json").read_text())["configs"]
    res = {"machine": machine(), "command": "python benchmarks/pipeline.py " + " ".join(sys.argv[1:]),
           "corpus_mb": args.corpus_mb, "prepare": {}, "pipeline": []}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.jsonl"
        size = corpus(text, args.corpus_mb)
        for tok in ("byte", "bpe"):
            t = time.perf_counter()
            index = prepare([text], Path(tmp) / tok, tokenizer=tok, vocab_size=2048, progress=False)
            s = time.perf_counter() - t
            res["prepare"][tok] = {"seconds": s, "mb_per_s": size / 2 ** 20 / s,
                                   "tokens": index["splits"]["train"]["tokens"] + index["splits"]["eval"]["tokens"]}
            print(f"prepare {tok}: {size / 2 ** 20:.0f} MiB in {s:.1f} s", flush=True)
        for name, (batch, block) in SHAPES.items():
            consume = steps[name]["jax"]["median_tokens_per_s"]
            for packing in ("windows", "documents"):
                rate = pipeline_rate(Path(tmp) / "bpe", packing, batch, block, args.batches, args.reps)
                res["pipeline"].append({"shape": name, "batch": batch, "block": block, "packing": packing,
                                        "tokens_per_s": rate, "train_step_tokens_per_s": consume,
                                        "headroom": rate / consume})
                print(f"{name} {packing}: {rate:,.0f} tokens/s, train step {consume:,.0f} ({rate / consume:.0f}×)",
                      flush=True)
    out = Path(args.out)
    (out / "pipeline.json").write_text(json.dumps(res, indent=1))
    md = [f"# Input pipeline vs train step ({res['machine']})", "", f"`{res['command']}`", "",
          f"A generated JSONL corpus of {args.corpus_mb} MiB (random-word documents).", "",
          "| prepare | seconds | MiB/s |", "|---|---:|---:|"]
    md += [f"| {k} | {v['seconds']:.1f} | {v['mb_per_s']:.1f} |" for k, v in res["prepare"].items()]
    md += ["", "| train shape | packing | pipeline tokens/s | train step tokens/s | pipeline / step |",
           "|---|---|---:|---:|---:|"]
    md += [f"| {r['shape']} (B{r['batch']}, T{r['block']}) | {r['packing']} | {r['tokens_per_s']:,.0f} | "
           f"{r['train_step_tokens_per_s']:,.0f} | {r['headroom']:.0f}× |" for r in res["pipeline"]]
    (out / "pipeline.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
