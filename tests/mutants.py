"""Plant the bug you fear: apply each plausible wrong implementation below to a copy of the repository, run the
tests meant to catch it, and report which mutants survive (a survivor is a test still to write).

    .venv/bin/python tests/mutants.py [--only NAME ...] [--out FILE.json]

Each mutant replaces one exact snippet of one file (the script fails loudly if the snippet is gone, so the list
cannot rot silently) and names the pytest selection that must fail on it. The copy is imported through
PYTHONPATH, ahead of the editable install, so the working tree is never touched. The named tests run whatever their
lane (a mutant's killer may be a slow test: CI's slow lane runs it too); `--default-lane` runs them in plain
pytest's lane only (`-m 'not slow and not gpu'`), so a mutant that only a slow test kills survives there. Not
collected by pytest.
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
           "put(self.segments, segments), i", "put(self.segments, jnp.ones_like(segments)), i",
           ("tests/test_attention_inputs.py", "-k", "cached")),
    Mutant("cross-attention-leaks", "cross-attention sees every packed source", "jaxformer/nn/inputs.py",
           "        return ops.segment_mask(self.segments, memory.segments)\n",
           "        return memory.valid[:, None, None, :]\n", ("tests/test_attention_inputs.py", "-k", "seq2seq")),
    Mutant("pallas-drops-segments", "the Pallas kernel gets key padding instead of segment ids",
           "jaxformer/ops/fused.py", "        return jnp.where(valid, mask.k_segments, 0).astype(jnp.int32), True\n",
           "        return valid.astype(jnp.int32), True\n", ("tests/test_attention_inputs.py", "-k", "pallas")),
    Mutant("window-off-by-one", "a window of w sees w+1 positions", "jaxformer/ops/masks.py",
           "k_positions[:, None, :] < window", "k_positions[:, None, :] <= window",
           ("tests/test_attention_inputs.py", "-k", "window")),
    Mutant("embedding-decayed", "AdamW decays the embedding table", "jaxformer/nn/embed.py",
           '(cfg.vocab_size, d), ("vocab", "embed"))', '(cfg.vocab_size, d), ("vocab", "embed"), matrix=True)',
           ("tests/test_train.py", "-k", "weight_decay")),
    Mutant("int4-one-scale", "int4 with one scale per matrix (no per-channel scales, no 128-input blocks)",
           "jaxformer/nn/weights.py", "channelwise_axes=channels, tiled_axes=tiles)",
           "channelwise_axes=(), tiled_axes=None)", ("tests/test_quantize.py",)),
    Mutant("w8a8-float-activations", "w8a8 that never quantizes its activations", "jaxformer/nn/weights.py",
           "        if self.dynamic:\n", "        if False:\n", ("tests/test_quantize.py",)),
    Mutant("exact-match-counts-all", "exact match counts every answer as exact", "jaxformer/inference/evaluate.py",
           "exact += int((real & (pred == want).all(1)).sum())", "exact += int(real.sum())",
           ("tests/test_inference.py", "-k", "exact")),
    Mutant("nan-guard-loss-only", "the NaN guard reads the loss alone", "jaxformer/train/monitor.py",
           '~(jnp.isfinite(m["loss"]) & jnp.isfinite(m["grad_norm"]))', '~jnp.isfinite(m["loss"])',
           ("tests/test_bad_inputs.py", "-k", "gradient")),
    Mutant("dropout-keys-restart", "dropout keys restart from the first step on resume", "jaxformer/train/loop.py",
           "jax.random.fold_in(base_key, step - 1)", "jax.random.fold_in(base_key, step - 1 - p.start)",
           ("tests/test_runs.py", "-k", "truncated-arrays")),
    Mutant("no-clipping", "optim.clip_norm is ignored", "jaxformer/train/optim.py",
           "tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx) if cfg.clip_norm > 0 else tx", "pass",
           ("tests/test_train.py", "-k", "clipping")),
    Mutant("pad-id-unchecked", "model.pad_id may disagree with the tokenizer", "jaxformer/config/run.py",
           "    if pad_id is not None and cfg.model.pad_id != pad_id:\n", "    if False:\n",
           ("tests/test_bad_inputs.py", "-k", "nonsense")),
    Mutant("beam-never-finishes", "beam search keeps extending finished beams", "jaxformer/decode.py",
           "        logp = jnp.where(finished[..., None], only_pad, _no_pad(logp, pad))",
           "        logp = _no_pad(logp, pad)", ("tests/test_decode.py", "-k", "beam")),
    Mutant("overlap-means-equal", "equality decided by overlapping intervals of the two arms",
           "jaxformer/stats.py", "    if -margin < diff.lo and diff.hi < margin:\n",
           "    if diff.lo <= 0 <= diff.hi:\n", ("tests/test_reports.py", "-k", "equivalence")),
    Mutant("pooled-variance", "a pooled-variance (Student) interval where Welch's is claimed", "jaxformer/stats.py",
           "    df = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(ys) - 1))",
           "    df = len(xs) + len(ys) - 2", ("tests/test_reports.py", "-k", "welch")),
    Mutant("tolerance-edges-swapped", "a tolerance verdict that holds when the interval merely touches the range",
           "jaxformer/stats.py", "    if lo <= st.lo and st.hi <= hi:\n", "    if st.lo <= hi and lo <= st.hi:\n",
           ("tests/test_reports.py", "-k", "within")),
    Mutant("second-signal-interrupts", "a second signal interrupts the stop checkpoint", "jaxformer/signals.py",
           '        stderr_line(f"{signal.Signals(signum).name} received while stopping',
           '        raise KeyboardInterrupt\n        stderr_line(f"{signal.Signals(signum).name} received while stopping',
           ("tests/test_runs.py", "-k", "held_not_raised")),
    Mutant("data-state-unchecked", "a data state the pipeline cannot take is restored anyway",
           "jaxformer/train/loop.py", "data=True, check=fits)", "data=True)",
           ("tests/test_runs.py", "-k", "another-shape")),
    Mutant("shared-barrier-names", "both checkpoint managers use orbax's step-named barriers (two processes clash)",
           "jaxformer/checkpoints.py", 'barrier_sync_key_prefix=f"jaxformer_{kind}"', "barrier_sync_key_prefix=None",
           ("tests/test_parallel.py", "-k", "both_managers")),
    Mutant("threshold-on-the-mean", "a threshold claim decided on the mean, not its interval", "jaxformer/stats.py",
           '    return "holds" if st.lo >= x else "does not hold" if st.hi < x else "not resolved"',
           '    return "holds" if st.mean >= x else "does not hold"', ("tests/test_reports.py", "-k", "threshold")),
    Mutant("counts-compared", "more failures decided by comparing the counts, without a test", "jaxformer/stats.py",
           '    return ("holds" if p < 0.05 else "not resolved"), p', '    return "holds", p',
           ("tests/test_reports.py", "-k", "fisher")),
    Mutant("stale-claims-figure", "a claims-table figure that ignores its results file", "tools/claims_table.py",
           "({_times(r['speedup'])}), {_times(_decode_row('base', 1, 256)['speedup'])} at 256",
           "(2.9×), {_times(_decode_row('base', 1, 256)['speedup'])} at 256",
           ("tests/test_reports.py", "-k", "claims_table")),
    Mutant("gemma-norm-plain", "Gemma's (1 + w) norm weights read as plain scales", "jaxformer/hf/mapping.py",
           'one = 1.0 if family in ("gemma", "gemma2") else 0.0', "one = 0.0", ("tests/test_hf.py", "-k", "gemma")),
    Mutant("rope-scaling-ignored", "RoPE scaling read from the config but not applied", "jaxformer/nn/attention.py",
           "rope = lambda x: positional.apply_rope(x, positions, self.cfg.rope.base,  # noqa: E731\n"
           "                                               self.cfg.rope.frequency_scaling())",
           "rope = lambda x: positional.apply_rope(x, positions, self.cfg.rope.base)",
           ("tests/test_hf.py", "-k", "llama")),
    Mutant("qk-norm-after-rope", "QK-norm's scale applied after RoPE", "jaxformer/nn/attention.py",
           "        if layer.rope is None:\n            return rope(q), rope(k)\n",
           "        if layer.rope is None:\n"
           "            qn, kn = (self.q_norm[...], self.k_norm[...]) if self.cfg.attention.qk_norm else (1.0, 1.0)\n"
           "            return rope(q / qn) * qn, rope(k / kn) * kn\n",
           ("tests/test_hf.py", "-k", "qwen3")),
    Mutant("kv-heads-interleaved", "k/v projections split into heads the wrong way round (H, K)",
           "jaxformer/hf/mapping.py", "lambda a: (a.T.reshape(d_in, *out_shape),)",
           "lambda a: (a.T.reshape(d_in, *out_shape[::-1]).swapaxes(-1, -2) if len(out_shape) == 2 else "
           "a.T.reshape(d_in, *out_shape),)", ("tests/test_hf.py", "-k", "imported")),
    Mutant("sliding-window-dropped", "Mistral's sliding_window read but not set", "jaxformer/hf/families.py",
           '        attention["windows"] = (int(r("sliding_window")),)', "        pass",
           ("tests/test_hf.py", "-k", "mistral and imported")),
    Mutant("runtime-in-the-function", "init_from and restore compare the runtime section too (a bf16 or remat "
           "run of the same model refused)", "jaxformer/config/model.py",
           "        return dataclasses.replace(self, runtime=RuntimeConfig(), lora=LoraConfig())",
           "        return dataclasses.replace(self, lora=LoraConfig())",
           ("tests/test_config_sections.py", "-k", "function")),
    Mutant("old-key-dropped", "an old flat key in a run's config.json is dropped (its default used)",
           "jaxformer/configio.py", "        target.setdefault(nkey, value)\n", "        pass\n",
           ("tests/test_config_sections.py", "-k", "old_flat_key")),
    Mutant("sections-unvalidated", "the model does not validate its sections (a bad value set by --set is kept)",
           "jaxformer/config/model.py",
           "        for section in (self.norm, self.rope, self.attention, self.moe, self.ablation, self.runtime, self.lora):\n"
           "            section.validate()\n", "",
           ("tests/test_config.py", "-k", "invalid_fields")),
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
           ("tests/test_moe_model.py", "-k", "they_repeat")),
    Mutant("ema-one-step-late", "the EMA averages the weights from before each update",
           "jaxformer/train/weights.py", "decay * e + (1.0 - decay) * p.astype(jnp.float32), state.ema, new)",
           "decay * e + (1.0 - decay) * p.astype(jnp.float32), state.ema, params)",
           ("tests/test_weights.py", "-k", "ema_averages")),
    Mutant("schedule-free-evaluates-y", "schedule-free AdamW evaluated at its training iterate y, not x",
           "jaxformer/inference/weights.py", '        out["eval"] = with_params(graph, model_state, x)\n',
           '        out["eval"] = model_state\n', ("tests/test_weights.py", "-k", "schedule_free")),
    Mutant("evaluation-overwrites-weights", "the evaluated weights are written into the training state's Variables",
           "jaxformer/inference/weights.py", "model = nnx.merge(graph, model_state, copy=True)",
           "model = nnx.merge(graph, model_state)", ("tests/test_weights.py", "-k", "schedule_free")),
    # issue 45 (V.3): one loader, the evaluated weights as checkpoint items
    Mutant("views-not-saved", "checkpoints keep only model and opt (the views recomputed from the optimizer)",
           "jaxformer/inference/weights.py", "    return {**state, **{k: v for k, v in views.items()",
           "    return {**state, **{k: v for k, v in {}.items()", ("tests/test_weights.py", "-k", "own_item")),
    Mutant("schedule-free-loads-y", "a schedule-free run loads its model item (y), not its averaged iterate",
           "jaxformer/inference/weights.py", '    return "eval" if optim.name == "schedule_free" else "model"',
           '    return "model"', ("tests/test_weights.py", "-k", "own_item")),
    Mutant("legacy-loads-model", "a checkpoint saved before the view items loads the trained weights",
           "jaxformer/inference/restore.py", "abstract, views[item]), restored.step",
           'abstract, restored.items["model"]), restored.step', ("tests/test_weights.py", "-k", "own_item")),
    # issue 45 (V.1): the platform seam
    Mutant("levers-on-every-platform", "a lever gated by nothing but itself: on for GPU and TPU too",
           "jaxformer/platforms/__init__.py", "    return current() in LEVERS[name].on\n", "    return True\n",
           ("tests/test_platforms.py", "-k", "off_platform")),
    Mutant("override-leaks", "an override that outlives its block", "jaxformer/platforms/__init__.py",
           "        _overrides.reset(token)\n", "        pass\n", ("tests/test_platforms.py", "-k", "override")),
    # issue 46 (W): the accelerator levers, each equal to the step without it
    Mutant("chunked-loss-keeps-logits", "the chunked loss keeps every slice's logits for the backward pass",
           "jaxformer/ops/losses.py", "    @jax.checkpoint\n    def one(", "    def one(",
           ("tests/test_accelerator_levers.py", "-k", "one_slice")),
    Mutant("chunked-loss-counts-padding", "the last slice's padding weighted as tokens", "jaxformer/ops/losses.py",
           "        x, targets, w = (jnp.pad(a, ((0, 0), (0, m * c - t)) + ((0, 0),) * (a.ndim - 2)) for a in (x, targets, w))",
           "        x, targets = (jnp.pad(a, ((0, 0), (0, m * c - t)) + ((0, 0),) * (a.ndim - 2)) for a in (x, targets))"
           "\n        w = (targets != pad_id).astype(jnp.float32)",
           ("tests/test_accelerator_levers.py", "-k", "whole_logits")),
    Mutant("fused-gate-up-swapped", "the fused gate/up (and q/k/v) matmul split in the wrong order",
           "jaxformer/nn/params.py", "together(eqs, x, side_by_side(ws), ", "together(eqs, x, side_by_side(ws[::-1]), ",
           ("tests/test_accelerator_levers.py", "-k", "same_loss")),
    Mutant("master-copy-unused", "bfloat16 parameters updated directly, the float32 master copy beside them unused",
           "jaxformer/train/weights.py", "        return (jax.tree.map(lambda m, p: m - p.astype(jnp.float32), master, params),",
           "        return (steps,", ("tests/test_param_dtype.py", "-k", "accumulate or rounded_master")),
    Mutant("constants-rounded", "the sinusoidal table rounded to bfloat16 with the parameters",
           "jaxformer/nn/build.py", "    params = nnx.state(model, nnx.Param)\n", "    params = nnx.state(model)\n",
           ("tests/test_param_dtype.py", "-k", "rounded_master")),
    # issue 47 (M.1): published configs
    Mutant("any-key-accepted", "config.json keys nobody reads accepted silently", "jaxformer/hf/families.py",
           "        return sorted(k for k in self.d if k not in self.read and k not in ACCEPTED and k not in _ROPE_KEYS)",
           "        return []", ("tests/test_hf_formats.py", "-k", "inert")),
    Mutant("inert-value-unchecked", "use_mrope accepted at any value", "jaxformer/hf/families.py",
           "            r.need(key, lambda v, want=value: v == want, f\"only {value!r} changes nothing\")",
           "            r(key)", ("tests/test_hf_formats.py", "-k", "inert")),
    Mutant("yarn-attention-factor-dropped", "YaRN's frequencies without its cos/sin scale",
           "jaxformer/ops/positional.py", "    af = rope_attention_factor(scaling)\n", "    af = 1.0\n",
           ("tests/test_hf_formats.py", "-k", "yarn")),
    Mutant("yarn-ramp-reversed", "YaRN keeping the slow dimensions and interpolating the fast ones",
           "jaxformer/ops/positional.py", "    return inv / s.factor * (1.0 - keep) + inv * keep\n",
           "    return inv * (1.0 - keep) + inv / s.factor * keep\n", ("tests/test_hf_formats.py", "-k", "yarn")),
    Mutant("qwen-window-layers-shifted", "Qwen's sliding layers counted from max_window_layers + 1",
           "jaxformer/hf/families.py", "lambda i: window is not None and i >= k)", "lambda i: window is not None and i > k)",
           ("tests/test_hf_formats.py", "-k", "qwen_sliding")),
    Mutant("gemma2-post-norms-swapped", "Gemma 2's post-attention norm read as the pre-FFN norm (Llama's meaning)",
           "jaxformer/hf/mapping.py", 'STACK + ("res_self", "post_norm", "scale"),\n                          i, one),\n'
           '                    _same(p + "pre_feedforward_layernorm.weight", (d,), STACK + ("res_ffn", "norm", "scale")',
           'STACK + ("res_ffn", "norm", "scale"),\n                          i, one),\n'
           '                    _same(p + "pre_feedforward_layernorm.weight", (d,), STACK + ("res_self", "post_norm", "scale")',
           ("tests/test_hf_formats.py", "-k", "gemma2")),
    Mutant("gemma2-scale-ignored", "query_pre_attn_scalar read but the head size used", "jaxformer/nn/attention.py",
           "(cfg.attention.scale_dim or h) ** -0.5", "h ** -0.5",
           ("tests/test_hf_formats.py", "-k", "gemma2")),
    Mutant("dynamic-ntk-static", "dynamic NTK scaled from the model's whole context, not the call's length",
           "jaxformer/ops/positional.py", "    length = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1.0, m)",
           "    length = jnp.maximum(4.0 * m, m)", ("tests/test_hf_formats.py", "-k", "dynamic")),
    # issue 47 (M.2): downstream evaluation
    Mutant("continuation-off-by-one", "a continuation's tokens scored by the logits one position later",
           "jaxformer/inference/tasks.py", "sl = slice(len(r) - 1 - n, len(r) - 1)", "sl = slice(len(r) - n, len(r))",
           ("tests/test_eval_tasks.py", "-k", "unbatched")),
    Mutant("space-kept-in-context", "the context's trailing space scored as context", "jaxformer/inference/tasks.py",
           "        if spaces:\n            context, continuation", "        if False:\n            context, continuation",
           ("tests/test_eval_tasks.py", "-k", "unbatched")),
    Mutant("acc-norm-unnormalised", "acc_norm the raw log-likelihood's argmax", "jaxformer/inference/tasks.py",
           "per_char = [s / max(1, len(c)) for", "per_char = [s for",
           ("tests/test_eval_tasks.py", "-k", "harness_defines")),
    Mutant("stderr-population", "the standard error of the population (n), not the sample (n - 1)",
           "jaxformer/inference/tasks.py", "/ (n - 1) if n > 1", "/ n if n > 1",
           ("tests/test_eval_tasks.py", "-k", "standard_error")),
    Mutant("chat-default-whitespace", "Jinja's default whitespace handling for chat templates",
           "jaxformer/data/chat.py", "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,",
           "ImmutableSandboxedEnvironment(", ("tests/test_chat.py", "-k", "equals_transformers")),
    Mutant("chat-span-content-only", "an assistant's loss span starting after the template's generation prompt "
           "is dropped", "jaxformer/data/chat.py", "before = self.render(messages[:i], add_generation_prompt=True)",
           "before = self.render(messages[:i + 1])[:len(self.render(messages[:i + 1])) - len(m['content'])]",
           ("tests/test_chat.py", "-k", "spans")),
    # low-rank adapters and supervised fine-tuning
    Mutant("lora-scale-alpha", "the adapter's update scaled by alpha, not alpha / rank", "jaxformer/nn/lora.py",
           "return Adapted(w, a, b, cfg.alpha / cfg.rank, cfg.dropout)", "return Adapted(w, a, b, cfg.alpha, cfg.dropout)",
           ("tests/test_lora.py", "-k", "scale")),
    Mutant("lora-b-random", "B initialised randomly: a fresh adapter changes the model", "jaxformer/nn/lora.py",
           "b = jnp.zeros((*shape[:lead], cfg.rank, *outs), jnp.float32)",
           "b = 0.01 * jax.random.normal(key, (*shape[:lead], cfg.rank, *outs), jnp.float32)",
           ("tests/test_lora.py", "-k", "fresh")),
    Mutant("lora-base-trains", "every parameter trains under model.lora", "jaxformer/nn/lora.py",
           "return nnx.LoRAParam if cfg.lora.rank else nnx.Param", "return nnx.Param",
           ("tests/test_lora.py", "-k", "moves_only")),
    Mutant("lora-merge-unscaled", "merging adds A·B without its scale", "jaxformer/nn/lora.py",
           "return dequantized(self.base).astype(jnp.float32) + self.scale * delta",
           "return dequantized(self.base).astype(jnp.float32) + delta", ("tests/test_lora.py", "-k", "merging")),
    Mutant("lora-dropout-at-eval", "the adapter's input dropout applied without a training stream",
           "jaxformer/nn/lora.py", "return LoraWeight(self.base[...], self.a[...], self.b[...], None, self.scale, self.rate)",
           "return LoraWeight(self.base[...], self.a[...], self.b[...], jax.random.key(0), self.scale, self.rate)",
           ("tests/test_lora.py", "-k", "dropout")),
    Mutant("lora-dropout-unscaled", "the adapter's input dropout keeps its inputs unscaled (not by 1/(1 − rate))",
           "jaxformer/nn/lora.py", "x = jnp.where(keep, x / (1.0 - self.rate), 0).astype(x.dtype)",
           "x = jnp.where(keep, x, 0).astype(x.dtype)", ("tests/test_lora.py", "-k", "expected_update")),
    Mutant("peft-a-reshaped", "PEFT's lora_A [r, in] written as a reshape of A, not its transpose",
           "jaxformer/hf/adapters.py", "np.ascontiguousarray(a.reshape(-1, r).T)", "np.ascontiguousarray(a.reshape(r, -1))",
           ("tests/test_lora.py", "-k", "peft")),
    Mutant("sft-specials-as-text", "a rendered chat's <|im_start|> tokenized as its characters",
           "jaxformer/data/sft.py", "    with tok.reading_special_tokens():", "    if True:",
           ("tests/test_sft.py", "-k", "transformers")),
    Mutant("sft-loss-on-every-token", "the loss on the user's and system's tokens too", "jaxformer/data/sft.py",
           "mask |= (starts >= s) & (starts < e)", "mask |= starts >= 0", ("tests/test_sft.py", "-k", "masks")),
    Mutant("sft-conversations-one-segment", "packed conversations attend to each other", "jaxformer/data/sft.py",
           "            seg[r, at:at + n] = k\n", "            seg[r, at:at + n] = 1\n",
           ("tests/test_sft.py", "-k", "packing")),
    # activation sites
    Mutant("sites-layer-shifted", "a patch told the next layer's index", "jaxformer/nn/stack.py",
           "index = jnp.arange(self.num_layers, dtype=jnp.int32).reshape(groups, n)",
           "index = jnp.arange(1, self.num_layers + 1, dtype=jnp.int32).reshape(groups, n)",
           ("tests/test_sites.py", "-k", "ablating")),
    Mutant("sites-patch-discarded", "a patch computed but its result not what flows on", "jaxformer/nn/sites.py",
           "                value = fn(value, self.layer)\n", "                fn(value, self.layer)\n",
           ("tests/test_sites.py", "-k", "ablating")),
    Mutant("sites-layout-layer-zero", "a decoding layout tells every layer's patch it is layer 0",
           "jaxformer/nn/stack.py", "extra[\"layer\"] = jnp.asarray(i, jnp.int32)",
           "extra[\"layer\"] = jnp.asarray(0, jnp.int32)", ("tests/test_decode_layout.py", "-k", "its_own_index")),
    Mutant("sites-layout-layer-shifted", "a decoding layout tells each layer's patch its neighbour's index",
           "jaxformer/nn/stack.py", "extra[\"layer\"] = jnp.asarray(i, jnp.int32)",
           "extra[\"layer\"] = jnp.asarray(i + 1, jnp.int32)", ("tests/test_decode_layout.py", "-k", "its_own_index")),
    Mutant("sites-captured-before-patch", "a captured site records its value before its patch, not after",
           "jaxformer/nn/sites.py", "        for n, fn in self.hooks.patch:\n            if n == name:\n"
           "                value = fn(value, self.layer)\n        if name in self.hooks.capture:\n"
           "            self.captured[name] = value\n",
           "        if name in self.hooks.capture:\n            self.captured[name] = value\n"
           "        for n, fn in self.hooks.patch:\n            if n == name:\n"
           "                value = fn(value, self.layer)\n", ("tests/test_sites.py", "-k", "ablating")),
    Mutant("attn-out-after-residual", "the attn_out site taken after the residual add (the residual stream)",
           "jaxformer/nn/layers.py", 'x, a = self.res_self(x, lambda y: sites.output("attn_out", self.self_attn(\n'
           '            sites("attn_in", y), mask=ctx.mask, positions=ctx.positions, kv_positions=ctx.kv_positions, '
           'cache=cache,\n            rngs=rngs, sites=sites, layer=settings)), rngs)\n'
           '        x = sites("resid_mid", x)\n',
           'x, a = self.res_self(x, lambda y: self.self_attn(\n'
           '            sites("attn_in", y), mask=ctx.mask, positions=ctx.positions, kv_positions=ctx.kv_positions, '
           'cache=cache,\n            rngs=rngs, sites=sites, layer=settings), rngs)\n'
           '        x = sites("resid_mid", sites("attn_out", x))\n', ("tests/test_sites.py", "-k", "by_hand")),
    Mutant("sites-unknown-accepted", "a misspelt site name captures nothing, silently", "jaxformer/nn/sites.py",
           "        if name not in available:\n", "        if False:\n", ("tests/test_sites.py", "-k", "bad_sites")),
    Mutant("scaling-exponent-sign", "the law's exponent with the wrong sign (x^α)", "jaxformer/scaling.py",
           "    return np.logaddexp(a - alpha * lx, e) - ly\n", "    return np.logaddexp(a + alpha * lx, e) - ly\n",
           ("tests/test_scaling.py", "-k", "exact_law or curve_fit")),
    Mutant("scaling-bootstrap-no-replacement", "the bootstrap draws each arm's runs without replacement",
           "jaxformer/stats.py", "size=len(i), replace=True)", "size=len(i), replace=False)", ("tests/test_scaling.py", "-k", "resample or bootstrap")),
    Mutant("scaling-bootstrap-uncorrected", "the bootstrap resamples seeds without the small-sample rescaling",
           "jaxformer/stats.py", "    scale = np.sqrt(m / np.maximum(m - 1, 1))\n", "    scale = np.ones_like(m)\n",
           ("tests/test_scaling.py", "-k", "standard_error")),
    Mutant("scaling-tokens-without-batch", "a run's tokens forget the batch", "jaxformer/train/flops.py",
           "    tokens = cfg.train.steps * cfg.data.batch_size * cfg.data.block_size\n",
           "    tokens = cfg.train.steps * cfg.data.block_size\n", ("tests/test_scaling.py", "-k", "run_size")),
    Mutant("lens-before-each-layer", "the logit lens reads each layer's input instead of its output",
           "jaxformer/interpret.py", 'capture=("embed", "resid_post"), **forward_kw)\n    resid = jnp.concatenate('
           '[aux["captured"]["embed"][None], aux["captured"]["resid_post"]])',
           'capture=("embed", "resid_pre"), **forward_kw)\n    resid = jnp.concatenate('
           '[aux["captured"]["embed"][None], aux["captured"]["resid_pre"]])', ("tests/test_interpret.py", "-k", "lens")),
    Mutant("lens-skips-final-norm", "the logit lens applies the head without the final norm", "jaxformer/interpret.py",
           "    read = (lambda r: head(norm(r))) if norm is not None else head\n", "    read = head\n",
           ("tests/test_interpret.py", "-k", "lens")),
    Mutant("ablation-heads-transposed", "the head table's layer and head indices swapped", "jaxformer/interpret.py",
           "jax.lax.map(lambda p: loss(state, p[0], p[1]), lh)",
           "jax.lax.map(lambda p: loss(state, p[1] % cfg.num_decoder_layers, p[0] % cfg.num_heads), lh)",
           ("tests/test_interpret.py", "-k", "ablation")),
    Mutant("head-mean-per-position", 'head_ablation(how="mean") averages each position over the batch alone',
           "jaxformer/interpret.py", "z[:, :, head].mean(axis=(0, 1), keepdims=True)",
           "z[:, :, head].mean(axis=0, keepdims=True)", ("tests/test_interpret.py", "-k", "zeroing_that_heads")),
    Mutant("patching-every-layer", "a patching cell writes the clean value at its position in every layer",
           "jaxformer/patching.py", "here = (at == cell[0]) & _selected", "here = (at >= 0) & _selected",
           ("tests/test_patching.py",)),
    Mutant("probe-scored-on-training-rows", "the probe is scored on the rows it was fitted on",
           "jaxformer/interpret.py", "        test = 1.0 - w_tr[:, 0]\n", "        test = w_tr[:, 0]\n",
           ("tests/test_interpret.py", "-k", "probe")),
    Mutant("mup-lr-on-every-parameter", "µP's learning-rate factor scales every parameter's update",
           "jaxformer/train/optim.py", "tx = optax.chain(tx, optax.masked(optax.scale(factor), mask))",
           "tx = optax.chain(tx, optax.scale(factor))", ("tests/test_mup.py", "-k", "one_over_m")),
    Mutant("mup-output-multiplier-inverted", "µP's output logits multiplied by m instead of 1/m",
           "jaxformer/nn/embed.py", "mult = self.cfg.logit_softcap, self.cfg.tie_embeddings, 1.0 / self.cfg.width_mult",
           "mult = self.cfg.logit_softcap, self.cfg.tie_embeddings, self.cfg.width_mult",
           ("tests/test_mup.py", "-k", "own_activations")),
    Mutant("mup-attention-left-at-sp", "µP leaves the attention logits at 1/√H", "jaxformer/nn/attention.py",
           "    return sp * (h0 / h) ** 0.5\n", "    return sp\n", ("tests/test_mup.py", "-k", "own_activations")),
    Mutant("mup-embedding-multiplier-grows", "µP keeps the embedding multiplier √D", "jaxformer/nn/embed.py",
           "            x = x * math.sqrt(self.cfg.d_model / self.cfg.width_mult)",
           "            x = x * math.sqrt(self.cfg.d_model)", ("tests/test_mup.py", "-k", "own_activations")),
    Mutant("generate-patch-prefill-only", "generate_lm patches the prompt's prefill, not the generated steps",
           "jaxformer/decode.py", 'cache=c, mode="decode", patch=patch))', 'cache=c, mode="decode"))', ("tests/test_sites.py", "-k", "every_generated")),
    Mutant("mup-edge-optimum-taken", "a best learning rate at the grid's edge taken as the optimum",
           "jaxformer/mup.py", "    v = np.where(i == 0, -np.inf, np.where(i == len(x) - 1, np.inf, v))\n",
           "    v = np.where((i == 0) | (i == len(x) - 1), x[i], v)\n",
           ("tests/test_mup.py", "-k", "optimum")),
    Mutant("head-table-patches-self-attention", "the cross-attention and encoder head tables zero the decoder's "
           "self-attention heads", "jaxformer/interpret.py", "patch={site: patch}", 'patch={"z": patch}',
           ("tests/test_interpret.py", "-k", "three_head_tables")),
    Mutant("head-table-decoder-depth", "the encoder's head table has the decoder's number of layers",
           "jaxformer/interpret.py", 'layers = cfg.num_encoder_layers if site == "encoder.z" else cfg.num_decoder_layers',
           "layers = cfg.num_decoder_layers", ("tests/test_interpret.py", "-k", "three_head_tables")),
    Mutant("pattern-patch-ignored", "a patched attention pattern is recorded but the heads read the original",
           "jaxformer/nn/attention.py", "ctx = mix(patched, kv).astype(ctx.dtype)", "ctx = ctx",
           ("tests/test_sites.py", "-k", "patched_pattern")),
    Mutant("pattern-heads-grouped-kv-minor", "a patched pattern's query head n reads kv head n % K",
           "jaxformer/nn/attention.py", "w.reshape(b, k, n // k, t, s)", "jnp.swapaxes(w.reshape(b, n // k, k, t, s), 1, 2)",
           ("tests/test_sites.py", "-k", "heads_read")),
    Mutant("mup-router-lr-unscaled", "µP leaves the MoE router's update at SP's (its logits sum over the width)",
           "jaxformer/nn/moe.py", '("embed", None), matrix=True, hidden=True)', '("embed", None), matrix=True)',
           ("tests/test_mup.py", "-k", "one_over_m or fan_in_grows")),
    Mutant("mup-edge-optimum-a-point", "an unbracketed optimum counts as a point at the grid's edge side (±inf), "
           "not as the range beyond the edge's neighbour", "jaxformer/mup.py",
           "    return np.where(v == np.inf, x[-2], v), np.where(v == -np.inf, x[1], v)", "    return v, v",
           ("tests/test_mup.py", "-k", "optimum")),
    Mutant("padding-target-is-token-zero", "a held-out window's padding targets token 0 (a pretrained tokenizer's "
           "real token)", "jaxformer/data/tokens.py", "targets = np.where(seg[:, 1:] != 0, rows[:, 1:], ignore)",
           "targets = rows[:, 1:]", ("tests/test_sft.py", "-k", "held_out")),
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
           "    if a.vocab_size == b.vocab_size:\n        return None",
           ("tests/test_bad_inputs.py", "tests/test_data.py", "-k", "tokenizer")),
    Mutant("corpus-fingerprint-by-path", "a prepared corpus is identified by its path, not its index",
           "jaxformer/data/tokens.py", "hashlib.sha256(index).hexdigest()",
           "hashlib.sha256(str(cfg.path).encode()).hexdigest()", ("tests/test_tokens.py", "-k", "another_corpus")),
    Mutant("forced-family-unchecked", "export-hf --family F writes F's config whatever the model",
           "jaxformer/hf/checkpoint.py", "    check_family(cfg, family)  ", "    pass  # ",
           ("tests/test_export_families.py", "tests/test_export_safety.py", "-k", "every_family or field")),
    Mutant("mistral-window-zero", "a model without a window exported as Mistral with sliding_window 0",
           "jaxformer/hf/expressing.py", 'out["sliding_window"] = cfg.layer_windows()[0] or None',
           'out["sliding_window"] = cfg.layer_windows()[0]',
           ("tests/test_export_families.py", "tests/test_export_safety.py", "-k", "llama or mistral")),
    Mutant("nan-tensor-imported", "a checkpoint tensor holding NaN is loaded", "jaxformer/hf/checkpoint.py",
           "        if not finite.all():", "        if False:", ("tests/test_hf.py", "-k", "nan")),
    Mutant("nan-guard-names-last-saved", "the NaN guard names the newest checkpoint, whose weights gave the NaN",
           "jaxformer/train/monitor.py", "diverged(ckpt, bad - 1, ", "diverged(ckpt, bad, ",
           ("tests/test_bad_inputs.py", "-k", "non_finite or named_good")),
    Mutant("eval-nan-saved", "a NaN held-out loss is logged and saved as a checkpoint",
           "jaxformer/train/loop.py", '        if not math.isfinite(metrics["loss"]):',
           "        if False:", ("tests/test_bad_inputs.py", "-k", "held_out_loss")),
    Mutant("import-blocked-by-config", "import-hf counts a workdir with a config but no checkpoint as a run",
           "jaxformer/train/pretrained.py", "        if run.has_checkpoint():",
           "        if run.config_path.exists() or run.checkpoints_path.exists():",
           ("tests/test_hf.py", "-k", "leaves_its_workdir")),
    Mutant("import-signal-unheld", "import-hf leaves SIGINT to Python (a KeyboardInterrupt anywhere)",
           "jaxformer/train/pretrained.py", '    with Held(until="the import reaches a safe point") as sig:',
           '    with __import__("contextlib").nullcontext(type("S", (), {"received": None})) as sig:',
           ("tests/test_hf.py", "-k", "leaves_its_workdir")),
    # issue 44 (U): Hugging Face formats, pretrained tokenizers, exports
    # killed by test_older_rope_keys_import_with_transformers_logits[rope_scaling_type_linear / _rope_type_llama3]
    Mutant("rope-scaling-key-ignored", "an old-style top-level rope_scaling is not read (rope_parameters only)",
           "jaxformer/hf/families.py", '    if d.get("rope_scaling"):\n', "    if False:\n",
           ("tests/test_hf_formats.py", "-k", "older_rope")),
    # killed by test_older_rope_keys_import_with_transformers_logits[rope_theta]
    Mutant("rope-theta-key-ignored", "a top-level rope_theta is not read (10000 unless in rope_parameters)",
           "jaxformer/hf/families.py", 'theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))',
           'theta = params.pop("rope_theta", 10000.0)', ("tests/test_hf_formats.py", "-k", "older_rope")),
    # killed by test_older_rope_keys_import_with_transformers_logits[rope_scaling_type_linear]
    Mutant("rope-type-key-unread", "an old-style rope_scaling's `type` key is not read (rope_type only)",
           "jaxformer/hf/families.py", 'kind = params.pop("rope_type", params.pop("type", "default"))',
           'kind = params.pop("rope_type", "default")', ("tests/test_hf_formats.py", "-k", "older_rope")),
    # killed by test_gpt2_activation_spellings_import_as_the_function_transformers_runs[gelu-gelu]
    Mutant("gpt2-gelu-as-tanh", "GPT-2's activation_function=gelu (the exact GELU) imported as the tanh GELU",
           "jaxformer/hf/families.py", 'activation={"gelu": "gelu"}.get(r("activation_function"), "gelu_tanh")',
           'activation="gelu_tanh"', ("tests/test_hf_formats.py", "-k", "gpt2_activation")),
    # killed by test_gpt2_activation_spellings_import_as_the_function_transformers_runs[gelu_pytorch_tanh-...]
    Mutant("gpt2-pytorch-tanh-as-exact", "GPT-2's gelu_pytorch_tanh imported as the exact GELU",
           "jaxformer/hf/families.py", 'activation={"gelu": "gelu"}.get(',
           'activation={"gelu": "gelu", "gelu_pytorch_tanh": "gelu"}.get(',
           ("tests/test_hf_formats.py", "-k", "gpt2_activation")),
    # killed by test_gemma_activation_spellings_import_with_transformers_logits[hidden_act_gelu_new]
    Mutant("gemma-gelu-new-refused", "Gemma's hidden_act gelu_new (the same tanh GELU) refused",
           "jaxformer/hf/families.py", '(want, "gelu_new") if family == "gemma" else (want,)', "(want,)",
           ("tests/test_hf_formats.py", "-k", "gemma_activation")),
    # killed by test_a_gemma_hidden_activation_other_than_hidden_act_is_refused
    Mutant("gemma-hidden-activation-unchecked", "Gemma's hidden_activation read but any value accepted",
           "jaxformer/hf/families.py", 'lambda v: v in (None, r("hidden_act"), act()), "hidden_act is',
           'lambda v: True, "hidden_act is', ("tests/test_hf_formats.py", "-k", "hidden_activation_other")),
    # killed by test_export_of_a_model_built_here_writes_its_own_settings[llama_own_eps_theta_head_dim]
    Mutant("export-rms-eps-default", "export writes the family's default rms_norm_eps, not the model's norm_eps",
           "jaxformer/hf/expressing.py", '"rms_norm_eps": cfg.norm.eps,', '"rms_norm_eps": 1e-6,',
           ("tests/test_hf_formats.py", "-k", "built_here")),
    # killed by test_export_of_a_model_built_here_writes_its_own_settings[gpt2_own_eps_tied]
    Mutant("export-gpt2-eps-default", "export writes GPT-2's default layer_norm_epsilon, not the model's norm_eps",
           "jaxformer/hf/expressing.py", '"layer_norm_epsilon": cfg.norm.eps,', '"layer_norm_epsilon": 1e-5,',
           ("tests/test_hf_formats.py", "-k", "built_here")),
    # killed by test_export_of_a_model_built_here_writes_its_own_settings[llama_own_eps_theta_head_dim]
    Mutant("export-rope-theta-default", "export writes rope_theta 10000, not the model's rope_base",
           "jaxformer/hf/expressing.py", 'rope = {"rope_theta": cfg.rope.base,', 'rope = {"rope_theta": 10000.0,',
           ("tests/test_hf_formats.py", "-k", "built_here")),
    # killed by test_a_gpt2_file_as_published_imports[no_prefix_with_mask_buffers]
    Mutant("gpt2-prefix-not-added", "GPT-2 tensor names without `transformer.` are taken as they are",
           "jaxformer/hf/mapping.py", '            name = "transformer." + name\n', "            pass\n",
           ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_gpt2_file_as_published_imports[no_prefix_with_mask_buffers]
    Mutant("gpt2-mask-buffer-kept", "GPT-2's h.i.attn.bias causal-mask buffer is taken for a parameter",
           "jaxformer/hf/mapping.py", 'if name.endswith((".attn.bias", ".attn.masked_bias")) and ".c_attn."',
           'if name.endswith(".attn.masked_bias") and ".c_attn."', ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_gpt2_file_as_published_imports[tied_head_copy]
    Mutant("gpt2-head-copy-prefixed", "a GPT-2 file's lm_head.weight gets the transformer. prefix too",
           "jaxformer/hf/mapping.py", 'if not name.startswith(("transformer.", "lm_head.")):',
           'if not name.startswith("transformer."):', ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_gpt2_file_as_published_imports[no_prefix_with_mask_buffers]
    Mutant("file-names-not-canonical", "the loader ignores canonical_name (a file's names taken as spelled)",
           "jaxformer/hf/checkpoint.py", "canon = canonical_name(name, family)", "canon = name",
           ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_gpt2_file_as_published_imports[no_prefix_with_mask_buffers]
    Mutant("read-by-canonical-name", "tensors are read under their canonical name, not the file's own",
           "jaxformer/hf/checkpoint.py", "self.where[canon] = (file, name)", "self.where[canon] = (file, canon)",
           ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_gpt2_file_as_published_imports[tied_head_copy]
    Mutant("tied-head-copy-refused", "a tied checkpoint's lm_head.weight copy is refused as an unexpected tensor",
           "jaxformer/hf/checkpoint.py", ' and not (tied and n == "lm_head.weight")', "",
           ("tests/test_hf_formats.py", "-k", "gpt2_file")),
    # killed by test_a_bfloat16_export_writes_bfloat16_tensors_and_the_token_ids
    Mutant("export-dtype-ignored", "save_pretrained(dtype=bfloat16) writes float32 tensors",
           "jaxformer/hf/checkpoint.py", ".astype(np_dtype)", ".astype(np.float32)",
           ("tests/test_hf_formats.py", "-k", "bfloat16")),
    # killed by test_a_bfloat16_export_writes_bfloat16_tensors_and_the_token_ids
    Mutant("export-token-ids-dropped", "save_pretrained's token_ids are not written to config.json",
           "jaxformer/hf/checkpoint.py", 'hf.update({"torch_dtype": dtype, **(token_ids or {})})',
           'hf.update({"torch_dtype": dtype})', ("tests/test_hf_formats.py", "-k", "bfloat16")),
    # killed by test_a_pretrained_folders_tokenizer_reads_its_special_ids[gpt2_like / bos_named_not_added]
    Mutant("bos-whenever-named", "a pretrained tokenizer's BOS is config.json's bos_token_id, added or not",
           "jaxformer/data/tokenizers.py", "adds_bos = bos is not None and probe[:1] == [bos] and",
           "adds_bos = bos is not None or probe[:1] == [bos] and", ("tests/test_hf_formats.py", "-k", "special_ids")),
    # killed by test_a_pretrained_folders_tokenizer_reads_its_special_ids[eos_list_first]
    Mutant("eos-last-of-list", "the EOS of an eos_token_id list is its last entry, not its first",
           "jaxformer/data/tokenizers.py", "    first = lambda v: v[0] if isinstance(v, list) and v else v          # noqa: E731\n    eos, bos = first(d.get(",
           "    first = lambda v: v[-1] if isinstance(v, list) and v else v          # noqa: E731\n    eos, bos = first(d.get(",
           ("tests/test_hf_formats.py", "-k", "special_ids")),
    # killed by test_a_pretrained_folders_tokenizer_reads_its_special_ids[eos_config_over_vocab / eos_list_first]
    Mutant("eos-vocab-over-config", "EOS taken from the vocabulary (</s>) instead of config.json's eos_token_id",
           "jaxformer/data/tokenizers.py", 'eos, bos = first(d.get("eos_token_id")), first(d.get("bos_token_id"))',
           'eos, bos = None, first(d.get("bos_token_id"))', ("tests/test_hf_formats.py", "-k", "special_ids")),
    # killed by test_a_pretrained_folders_tokenizer_reads_its_special_ids[llama_like]
    Mutant("pad-from-config", "a pretrained tokenizer's pad_id is config.json's pad_token_id (a real token)",
           "jaxformer/data/tokenizers.py", "HFTokenizer(tok, int(eos), pad_id=-1,",
           'HFTokenizer(tok, int(eos), pad_id=int(d.get("pad_token_id", -1)),',
           ("tests/test_hf_formats.py", "-k", "special_ids")),
    # issue 44 (U): optimizers, MoE router losses, EMA restore, DeepNorm per stack
    # killed by test_muon_steps_its_matrices_by_lr_and_the_rest_by_muon_adam_lr
    Mutant("muon-adam-lr-ignored", "optim.muon_adam_lr read but the AdamW part steps at optim.lr",
           "jaxformer/train/optim.py", "else _scaled(lr, cfg.muon_adam_lr / cfg.lr)\n", "else lr\n",
           ("tests/test_train_pins.py", "-k", "muon_steps")),
    # killed by test_muon_steps_its_matrices_by_lr_and_the_rest_by_muon_adam_lr
    Mutant("muon-adam-lr-inverted", "the AdamW part's lr scaled by lr / muon_adam_lr", "jaxformer/train/optim.py",
           "_scaled(lr, cfg.muon_adam_lr / cfg.lr)", "_scaled(lr, cfg.lr / cfg.muon_adam_lr)",
           ("tests/test_train_pins.py", "-k", "muon_steps")),
    # killed by test_muon_steps_its_matrices_by_lr_and_the_rest_by_muon_adam_lr
    Mutant("muon-matrices-at-adam-lr", "Muon's matrices step at muon_adam_lr too", "jaxformer/train/optim.py",
           "tx = optax.contrib.muon(lr, weight_decay=cfg.weight_decay,",
           "tx = optax.contrib.muon(adam_lr, weight_decay=cfg.weight_decay,",
           ("tests/test_train_pins.py", "-k", "muon_steps")),
    Mutant("muon-adam-part-decays-all", "Muon's AdamW part decays norm scales and embeddings (optax's unmasked "
           "adam_weight_decay)", "jaxformer/train/optim.py",
           "adam_weight_decay=cfg.weight_decay if mask is None else 0.0", "adam_weight_decay=cfg.weight_decay",
           ("tests/test_train_pins.py", "-k", "muon_leaves")),
    # killed by test_muon_decays_its_matrices_by_lr_and_the_head_by_muon_adam_lr
    Mutant("muon-matrices-undecayed", "Muon's matrices get no weight decay (only its AdamW part does)",
           "jaxformer/train/optim.py", "muon(lr, weight_decay=cfg.weight_decay, weight_decay_mask=mask,",
           "muon(lr, weight_decay_mask=mask,", ("tests/test_train_pins.py", "-k", "muon_decays")),
    # killed by test_lion_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("lion-default-betas", "Lion with optax's default b1/b2, not optim.b1/b2", "jaxformer/train/optim.py",
           "optax.lion(lr, b1=cfg.b1, b2=cfg.b2,", "optax.lion(lr,", ("tests/test_train_pins.py", "-k", "lion")),
    # killed by test_lion_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("lion-betas-swapped", "Lion's b1 and b2 swapped", "jaxformer/train/optim.py",
           "optax.lion(lr, b1=cfg.b1, b2=cfg.b2,", "optax.lion(lr, b1=cfg.b2, b2=cfg.b1,",
           ("tests/test_train_pins.py", "-k", "lion")),
    # killed by test_lion_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("lion-decays-everything", "Lion decays norms, biases and embeddings too", "jaxformer/train/optim.py",
           "weight_decay=cfg.weight_decay, mask=mask)\n    if cfg.name == \"muon\"",
           "weight_decay=cfg.weight_decay)\n    if cfg.name == \"muon\"", ("tests/test_train_pins.py", "-k", "lion")),
    # killed by test_schedule_free_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("schedule-free-default-b1", "schedule-free AdamW with optax's default b1, not optim.b1",
           "jaxformer/train/optim.py", "schedule_free(base, learning_rate=lr, b1=cfg.b1)",
           "schedule_free(base, learning_rate=lr)", ("tests/test_train_pins.py", "-k", "schedule_free")),
    # killed by test_schedule_free_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("schedule-free-unclipped", "optim.clip_norm ignored by schedule-free AdamW", "jaxformer/train/optim.py",
           "*([optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else [])", "*[]",
           ("tests/test_train_pins.py", "-k", "schedule_free")),
    # killed by test_schedule_free_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("schedule-free-decays-everything", "schedule-free AdamW decays norms, biases and embeddings too",
           "jaxformer/train/optim.py", "optax.add_decayed_weights(cfg.weight_decay, mask)",
           "optax.add_decayed_weights(cfg.weight_decay)", ("tests/test_train_pins.py", "-k", "schedule_free")),
    # killed by test_schedule_free_uses_its_b1_b2_clipping_and_decay_mask_over_three_steps
    Mutant("schedule-free-default-b2", "schedule-free AdamW's RMS decay fixed at 0.999, not optim.b2",
           "jaxformer/train/optim.py", "optax.scale_by_rms(decay=cfg.b2,", "optax.scale_by_rms(decay=0.999,",
           ("tests/test_train_pins.py", "-k", "schedule_free")),
    # killed by test_accumulated_micro_batches_of_a_moe_model_equal_the_batch_they_repeat (and by
    # test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged, slow)
    Mutant("moe-losses-summed-over-micro-batches", "each micro-batch adds its whole router losses (k× too heavy)",
           "jaxformer/train/step.py", "jax.random.fold_in(rng, i), total, k)", "jax.random.fold_in(rng, i), total)",
           ("tests/test_moe_model.py", "-k", "they_repeat")),
    # killed by test_accumulated_micro_batches_of_a_moe_model_equal_the_batch_they_repeat (and by
    # test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged, slow)
    Mutant("moe-metrics-summed-over-micro-batches", "the logged router losses are the micro-batches' sum",
           "jaxformer/train/step.py", "return (s, jax.tree.map(lambda x: x / k, moe)), grads",
           "return (s, moe), grads", ("tests/test_moe_model.py", "-k", "they_repeat")),
    # killed by test_the_objective_adds_the_router_losses_averaged_over_layers_weighted_and_shared (and
    # by test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged, slow)
    Mutant("moe-losses-summed-over-layers", "the router losses summed over the MoE layers, not averaged",
           "jaxformer/train/step.py", '{"moe_balance": st.balance.mean(), "moe_z": st.z.mean(),',
           '{"moe_balance": st.balance.sum(), "moe_z": st.z.sum(),',
           ("tests/test_moe_model.py", "-k", "weighted_and_shared")),
    # killed by test_the_objective_adds_the_router_losses_averaged_over_layers_weighted_and_shared (and
    # by test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged, slow)
    Mutant("moe-losses-not-shared", "the objective's router losses not divided by the groups",
           "jaxformer/train/step.py",
           'cfg.moe_z_weight * moe["moe_z"]) / shards', 'cfg.moe_z_weight * moe["moe_z"])',
           ("tests/test_moe_model.py", "-k", "weighted_and_shared")),
    # killed by test_the_objective_adds_the_router_losses_averaged_over_layers_weighted_and_shared (and
    # by test_moe_router_losses_under_accumulation_are_each_micro_batchs_averaged, slow)
    Mutant("moe-loss-weights-swapped", "α weighs the z-loss and β the balance loss", "jaxformer/train/step.py",
           'cfg.moe_balance_weight * moe["moe_balance"] + cfg.moe_z_weight * moe["moe_z"]',
           'cfg.moe_z_weight * moe["moe_balance"] + cfg.moe_balance_weight * moe["moe_z"]',
           ("tests/test_moe_model.py", "-k", "weighted_and_shared")),
    # killed by test_moe_router_losses_under_shard_map_are_each_devices_averaged (slow lane)
    Mutant("moe-losses-summed-over-devices", "each device's router losses all-reduced whole (devices× too heavy)",
           "jaxformer/train/step.py", "(model, batch, rng, total,\n", "(model, batch, rng, total, 1,\n",
           ("tests/test_train_pins.py", "-k", "shard_map")),
    # killed by test_moe_router_losses_under_shard_map_are_each_devices_averaged (slow lane)
    Mutant("moe-metrics-summed-over-devices", "the logged router losses are the devices' sum",
           "jaxformer/train/step.py", "moe = jax.lax.pmean(moe, axes)", "moe = jax.lax.psum(moe, axes)",
           ("tests/test_train_pins.py", "-k", "shard_map")),
    # killed by test_a_checkpoint_holds_the_ema_as_its_own_item_and_weights_ema_reads_it (and by
    # test_a_run_restores_the_ema_of_its_saved_per_step_weights, slow)
    Mutant("ema-restores-trained", 'weights="ema" restores the trained weights', "jaxformer/inference/weights.py",
           '    if weights == "ema":\n        return "eval_ema"\n', '',
           ("tests/test_weights.py", "-k", "own_item")),
    # killed by test_the_ema_averages_the_weights_after_each_update_from_the_initial_ones (and by
    # test_a_run_restores_the_ema_of_its_saved_per_step_weights, slow)
    Mutant("ema-starts-at-zero", "the EMA starts from zeros, not the initial weights", "jaxformer/train/weights.py",
           "return EmaState(inner.init(params), jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params))",
           "return EmaState(inner.init(params), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))",
           ("tests/test_weights.py", "-k", "ema_averages")),
    # killed by test_weights_ema_of_a_run_without_an_ema_is_a_named_error (and by
    # test_a_run_restores_the_ema_of_its_saved_per_step_weights, slow)
    Mutant("ema-without-ema-unchecked", 'weights="ema" of a run without an EMA is not refused by name',
           "jaxformer/inference/restore.py", '    if weights == "ema" and not cfg.optim.ema:\n', "    if False:\n",
           ("tests/test_weights.py", "-k", "without_an_ema")),
    # killed by test_an_encoder_decoders_deepnorm_gives_each_stack_its_own_alpha_and_beta (and by
    # test_deepnorm_gives_each_stack_of_an_encoder_decoder_its_own_alpha_and_beta, slow)
    Mutant("deepnorm-encoder-alpha-of-decoder", "the encoder's attention residual scaled by the decoder's α",
           "jaxformer/nn/layers.py", 'self.res_attn = Residual(cfg, stack="encoder", rngs=rngs)',
           "self.res_attn = Residual(cfg, rngs=rngs)", ("tests/test_residuals.py", "-k", "each_stack_its_own")),
    # killed by test_an_encoder_decoders_deepnorm_gives_each_stack_its_own_alpha_and_beta (and by
    # test_deepnorm_gives_each_stack_of_an_encoder_decoder_its_own_alpha_and_beta, slow)
    Mutant("deepnorm-one-alpha", "every residual takes the decoder stack's α", "jaxformer/nn/layers.py",
           "init.deepnorm(cfg, stack)[0]", 'init.deepnorm(cfg, "decoder")[0]',
           ("tests/test_residuals.py", "-k", "each_stack_its_own")),
    # killed by test_an_encoder_decoders_deepnorm_gives_each_stack_its_own_alpha_and_beta (and by
    # test_deepnorm_gives_each_stack_of_an_encoder_decoder_its_own_alpha_and_beta, slow)
    Mutant("deepnorm-encoder-ffn-beta-of-decoder", "the encoder's FFN initialised with the decoder's β",
           "jaxformer/nn/layers.py", 'self.ffn = make_ffn(cfg, moe, rngs, stack="encoder")',
           "self.ffn = make_ffn(cfg, moe, rngs)", ("tests/test_residuals.py", "-k", "each_stack_its_own")),
    # killed by test_an_encoder_decoders_deepnorm_gives_each_stack_its_own_alpha_and_beta (and by
    # test_deepnorm_gives_each_stack_of_an_encoder_decoder_its_own_alpha_and_beta, slow)
    Mutant("deepnorm-n-m-swapped", "the encoder's α and β with N and M swapped", "jaxformer/nn/init.py",
           "0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)",
           "0.81 * (m ** 4 * n) ** (1 / 16), 0.87 * (m ** 4 * n) ** (-1 / 16)",
           ("tests/test_residuals.py", "-k", "each_stack_its_own")),
    # V.5: masks from explicit inputs only
    Mutant("model-infers-pad", "without segment ids the model still treats the pad id as padding",
           "jaxformer/nn/inputs.py", "self.segments, self.valid = None, jnp.ones(tokens.shape, bool)",
           "self.segments, self.valid = None, tokens != cfg.pad_id",
           ("tests/test_explicit_masks.py", "-k", "never_reads")),
    Mutant("adapter-drops-segments", "the encoder-decoder adapter passes positions but not segment ids",
           "jaxformer/arch/seq2seq.py", 'for k in ("positions", "segment_ids")})', 'for k in ("positions",)})',
           ("tests/test_explicit_masks.py", "-k", "digit_batch")),
    Mutant("fill-segments-with-pad-id", "a padded batch's extra rows get segment ids of pad_id",
           "jaxformer/data/tasks.py", 'value = 0 if k.endswith(("segment_ids", "positions")) else pad_id',
           "value = pad_id", ("tests/test_explicit_masks.py", "-k", "fill")),
    Mutant("padding-restarts-document", "a token after padding starts its document again at position 0",
           "jaxformer/ops/masks.py",
           "    prev = jnp.where(last >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last, 0), 1), -1)\n",
           "    prev = jnp.pad(segment_ids[:, :-1], [(0, 0), (1, 0)], constant_values=-1)\n",
           ("tests/test_explicit_masks.py", "-k", "restarts or host_positions")),
    Mutant("prompt-segments-dropped", "generate pads the prompts but never passes their segment ids",
           "jaxformer/arch/lm.py", "                                  segment_ids=segment_ids)",
           "                                  segment_ids=None)", ("tests/test_explicit_masks.py", "-k", "adapters")),
    # V.2: the decoding layout as a value, typed caches
    Mutant("layerwise-take-wrong-axis", "a per-layer cache reorders its rows on the slot axis's neighbour",
           "jaxformer/nn/cache.py", "jax.tree.map(lambda a: jnp.take(a, rows, axis=0), x) for x in t)",
           "jax.tree.map(lambda a: jnp.take(a, rows, axis=1), x) for x in t)",
           ("tests/test_decode_layout.py", "-k", "take_and_cut")),
    Mutant("layout-fused-qkv-unused", "the layout's fused q/k/v matrix never reaches the attention",
           "jaxformer/nn/layout.py", '            _fuse(module, ("wq", "wk", "wv"))', "            pass",
           ("tests/test_decode_layout.py", "-k", "one_matmul")),
    Mutant("layout-w2-unused", "the layout's [out,in] FFN weight never made", "jaxformer/nn/layout.py",
           "p.set_value(OutIn(jnp.transpose(w)))", "pass",
           ("tests/test_decode_layout.py", "-k", "row_by_row")),
    Mutant("cross-kv-of-layer-zero", "an encoder-decoder's cache gives every layer layer 0's cross-attention k/v",
           "jaxformer/nn/layout.py", "for blk in stack.blocks])", "for blk in stack.blocks[:1] * len(stack.blocks)])",
           ("tests/test_decode.py",)),
    # Y: per-layer settings (NoPE layers) from the layer index, in the scan and in cached decoding alike
    Mutant("nope-counted-from-zero", "the NoPE layers are 0, k, 2k (SmolLM3 drops k-1, 2k-1, ...)",
           "jaxformer/config/model.py", "tuple((i + 1) % every != 0 for i in range(layers))",
           "tuple(i % every != 0 for i in range(layers))", ("tests/test_per_layer.py",)),
    Mutant("nope-rotates-k", "a NoPE layer leaves q unrotated but still rotates k", "jaxformer/nn/attention.py",
           "jnp.where(layer.rope, rope(k), k)", "rope(k)", ("tests/test_per_layer.py",)),
    Mutant("nope-encoder-rotates", "the encoder's blocks do not hand their settings to their self-attention",
           "jaxformer/nn/layers.py", "rngs=rngs, sites=sites,\n            layer=settings)), rngs)",
           "rngs=rngs, sites=sites)), rngs)", ("tests/test_per_layer.py",)),
    Mutant("decoding-layer-index-shifted", "cached decoding tells each block its neighbour's index",
           "jaxformer/nn/stack.py", "extra[\"layer\"] = jnp.asarray(i, jnp.int32)",
           "extra[\"layer\"] = jnp.asarray((i + 1) % len(self.blocks), jnp.int32)",
           ("tests/test_per_layer.py", "-k", "cached")),
    Mutant("diff-heads-halves", "differential attention pairs head j with head j + N/2", "jaxformer/nn/differential.py",
           "pairs = w.reshape(b, n // 2, 2, t, s)", "pairs = jnp.swapaxes(w.reshape(b, 2, n // 2, t, s), 1, 2)",
           ("tests/test_differential.py",)),
    Mutant("diff-lambda-init-layer-zero", "every layer's λ_init is layer 0's", "jaxformer/nn/differential.py",
           "self.lam(layer.index)", "self.lam(0)", ("tests/test_differential.py",)),
    Mutant("diff-no-output-scale", "the (1 − λ_init) output scale dropped", "jaxformer/nn/differential.py",
           " * (1.0 - lambda_init(layer.index))", "", ("tests/test_differential.py",)),
    Mutant("settings-without-index", "per-layer settings do not carry the layer index", "jaxformer/nn/per_layer.py",
           "\n                         index=layer)", ")", ("tests/test_differential.py",)),
    Mutant("attention-kind-ignored", "model.attention.kind's class imported but the softmax module built",
           "jaxformer/nn/layers.py", "    cls.check(cfg)\n    return cls\n", "    cls.check(cfg)\n    return MultiHeadAttention\n",
           ("tests/test_attention_variant.py", "tests/test_differential.py")),
    Mutant("attention-kind-unchecked", "the variant's own check never runs", "jaxformer/nn/layers.py",
           "    cls.check(cfg)\n    return cls\n", "    return cls\n", ("tests/test_attention_variant.py",)),
    Mutant("per-layer-rule-ignored", "the per-layer rope rule read but every layer rotates",
           "jaxformer/nn/per_layer.py", "None if rule is None else", "None if rule is None or name == 'rope' else",
           ("tests/test_per_layer.py",)),
    Mutant("sites-discovery-first-only", "discovery records a model-level site but no block's",
           "jaxformer/nn/sites.py", "        if self.hooks.reached is not None:\n",
           "        if self.hooks.reached is not None and self.layer is None:\n",
           ("tests/test_sites.py", "-k", "every_site_is_listed or bad_sites")),
    Mutant("scores-patch-ignored", "a patched attn_scores site is recorded but the softmax reads the old logits",
           "jaxformer/ops/attention.py",
           "        logits = score_mod(logits.reshape(b, n, t, s)).astype(jnp.float32).reshape(b, kh, g, t, s)\n",
           "        score_mod(logits.reshape(b, n, t, s))\n", ("tests/test_sites.py", "-k", "scores")),
    Mutant("scores-unscaled", "the attn_scores site reads q·k before its 1/√H scale", "jaxformer/ops/attention.py",
           "    logits = logits.astype(jnp.float32) * scale\n", "    logits = logits.astype(jnp.float32)\n"
           "    logits = score_mod(logits.reshape(b, n, t, s)).reshape(logits.shape) if score_mod else logits\n"
           "    logits = logits * scale\n    score_mod = None\n", ("tests/test_sites.py", "-k", "scores")),
    # T3: eval-tasks / HarnessModel score as lm-evaluation-harness's HFLM
    Mutant("acc-norm-bytes-swapped", "acc_norm divides by UTF-8 bytes and acc_bytes by characters",
           "jaxformer/inference/tasks.py", '"pick_norm": int(np.argmax(per_char)),\n'
           '                 "pick_bytes": int(np.argmax(per_byte))}', '"pick_norm": int(np.argmax(per_byte)),\n'
           '                 "pick_bytes": int(np.argmax(per_char))}',
           ("tests/test_harness_parity.py", "-k", "divides_by_characters")),
    Mutant("rolling-skips-window-edge", "each rolling window predicts max_len - 1 tokens, skipping one at its edge",
           "jaxformer/inference/tasks.py", "stop = min(end + self.max_len, len(ids))",
           "stop = min(end + self.max_len - 1, len(ids))",
           ("tests/test_harness_parity.py", "-k", "rolling_windows_are_hflms")),
    Mutant("rolling-windows-max-len-minus-one", "rolling windows of max_len - 1 predictions (T3's old rule)",
           "jaxformer/inference/tasks.py", "for end in range(1, len(ids), self.max_len):\n"
           "            stop = min(end + self.max_len, len(ids))", "for end in range(1, len(ids), self.max_len - 1):\n"
           "            stop = min(end + self.max_len - 1, len(ids))",
           ("tests/test_harness_parity.py", "-k", "rolling_windows_are_hflms")),
    Mutant("pair-past-window-short-context", "a pair past the window keeps max_len tokens, one of context less",
           "jaxformer/inference/tasks.py", "rows = [(p + c)[-(self.max_len + 1):] for p, c in chunk]",
           "rows = [(p + c)[-self.max_len:] for p, c in chunk]",
           ("tests/test_harness_parity.py", "-k", "pair_past_the_window_keeps")),
    Mutant("generation-bos-kept-on-top", "a cut prompt keeps its BOS on top of its last max_len - n - 1 tokens",
           "jaxformer/inference/tasks.py", "batch, seg = arch.prompt_batch([x[-room:] for x in",
           "batch, seg = arch.prompt_batch([x[:1] + x[1 - room:] if len(x) > room and self._opening() else "
           "x[-room:] for x in", ("tests/test_harness_parity.py", "-k", "long_prompt_keeps")),
    Mutant("rows-wider-than-max-len", "scoring rows padded to the next power of two past model.max_len",
           "jaxformer/inference/tasks.py", "width = min(self.max_len, 1 << max(1,",
           "width = max(self.max_len, 1 << max(1,",
           ("tests/test_harness_parity.py", "-k", "no_wider_than_max_len")),
    Mutant("generation-largest-max-gen-toks", "every request generates the largest max_gen_toks of the batch",
           "jaxformer/inference/tasks.py", 'groups.setdefault(int(r.args[1].get("max_gen_toks", MAX_GEN_TOKS)), [])',
           'groups.setdefault(max(int(q.args[1].get("max_gen_toks", MAX_GEN_TOKS)) for q in requests), [])',
           ("tests/test_harness_parity.py", "-k", "long_prompt_keeps")),
    Mutant("mup-readout-sp-init", "µP's untied head keeps SP's init N(0, 1/D) (not as at the base width)",
           "jaxformer/nn/init.py", '"head": _normal(base ** -0.5)', '"head": _normal(d ** -0.5)',
           ("tests/test_mup.py", "-k", "each_mup_rule")),
    Mutant("mup-tied-head-unscaled", "µP's output multiplier skips a tied head", "jaxformer/nn/embed.py",
           "out = out * mult if mult != 1.0 else out", "out = out * mult if mult != 1.0 and not tied else out",
           ("tests/test_mup.py", "-k", "tied")),
    Mutant("bootstrap-without-rescaling", "a plain resample of m seeds (variance (m-1)/m of the squared "
           "standard error)", "jaxformer/stats.py", "scale = np.sqrt(m / np.maximum(m - 1, 1))", "scale = 1.0",
           ("tests/test_stats.py",)),
    Mutant("mup-logit-update-from-last-step", "the learned logit update measured from the previous step, not "
           "from init", "jaxformer/mup.py", "z0 = z if z0 is None else z0", "z0, z_prev = z, z0",
           ("tests/test_mup.py", "-k", "logit_update")),
    Mutant("scan-window-of-next-layer", "the scanned stack tells each block the next layer's index (so its window)",
           "jaxformer/nn/stack.py", "index = jnp.arange(self.num_layers, dtype=jnp.int32).reshape(groups, n)",
           "index = (jnp.arange(1, self.num_layers + 1, dtype=jnp.int32) % self.num_layers).reshape(groups, n)",
           ("tests/test_decode_layout.py", "-k", "own_window")),
    Mutant("layout-window-of-layer-zero", "the token loop tells every block it is layer 0 (so layer 0's window)",
           "jaxformer/nn/stack.py", "extra[\"layer\"] = jnp.asarray(i, jnp.int32)",
           "extra[\"layer\"] = jnp.asarray(0, jnp.int32)", ("tests/test_decode_layout.py", "-k", "own_window")),
    Mutant("grid-every-position", "a patching cell restores every position of its layer", "jaxformer/patching.py",
           "    sel = along(pos_axis, position)\n", "    sel = along(pos_axis, -1)\n", ("tests/test_patching.py",)),
    Mutant("grid-pattern-axes-swapped", "a pattern's query axis taken for its head axis", "jaxformer/patching.py",
           "        return 2, 1\n", "        return 1, 2\n", ("tests/test_patching.py",)),
    Mutant("grid-unnormalised", "the grid not divided by metric(clean) − metric(corrupt)", "jaxformer/patching.py",
           "    return (effect / (top - base) if normalize else effect).reshape(shape)",
           "    return effect.reshape(shape)", ("tests/test_patching.py",)),
    Mutant("grid-corrupt-value", "the cell patched with the corrupted run's own value", "jaxformer/patching.py",
           "jnp.where(here, saved[at].astype(value.dtype), value)", "jnp.where(here, value, value)",
           ("tests/test_patching.py",)),
    Mutant("atp-no-difference", "attribution without the (clean − corrupt) factor", "jaxformer/patching.py",
           "contrib = (saved.astype(jnp.float32) - was.astype(jnp.float32)) * grad",
           "contrib = grad + 0 * saved - 0 * was", ("tests/test_patching.py",)),
    Mutant("atp-gradient-at-clean", "the gradient taken at the clean run", "jaxformer/patching.py",
           "(*corrupt, patch={site: fn}, capture=(site,))", "(*clean, patch={site: fn}, capture=(site,))",
           ("tests/test_patching.py",)),
    Mutant("atp-both-unswapped", "a pattern's (layer, position, head) estimate left as (layer, head, position)",
           "jaxformer/patching.py", "if over == \"both\" and head_axis < pos_axis:", "if False:",
           ("tests/test_patching.py",)),
    Mutant("sae-topk-smallest", "TopK keeps the k smallest pre-activations", "jaxformer/sae.py",
           "values, index = jax.lax.top_k(pre, k)", "values, index = jax.lax.top_k(-pre, k)", ("tests/test_sae.py",)),
    Mutant("sae-no-b-dec-in", "b_dec not subtracted before encoding", "jaxformer/sae.py",
           "(x.astype(jnp.float32) - params[\"b_dec\"]) @", "(x.astype(jnp.float32)) @", ("tests/test_sae.py",)),
    Mutant("sae-l1-without-norms", "the L1 term ignores the decoder norms", "jaxformer/sae.py",
           "jnp.sum(f * jnp.linalg.norm(params[\"W_dec\"], axis=-1), -1)", "jnp.sum(f, -1)", ("tests/test_sae.py",)),
    Mutant("sae-auxk-live", "the AuxK loss ranks live latents too", "jaxformer/sae.py",
           "ranked = jnp.where(dead, pre, -jnp.inf)", "ranked = pre", ("tests/test_sae.py",)),
    Mutant("sae-auxk-unscaled", "the AuxK loss not scaled by min(dead / k_aux, 1)", "jaxformer/sae.py",
           "spec.aux * jnp.minimum(n_dead / k_aux, 1.0)", "spec.aux", ("tests/test_sae.py",)),
    Mutant("sae-dead-never-reset", "a latent that fires is not counted alive again", "jaxformer/sae.py",
           "since = jnp.where(parts[\"fired\"], 0, train[\"since_fired\"] + 1)", "since = train[\"since_fired\"] + 1",
           ("tests/test_sae.py",)),
    Mutant("sae-resample-keeps-adam", "resampled latents keep their Adam moments", "jaxformer/sae.py",
           "return state._replace(mu=zero(state.mu), nu=zero(state.nu))", "return state", ("tests/test_sae.py",)),
    Mutant("sae-patch-every-layer", "the SAE patch applies at every layer", "jaxformer/sae.py",
           "jnp.where(at == spec.layer, out.reshape(value.shape).astype(value.dtype), value)",
           "out.reshape(value.shape).astype(value.dtype)",
           ("tests/test_sae.py",)),
    Mutant("sae-error-of-edited", "the kept error term is the edited reconstruction's", "jaxformer/sae.py",
           "(x.astype(jnp.float32) - decode(params, f))", "(x.astype(jnp.float32) - out)", ("tests/test_sae.py",)),
    Mutant("sae-padding-fitted", "padding rows are fitted and counted like real ones", "jaxformer/sae.py",
           "    mean = lambda v: jnp.sum(v * w) / jnp.maximum(jnp.sum(w), 1.0)", "    mean = jnp.mean",
           ("tests/test_sae.py",)),
    Mutant("saelens-layer-zero", "an SAELens folder's layer not read from its hook name (SAELens 6 writes no hook_layer)",
           "jaxformer/saelens.py", "            return site, int(m.group(1))", "            return site, 0",
           ("tests/test_saelens_folders.py",)),
    Mutant("saelens-rescale-ignored", "rescale_acts_by_decoder_norm ignored (SAELens' TopK training default)",
           "jaxformer/saelens.py", "    if cfg.get(\"rescale_acts_by_decoder_norm\"):", "    if False:",
           ("tests/test_saelens_folders.py",)),
    Mutant("saelens-b-dec-unfolded", "apply_b_dec_to_input=false read as true", "jaxformer/saelens.py",
           "w[\"b_enc\"] = w[\"b_enc\"] + w[\"b_dec\"] @ w[\"W_enc\"]", "w[\"b_enc\"] = w[\"b_enc\"]",
           ("tests/test_saelens_folders.py",)),
    Mutant("saelens-pre6-topk-as-relu", "SAELens 5's activation_fn_str topk read as a ReLU SAE", "jaxformer/saelens.py",
           "new[\"architecture\"], new[\"k\"] = \"topk\", kwargs[\"k\"]", "new[\"k\"] = kwargs[\"k\"]",
           ("tests/test_saelens_folders.py",)),
    Mutant("sae-encoder-counts-decoder", "an encoder site's layers counted in the decoder", "jaxformer/nn/models.py",
           "return self.cfg.num_encoder_layers if site.startswith(\"encoder.\") else self.cfg.num_decoder_layers",
           "return self.cfg.num_decoder_layers", ("tests/test_sae.py",)),
    Mutant("sae-patch-layer-unchecked", "a patch for a layer the model lacks runs and changes nothing",
           "jaxformer/nn/models.py", "if at is not None and not 0 <= at < self.site_layers(name):", "if False:",
           ("tests/test_sae.py",)),
    Mutant("sae-z-heads-as-rows", "z's heads read as separate rows instead of one flattened vector", "jaxformer/sae.py",
           "rows = value.reshape(value.shape[0] * value.shape[1], -1)", "rows = value.reshape(-1, value.shape[-1])",
           ("tests/test_sae.py", "tests/test_saelens_folders.py")),
    Mutant("patching-shapes-unpaired", "clean and corrupt inputs of other shapes patched anyway", "jaxformer/patching.py",
           "        if a.shape != b.shape:", "        if False:", ("tests/test_r5_inputs.py",)),
    Mutant("patching-metric-any-shape", "a metric that returns no scalar accepted", "jaxformer/patching.py",
           "    if v.shape != ():", "    if False:", ("tests/test_r5_inputs.py",)),
    Mutant("window-past-int32", "a window past int32 accepted (an overflow inside the first step)",
           "jaxformer/config/sections.py", "            if w >= 2 ** 31:", "            if False:",
           ("tests/test_r5_inputs.py",)),
    Mutant("attribution-abs-normalised", "attribution normalised by |clean − corrupt| (its sign lost)",
           "jaxformer/patching.py", "    return (effect / (top - base) if normalize else effect), top, base\n",
           "    return (effect / jnp.abs(top - base) if normalize else effect), top, base\n",
           ("tests/test_patching.py",)),
    Mutant("grid-abs-normalised", "the patching grid normalised by |clean − corrupt| (its sign lost)",
           "jaxformer/patching.py", "(effect / (top - base) if normalize else effect).reshape(shape)",
           "(effect / jnp.abs(top - base) if normalize else effect).reshape(shape)", ("tests/test_patching.py",)),
    Mutant("sae-topk-keeps-negatives", "TopK keeps negative pre-activations among its k (no ReLU after the choice)",
           "jaxformer/sae.py", "jax.nn.relu(values).reshape(rows.shape[0], k))", "values.reshape(rows.shape[0], k))",
           ("tests/test_sae.py",)),
    Mutant("windows-last-one-extends", "a window pattern's last entry extends over the remaining layers",
           "jaxformer/config/model.py", "tuple(pattern[i % len(pattern)] for i in range(self.num_decoder_layers))",
           "tuple(pattern[min(i, len(pattern) - 1)] for i in range(self.num_decoder_layers))",
           ("tests/test_per_layer.py",)),
    Mutant("mup-pytorch-head-fan-in-d", "µP's untied head under init=pytorch U(±1/√D), SP's fan-in, not U(±1/√D₀)",
           "jaxformer/nn/init.py", '"ffn_out": f, "head": base}', '"ffn_out": f, "head": d}',
           ("tests/test_mup.py",)),
    Mutant("context-keys-local", "context-parallel attention reads only its own device's keys",
           "jaxformer/ops/context.py", "dot_product_attention(q, _gather(k, axis), _gather(v, axis), mask=keys,",
           "dot_product_attention(q, k, v, mask=mask,", ("tests/test_context_parallel.py",)),
    Mutant("pipeline-shifts-backwards", "the stages' outputs shift one stage back (equal to forward at 2 stages)",
           "jaxformer/nn/pipeline.py", "jnp.roll(y, 1, axis=0)", "jnp.roll(y, -1, axis=0)",
           ("tests/test_pipeline.py",)),
    Mutant("encoder-attention-softmax", "the encoder's self-attention is softmax whatever model.attention.kind says",
           "jaxformer/nn/layers.py",
           'self.self_attn = self_attention(cfg)(cfg, self_attention=True, stack="encoder", rngs=rngs)',
           'self.self_attn = MultiHeadAttention(cfg, self_attention=True, stack="encoder", rngs=rngs)',
           ("tests/test_attention_variant.py",)),
    Mutant("pair-context-from-whole", "a pair's context tokens taken from the whole's encoding (lm-eval encodes the "
           "context alone: they differ where the tokenizer merges across the boundary)",
           "jaxformer/inference/tasks.py", "prefix = self._opening() + ctx ",
           "prefix = self._opening() + whole[:len(ctx)] ",
           ("tests/test_harness_parity.py", "-k", "encode_pair or loglikelihood_inside")),
    Mutant("pair-encoded-apart", "a pair's continuation encoded alone (lm-eval's seq2seq rule, not its causal one)",
           "jaxformer/inference/tasks.py", "return prefix, whole[len(ctx):]",
           "return prefix, [int(t) for t in self.tok.encode(continuation)]",
           ("tests/test_harness_parity.py", "-k", "encode_pair or loglikelihood_inside")),
    Mutant("context-mask-local", "the key side of the mask left local while the keys are gathered",
           "jaxformer/ops/context.py", "k_segments=_gather(mask.k_segments, axis))",
           "k_segments=_gather(mask.k_segments, axis))\n    keys = keys._replace(k_positions=jnp.tile("
           "mask.k_positions, (1, k.shape[1] and jax.lax.psum(1, axis))))", ("tests/test_context_parallel.py",)),
    Mutant("sae-run-encoder-valid-from-decoder", "an encoder site's padding read from the decoder input",
           "jaxformer/sae_run.py", 'side = "src" if site.startswith("encoder.") else "tgt"', 'side = "tgt"',
           ("tests/test_viz_patching.py",)),
    Mutant("sae-top-contexts-padding", "top contexts may land on padding positions", "jaxformer/sae_run.py",
           "f = np.asarray(encode(params, x, spec)) * np.asarray(w)[:, None]", "f = np.asarray(encode(params, x, spec))",
           ("tests/test_viz_patching.py",)),
    Mutant("ring-merge-without-lse", "the ring keeps the last block's partial output, not the log-sum-exp merge",
           "jaxformer/ops/context.py", "        out, lse = _merge(out, lse, *flash._forward(sp, q_, k_, v_, m_, None))",
           "        out_b, lse_b = flash._forward(sp, q_, k_, v_, m_, None)\n"
           "        out, lse = jnp.where(jnp.isfinite(lse_b)[..., None], out_b, out), jnp.maximum(lse, lse_b)",
           ("tests/test_context_parallel.py", "-k", "attends_as_one")),
    Mutant("ring-keys-without-positions", "the ring passes keys and values but not their positions",
           "jaxformer/ops/context.py", "return (*_rotate((kb, vb, kk), axis), out, lse), None",
           "return (*_rotate((kb, vb), axis), kk, out, lse), None",
           ("tests/test_context_parallel.py", "-k", "attends_as_one")),
    Mutant("ring-gradients-not-sent-home", "key/value gradients stay where their block was last",
           "jaxformer/ops/context.py", "return (*_rotate((kb, vb, kk, dk + dk_b, dv + dv_b), axis), dq + dq_b), None",
           "return (*_rotate((kb, vb, kk), axis), dk + dk_b, dv + dv_b, dq + dq_b), None",
           ("tests/test_context_parallel.py", "-k", "attends_as_one")),
    Mutant("zigzag-without-positions", "the zigzag order applied to the tokens, positions left to their columns",
           "jaxformer/arch/lm.py", "zigzag(v, devices) if v.ndim >= 2 and v.shape[1] == t else v",
           'zigzag(v, devices) if v.ndim >= 2 and v.shape[1] == t and k != "positions" else v',
           ("tests/test_context_parallel.py", "-k", "language_model")),
    Mutant("ring-never-runs", "parallel.context_attention='ring' accepted but the keys gathered anyway",
           "jaxformer/nn/ring.py", 'plan.cfg.context_attention != "ring"', 'plan.cfg.context_attention != "gather"',
           ("tests/test_context_parallel.py", "-k", "language_model")),
    Mutant("pipeline-no-shift", "the stages' outputs are not passed on to the next stage",
           "jaxformer/nn/pipeline.py", "jnp.roll(y, 1, axis=0)", "y",
           ("tests/test_pipeline.py",)),
    Mutant("pipeline-collects-too-early", "the last stage's output collected one iteration early",
           "jaxformer/nn/pipeline.py", "done = jnp.clip(t - (p - 1), 0, m - 1)", "done = jnp.clip(t - (p - 2), 0, m - 1)",
           ("tests/test_pipeline.py",)),
    Mutant("flash-skip-by-cond", "the chunked forward skips tiles with lax.cond (T² residuals under a layer scan)",
           "jaxformer/ops/flash.py", "return _when(_visible(sp, mask, q0, j), update, carry), None",
           "return jax.lax.cond(_visible(sp, mask, q0, j), update, lambda c: c, carry), None",
           ("tests/test_attention_backends.py", "-k", "keeps_no_tiles")),
    Mutant("windows-ignore-the-layer", "every layer takes the first layer's window", "jaxformer/nn/per_layer.py",
           "jnp.asarray(rule)[layer]", "jnp.asarray(rule)[0]",
           ("tests/test_decode_layout.py", "-k", "own_window")),
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


def run(m: Mutant, tree: Path, markers: str = "slow or not slow") -> dict:
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
                               f"addopts=-m '{markers}'", *m.tests],
                              cwd=tree, env=env, capture_output=True, text=True)
    finally:
        target.write_text(original)
    lines = proc.stdout.strip().splitlines() or [""]
    if proc.returncode == 5 and markers != "slow or not slow":          # every named test is of another lane
        return {"name": m.name, "why": m.why, "killed": False, "tests": " ".join(m.tests),
                "seconds": round(time.perf_counter() - t0, 1), "pytest": f"no test of the lane -m '{markers}'"}
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
    p.add_argument("--default-lane", action="store_true", help="run the named tests of the default lane only")
    args = p.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tree = Path(d)
        copy_tree(tree)
        for m in chosen:
            rows.append(run(m, tree, "not slow and not gpu" if args.default_lane else "slow or not slow"))
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
