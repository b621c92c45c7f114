"""One of several processes that save checkpoints together: `python tests/checkpoint_worker.py PROCESS_ID
PORT ROOT STEPS` (2 processes, 2 fake CPU devices each). Each step goes into both managers ("latest" and "best")
at once, as a training run's evaluation steps do; the last step is then restored and checked. The assertions
live in tests/test_parallel.py; this file prints "saved STEP" per step and "restored" at the end."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxformer.checkpoints import Checkpoints  # noqa: E402

process, port, root, steps = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("data"))
full = np.arange(32, dtype=np.float32).reshape(8, 4)
ckpt = Checkpoints(root)
for step in range(1, steps + 1):
    x = jax.make_array_from_callback(full.shape, sharding, lambda i, s=step: full[i] * s)
    ckpt.save(step, {"model": {"w": x}, "opt": {"m": x + 1}}, {"position": step}, {"loss": 1.0 / step})
    print("saved", step, flush=True)
target = {"model": {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)}}
got = ckpt.restore(target, ("best",), data=True)
assert got.step == steps and got.items["data"] == {"position": steps}, got
assert all(np.array_equal(np.asarray(s.data), full[s.index] * steps) for s in got.items["model"]["w"].addressable_shards)
ckpt.close()
jax.distributed.shutdown()
print("restored", flush=True)
