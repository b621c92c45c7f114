"""Shared timing for the benchmark scripts: wall times after a warm-up call, setup outside the timed region."""
from __future__ import annotations

import math
import statistics
import time

import jax


def times_ms(fn, reps: int, setup=lambda: ()) -> list[float]:
    """Wall times of fn(*setup()) in ms after one warm-up call; setup (e.g. a fresh donated buffer) is untimed."""
    jax.block_until_ready(fn(*setup()))
    ts = []
    for _ in range(reps):
        args = jax.block_until_ready(setup())
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(1e3 * (time.perf_counter() - t))
    return ts


def median_ms(fn, reps: int, setup=lambda: ()) -> float:
    return statistics.median(times_ms(fn, reps, setup))


def paired_times_ms(fns: dict, reps: int, setups: dict | None = None) -> dict[str, list[float]]:
    """{name: fn} -> {name: wall times in ms}: one warm-up call each, then `reps` rounds in which every fn runs
    once, the order reversed every other round (neither always runs first); round i of each list pairs with round
    i of the others (a machine's drift between rounds cancels in their ratio). setups {name: () -> args}: untimed."""
    setups = setups or {}
    args = {n: setups.get(n, lambda: ()) for n in fns}
    for n, f in fns.items():
        jax.block_until_ready(f(*args[n]()))
    out = {n: [] for n in fns}
    for i in range(reps):
        for n in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            a = jax.block_until_ready(args[n]())
            t = time.perf_counter()
            jax.block_until_ready(fns[n](*a))
            out[n].append(1e3 * (time.perf_counter() - t))
    return out


def paired_ratio(num_ms: list[float], den_ms: list[float]) -> dict | None:
    """num/den from paired rounds (round i of each measured together): the geometric mean of the per-round ratios
    with the 95% Student-t interval of the mean log ratio -> {ratio, lo, hi, rounds}; None under two rounds."""
    from jaxformer.verdicts import paired_difference
    d = paired_difference([math.log(x) for x in num_ms], [math.log(x) for x in den_ms])
    return None if d is None else {"ratio": math.exp(d.mean), "lo": math.exp(d.lo), "hi": math.exp(d.hi),
                                   "rounds": d.n}


def against(r: dict, target: float) -> str:
    """A paired ratio against the target "ratio >= target": "met" when its whole interval is at or above it,
    "missed" when all of it is below, else "not resolved"."""
    return "met" if r["lo"] >= target else "missed" if r["hi"] < target else "not resolved"
