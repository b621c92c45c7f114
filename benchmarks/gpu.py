"""One-shot GPU benchmark: MFU of a ~1B-parameter decoder-only LM, its cached decoding, the reversal main job.

  python benchmarks/gpu.py [--batch 8] [--seq 2048] [--remat none] [--peak-tflops X] [--out STEM]
  python benchmarks/gpu.py --dry --out /tmp/gpu     # CPU, tiny shapes, seconds: the same code paths

1. train (MFU). LM: D2048, 16 heads (head dim 128), F8192 GELU, 18 layers, V32768 tied, pre-RMSNorm, RoPE, no
   biases, dropout 0; bf16 compute, float32 parameters and AdamW state (the repo's policy); B×T = 8×2048 random
   tokens; remat --remat (default "none": ~50 GB estimated of the H200's 141; an out-of-memory first step is
   retried with "dots"). Attention: the first of ("cudnn", "chunked") that `ops.fused.problem(backend, dtype)`
   accepts and whose step compiles and runs (failures are reported). --warmup steps (the first compiles), then
   --reps repetitions of --steps steps, dispatched asynchronously and blocked only at the end of each.
     model FLOPs per token = 6·N + 12·L·H·Q·T  (PaLM, appendix B: N parameters, the tied embedding once (its
       head matmul is work, its lookup is not); L layers, H heads, Q head dim, T sequence length; like PaLM, the
       attention term counts the full T×T matmuls, forward and backward, though causal attention needs half)
     tokens/s = B·T·steps / s;  MFU = FLOPs per token · tokens/s / peak, the dense bf16 peak by device_kind
       (H100 SXM / H200 989 TFLOP/s, H100 PCIe 756, A100 312) or --peak-tflops; none known (CPU): n/a.
2. decode. The same model under `decode.generate_lm` (one compiled program: prefill + while_loop of cached
   steps): 128 random prompt tokens, 256 new, greedy, no EOS, batch 1 and 64; attention --decode-backend,
   default "reference" (it reads the KV cache in place; the others concatenate it with the new key each step).
   A warm-up call (compiles), then --reps calls: tokens/s = B·new / s, ms/step = s / new (prefill included).
3. reversal. configs/reverse.py loaded as the CLI does, its `init_state` / `make_train_step` under its Plan, over
   real batches and dropout keys drawn before timing (the loop's data, logging, eval are not timed): target
   tokens/s = non-pad target tokens / s, as the training log counts them; float32, then bf16 (model.runtime.dtype only).
Each section has a time budget; what would pass it is skipped, and the report says so. Values: median and
min–max over repetitions. STEM.md and STEM.json (default benchmarks/results/gpu; --dry: a temp folder unless
--out) are rewritten after each section.
"""
from __future__ import annotations

import argparse
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
from jaxformer.report import machine  # noqa: E402
from jaxformer.train.step import abstract_state, init_state, make_train_step  # noqa: E402

PEAKS = (("H100 PCIe", 756.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))   # dense bf16 TFLOP/s
PREFERRED = ("cudnn", "chunked")
FULL = dict(d_model=2048, num_heads=16, d_ff=8192, layers=18, vocab=32768, seq=2048, batch=8, steps=10, reps=5,
            warmup=2, prompt=128, new=256, decode_batches=(1, 64), rev_steps=200, rev_batches=16,
            rev_dtypes=("float32", "bfloat16"), budgets=dict(train=210, decode=120, reversal=60))
DRY = dict(d_model=64, num_heads=4, d_ff=256, layers=2, vocab=256, seq=64, batch=2, steps=2, reps=2, warmup=1,
           prompt=8, new=8, decode_batches=(1, 2), rev_steps=2, rev_batches=2, rev_dtypes=("float32",),
           budgets=FULL["budgets"])      # dry: the reversal step in float32 only (its compile is most of the time)
INT_ARGS = {"batch": "train rows (default 8)", "seq": "train sequence length (2048)", "steps": "train steps per "
            "repetition (10)", "reps": "repetitions of each measurement (5)", "warmup": "train warm-up steps (2)"}
FORMULAS = {"model_flops_per_token": "6·N + 12·L·H·Q·T (PaLM appendix B; N parameters, L layers, H heads, "
                                     "Q head dim, T sequence length; here H·Q = D)",
            "tokens_per_s": "B·T·steps / seconds", "mfu": "(FLOPs per token · tokens/s) / dense bf16 peak",
            "decode_tokens_per_s": "B·new / seconds of one generate_lm call (prefill included)",
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


def lm_config(s: dict, backend: str, remat: str) -> Config:
    model = replaced(ModelConfig(), arch="decoder_only", vocab_size=s["vocab"], d_model=s["d_model"],
                     num_heads=s["num_heads"],
                        d_ff=s["d_ff"], num_decoder_layers=s["layers"], max_len=max(s["seq"], s["prompt"] + s["new"]),
                        runtime__dropout=0.0, norm__position="pre", norm__type="rmsnorm", positional="rope",
                        activation="gelu",
                        use_bias=False, tie_embeddings=True, scale_embeddings=False, runtime__dtype="bfloat16",
                        runtime__attention_backend=backend, runtime__remat=remat)
    data = DataConfig(task="text", path="builtin:alice", block_size=s["seq"], batch_size=s["batch"])   # shapes only
    return Config(model=model, data=data, optim=OptimConfig(lr=1e-4, schedule="constant", warmup_steps=0),
                  train=TrainConfig(best_metric="loss"))


def peak_tflops(a) -> tuple[float | None, str]:
    kind = jax.devices()[0].device_kind
    key, v = next(((k, v) for k, v in PEAKS if k in kind), (None, None))
    return ((a.peak_tflops, "--peak-tflops") if a.peak_tflops else (v, f"table: device_kind {kind!r} contains "
            f"{key!r}") if v else (None, f"no peak known for device_kind {kind!r} (pass --peak-tflops)"))


def peak_memory_gb() -> float | None:
    st = jax.devices()[0].memory_stats() or {}
    return st["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in st else None


def bench_train(s: dict, a, budget: Budget, rec: dict) -> dict:
    """Backends in order of preference, `problem` deciding which can run here; the first that runs is reported."""
    passed = {b: why for b in PREFERRED if (why := problem(b, dtype=jnp.bfloat16))}
    out = {"passed_over": passed, "errors": {}}
    for backend in (b for b in PREFERRED if b not in passed):
        remat = a.remat
        while budget.room():
            try:
                return out | train_once(s, a, backend, remat, budget)
            except Exception as e:  # noqa: BLE001  a backend that fails to compile or run: recorded, next one tried
                out["errors"][f"{backend}, remat {remat}"] = short(e)
                print(f"  {backend} remat={remat} failed: {short(e)}", flush=True)
                oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
                if not (oom and remat == "none"):
                    break
                remat = "dots"
    return out | {"error": "no attention backend ran; see errors"}


def train_once(s: dict, a, backend: str, remat: str, budget: Budget) -> dict:
    cfg = lm_config(s, backend, remat)
    abstract = nnx.eval_shape(lambda: build_model(cfg.model))                # shapes only, nothing allocated
    n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    print(f"  train: backend {backend}, remat {remat}, {n_params:,} parameters", flush=True)
    b, t = s["batch"], s["seq"]
    tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 1, s["vocab"], jnp.int32)
    batch, rng = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, jax.random.key(0)   # dropout 0: rng unused
    graphs, state = init_state(cfg)
    run = Stepper(make_train_step(graphs, cfg), state, lambda i: (batch, rng))
    del state
    compile_s = timed(lambda: run(1))
    run(s["warmup"] - 1)
    ts = budget.repeat(lambda: run(s["steps"]), s["reps"], "train")
    loss = float(run.metrics["loss"])
    per_token = 6 * n_params + 12 * s["layers"] * s["d_model"] * t            # H·Q = D
    tok_s = [b * t * s["steps"] / x for x in ts]
    peak, peak_src = peak_tflops(a)
    tflops = [per_token * v / 1e12 for v in tok_s]
    return {"backend": backend, "remat": remat, "params": n_params, "model": dataclasses.asdict(cfg.model),
            "batch": b, "seq": t, "steps_per_rep": s["steps"], "warmup_steps": s["warmup"], "compile_s": compile_s,
            "flops_per_token": per_token, "s_per_step": stats([x / s["steps"] for x in ts]),
            "tokens_per_s": stats(tok_s), "model_tflops": stats(tflops), "peak_tflops": peak, "peak_source": peak_src,
            "mfu": stats([x / peak for x in tflops]) if peak else None, "final_loss": loss,
            "peak_memory_gb": peak_memory_gb()}


def bench_decode(s: dict, a, budget: Budget, rec: dict) -> dict:
    trained = rec["sections"]["train"].get("backend") or PREFERRED[-1]
    backend = trained if a.decode_backend == "train" else a.decode_backend
    mcfg = lm_config(s, backend, "none").model
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(mcfg)))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.state(build_model(mcfg)))())     # one jitted init
    out = {"backend": backend, "prompt": s["prompt"], "new": s["new"], "batches": {}}
    for bsz in budget.parts(s["decode_batches"], "decode batch"):
        prompts = jax.random.randint(jax.random.key(bsz), (bsz, s["prompt"]), 1, s["vocab"], jnp.int32)
        call = lambda: jax.block_until_ready(generate_lm(model, prompts, max_new=s["new"]))   # noqa: E731
        r = out["batches"][str(bsz)] = {}
        r["compile_s"] = timed(lambda: r.update(generated_shape=list(call().shape)))
        ts = budget.repeat(call, s["reps"], f"decode batch {bsz}")
        r.update(seconds=stats(ts), tokens_per_s=stats([bsz * s["new"] / x for x in ts]),
                 ms_per_step=stats([1e3 * x / s["new"] for x in ts]))
    out["peak_memory_gb"] = peak_memory_gb()
    return out


def bench_reversal(s: dict, a, budget: Budget, rec: dict) -> dict:
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


def fmt(st: dict | None, f: str = ",.0f") -> str:
    g = lambda v: format(v, f)                                                # noqa: E731
    return f"{g(st['median'])} ({g(st['min'])}–{g(st['max'])}, n={st['n']})" if st else "n/a"


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                           for r in rows]


def _flat_model(mo: dict) -> dict:
    """A recorded model config as flat keys: sectioned (model.norm.position, ...) or as results before the
    sections recorded it (norm_position, ...)."""
    from jaxformer.config import SECTIONED
    if "norm" not in mo:
        return mo
    flat = {k: v for k, v in mo.items() if not isinstance(v, dict)}
    for old, new in SECTIONED.items():
        section, field = new.split(".")
        flat[old] = mo[section][field]
    return flat


def write(stem: Path, rec: dict) -> None:
    m, S = rec["machine"], rec["sections"]
    tr, de, rv = (S.get(k, {}) for k in ("train", "decode", "reversal"))
    L = ["# GPU benchmark: train MFU (~1B LM), cached decoding, reversal main job" + " (DRY RUN)" * rec["dry"], "",
         f"Machine: {m['device_kind']} ({m['platform']}); {m['summary']}", "", f"Command: `{rec['command']}`", "",
         *[f"- {k}: {v}" for k, v in FORMULAS.items()], "", "Values: median (min–max, n = repetitions)."]
    if "backend" in tr:
        mo, mem = _flat_model(tr["model"]), tr["peak_memory_gb"]
        L += ["", "## 1. Train step, MFU", "",
              f"Model: decoder-only, {tr['params']:,} parameters (nnx.eval_shape), D{mo['d_model']}, {mo['num_heads']} "
              f"heads, F{mo['d_ff']} {mo['activation']}, {mo['num_decoder_layers']} layers, V{mo['vocab_size']} tied, "
              f"{mo['norm_position']}-{mo['norm_type']}, {mo['positional']}, dtype {mo['dtype']} (params float32), "
              f"remat {tr['remat']}; B×T = {tr['batch']}×{tr['seq']}; {tr['warmup_steps']} warm-up steps, then "
              f"repetitions of {tr['steps_per_rep']} steps.", "", f"Attention backend: **{tr['backend']}**"
              + "".join(f"; passed over {b}: {w}" for b, w in tr["passed_over"].items()), "",
              *table(["tokens/s", "s/step", "model TFLOP/s", "MFU", "peak TFLOP/s", "compile s", "peak mem GB", "loss"],
                     [[fmt(tr["tokens_per_s"]), fmt(tr["s_per_step"], ".4f"), fmt(tr["model_tflops"], ".3g"),
                       fmt(tr["mfu"], ".1%"), tr["peak_tflops"] or "n/a", f"{tr['compile_s']:.1f}",
                       "n/a" if mem is None else f"{mem:.1f}", f"{tr['final_loss']:.3f}"]]),
              "", f"FLOPs per token: {tr['flops_per_token']:,}; peak: {tr['peak_source']}."]
    if "batches" in de:
        L += ["", "## 2. Cached decoding (generate_lm, greedy)", "", f"Same model, attention backend "
              f"**{de['backend']}**, prompt {de['prompt']} tokens, {de['new']} new tokens.", "",
              *table(["batch", "tokens/s", "ms/step", "compile s"],
                     [[b, fmt(r["tokens_per_s"]), fmt(r["ms_per_step"], ".2f"), f"{r['compile_s']:.1f}"]
                      for b, r in de["batches"].items()])]
    if "variants" in rv:
        L += ["", "## 3. Reversal main job (configs/reverse.py)", "", f"Batch {rv['batch']}, shapes {rv['shapes']}, "
              f"{rv['steps_per_rep']} steps per repetition cycling {rv['distinct_batches']} real batches "
              f"({rv['target_tokens_per_rep']:,} target tokens).", "",
              *table(["dtype", "target tokens/s", "ms/step", "compile s"],
                     [[d, fmt(r["tokens_per_s"]), fmt(r["ms_per_step"], ".3f"), f"{r['compile_s']:.1f}"]
                      for d, r in rv["variants"].items()])]
    notes = [f"- {k}: {n}" for k, sec in S.items() for n in sec.get("notes", [])] + [
        f"- {k} error ({w}): {v}" for k, sec in S.items() for w, v in sec.get("errors", {}).items()] + [
        f"- {k} FAILED: {sec['error']}" for k, sec in S.items() if "error" in sec]
    L += ["", "## Notes", "", *(notes or ["- every section ran all its repetitions"]), "", f"Wall time: "
          f"{rec['wall_s']:.0f} s (sections: " + ", ".join(f"{k} {v['section_s']:.0f} s" for k, v in S.items()) + ")."]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".md").write_text("\n".join(L) + "\n")
    stem.with_name(stem.name + ".json").write_text(json.dumps(rec, indent=1, default=str) + "\n")


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU smoke run: tiny shapes, same code paths")
    p.add_argument("--out", help="path stem of .md and .json (default benchmarks/results/gpu; --dry: a temp dir)")
    for k in INT_ARGS:
        p.add_argument(f"--{k}", type=int, help=INT_ARGS[k])
    p.add_argument("--remat", choices=("none", "dots", "full"), default="none")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak, if not in the table")
    p.add_argument("--decode-backend", choices=(*BACKENDS, "train"), default="reference")
    a = p.parse_args(argv)
    if a.dry:                  # CPU (a no-op if this process already started its JAX backends)
        jax.config.update("jax_platforms", "cpu")
    s = (DRY if a.dry else FULL) | {k: getattr(a, k) for k in INT_ARGS if getattr(a, k)}
    stem = Path(a.out) if a.out else (Path(tempfile.mkdtemp()) / "gpu" if a.dry else ROOT / "benchmarks/results/gpu")
    dev = jax.devices()[0]
    rec = {"machine": {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                       "flax": flax.__version__, "summary": machine()},
           "command": shlex.join(["python", "benchmarks/gpu.py", *argv]), "dry": a.dry, "settings": s,
           "formulas": FORMULAS, "sections": {}, "wall_s": 0.0}
    t_all = time.perf_counter()
    for name, fn in (("train", bench_train), ("decode", bench_decode), ("reversal", bench_reversal)):
        print(f"[{name}]", flush=True)
        budget = Budget(s["budgets"][name])
        try:
            res = fn(s, a, budget, rec)
        except Exception as e:  # noqa: BLE001  one failed section must not lose the others
            res = {"error": short(e)}
            print(f"  {name} failed: {short(e)}", flush=True)
        rec["sections"][name] = res | {"notes": budget.notes, "section_s": budget.elapsed()}
        rec["wall_s"] = time.perf_counter() - t_all
        write(stem, rec)                                                     # partial results survive a kill
    print(stem.with_name(stem.name + ".md").read_text())
    return rec


if __name__ == "__main__":
    main()
