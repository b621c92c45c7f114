"""Context parallelism's attention (`jaxformer.ops.context`): on 8 fake devices (tests/context_worker.py, its
own process) a sequence split over a "context" axis attends as the whole sequence does on one device, outputs
and gradients, for two packed documents with padding, with the tokens in order or in the zigzag load-balanced
order, on the reference and chunked backends and by ring attention (with a sliding window and a soft-cap too);
the ring's program never all-gathers; and zigzag balances the causal work. A tiny language model trains under
context plans (ring or gathered, zigzag or not, with data and FSDP) as on one device, and a run resumes across
plans.

Wrong implementations these catch: keys not gathered (each device sees only its own chunk), the key side of the
mask left local (positions of another device's keys misread), a mask taken from where a token sits instead of its
position (zigzag then breaks causality), an order and its inverse that do not round-trip; in the ring: partial results merged without their log-sum-exps,
blocks passed without their positions, key/value gradients not sent home (each device would keep the gradient of
the last block it held); in the model: the ring asked for but not run (caught by its collectives), the zigzag
order applied to the tokens but not their positions (the loss changes), a resume that drops the optimizer state.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT, tiny_lm, tiny_reverse
from jaxformer.config import ConfigError
from jaxformer.ops.context import unzigzag, zigzag, zigzag_order


def _worker(tmp, *jobs) -> dict:
    out = tmp / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/context_worker.py"), str(out), *jobs],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("context"), "train")


@pytest.fixture(scope="module")
def eight_all(tmp_path_factory):
    """The slow lane's worker: every context plan trained, and runs resumed across plans."""
    return _worker(tmp_path_factory.mktemp("context-all"), "train-all", "resume")


RTOL = 2 ** 7 * float(np.finfo(np.float32).eps)        # as tests/test_parallel.py: another reduction order


def _trains_like_one_device(runs: dict, name: str) -> None:
    one, got = runs["one"], runs[name]
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=RTOL)
    assert list(got["params"]) == list(one["params"])
    for path, b in one["params"].items():       # 4 Adam steps of lr 0.01 from the same start
        if "['bk']" in path:    # the key bias: its gradient is 0 exactly (softmax ignores a row's constant), so
            continue            # Adam turns float noise into lr-sized steps, differently in any reduction order
        np.testing.assert_allclose(got["params"][path], b, rtol=0, atol=2e-5 * max(np.max(np.abs(b)), 1.0),
                                   err_msg=path)
    assert one["losses"][0] != one["losses"][-1]
    assert (got["collective-permute"] > 0) == ("ring" in name)      # the ring really ran (and only there)


def test_a_language_model_trains_under_ring_attention_and_zigzag_like_one_device(eight):
    got = eight["train"]["data x context ring zigzag"]
    assert got["mesh"]["context"] == 4
    assert got["describe"].endswith("(jit, context attention ring, order zigzag)"), got["describe"]   # `plan`
    _trains_like_one_device(eight["train"], "data x context ring zigzag")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data x context ring", "data x context ring zigzag", "fsdp x context gather zigzag",
                                  "context ring zigzag", "fsdp x context ring"])
def test_every_context_plan_trains_like_one_device(eight_all, name):
    _trains_like_one_device(eight_all["train"], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring zigzag -> data", "data -> ring zigzag"])
def test_a_run_resumed_across_context_plans_continues_as_one_run(eight_all, name):
    base, got = eight_all["resume"]["data"], eight_all["resume"][name]
    assert list(got) == list(base) == [str(i) for i in range(1, 7)]
    np.testing.assert_allclose(list(got.values()), list(base.values()), rtol=RTOL)


@pytest.mark.slow      # the default lane's twin: tests/test_context_devices.py, on 4 devices in or out of process
@pytest.mark.parametrize("case", ["contiguous reference", "contiguous ring", "zigzag ring", "ring window softcap",
                                  "zigzag reference", "contiguous chunked", "zigzag chunked"])
def test_a_sequence_split_over_eight_devices_attends_as_one(eight_all, case):
    r = eight_all[case]
    assert r["out"] < 1e-5 * max(r["scale"], 1.0) and r["grads"] < 1e-5, r


def test_the_ring_passes_blocks_and_never_gathers_the_sequence(eight):
    assert eight["ring collectives"]["all-gather"] == 0 and eight["ring collectives"]["collective-permute"] > 0


def test_zigzag_balances_the_causal_work(eight):
    plain, balanced = eight["pairs contiguous"], eight["pairs zigzag"]
    assert max(plain) > 10 * min(plain)                          # the last device reads 15x the first's keys
    assert len(set(balanced)) == 1 and sum(balanced) == sum(plain)


def test_zigzag_order_and_its_inverse():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = jnp.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(unzigzag(zigzag(x, 3), 3), x)
    with pytest.raises(ValueError, match="length 10 is not a multiple of 2 x 4 devices"):
        zigzag_order(10, 4)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context=3"], "data.block_size=10 must be a multiple of it"),
    (["parallel.context=4", "parallel.context_order=zigzag", "data.block_size=12"], "data.block_size=12 must be a multiple of 2 x"),
    (["parallel.data=1", "parallel.context=-1", "parallel.context_order=zigzag"], "parallel.context=-1"),
    (["parallel.context=5", "parallel.context_order=zigzag", "data.block_size=20", "model.ffn=moe"],
     "model.runtime.moe_capacity_factor=1.25"),
    (["parallel.context_attention=ring", "parallel.stage=2"], "parallel.stage=2"),
    (["parallel.context_attention=rings"], "parallel.context_attention"),
    (["parallel.context_order=zag"], "parallel.context_order"),
])
def test_context_plans_that_cannot_run_are_named_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_lm(*overrides)


def test_zigzag_refuses_a_seq2seq_task():
    with pytest.raises(ConfigError, match="seq2seq task"):
        tiny_reverse("parallel.context=2", "parallel.context_order=zigzag")
