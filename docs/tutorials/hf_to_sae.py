# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # A Hugging Face model: capture, patch, SAE
#
# The path a researcher walks with a pretrained model, in blocks of about ten lines: load a Hugging Face
# checkpoint folder, read its activations (`capture=`), change them (`patch=`), find which heads carry a
# difference between two prompts (the patching grid and its attribution estimate), and train a sparse autoencoder
# on its residual stream, splice it in, ablate one of its features and write it in SAELens' format.
#
# So that this page runs anywhere (no download), the folder is a 2-layer GPT-2 with random weights that jaxformer
# writes itself, in the layout transformers writes (`config.json` + `model.safetensors`). With a real one, point
# `folder` at it: `huggingface_hub.snapshot_download("gpt2")`, or any folder of a Llama, Qwen, Mistral, Gemma or
# GPT-2 family model (`jaxformer.hf.FAMILIES`). With random weights the numbers below mean nothing about language;
# the calls are the same.
#
# Run it as a script (`python docs/tutorials/hf_to_sae.py`) or as a notebook (`jupytext --to ipynb`).

# %% tags=["remove_input"]
# Setup, its source hidden on the site: work from the repository root as a notebook too.
import os
from pathlib import Path

if not Path("configs").is_dir():
    os.chdir(Path.cwd().parents[1])

# %% [markdown]
# ## 1. The checkpoint folder
#
# `to_model_config` reads a transformers `config.json` dict into our `ModelConfig`; `save_pretrained` writes a
# model as transformers would. Here they make the stand-in folder.

# %%
import tempfile

from jaxformer.hf import save_pretrained, to_model_config
from jaxformer.nn import build_model

hf_config = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}
folder = Path(tempfile.mkdtemp()) / "tiny-gpt2"
save_pretrained(build_model(to_model_config(hf_config), seed=0), folder)
print(sorted(p.name for p in folder.iterdir()))

# %% [markdown]
# ## 2. Load it
#
# `from_pretrained` builds the model from `config.json` and reads the safetensors into it (float32 unless
# `dtype=` says otherwise). It is an ordinary jaxformer model: every tool below works on a model you trained too.

# %%
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.hf import from_pretrained

model = from_pretrained(folder)
cfg = model.cfg
print(f"{cfg.num_decoder_layers} layers, width {cfg.d_model}, {cfg.num_heads} heads, vocab {cfg.vocab_size}")
print(model.sites())

# %% [markdown]
# ## 3. Capture activations
#
# One call returns the logits and, under `out["captured"]`, every site asked for. A per-layer site comes stacked
# over the layers: `resid_post` is [L, B, T, D], `pattern` [L, B, N, T, S].

# %%
tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
logits, out = model(tokens, capture=("resid_post", "pattern", "z"))
for site, value in out["captured"].items():
    print(f"{site:11s} {value.shape}")
print("logits", logits.shape)

# %% [markdown]
# ## 4. Patch an activation
#
# A patch is a function of a site's value and the layer's index, `fn(value, layer) -> value`, applied inside the
# compiled, scanned stack (the layer is traced: write `jnp.where(layer == l, ...)`, not `if`). Here: head 1 of
# layer 1 switched off (its slice of `z`, [B, T, N, H]), and how much that moves the next-token loss.

# %%
from jaxformer.ops.losses import mean_nll


def zero_head(z, layer, target=1, head=1):
    return jnp.where(layer == target, z.at[:, :, head].set(0.0), z)


ablated, _ = model(tokens, patch={"z": zero_head})
loss = lambda lg: float(mean_nll(lg[:, :-1], tokens[:, 1:]))          # noqa: E731
print(f"loss {loss(logits):.4f} -> {loss(ablated):.4f} with head (1, 1) off")

# %% [markdown]
# `jaxformer.interpret.head_ablation` asks that question of every head at once, as one compiled program:

# %%
from jaxformer.interpret import head_ablation

table = head_ablation(model, tokens[:, :-1], targets=tokens[:, 1:])         # [L, N]: the loss increase
print(np.asarray(table).round(4))

# %% [markdown]
# ## 5. Which heads carry a difference: the patching grid
#
# Two prompts that differ in one token; the metric, the logit difference of two answers at the last position.
# `patching_grid` runs the corrupted prompt once per cell with that cell taken from the clean run (every cell in
# one compiled program); `attribution_patching` estimates the same grid from one backward pass. Their programs
# compile for seconds: `compile_cache.enable()` keeps them on disk, so a later process (a notebook restarted, a
# script run again) loads them instead (benchmarks/results/patching_tl.md measures both).

# %%
from jaxformer import compile_cache
from jaxformer.patching import attribution_patching, patching_grid

compile_cache.enable()            # ~/.cache/jaxformer/jax, or $JAXFORMER_COMPILATION_CACHE
clean = tokens[:1]
corrupt = clean.at[0, 3].set((clean[0, 3] + 1) % cfg.vocab_size)
metric = lambda lg: lg[0, -1, 5] - lg[0, -1, 6]                              # noqa: E731
grid = patching_grid(model, (clean,), (corrupt,), "z", metric, over="head")            # [L, N]
estimate = attribution_patching(model, (clean,), (corrupt,), "z", metric, over="head")
print("patched:\n", np.asarray(grid).round(3), "\nestimated:\n", np.asarray(estimate).round(3))

# %% [markdown]
# ## 6. A sparse autoencoder on the residual stream
#
# `train_sae` captures the site batch by batch inside its jitted step (nothing is dumped) and trains a TopK SAE
# with Adam. Batches are the model's inputs; here random token rows, with a real model your corpus.

# %%
from jaxformer.sae import SAESpec, evaluate_sae, train_sae

spec = SAESpec(d_in=cfg.d_model, d_sae=256, site="resid_post", layer=0, k=8, lr=1e-3)
keys = jax.random.split(jax.random.key(1), 300)
batches = ((jax.random.randint(k, (8, 16), 0, cfg.vocab_size),) for k in keys)
params, log = train_sae(model, batches, spec, steps=300)
print(f"loss {float(log[0]['loss']):.4f} -> {float(log[-1]['loss']):.4f}, L0 {float(log[-1]['l0']):.0f}")
report = evaluate_sae(model, params, spec, (tokens[:, :-1],), tokens[:, 1:])
print({k: round(v, 3) for k, v in report.items()})

# %% [markdown]
# ## 7. Splice it in and ablate a feature
#
# `sae_patch` is the SAE as a patch: the site's value becomes the SAE's reconstruction, with an edit of the
# latents first. `keep_error=True` adds the SAE's own error back, so the edit is the only change: with no edit
# the model is exactly itself.

# %%
from jaxformer.sae import encode, sae_patch

x = out["captured"]["resid_post"][0]                                          # layer 0: [B, T, D]
busiest = int(jnp.argmax((encode(params, x, spec) > 0).sum((0, 1))))
off = lambda f: f.at[..., busiest].set(0.0)                                   # noqa: E731
same, _ = model(tokens, patch={"resid_post": sae_patch(params, spec, keep_error=True)})
edited, _ = model(tokens, patch={"resid_post": sae_patch(params, spec, edit=off, keep_error=True)})
print(f"max |logits| change: no edit {float(jnp.abs(same - logits).max()):.1e}, "
      f"feature {busiest} off {float(jnp.abs(edited - logits).max()):.3f}")

# %% [markdown]
# ## 8. Write it for SAELens
#
# `save_saelens` writes SAELens' folder (`cfg.json` + `sae_weights.safetensors`, the hook named as
# TransformerLens names it); `load_saelens` reads it back, and reads folders SAELens wrote
# (`tests/test_saelens_folders.py` checks both directions against SAELens itself).

# %%
from jaxformer.sae import load_saelens, save_saelens

where = save_saelens(params, spec, Path(tempfile.mkdtemp()) / "sae", model_name="tiny-gpt2")
back, back_spec = load_saelens(where)
print(sorted(p.name for p in where.iterdir()), back_spec.site, back_spec.layer, back_spec.k)
assert all(bool(jnp.array_equal(back[n], params[n])) for n in params)
