"""Where a train step's time goes, ours and PyTorch's, for the configs of benchmarks/train_step.py.

  .venv/bin/python benchmarks/step_profile.py [--configs gpt base tiny] [--steps N] [--out STEM]

Ours: the compiled step (`jaxformer.train.step.make_train_step`) is traced with `jax.profiler.trace` for
--steps steps; each op event of XLA:CPU's runtime is matched to its instruction in the compiled HLO
(`step.lower(...).compile().as_text()`) and put in one group:
  matmul            dots and convolutions (YNNPACK/XNNPACK fusions around a dot included);
  transposes/copies copy and transpose fusions: layout changes, often with elementwise work fused into them
                    (the report splits them: plain copies, and copies carrying their producers' work);
  reductions        fusions around a reduce (softmax, norms, bias gradients, the loss);
  random bits       fusions computing uint32 threefry bits (dropout masks);
  layer-stack I/O   dynamic-slice / dynamic-update-slice fusions: the scanned layer stack reading its
                    layer's parameters and storing each layer's activations for the backward pass;
  buffer fills      broadcasts that initialise a whole buffer (the stacked activations' zeros);
  elementwise       every other fusion (activations, Adam's update, dropout scaling, residual adds);
  loop control      the while loops themselves: an event's own time, less the op events nested in it on its
                    thread (its body's ops are counted in their groups; `self_times`).
Op times are summed over XLA:CPU's threads, so they can exceed the wall time; time when no op event is open
(a dot or YNNPACK fusion finishing its work in pool tasks after its event ends) is reported apart. Also timed (medians of 5 runs
of --steps steps, state threaded through, blocking only at the end): the whole step and the forward pass
alone (the jitted loss), hence backward+update / forward. Ours runs twice: in the environment `jaxformer`
gives itself (glibc.malloc.hugetlb=1: jaxformer/platforms/launch.py; the profile is this run's) and with malloc as it is
(JAXFORMER_MALLOC=default), each with the minor page faults of one block of steps; the dropout models (base,
tiny) also with jax's own CPU lowering of the threefry hash (STEP_PROFILE_ROLLED_THREEFRY=1: a loop per draw,
where jaxformer lowers it unrolled, `jaxformer/platforms/lowering.py`), with op events per step; the char model (gpt)
also a third time pinned to one core (STEP_PROFILE_ONE_CORE=1), where no op runs beside another, so no op's
time includes waits for a worker (on two threads the shares over-count cheap ops).
PyTorch: the same model as benchmarks/train_step.py, `torch.profiler` over --steps steps; self CPU time per
aten op, grouped alike (mm/addmm/bmm/sdpa as matmul; copy_/clone/contiguous as copies; sum/mean/softmax/
layer_norm and their backwards as reductions; bernoulli/dropout as random bits; _foreach_*/adamw as the
optimizer; the rest elementwise). The remainder of the wall time is Python and dispatch.
Writes benchmarks/results/step_profile.md and .json (or --out STEM.md / STEM.json).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPS = ("matmul", "transposes/copies", "reductions", "random bits", "layer-stack I/O", "buffer fills",
          "optimizer", "elementwise", "loop control")


def classify_hlo(name: str, body: str) -> str:
    """Group of one XLA:CPU op, from its instruction name and (for a fusion) its fused computation's text."""
    if re.match(r"(dot|convolution)\b", name) or re.search(r" (dot|convolution)\(", body):
        return "matmul"
    if "u32[" in body and ("shift-right-logical(" in body or "xor(" in body):
        return "random bits"
    if name.startswith(("while", "conditional", "call")):
        return "loop control"
    if re.search(r" reduce\(", body) or name.startswith("reduce"):
        return "reductions"
    if "dynamic-update-slice" in name or "dynamic-slice" in name:
        return "layer-stack I/O"
    if name.startswith("wrapped_broadcast"):
        return "buffer fills"
    if "copy" in name or "transpose" in name:
        return "transposes/copies"
    return "elementwise"


# the instructions a layout copy is made of when it carries no other work (a transpose, maybe of a slice)
PLAIN_COPY = {"parameter", "constant", "bitcast", "copy", "transpose", "dynamic-slice", "slice", "subtract",
              "broadcast"}


def copy_kind(body: str) -> str:
    """"plain" for a copy fusion (or a bare copy) made only of PLAIN_COPY instructions, else "with work" (the
    elementwise work of its producers fused into the transpose)."""
    ops = set(re.findall(r"= \S+ ([a-z][\w\-]*)\(", body))
    return "plain" if ops <= PLAIN_COPY else "with work"


def _elements(line: str) -> int:
    """Elements of an instruction's (first) array result, from its HLO line."""
    m = re.match(r"\(?\w+\[([\d,]*)\]", line)
    return math.prod(int(d) for d in m.group(1).split(",") if d) if m else 0


def gaps(spans: list[tuple[str, float, float]], min_us: float = 50.0) -> tuple[float, collections.Counter]:
    """Time inside the profiled block when no op event is open on any thread, from (op, start µs, duration µs)
    events: (total µs, Counter op -> µs of the gaps that follow the op whose event ended last before each gap).
    Gaps shorter than min_us (an op's dispatch) are not counted. A dot or YNNPACK fusion runs its work in the
    thread pool's tasks after its own event ends, so such gaps are mostly that work."""
    total, after = 0.0, collections.Counter()
    spans = sorted(spans, key=lambda s: s[1])
    if not spans:
        return total, after
    end, last = spans[0][1] + spans[0][2], spans[0][0]
    for op, start, dur in spans[1:]:
        if start - end >= min_us:
            total += start - end
            after[last] += start - end
        if start + dur > end:
            end, last = start + dur, op
    return total, after


def op_events(events: list[dict], module: str) -> list[dict]:
    """The complete ("X") events of XLA:CPU ops (with an hlo_op) of the jitted program whose module name has
    `module`, from a perfetto trace's traceEvents."""
    return [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_op") is not None
            and module in e["args"].get("hlo_module", "")]


def self_times(events: list[dict], eps_us: float = 0.5) -> list[float]:
    """Each op event's own time (µs): its duration less the events nested in it on its thread (its direct
    children). XLA:CPU's runtime opens a while/conditional/call event that spans its body when the body's ops run
    on the same thread (always pinned to one core; the batch-8 decoding loop on two), so the loop's full duration
    is not the loop's own cost. `events`: dicts with ts, dur (µs) and tid; the result is in their order."""
    own = [float(e["dur"]) for e in events]
    by_tid = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_tid[e.get("tid")].append(i)
    for idx in by_tid.values():
        idx.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack = []                                                 # (end µs, index) of the open events
        for i in idx:
            start, end = events[i]["ts"], events[i]["ts"] + events[i]["dur"]
            while stack and stack[-1][0] <= start + eps_us:
                stack.pop()
            if stack and end <= stack[-1][0] + eps_us:
                own[stack[-1][1]] -= events[i]["dur"]
            stack.append((end, i))
    return own


def fused_bodies(hlo: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (fused computation text or '', metadata op_name) from compiled HLO text."""
    comps = {}
    for m in re.finditer(r"^%?([\w.\-]+) \(.*?\) -> .*? \{\n(.*?)\n\}", hlo, re.S | re.M):
        comps[m.group(1)] = m.group(2)
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", hlo, re.M):
        line = m.group(2)
        called = re.search(r"calls=%([\w.\-]+)", line)
        op = re.search(r'op_name="([^"]+)"', line)
        out[m.group(1)] = (comps.get(called.group(1), "") if called else line, op.group(1) if op else "")
    return out


def jax_child(name: str, steps: int) -> dict:
    import jax
    from flax import nnx
    from jaxformer.ops.losses import token_losses
    from jaxformer.train.step import forward, init_state, make_train_step
    import train_step as ts
    c = ts.CONFIGS[name]
    cfg = ts.jax_config(c)
    graphs, state = init_state(cfg)
    step = make_train_step(graphs, cfg)                       # lowers jax's threefry unrolled (jaxformer.platforms.lowering)
    if os.environ.get("STEP_PROFILE_ROLLED_THREEFRY"):
        from jaxformer.platforms.lowering import unrolled_threefry
        unrolled_threefry(False)                              # the A/B: jax's CPU default, a loop per draw
    batch, key = _jax_batch(c), jax.random.key(0)

    def loss(model_state, batch, rng):                        # the forward pass alone, as the step runs it
        model = nnx.merge(graphs.model, model_state)
        logits, targets, _ = forward(model, batch, nnx.Rngs(dropout=rng))
        s = token_losses(logits, targets, cfg.model.pad_id, cfg.optim.label_smoothing)
        return s["objective"] / s["count"]

    fwd = jax.jit(loss)
    hlo = step.lower(state, batch, key).compile().as_text()
    carry = [state]

    def run_steps():
        for _ in range(steps):
            carry[0], m = step(carry[0], batch, key)
        return m

    def run_fwd():
        for _ in range(steps):
            out = fwd(carry[0]["model"], batch, key)
        return out

    step_ms, fwd_ms = _median_ms(run_steps, steps), _median_ms(run_fwd, steps)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(run_steps())
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run_steps())
        events = json.load(gzip.open(glob.glob(f"{d}/plugins/profile/*/perfetto_trace.json.gz")[0]))["traceEvents"]
    info = fused_bodies(hlo)
    results = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", hlo, re.M)}
    groups, ops = collections.Counter(), collections.Counter()
    copies = {k: collections.Counter() for k in ("plain", "with work")}
    spans = []
    events = op_events(events, "train_step")
    for e, own in zip(events, self_times(events)):
        op = e["args"]["hlo_op"]
        body, op_name = info.get(op, ("", ""))
        g = classify_hlo(op, body)
        if g != "loop control":                  # a loop's event spans its body: the gaps are between the work
            spans.append((op, e["ts"], e["dur"]))
        groups[g] += own / 1e3 / steps
        ops[(op, g, re.sub(r"^jit\(\w+\)/", "", op_name)[-70:])] += own / 1e3 / steps
        if g == "transposes/copies":
            c = copies[copy_kind(body)]
            c["ms"] += own / 1e3 / steps
            c["elements"] += _elements(results.get(op, "")) / steps
    top = [{"op": k[0], "group": k[1], "source": k[2], "ms": v} for k, v in ops.most_common(12)]
    idle, after = gaps(spans)
    gap_after = [{"op": op, "group": classify_hlo(op, info.get(op, ("", ""))[0]), "ms": us / 1e3 / steps}
                 for op, us in after.most_common(5)]
    return {"step_ms": step_ms, "forward_ms": fwd_ms, "groups_ms": dict(groups), "top": top, "faults_per_step": faults,
            "op_events_per_step": len(events) / steps,
            "no_op_ms": idle / 1e3 / steps, "no_op_after": gap_after, "copies": {k: dict(v) for k, v in copies.items()},
            "temp_mib": step.lower(state, batch, key).compile().memory_analysis().temp_size_in_bytes / 2 ** 20}


def _jax_batch(c):
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.key(1234), 3)
    tok = lambda key, n: jax.random.randint(key, (c["B"], n), 1, c["V"], dtype=jnp.int32)   # [B,n], no pad
    if c["arch"] == "decoder_only":
        return {"inputs": tok(k[0], c["T"]), "targets": tok(k[1], c["T"])}
    return {"src": tok(k[0], c["S"]), "tgt_in": tok(k[1], c["T"]), "tgt_out": tok(k[2], c["T"])}


def _median_ms(fn, steps: int, reps: int = 5) -> float:
    import jax
    jax.block_until_ready(fn())
    ts_ = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts_.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(ts_)


TORCH_GROUPS = [("optimizer", r"_foreach|adam"), ("matmul", r"aten::(mm|addmm|bmm|baddbmm|_scaled_dot|linear_back)"),
                ("random bits", r"bernoulli|dropout|rand"),
                ("reductions", r"sum|mean|softmax|norm|var|max|nll|cross_entropy|log_softmax"),
                ("transposes/copies", r"copy_|clone|contiguous|cat|stack|_to_copy")]


def torch_child(name: str, steps: int) -> dict:
    import torch
    import train_step as ts
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    c = ts.CONFIGS[name]
    model = ts.torch_model(c).train()
    matrix = lambda n, p: p.ndim >= 2 and n not in ("emb.weight", "pos")     # as train_step.torch_child
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if matrix(n, p)], "weight_decay": c["wd"]},
                             {"params": [p for n, p in named if not matrix(n, p)], "weight_decay": 0.0}],
                            lr=ts.LR, betas=(ts.B1, c["b2"]))
    tok = lambda n: torch.randint(1, c["V"], (c["B"], n))
    inputs = (tok(c["S"]), tok(c["T"])) if c["arch"] == "encoder_decoder" else (tok(c["T"]),)
    targets = tok(c["T"])

    def run_steps():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(*inputs).reshape(-1, c["V"]), targets.reshape(-1))
            loss.backward()
            opt.step()

    run_steps()
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        run_steps()
        walls.append((time.perf_counter() - t) / steps * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_steps()
    groups = collections.Counter()
    top = collections.Counter()
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3 / steps
        g = next((g for g, pat in TORCH_GROUPS if re.search(pat, ev.key)), "elementwise")
        groups[g] += ms
        top[(ev.key, g)] += ms
    return {"step_ms": statistics.median(walls), "groups_ms": dict(groups),
            "top": [{"op": k[0], "group": k[1], "ms": v} for k, v in top.most_common(12)]}


def run_child(framework: str, name: str, steps: int, env: dict | None = None) -> dict:
    import train_step as ts
    return ts.run_child(framework, name, steps, script=__file__, env=env)


def _against(r: dict, variant: str, field: str) -> tuple[dict, dict] | None:
    """(ours as built, ours in the A/B variant) from one config's results, when both measured `field`."""
    ours, other = r["jax"], r.get(variant, {})
    return (ours, other) if field in ours and field in other else None


def _malloc_line(r: dict) -> list[str]:
    """Ours with glibc's huge-page tunable (as `jaxformer` starts: jaxformer/platforms/launch.py) against malloc as it is."""
    if (pair := _against(r, "jax_default_malloc", "faults_per_step")) is None:
        return []
    ours, plain = pair
    return [f"Memory: with glibc.malloc.hugetlb=1 (how `jaxformer` starts) {ours['faults_per_step']:,.0f} minor page "
            f"faults per step, step {ours['step_ms']:.1f} ms; with malloc as it is (JAXFORMER_MALLOC=default) "
            f"{plain['faults_per_step']:,.0f} faults per step, step {plain['step_ms']:.1f} ms."]


def _no_op_line(ours: dict) -> list[str]:
    """The step's time with no op event open (`gaps`): work the pool runs after an op's event has ended."""
    if "no_op_ms" not in ours:
        return []
    after = ", ".join(f"{a['op']} ({a['group']}) {a['ms']:.1f}" for a in ours["no_op_after"][:3])
    return [f"Not in any op event: {ours['no_op_ms']:.1f} ms of the {ours['step_ms']:.1f} ms step (gaps of 50 µs or "
            f"more while no op event is open on any thread; a dot or YNNPACK fusion hands its work to the thread "
            f"pool and its event ends before the work does, so this is work their rows do not count). Largest "
            f"after (the op before a gap need not own the work running in it): {after} ms/step.", ""]


def _threefry_line(r: dict) -> list[str]:
    """Ours as built (threefry lowered unrolled: jaxformer/platforms/lowering.py) against jax's CPU default lowering."""
    if (pair := _against(r, "jax_rolled_threefry", "op_events_per_step")) is None:
        return []
    ours, rolled = pair
    return [f"Dropout bits: with threefry lowered unrolled (`jaxformer/platforms/lowering.py`, how the step is built) "
            f"{ours['op_events_per_step']:,.0f} op events per step, step {ours['step_ms']:.1f} ms; with jax's CPU "
            f"default, a 5-trip loop per draw (STEP_PROFILE_ROLLED_THREEFRY=1), {rolled['op_events_per_step']:,.0f} "
            f"op events per step, step {rolled['step_ms']:.1f} ms (same bits).", ""]


def _one_core_line(one: dict | None) -> list[str]:
    """Why the one-core column: on 2 threads XLA:CPU runs independent ops side by side, and an op's event also
    spans its waits for a free worker, so op times overlap and over-count cheap ops (fills above all)."""
    if one is None:
        return []
    return ["Ours pinned to one core too (`STEP_PROFILE_ONE_CORE=1`: no op runs beside another; op time "
            f"{sum(one['groups_ms'].values()):.1f} ms for a {one['step_ms']:.1f} ms step): on two threads an op's "
            "event also spans its waits for a free worker, so the two-thread shares over-count cheap ops.", ""]


def _copies_line(ours: dict) -> list[str]:
    """The transposes/copies group split: plain layout copies against copies carrying fused elementwise work."""
    c = ours.get("copies", {})
    if not all(c.get(k, {}).get("elements") for k in ("plain", "with work")):
        return []
    ns = {k: v["ms"] * 1e6 / v["elements"] for k, v in c.items()}
    return [f"Transposes/copies: {c['plain']['ms']:.2f} ms/step in plain layout copies (a transpose or slice and "
            f"nothing else: {ns['plain']:.2f} ns per element written), {c['with work']['ms']:.2f} ms in copies "
            f"carrying their producers' elementwise work ({ns['with work']:.2f} ns per element; "
            "`benchmarks/kernels.py` times that fused form alone)."]


def report(results: dict, command: str) -> str:
    import train_step as ts
    from jaxformer.stats import machine
    lines = ["# Where the train step's time goes", "", f"`{command}`", "", f"Machine: {machine()}", "",
             __doc__.split("\n\n", 2)[2].split("Writes")[0].strip(), ""]
    for name, r in results.items():
        ours, torch_ = r["jax"], r["torch"]
        one = r.get("jax_one_core") if "groups_ms" in r.get("jax_one_core", {}) else None
        lines += [f"## {name}: {ts.describe(ts.CONFIGS[name])}", ""]
        if "error" in ours or "error" in torch_:
            lines += [f"failed: ours {ours.get('error', 'ok')}; torch {torch_.get('error', 'ok')}", ""]
            continue
        lines += [f"Ours: step {ours['step_ms']:.1f} ms, forward alone {ours['forward_ms']:.1f} ms, so backward + "
                  f"update = {(ours['step_ms'] - ours['forward_ms']) / ours['forward_ms']:.1f}× the forward; "
                  f"temporary block {ours['temp_mib']:.0f} MiB. PyTorch: step {torch_['step_ms']:.1f} ms.", "",
                  *_malloc_line(r), "",
                  *_threefry_line(r),
                  *_one_core_line(one),
                  "| group | ours ms/step | share | PyTorch ms/step | share |" + (" ours, one core | share |" if one else ""),
                  "|---|---:|---:|---:|---:|" + ("---:|---:|" if one else "")]
        to, tt = sum(ours["groups_ms"].values()), sum(torch_["groups_ms"].values())
        t1 = sum(one["groups_ms"].values()) if one else 0.0
        for g in GROUPS:
            a, b = ours["groups_ms"].get(g, 0.0), torch_["groups_ms"].get(g, 0.0)
            c = one["groups_ms"].get(g, 0.0) if one else 0.0
            if a or b or c:
                lines.append(f"| {g} | {a:.2f} | {a / to:.0%} | {b:.2f} | {b / tt:.0%} |" +
                             (f" {c:.2f} | {c / t1:.0%} |" if one else ""))
        lines += [f"| **op time** | {to:.2f} | | {tt:.2f} | |" + (f" {t1:.2f} | |" if one else ""),
                  f"| wall (step) | {ours['step_ms']:.2f} | | {torch_['step_ms']:.2f} | |" +
                  (f" {one['step_ms']:.2f} | |" if one else ""), "",
                  "Our twelve most expensive ops (ms/step; source = the jaxpr equation XLA names):", "",
                  "| op | group | ms | source |", "|---|---|---:|---|"]
        lines += [f"| {t['op']} | {t['group']} | {t['ms']:.2f} | `{t['source']}` |" for t in ours["top"]]
        lines += ["", *_copies_line(ours), "", *_no_op_line(ours)]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=["gpt", "base", "tiny"], default=["gpt", "base", "tiny"])
    p.add_argument("--steps", type=int, default=None, help="steps per timed block (default: tiny 50, base 3, gpt 20)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/step_profile"), help="path stem of .md and .json")
    p.add_argument("--child", nargs=3, metavar=("FRAMEWORK", "CONFIG", "STEPS"))
    a = p.parse_args(argv)
    if a.child:
        fw, name, steps = a.child
        if os.environ.get("STEP_PROFILE_ONE_CORE") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})     # before jax starts its thread pool
        print(json.dumps((jax_child if fw == "jax" else torch_child)(name, int(steps))))
        return
    results = {}
    for name in a.configs:
        steps = a.steps or {"tiny": 50, "base": 3, "gpt": 20}[name]
        results[name] = {fw: run_child(fw, name, steps) for fw in ("jax", "torch")}
        results[name]["jax_default_malloc"] = run_child("jax", name, steps, env={"JAXFORMER_MALLOC": "default"})
        if name != "gpt":        # dropout: the unrolled threefry against jax's CPU default
            results[name]["jax_rolled_threefry"] = run_child("jax", name, steps, env={"STEP_PROFILE_ROLLED_THREEFRY": "1"})
        if name == "gpt":        # one core: no op runs beside another, so no op's time includes waits for a worker
            results[name]["jax_one_core"] = run_child("jax", name, steps, env={"STEP_PROFILE_ONE_CORE": "1"})
        print(name, {fw: r.get("step_ms", r.get("error")) for fw, r in results[name].items()}, flush=True)
    command = "python benchmarks/step_profile.py " + " ".join(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    Path(a.out + ".md").write_text(report(results, command.strip()))
    print(f"wrote {a.out}.md")


if __name__ == "__main__":
    main()
