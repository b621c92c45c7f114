"""`platforms.cpu.materialize` (an identity that ends an XLA:CPU fusion) and the projections' backward that uses it
(`nn.params.contract`: the weight gradient's transposed operand materialized, `nn.params._weight_grad`).

Wrong implementations these tests catch: a materialize that changes values (its false branch taken when the
first element is NaN or infinite, or a cast), that blocks or scales the gradient, or that the compiler folds
away (the fusion then stays); a projection backward that loses the materialize (XLA folds the transpose back
into the dot), swaps or transposes the gradients wrongly, or gives a weight gradient of the wrong layout for a
multi-axis weight; a weight gradient that pairs contracted axes in the wrong order, transposes the larger
operand (or leaves the choice to XLA, which transposes the output gradient), or flattens sharded axes under a
mesh; a tiled transpose (`layout.transpose`) that swaps the wrong axes (tiles transposed but not their contents,
or the reverse), tiles a side that is no multiple of the tile or a matrix below TILED_MIN, or that the weight
gradient does not use.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.nn.params import contract
from jaxformer.platforms import cpu as layout
from jaxformer.platforms.cpu import materialize

EPS32 = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("first", [1.5, np.nan, np.inf, -np.inf, 0.0])
def test_materialize_is_the_identity_under_jit_grad_and_vmap(first):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32).at[0, 0].set(first)
    np.testing.assert_array_equal(np.asarray(jax.jit(materialize)(x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.vmap(materialize)(x)), np.asarray(x))
    g = jax.grad(lambda a: jnp.sum(jnp.nan_to_num(materialize(a)) * jnp.arange(12.0).reshape(3, 4)))(x)
    np.testing.assert_array_equal(np.asarray(g)[np.isfinite(np.asarray(x))],
                                  np.arange(12.0).reshape(3, 4)[np.isfinite(np.asarray(x))])
    for other in (jnp.arange(5), jnp.zeros((0, 3)), jnp.ones((2,), jnp.bfloat16)):
        np.testing.assert_array_equal(np.asarray(materialize(other)), np.asarray(other))


def _fusions_with(hlo: str, *ops: str) -> int:
    """How many fused computations of compiled HLO text contain every one of `ops`."""
    bodies = re.findall(r"^%?[\w.\-]+ \(.*?\) -> .*? \{\n(.*?)\n\}", hlo, re.S | re.M)
    return sum(all(re.search(rf" {op}\(", b) for op in ops) for b in bodies)


def test_materialize_ends_the_fusion_on_cpu():
    x, s = jnp.ones((64, 48)), jnp.ones((64, 1))
    fused = jax.jit(lambda x, s: jnp.transpose(jnp.where(x > 0, x * s + 2.0, 0.0))).lower(x, s).compile().as_text()
    split = jax.jit(lambda x, s: jnp.transpose(materialize(jnp.where(x > 0, x * s + 2.0, 0.0)))).lower(x, s)
    split = split.compile().as_text()
    assert _fusions_with(fused, "multiply", "transpose") >= 1          # the check can fail: XLA fuses them
    assert _fusions_with(split, "multiply", "transpose") == 0
    assert " conditional(" in split


@pytest.mark.parametrize("eq,xs,ws", [("BTD,DF->BTF", (2, 3, 6), (6, 7)),           # input size <= output
                                      ("BTF,FD->BTD", (2, 3, 7), (7, 5)),           # input size > output
                                      ("BTD,DNH->BTNH", (2, 3, 6), (6, 4, 5)),
                                      ("BTD,DNH->BTNH", (2, 3, 9), (9, 2, 3)),
                                      ("BTNH,NHD->BTD", (2, 3, 4, 5), (4, 5, 6)),
                                      ("BTNH,NHD->BTD", (2, 3, 4, 5), (4, 5, 30)),
                                      ("BTHN,NHD->BTD", (2, 3, 5, 4), (4, 5, 6))])  # x's axes not in w's order
def test_projection_gradients_are_einsums(eq, xs, ws):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, xs), jax.random.normal(kw, ws)
    out = jnp.einsum(eq, x, w)
    g = jax.random.normal(kg, out.shape)
    got = jax.vjp(lambda x, w: contract(eq, x, w), x, w)[1](g)
    want = jax.vjp(lambda x, w: jnp.einsum(eq, x, w, precision="highest"), x, w)[1](g)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=32 * EPS32 * float(jnp.max(jnp.abs(b))) * max(xs[:2]))
    # the backward materializes the weight gradient's transposed operand (a conditional in the compiled program)
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(contract(eq, x, w) ** 2), (0, 1))).lower(x, w).compile().as_text()
    assert " conditional(" in hlo


def _transposed_sizes(hlo: str) -> list[int]:
    """Element counts of the arrays that compiled HLO text transposes (its transpose instructions, fused or not)."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} transpose\(", hlo)
    return [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in shapes]


def test_the_weight_gradient_transposes_the_smaller_operand():
    """An FFN's two projections, M = 96 tokens, D = 16, F = 128: their weight gradients transpose [M,D] arrays
    (x for the input projection, g for the output one), never an [M,F] one; jax's own transpose of the dot (the
    form `_weight_grad` replaced) makes XLA:CPU transpose the [M,F] output gradient of the input projection."""
    from jaxformer.nn import params
    x, w1, w2 = jnp.ones((4, 24, 16)), jnp.ones((16, 128)), jnp.ones((128, 16))

    def hlo():
        def f(x, w1, w2):
            return jnp.sum(contract("BTF,FD->BTD", jnp.tanh(contract("BTD,DF->BTF", x, w1)), w2) ** 2)
        return jax.jit(jax.grad(f, (1, 2))).lower(x, w1, w2).compile().as_text()
    ours = hlo()
    jax_form = lambda dims, x, w, g: jax.vjp(lambda w: jax.lax.dot_general(x, w, dims), w)[1](g)[0]  # noqa: E731
    old, params._weight_grad = params._weight_grad, jax_form
    try:
        theirs = hlo()
    finally:
        params._weight_grad = old
    assert max(_transposed_sizes(theirs)) >= 96 * 128                        # the check can fail
    assert max(_transposed_sizes(ours)) <= 96 * 16


def test_the_weight_gradient_under_a_multi_device_mesh_is_jax_own():
    """Flattening the token axes would merge sharded axes: under a mesh of several devices no reshape of x."""
    from jaxformer.nn import params
    dims = (((2,), (0,)), ((), ()))
    x, w, g = jnp.ones((2, 3, 4)), jnp.ones((4, 5)), jnp.ones((2, 3, 5))
    def prims():
        return {e.primitive.name for e in jax.make_jaxpr(params._weight_grad, static_argnums=0)(dims, x, w, g).eqns}
    assert "reshape" in prims()                                                 # the check can fail
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("data",))):
        assert "reshape" not in prims()


def test_materialize_is_a_no_op_under_a_multi_device_mesh():
    """Its predicate reads one element: on a sharded x that would be a collective per call."""
    def prims(jaxpr):
        return {e.primitive.name for e in jaxpr.eqns}
    x = jnp.ones((4, 4))
    assert "cond" in prims(jax.make_jaxpr(materialize)(x).jaxpr)                # the check can fail
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("data",))):
        assert not prims(jax.make_jaxpr(materialize)(x).jaxpr)                 # x itself, no equation


def test_step_profile_tells_a_plain_copy_from_one_carrying_work():
    """benchmarks/step_profile.py's split of the copies group, on the two programs above."""
    import sys
    from helpers import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile
    x, s = jnp.ones((64, 48)), jnp.ones((64, 1))
    kinds = {}
    for name, f in (("fused", lambda x, s: jnp.transpose(jnp.where(x > 0, x * s + 2.0, 0.0))),
                    ("split", lambda x, s: jnp.transpose(materialize(jnp.where(x > 0, x * s + 2.0, 0.0))))):
        hlo = jax.jit(f).lower(x, s).compile().as_text()
        kinds[name] = {step_profile.copy_kind(body) for op, (body, _) in step_profile.fused_bodies(hlo).items()
                       if "fusion" in op and step_profile.classify_hlo(op, body) == "transposes/copies"}
    assert kinds["fused"] == {"with work"}                  # the fused transpose carries the where/multiply
    assert "with work" not in kinds["split"]
    assert step_profile.copy_kind("f32[48,64]{1,0} copy(%transpose.0)") == "plain"           # a bare copy
    assert step_profile._elements("f32[6,16,64,2048]{3,2,1,0} copy(%x)") == 6 * 16 * 64 * 2048


def test_step_profile_charges_a_loop_only_its_own_time():
    """benchmarks/step_profile.py's `self_times`: a while event that spans its body's ops on the same thread keeps
    only the time no nested event covers (a nested child's own children are not subtracted twice); an op on
    another thread inside its span is not its child; siblings that touch end to start do not nest."""
    import sys
    from helpers import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile
    ev = [{"ts": 0.0, "dur": 1000.0, "tid": 1},                # while: spans all of the below on thread 1
          {"ts": 10.0, "dur": 300.0, "tid": 1},                # a call inside it ...
          {"ts": 20.0, "dur": 100.0, "tid": 1},                # ... with its own op inside
          {"ts": 310.0, "dur": 400.0, "tid": 1},               # starts where the call ends: a sibling
          {"ts": 50.0, "dur": 500.0, "tid": 2},                # another thread: no one's child
          {"ts": 1000.0, "dur": 7.0, "tid": 1}]                # after the loop
    own = step_profile.self_times(list(reversed(ev)))[::-1]    # in any order; the result follows the input's
    assert own == [300.0, 200.0, 100.0, 400.0, 500.0, 7.0]
    assert sum(own) == 1000.0 + 500.0 + 7.0                    # thread 1 is covered exactly once


def test_step_profile_counts_the_time_no_op_event_covers():
    """benchmarks/step_profile.py's `gaps`: overlapping events on two threads cover their union; a gap of at least
    50 µs is charged to the op whose event ended last before it; shorter gaps (dispatch) are not counted."""
    import sys
    from helpers import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile
    spans = [("dot", 0.0, 100.0), ("add", 20.0, 30.0),       # add inside dot's event: no gap, dot ends last
             ("reduce", 400.0, 50.0),                          # 300 µs after dot
             ("copy", 460.0, 10.0),                            # 10 µs: dispatch, not counted
             ("tail", 600.0, 5.0)]                             # 130 µs after copy
    total, after = step_profile.gaps(list(reversed(spans)))    # in any order
    assert total == 430.0
    assert after == {"dot": 300.0, "copy": 130.0}
    assert step_profile.gaps([]) == (0.0, {})


@pytest.mark.parametrize("shape", [(256, 256), (512, 128), (128, 1024), (64, 32), (300, 256), (32, 4096)])
def test_tiled_transpose_is_the_transpose_under_jit_grad_and_vmap(shape):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.transpose)(x)), np.asarray(x).T)
    xi = jnp.arange(x.size, dtype=jnp.int32).reshape(shape)                        # every element where it goes
    np.testing.assert_array_equal(np.asarray(layout.transpose(xi)), np.asarray(xi).T)
    c = jnp.asarray(np.random.default_rng(1).standard_normal(shape[::-1]), jnp.float32)
    g = jax.grad(lambda a: jnp.sum(layout.transpose(a) * c))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c).T)
    stack = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(np.asarray(jax.vmap(layout.transpose)(stack)), np.swapaxes(np.asarray(stack), 1, 2))
    # tiled exactly where both sides are multiples of the tile and the matrix has TILED_MIN elements or more
    ranks = {e.outvars[0].aval.ndim for e in jax.make_jaxpr(layout.transpose)(x).jaxpr.eqns
             if e.primitive.name == "transpose"}
    tiled = shape[0] % layout.TILE == 0 and shape[1] % layout.TILE == 0 and x.size >= layout.TILED_MIN
    assert ranks == ({4} if tiled else {2})


def test_the_weight_gradient_transposes_in_tiles():
    """x [4,64,256] through a [256,512] weight: its gradient transposes x as [M,D] = [256,256] in 32×32 tiles."""
    x, w = jnp.ones((4, 64, 256)), jnp.ones((256, 512))
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(contract("BTD,DF->BTF", x, w) ** 2), 1)).lower(x, w).compile()
    assert re.search(r"= f32\[8,32,8,32\]\{[\d,]*\} transpose\(", hlo.as_text())
