# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Common patterns
#
# The questions asked of a model most days, each answered in a few lines (as TransformerLens' docs keep a page of
# them). Every pattern is a model call with `capture=` (read sites) and `patch=` (replace them) or a function of
# `jaxformer.interpret` / `jaxformer.patching` over it; nothing reaches into the modules. The model here is a
# small decoder-only one with random weights (any jaxformer model, trained or imported, takes the same calls).
#
# Run it as a script (`python docs/tutorials/patterns.py`) or as a notebook (`jupytext --to ipynb`).

# %% tags=["remove_input"]
# Setup, its source hidden on the site: work from the repository root as a notebook too.
import os
from pathlib import Path

if not Path("configs").is_dir():
    os.chdir(Path.cwd().parents[1])

# %%
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.config import ModelConfig, replaced
from jaxformer.nn import build_model

cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=64, d_model=32, num_heads=4, d_ff=64,
               num_decoder_layers=3, max_len=32, positional="rope", norm__position="pre", runtime__dropout=0.0)
model = build_model(cfg, seed=0)
tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, cfg.vocab_size)        # [B, T]
logits, _ = model(tokens)
print(logits.shape, len(model.sites()), "sites")

# %% [markdown]
# ## Which sites are there, and their shapes
#
# `model.sites()` names them in order; a capture of all of them shows each one's shape (per-layer sites stacked
# over the layers first).

# %%
_, out = model(tokens, capture=model.sites())
for name, value in out["captured"].items():
    print(f"{name:12s} {tuple(value.shape)}")

# %% [markdown]
# ## The residual stream at one layer
#
# Capture the stacked site and index the layer; several sites in one call cost one forward pass.

# %%
_, out = model(tokens, capture=("resid_pre", "resid_post"))
resid = out["captured"]["resid_post"][1]                        # after layer 1: [B, T, D]
norms = jnp.linalg.norm(out["captured"]["resid_post"], axis=-1).mean((1, 2))      # [L]
print(resid.shape, np.asarray(norms).round(2))

# %% [markdown]
# ## Zero-ablate or mean-ablate a head
#
# A patch is `fn(value, layer) -> value`, called inside the compiled, scanned stack with the layer's index traced:
# select a layer with `jnp.where`, not `if`. `z` is [B, T, N, H], one slice per head.

# %%
def ablate(layer, head, mean=None):
    def fn(z, at):
        new = z.at[:, :, head].set(0.0 if mean is None else mean[at, head])
        return jnp.where(at == layer, new, z)
    return fn


z_mean = model(tokens, capture=("z",))[1]["captured"]["z"].mean((1, 2))          # [L, N, H]
zeroed, _ = model(tokens, patch={"z": ablate(2, 1)})
meaned, _ = model(tokens, patch={"z": ablate(2, 1, z_mean)})
print(float(jnp.abs(zeroed - logits).max()), float(jnp.abs(meaned - logits).max()))

# %% [markdown]
# ## Patch one activation from a clean run into a corrupted one
#
# Capture the clean run's site, then replace the corrupted run's value at one (layer, position). For every cell at
# once use `patching_grid` (below).

# %%
clean, corrupt = tokens[:1], tokens[:1].at[0, 4].set(0)
_, aux = model(clean, capture=("resid_pre",))
saved = aux["captured"]["resid_pre"]                             # [L, B, T, D]


def from_clean(layer, pos):
    return lambda v, at: jnp.where((at == layer) & (jnp.arange(v.shape[1]) == pos)[None, :, None], saved[at], v)


patched, _ = model(corrupt, patch={"resid_pre": from_clean(0, 4)})
print(bool(jnp.allclose(patched, model(clean)[0], atol=1e-5)))    # layer 0's input at position 4 is all that differs

# %% [markdown]
# ## Every cell at once: the patching grid and attribution patching
#
# One compiled program for all (layer, position) or (layer, head) cells; attribution patching estimates the
# same grid from one backward pass.

# %%
from jaxformer.patching import attribution_patching, patching_grid

metric = lambda lg: lg[0, -1, 3] - lg[0, -1, 4]                  # noqa: E731
grid = patching_grid(model, (clean,), (corrupt,), "resid_pre", metric)               # [L, T]
estimate = attribution_patching(model, (clean,), (corrupt,), "resid_pre", metric)
print(np.asarray(grid).round(2)[:, 3:6], "\n", np.asarray(estimate).round(2)[:, 3:6])

# %% [markdown]
# Attribution is first order: where the patched site acts non-linearly (here layer 0 at the corrupted position)
# its estimate and the real patch part; the grid is the measurement, the estimate a fast guide to where to look.

# %% [markdown]
# ## The attention pattern of a head
#
# `pattern` is [L, B, N, T, S]: softmax probabilities, rows summing to 1 over the keys a query may see.

# %%
import matplotlib.pyplot as plt

pattern = model(tokens, capture=("pattern",))[1]["captured"]["pattern"]
fig, ax = plt.subplots(figsize=(3, 3))
ax.imshow(pattern[0, 0, 2], cmap="viridis")                      # layer 0, row 0, head 2: [T, S]
ax.set(xlabel="key", ylabel="query", title="layer 0, head 2")
plt.show()
print(np.asarray(pattern[0, 0, 2].sum(-1)).round(4))

# %% [markdown]
# ## The logit lens and each head's effect on the loss
#
# Both are one compiled program over every layer (and head): `logit_lens` reads the output head after every layer,
# `head_ablation` zeroes each head in turn.

# %%
from jaxformer.interpret import head_ablation, logit_lens

lens = logit_lens(model, tokens)                                 # [L+1, B, T, V]; row L: the logits
table = head_ablation(model, tokens[:, :-1], targets=tokens[:, 1:])       # [L, N] loss increase
print(lens.shape, bool(jnp.allclose(lens[-1], logits, atol=1e-5)), table.shape)

# %% [markdown]
# ## The gradient of a metric with respect to an activation
#
# Add a zero perturbation through a patch and differentiate with respect to it: the gradient at every layer's
# site in one backward pass (what attribution patching does).

# %%
graphdef, state = nnx.split(model)


def metric_at(delta):
    out, _ = nnx.merge(graphdef, state)(clean, patch={"resid_post": lambda v, at: v + delta[at]})
    return metric(out)


grad = jax.grad(metric_at)(jnp.zeros((cfg.num_decoder_layers, *clean.shape, cfg.d_model)))
print(grad.shape, np.asarray(jnp.linalg.norm(grad, axis=-1)[:, 0]).round(2))     # [L, B, T, D] -> [L, T]

# %% [markdown]
# ## Under `jax.jit`
#
# The model call is a pure function of its state: split once, jit the function of (state, inputs), and the
# captures and patches compile with it. Patch functions are part of the program (a new function compiles anew).

# %%
@jax.jit
def resid_and_logits(state, tokens):
    logits, out = nnx.merge(graphdef, state)(tokens, capture=("resid_post",))
    return logits, out["captured"]["resid_post"]


jit_logits, jit_resid = resid_and_logits(state, tokens)
print(bool(jnp.allclose(jit_logits, logits, atol=1e-5)), jit_resid.shape)

# %% [markdown]
# ## Prompts of different lengths in one batch
#
# Left-pad and say which tokens are real with `segment_ids` (0 = padding); positions follow each row's own tokens,
# so a padded row gives the same logits as the row alone. Masks come from segment ids and positions, never from a
# token id.

# %%
short = tokens[1, :6]
padded = jnp.stack([jnp.pad(short, (4, 0)), tokens[0]])         # row 0: 4 pads, then 6 real tokens
segments = jnp.stack([jnp.r_[jnp.zeros(4, int), jnp.ones(6, int)], jnp.ones(10, int)])
positions = jnp.maximum(jnp.cumsum(segments, axis=1) - 1, 0)
both, _ = model(padded, positions, segment_ids=segments)
alone, _ = model(short[None])
print(bool(jnp.allclose(both[0, 4:], alone[0], atol=1e-5)))

# %% [markdown]
# ## Steer generation with a vector
#
# `generate_lm(..., patch=...)` applies the patch at every decoding step, prefill included: here a direction
# added to the residual stream after layer 1.

# %%
from jaxformer.decode import generate_lm

direction = 4.0 * jax.random.normal(jax.random.key(1), (cfg.d_model,))
steer = {"resid_post": lambda v, at: jnp.where(at == 1, v + direction, v)}
plain = generate_lm(model, tokens[:1, :5], max_new=8)
steered = generate_lm(model, tokens[:1, :5], max_new=8, patch=steer)
print(plain.tolist(), steered.tolist())
