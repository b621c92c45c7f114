"""Pipeline parallelism (parallel.stage, parallel.microbatches; `jaxformer.nn.pipeline`): the GPipe schedule's
bubble, config errors, the schedule at 3 and 4 stages against running the groups in order (in this process), and
on 8 fake CPU devices (tests/pipeline_worker.py, one subprocess per lane) training under
stage × data (× fsdp) plans equal to one device, stacked layers split over the stages, and checkpoints resumed
across a pipelined and a data-parallel mesh."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT, with_devices
from jaxformer.config import ConfigError, ParallelConfig
from jaxformer.nn import pipeline
from jaxformer.parallel import Plan

RTOL = 2 ** 7 * float(np.finfo(np.float32).eps)           # as tests/test_parallel.py
SMALL = ["model.num_heads=4", "model.vocab_size=16", "model.runtime.dropout=0.0", "optim.schedule=constant",
         "optim.lr=0.01", "optim.warmup_steps=0"]
L2 = SMALL + ["model.num_encoder_layers=2", "model.num_decoder_layers=2"]
L4 = SMALL + ["model.num_encoder_layers=4", "model.num_decoder_layers=4"]
RUNS = {       # name: (overrides, the one-device run it must equal)
    "stage 2 x data 4": (L2 + ["parallel.data=-1", "parallel.stage=2", "parallel.microbatches=4"], "L2 one device"),
    "stage 4 x data 2": (L4 + ["parallel.data=-1", "parallel.stage=4", "parallel.microbatches=2"], "L4 one device"),
    "stage 2 x data 2 x fsdp 2": (L2 + ["parallel.data=2", "parallel.fsdp=2", "parallel.stage=2",
                                       "parallel.microbatches=4"], "L2 one device"),
    "stage 2 remat": (L2 + ["parallel.data=-1", "parallel.stage=2", "parallel.microbatches=2",
                            "model.runtime.remat=full"], "L2 one device"),
}
DEFAULT_RUNS = ("stage 2 x data 4",)
REFUSED = {
    "layers not divisible by stage": (SMALL + ["model.num_encoder_layers=2", "model.num_decoder_layers=3",
                                               "parallel.stage=2"], "model.num_decoder_layers=3"),
    "encoder layers not divisible by stage": (L2 + ["model.num_encoder_layers=1", "parallel.stage=2"],
                                              "model.num_encoder_layers=1"),
    "batch not divisible by microbatches": (L2 + ["parallel.stage=2", "parallel.data=4", "parallel.microbatches=3"],
                                            "parallel.microbatches=3"),
    "a MoE model": (L2 + ["parallel.stage=2", "model.ffn=moe", "model.moe.num_experts=4"], "model.ffn='moe'"),
    "micro-batches too small for the batch shards": (L2 + ["parallel.stage=2", "parallel.data=4",
                                                           "parallel.microbatches=8"], "parallel.microbatches=8"),
}


def _worker(job: dict, tmp) -> dict:
    (tmp / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(ROOT / "tests/pipeline_worker.py"), str(tmp / "job.json"),
                           str(tmp / "out.json")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """The default lane's worker: stage 2 × data 4 against one device, and the refused configs."""
    tmp = tmp_path_factory.mktemp("pipeline")
    runs = {k: RUNS[k][0] for k in DEFAULT_RUNS}
    return _worker({"devices": 8, "tmp": str(tmp), "runs": {**runs, "L2 one device": L2 + ["parallel.data=1"]},
                    "errors": {k: v[0] for k, v in REFUSED.items()}}, tmp)


@pytest.fixture(scope="module")
def eight_more(tmp_path_factory):
    """The slow lane's worker: the other plans (their own one-device baselines) and resuming across meshes."""
    tmp = tmp_path_factory.mktemp("pipeline-more")
    steps = ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=2", "train.log_every=1"]
    stage2 = L2 + ["parallel.data=-1", "parallel.stage=2", "parallel.microbatches=4"] + steps
    data8 = L2 + ["parallel.data=8"] + steps
    runs = {k: v[0] for k, v in RUNS.items() if k not in DEFAULT_RUNS}
    return _worker({"devices": 8, "tmp": str(tmp),
                    "runs": {**runs, "L2 one device": L2 + ["parallel.data=1"],
                             "L4 one device": L4 + ["parallel.data=1"]},
                    "resume": {"stage 2 -> data 8": {"first": stage2, "then": data8, "workdir": str(tmp / "a")},
                               "data 8 -> stage 2": {"first": data8, "then": stage2, "workdir": str(tmp / "b")}}},
                   tmp)


def _record(request, name) -> dict:
    return request.getfixturevalue("eight" if name in DEFAULT_RUNS else "eight_more")["runs"]


# Parameters after Adam steps: an element whose gradient is ~0 moves by lr·(its noise's sign), so reduction order
# shows as absolute differences; data parallel (parallel.data=8) itself ends 5.5e-5 from one device after 3 steps of
# this model. The attention key biases (bk) are left out: their gradient is exactly 0 in exact arithmetic (softmax
# is shift-invariant), so Adam's update of them is pure rounding noise (~1e-3 apart under any mesh).
PARAM_ATOL = 1e-4


def _assert_params_close(got: dict, want: dict):
    assert got.keys() == want.keys() and got
    for k in want:
        if not k.endswith("['bk'].value"):
            np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=PARAM_ATOL, err_msg=k)


@pytest.mark.parametrize("name", [n if n in DEFAULT_RUNS else pytest.param(n, marks=pytest.mark.slow) for n in RUNS])
def test_pipelined_training_equals_one_device(request, name):
    runs = _record(request, name)
    got, base = runs[name], runs[RUNS[name][1]]
    assert got["mesh"]["stage"] > 1 and len(got["losses"]) == 3
    assert f"stage {got['mesh']['stage']} × " in got["describe"] and "micro-batches, bubble" in got["describe"]   # `jaxformer plan`
    np.testing.assert_allclose(got["losses"], base["losses"], rtol=RTOL)
    assert base["losses"][0] != base["losses"][-1]                    # the steps did change the model
    _assert_params_close(got["params"], base["params"])


@pytest.mark.parametrize("name", [n if n in DEFAULT_RUNS else pytest.param(n, marks=pytest.mark.slow) for n in RUNS])
def test_stacked_layers_and_their_moments_are_split_over_the_stages(request, name):
    r = _record(request, name)[name]
    stages = r["mesh"]["stage"]
    for part in ("model", "opt"):
        assert len(r["shards"][part]) > 10, part
        for path, (shape, shard, spec, held) in r["shards"][part].items():
            assert spec[0] == "stage" and shard[0] * stages == shape[0] and held == [shape[0] // stages], path


def test_bubble_fraction_is_the_schedule_s_idle_share():
    for p, m in [(1, 1), (1, 4), (2, 1), (2, 4), (4, 2), (4, 8), (3, 5), (8, 32)]:
        assert pipeline.counted_bubble_fraction(p, m) == pytest.approx(pipeline.bubble_fraction(p, m)), (p, m)
    s = pipeline.schedule(2, 3)                     # every micro-batch visits every stage once, in order
    assert s.tolist() == [[0, -1], [1, 0], [2, 1], [-1, 2]]


def test_split_rows_is_strided_and_merge_undoes_it():
    a = np.arange(12).reshape(12, 1)
    s = pipeline.split_rows(a, 4)
    assert s.shape == (4, 3, 1) and s[1, :, 0].tolist() == [1, 5, 9]
    assert (pipeline.merge_rows(s) == a).all()
    assert pipeline.usable_microbatches(12, 8) == 6 and pipeline.usable_microbatches(7, 4) == 1
    assert pipeline.usable_microbatches(6, 2) == 2 and pipeline.usable_microbatches(4, 3) == 2      # never more


class _Ctx(NamedTuple):
    """A stand-in for `nn.layers.Context`: one per-row leaf (split into micro-batches as the real one's) and hooks."""
    shift: jax.Array
    hooks: object = None


def _make_body(ctx):
    """Group g: h -> tanh(h · w_g + g/10) + shift[row]: no two groups commute, and the row's own ctx leaf is read."""
    def body(h, xs):
        w, _, layer = xs
        return jnp.tanh(h * w + 0.1 * layer[0]) + ctx.shift[:, None, None], {}
    return body


@pytest.mark.parametrize("stages, groups, rows, microbatches", [(3, 6, 6, 3), (4, 4, 4, 2), (3, 3, 5, 2)])
def test_the_schedule_equals_running_the_groups_in_order(stages, groups, rows, microbatches):
    """`pipeline.run` at 3 and 4 stages, in this process (one device: the stage axis is the vmapped one, its
    mesh axis of size 1), against a NumPy loop applying the groups one after another to each row. Wrong
    implementations caught: the stages' outputs shifted one stage back instead of forward (`jnp.roll(y, -1)`,
    the same as forward at 2 stages, all the worker's default lane runs), or not shifted; the last stage's output
    collected at the wrong iteration; a row given another micro-batch's ctx. (3, 3, 5, 2): 5 rows run as one
    micro-batch."""
    rng = np.random.default_rng(stages * 100 + groups)
    x = rng.normal(size=(rows, 2, 3)).astype(np.float32)
    w = rng.normal(size=(groups, 3)).astype(np.float32)
    shift = rng.normal(size=rows).astype(np.float32)
    want = x.astype(np.float64)
    for r in range(rows):
        for g in range(groups):
            want[r] = np.tanh(want[r] * w[g] + 0.1 * g) + shift[r]
    plan = Plan(ParallelConfig(), jax.devices()[:1])
    index = np.arange(groups, dtype=np.int32)[:, None]
    with plan.use():
        got = jax.jit(lambda x, w, s: pipeline.run(_make_body, (w, None, index), x, _Ctx(s), plan=plan,
                                                   stages=stages, microbatches=microbatches))(x, w, shift)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_the_schedule_carries_what_the_blocks_pass_on():
    """The layer driver's carry (x, passed: `nn.stack.Block`) through 3 stages of 6 groups: what group g passes
    on (here the running sum of the x it saw, and the first group's x kept) reaches group g+1 in every stage,
    equal to scanning the groups in order."""
    rng = np.random.default_rng(4)
    x, w, shift = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((6, 2, 3), (6, 3), (6,)))
    index = np.arange(6, dtype=np.int32)[:, None]

    def make_body(ctx):
        def body(carry, xs):
            (h, passed), (wg, _, layer) = carry, xs
            first = jnp.where(layer[0] == 0, h, passed["first"])
            h2 = jnp.tanh(h * wg + 0.1 * first) + ctx.shift[:, None, None]
            return (h2, {"sum": passed["sum"] + h, "first": first}), {}
        return body
    carry = (x, {"sum": jnp.zeros_like(x), "first": jnp.zeros_like(x)})
    plan = Plan(ParallelConfig(), jax.devices()[:1])
    with plan.use():
        got = jax.jit(lambda c, w, s: pipeline.run(make_body, (w, None, index), c, _Ctx(s), plan=plan, stages=3,
                                                   microbatches=2))(carry, w, shift)
    want = jax.jit(lambda c, w: jax.lax.scan(make_body(_Ctx(shift)), c, (w, None, index))[0])(carry, w)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(want[1]["sum"]).max()) > 0 and not np.allclose(np.asarray(want[1]["first"]), 0)


def test_a_bfloat16_stack_is_the_groups_scanned_in_order_bit_for_bit():
    """The schedule only reorders the work: in bfloat16 each row's groups run the same ops in the same dtype as
    scanning them in order, so the two agree exactly (a stage buffer of another dtype computes in it: 8e-3 off)."""
    rng = np.random.default_rng(0)
    x, w, shift = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((6, 2, 3), (6, 3), (6,)))
    index = np.arange(6, dtype=np.int32)[:, None]
    plan = Plan(ParallelConfig(), jax.devices()[:1])
    with plan.use():
        got = jax.jit(lambda x, w, s: pipeline.run(_make_body, (w, None, index), x, _Ctx(s), plan=plan, stages=3,
                                                   microbatches=3))(x, w, shift)
    want = jax.jit(lambda x, w: jax.lax.scan(_make_body(_Ctx(shift)), x, (w, None, index))[0])(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


class _RichCtx(NamedTuple):
    """Leaves of every kind a Context has: per-row ([rows]), broadcast ([1, D]), a traced scalar, a Python float
    (each but the first kept whole for every micro-batch), and hooks (kept as they are)."""
    shift: jax.Array
    bias: jax.Array
    offset: jax.Array
    scale: float
    hooks: object = None


def _make_rich_body(ctx):
    """Group g on micro-batch i: h -> hooks(tanh(h · w_g · scale + g/10 + bias) + shift[row] + offset + u), u a
    uniform draw of the group's dropout key folded with i."""
    def body(h, xs):
        w, keys, layer = xs
        u = jax.random.uniform(keys[0], h.shape[-1:])
        h = jnp.tanh(h * w * ctx.scale + 0.1 * layer[0] + ctx.bias[:, None]) + ctx.shift[:, None, None]
        return ctx.hooks(h + ctx.offset + u), {}
    return body


def _rich_reference(x, w, keys, ctx, microbatches):
    """The groups in order on each row, row r in micro-batch r mod M (`split_rows`), its keys folded with it."""
    want = np.asarray(x, np.float64).copy()
    for r in range(x.shape[0]):
        for g in range(w.shape[0]):
            u = np.asarray(jax.random.uniform(jax.random.fold_in(keys[g, 0], r % microbatches), (x.shape[-1],)))
            h = np.tanh(want[r] * w[g] * ctx.scale + 0.1 * g + np.asarray(ctx.bias)) + float(ctx.shift[r])
            want[r] = (h + float(ctx.offset) + u) * 0.5
    return want


def _rich_run(plan, stages, groups, rows, microbatches):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 2, 3)).astype(np.float32)
    w = rng.normal(size=(groups, 3)).astype(np.float32)
    ctx = _RichCtx(jnp.asarray(rng.normal(size=rows), jnp.float32), jnp.asarray(rng.normal(size=(1, 3)), jnp.float32),
                   jnp.float32(0.25), 0.75, lambda h: h * 0.5)
    keys = jax.random.split(jax.random.key(3), groups)[:, None]                          # [G, 1]
    index = np.arange(groups, dtype=np.int32)[:, None]
    with plan.use():           # the arrays traced, the Python float and the hooks closed over as a Context holds them
        f = jax.jit(lambda x, w, keys, shift, bias, offset: pipeline.run(
            _make_rich_body, (w, keys, index), x, ctx._replace(shift=shift, bias=bias, offset=offset), plan=plan,
            stages=stages, microbatches=microbatches))
        got = f(x, w, keys, ctx.shift, ctx.bias, ctx.offset)
        hlo = f.lower(x, w, keys, ctx.shift, ctx.bias, ctx.offset).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), _rich_reference(x, w, keys, ctx, microbatches), rtol=1e-5, atol=1e-5)
    return hlo


def test_every_kind_of_context_leaf_dropout_keys_and_hooks_reach_each_micro_batch():
    """Per-row leaves split with their rows, the others (broadcast, scalar, Python number) whole, the hooks kept,
    and each group's dropout key folded with the micro-batch's index (so micro-batches draw differently), at 3
    stages of 2 groups and 3 micro-batches, against the groups run in order on each row."""
    _rich_run(Plan(ParallelConfig(), jax.devices()[:1]), stages=3, groups=6, rows=6, microbatches=3)


def test_a_body_that_returns_aux_is_refused():
    """A pipelined stack returns no aux (MoE router statistics, captured sites): refused, not dropped."""
    plan = Plan(ParallelConfig(), jax.devices()[:1])
    body = lambda ctx: lambda h, xs: (h, {"seen": h})                                      # noqa: E731
    with plan.use(), pytest.raises(ValueError, match="cannot return the blocks' aux"):
        pipeline.run(body, (jnp.ones((2, 3)), None, jnp.zeros((2, 1), jnp.int32)), jnp.ones((2, 2, 3)),
                     _Ctx(jnp.zeros(2)), plan=plan, stages=2, microbatches=2)


@with_devices(4)
def test_stages_on_their_own_devices_hand_over_and_rows_split_leniently():
    """On 4 devices: at stage=4 each stage's buffer lives on its device, so the hand-over between stages is a
    collective-permute and nothing is all-gathered (a buffer or stage output left unpinned is gathered; one
    replicated over the stages would run every stage everywhere: no permute); at
    data=2 × stage=2 a micro-batch of 1 row is not split over data (the activation spec drops what does not
    divide, instead of refusing or mis-sharding). Both against the groups run in order."""
    hlo = _rich_run(Plan(ParallelConfig(stage=4, data=1), jax.devices()[:4]), 4, 4, 4, 2)
    assert "collective-permute(" in hlo and "all-gather(" not in hlo          # a stage's buffer is never gathered
    hlo = _rich_run(Plan(ParallelConfig(stage=2, data=2), jax.devices()[:4]), 2, 2, 2, 2)
    assert "all-gather(" not in hlo and "all-to-all(" not in hlo               # nor resharded between steps


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_pipeline_configs_are_refused_by_name_before_compiling(eight, name):
    r = eight["errors"][name]
    assert r["error"] == "ConfigError", r
    assert REFUSED[name][1] in r["message"], r["message"]
    assert r["compiled"] == 0


@pytest.mark.parametrize("kw, message", [
    ({"microbatches": 0}, "parallel.microbatches=0"),
    ({"stage": 0}, "parallel.stage=0"),
    ({"stage": 2, "mode": "shard_map"}, "parallel.stage=2"),
])
def test_pipeline_config_errors_name_the_field(kw, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage 2 -> data 8", "data 8 -> stage 2"])
def test_resume_across_a_pipelined_and_a_data_parallel_mesh(eight_more, name):
    r = eight_more["resume"][name]
    resumed, whole = r["resumed"], r["whole"]
    assert sorted(map(int, resumed["losses"])) == [1, 2, 3, 4] == sorted(map(int, whole["losses"]))
    np.testing.assert_allclose([resumed["losses"][str(s)] for s in range(1, 5)],
                               [whole["losses"][str(s)] for s in range(1, 5)], rtol=RTOL)
    _assert_params_close(resumed["params"], whole["params"])
