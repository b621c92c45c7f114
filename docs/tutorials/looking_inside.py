# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Looking inside a trained model
#
# A model that reverses digit strings ([7,1,4] -> [4,1,7], seed article 004) is trained for a minute, then
# opened up with jaxformer's interpretability tools: the activations it computes on the way (`capture=`), the
# logit lens (what each layer would answer if the output head read it there), and activation patching (which
# activations carry one particular digit from the input to the output), beside attribution patching's
# one-backward-pass estimate of the same thing. Every question is asked of the model call itself, through its
# named activation sites (`jaxformer/nn/sites.py`); nothing here reaches into the model's modules.
#
# Run it as a script (`python docs/tutorials/looking_inside.py`) or as a notebook (`jupytext --to ipynb`).

# %% [markdown]
# ## Train a digit reverser
#
# `configs/reverse.py` is a Pre-LN encoder-decoder (2 encoder and 2 decoder layers, width 64, 4 heads) trained on
# 1000 strings of 3 to 6 digits. 600 steps instead of its 1500 are enough for it to reverse the held-out strings
# (a disjoint set of 500) almost always; `train` evaluates them once, at the end, by greedy decoding.

# %% tags=["remove_input"]
# Setup, its source hidden on the site. As a notebook this runs from docs/tutorials: work from the repository
# root, where configs/ is. In a notebook kernel without ipywidgets, importing the training loop (which imports
# tqdm.auto for its progress bar, off here) warns "IProgress not found" on stderr: silenced, not needed.
import os
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")
if not Path("configs").is_dir():
    os.chdir(Path.cwd().parents[1])

# %%
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxformer.configio import apply_overrides, load_config_file
from jaxformer.data import build_task
from jaxformer.data.tasks import encode_digit_pairs
from jaxformer.decode import generate_seq2seq
from jaxformer.inference import load_model
from jaxformer.interpret import logit_lens
from jaxformer.patching import attribution_patching, patching_grid
from jaxformer.train.loop import train

cfg = apply_overrides(load_config_file("configs/reverse.py"),
                      ["train.steps=600", "train.eval_every=600", "train.checkpoint_every=600",
                       "train.num_examples=0"])
workdir = Path(tempfile.mkdtemp()) / "reverse"
t0 = time.perf_counter()
result = train(cfg, workdir, progress="none")
print(f"trained {result['step']} steps in {time.perf_counter() - t0:.0f} s; held-out exact match "
      f"{result['eval']['exact_match']:.3f}, token accuracy {result['eval']['token_accuracy']:.4f}")

# %% [markdown]
# `load_model` restores the model alone (no optimizer, no training data) from the run directory's config,
# tokenizer and checkpoint. The tokenizer is the digit one: 0 = padding, 1 = BOS, 2 = EOS, digit d = d + 3. The
# held-out strings are rebuilt from the saved config (the data are a seeded draw) and run through the model
# teacher-forced, as one batch: source = digits + EOS, decoder input = BOS + the reversed digits, target = the
# reversed digits + EOS. Segment ids say which positions are padding.

# %%
run = load_model(workdir, "best")
model, tok = run.model, run.tokenizer
print(f"restored the {run.which} checkpoint (step {run.step}): {type(model).__name__}, "
      f"{model.cfg.num_encoder_layers} encoder + {model.cfg.num_decoder_layers} decoder layers, "
      f"{model.cfg.num_heads} heads")

held = {k: jnp.asarray(v) for k, v in build_task(run.cfg.data, tok).eval.items()}
src, tgt_in, tgt_out = held["src"], held["tgt_in"], held["tgt_out"]
kw = dict(src_segment_ids=held["src_segment_ids"], tgt_segment_ids=held["tgt_segment_ids"])
scored = held["tgt_segment_ids"] > 0                          # [B,T]: the answer's digits and its EOS
digits = np.asarray(held["src_segment_ids"].sum(1) - 1)       # [B]: each source's number of digits

answers = generate_seq2seq(model, src[:4], max_new=src.shape[1], bos_id=tok.bos_id, eos_id=tok.eos_id,
                           segment_ids=held["src_segment_ids"][:4])
for s, a in zip(np.asarray(src[:4]), np.asarray(answers)):
    print(f"  {tok.decode(s):>7s} -> {tok.decode(a)}")

# %% [markdown]
# ## Capture: what the model computes on the way
#
# `model(src, tgt, capture=(...))` returns, beside the logits, every named activation asked for in
# `aux["captured"]`: a per-layer site stacked over the layers ([L, ...]), a model-level one as it is.
# `model.sites()` lists them all. For an encoder-decoder the decoder's sites have the plain names, its
# cross-attention's start with `cross_` and the encoder's with `encoder.`; `memory` is the encoder's output.

# %%
print(len(model.sites()), "sites, e.g.", ", ".join(model.sites()[:6]), "...")
logits, aux = model(src, tgt_in, capture=("resid_post", "pattern", "cross_pattern", "encoder.pattern", "memory"),
                    **kw)
for name, value in aux["captured"].items():
    print(f"  {name:16s} {tuple(value.shape)}")
teacher = (jnp.argmax(logits, -1) == tgt_out) | ~scored
print(f"teacher-forced: every answer token right in {float(teacher.all(1).mean()):.3f} of the held-out strings")

# %% [markdown]
# Reversal has a simple algorithm: the decoder's output j is source digit n − 1 − j (of n), so some
# cross-attention head should look, from decoder position j, at source position n − 1 − j: the anti-diagonal.
# Below, each cross-attention head's average weight on that mirrored source position over the held-out strings,
# and the cross-attention maps of one string (rows: decoder positions, BOS first; columns: source positions,
# EOS last).

# %%
cross = np.asarray(aux["captured"]["cross_pattern"])           # [L,B,N,T,S]
L, B, N, T, S = cross.shape
j = np.arange(T)[None, :]
mirror = digits[:, None] - 1 - j                                # [B,T]: the source position output j copies
copies = mirror >= 0                                            # decoder positions that emit a digit
on_mirror = np.take_along_axis(cross, np.clip(mirror, 0, S - 1)[None, :, None, :, None], -1)[..., 0]  # [L,B,N,T]
mirror_mass = (on_mirror * copies[None, :, None]).sum((1, 3)) / copies.sum()                        # [L,N]
for layer in range(L):
    print(f"decoder layer {layer}: weight on the mirrored source digit, per head:",
          " ".join(f"{m:.2f}" for m in mirror_mass[layer]))

example = int(np.argmax(digits == digits.max()))              # a longest held-out string
n = int(digits[example])
src_labels = [tok.decode([t]) or "EOS" for t in np.asarray(src[example, :n + 1])]
tgt_labels = ["BOS"] + [tok.decode([t]) for t in np.asarray(tgt_in[example, 1:n + 1])]
fig, axes = plt.subplots(L, N, figsize=(2.2 * N, 2.2 * L), layout="constrained")
for layer in range(L):
    for head in range(N):
        ax = axes[layer, head]
        ax.imshow(cross[layer, example, head, :n + 1, :n + 1], vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"layer {layer} head {head}", fontsize=8)
        ax.set_xticks(range(n + 1), src_labels, fontsize=7)
        ax.set_yticks(range(n + 1), tgt_labels, fontsize=7)
fig.suptitle(f"cross-attention of {tok.decode(src[example])} -> {tok.decode(tgt_out[example])}", fontsize=9)
plt.show()

# %% [markdown]
# The anti-diagonal is there: in the last decoder layer every head puts most of its weight, from decoder position
# j, on source digit n − 1 − j, the one that output copies (BOS, the first row, looks at the last digit). The
# first layer's heads do so more loosely, spreading weight onto the neighbours. Several heads doing the same job
# is common in a model this over-sized for its task, and it shows again in the patching below.

# %% [markdown]
# ## The logit lens: what each decoder layer would answer
#
# `jaxformer.interpret.logit_lens` reads the decoder's residual stream before its first layer (`embed`) and after
# each layer (`resid_post`) with the model's own output head (through the final norm): [L+1, B, T, V]. Its
# last row is the model's logits. Where does the right answer appear?

# %%
lens = jax.nn.softmax(logit_lens(model, src, tgt_in, **kw))                           # [L+1,B,T,V]
p_right = jnp.take_along_axis(lens, jnp.broadcast_to(tgt_out[None, ..., None], lens.shape[:3] + (1,)), -1)[..., 0]
top = jnp.argmax(lens, -1)                                                            # [L+1,B,T]
names = ["embed"] + [f"after layer {i}" for i in range(L)]
for name, p, guess in zip(names, p_right, top):
    print(f"  {name:14s} p(right token) {float((p * scored).sum() / scored.sum()):.3f}   "
          f"top guess right {float(((guess == tgt_out) & scored).sum() / scored.sum()):.3f}   "
          f"top guess = the decoder's input token {float(((guess == tgt_in) & scored).sum() / scored.sum()):.3f}")

fig, ax = plt.subplots(figsize=(0.6 * (n + 1) + 2, 0.4 * (L + 1) + 1.4), layout="constrained")
ax.imshow(np.asarray(p_right[:, example, :n + 1]), vmin=0, vmax=1, cmap="magma", aspect="auto")
for r in range(L + 1):
    for c in range(n + 1):
        ax.text(c, r, tok.decode([int(top[r, example, c])]) or "EOS", ha="center", va="center", fontsize=7,
                color="black" if p_right[r, example, c] > 0.6 else "white")
ax.set_xticks(range(n + 1), tgt_labels)
ax.set_yticks(range(L + 1), names)
ax.set_xlabel("decoder input")
ax.set_title("colour: the lens's probability of the right next token; text: its top guess", fontsize=9)
plt.show()

# %% [markdown]
# Read from the bottom of the stack up. At `embed` the lens's top guess is the decoder's own input token: the
# output head shares the token embedding (`model.tie_embeddings`), so the embedding read straight back names
# itself, and the answer is right only by chance. After the first decoder layer the right digit is on top at
# some positions and not at others; after the second, the last, it is there almost everywhere. The first layer's
# cross-attention has started to fetch the digit (its maps above are blurrier), and the second finishes the job.

# %% [markdown]
# ## Activation patching: where does one digit travel?
#
# A clean source and a corrupted one that differ in one digit, at position p. The decoder is fed the clean answer
# in both runs, and the metric is, at the output that copies digit p (j = n − 1 − p), the logit of the clean
# digit minus the logit of the corrupted one. `patching_grid` runs the corrupted input once per cell with that
# cell's activation taken from the clean run (all cells inside one compiled program) and reports how much of
# the clean metric comes back: 1 = all of it, 0 = none. `attribution_patching` estimates every cell at once from
# one backward pass: (clean − corrupted activation) · ∂metric/∂activation at the corrupted run.

# %%
clean_digits = (3, 1, 4, 1, 5, 9)
p = 2
corrupt_digits = tuple((d + 5) % 10 if i == p else d for i, d in enumerate(clean_digits))
pair = encode_digit_pairs([clean_digits, corrupt_digits], True, len(clean_digits) + 1)   # no padding
clean = (jnp.asarray(pair["src"][:1]), jnp.asarray(pair["tgt_in"][:1]))
corrupt = (jnp.asarray(pair["src"][1:]), clean[1])              # the same decoder input: the clean answer
out_pos, good, bad = len(clean_digits) - 1 - p, clean_digits[p] + 3, corrupt_digits[p] + 3


def logit_diff(logits):
    """The clean digit's logit minus the corrupted digit's, at the output that copies position p."""
    return logits[0, out_pos, good] - logits[0, out_pos, bad]


print(f"clean {''.join(map(str, clean_digits))}, corrupted {''.join(map(str, corrupt_digits))} (position {p}); "
      f"metric at output {out_pos}: clean {float(logit_diff(model(*clean)[0])):.2f}, "
      f"corrupted {float(logit_diff(model(*corrupt)[0])):.2f}")

# %% [markdown]
# First the encoder: its residual stream entering each layer (`encoder.resid_pre`), one cell per (layer,
# source position). Then the decoder's cross-attention heads (`cross_z`, each head's output before the output
# projection): one cell per (layer, decoder position) with all of that layer's heads patched together, then one
# per (layer, decoder position, head): which head, at which output, reads the digit.

# %%
def as_rows(values):
    """[L,T] as it is; [L,T,N] -> [L*N,T], one row per (layer, head)."""
    return values if values.ndim == 2 else values.transpose(0, 2, 1).reshape(-1, values.shape[1])


maps = {}
for site, over in (("encoder.resid_pre", "position"), ("cross_z", "position"), ("cross_z", "both")):
    t = time.perf_counter()
    grid = np.asarray(patching_grid(model, clean, corrupt, site, logit_diff, over=over))
    t_grid = time.perf_counter() - t
    estimate = np.asarray(attribution_patching(model, clean, corrupt, site, logit_diff, over=over))
    maps[site, over] = grid, estimate
    r = np.corrcoef(grid.reshape(-1), estimate.reshape(-1))[0, 1]
    cell = np.unravel_index(np.argmax(grid), grid.shape)
    print(f"{site} over {over} {grid.shape}: {grid.size} cells patched in {t_grid:.1f} s; the largest, "
          f"{tuple(map(int, cell))}, restores {grid.max():.2f} and attribution estimates it at {estimate[cell]:.2f}; "
          f"Pearson r of the two over all cells {r:.3f}")
    print(np.array2string(as_rows(grid), precision=2, suppress_small=True))

# %%
src_ticks = [str(d) for d in clean_digits] + ["EOS"]
dec_ticks = ["BOS"] + [str(d) for d in clean_digits[::-1]]
shown = (("encoder.resid_pre", "position", src_ticks, [f"layer {i}" for i in range(L)]),
         ("cross_z", "both", dec_ticks, [f"L{i} head {h}" for i in range(L) for h in range(N)]))
fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), layout="constrained", gridspec_kw={"height_ratios": [L, L * N]})
for row, (site, over, ticks, labels) in enumerate(shown):
    top = max(float(np.abs(m).max()) for m in maps[site, over])         # one colour scale per site
    for col, (title, values) in enumerate(zip(("patched", "attribution estimate"), maps[site, over])):
        ax = axes[row, col]
        image = ax.imshow(as_rows(values), cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"{site} ({'source' if row == 0 else 'decoder'} positions): {title}", fontsize=9)
    fig.colorbar(image, ax=axes[row], shrink=0.8, label="share restored")
plt.show()

# %% [markdown]
# What the maps say in words. In the encoder the corrupted digit stays at its own source position: patching that
# one position restores the clean answer, patching any other restores nothing, in either layer. In the decoder,
# cross-attention picks it up at the one output that copies it, and nowhere else. No single head carries it
# there: the largest head cell restores only a part, while all of the last layer's heads patched together
# (`over="position"`) restore most of it, and the first layer adds a little: the redundancy of the attention
# maps above, measured.
#
# The attribution estimate points at the same cells from a single backward pass (the correlations printed
# above), but its values are a first-order guess: where patching the encoder's input restores all of the
# clean answer, the estimate says about a quarter, because the model is far from linear between the two runs
# (the softmax, the norms, a logit difference of ±9). Use it to find cells to look at, and a real patch to
# measure them.
