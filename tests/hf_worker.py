"""Runs in its own process with 8 fake CPU devices: `python tests/hf_worker.py CHECKPOINT OUT.json`. Loads a
Hugging Face checkpoint folder under an FSDP plan (fsdp=8) and records, per parameter, its global shape and each
device's shard, the logits of a fixed batch, and the process's peak resident memory before and after loading.
The assertions live in tests/test_hf.py."""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxformer.config import ParallelConfig  # noqa: E402
from jaxformer.hf import from_pretrained  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
plan = Plan(ParallelConfig(data=1, fsdp=8))
before = peak_mib()
model = from_pretrained(ckpt, plan=plan)
after = peak_mib()
params = {}
for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    a = v[...]
    params["/".join(map(str, path))] = {
        "shape": list(a.shape), "bytes": a.nbytes, "spec": str(a.sharding.spec),
        "shards": sorted([[d.id, list(s.data.shape), s.data.nbytes] for s in a.addressable_shards
                          for d in [s.device]])}
ids = np.asarray(json.loads((ckpt / "batch.json").read_text()))
logits = np.asarray(model(jnp.asarray(ids))[0])
out.write_text(json.dumps({"devices": len(jax.devices()), "params": params, "logits": logits.tolist(),
                           "peak_mib_before": before, "peak_mib_after": after}))
