"""Process-wide lowering choices jaxformer makes for XLA:CPU. Each changes how a program is compiled, never what
it computes: results stay bit-identical (tests/test_lowering.py).

`unrolled_threefry`: jax lowers its threefry2x32 hash (every draw from a default jax.random key: dropout masks,
key splits, sampling) as straight-line code on GPU and TPU, but on CPU as a while loop of 5 trips (shorter to
compile). Each draw is then a loop whose every trip runs a fusion plus copies of its carried state as separate
runtime ops: the "threefry_unrolled" lever (`jaxformer.platforms`). The op events per step of the dropout
models, rolled and unrolled: benchmarks/step_profile.py (benchmarks/results/step_profile.md, each config's
"Dropout bits" line); the step's time with and without it: benchmarks/levers.py (`threefry_unrolled`;
benchmarks/results/levers.md, rows `threefry_unrolled`). Results are unchanged.

`train_compiler_options`: the XLA options the train step is compiled with. On CPU, copy insertion with region
analysis (`xla_cpu_copy_insertion_use_region_analysis`, off by default on CPU; GPU and TPU have their own switch):
XLA proves more of the copies it inserts for a while loop's carried values unnecessary and drops them, e.g. the
scanned layer stack's carried activation [B,T,D], forward and backward, and weight-gradient-sized copies in the
backward loop: the "copy_insertion" lever (`jaxformer.platforms`), the step's time and compile time with and
without it per config: benchmarks/levers.py (`copy_insertion`; benchmarks/results/levers.md, rows
`copy_insertion`). Results are bit-identical.
"""
from __future__ import annotations

import jax

from jaxformer.platforms import COMPILER_OPTIONS, enabled

TRAIN_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def train_compiler_options() -> dict | None:
    """`compiler_options` for the train step's jax.jit: TRAIN_CPU_OPTIONS when the default backend is the CPU,
    plus the options of each enabled option lever (`platforms.COMPILER_OPTIONS`); None when there are none
    (XLA's defaults). An option this jaxlib's XLA does not know fails the compile with a named error."""
    out = dict(TRAIN_CPU_OPTIONS) if jax.default_backend() == "cpu" and enabled("copy_insertion") else {}
    for name, options in COMPILER_OPTIONS.items():
        if enabled(name):
            out.update(options)
    return out or None


def _hooks():
    """(mlir, threefry2x32 module) from jax's internals, or None where this jax lacks them."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as tf
        tf.threefry2x32_p, tf._threefry2x32_lowering_rule, tf._threefry2x32_cpu_lowering_rule  # noqa: B018
    except (ImportError, AttributeError):
        return None
    return mlir, tf


def unrolled_threefry(enable: bool | None = None) -> bool:
    """Lower threefry2x32 on CPU unrolled (enable=True) or as jax's CPU default, the rolled loop (enable=False);
    None (what `train.step.make_train_step` and the decoders call): as the "threefry_unrolled" lever says
    (`jaxformer.platforms`: on for CPU, overridable by name). Affects programs lowered from
    then on, in this process; idempotent. Returns whether the choice could be made (False: this jax has no such
    hook and its default stays)."""
    hooks = _hooks()
    if hooks is None:
        return False
    mlir, tf = hooks
    enable = enabled("threefry_unrolled") if enable is None else enable
    rule = tf._threefry2x32_lowering_rule if enable else tf._threefry2x32_cpu_lowering_rule
    mlir.register_lowering(tf.threefry2x32_p, rule, platform="cpu")
    return True


def threefry_is_unrolled() -> bool:
    """Whether CPU programs lowered now get the unrolled threefry2x32."""
    hooks = _hooks()
    if hooks is None:
        return False
    mlir, tf = hooks
    entry = mlir._platform_specific_lowerings["cpu"].get(tf.threefry2x32_p)
    return entry is not None and entry.rule is tf._threefry2x32_lowering_rule
