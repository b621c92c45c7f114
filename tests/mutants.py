"""Plant the bug you fear: apply each plausible wrong implementation below to a copy of the repository, run the
tests meant to catch it, and report which mutants survive (a survivor is a test still to write).

    .venv/bin/python tests/mutants.py [--only NAME ...] [--out FILE.json]

Each mutant replaces one exact snippet of one file (the script fails loudly if the snippet is gone, so the list
cannot rot silently) and names the pytest selection that must fail on it. The copy is imported through
PYTHONPATH, ahead of the editable install, so the working tree is never touched. The named tests run whatever their
lane (a mutant's killer may be a slow test: CI's slow lane runs it too). Not collected by pytest.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    why: str          # the wrong implementation, in words
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("segments-ignored", "the causal mask ignores document boundaries", "jaxformer/ops/masks.py",
           "        m = m & (q_segments[:, :, None] == k_segments[:, None, :])\n", "        pass\n",
           ("tests/test_attention_inputs.py",)),
    Mutant("positions-do-not-restart", "positions run on across packed documents", "jaxformer/ops/masks.py",
           "    pos = idx - jax.lax.cummax(start, axis=1)\n", "    pos = idx + 0 * start\n",
           ("tests/test_attention_inputs.py",)),
    Mutant("cache-forgets-documents", "the KV cache stores every slot as document 1", "jaxformer/nn/cache.py",
           "put(self.segments, segments.astype(jnp.int32), 1)", "put(self.segments, jnp.ones_like(segments), 1)",
           ("tests/test_attention_inputs.py", "-k", "cached")),
    Mutant("cross-attention-leaks", "cross-attention sees every packed source", "jaxformer/nn/models.py",
           "        return ops.segment_mask(self.segments, memory.segments)\n",
           "        return memory.valid[:, None, None, :]\n", ("tests/test_attention_inputs.py", "-k", "seq2seq")),
    Mutant("pallas-drops-segments", "the Pallas kernel gets key padding instead of segment ids",
           "jaxformer/ops/fused.py", "        return jnp.where(valid, mask.k_segments, 0).astype(jnp.int32), True\n",
           "        return valid.astype(jnp.int32), True\n", ("tests/test_attention_inputs.py", "-k", "pallas")),
    Mutant("window-off-by-one", "a window of w sees w+1 positions", "jaxformer/ops/masks.py",
           "k_positions[:, None, :] < window", "k_positions[:, None, :] <= window",
           ("tests/test_attention_inputs.py", "-k", "window")),
    Mutant("embedding-decayed", "AdamW decays the embedding table", "jaxformer/nn/models.py",
           '(cfg.vocab_size, d), ("vocab", "embed"))', '(cfg.vocab_size, d), ("vocab", "embed"), matrix=True)',
           ("tests/test_train.py", "-k", "weight_decay")),
    Mutant("int4-one-scale", "int4 with one scale per matrix (no per-channel scales, no 128-input blocks)",
           "jaxformer/quantize.py", "channelwise_axes=channels, tiled_axes=tiles)",
           "channelwise_axes=(), tiled_axes=None)", ("tests/test_quantize.py",)),
    Mutant("w8a8-float-activations", "w8a8 that never quantizes its activations", "jaxformer/quantize.py",
           "        if self.dynamic:\n", "        if False:\n", ("tests/test_quantize.py",)),
    Mutant("exact-match-counts-all", "exact match counts every answer as exact", "jaxformer/inference/evaluate.py",
           "exact += int((real & (pred == want).all(1)).sum())", "exact += int(real.sum())",
           ("tests/test_inference.py", "-k", "exact")),
    Mutant("nan-guard-loss-only", "the NaN guard reads the loss alone", "jaxformer/train/loop.py",
           '~(jnp.isfinite(m["loss"]) & jnp.isfinite(m["grad_norm"]))', '~jnp.isfinite(m["loss"])',
           ("tests/test_bad_inputs.py", "-k", "gradient")),
    Mutant("dropout-keys-restart", "dropout keys restart from the first step on resume", "jaxformer/train/loop.py",
           "jax.random.fold_in(base_key, step - 1)", "jax.random.fold_in(base_key, step - 1 - p.start)",
           ("tests/test_train.py", "-k", "dropout")),
    Mutant("no-clipping", "optim.clip_norm is ignored", "jaxformer/train/step.py",
           "optax.chain(optax.clip_by_global_norm(cfg.clip_norm), base)", "base",
           ("tests/test_train.py", "-k", "clipping")),
    Mutant("pad-id-unchecked", "model.pad_id may disagree with the tokenizer", "jaxformer/config.py",
           "    if pad_id is not None and cfg.model.pad_id != pad_id:\n", "    if False:\n",
           ("tests/test_bad_inputs.py", "-k", "nonsense")),
    Mutant("beam-never-finishes", "beam search keeps extending finished beams", "jaxformer/decode.py",
           "        logp = jnp.where(finished[..., None], only_pad, _no_pad(logp, pad))",
           "        logp = _no_pad(logp, pad)", ("tests/test_decode.py", "-k", "beam")),
    Mutant("overlap-means-equal", "equality decided by overlapping intervals of the two arms",
           "jaxformer/verdicts.py", "    if -margin < diff.lo and diff.hi < margin:\n",
           "    if diff.lo <= 0 <= diff.hi:\n", ("tests/test_reports.py", "-k", "equivalence")),
    Mutant("pooled-variance", "a pooled-variance (Student) interval where Welch's is claimed", "jaxformer/verdicts.py",
           "    df = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(ys) - 1))",
           "    df = len(xs) + len(ys) - 2", ("tests/test_reports.py", "-k", "welch")),
    Mutant("tolerance-edges-swapped", "a tolerance verdict that holds when the interval merely touches the range",
           "jaxformer/verdicts.py", "    if lo <= st.lo and st.hi <= hi:\n", "    if st.lo <= hi and lo <= st.hi:\n",
           ("tests/test_reports.py", "-k", "within")),
    Mutant("second-signal-interrupts", "a second signal interrupts the stop checkpoint", "jaxformer/signals.py",
           '        stderr_line(f"{signal.Signals(signum).name} received while stopping',
           '        raise KeyboardInterrupt\n        stderr_line(f"{signal.Signals(signum).name} received while stopping',
           ("tests/test_runs.py", "-k", "SIGHUP")),
    Mutant("data-state-unchecked", "a data state the pipeline cannot take is restored anyway",
           "jaxformer/train/loop.py", "data=True, check=fits)", "data=True)",
           ("tests/test_runs.py", "-k", "another-shape")),
    Mutant("shared-barrier-names", "both checkpoint managers use orbax's step-named barriers (two processes clash)",
           "jaxformer/checkpoints.py", 'barrier_sync_key_prefix=f"jaxformer_{kind}"', "barrier_sync_key_prefix=None",
           ("tests/test_parallel.py", "-k", "both_managers")),
    Mutant("threshold-on-the-mean", "a threshold claim decided on the mean, not its interval", "jaxformer/verdicts.py",
           '    return "holds" if st.lo >= x else "does not hold" if st.hi < x else "not resolved"',
           '    return "holds" if st.mean >= x else "does not hold"', ("tests/test_reports.py", "-k", "threshold")),
    Mutant("counts-compared", "more failures decided by comparing the counts, without a test", "jaxformer/verdicts.py",
           '    return ("holds" if p < 0.05 else "not resolved"), p', '    return "holds", p',
           ("tests/test_reports.py", "-k", "fisher")),
    Mutant("stale-claims-figure", "a claims-table figure that ignores its results file", "benchmarks/claims_table.py",
           "({_times(r['speedup'])}), {_times(_decode_row('base', 1, 256)['speedup'])} at 256",
           "(2.9×), {_times(_decode_row('base', 1, 256)['speedup'])} at 256",
           ("tests/test_reports.py", "-k", "claims_table")),
    Mutant("gemma-norm-plain", "Gemma's (1 + w) norm weights read as plain scales", "jaxformer/hf/mapping.py",
           'one = 1.0 if family == "gemma" else 0.0', "one = 0.0", ("tests/test_hf.py", "-k", "gemma")),
    Mutant("rope-scaling-ignored", "RoPE scaling read from the config but not applied", "jaxformer/nn/attention.py",
           "positional.apply_rope(x, positions, self.cfg.rope_base, self.cfg.rope())",
           "positional.apply_rope(x, positions, self.cfg.rope_base)", ("tests/test_hf.py", "-k", "llama")),
    Mutant("qk-norm-after-rope", "QK-norm applied after RoPE", "jaxformer/nn/attention.py",
           "            return positional.apply_rope(x, positions, self.cfg.rope_base, self.cfg.rope())\n        return x",
           "            x = positional.apply_rope(x, positions, self.cfg.rope_base, self.cfg.rope())\n"
           "        return norms.rms_norm(x, getattr(self, norm)[...], self.cfg.norm_eps) if self.cfg.qk_norm else x",
           ("tests/test_hf.py", "-k", "qwen3")),
    Mutant("kv-heads-interleaved", "k/v projections split into heads the wrong way round (H, K)",
           "jaxformer/hf/mapping.py", "lambda a: (a.T.reshape(d_in, *out_shape),)",
           "lambda a: (a.T.reshape(d_in, *out_shape[::-1]).swapaxes(-1, -2) if len(out_shape) == 2 else "
           "a.T.reshape(d_in, *out_shape),)", ("tests/test_hf.py", "-k", "imported")),
    Mutant("sliding-window-dropped", "Mistral's sliding_window read but not set", "jaxformer/hf/families.py",
           '            kw["attention_windows"] = (int(r("sliding_window")),)', "            pass",
           ("tests/test_hf.py", "-k", "mistral and imported")),
    Mutant("init-from-ignored", "train.init_from read but the run starts from a random init", "jaxformer/train/loop.py",
           "            if cfg.train.init_from:                         # fine-tuning", "            if False:  #",
           ("tests/test_train.py", "-k", "init_from")),
    Mutant("softcap-backward-uncapped", "the chunked backward ignores the soft-cap's slope", "jaxformer/ops/flash.py",
           "dr = ds if dcap is None else ds * dcap", "dr = ds", ("tests/test_stability.py", "-k", "chunked")),
    Mutant("z-loss-on-the-nll", "z-loss squared into the reported nll instead of added to the objective",
           "jaxformer/ops/losses.py", "        objective = objective + z_loss * jnp.square(log_z)\n",
           "        nll = nll + z_loss * jnp.square(log_z)\n", ("tests/test_stability.py", "-k", "z_loss")),
    Mutant("accumulate-unweighted", "micro-batches each normalised by their own tokens (equal weights)",
           "jaxformer/train/step.py", "jax.random.fold_in(rng, i), total, k)", "jax.random.fold_in(rng, i), None, k)",
           ("tests/test_optimizers.py", "-k", "accumulated")),
    Mutant("ema-one-step-late", "the EMA averages the weights from before each update",
           "jaxformer/train/weights.py", "decay * e + (1.0 - decay) * p.astype(jnp.float32), state.ema, new)",
           "decay * e + (1.0 - decay) * p.astype(jnp.float32), state.ema, params)",
           ("tests/test_weights.py", "-k", "ema_averages")),
    Mutant("schedule-free-evaluates-y", "schedule-free AdamW evaluated at its training iterate y, not x",
           "jaxformer/train/weights.py", '        out["eval"] = _with_params(graphs.model, state["model"], x)\n',
           '        out["eval"] = state["model"]\n', ("tests/test_weights.py", "-k", "schedule_free_adamw")),
    Mutant("evaluation-overwrites-weights", "the evaluated weights are written into the training state's Variables",
           "jaxformer/train/weights.py", "model = nnx.merge(graph, model_state, copy=True)",
           "model = nnx.merge(graph, model_state)", ("tests/test_weights.py", "-k", "schedule_free_adamw")),
    # issue 50 (R3): the silent wrong results, each pinned by the test that failed on the code before it
    Mutant("partial-removed-unmarked", "data prepare removes an OUT.partial it did not make",
           "jaxformer/data/prepare.py", "        if not (tmp / MARK).is_file():\n            raise DataError(",
           "        if False:\n            raise DataError(", ("tests/test_prepare.py", "-k", "partial or marked")),
    Mutant("text-bytes-as-characters", "a split's text bytes counted as characters",
           "jaxformer/data/prepare.py", '            w.text_bytes += len(p.text.encode("utf-8"))',
           "            w.text_bytes += len(p.text)", ("tests/test_prepare.py", "-k", "round_trips")),
    Mutant("special-tokens-from-text", "the text <pad> / <eod> encodes as the special ids",
           "jaxformer/data/tokenizers.py", "        tok.encode_special_tokens = True", "        pass",
           ("tests/test_prepare.py", "-k", "special")),
    Mutant("tokenizers-compared-by-size", "init_from compares the tokenizers' vocabulary sizes only",
           "jaxformer/data/tokenizers.py", "    if da == db:\n        return None",
           "    if a.vocab_size == b.vocab_size:\n        return None", ("tests/test_bad_inputs.py", "-k", "tokenizer")),
    Mutant("corpus-fingerprint-by-path", "a prepared corpus is identified by its path, not its index",
           "jaxformer/data/tokens.py", "hashlib.sha256(index).hexdigest()",
           "hashlib.sha256(str(cfg.path).encode()).hexdigest()", ("tests/test_tokens.py", "-k", "another_corpus")),
    Mutant("forced-family-unchecked", "export-hf --family F writes F's config whatever the model",
           "jaxformer/hf/checkpoint.py", "    check_family(cfg, family)  ", "    pass  # ",
           ("tests/test_export_families.py", "-k", "every_family")),
    Mutant("mistral-window-zero", "a model without a window exported as Mistral with sliding_window 0",
           "jaxformer/hf/families.py", 'out["sliding_window"] = cfg.layer_windows()[0] or None',
           'out["sliding_window"] = cfg.layer_windows()[0]', ("tests/test_export_families.py", "-k", "llama")),
    Mutant("nan-tensor-imported", "a checkpoint tensor holding NaN is loaded", "jaxformer/hf/checkpoint.py",
           "        if not finite.all():", "        if False:", ("tests/test_hf.py", "-k", "nan")),
    Mutant("nan-guard-names-last-saved", "the NaN guard names the newest checkpoint, whose weights gave the NaN",
           "jaxformer/train/loop.py", "_diverged(ckpt, bad - 1, ", "_diverged(ckpt, bad, ",
           ("tests/test_bad_inputs.py", "-k", "non_finite or named_good")),
    Mutant("eval-nan-saved", "a NaN held-out loss is logged and saved as a checkpoint",
           "jaxformer/train/loop.py", '                        if not math.isfinite(metrics["loss"]):',
           "                        if False:", ("tests/test_bad_inputs.py", "-k", "held_out_loss")),
    Mutant("import-blocked-by-config", "import-hf counts a workdir with a config but no checkpoint as a run",
           "jaxformer/train/pretrained.py", "    if run.has_checkpoint():\n        raise RunDirError",
           "    if run.config_path.exists() or run.checkpoints_path.exists():\n        raise RunDirError",
           ("tests/test_hf.py", "-k", "leaves_its_workdir")),
    Mutant("import-signal-unheld", "import-hf leaves SIGINT to Python (a KeyboardInterrupt anywhere)",
           "jaxformer/train/pretrained.py", '    with Held(until="the import reaches a safe point") as sig:',
           '    with __import__("contextlib").nullcontext(type("S", (), {"received": None})) as sig:',
           ("tests/test_hf.py", "-k", "leaves_its_workdir")),
)


def copy_tree(dest: Path) -> None:
    """The files git tracks plus the untracked ones it does not ignore, as they are in the working tree."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    for rel in filter(None, out):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run(m: Mutant, tree: Path) -> dict:
    target = tree / m.path
    original = target.read_text()
    if original.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: its snippet occurs {original.count(m.old)} times in {m.path}; update "
                         f"tests/mutants.py")
    target.write_text(original.replace(m.old, m.new))
    t0 = time.perf_counter()
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o",
                               "addopts=-m 'slow or not slow'", *m.tests],
                              cwd=tree, env=env, capture_output=True, text=True)
    finally:
        target.write_text(original)
    lines = proc.stdout.strip().splitlines() or [""]
    if proc.returncode not in (0, 1):        # not a test verdict: the mutant broke collection (a bad snippet)
        raise SystemExit(f"mutant {m.name}: pytest exited {proc.returncode} (no test verdict):\n" +
                         "\n".join(lines[-15:]))
    summary = next((x for x in reversed(lines) if " passed" in x or " failed" in x), lines[-1])
    return {"name": m.name, "why": m.why, "killed": proc.returncode == 1, "tests": " ".join(m.tests),
            "seconds": round(time.perf_counter() - t0, 1), "pytest": summary.strip("= ")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="+", help="mutant names")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tree = Path(d)
        copy_tree(tree)
        for m in chosen:
            rows.append(run(m, tree))
            r = rows[-1]
            print(f"{'killed  ' if r['killed'] else 'SURVIVED'} {r['name']:26} {r['seconds']:6.1f}s  {r['pytest']}",
                  flush=True)
    survivors = [r["name"] for r in rows if not r["killed"]]
    print(f"{len(rows) - len(survivors)}/{len(rows)} mutants killed" + (f"; survivors: {survivors}" if survivors
                                                                        else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
