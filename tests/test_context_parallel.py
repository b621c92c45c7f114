"""Context parallelism's attention (`jaxformer.ops.context`): on 8 fake devices (tests/context_worker.py, its
own process) a sequence split over a "context" axis attends as the whole sequence does on one device, outputs
and gradients, for two packed documents with padding, with the tokens in order or in the zigzag load-balanced
order, on the reference and chunked backends; and zigzag balances the causal work.

Wrong implementations these catch: keys not gathered (each device sees only its own chunk), the key side of the
mask left local (positions of another device's keys misread), a mask taken from where a token sits instead of its
position (zigzag then breaks causality), an order and its inverse that do not round-trip.
"""
from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT
from jaxformer.ops.context import unzigzag, zigzag, zigzag_order


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    out = tmp_path_factory.mktemp("context") / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/context_worker.py"), str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["contiguous reference", "zigzag reference", "contiguous chunked",
                                  "zigzag chunked"])
def test_a_sequence_split_over_eight_devices_attends_as_one(eight, case):
    r = eight[case]
    assert r["out"] < 1e-5 * max(r["scale"], 1.0) and r["grads"] < 1e-5, r


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
