"""One of two processes reading the same token shards: `python tests/tokens_worker.py PROCESS_ID PORT SHARDS OUT`
(2 fake CPU devices each, 4 in all). Each process builds the data-parallel plan, takes its rows of 3 global
batches of 8 (packed documents) exactly as training does, and saves them with its row slice to OUT. The
assertions live in tests/test_tokens.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer.config import DataConfig, ParallelConfig  # noqa: E402
from jaxformer.data.tokens import TokensTask  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402

process, port, shards, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
plan = Plan(ParallelConfig(data=4))
rows = plan.local_rows(8)
task = TokensTask(DataConfig(task="tokens", path=shards, block_size=24, batch_size=8, packing="documents"))
it = iter(task.train_dataset(8, seed=5, rows=rows))
batches = [next(it) for _ in range(3)]
global_batch = plan.global_batch(batches[0], 8)             # the global array training would step on
assert global_batch["inputs"].shape == (8, 24)
np.savez(out, start=rows.start, stop=rows.stop, **{f"{k}{i}": b[k] for i, b in enumerate(batches) for k in b})
jax.distributed.shutdown()
print("saved", rows.start, rows.stop, flush=True)
