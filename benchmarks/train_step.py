"""Train-step throughput: our jitted JAX step (`jaxformer.train.step`) against the same model in PyTorch (eager, CPU).

  .venv/bin/python benchmarks/train_step.py [--configs tiny base gpt] [--rounds 10] [--steps N] [--out STEM]

Configs (float32, AdamW lr 1e-3 constant, no gradient clipping, tied input/output embedding on both sides):
  tiny  encoder-decoder D64, 4 heads, F128, 2+2 layers, B32, S=T=10, V64, dropout 0.1, post-LN, ReLU, sinusoidal,
        betas (0.9, 0.98), weight decay 0.01 (the repo's OptimConfig defaults);
  base  encoder-decoder D512, 8 heads, F2048, 6+6 layers, B16, S=T=64, V1000, otherwise as tiny;
  gpt   configs/shakespeare_char.py with V65: decoder-only D128, 4 layers, 4 heads, F512, T=64, B12, dropout 0,
        pre-LN + final LN, GELU (exact), learned positions, betas (0.9, 0.99), weight decay 0.1; ours with the
        recipe's model.runtime.remat="dots" (each block keeps only its matmul outputs for the backward pass);
  gpt-noremat  gpt with model.runtime.remat="none" (every activation stored): what the remat setting buys.
Weight decay on weight matrices only on both sides (ours: optim.weight_decay_mask="matrices"; PyTorch: a param
group of the >=2-d weights other than the embedding and positions). Dropout on both sides sits where ours puts it:
after the embedding and on each residual branch (PyTorch's attention-probability and inner-FFN dropout are off).
PyTorch: nn.Transformer (batch_first, norm_first, activation and dropout matching, custom encoder/decoder stacks
so a final LayerNorm exists only for pre-LN, as ours) or nn.TransformerEncoder (gpt, is_causal=True + mask),
nn.Embedding (initialised N(0, 1/D) as ours) scaled by sqrt(D), causal target mask, cross-entropy,
torch.optim.AdamW (defaults otherwise), torch.set_num_threads(os.cpu_count()), train mode, no torch.compile.

Method: every measurement runs in a fresh child process (this script with --child FRAMEWORK CONFIG STEPS), the
parent alternating jax, torch, jax, torch, ... for --rounds rounds per config. A child builds the model, runs 3
warm-up steps (the first one, which compiles on our side, is timed alone: "compile s"), then times --steps steps
(default tiny 200, base 10, gpt 50) as one block: ours dispatches them asynchronously and blocks only at the end.
Random tokens in [1, V) (no pad) are drawn once, on the device, and reused; dropout keys are drawn before timing.
  tokens/s        target tokens per step (B·T) / seconds per step; median (min–max) over rounds;
  ratio           ours / PyTorch, of the medians;
  model GFLOP/s   6 · P · B·T / (seconds per step), P = parameter count (ours: the sizes of
                  nnx.state(model, nnx.Param), as `nn.count_params`; PyTorch: model.parameters());
  XLA GFLOP/s     the compiled step's own count (`step.lower(...).compile().cost_analysis()["flops"]`) / time;
                  XLA counts a loop body once and our layers are one lax.scan per stack (nn/stack.py), so this
                  covers one layer of each stack, not L: a lower bound, not comparable to the model estimate;
  % of peak       of the float32 matmul peak measured in the same run: a child timing jitted jnp.dot of two
                  2048x2048 float32 matrices (median of 10 after warm-up, 2·n³ flops), another timing torch.mm.
Writes benchmarks/results/train_step.md and .json (or --out STEM.md / STEM.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Axis legend: B batch, S source length, T target length, D model width, N heads, F FFN width, V vocab,
# L layers (Le encoder, Ld decoder), P parameters.
CONFIGS = {
    "tiny": dict(arch="encoder_decoder", V=64, D=64, N=4, F=128, Le=2, Ld=2, B=32, S=10, T=10, dropout=0.1,
                 norm="post", act="relu", pos="sinusoidal", b2=0.98, wd=0.01),
    "base": dict(arch="encoder_decoder", V=1000, D=512, N=8, F=2048, Le=6, Ld=6, B=16, S=64, T=64, dropout=0.1,
                 norm="post", act="relu", pos="sinusoidal", b2=0.98, wd=0.01),
    "gpt": dict(arch="decoder_only", V=65, D=128, N=4, F=512, Le=0, Ld=4, B=12, S=0, T=64, dropout=0.0,
                norm="pre", act="gelu", pos="learned", b2=0.99, wd=0.1, remat="dots"),
}
CONFIGS["gpt-noremat"] = {**CONFIGS["gpt"], "remat": "none"}          # the lever measured: remat off
DEFAULT_STEPS = {"tiny": 200, "base": 10, "gpt": 50, "gpt-noremat": 50}
LR, B1, WARMUP, MATMUL_N, MATMUL_REPS = 1e-3, 0.9, 3, 2048, 10
TARGETS = {"tiny": 1.5, "base": 0.9, "gpt": 1.0}     # ours / PyTorch tokens/s to reach (issue 26's speed targets)


def describe(c: dict) -> str:
    kind = (f"encoder-decoder, {c['Le']}+{c['Ld']} layers, B{c['B']}, S={c['S']}, T={c['T']}"
            if c["arch"] == "encoder_decoder" else f"decoder-only, {c['Ld']} layers, B{c['B']}, T={c['T']}")
    return (f"{kind}, D{c['D']}, {c['N']} heads, F{c['F']}, V{c['V']}, dropout {c['dropout']}, {c['norm']}-LN, "
            f"{c['act']}, {c['pos']} positions; AdamW lr {LR} betas ({B1}, {c['b2']}) weight decay {c['wd']}")


# ---------------------------------------------------------------------------------------------- our side (JAX)
def jax_config(c: dict):
    from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, replaced
    lm = c["arch"] == "decoder_only"
    model = replaced(ModelConfig(), arch=c["arch"], vocab_size=c["V"], d_model=c["D"], num_heads=c["N"], d_ff=c["F"],
                        num_encoder_layers=c["Le"], num_decoder_layers=c["Ld"], max_len=max(c["S"], c["T"]),
                        runtime__dropout=c["dropout"], norm__position=c["norm"], positional=c["pos"],
                        activation=c["act"],
                        runtime__remat=c.get("remat", "none"))
    data = (DataConfig(task="text", path="builtin:alice", block_size=c["T"], batch_size=c["B"]) if lm
            else DataConfig(task="reverse", batch_size=c["B"]))
    optim = OptimConfig(name="adamw", lr=LR, schedule="constant", warmup_steps=0, b1=B1, b2=c["b2"],
                        weight_decay=c["wd"], clip_norm=0.0)
    return Config(model=model, data=data, optim=optim, train=TrainConfig(best_metric="loss" if lm else "exact_match"))


def jax_child(name: str, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxformer.nn import build_model
    from jaxformer.train.step import init_state, make_train_step
    c = CONFIGS[name]
    cfg = jax_config(c)
    abstract = nnx.eval_shape(lambda: build_model(cfg.model))                # shapes only, nothing allocated
    params = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))   # P
    graphs, state = init_state(cfg)
    step = make_train_step(graphs, cfg)
    k = jax.random.split(jax.random.key(1234), 3)
    tok = lambda key, n: jax.random.randint(key, (c["B"], n), 1, c["V"], dtype=jnp.int32)   # [B,n], no pad
    batch = ({"inputs": tok(k[0], c["T"]), "targets": tok(k[1], c["T"])} if c["arch"] == "decoder_only" else
             {"src": tok(k[0], c["S"]), "tgt_in": tok(k[1], c["T"]), "tgt_out": tok(k[2], c["T"])})
    keys = list(jax.random.split(jax.random.key(0), WARMUP + steps))          # dropout keys, drawn untimed
    jax.block_until_ready((batch, keys))
    t = time.perf_counter()
    state, metrics = step(state, batch, keys[0])                              # compiles
    jax.block_until_ready((state, metrics))
    first = time.perf_counter() - t
    for i in range(1, WARMUP):
        state, metrics = step(state, batch, keys[i])
    jax.block_until_ready((state, metrics))
    t = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batch, keys[WARMUP + i])
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - t
    cost = step.lower(state, batch, keys[0]).compile().cost_analysis()       # after timing: not in any figure
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"params": params, "first_step_s": first, "s_per_step": elapsed / steps, "steps": steps,
            "xla_flops": float(cost["flops"]), "loss": float(metrics["loss"])}


# ---------------------------------------------------------------------------------------------- PyTorch side
def torch_model(c: dict):
    import torch
    from torch import nn

    def no_inner_dropout(layers):      # keep only residual dropout (dropout1/2/3), as ours
        for layer in layers:
            layer.self_attn.dropout = 0.0
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = 0.0
            layer.dropout = nn.Identity()   # the one between the FFN's two linears

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            d, pre, length = c["D"], c["norm"] == "pre", max(c["S"], c["T"])
            self.scale = math.sqrt(d)
            self.emb = nn.Embedding(c["V"], d)                                # [V,D], also the output head
            nn.init.normal_(self.emb.weight, std=d ** -0.5)                   # as ours (N(0,1)·sqrt(D) explodes)
            self.drop = nn.Dropout(c["dropout"])
            kw = dict(d_model=d, nhead=c["N"], dim_feedforward=c["F"], dropout=c["dropout"], activation=c["act"],
                      batch_first=True, norm_first=pre)
            final = (lambda: nn.LayerNorm(d)) if pre else (lambda: None)
            if c["pos"] == "learned":
                self.pos = nn.Parameter(0.02 * torch.randn(length, d))        # [T,D]
            else:
                i = torch.arange(0, d, 2, dtype=torch.float32)
                angle = torch.arange(length, dtype=torch.float32)[:, None] / 10000 ** (i / d)
                pe = torch.zeros(length, d)
                pe[:, 0::2], pe[:, 1::2] = torch.sin(angle), torch.cos(angle)
                self.register_buffer("pe", pe)                               # [T,D], not a parameter
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(c["T"]))  # [T,T]
            dec = c["arch"] == "encoder_decoder"
            enc_stack = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), c["Le"] if dec else c["Ld"],
                                              norm=final(), enable_nested_tensor=False)
            no_inner_dropout(enc_stack.layers)
            if dec:
                dec_stack = nn.TransformerDecoder(nn.TransformerDecoderLayer(**kw), c["Ld"], norm=final())
                no_inner_dropout(dec_stack.layers)
                self.tf = nn.Transformer(d_model=d, nhead=c["N"], custom_encoder=enc_stack,
                                         custom_decoder=dec_stack, batch_first=True)
            else:
                self.stack = enc_stack

        def embed(self, tokens):                                                  # [B,T] -> [B,T,D]
            pos = self.pos if c["pos"] == "learned" else self.pe
            return self.drop(self.emb(tokens) * self.scale + pos[: tokens.shape[1]])

        def forward(self, *tokens):                                               # -> logits [B,T,V]
            if c["arch"] == "encoder_decoder":
                src, tgt = tokens
                y = self.tf(self.embed(src), self.embed(tgt), tgt_mask=self.causal, tgt_is_causal=True)
            else:
                y = self.stack(self.embed(tokens[0]), mask=self.causal, is_causal=True)
            return y @ self.emb.weight.T                                          # tied head, no bias

    return Model()


def torch_child(name: str, steps: int) -> dict:
    import torch
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    c = CONFIGS[name]
    model = torch_model(c).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n not in ("emb.weight", "pos")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and n not in ("emb.weight", "pos"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["wd"]}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(B1, c["b2"]))
    tok = lambda n: torch.randint(1, c["V"], (c["B"], n))                         # [B,n], no pad
    inputs = (tok(c["S"]), tok(c["T"])) if c["arch"] == "encoder_decoder" else (tok(c["T"]),)
    targets = tok(c["T"])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(*inputs).reshape(-1, c["V"]), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    for _ in range(1, WARMUP):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    elapsed = time.perf_counter() - t
    return {"params": sum(p.numel() for p in model.parameters()), "first_step_s": first,
            "s_per_step": elapsed / steps, "steps": steps, "loss": float(loss), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def matmul_child(framework: str, reps: int) -> dict:
    """Median time of a float32 [n,n]·[n,n] product after warm-up -> FLOP/s (2·n³ per product)."""
    ts = []
    if framework == "jax":
        import jax
        import jax.numpy as jnp
        a, b = (jax.random.normal(jax.random.key(i), (MATMUL_N, MATMUL_N), jnp.float32) for i in range(2))
        f = jax.jit(jnp.dot)
        jax.block_until_ready(f(a, b))
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f(a, b))
            ts.append(time.perf_counter() - t)
    else:
        import torch
        torch.set_num_threads(os.cpu_count())
        a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
        torch.mm(a, b)
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            ts.append(time.perf_counter() - t)
    med = statistics.median(ts)
    return {"n": MATMUL_N, "median_s": med, "flops_per_s": 2 * MATMUL_N ** 3 / med}


def run_child(framework: str, name: str, steps: int, script: str = __file__, env: dict | None = None) -> dict:
    """`script --child FRAMEWORK NAME STEPS` in a fresh process (the environment `jaxformer` gives itself, plus
    `env`) -> its last stdout line as JSON (or the error)."""
    from jaxformer.platforms.launch import malloc_env
    cmd = [sys.executable, script, "--child", framework, name, str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env=malloc_env(os.environ | {"PYTHONPATH": str(ROOT)} | (env or {})))
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- parent
def paired_ratio(runs: dict) -> dict | None:
    """runs {"jax": [...], "torch": [...]} (round i's two children ran back to back) -> ours/PyTorch tokens/s as
    `stats.paired_ratio` of the rounds where neither child failed; None with fewer than two such rounds."""
    from jaxformer.stats import paired_ratio as ratio
    pairs = [(j["s_per_step"], t["s_per_step"]) for j, t in zip(runs["jax"], runs["torch"])
             if "error" not in j and "error" not in t]
    return ratio([t for _, t in pairs], [j for j, _ in pairs])                  # tokens/s ratio = time ratio⁻¹


def target_verdict(r: dict | None, target: float | None) -> str:
    """The target "ours/PyTorch >= target" against a paired ratio (`stats.against`)."""
    from jaxformer.stats import against
    if target is None:
        return "—"
    return f"≥ {target:g}×: " + ("not measured" if r is None else against(r, target))


def summarise(c: dict, runs: list[dict], peak: float | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}
    tok = [c["B"] * c["T"] / r["s_per_step"] for r in ok]                       # target tokens / s
    s = statistics.median(r["s_per_step"] for r in ok)
    out = {"tokens_per_s": tok, "median_tokens_per_s": statistics.median(tok), "min": min(tok), "max": max(tok),
           "median_s_per_step": s, "params": ok[0]["params"], "first_step_s": statistics.median(
               r["first_step_s"] for r in ok), "model_flops_per_s": 6 * ok[0]["params"] * c["B"] * c["T"] / s}
    if "xla_flops" in ok[0]:
        out["xla_flops_per_step"] = ok[0]["xla_flops"]
        out["xla_flops_per_s"] = ok[0]["xla_flops"] / s
    if peak:
        out["model_fraction_of_peak"] = out["model_flops_per_s"] / peak
        if "xla_flops_per_s" in out:
            out["xla_fraction_of_peak"] = out["xla_flops_per_s"] / peak
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    # 10: at 5 rounds the paired interval of the char model was ±12% on the 2-core AMD VM (PyTorch's step time
    # moves that much between processes), wider than the distance of its ratio from the target
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=None, help="timed steps per child (default: tiny 200, base 10, gpt 50)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/train_step"), help="path stem of .md and .json")
    p.add_argument("--child", nargs=3, metavar=("FRAMEWORK", "CONFIG", "STEPS"))
    a = p.parse_args(argv)
    if a.child:
        fw, name, steps = a.child
        if name == "matmul":
            print(json.dumps(matmul_child(fw, int(steps))))
        else:
            print(json.dumps((jax_child if fw == "jax" else torch_child)(name, int(steps))))
        return
    peaks = {fw: run_child(fw, "matmul", MATMUL_REPS) for fw in ("jax", "torch")}
    print("matmul peak", peaks, flush=True)
    results = {}
    for name in a.configs:
        steps = a.steps or DEFAULT_STEPS[name]
        runs = {"jax": [], "torch": []}
        for r in range(a.rounds):
            for fw in ("jax", "torch"):
                runs[fw].append(run_child(fw, name, steps))
                print(name, r, fw, runs[fw][-1], flush=True)
        results[name] = {"shapes": CONFIGS[name], "steps": steps, "runs": runs,
                         **{fw: summarise(CONFIGS[name], runs[fw], peaks[fw].get("flops_per_s")) for fw in runs}}
    write(a, argv, peaks, results)


def write(a, argv, peaks, results) -> None:
    from jaxformer.platforms.launch import malloc_env
    from jaxformer.stats import machine
    cmd = shlex.join(["python", "benchmarks/train_step.py", *argv])
    tv = next((r.get("torch") for res in results.values() for r in res["runs"]["torch"] if "torch" in r), "?")
    gf = lambda x: f"{x / 1e9:.1f}"
    frac = lambda s, k: f"{100 * s[k]:.1f}%" if k in s else "—"
    peak = lambda fw: (gf(peaks[fw]["flops_per_s"]) + " GFLOP/s" if "flops_per_s" in peaks[fw]
                       else "error: " + peaks[fw]["error"])
    lines = ["# Train-step throughput: ours (JAX) vs PyTorch, CPU", "",
             f"Machine: {machine()}", "", f"Command: `{cmd}` (PyTorch {tv}, eager, "
             f"{a.rounds} rounds, each framework in its own fresh process, alternating; both with the process "
             f"environment `jaxformer` gives itself: GLIBC_TUNABLES={malloc_env().get('GLIBC_TUNABLES', '(unset)')}, "
             "jaxformer/platforms/launch.py).", "", "Configs:", ""]
    lines += [f"- **{n}**: {describe(r['shapes'])}; {r['steps']} timed steps per process after {WARMUP} "
              "warm-up." for n, r in results.items()]
    lines += ["", f"Float32 matmul peak ({MATMUL_N}x{MATMUL_N}, median of {MATMUL_REPS}): jitted jnp.dot "
              f"{peak('jax')}, torch.mm {peak('torch')}.", "",
              "Tokens/s: target tokens (B·T) per second, median (min–max) over rounds. Model GFLOP/s = "
              "6 · P · B·T / (median seconds per step); XLA GFLOP/s = the compiled step's cost_analysis() flops "
              "/ (median seconds per step); percentages are of the jnp.dot peak (PyTorch's: of torch.mm's). "
              "Compile s: our first step (tracing + XLA compilation + one step), median over rounds. XLA's cost "
              "analysis counts a while-loop body once, and each of our layer stacks is one lax.scan "
              "(jaxformer/nn/stack.py): its count covers one layer per stack, not L, so it is a lower bound. "
              "Paired: the geometric mean of the per-round ratios ours/PyTorch (a round's two processes ran "
              "back to back) with its 95% Student-t interval; a target is met when that whole interval is at "
              "or above it, missed when it is all below (`paired_ratio`, `target_verdict`).", "",
              "| config | ours tokens/s median (min–max) | PyTorch tokens/s median (min–max) | ratio | "
              "paired [95%] | target | ours ms/step | model GFLOP/s (6·P·tokens) | % of matmul peak | "
              "XLA GFLOP/s | compile s |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    cell = lambda s: (f"{s['median_tokens_per_s']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f})" if "error" not in s
                      else f"error: {s['error']}")
    for n, r in results.items():
        j, t = r["jax"], r["torch"]
        ratio = f"{j['median_tokens_per_s'] / t['median_tokens_per_s']:.2f}×" if "error" not in j | t else "—"
        pr = paired_ratio(r["runs"])
        paired = f"{pr['ratio']:.2f} [{pr['lo']:.2f}, {pr['hi']:.2f}]" if pr else "—"
        target = target_verdict(pr, TARGETS.get(n))
        if "error" in j:
            lines.append(f"| {n} | {cell(j)} | {cell(t)} | — | — | {target} | — | — | — | — | — |")
            continue
        xla = f"{gf(j['xla_flops_per_s'])} ({frac(j, 'xla_fraction_of_peak')})"
        lines.append(f"| {n} | {cell(j)} | {cell(t)} | {ratio} | {paired} | {target} | "
                     f"{1e3 * j['median_s_per_step']:.2f} | "
                     f"{gf(j['model_flops_per_s'])} | {frac(j, 'model_fraction_of_peak')} | {xla} | "
                     f"{j['first_step_s']:.2f} |")
    lines += ["", "PyTorch side and parameter counts:", "",
              "| config | P ours | P PyTorch | PyTorch ms/step | PyTorch model GFLOP/s | % of torch.mm peak | "
              "PyTorch first step s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n, r in results.items():
        j, t = r["jax"], r["torch"]
        if "error" in t:
            lines.append(f"| {n} | {j.get('params', '—')} | error: {t['error']} | | | | |")
            continue
        lines.append(f"| {n} | {j.get('params', '—')} | {t['params']} | {1e3 * t['median_s_per_step']:.2f} | "
                     f"{gf(t['model_flops_per_s'])} | {frac(t, 'model_fraction_of_peak')} | {t['first_step_s']:.3f} |")
    diff = [n for n, r in results.items() if "params" in r["jax"] and "params" in r["torch"]
            and r["jax"]["params"] != r["torch"]["params"]]
    lines += ["", ("Parameter counts DIFFER for " + ", ".join(diff) + " (see the table): the models are not "
                   "the same size there." if diff else "Parameter counts are identical on both sides.")]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    Path(a.out + ".json").write_text(json.dumps({"machine": machine(), "command": cmd, "torch": tv,
                                                    "rounds": a.rounds, "warmup": WARMUP, "matmul_peak": peaks,
                                                    "configs": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
