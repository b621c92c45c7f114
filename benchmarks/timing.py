"""Shared timing for the benchmark scripts: wall times after a warm-up call, setup outside the timed region. The
statistics of paired rounds (`paired_ratio`, `against`) are `jaxformer.stats`'s."""
from __future__ import annotations

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
