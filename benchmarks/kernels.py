"""The kernels under the char-model train step, alone: each matmul of one layer (forward, input gradient, weight
gradient) and the attention softmax backward, XLA:CPU (jitted JAX) against PyTorch (eager, oneDNN/MKL), same
shapes, same machine, each framework in its own fresh process.

  .venv/bin/python benchmarks/kernels.py [--reps 7] [--out STEM]

Shapes: the gpt config of benchmarks/train_step.py (B12, T64, D128, N4, H32, F512, V65: M = B·T = 768 rows),
and the FFN matmuls of one decoded token at base size (D512, F2048; M = 1 or 8 rows: weight-read bound, so
GB/s = the weight's bytes / time is also given), the FFN's down projection also with its weight stored [N,K]
(the batch-1 decoding layout of a tall weight).
  fwd    x[M,K] @ w[K,N]                              (a projection)
  dX     g[M,N] @ w[K,N]ᵀ                             (its input gradient)
  dW     x[M,K]ᵀ @ g[M,N]                             (its weight gradient: contracts the M rows of both)
  softmax-bwd  p·(dp − Σ_s p·dp) over [B,N,T,S]       (the attention softmax's backward)
and layout copies (LAYOUT below: a transpose alone, the same in 32×32 tiles, elementwise work alone, and the
elementwise work and the transpose in one fusion).
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
# the same product with the weight stored [N,K] and contracted on its K (the batch-1 decoding layout of a tall
# weight: nn.layout, nn.weights.OutIn); PyTorch: x @ wᵀ (nn.Linear's own layout)
DECODE_T = {"decode b1 ffn down, w [N,K]": (1, 2048, 512), "decode b8 ffn down, w [N,K]": (8, 2048, 512)}


# layout copies (benchmarks/step_profile.py: the steps' "transposes/copies"), each [M,N] float32 -> [N,M]:
#   transpose     x -> xᵀ;
#   ew            where(keep, x·s + 2·y, 0)·1.1, s [M,1]: elementwise work of the kind XLA fuses into the
#                 weight gradient's transposed operand in the base step (the norm's backward and dropout);
#   ew+transpose  the same with its result transposed, in one fusion, as XLA:CPU emits it there.
# Each copy is its own jitted call with one output (dispatch included: ~10 µs against 0.3-20 ms).
#   tiled transpose  x -> xᵀ in 32×32 tiles (`platforms.cpu.transpose`, the weight gradients' form; PyTorch: as
#                 transpose).
LAYOUT = {"[768,128]": (768, 128), "[768,512]": (768, 512), "[1024,2048]": (1024, 2048)}
LAYOUT_KINDS = ("transpose", "tiled transpose", "ew", "ew+transpose")


def _cases():
    for name, (m, k, n) in GEMMS.items():
        for kind in KINDS:
            yield f"{name} {kind}", (kind, m, k, n)
    yield "softmax-bwd", ("softmax", B, N, T)
    for name, (m, k, n) in DECODE.items():
        yield name, ("fwd", m, k, n)
    for name, (m, k, n) in DECODE_T.items():
        yield name, ("fwdT", m, k, n)
    for shape, (m, n) in LAYOUT.items():
        for kind in LAYOUT_KINDS:
            yield f"{kind} {shape}", (kind, m, n, 0)


def _layout_arrays(rng, m: int, n: int, np):
    """R sets of (x, y [M,N], s [M,1], keep bool [M,N]) as numpy arrays."""
    return [(rng.standard_normal((m, n), np.float32), rng.standard_normal((m, n), np.float32),
             rng.standard_normal((m, 1), np.float32), rng.random((m, n)) > 0.1) for _ in range(R)]


def jax_child(reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxformer.platforms import cpu as layout
    out = {}
    rng = np.random.default_rng(0)
    for label, (kind, m, k, n) in _cases():
        if kind in LAYOUT_KINDS:
            sets = [tuple(map(jnp.asarray, a)) for a in _layout_arrays(rng, m, k, np)]
            ew = lambda x, y, s, keep: jnp.where(keep, x * s + 2 * y, 0.0) * 1.1             # noqa: E731
            one = {"transpose": lambda x, y, s, keep: x.T, "tiled transpose": lambda x, y, s, keep: layout.transpose(x),
                   "ew": ew, "ew+transpose": lambda x, y, s, keep: ew(x, y, s, keep).T}[kind]
            # one jitted call per copy, one output each: the form the step's fusions take (one R-output jit lets
            # XLA split the fusion from its transpose, which then runs as a separate copy)
            single = jax.jit(one)
            fn = lambda sets, single=single: [single(*a) for a in sets]                    # noqa: E731
            args, flops = (sets,), 0
        elif kind == "softmax":
            p, dp = ([jnp.asarray(rng.random((m, k, n, n), np.float32)) for _ in range(R)] for _ in range(2))
            fn = jax.jit(lambda p, dp: [a * (b - jnp.sum(a * b, -1, keepdims=True)) for a, b in zip(p, dp)])
            args, flops = (p, dp), 0
        else:
            a_shape, b_shape = {"fwd": ((m, k), (k, n)), "fwdT": ((m, k), (n, k)), "dX": ((m, n), (k, n)),
                                "dW": ((m, k), (m, n))}[kind]
            a = [jnp.asarray(rng.standard_normal(a_shape, np.float32)) for _ in range(R)]
            b = [jnp.asarray(rng.standard_normal(b_shape, np.float32)) for _ in range(R)]
            eq = {"fwd": "mk,kn->mn", "fwdT": "mk,nk->mn", "dX": "mn,kn->mk", "dW": "mk,mn->kn"}[kind]
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
            if kind in LAYOUT_KINDS:
                sets = [tuple(map(torch.from_numpy, a)) for a in _layout_arrays(rng, m, k, np)]
                ew = lambda x, y, s, keep: torch.where(keep, x * s + 2 * y, 0.0) * 1.1     # noqa: E731
                tr = lambda x, y, s, keep: x.t().contiguous()                               # noqa: E731
                one = {"transpose": tr, "tiled transpose": tr, "ew": ew,
                       "ew+transpose": lambda x, y, s, keep: ew(x, y, s, keep).t().contiguous()}[kind]
                fn = lambda one=one, sets=sets: [one(*a) for a in sets]                   # noqa: E731
                flops = 0
            elif kind == "softmax":
                p, dp = ([torch.from_numpy(rng.random((m, k, n, n), np.float32)) for _ in range(R)]
                         for _ in range(2))
                fn = lambda: [p[i] * (dp[i] - (p[i] * dp[i]).sum(-1, keepdim=True)) for i in range(R)]  # noqa: E731
                flops = 0
            else:
                a_shape, b_shape = {"fwd": ((m, k), (k, n)), "fwdT": ((m, k), (n, k)), "dX": ((m, n), (k, n)),
                                    "dW": ((m, k), (m, n))}[kind]
                a = [torch.from_numpy(rng.standard_normal(a_shape, np.float32)) for _ in range(R)]
                b = [torch.from_numpy(rng.standard_normal(b_shape, np.float32)) for _ in range(R)]
                op = {"fwd": lambda x, y: x @ y, "fwdT": lambda x, y: x @ y.t(), "dX": lambda x, y: x @ y.t(),
                      "dW": lambda x, y: x.t() @ y}[kind]
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
    from jaxformer.stats import machine
    import torch
    rows = []
    for label in res["jax"]:
        j, t = res["jax"][label], res["torch"][label]
        rows.append({"case": label, "jax_us": j["s"] * 1e6, "torch_us": t["s"] * 1e6, "flops": j["flops"],
                     "torch_over_jax": t["s"] / j["s"]})
    gem = [r for r in rows if r["flops"] and not r["case"].startswith(("qkv", "decode"))]
    per_layer = {fw: sum(r[f"{fw}_us"] for r in gem if not r["case"].startswith("head")) for fw in ("jax", "torch")}
    by = {r["case"]: r for r in rows}
    # per layout shape: XLA's fused ew+transpose over its ew and its transpose run apart (>1: fusing them loses)
    fused = {shape: by[f"ew+transpose {shape}"]["jax_us"]
             / (by[f"ew {shape}"]["jax_us"] + by[f"transpose {shape}"]["jax_us"]) for shape in LAYOUT}
    summary = {"layer_matmuls_us": per_layer, "ratio": per_layer["torch"] / per_layer["jax"],
               "fused_transpose_over_parts": fused}
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
        if any(r["case"].startswith(f"{kind} [") for kind in LAYOUT_KINDS):
            continue
        g = (lambda us: f"{r['flops'] / us / 1e3:.0f}") if r["flops"] else (lambda us: "–")
        wb = DECODE.get(r["case"]) or DECODE_T.get(r["case"])
        bw = (lambda us: f"{wb[1] * wb[2] * 4 / us / 1e3:.1f}") if wb else (lambda us: "–")
        lines.append(f"| {r['case']} | {r['jax_us']:.0f} | {r['torch_us']:.0f} | {r['torch_over_jax']:.2f}× | "
                     f"{g(r['jax_us'])} | {g(r['torch_us'])} | {bw(r['jax_us'])} | {bw(r['torch_us'])} |")
    lines += ["", "One layer's matmuls (q, k, v, attention out, ffn up and down; fwd + dX + dW, three separate "
              f"projections as the model runs them): XLA {per_layer['jax'] / 1e3:.2f} ms, PyTorch "
              f"{per_layer['torch'] / 1e3:.2f} ms: XLA:CPU takes **{1 / summary['ratio']:.2f}×** PyTorch's time."]
    lines += ["", "## Layout copies", "",
              "Each [M,N] float32 array to [N,M]: transpose alone; ew = where(keep, x·s + 2·y, 0)·1.1 with s [M,1] "
              "(elementwise work of the kind XLA:CPU fuses into a weight gradient's transposed operand in the base "
              "step: the norm's backward, dropout); ew+transpose = its result transposed, one fusion in XLA "
              "(PyTorch: `.t().contiguous()` after it). ns per element of the output.", "",
              "| case | XLA ns/element | PyTorch ns/element | PyTorch / XLA |", "|---|---:|---:|---:|"]
    for shape, (m, n) in LAYOUT.items():
        for kind in LAYOUT_KINDS:
            r = by[f"{kind} {shape}"]
            lines.append(f"| {kind} {shape} | {r['jax_us'] * 1e3 / (m * n):.2f} | {r['torch_us'] * 1e3 / (m * n):.2f} "
                         f"| {r['torch_over_jax']:.2f}× |")
    lines += ["", "XLA:CPU's fused ew+transpose takes " + ", ".join(
        f"**{v:.1f}×** the time of its two parts run apart ({k})" for k, v in fused.items()) + "."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
