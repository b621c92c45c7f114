"""The one prepared GPU script: the suite's GPU lane, the PyTorch peer, our train step's MFU, the lever matrix,
cached decoding against the weight-read floor. One command, about 9 minutes on one H200:

  python benchmarks/gpu.py [--sections lane peer train levers decode [reversal]] [--levers NAME ...]
                           [--batch 8] [--seq 2048] [--remat none] [--peak-tflops X] [--out STEM]
  python benchmarks/gpu.py --dry --out /tmp/gpu     # CPU, tiny shapes: every item's code path (the slow lane)

Each section has a time budget (BUDGETS, seconds; 515 in all); an item that would pass it is skipped and the report
names it. STEM.md and STEM.json (default benchmarks/results/gpu; --dry: a temp folder unless --out) are rewritten
after every item, and everything is printed as it goes, so a run killed at its limit keeps what it measured.

The model (sections peer, train, levers, decode): LM: D2048, 16 heads (head dim 128), F8192 GELU, 18 layers,
V32768 tied, pre-RMSNorm, RoPE, no biases, dropout 0; bf16 compute, float32 parameters and AdamW state (the
repo's policy); B×T = 8×2048 random tokens.
  model FLOPs per token = 6·N + 12·L·H·Q·T  (PaLM, appendix B: N parameters, the tied embedding once (its head
    matmul is work, its lookup is not); L layers, H heads, Q head dim, T sequence length; like PaLM, the attention
    term counts the full T×T matmuls, forward and backward, though causal attention needs half); the same for the
    peer; tokens/s = B·T·steps / s; MFU = FLOPs per token · tokens/s / the dense bf16 peak by device_kind (H100 SXM /
    H200 989 TFLOP/s, H100 PCIe 756, A100 312) or --peak-tflops; none known (CPU): n/a.
1. lane: `pytest -m gpu` (tests/test_gpu_lane.py and the cuDNN cases) in a child process, its per-test log
   ($JAXFORMER_TEST_LOG) copied into the results (dry: one Pallas case).
2. peer: benchmarks/torch_peer.py in a child process, before this process allocates GPU memory (JAX's
   preallocation is off here, so PyTorch has the GPU to itself): train eager and torch.compile (autocast bf16,
   fused AdamW), decoding (bf16 weights, static cache) eager and compiled at batch 1 and 64.
3. train: attention the first of ("cudnn", "chunked") that `ops.fused.problem(backend, dtype)` accepts and whose
   step compiles and runs; remat --remat (an out-of-memory first step is retried with "dots"); compiled ahead of
   time (XLA's memory analysis: arguments + temporaries); --warmup steps, then --reps repetitions of --steps steps
   dispatched back to back, blocked at the end of each.
4. levers: benchmarks/gpu_levers.py: each lever A/B'd against the train step in paired blocks.
5. decode: `decode.generate_lm` (one compiled program: prefill + while_loop of cached steps), bf16 weights, 128
   random prompt tokens, 256 new, greedy, batch 1 and 64, attention --decode-backend. Floor: (weight bytes + the
   mean KV-cache bytes a step reads) / the read bandwidth measured here (a jitted sum over a 2 GiB array).
6. reversal (only when named): configs/reverse.py's train step under its Plan, float32 then bf16.
Values: median and min–max over repetitions.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import dataclasses
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # the peer child gets the GPU's memory

import flax  # noqa: E402  (after the path above: the repo's package, installed or not)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, replaced  # noqa: E402
from jaxformer.configio import apply_overrides, load_config_file  # noqa: E402
from jaxformer.data import resolve  # noqa: E402
from jaxformer.decode import generate_lm  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402
from jaxformer.ops.attention import BACKENDS  # noqa: E402
from jaxformer.ops.fused import problem  # noqa: E402
from jaxformer.parallel import Plan  # noqa: E402
from jaxformer.stats import machine  # noqa: E402
from jaxformer.train.step import abstract_state, init_state, make_train_step  # noqa: E402

import gpu_levers  # noqa: E402
import gpu_report  # noqa: E402

PEAKS = (("H100 PCIe", 756.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))   # dense bf16 TFLOP/s
PREFERRED = ("cudnn", "chunked")
SECTIONS = ("lane", "peer", "train", "levers", "decode")                    # the default run, in this order
BUDGETS = dict(lane=120, peer=110, train=45, levers=200, decode=40, reversal=60)      # seconds; 515 by default
FULL = dict(d_model=2048, num_heads=16, d_ff=8192, layers=18, vocab=32768, seq=2048, batch=8, steps=10, reps=5,
            warmup=2, lever_steps=5, lever_reps=3, prompt=128, new=256, decode_batches=(1, 64), rev_steps=200,
            rev_batches=16, rev_dtypes=("float32", "bfloat16"), bandwidth_gib=2.0,
            lane=["tests/test_gpu_lane.py", "tests/test_attention_backends.py", "tests/test_attention_inputs.py"])
DRY = dict(d_model=64, num_heads=4, d_ff=256, layers=2, vocab=256, seq=64, batch=2, steps=2, reps=2, warmup=1,
           lever_steps=1, lever_reps=2, prompt=8, new=8, decode_batches=(1, 2), rev_steps=2, rev_batches=2,
           rev_dtypes=("float32",), bandwidth_gib=1 / 64,
           lane=["tests/test_gpu_lane.py", "-k", "gqa_mqa and pallas"])          # dry: one Pallas case
INT_ARGS = {"batch": "train rows (default 8)", "seq": "train sequence length (2048)", "steps": "train steps per "
            "repetition (10)", "reps": "repetitions of each measurement (5)", "warmup": "train warm-up steps (2)"}
FORMULAS = {"model_flops_per_token": "6·N + 12·L·H·Q·T (PaLM appendix B; N parameters, L layers, H heads, "
                                     "Q head dim, T sequence length; here H·Q = D)",
            "tokens_per_s": "B·T·steps / seconds", "mfu": "(FLOPs per token · tokens/s) / dense bf16 peak",
            "decode_tokens_per_s": "B·new / seconds of one generate_lm call (prefill included)",
            "decode_floor_ms": "(weight bytes + mean KV-cache bytes read per step) / measured read bandwidth",
            "reversal_tokens_per_s": "non-pad target tokens / seconds"}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Budget:
    """A section's time budget: `room(next_s)` is False once elapsed + next_s would pass it."""

    def __init__(self, seconds: float):
        self.seconds, self.t0, self.notes = seconds, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def room(self, next_s: float = 0.0) -> bool:
        return self.elapsed() + next_s <= self.seconds

    def skip(self, what: str) -> None:
        self.notes.append(f"{what} skipped: {self.elapsed():.0f} s of the {self.seconds:.0f} s budget spent")
        print("  " + self.notes[-1], flush=True)

    def repeat(self, fn, reps: int, what: str) -> list[float]:
        """Seconds of up to `reps` calls of fn() (each blocks at its end), fewer when one more would not fit."""
        ts = []
        for r in range(reps):
            if ts and not self.room(ts[-1]):
                self.skip(f"{what}: repetitions {r + 1}-{reps} of {reps}")
                break
            ts.append(timed(fn))
        return ts

    def parts(self, items, what: str):
        """Yield the items in turn, skipping those that would pass the budget if as long as the last one run."""
        last = 0.0
        for x in items:
            if not self.room(last):
                self.skip(f"{what} {x}")
                continue
            t = time.perf_counter()
            yield x
            last = time.perf_counter() - t


class Stepper:
    """stepper(n): n train steps dispatched back to back, then one block; holds the donated state between calls."""

    def __init__(self, step, state, args):
        self.step, self.state, self.args, self.metrics = step, state, args, None

    def __call__(self, n: int) -> None:
        st, self.state = self.state, None
        for i in range(n):
            st, self.metrics = self.step(st, *self.args(i))
        self.state = jax.block_until_ready(st)


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"


def peak_tflops(a) -> tuple[float | None, str]:
    kind = jax.devices()[0].device_kind
    key, v = next(((k, v) for k, v in PEAKS if k in kind), (None, None))
    return ((a.peak_tflops, "--peak-tflops") if a.peak_tflops else (v, f"table: device_kind {kind!r} contains "
            f"{key!r}") if v else (None, f"no peak known for device_kind {kind!r} (pass --peak-tflops)"))


def peak_memory_gb() -> float | None:
    st = jax.devices()[0].memory_stats() or {}
    return st["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in st else None


def lm_config(s: dict, backend: str, remat: str, **model) -> Config:
    """The benchmark's LM (module docstring) with attention `backend`, `remat`, and any further model overrides
    (`replaced` keywords, e.g. runtime__remat)."""
    kw = dict(arch="decoder_only", vocab_size=s["vocab"], d_model=s["d_model"], num_heads=s["num_heads"],
              d_ff=s["d_ff"], num_decoder_layers=s["layers"], max_len=max(s["seq"], s["prompt"] + s["new"]),
              runtime__dropout=0.0, norm__position="pre", norm__type="rmsnorm", positional="rope",
              activation="gelu", use_bias=False, tie_embeddings=True, scale_embeddings=False,
              runtime__dtype="bfloat16", runtime__attention_backend=backend, runtime__remat=remat)
    data = DataConfig(task="text", path="builtin:alice", block_size=s["seq"], batch_size=s["batch"])   # shapes only
    return Config(model=replaced(ModelConfig(), **(kw | model)), data=data,
                  optim=OptimConfig(lr=1e-4, schedule="constant", warmup_steps=0), train=TrainConfig(best_metric="loss"))


def memory_gb(compiled) -> float | None:
    """XLA's memory analysis of a compiled program: arguments + temporaries, GiB (None where not reported)."""
    m = compiled.memory_analysis()
    return None if m is None else (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2 ** 30


def build_stepper(s: dict, opts: dict, rows: int):
    """A compiled train step of the LM (opts: backend, remat, more model overrides) over `rows` random rows,
    its first step run. -> (Stepper, {compile_s, memory_gb, params, model})."""
    opts = dict(opts)
    cfg = lm_config(s | {"batch": rows}, opts.pop("backend"), opts.pop("remat"), **opts)
    tokens = jax.random.randint(jax.random.key(1), (rows, s["seq"] + 1), 1, s["vocab"], jnp.int32)
    batch, rng = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, jax.random.key(0)   # dropout 0: rng unused
    graphs, state = init_state(cfg)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["model"]))
    t0 = time.perf_counter()
    compiled = make_train_step(graphs, cfg).lower(state, batch, rng).compile()
    compile_s = time.perf_counter() - t0
    run = Stepper(compiled, state, lambda i: (batch, rng))
    del state
    run(1)
    return run, {"compile_s": compile_s, "memory_gb": memory_gb(compiled), "params": n_params,
                 "model": dataclasses.asdict(cfg.model)}


def bench_train(s: dict, a, budget: Budget, rec: dict, live: dict) -> dict:
    """Backends in order of preference, `problem` deciding which can run here; the first that runs is reported
    (and kept in `live` as the levers' baseline)."""
    passed = {b: why for b in PREFERRED if (why := problem(b, dtype=jnp.bfloat16))}
    out = {"passed_over": passed, "errors": {}}
    for backend in (b for b in PREFERRED if b not in passed):
        remat = a.remat
        while budget.room():
            try:
                return out | train_once(s, a, backend, remat, budget, live)
            except Exception as e:  # noqa: BLE001  a backend that fails to compile or run: recorded, next one tried
                out["errors"][f"{backend}, remat {remat}"] = short(e)
                print(f"  {backend} remat={remat} failed: {short(e)}", flush=True)
                oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
                if not (oom and remat == "none"):
                    break
                remat = "dots"
    return out | {"error": "no attention backend ran; see errors"}


def train_once(s: dict, a, backend: str, remat: str, budget: Budget, live: dict) -> dict:
    print(f"  train: backend {backend}, remat {remat}", flush=True)
    run, info = build_stepper(s, {"backend": backend, "remat": remat}, s["batch"])
    run(s["warmup"] - 1)
    ts = budget.repeat(lambda: run(s["steps"]), s["reps"], "train")
    live["train"] = run
    b, t, n_params = s["batch"], s["seq"], info["params"]
    per_token = 6 * n_params + 12 * s["layers"] * s["d_model"] * t            # H·Q = D
    tok_s = [b * t * s["steps"] / x for x in ts]
    peak, peak_src = peak_tflops(a)
    tflops = [per_token * v / 1e12 for v in tok_s]
    return info | {"backend": backend, "remat": remat, "batch": b, "seq": t, "steps_per_rep": s["steps"],
                   "warmup_steps": s["warmup"], "flops_per_token": per_token,
                   "s_per_step": stats([x / s["steps"] for x in ts]), "tokens_per_s": stats(tok_s),
                   "model_tflops": stats(tflops), "peak_tflops": peak, "peak_source": peak_src,
                   "mfu": stats([x / peak for x in tflops]) if peak else None,
                   "final_loss": float(run.metrics["loss"]), "peak_memory_gb": peak_memory_gb()}


def read_bandwidth_gbs(gib: float) -> float:
    """GB/s of a jitted sum over a bfloat16 array of `gib` GiB (one read of it), the best of 5 after a warm-up."""
    x = jnp.ones((int(gib * 2 ** 30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a.sum(dtype=jnp.float32))
    f(x).block_until_ready()
    return x.nbytes / min(timed(lambda: f(x).block_until_ready()) for _ in range(5)) / 1e9


def bench_decode(s: dict, a, budget: Budget, rec: dict, live: dict) -> dict:
    trained = rec["sections"].get("train", {}).get("backend") or PREFERRED[-1]
    backend = trained if a.decode_backend == "train" else a.decode_backend
    live.pop("train", None)                                                  # the train state's memory back
    mcfg = lm_config(s, backend, "none").model
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(mcfg)))
    bf16 = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x   # noqa: E731
    model = nnx.merge(graphdef, jax.jit(lambda: jax.tree.map(bf16, nnx.state(build_model(mcfg))))())
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    bw = read_bandwidth_gbs(s["bandwidth_gib"])
    out = {"backend": backend, "prompt": s["prompt"], "new": s["new"], "weights": "bfloat16",
           "weight_bytes": weight_bytes, "read_gb_per_s": bw, "batches": {}}
    for bsz in budget.parts(s["decode_batches"], "decode batch"):
        prompts = jax.random.randint(jax.random.key(bsz), (bsz, s["prompt"]), 1, s["vocab"], jnp.int32)
        call = lambda: jax.block_until_ready(generate_lm(model, prompts, max_new=s["new"]))   # noqa: E731
        r = out["batches"][str(bsz)] = {}
        r["compile_s"] = timed(lambda: r.update(generated_shape=list(call().shape)))
        ts = budget.repeat(call, s["reps"], f"decode batch {bsz}")
        kv = 2 * s["layers"] * bsz * (s["prompt"] + s["new"] / 2) * s["d_model"] * 2    # mean bf16 K+V read
        r.update(seconds=stats(ts), tokens_per_s=stats([bsz * s["new"] / x for x in ts]),
                 ms_per_step=stats([1e3 * x / s["new"] for x in ts]), floor_ms=1e3 * (weight_bytes + kv) / bw / 1e9)
    out["peak_memory_gb"] = peak_memory_gb()
    return out


def bench_lane(s: dict, a, budget: Budget, rec: dict, live: dict) -> dict:
    """`pytest -m gpu` over the lane's files in a child process, cut at the section's budget; its log read back."""
    log = Path(tempfile.mkdtemp()) / "lane.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *s["lane"]]
    env = dict(os.environ, JAXFORMER_TEST_LOG=str(log))
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget.seconds)
        rc, tail = p.returncode, (p.stdout + p.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"cut at the section's budget, {budget.seconds:.0f} s"]
    lines = log.read_text().splitlines() if log.is_file() else []
    counts = {k: sum(1 for x in lines if x.startswith(k)) for k in ("passed", "failed", "skipped")}
    for x in lines:
        if x.startswith("failed"):
            print("  " + x, flush=True)
    return {"command": shlex.join(cmd[1:]), "returncode": rc, "counts": counts, "log": lines, "tail": tail}


def bench_peer(s: dict, a, budget: Budget, rec: dict, live: dict) -> dict:
    """benchmarks/torch_peer.py in a child process (its JSON read back, also when cut at the budget)."""
    res = Path(tempfile.mkdtemp()) / "peer.json"
    keys = ("d_model", "num_heads", "d_ff", "layers", "vocab", "seq", "batch", "steps", "reps", "warmup", "prompt",
            "new", "decode_batches")
    cmd = [sys.executable, str(ROOT / "benchmarks/torch_peer.py"), "--settings", json.dumps({k: s[k] for k in keys}),
           "--out", str(res), "--budget", str(budget.seconds - 15)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget.seconds + 30)
        err = None if p.returncode == 0 else (p.stdout + p.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        err = ["cut at the section's budget"]
    out = json.loads(res.read_text()) if res.is_file() else {"items": {}}
    peak, _ = peak_tflops(a)
    for name, r in out["items"].items():
        if "seconds" not in r or not r["seconds"]:
            continue
        if name.startswith("train"):
            tok = [s["batch"] * s["seq"] * s["steps"] / x for x in r["seconds"]]
            per_token = 6 * r["params"] + 12 * s["layers"] * s["d_model"] * s["seq"]
            r.update(tokens_per_s=stats(tok), mfu=stats([per_token * v / 1e12 / peak for v in tok]) if peak else None)
        else:
            r.update(tokens_per_s=stats([r["batch"] * s["new"] / x for x in r["seconds"]]),
                     ms_per_step=stats([1e3 * x / s["new"] for x in r["seconds"]]))
    return out | ({"error": " ".join(err)} if err else {})


def bench_reversal(s: dict, a, budget: Budget, rec: dict, live: dict) -> dict:
    cfg = apply_overrides(load_config_file(ROOT / "configs/reverse.py"), [])  # as `jaxformer train configs/reverse.py`
    cfg, task = resolve(cfg)
    plan, rows = Plan(cfg.parallel), cfg.data.batch_size
    it = iter(task.train_dataset(rows, cfg.train.seed, plan.local_rows(rows)))
    host = [next(it) for _ in range(s["rev_batches"])]
    n, counts = s["rev_steps"], [int((h["tgt_out"] != cfg.model.pad_id).sum()) for h in host]
    tokens = sum(counts[i % len(host)] for i in range(n))                     # target tokens per repetition
    out = {"config": "configs/reverse.py", "model": dataclasses.asdict(cfg.model), "batch": rows,
           "shapes": {k: list(v.shape) for k, v in host[0].items()}, "steps_per_rep": n,
           "distinct_batches": len(host), "target_tokens_per_rep": tokens, "variants": {}}
    state = None
    for dtype in budget.parts(s["rev_dtypes"], "reversal"):
        c = dataclasses.replace(cfg, model=replaced(cfg.model, runtime__dtype=dtype))
        with plan.use():
            batches = [plan.global_batch(h, rows) for h in host]
            keys = list(jax.random.split(jax.random.key(c.train.seed), len(host)))
            graphs, state = init_state(c, plan) if state is None else (abstract_state(c, plan)[0], state)
            run = Stepper(make_train_step(graphs, c, plan), state, lambda i: (batches[i % len(host)],
                                                                              keys[i % len(host)]))
            compile_s = timed(lambda: run(1))
            run(min(n, 10))
            ts = budget.repeat(lambda: run(n), s["reps"], f"reversal {dtype}")
            state = run.state
        out["variants"][dtype] = {"compile_s": compile_s, "ms_per_step": stats([1e3 * x / n for x in ts]),
                                  "tokens_per_s": stats([tokens / x for x in ts])}
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU smoke run: tiny shapes, same code paths")
    p.add_argument("--out", help="path stem of .md and .json (default benchmarks/results/gpu; --dry: a temp dir)")
    p.add_argument("--sections", nargs="+", choices=(*SECTIONS, "reversal"), default=list(SECTIONS))
    p.add_argument("--levers", nargs="+", choices=tuple(gpu_levers.ITEMS), help="only these lever items")
    for k in INT_ARGS:
        p.add_argument(f"--{k}", type=int, help=INT_ARGS[k])
    p.add_argument("--remat", choices=("none", "dots", "dots_attention", "full"), default="none")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak, if not in the table")
    p.add_argument("--decode-backend", choices=(*BACKENDS, "train"), default="reference")
    a = p.parse_args(argv)
    if a.dry:                  # CPU (a no-op if this process already started its JAX backends)
        jax.config.update("jax_platforms", "cpu")
    s = (DRY if a.dry else FULL) | {k: getattr(a, k) for k in INT_ARGS if getattr(a, k)}
    stem = Path(a.out) if a.out else (Path(tempfile.mkdtemp()) / "gpu" if a.dry else ROOT / "benchmarks/results/gpu")
    dev = jax.devices()[0]        # no memory preallocated (module top): the child processes still have the GPU
    rec = {"machine": {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                       "flax": flax.__version__, "summary": machine()},
           "command": shlex.join(["python", "benchmarks/gpu.py", *argv]), "dry": a.dry, "settings": s,
           "formulas": FORMULAS, "budgets": BUDGETS, "sections": {}, "wall_s": 0.0}
    t_all = time.perf_counter()
    live = {"write": lambda: gpu_report.write(stem, rec | {"wall_s": time.perf_counter() - t_all})}
    fns = dict(lane=bench_lane, peer=bench_peer, train=bench_train, levers=lambda *x: gpu_levers.bench_levers(
        *x, build_stepper), decode=bench_decode, reversal=bench_reversal)
    budgets = {k: v * (4 if a.dry else 1) for k, v in BUDGETS.items()}   # dry: every item, on a slow CPU too
    for name in (n for n in (*SECTIONS, "reversal") if n in a.sections):
        print(f"[{name}]", flush=True)
        budget = Budget(budgets[name])
        try:
            res = fns[name](s, a, budget, rec, live)
        except Exception as e:  # noqa: BLE001  one failed section must not lose the others
            res = {"error": short(e)}
            print(f"  {name} failed: {short(e)}", flush=True)
        rec["sections"][name] = res | {"notes": budget.notes, "section_s": budget.elapsed()}
        rec["wall_s"] = time.perf_counter() - t_all
        live["write"]()                                                     # partial results survive a kill
    print(stem.with_name(stem.name + ".md").read_text())
    return rec


if __name__ == "__main__":
    main()
