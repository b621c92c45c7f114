"""A corpus far larger than a memory budget prepares and trains with bounded resident memory: the peak RSS of a
`jaxformer data prepare` process and of a `jaxformer train` process on its shards (sampled from /proc while each
runs), against the same commands on a 100 KiB corpus. The corpus is generated here
(JSONL documents of random words), never committed. Slow lane: ~2 minutes on 2 cores."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import cli_args

MB = 1 << 20
CORPUS_MB = 256


def _peak_memory_of(argv) -> tuple[dict, subprocess.CompletedProcess]:
    """Run argv, sampling its /proc/PID/status every 20 ms: -> ({"anon": peak RssAnon, "rss": peak VmRSS} in
    bytes, the finished process). RssAnon is the memory the process allocates itself; the rest of VmRSS is
    file pages mapped into it (the memory-mapped shards), page cache that the kernel reclaims under pressure."""
    peak = {"anon": 0, "rss": 0}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                break
            for key, name in (("anon", "RssAnon:"), ("rss", "VmRSS:")):
                if name in status:
                    peak[key] = max(peak[key], int(status.split(name)[1].split()[0]) * 1024)
            time.sleep(0.02)
        proc.wait()
        out.seek(0)
        err.seek(0)
        return peak, subprocess.CompletedProcess(argv, proc.returncode, out.read()[-3000:], err.read()[-3000:])


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
    prepare = lambda corpus, out: _peak_memory_of([sys.executable, "-m", "jaxformer.cli", "data", "prepare",   # noqa
                                                str(corpus), "--tokenizer", "byte", "--out", str(out),
                                                "--no-progress", "--shard-tokens", str(64 * MB)])
    base, p = prepare(small, tmp_path / "small-shards")       # the same command on 100 KiB: the reference
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "shards"
    rss, p = prepare(path, out)
    assert p.returncode == 0, p.stdout + p.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] > 200 * MB and len(index["splits"]["train"]["shards"]) >= 4
    print(f"prepare: corpus {size / MB:.0f} MiB, peak RSS {rss['rss'] / MB:.0f} MiB, anonymous "
          f"{rss['anon'] / MB:.0f} MiB (100 KiB corpus: {base['rss'] / MB:.0f} / {base['anon'] / MB:.0f} MiB)")
    assert rss["rss"] - base["rss"] < 64 * MB, (rss, base)       # prepare maps nothing: all of it is bounded
    overrides = ["data.task=tokens", "data.block_size=16", "model.vocab_size=0",
                 "train.steps=5", "train.eval_every=1000", "train.checkpoint_every=5", "train.num_examples=0",
                 "data.batch_size=8", "model.max_len=16", "data.eval_tokens=4096"]
    train = lambda shards, run: _peak_memory_of([sys.executable, "-m", "jaxformer.cli", "train",       # noqa: E731
                                              *cli_args("configs/alice.py", overrides + [f"data.path={shards}"]),
                                              "--workdir", str(run), "--no-progress"])
    base, p = train(tmp_path / "small-shards", tmp_path / "run-small")
    assert p.returncode == 0, p.stdout + p.stderr
    rss, p = train(out, tmp_path / "run")
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"train: peak RSS {rss['rss'] / MB:.0f} MiB, anonymous {rss['anon'] / MB:.0f} MiB on "
          f"{index['splits']['train']['tokens'] / MB:.0f} Mi tokens (small shards: {base['rss'] / MB:.0f} / "
          f"{base['anon'] / MB:.0f} MiB)")
    assert rss["anon"] - base["anon"] < 64 * MB, (rss, base)      # the process's own memory does not grow
    # (the rest of VmRSS grows with the shard pages grain's prefetching threads have touched: page cache)
