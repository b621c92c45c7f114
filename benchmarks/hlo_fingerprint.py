"""Fingerprints of the compiled programs a refactor must not change: the optimized XLA HLO (after every pass) of
the train step for the tiny, base and gpt configs of benchmarks/train_step.py, and of the whole decoding programs
of `jaxformer.decode` (greedy generate_lm of the base decoder at batch 1 and 8, a small encoder-decoder's
generate_seq2seq and beam search). Metadata (source locations, op names) and instruction numbering are
dropped, so two trees that compile to the same program print the same hash and instruction count.

    PYTHONPATH=TREE .venv/bin/python TREE/benchmarks/hlo_fingerprint.py [--dump DIR]

(run it from each tree to compare: the first jaxformer on PYTHONPATH is the one fingerprinted; --dump writes the
normalised texts, to diff). Compiles only; runs nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import train_step as ts  # noqa: E402
from jaxformer.config import ModelConfig, replaced  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402
from jaxformer.train.step import init_state, make_train_step  # noqa: E402


def normalise(text: str) -> str:
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.-]+", "%x", text)
    text = re.sub(r"\b(\w[\w-]*?)\.\d+\b", r"\1", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("HloModule")
                     and not re.match(r"^\s*\d+ (\{|\")", line))          # the stack-frame tables


def fingerprint(text: str) -> tuple[str, int]:
    t = normalise(text)
    return hashlib.sha256(t.encode()).hexdigest()[:12], len(re.findall(r"= \S+ [a-z][\w-]*\(", t))


def programs():
    for name in ("tiny", "base", "gpt"):
        c = ts.CONFIGS[name]
        cfg = ts.jax_config(c)
        graphs, state = init_state(cfg)
        ones = lambda n: jnp.ones((c["B"], n), jnp.int32)                        # noqa: E731
        batch = ({"inputs": ones(c["T"]), "targets": ones(c["T"])} if c["arch"] == "decoder_only" else
                 {"src": ones(c["S"]), "tgt_in": ones(c["T"]), "tgt_out": ones(c["T"])})
        yield f"train step {name}", make_train_step(graphs, cfg).lower(state, batch, jax.random.key(0))
    yield from decoding_programs()


def decoding_programs():
    """The compiled decoding programs (`jaxformer.decode`'s, whole: decoding state made inside, prefill, the
    while loop), lowered through their jitted entry points, whose signatures the model's API does not touch."""
    from jaxformer import decode
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=1000, max_len=300, positional="rope",
                   norm__position="pre", runtime__dropout=0.0, d_model=512, num_heads=8, d_ff=2048,
                   num_decoder_layers=6)
    graphdef, state = nnx.split(build_model(cfg))
    greedy = dict(eos_id=None, sampling=(0.0, 0, 1.0), kv_cache="auto")
    for b in (1, 8):
        yield f"generate_lm base b{b} p64+32", decode._generate_lm.lower(
            graphdef, state, jnp.ones((b, 64), jnp.int32), None, jax.random.key(0), max_new=32, cache_len=96,
            **greedy)
    ecfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=64, max_len=64, d_model=64, num_heads=4,
                    d_ff=128, num_encoder_layers=2, num_decoder_layers=2, runtime__dropout=0.0)
    graphdef, state = nnx.split(build_model(ecfg))
    src = jnp.ones((4, 12), jnp.int32)
    yield "generate_seq2seq small b4", decode._generate_seq2seq.lower(
        graphdef, state, src, None, jax.random.key(0), max_new=10, bos_id=1, eos_id=2, sampling=(0.0, 0, 1.0),
        kv_cache="auto")
    yield "beam_search small b4 w3", decode._beam_search.lower(
        graphdef, state, src, None, max_new=10, bos_id=1, eos_id=2, beam=3, length_penalty=0.6, kv_cache="auto")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", help="write each normalised HLO text into this folder")
    args = p.parse_args()
    for name, lowered in programs():
        text = lowered.compile().as_text()
        digest, count = fingerprint(text)
        print(f"{name:28} {digest}  {count} instructions", flush=True)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / (name.replace(" ", "_") + ".hlo")).write_text(normalise(text))


if __name__ == "__main__":
    main()
