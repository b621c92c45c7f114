"""A corpus far larger than a memory budget prepares and trains with bounded resident memory: the peak RSS of a
`jaxformer data prepare` process and of a `jaxformer train` process on its shards, each in its own process
(`resource.getrusage(RUSAGE_CHILDREN)` after it exits), against the corpus size. The corpus is generated here
(JSONL documents of random words), never committed. Slow lane: ~2 minutes on 2 cores."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from helpers import cli_args

MB = 1 << 20
CORPUS_MB = 256


def _peak_rss_of(argv) -> tuple[int, subprocess.CompletedProcess]:
    """(peak resident set of the child in bytes, the finished process). Each call runs in a fresh helper
    process so that RUSAGE_CHILDREN is that one child's."""
    probe = ("import resource, subprocess, sys, json; p = subprocess.run(sys.argv[1:], capture_output=True, "
             "text=True); print(json.dumps({'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
             "'rc': p.returncode, 'out': p.stdout[-3000:], 'err': p.stderr[-3000:]}))")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["rss"], subprocess.CompletedProcess(argv, r["rc"], r["out"], r["err"])


@pytest.mark.slow
def test_a_corpus_larger_than_the_budget_prepares_and_trains_in_bounded_memory(tmp_path):
    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))) for _ in range(5000)]
    path, size = tmp_path / "big.jsonl", 0
    with open(path, "w", encoding="utf-8") as f:
        while size < CORPUS_MB * MB:
            doc = " ".join(rng.choices(words, k=rng.randint(20, 400)))
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            size += len(line)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=50))}) + "\n" for _ in range(50)))
    prepare = lambda corpus, out: _peak_rss_of([sys.executable, "-m", "jaxformer.cli", "data", "prepare",   # noqa
                                                str(corpus), "--tokenizer", "byte", "--out", str(out),
                                                "--no-progress", "--shard-tokens", str(64 * MB)])
    base, p = prepare(small, tmp_path / "small-shards")       # the same command on 100 KiB: the reference
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "shards"
    rss, p = prepare(path, out)
    assert p.returncode == 0, p.stdout + p.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] > 200 * MB and len(index["splits"]["train"]["shards"]) >= 4
    print(f"prepare: corpus {size / MB:.0f} MiB, peak RSS {rss / MB:.0f} MiB (100 KiB corpus: {base / MB:.0f} MiB)")
    assert rss - base < 64 * MB, f"peak RSS {rss / MB:.0f} MiB for {size / MB:.0f} MiB, {base / MB:.0f} MiB for 0.1"
    overrides = ["data.task=tokens", "data.block_size=16", "model.vocab_size=0",
                 "train.steps=5", "train.eval_every=1000", "train.checkpoint_every=5", "train.num_examples=0",
                 "data.batch_size=8", "model.max_len=16", "data.eval_tokens=4096"]
    train = lambda shards, run: _peak_rss_of([sys.executable, "-m", "jaxformer.cli", "train",       # noqa: E731
                                              *cli_args("configs/alice.py", overrides + [f"data.path={shards}"]),
                                              "--workdir", str(run), "--no-progress"])
    base, p = train(tmp_path / "small-shards", tmp_path / "run-small")
    assert p.returncode == 0, p.stdout + p.stderr
    rss, p = train(out, tmp_path / "run")
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"train: peak RSS {rss / MB:.0f} MiB on {index['splits']['train']['tokens'] / MB:.0f} Mi tokens "
          f"({base / MB:.0f} MiB on the small shards)")
    assert rss - base < 64 * MB, f"training peak RSS {rss / MB:.0f} MiB vs {base / MB:.0f} MiB on small shards"
