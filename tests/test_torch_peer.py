"""benchmarks/torch_peer.py, the PyTorch peer benchmarks/gpu.py times ours against, computes what our model computes:
the same logits from the same parameters (float32, CPU), and its static-cache decoding the same as its full
forward. Wrong peers these catch: a different RoPE convention (interleaved pairs), GELU's tanh form, a missing
final norm, an untied head, or a cache mask off by one slot: each moves the logits far past float32 rounding."""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu  # noqa: E402
import torch_peer  # noqa: E402
from flax import nnx  # noqa: E402

from jaxformer.config import replaced  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402

S = gpu.DRY | {"prompt": 5, "new": 4}


def test_peer_logits_equal_ours_from_the_same_parameters():
    cfg = gpu.lm_config(S, "reference", "none").model
    ours = build_model(replaced(cfg, runtime__dtype="float32"), seed=2)
    peer = torch_peer.load_jax(torch_peer.PeerLM(S), nnx.state(ours, nnx.Param))
    tokens = np.random.default_rng(0).integers(1, S["vocab"], (2, 12))
    want = np.asarray(ours(jnp.asarray(tokens, jnp.int32))[0])
    with torch.no_grad():
        got = peer(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert sum(p.numel() for p in peer.parameters()) == sum(x.size for x in jax_leaves(ours))


def jax_leaves(model):
    import jax
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_peer_static_cache_decoding_equals_its_full_forward():
    torch.manual_seed(0)
    peer = torch_peer.PeerLM(S).eval()
    b, slots, n, h = 2, 9, S["num_heads"], S["d_model"] // S["num_heads"]
    tokens = torch.randint(1, S["vocab"], (b, slots))
    caches = [tuple(torch.zeros(b, n, slots, h) for _ in range(2)) for _ in peer.blocks]
    with torch.no_grad():
        full = peer(tokens)
        idx = torch.arange(5)
        steps = [peer(tokens[:, :5], idx, caches, idx)]
        for i in range(5, slots):
            idx = torch.tensor([i])
            steps.append(peer(tokens[:, i:i + 1], idx, caches, idx))
    np.testing.assert_allclose(torch.cat(steps, 1).numpy(), full.numpy(), rtol=1e-5, atol=1e-5)
