"""Each speed lever jaxformer keeps, measured against the program without it, in one process (paired blocks).

  .venv/bin/python benchmarks/levers.py [--levers NAME ...] [--configs C ...] [--blocks N] [--out STEM] [--merge]

A lever is a choice that changes how the train step is compiled, not what it computes (or, for `gelu_erf` and
`weight_grad`, computes the same function to float32 rounding: over a base row's 65 Adam steps on one batch such a
difference grows to a few percent of the loss). For each lever and each config of benchmarks/train_step.py it
applies to, both programs are built and compiled in the same process, "before" with the lever switched off (the code it
replaced, restored by a patch or a config value while that program is traced) and "after" as jaxformer builds it
("after" is built and compiled first: in A/A runs the program built second was up to 2% faster, so that bias, if
any, works against the lever); then, after one untimed block each, blocks of steps alternate between them
(before/after, then after/before, ...; `benchmarks/timing.paired_times_ms`), each program threading its own
training state. Every pair of blocks gives one ratio after/before of ms per step; the
verdict follows from the 95% Student-t interval of the mean log ratio (`jaxformer.stats`): "faster" or "slower"
when the interval excludes 1, "no difference beyond ±2%" when it lies within 0.98–1.02, else "not resolved". Pairing
within one process is what makes a few-percent effect measurable on a VM whose step time drifts by more than that
between processes (benchmarks/train_step.py's min–max). Also recorded: each program's first call (trace + compile +
one step) and its loss after the same steps (a lever that changed the model would show there). A lever with an op of
its own (`Lever.op`) is also timed on that op alone, the same way (paired blocks of calls). A decoding lever
(`Lever.decode`, config "SIZE bB cC") is timed the same way on benchmarks/decode.py's cached token loop (blocks of
16 greedy tokens from context C at batch B, the model laid out for decoding, "before" laid out with the lever off),
per token, and records whether both programs chose the same tokens instead of a loss.

Writes benchmarks/results/levers.md and .json (or --out STEM.md / STEM.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MARGIN = 0.02                  # a step-time change smaller than 2% is one we call negligible
STEPS = {"tiny": 10, "base": 1, "gpt": 5, "gpt-noremat": 5}       # steps per block
BLOCKS = {"tiny": 48, "base": 20, "gpt": 48, "gpt-noremat": 48}    # blocks per program (even: both orders)
DECODE_BLOCKS = 60                                                 # the same for a decoding lever


@contextlib.contextmanager
def _patched(obj, name: str, value):
    """obj.name = value (or obj[name] for a dict) inside the block."""
    get, put = ((obj.__getitem__, obj.__setitem__) if isinstance(obj, dict) else
                (lambda n: getattr(obj, n), lambda n, v: setattr(obj, n, v)))
    old = get(name)
    put(name, value)
    try:
        yield
    finally:
        put(name, old)


def _lever_off(name: str):
    """A lever of `jaxformer.platforms` switched off by name while the program is built and traced."""
    from jaxformer import platforms
    return platforms.override(**{name: False})


def _default_copy_insertion():
    """The train step compiled with XLA's default options (no region analysis in copy insertion)."""
    return _lever_off("copy_insertion")


def _erfc_gelu():
    import jax
    from jaxformer.ops import activations
    return _patched(activations.UNGATED, "gelu", lambda x: jax.nn.gelu(x, approximate=False))


def _jax_weight_grad():
    """nn.params._dot as it was before `_weight_grad`: jax's transpose of the dot for both gradients, the output
    gradient materialized first (so that XLA:CPU's transposing copy of it carries none of its producers' work)."""
    import functools
    import jax
    from jaxformer.nn import params
    from jaxformer.platforms import cpu as layout

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def dot(x, w, dims):
        return jax.lax.dot_general(x, w, dims)

    def bwd(dims, res, g):
        return jax.vjp(lambda x, w: jax.lax.dot_general(x, w, dims), *res)[1](layout.materialize(g))
    dot.defvjp(lambda x, w, dims: (jax.lax.dot_general(x, w, dims), (x, w)), bwd)
    return _patched(params, "_dot", dot)


def _w2_as_stored():
    """The one-row decoding layout without the FFN output weight in [out,in] order (w2 read as stored)."""
    return _lever_off("decode_w2_out_in")


def _plain_transpose():
    """Each weight gradient's transposed operand as XLA:CPU's own 2-D transpose (x.T)."""
    return _lever_off("tiled_transpose")


def _plain_softmax():
    return _lever_off("softmax_gemv")


def _rolled_threefry():
    return _lever_off("threefry_unrolled")


@dataclass(frozen=True)
class Lever:
    what: str                                       # what jaxformer does, and where
    before: str                                     # what the program did without it
    configs: tuple[str, ...]                        # train_step.CONFIGS it applies to
    switch_off: Callable = contextlib.nullcontext   # -> context manager in force while "before" is traced
    model_before: dict = field(default_factory=dict)  # replaced() keywords of "before", when a config value
    op: Callable | None = None                      # -> (label, before fn, after fn, args): the op alone
    decode: bool = False                            # configs are "SIZE bB cC" of the cached decoding loop


def _gelu_op():
    """The char model's FFN activation alone, [B·T, F] = [768, 512], value and input gradient (what its
    rematerialized backward computes), the erfc form against ours."""
    import jax
    from jaxformer.ops import activations
    x = 2.0 * jax.random.normal(jax.random.key(0), (768, 512))
    g = jax.random.normal(jax.random.key(1), (768, 512))
    prog = lambda f: jax.jit(lambda x, g: (f(x), jax.vjp(f, x)[1](g)[0]))           # noqa: E731
    return ("op alone: [768,512] value + gradient", prog(lambda x: jax.nn.gelu(x, approximate=False)),
            prog(activations.gelu), (x, g))


LEVERS = {
    "control": Lever("nothing: both programs are the same (an A/A run: the harness's own bias and noise)",
                     "the same program", ("tiny", "gpt", "base")),
    "gelu_erf": Lever("exact GELU as 0.5·x·(1+erf(x/√2)) (`ops.activations.gelu`)",
                      "jax.nn.gelu(approximate=False), the erfc form", ("gpt",), _erfc_gelu, op=_gelu_op),
    "weight_grad": Lever("each projection's weight gradient as a standard-form matmul that transposes the smaller "
                         "operand, x or the output gradient (`nn.params._weight_grad`)",
                         "jax's transpose of the dot, the output gradient materialized first (XLA:CPU transposes "
                         "it)", ("tiny", "gpt", "base"), _jax_weight_grad),
    "softmax_gemv": Lever("attention softmax backward's row sums as a GEMV (`ops.attention._softmax`)",
                          "jax.nn.softmax's own backward (a reduce)", ("tiny", "gpt", "base"), _plain_softmax),
    "threefry_unrolled": Lever("dropout's threefry hash lowered unrolled on CPU (`jaxformer/platforms/lowering.py`)",
                               "jax's CPU lowering, a 5-trip loop per draw", ("tiny", "base"), _rolled_threefry),
    "copy_insertion": Lever("the train step compiled with xla_cpu_copy_insertion_use_region_analysis "
                            "(`lowering.train_compiler_options`: fewer copies of loop-carried values)",
                            "XLA:CPU's default copy insertion", ("tiny", "gpt", "base"), _default_copy_insertion),
    "decode_w2_out_in": Lever("decoding at batch 1: the FFN's output weight laid out [out,in] for the token loop "
                              "(`nn.layout`, an `nn.weights.OutIn` weight), read row by row",
                              "the weight as stored, [in,out]", ("base b1 c64", "base b1 c256", "tiny b1 c64"),
                              _w2_as_stored, decode=True),
    "tiled_transpose": Lever("each weight gradient's transposed operand moved in 32×32 tiles (`platforms.cpu.transpose`)",
                             "XLA:CPU's own 2-D transpose", ("tiny", "gpt", "base"), _plain_transpose),
    "remat_dots": Lever("model.runtime.remat='dots' for the char model (configs/shakespeare_char.py)",
                        "model.runtime.remat='none' (every activation stored)", ("gpt",),
                        model_before={"runtime__remat": "none"}),
}


def build(c: dict, lever: Lever, which: str):
    """(jitted train step, state, batch, key) of config dict `c` (benchmarks/train_step.py's), with the lever
    switched off for which="before". Nothing is compiled here: the first call compiles, and must happen inside
    `lever.switch_off()` for "before" (`first_call`); the jitted function is also made inside it (its compiler
    options are fixed there)."""
    import dataclasses
    import jax
    import train_step as ts
    from step_profile import _jax_batch
    from jaxformer.config import replaced
    from jaxformer.train.step import init_state, make_train_step
    cfg = ts.jax_config(c)
    if which == "before" and lever.model_before:
        cfg = dataclasses.replace(cfg, model=replaced(cfg.model, **lever.model_before))
    graphs, state = init_state(cfg)
    with lever.switch_off() if which == "before" else contextlib.nullcontext():   # jit options are set here
        step = make_train_step(graphs, cfg)
    return step, state, _jax_batch(c), jax.random.key(0)


def first_call(lever: Lever, which: str, step, state, batch, key):
    """Trace, compile and run one step under the lever's setting -> (state, seconds)."""
    import jax
    with lever.switch_off() if which == "before" else contextlib.nullcontext():
        t = time.perf_counter()
        state, m = step(state, batch, key)
        jax.block_until_ready(m)
    return state, time.perf_counter() - t


def paired(before: list[float], after: list[float]) -> dict:
    """Per-pair log(after/before) -> ratio after/before with its 95% Student-t interval and the verdict."""
    from jaxformer.stats import equivalence, paired_difference
    d = paired_difference([math.log(a) for a in after], [math.log(b) for b in before])
    word = equivalence(d, math.log(1 + MARGIN)).split(" (")[0]
    verdict = {"equivalent": f"no difference beyond ±{MARGIN:.0%}", "lower": "faster",
               "lower by more than the margin": f"faster by more than {MARGIN:.0%}", "higher": "slower",
               "higher by more than the margin": f"slower by more than {MARGIN:.0%}"}.get(word, "not resolved")
    return {"ratio": math.exp(d.mean), "lo": math.exp(d.lo), "hi": math.exp(d.hi), "pairs": d.n, "verdict": verdict}


def measure(name: str, lever: Lever, config: str, blocks: int, steps: int) -> dict:
    """One lever on one config: paired blocks of steps in this process -> row of the results file."""
    from timing import paired_times_ms
    import train_step as ts
    progs = {}
    for which in ("after", "before"):      # built second, "before" gets whatever a later build gains (A/A rows)
        step, state, batch, key = build(ts.CONFIGS[config], lever, which)
        state, compile_s = first_call(lever, which, step, state, batch, key)
        progs[which] = {"step": step, "state": state, "batch": batch, "key": key, "compile_s": compile_s}

    def block(p):
        def run():
            for _ in range(steps):
                p["state"], p["metrics"] = p["step"](p["state"], p["batch"], p["key"])
            return p["metrics"]
        return run
    ms = paired_times_ms({w: block(progs[w]) for w in ("before", "after")}, blocks)
    ms = {w: [t / steps for t in v] for w, v in ms.items()}
    return {"lever": name, "config": config, "blocks": blocks, "steps_per_block": steps,
            **paired(ms["before"], ms["after"]),
            **{w: {"median_ms": statistics.median(ms[w]), "ms": ms[w], "compile_s": p["compile_s"],
                   "loss": float(p["metrics"]["loss"])} for w, p in progs.items()}}


DECODE_TOKENS = 16             # greedy tokens per block of the cached decoding loop


def measure_decode(name: str, lever: Lever, config: str, blocks: int) -> dict:
    """A decoding lever on config "SIZE bB cC": benchmarks/decode.py's cached loop (DECODE_TOKENS greedy steps
    per block, from context C, batch B, its decoder at size SIZE) over the model laid out for decoding, the lever
    switched off while "before" is laid out; both programs in this process, paired blocks."""
    from timing import paired_times_ms
    import jax
    import jax.numpy as jnp
    from flax import nnx
    import decode as dec
    from jaxformer.config import ModelConfig, replaced
    from jaxformer.nn import build_model
    size, b, c = config.split()
    batch, context, steps = int(b[1:]), int(c[1:]), DECODE_TOKENS
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=dec.VOCAB, max_len=context + steps + 1,
                   positional="rope",
                      norm__position="pre", runtime__dropout=0.0, **dec.SIZES[size])
    graphdef, state = nnx.split(build_model(cfg))
    tokens = jax.random.randint(jax.random.key(context), (batch, context), 1, dec.VOCAB)
    pos = jnp.broadcast_to(jnp.arange(context), (batch, context))
    start = (tokens[:, -1:], jnp.full((batch, 1), context, jnp.int32))
    progs = {}
    for which in ("after", "before"):
        with lever.switch_off() if which == "before" else contextlib.nullcontext():   # the layout's levers
            empty = dec.decoding_cache(graphdef, batch, context + steps)(state)
        _, cache = dec.prefill_fn(graphdef)(state, empty, tokens, pos)
        loop = dec.cached_loop(graphdef, steps)
        t = time.perf_counter()
        out = jax.block_until_ready(loop(state, cache, *start))
        progs[which] = {"loop": loop, "state": state, "out": out, "compile_s": time.perf_counter() - t,
                        "tokens": out[1]}

    def block(p):
        def run():
            p["out"] = p["loop"](p["state"], p["out"][0], *start)     # the same slots again (the cache donated)
            return p["out"]
        return run
    ms = paired_times_ms({w: block(progs[w]) for w in ("before", "after")}, blocks)
    ms = {w: [t / steps for t in v] for w, v in ms.items()}
    same = bool(jnp.all(progs["before"]["tokens"] == progs["after"]["tokens"]))
    return {"lever": name, "config": config, "blocks": blocks, "steps_per_block": steps, "unit": "token",
            **paired(ms["before"], ms["after"]), "same_tokens": same,
            **{w: {"median_ms": statistics.median(ms[w]), "ms": ms[w], "compile_s": p["compile_s"], "loss": None}
               for w, p in progs.items()}}


def measure_op(name: str, lever: Lever, blocks: int = 32, calls: int = 50) -> dict:
    """The lever's op alone (`Lever.op`), both forms jitted in this process, paired blocks of calls."""
    from timing import paired_times_ms
    import jax
    label, before, after, args = lever.op()
    fns = {"before": before, "after": after}
    for f in fns.values():
        jax.block_until_ready(f(*args))

    def block(f):
        def run():
            for _ in range(calls):
                out = f(*args)
            return out
        return run
    ms = paired_times_ms({w: block(fns[w]) for w in ("before", "after")}, blocks)
    ms = {w: [t / calls for t in v] for w, v in ms.items()}
    return {"lever": name, "config": label, "blocks": blocks, "steps_per_block": calls,
            **paired(ms["before"], ms["after"]),
            **{w: {"median_ms": statistics.median(v), "ms": v, "compile_s": None, "loss": None} for w, v in ms.items()}}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    p.add_argument("--configs", nargs="+", default=None, help="only these configs (default: each lever's own)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per program (default per config: "
                   + ", ".join(f"{k} {v}" for k, v in BLOCKS.items()) + ")")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/levers"), help="path stem of .md and .json")
    p.add_argument("--merge", action="store_true", help="keep the results file's other rows: this run's rows "
                   "replace those of the same lever and config (the file must name this machine)")
    a = p.parse_args(argv)
    from jaxformer.stats import machine
    rows = []
    for name in a.levers:
        lever = LEVERS[name]
        if lever.op is not None and not a.configs:
            rows.append(measure_op(name, lever))
            print(name, rows[-1]["config"], f"{rows[-1]['ratio']:.3f}", rows[-1]["verdict"], flush=True)
        for config in lever.configs:
            if a.configs and config not in a.configs:
                continue
            rows.append(measure_decode(name, lever, config, a.blocks or DECODE_BLOCKS) if lever.decode else
                        measure(name, lever, config, a.blocks or BLOCKS[config], STEPS[config]))
            r = rows[-1]
            print(f"{name} {config}: {r['before']['median_ms']:.2f} -> {r['after']['median_ms']:.2f} ms, "
                  f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] {r['verdict']}", flush=True)
    res = {"machine": machine(), "command": shlex.join(["python", "benchmarks/levers.py", *argv]), "margin": MARGIN,
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "levers": {n: {"what": LEVERS[n].what, "before": LEVERS[n].before} for n in a.levers}, "rows": rows}
    if a.merge:
        old = Path(a.out).with_suffix(".json")
        if not old.exists():
            raise MergeError(f"--merge: no results file {old} to merge into")
        res = merged(json.loads(old.read_text()), res)
    write(Path(a.out), res)


class MergeError(ValueError):
    """--merge onto a results file that another machine, margin or environment wrote."""


def merged(old: dict, new: dict) -> dict:
    """The old results with the new run's rows in place of the old rows of the same lever and config (order kept,
    new pairs appended); both commands are recorded. Rows from two machines are never mixed."""
    for field in ("machine", "margin", "glibc_tunables"):
        if old[field] != new[field]:
            raise MergeError(f"--merge: the results file has {field}={old[field]!r}, this run {new[field]!r}; "
                             "run every lever again instead")
    fresh = {(r["lever"], r["config"]): r for r in new["rows"]}
    rows = [fresh.pop((r["lever"], r["config"]), r) for r in old["rows"]] + list(fresh.values())
    return {**old, "command": commands(old) + [new["command"]], "levers": old["levers"] | new["levers"], "rows": rows}


def commands(res: dict) -> list[str]:
    """The runs that wrote a results file, oldest first (a --merge run adds its own)."""
    return res["command"] if isinstance(res["command"], list) else [res["command"]]


def write(stem: Path, res: dict) -> None:
    lines = ["# Speed levers, each against the program without it", "",
             f"{' then '.join(f'`{c}`' for c in commands(res))} on {res['machine']}, "
             f"with GLIBC_TUNABLES={res['glibc_tunables'] or '(unset)'} "
             "(how `jaxformer` starts: jaxformer/platforms/launch.py).", "",
             __doc__.split("\n\n")[2].replace("\n", " ").strip(), "",
             "| lever | config | before ms | after ms | after / before [95% interval] | verdict | "
             "compile s before / after | loss (tokens) before / after |", "|---|---|---:|---:|---|---|---|---|"]
    for r in res["rows"]:
        b, a = r["before"], r["after"]
        unit = r.get("unit", "call" if b["loss"] is None else "step")   # an op alone: calls, no compile or loss
        d = 2 if unit == "step" else 3
        result = (f"{b['loss']:.6g} / {a['loss']:.6g}" if unit == "step" else
                  "same tokens" if r.get("same_tokens") else "tokens differ" if unit == "token" else "—")
        lines.append(f"| {r['lever']} | {r['config']} | {b['median_ms']:.{d}f} | {a['median_ms']:.{d}f} | "
                     f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] ({r['pairs']} pairs of {r['steps_per_block']}"
                     f"-{unit} blocks) | {r['verdict']} | "
                     + (f"{b['compile_s']:.2f} / {a['compile_s']:.2f}" if b["compile_s"] is not None else "—")
                     + f" | {result} |")
    lines += ["", "The levers:", ""] + [f"- **{n}**: {v['what']}; before: {v['before']}."
                                        for n, v in res["levers"].items()
                                        if any(r["lever"] == n for r in res["rows"])]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    from jaxformer.platforms.launch import hugepage_malloc
    hugepage_malloc()                  # the process environment `jaxformer` gives itself (jaxformer/platforms/launch.py)
    try:
        main()
    except MergeError as e:
        sys.exit(f"levers.py: {e}")
