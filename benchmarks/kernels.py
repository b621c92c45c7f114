"""The kernels under the char-model train step, alone: each matmul of one layer (forward, input gradient, weight
gradient) and the attention softmax backward, XLA:CPU (jitted JAX) against PyTorch (eager, oneDNN/MKL), same
shapes, same machine, each framework in its own fresh process.

  .venv/bin/python benchmarks/kernels.py [--reps 7] [--out STEM]

Shapes: the gpt config of benchmarks/train_step.py (B12, T64, D128, N4, H32, F512, V65: M = B·T = 768 rows),
and the FFN matmuls of one decoded token at base size (D512, F2048; M = 1 or 8 rows: weight-read bound, so
GB/s = the weight's bytes / time is also given).
  fwd    x[M,K] @ w[K,N]                              (a projection)
  dX     g[M,N] @ w[K,N]ᵀ                             (its input gradient)
  dW     x[M,K]ᵀ @ g[M,N]                             (its weight gradient: contracts the M rows of both)
  softmax-bwd  p·(dp − Σ_s p·dp) over [B,N,T,S]       (the attention softmax's backward)
A case is timed as R independent copies (separate buffers) in one call (R = 16; JAX: one jitted function,
PyTorch: a Python loop), so dispatch is amortised; median over --reps calls after a warm-up, divided by R.
GFLOP/s = 2·M·K·N / time.
What the ratio means: the train step's own time, less these kernels at this speed, is what XLA:CPU spends
elsewhere (copies, layer-stack I/O, fills: benchmarks/step_profile.py); at PyTorch's kernel speed the same
matmuls would take the PyTorch column. Writes STEM.md and STEM.json (default benchmarks/results/kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

M, D, F, V, B, N, T = 768, 128, 512, 65, 12, 4, 64
R = 16
# name -> (kind, m, k, n): the matmuls of one gpt layer (+ the tied head), each as fwd / dX / dW
GEMMS = {"qkv (3 projections)": (M, D, 3 * D), "q, k or v": (M, D, D), "attention out": (M, D, D),
         "ffn up": (M, D, F), "ffn down": (M, F, D), "head (tied)": (M, D, V)}
KINDS = ("fwd", "dX", "dW")


# decoding at base size (benchmarks/decode.py): a step's weight matmuls, M = batch rows, forward only
DECODE = {"decode b1 ffn up": (1, 512, 2048), "decode b1 ffn down": (1, 2048, 512),
          "decode b8 ffn up": (8, 512, 2048), "decode b8 ffn down": (8, 2048, 512)}


def _cases():
    for name, (m, k, n) in GEMMS.items():
        for kind in KINDS:
            yield f"{name} {kind}", (kind, m, k, n)
    yield "softmax-bwd", ("softmax", B, N, T)
    for name, (m, k, n) in DECODE.items():
        yield name, ("fwd", m, k, n)


def jax_child(reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    out = {}
    rng = np.random.default_rng(0)
    for label, (kind, m, k, n) in _cases():
        if kind == "softmax":
            p, dp = ([jnp.asarray(rng.random((m, k, n, n), np.float32)) for _ in range(R)] for _ in range(2))
            fn = jax.jit(lambda p, dp: [a * (b - jnp.sum(a * b, -1, keepdims=True)) for a, b in zip(p, dp)])
            args, flops = (p, dp), 0
        else:
            a_shape, b_shape = {"fwd": ((m, k), (k, n)), "dX": ((m, n), (k, n)), "dW": ((m, k), (m, n))}[kind]
            a = [jnp.asarray(rng.standard_normal(a_shape, np.float32)) for _ in range(R)]
            b = [jnp.asarray(rng.standard_normal(b_shape, np.float32)) for _ in range(R)]
            eq = {"fwd": "mk,kn->mn", "dX": "mn,kn->mk", "dW": "mk,mn->kn"}[kind]
            # R independent matmuls on R separate buffers (no slicing), unrolled: each the kernel a step runs
            fn = jax.jit(lambda a, b, eq=eq: [jnp.einsum(eq, x, y) for x, y in zip(a, b)])
            args, flops = (a, b), 2 * m * k * n
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append((time.perf_counter() - t) / R)
        out[label] = {"s": statistics.median(ts), "flops": flops}
    return out


def torch_child(reps: int) -> dict:
    import numpy as np
    import torch
    torch.set_num_threads(os.cpu_count())
    out = {}
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for label, (kind, m, k, n) in _cases():
            if kind == "softmax":
                p, dp = ([torch.from_numpy(rng.random((m, k, n, n), np.float32)) for _ in range(R)]
                         for _ in range(2))
                fn = lambda: [p[i] * (dp[i] - (p[i] * dp[i]).sum(-1, keepdim=True)) for i in range(R)]  # noqa: E731
                flops = 0
            else:
                a_shape, b_shape = {"fwd": ((m, k), (k, n)), "dX": ((m, n), (k, n)), "dW": ((m, k), (m, n))}[kind]
                a = [torch.from_numpy(rng.standard_normal(a_shape, np.float32)) for _ in range(R)]
                b = [torch.from_numpy(rng.standard_normal(b_shape, np.float32)) for _ in range(R)]
                op = {"fwd": lambda x, y: x @ y, "dX": lambda x, y: x @ y.t(), "dW": lambda x, y: x.t() @ y}[kind]
                fn = lambda op=op, a=a, b=b: [op(a[i], b[i]) for i in range(R)]        # noqa: E731
                flops = 2 * m * k * n
            fn()
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) / R)
            out[label] = {"s": statistics.median(ts), "flops": flops}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kernels"))
    p.add_argument("--child", choices=("jax", "torch"))
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps((jax_child if a.child == "jax" else torch_child)(a.reps)))
        return
    res = {}
    for fw in ("jax", "torch"):
        cmd = [sys.executable, __file__, "--child", fw, "--reps", str(a.reps)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise SystemExit(f"{fw} child failed: {done.stderr.strip().splitlines()[-1:]}")
        res[fw] = json.loads(done.stdout.strip().splitlines()[-1])
    from jaxformer.report import machine
    import torch
    rows = []
    for label in res["jax"]:
        j, t = res["jax"][label], res["torch"][label]
        rows.append({"case": label, "jax_us": j["s"] * 1e6, "torch_us": t["s"] * 1e6, "flops": j["flops"],
                     "torch_over_jax": t["s"] / j["s"]})
    gem = [r for r in rows if r["flops"] and not r["case"].startswith(("qkv", "decode"))]
    per_layer = {fw: sum(r[f"{fw}_us"] for r in gem if not r["case"].startswith("head")) for fw in ("jax", "torch")}
    summary = {"layer_matmuls_us": per_layer, "ratio": per_layer["torch"] / per_layer["jax"]}
    stem = Path(a.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    mach = f"{machine()}, torch {torch.__version__}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": mach, "reps": a.reps, "rows": rows,
                                                     "summary": summary}, indent=1))
    lines = ["# The train step's kernels alone: XLA:CPU vs PyTorch", "",
             f"`python benchmarks/kernels.py --reps {a.reps}` on {mach}. " + " ".join(__doc__.split("\n\n")[2].split()),
             "", "| case | XLA µs | PyTorch µs | PyTorch / XLA | XLA GFLOP/s | PyTorch GFLOP/s | XLA GB/s | "
             "PyTorch GB/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = (lambda us: f"{r['flops'] / us / 1e3:.0f}") if r["flops"] else (lambda us: "–")
        wb = DECODE.get(r["case"])
        bw = (lambda us: f"{wb[1] * wb[2] * 4 / us / 1e3:.1f}") if wb else (lambda us: "–")
        lines.append(f"| {r['case']} | {r['jax_us']:.0f} | {r['torch_us']:.0f} | {r['torch_over_jax']:.2f}× | "
                     f"{g(r['jax_us'])} | {g(r['torch_us'])} | {bw(r['jax_us'])} | {bw(r['torch_us'])} |")
    lines += ["", "One layer's matmuls (q, k, v, attention out, ffn up and down; fwd + dX + dW, three separate "
              f"projections as the model runs them): XLA {per_layer['jax'] / 1e3:.2f} ms, PyTorch "
              f"{per_layer['torch'] / 1e3:.2f} ms: XLA:CPU takes **{1 / summary['ratio']:.2f}×** PyTorch's time."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
