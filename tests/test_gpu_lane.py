"""The GPU lane (`make test-gpu`, `pytest -m gpu`): what only an accelerator's kernels can show. The GPU attention
backends (cuDNN flash attention, Pallas lowered to Triton) in bfloat16 against the float32 reference (outputs,
log-sum-exp, gradients; padding, causal packed documents, GQA/MQA); the whole model with each backend: loss and
gradients under every remat policy, cached decoding equal to the full forward, and bf16 training of the reversal
main job to float32's accuracy.

Each case runs where its backend can (`ops.fused.problem` says why not, and the case is skipped with that reason):
on a CPU cuDNN's cases skip and Pallas runs in interpret mode, and "chunked" (plain XLA) is the control on every
platform, so CI's slow lane runs the lane's bodies on CPU (`make test-slow` selects "slow or gpu"). Written to
finish in about 3 minutes on one H200 (benchmarks/gpu.py runs it first and records it). Each result is appended to
$JAXFORMER_TEST_LOG as it ends, after a first line naming the platform and devices it ran on (tests/conftest.py),
so a lane cut short still says how far it got, and a GPU lane that ran on a CPU says so.

Wrong implementations these catch: a kernel's log-sum-exp read in the wrong layout ([B,T,N] for [B,N,T]: issue 46's
cuDNN failure); segment ids or GQA head groups lost inside a kernel; a remat policy that changes gradients; a
backend's cached step attending one slot too far; bf16 training that diverges from float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT, cached_and_full
from test_attention_backends import LM, assert_same, case, lm_batch, loss_and_grads, run
from jaxformer import ops
from jaxformer.config import replaced
from jaxformer.nn import build_model
from jaxformer.ops import fused

pytestmark = pytest.mark.gpu
KERNELS = ("cudnn", "pallas")
BF16 = 8 * float(jnp.finfo(jnp.bfloat16).eps)        # a few bfloat16 steps, relative to the reference's scale


def need(backend: str, **kw) -> None:
    why = fused.problem(backend, dtype=jnp.bfloat16, **kw)
    if why:
        pytest.skip(why)


def packed():
    """Two documents per row (segment ids 1 then 2), causal within each: (q, k, v, mask)."""
    r = np.random.default_rng(3)
    b, t, n, h = 2, 64, 4, 32
    q, k, v = (jnp.asarray(r.normal(size=(b, t, n if i == 0 else 2, h)), jnp.float32) for i in range(3))
    seg = jnp.asarray(np.where(np.arange(t)[None] < np.array([[24], [40]]), 1, 2), jnp.int32)
    pos = jnp.asarray(np.where(seg == 1, np.arange(t), np.arange(t) - np.array([[24], [40]])), jnp.int32)
    return q, k, v, ops.CausalMask(pos, pos, None, seg, seg)


def within_bf16(got, want, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=what)
    scale = max(np.abs(want[finite]).max(initial=0.0), 1e-30)
    assert np.abs(got[finite] - want[finite]).max() <= BF16 * scale, what


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", ["padding", "causal", "gqa_mqa", "packed"])
def test_kernel_in_bfloat16_agrees_with_the_float32_reference(backend, name):
    """Outputs, log-sum-exp ([B,N,T], the contract every backend returns) and gradients of q, k, v."""
    need(backend)
    if name == "packed":
        (q, k, v, mask), bias, rows = packed(), None, None
    else:
        q, k, v, mask, bias, rows, _ = case(name)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    want = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)), mask, bias, rows)
    got = run(backend, q, k, v, mask, bias, rows)
    keep = np.ones(q.shape[:2], bool) if rows is None else np.asarray(rows)   # padded query rows may differ
    within_bf16(np.asarray(got[0], np.float32)[keep], np.asarray(want[0])[keep], "out")
    assert got[1].shape == want[1].shape, f"lse layout {got[1].shape} != {want[1].shape}"
    within_bf16(np.moveaxis(np.asarray(got[1]), 1, 2)[keep], np.moveaxis(np.asarray(want[1]), 1, 2)[keep], "lse")
    for i, (g, w) in enumerate(zip(got[2], want[2])):
        within_bf16(np.asarray(g, np.float32), w, f"grad {'qkv'[i]}")


@pytest.mark.parametrize("backend", [*KERNELS, "chunked"])
@pytest.mark.parametrize("remat", ["none", "dots", "dots_attention", "full"])
def test_model_loss_and_gradients_per_backend_and_remat(backend, remat):
    """float32 model (the kernels' float32 paths where they have one) against the reference without remat."""
    need(backend)
    cfg = replaced(LM, runtime__attention_backend=backend, runtime__remat=remat)
    if backend == "cudnn":                                     # bfloat16 only: compared with bf16 tolerance
        cfg = replaced(cfg, runtime__dtype="bfloat16")
        got, want = loss_and_grads(cfg, lm_batch()), loss_and_grads(replaced(LM, runtime__dtype="bfloat16"),
                                                                     lm_batch())
        within_bf16(got[0], want[0], "loss")
        return
    assert_same(loss_and_grads(cfg, lm_batch()), loss_and_grads(LM, lm_batch()))


@pytest.mark.parametrize("backend", ["cudnn", "chunked"])
def test_cached_decoding_equals_the_full_forward(backend):
    """Pallas refuses the cached path by name (tests/test_attention_backends.py)."""
    need(backend)
    dtype = "bfloat16" if backend == "cudnn" else "float32"
    model = build_model(replaced(LM, runtime__attention_backend=backend, runtime__dtype=dtype), seed=0)
    x = jnp.asarray(np.random.default_rng(2).integers(1, 23, (2, 12)), jnp.int32)
    cached, full, _ = cached_and_full(model, x, prefill=5)
    tol = BF16 if dtype == "bfloat16" else 1e-5
    scale = float(jnp.abs(full).max())
    assert float(jnp.abs(cached - full).max()) <= tol * scale * 4, backend


@pytest.mark.parametrize("backend", ["cudnn", "chunked"])
def test_bf16_training_of_reversal_reaches_float32_accuracy(backend, tmp_path):
    """configs/reverse.py (an encoder-decoder: Pallas takes no cross-attention), 600 steps in bfloat16 with the
    backend against float32 with the reference."""
    need(backend, cross=True)
    if jax.default_backend() == "cpu":
        pytest.skip("two 600-step trainings: tests/test_attention_backends.py's slow lane trains this on CPU")
    from jaxformer.configio import apply_overrides, load_config_file
    from jaxformer.train.loop import train
    exact = {}
    for name, sets in (("float32", []), ("bf16", ["model.runtime.dtype=bfloat16",
                                                  f"model.runtime.attention_backend={backend}"])):
        cfg = apply_overrides(load_config_file(ROOT / "configs/reverse.py"),
                              [*sets, "train.steps=600", "train.eval_every=600"])
        exact[name] = train(cfg, tmp_path / name, progress="none")["eval"]["exact_match"]
    assert exact["float32"] >= 0.9, exact
    assert exact["bf16"] >= exact["float32"] - 0.02, exact

