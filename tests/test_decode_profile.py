"""benchmarks/decode_profile.py reads which weight each matmul of the compiled decoding loop reads, and how, from
the compiled HLO (operands are printed by name only, so their shapes come from the instructions that define
them). These tests compile small programs and check the reading.

Wrong implementations caught: the weight taken from the dot's own (output) shape, the contracted axis always read
from the left operand's dims (a weight on the right contracted on 1 reported as 0), an operand name not resolved
(empty shape, 0 bytes).
"""
import sys

import jax
import jax.numpy as jnp

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_profile as dp  # noqa: E402
from step_profile import classify_hlo, fused_bodies  # noqa: E402


def _weights(f, *args) -> list[tuple[str, int]]:
    """dot_weight of every matmul op of f's compiled program."""
    hlo = jax.jit(f).lower(*args).compile().as_text()
    shapes = dp.value_shapes(hlo)
    return [dp.dot_weight(body, shapes) for op, (body, _) in fused_bodies(hlo).items()
            if classify_hlo(op, body) == "matmul" and " dot(" in body]


def test_a_row_times_a_weight_reads_the_weight_contracted_on_its_input_axis():
    x, w = jnp.ones((1, 64)), jnp.ones((64, 256))
    assert set(_weights(lambda x, w: jnp.tanh(x @ w), x, w)) == {("f32[64,256] in 0", 64 * 256 * 4)}


def test_a_weight_stored_out_in_is_contracted_on_axis_1():
    x, w = jnp.ones((1, 256)), jnp.ones((64, 256))
    f = lambda x, w: jnp.tanh(jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))  # noqa: E731
    assert set(_weights(f, x, w)) == {("f32[64,256] in 1", 64 * 256 * 4)}


def test_the_weight_is_found_on_either_side():
    x, w = jnp.ones((1, 64)), jnp.ones((256, 64))
    f = lambda x, w: jnp.tanh(jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))))  # noqa: E731
    assert set(_weights(f, x, w)) == {("f32[256,64] in 1", 256 * 64 * 4)}
