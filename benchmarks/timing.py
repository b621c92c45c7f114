"""Shared timing for the benchmark scripts: wall times after a warm-up call, setup outside the timed region."""
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
