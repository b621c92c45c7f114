"""Decoding speed: naive full recomputation vs the KV-cached decoder, same model, same run (+ PyTorch references,
without and with a KV cache).

  .venv/bin/python benchmarks/decode.py [--sizes tiny base] [--batches 1 8] [--contexts 32 ... 1024] [--reps 5]

Per context c (decoder-only, RoPE, pre-LN, float32, random weights):
  naive(c)   one jitted full forward over c tokens: what each new token costs without a cache at context c;
  torch(c)   the same forward in PyTorch 2.13 (nn.TransformerEncoder, norm_first, causal mask, inference mode);
  cached(c)  per-token time of the compiled decode loop (model.step + greedy pick in a lax.fori_loop, cache
             donated so it is updated in place, as inside generate_lm) running --steps tokens from context c;
  torch cached(c)  per-token time of PyTorch with a KV cache (benchmarks/torch_decoder.py: the same structure as
             ours (pre-LN, RoPE, tied head, ...), cache [L,B,N,Smax,H] preallocated and written in place,
             F.scaled_dot_product_attention over the filled slots, eager, inference mode, os.cpu_count() threads):
             after a prefill of c tokens, a Python loop of --steps greedy steps from context c, as ours;
             "torch cached / ours cached" > 1 means ours is faster per token; ours and PyTorch's loops alternate
             within each of --reps rounds (`timing.paired_times_ms`), so the ratio also comes as the geometric
             mean of per-round ratios with its 95% interval, on which the target is judged;
  ttft(c)    time to first token: the prefill of a c-token prompt (one pass).
End to end: greedy generation of --new tokens after a --prompt-token prompt.
  naive      a Python loop calling the jitted full forward on the growing sequence (each length compiled
             before timing, so compile time is excluded);
  cached     generate_lm: one compiled program (prefill + while_loop).
All times are medians of --reps runs after a warm-up. Writes decode.md and decode.json in --out (default
benchmarks/results), with sections on the targets at base size: per token at least as fast as PyTorch cached at
every batch and context, and batch 1 within 1.3x of the weight-bandwidth floor (weights' bytes over the fastest
read rate of a buffer of their size, by any of four readers, measured in the same run).
`.venv/bin/python benchmarks/torch_decoder.py [tiny base]` checks the PyTorch cache against recomputation and
the PyTorch model against ours with our weights copied in.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.config import ModelConfig, replaced
from jaxformer.decode import generate_lm
from jaxformer.nn import build_model
from jaxformer.stats import against, paired_ratio
from decode_sizes import SIZES, VOCAB  # benchmarks/decode_sizes.py (torch_decoder.py reads it too)
from timing import median_ms, paired_times_ms, times_ms  # benchmarks/timing.py

try:
    import torch_decoder  # benchmarks/torch_decoder.py (needs torch; sets torch's threads to os.cpu_count())
except ImportError:
    torch_decoder = None


def torch_forward(size):
    """A PyTorch decoder-only model of the same size; returns f(tokens np [B,T]) -> last logits, or None."""
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    s = SIZES[size]
    d = s["d_model"]
    layer = torch.nn.TransformerEncoderLayer(d, s["num_heads"], s["d_ff"], dropout=0.0, batch_first=True,
                                             norm_first=True)
    stack = torch.nn.TransformerEncoder(layer, s["num_decoder_layers"], enable_nested_tensor=False).eval()
    emb, head = torch.nn.Embedding(VOCAB, d), torch.nn.Linear(d, VOCAB)

    def f(tokens):
        with torch.inference_mode():
            x = torch.as_tensor(tokens)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return head(stack(emb(x), mask=mask, is_causal=True)[:, -1])
    return f


def decoding_cache(graphdef, batch: int, slots: int, dtype: str = "auto"):
    """jit of model state -> an empty decoding state for `batch` rows and `slots` slots (`model.init_cache`: the
    per-layer cache and the decoder laid out for decoding, as generate_lm makes it inside its program)."""
    return jax.jit(lambda s: nnx.merge(graphdef, s).init_cache(batch, slots, dtype=dtype))


def prefill_fn(graphdef):
    """jit of (state, cache, tokens [B,P], positions [B,P]) -> (logits, the filled cache): mode "prefill"."""
    def prefill(s, cache, t, p):
        logits, out = nnx.merge(graphdef, s)(t, p, cache=cache, mode="prefill")
        return logits, out["cache"]
    return jax.jit(prefill)


def cached_loop(graphdef, steps):
    """jit of (state, cache, tok [B,1], pos [B,1]) -> (cache, tok, pos): `steps` greedy cached calls (mode
    "decode") in a fori_loop, the cache donated (returned, so donation aliases it), as inside generate_lm."""
    def run_steps(s, cache, tok, pos):
        m = nnx.merge(graphdef, s)

        def body(_, c):
            cache, tok, pos = c
            logits, out = m(tok, pos, cache=cache, mode="decode")
            return out["cache"], jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
        return jax.lax.fori_loop(0, steps, body, (cache, tok, pos))
    return jax.jit(run_steps, donate_argnums=1)


def bench_contexts(size, batch, contexts, reps, steps):
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=VOCAB, max_len=max(contexts) + steps + 1,
                      positional="rope", norm__position="pre", runtime__dropout=0.0, **SIZES[size])
    graphdef, state = nnx.split(build_model(cfg))
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0][:, -1])
    # generate_lm makes its decoding state once per call (per-layer weight copies and an empty cache); timed here
    make = decoding_cache(graphdef, batch, max(contexts) + steps)
    layout_ms = median_ms(lambda: make(state), reps)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
    prefill = prefill_fn(graphdef)
    loop = cached_loop(graphdef, steps)
    tf = torch_forward(size)
    td = (torch_decoder.TorchDecoder(VOCAB, **SIZES[size], batch=batch, max_len=max(contexts) + steps + 1)
          if torch_decoder is not None else None)
    rows = []
    for c in contexts:
        toks = jax.random.randint(jax.random.key(c), (batch, c), 1, VOCAB)
        pos = jnp.broadcast_to(jnp.arange(c), (batch, c))
        cache = decoding_cache(graphdef, batch, c + steps)(state)
        np_toks = np.asarray(toks).astype(np.int64)
        naive = median_ms(lambda: fwd(state, toks), reps)
        ttft = median_ms(lambda: prefill(state, cache, toks, pos), reps)
        _, filled = prefill(state, cache, toks, pos)
        start = (toks[:, -1:], jnp.full((batch, 1), c, jnp.int32))
        ours = lambda c2: loop(state, c2, *start)                                 # noqa: E731
        fresh = lambda: (jax.tree.map(jnp.copy, filled),)                           # noqa: E731
        if td is not None:
            td.prefill(np_toks)        # slots [0,c); every timed loop rewrites slots [c,c+steps) before reading
            first = torch_decoder.torch.as_tensor(np_toks[:, -1])        # as ours: the last prompt token at c
            t = paired_times_ms({"ours": ours, "torch": lambda: td.greedy_steps(first, c, steps)}, reps,
                                {"ours": fresh})
            cached = statistics.median(t["ours"]) / steps
        else:
            cached = median_ms(ours, reps, setup=fresh) / steps
        row = {"size": size, "batch": batch, "context": c, "naive_ms": naive, "cached_ms": cached,
               "speedup": naive / cached, "ttft_ms": ttft, "layout_ms": layout_ms, "weight_bytes": weight_bytes,
               "cache_bytes": sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((cache.k, cache.v)))}
        if tf is not None:
            row["torch_naive_ms"] = median_ms(lambda: tf(np_toks), reps)
        if td is not None:
            row["torch_cached_ms"] = statistics.median(t["torch"]) / steps
            row["torch_cached_over_cached"] = row["torch_cached_ms"] / cached
            row["paired"] = paired_ratio(t["torch"], t["ours"])
        rows.append(row)
        print(row, flush=True)
    return rows


def bench_end_to_end(size, batch, prompt, new, reps):
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=VOCAB, max_len=prompt + new, positional="rope",
                      norm__position="pre", runtime__dropout=0.0, **SIZES[size])
    model = build_model(cfg)
    graphdef, state = nnx.split(model)
    toks = jax.random.randint(jax.random.key(1), (batch, prompt), 1, VOCAB).astype(jnp.int32)
    pick = jax.jit(lambda s, t: jnp.argmax(nnx.merge(graphdef, s)(t)[0][:, -1], -1).astype(jnp.int32))

    def naive():
        seq = toks
        for _ in range(new):
            seq = jnp.concatenate([seq, pick(state, seq)[:, None]], 1)
        return seq[:, prompt:]

    t = time.perf_counter()
    naive_out = jax.block_until_ready(naive())                    # compiles each length once
    compile_s = time.perf_counter() - t
    naive_ts = times_ms(naive, reps)
    cached = lambda: generate_lm(model, toks, max_new=new)        # noqa: E731
    cached_ts = times_ms(cached, reps)
    agree = float(np.mean(np.asarray(cached()) == np.asarray(naive_out)))
    naive_ms, cached_ms = statistics.median(naive_ts), statistics.median(cached_ts)
    row = {"size": size, "batch": batch, "prompt": prompt, "new": new, "naive_ms": naive_ms,
           "cached_ms": cached_ms, "speedup": naive_ms / cached_ms, "naive_min_ms": min(naive_ts),
           "cached_min_ms": min(cached_ts), "speedup_of_minima": min(naive_ts) / min(cached_ts),
           "token_agreement": agree, "naive_warmup_s": compile_s}
    print(row, flush=True)
    return row


def torch_target(rows):
    """The target "ours at least as fast per token as PyTorch cached at base size", at every batch and context
    measured -> (met: bool | None when not measured or not resolved, one line saying why). Judged on each row's
    paired interval where the row has one (met: at or above 1.0 throughout; missed: all below), else on its
    ratio of medians."""
    rs = [r for r in rows if r["size"] == "base" and "torch_cached_over_cached" in r]
    if not rs:
        return None, "not measured in this run (needs --sizes base, and torch)"
    point = lambda r: {"lo": r["torch_cached_over_cached"], "hi": r["torch_cached_over_cached"]}   # noqa: E731
    word_of = lambda r: against(r.get("paired") or point(r), 1.0)                                  # noqa: E731
    low = min(rs, key=lambda r: r["torch_cached_over_cached"])
    cell = lambda r: (f"batch {r['batch']} c={r['context']} ({r['torch_cached_over_cached']:.2f}×"      # noqa: E731
                      + (f" [{r['paired']['lo']:.2f}, {r['paired']['hi']:.2f}]" if r.get("paired") else "") + ")")
    missed = [cell(r) for r in rs if word_of(r) == "missed"]
    open_ = [cell(r) for r in rs if word_of(r) == "not resolved"]
    met = False if missed else None if open_ else True
    word = {True: "met", False: "not met", None: "not resolved"}[met]
    return met, (f"**{word}**: lowest ratio {low['torch_cached_over_cached']:.2f}× (batch {low['batch']}, "
                 f"context {low['context']})" + ("; below 1.0× (whole interval): " + ", ".join(missed)
                                                 if missed else "")
                 + ("; interval straddling 1.0×: " + ", ".join(open_) if open_ else ""))


def floor_target(rows):
    """The target "batch-1 cached per-token time within 1.3x the weight-bandwidth floor" at base size."""
    rs = [r for r in rows if r["size"] == "base" and r["batch"] == 1]
    if not rs:
        return None, "not measured in this run (needs --sizes base --batches 1)"
    worst = max(rs, key=lambda r: r["cached_ms"] / r["floor_ms"])
    ratio = worst["cached_ms"] / worst["floor_ms"]
    with_cache = max(r["cached_ms"] / r["floor_with_cache_ms"] for r in rs if "floor_with_cache_ms" in r)
    return ratio <= 1.3, (f"**{'met' if ratio <= 1.3 else 'not met'}**: worst {ratio:.2f}× the floor "
                          f"{worst['floor_ms']:.2f} ms (context {worst['context']}); with the cache's bytes "
                          f"counted too, worst {with_cache:.2f}×")


def weight_bytes(size: str) -> int:
    """Bytes of the model's float32 weights at `size` (abstract: nothing is allocated)."""
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=VOCAB, max_len=64, positional="rope",
                   norm__position="pre",
                      runtime__dropout=0.0, **SIZES[size])
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg)))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))


MIN_READ_BYTES = 16 * 2 ** 20       # below this, a reader's time is its call overhead, not the read


def stream_bandwidth(reps: int, nbytes: int) -> dict[str, float]:
    """Bytes/s at which four readers read a float32 buffer of `nbytes` (at least MIN_READ_BYTES) once: ours (a
    jitted sum; a jitted matrix-vector product, which a batch-1 decode step is) and PyTorch's (torch.sum,
    torch.mv). Read at the weights' size, this is the rate the memory hierarchy serves that working set at (on a
    machine whose cache holds the weights, the cache's rate, not DRAM's). Median of `reps` (at least 5) after a
    warm-up per reader. The floor takes the fastest, so it never flatters us."""
    side = max(64, int(math.sqrt(max(nbytes, MIN_READ_BYTES) / 4)) // 64 * 64)
    read = side * side * 4
    w, v = jnp.ones((side, side), jnp.float32), jnp.ones((side,), jnp.float32)
    total, gemv = jax.jit(jnp.sum), jax.jit(jnp.dot)
    readers = {"jax sum": lambda: total(w), "jax matvec": lambda: gemv(w, v)}
    try:
        import torch
        tw, tv = torch.ones(side, side), torch.ones(side)
        readers |= {"torch sum": lambda: tw.sum(), "torch mv": lambda: torch.mv(tw, tv)}
    except ImportError:
        pass
    return {name: read / (median_ms(f, max(reps, 5)) / 1e3) for name, f in readers.items()}


def na(r, key, spec, unit=""):
    """r[key] formatted with spec and unit, or "n/a" (no torch)."""
    return format(r[key], spec) + unit if key in r else "n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["tiny", "base"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    ap.add_argument("--steps", type=int, default=16, help="cached tokens timed per context")
    ap.add_argument("--prompt", type=int, default=32, help="end-to-end prompt length")
    ap.add_argument("--new", type=int, default=128, help="end-to-end new tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    from jaxformer.stats import machine as machine_line
    machine = machine_line()
    try:
        import torch
        machine += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        machine += ", no torch"
    # measured per size at the weights' size, before and after the rows (this VM's bandwidth moves by up to 1.7x
    # between runs), and once over 256 MiB (beyond any cache: DRAM); each size's floor takes its fastest reading
    sizes_bytes = {s: weight_bytes(s) for s in args.sizes}
    readings = {s: [stream_bandwidth(args.reps, n)] for s, n in sizes_bytes.items()}
    dram = stream_bandwidth(args.reps, 256 * 2 ** 20)
    for s, rs in readings.items():
        print(f"{s}: read rates at {sizes_bytes[s] / 2 ** 20:.1f} MiB " +
              ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rs[0].items()) + " GB/s", flush=True)
    rows = [r for s in args.sizes for b in args.batches for r in bench_contexts(s, b, args.contexts, args.reps,
                                                                                  args.steps)]
    for s, n in sizes_bytes.items():
        readings[s].append(stream_bandwidth(args.reps, n))
    bandwidth = {s: max(v for r in rs for v in r.values()) for s, rs in readings.items()}
    fastest = {s: max(((k, v) for r in rs for k, v in r.items()), key=lambda kv: kv[1])[0]
               for s, rs in readings.items()}
    for r in rows:
        r["floor_ms"] = r["weight_bytes"] / bandwidth[r["size"]] * 1e3
        r["floor_with_cache_ms"] = (r["weight_bytes"] + r["cache_bytes"]) / bandwidth[r["size"]] * 1e3
    e2e = [bench_end_to_end(s, b, args.prompt, args.new, args.reps) for s in args.sizes for b in args.batches]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    met, verdict = torch_target(rows)
    floor_met, floor_verdict = floor_target(rows)
    (out / "decode.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows,
                                                 "end_to_end": e2e, "bandwidth_bytes_per_s": bandwidth,
                                                 "bandwidth_readings": readings, "fastest_reader": fastest,
                                                 "dram_readings": dram, "weight_bytes": sizes_bytes,
                                                 "torch_cached_target_met": met, "floor_target_met": floor_met},
                                                indent=1))
    cmd = (f"benchmarks/decode.py --sizes {' '.join(args.sizes)} --batches {' '.join(map(str, args.batches))} "
           f"--contexts {' '.join(map(str, args.contexts))} --steps {args.steps} --prompt {args.prompt} "
           f"--new {args.new} --reps {args.reps}")
    lines = ["# Decode: naive recomputation vs KV cache", "",
             f"`{cmd}` on {machine}, {time.strftime('%Y-%m-%d')}. Decoder-only, RoPE, pre-LN, float32, random "
             "weights; tiny = D64/N4/F256/2 layers, base = D512/N8/F2048/6 layers. Medians; written by the script.",
             "", "## Per token at context c", "",
             "naive = full forward over c tokens (JAX, jitted); torch naive = the same in PyTorch, no cache; "
             "cached = per-token time inside the compiled decode loop from context c; torch cached = per-token "
             "time of PyTorch with a KV cache (benchmarks/torch_decoder.py, eager) stepping from context c; "
             "TTFT = prefill of c tokens; floor = the weights' bytes over the fastest rate at which any of four "
             "readers (a jitted sum and a jitted matrix-vector product, torch.sum and torch.mv) read a float32 "
             "buffer of the weights' size (at least 16 MiB) in this run, before and after the rows: "
             + "; ".join(f"{s} {sizes_bytes[s] / 2 ** 20:.1f} MiB"
                         + (f" (read as {MIN_READ_BYTES // 2 ** 20} MiB)" if sizes_bytes[s] < MIN_READ_BYTES else "")
                         + f", fastest {bandwidth[s] / 1e9:.1f} GB/s "
                         f"({fastest[s]}; readings " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in readings[s][0].items())
                         + " GB/s before)" for s in args.sizes)
             + "; over 256 MiB, beyond any cache, the fastest reads at "
             f"{max(dram.values()) / 1e9:.1f} GB/s. It is the least a step that reads every weight once can take; "
             "+ cache = the same with the cache's bytes (every slot, as attention reads them) added; "
             "layout = `model.init_cache` (each layer's weights copied out of the stacked arrays, an empty cache), which "
             "generate_lm runs once per call, before its token loop (not in cached ms).", "",
             "| size | batch | context | naive ms | torch naive ms | cached ms | torch cached ms | naive/cached | "
             "torch cached / ours cached | cached / floor | cached / floor + cache | TTFT ms | layout ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['batch']} | {r['context']} | {r['naive_ms']:.2f} | "
              f"{na(r, 'torch_naive_ms', '.2f')} | {r['cached_ms']:.3f} | {na(r, 'torch_cached_ms', '.3f')} | "
              f"{r['speedup']:.1f}× | {na(r, 'torch_cached_over_cached', '.2f', '×')} | "
              f"{r['cached_ms'] / r['floor_ms']:.2f}× of {r['floor_ms']:.3f} | "
              f"{r['cached_ms'] / r['floor_with_cache_ms']:.2f}× of {r['floor_with_cache_ms']:.3f} | "
              f"{r['ttft_ms']:.2f} | "
              f"{r['layout_ms']:.2f} |" for r in rows]
    ref = 64 if 64 in args.contexts else min(args.contexts)
    lines += ["", f"Cached per-token time at the longest context over context {ref}:", ""]
    for s in args.sizes:
        for b in args.batches:
            rs = [r for r in rows if r["size"] == s and r["batch"] == b]
            lo, hi = next(r for r in rs if r["context"] == ref), rs[-1]
            lines.append(f"- {s}, batch {b}: {hi['cached_ms']:.3f} / {lo['cached_ms']:.3f} ms = "
                         f"**{hi['cached_ms'] / lo['cached_ms']:.2f}×** (context {hi['context']} vs "
                         f"{lo['context']})")
    lines += ["", "## Cached decoding vs PyTorch with a KV cache", "",
              "Per-token time of PyTorch cached over ours cached (>1: ours is faster), per context. PyTorch: the "
              "same structure and shapes as ours (benchmarks/torch_decoder.py: pre-LN, RoPE, ReLU, tied head, "
              "cache [L,B,N,Smax,H] written in place, scaled_dot_product_attention, eager, inference mode, "
              "a Python loop of greedy steps). In brackets: the 95% interval of the per-round paired ratios (the two "
              "loops alternate within each round).", ""]
    for s in args.sizes:
        for b in args.batches:
            rs = [r for r in rows if r["size"] == s and r["batch"] == b]
            lines.append(f"- {s}, batch {b}: " + ", ".join(
                f"{na(r, 'torch_cached_over_cached', '.2f', '×')}"
                + (f" [{r['paired']['lo']:.2f}, {r['paired']['hi']:.2f}]" if r.get("paired") else "")
                + f" (c={r['context']})" for r in rs))
    lines += ["", f"target: ours at least as fast per token as PyTorch cached at base size, every batch and context "
              f"— {verdict}.", "", f"target: base size, batch 1, within 1.3× the weight-bandwidth floor — "
              f"{floor_verdict}."]
    lines += ["", f"## End to end: {args.new} new tokens after a {args.prompt}-token prompt (greedy)", "",
              "naive = Python loop over the jitted full forward on the growing sequence (compile excluded); "
              "cached = `generate_lm` (one compiled program). Medians, and minima (this machine's timings are "
              "bimodal: the same call takes 1× or ~2× from run to run). Agreement = fraction of identical tokens.",
              "", "| size | batch | naive ms | cached ms | speed-up | min naive ms | min cached ms | speed-up of "
              "minima | token agreement |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['batch']} | {r['naive_ms']:.1f} | {r['cached_ms']:.1f} | "
              f"**{r['speedup']:.1f}×** | {r['naive_min_ms']:.1f} | {r['cached_min_ms']:.1f} | "
              f"{r['speedup_of_minima']:.1f}× | {100 * r['token_agreement']:.0f}% |" for r in e2e]
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
