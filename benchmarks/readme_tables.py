"""Render the README's tables from the committed results files, so that no figure in them can go stale: the
performance table and `make run`'s phases (here), and the claims table (benchmarks/claims_table.py).

  python benchmarks/readme_tables.py          # rewrite README.md between the table markers
  python benchmarks/readme_tables.py --check  # exit 1 if README.md differs from what the results give

A block is `<!-- table:NAME (rendered by benchmarks/readme_tables.py from ...) -->` ... `<!-- /table:NAME -->`;
tests/test_reports.py fails when a block and its results files disagree. `make bench` runs this last.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from claims_table import claims  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"
_BLOCK = re.compile(r"(?s)(<!-- table:(?P<name>[a-z_]+) [^\n]*-->\n).*?(\n<!-- /table:(?P=name) -->)")


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def performance() -> str:
    """Train-step throughput (train_step.json) and cached decoding (decode.json), ours against PyTorch."""
    ts, dec = _load("train_step"), _load("decode")
    label = {"tiny": "train step, seed 004's tiny encoder-decoder, target tokens/s (`train_step.py`)",
             "base": "train step, base encoder-decoder D512 6+6 layers, B16, T64",
             "gpt": "train step, GPT-style char model D128 4 layers, B12, T64"}
    rows = ["| measurement (script) | ours | PyTorch | ours / PyTorch |", "|---|---:|---:|---:|"]
    for name, text in label.items():
        j, t = ts["configs"][name]["jax"], ts["configs"][name]["torch"]
        rows.append(f"| {text} | {j['median_tokens_per_s']:,.0f} | {t['median_tokens_per_s']:,.0f} | "
                    f"{j['median_tokens_per_s'] / t['median_tokens_per_s']:.2f}× |")
    for size, text in (("base", "KV-cached decoding, base decoder, batch 1, context 64, ms/token (`decode.py`)"),
                       ("tiny", "KV-cached decoding, tiny decoder, batch 1, context 64, ms/token")):
        r = next(r for r in dec["rows"] if r["size"] == size and r["batch"] == 1 and r["context"] == 64)
        rows.append(f"| {text} | {r['cached_ms']:.2g} | {r['torch_cached_ms']:.2g} (with its own KV cache) | "
                    f"{r['torch_cached_ms'] / r['cached_ms']:.2f}× |")
    base = ts["configs"]["base"]
    rows += ["", f"The base model's train step reaches {base['jax']['model_flops_per_s'] / 1e9:.0f} GFLOP/s by "
             f"6·params·tokens, {100 * base['jax']['model_fraction_of_peak']:.0f}% of the float32 matmul rate "
             f"measured in the same run (`jnp.dot` 2048²); PyTorch reaches "
             f"{100 * base['torch']['model_fraction_of_peak']:.0f}%. Machine: {ts['machine']}; PyTorch "
             f"{ts['torch']}."]
    return "\n".join(rows)


def make_run() -> str:
    """`make run`'s phases (make_run.json: medians over its runs)."""
    run = _load("make_run")
    m = {k: v["median"] for k, v in run["stats"].items()}
    steps = run["runs"][0]["to_step"]
    return (f"`make run` takes {m['wall']:.0f} s end to end: {m['steps']:.0f} s of train steps "
            f"({1e3 * m['steps'] / steps:.0f} ms each), {m['first_step']:.1f} s tracing and compiling the step, "
            f"{m['setup']:.1f} s setup, {m['eval']:.1f} s evaluation, {m['checkpoint']:.1f} s checkpoints, "
            f"{m['examples']:.1f} s final examples, {m['start + exit']:.1f} s interpreter start and exit "
            f"(`make_run.py`, medians; the loop writes these phases to `RUN/timings.jsonl` and `jaxformer train` "
            f"prints them).")


TABLES = {"performance": performance, "make_run": make_run, "claims": claims}


def render(text: str) -> str:
    """`text` with every table block replaced by its rendering; ValueError names a block with no renderer."""
    def one(m):
        if m["name"] not in TABLES:
            raise ValueError(f"README table block {m['name']!r} has no renderer in benchmarks/readme_tables.py")
        return m.group(1) + TABLES[m["name"]]() + m.group(3)
    return _BLOCK.sub(one, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    path = ROOT / "README.md"
    old = path.read_text(encoding="utf-8")
    new = render(old)
    if args.check:
        if new != old:
            print("README.md's tables differ from benchmarks/results/: run python benchmarks/readme_tables.py")
            return 1
        return 0
    path.write_text(new, encoding="utf-8")
    print(f"rendered {len(_BLOCK.findall(old))} table(s) into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
