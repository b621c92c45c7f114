# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Adding your own attention variant
#
# A research change to attention is one file: a subclass of `jaxformer.nn.attention.MultiHeadAttention` that
# overrides `context` (what the heads read), named by the config field `model.attention.kind="module:Class"`.
# Nothing in jaxformer is edited: the KV cache, the fused projections, the activation sites, every parallel plan
# and the CLI work with it as they are. Here: cosine attention (Swin v2's), where a logit is a fixed temperature
# times the cosine of query and key instead of their dot product over √H.

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
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import jax
import numpy as np

from jaxformer.config import resolve_vocab
from jaxformer.configio import apply_overrides, load_config_file
from jaxformer.decode import generate_lm
from jaxformer.nn import build_model
from jaxformer.train.loop import train

folder = Path(tempfile.mkdtemp())
(folder / "my_attention.py").write_text(textwrap.dedent('''
    import dataclasses

    import jax.numpy as jnp

    from jaxformer.errors import ConfigError
    from jaxformer.nn.attention import MultiHeadAttention


    def unit(x):
        """x / |x| over the head dim H (the last axis in every layout), for arrays and segment tuples alike."""
        if isinstance(x, tuple):
            return tuple(unit(a) for a in x)
        return x * jax.lax.rsqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(x.dtype)


    class CosineAttention(MultiHeadAttention):
        """Logits temperature · cos(q, k): queries and keys normalised, the queries scaled by temperature · √H
        (the call's logit scale is 1/√H)."""

        @dataclasses.dataclass(frozen=True)
        class Options:                  # its own config section: model.attention.options=temperature=...
            temperature: float = 10.0

        @classmethod
        def check(cls, cfg):
            if cfg.attention.scale != "rsqrt" or cfg.attention.scale_dim:
                raise ConfigError(f"model.attention.kind={cfg.attention.kind!r} sets its own logit scale; "
                                  f"leave model.attention.scale='rsqrt' and model.attention.scale_dim=0")

        def context(self, q, kv, *args, **kw):
            scale = self.options(self.cfg).temperature * q.shape[-1] ** 0.5
            return super().context(unit(q) * scale, kv._replace(k=unit(kv.k)), *args, **kw)
''').replace("import jax.numpy as jnp", "import jax\nimport jax.numpy as jnp"))
sys.path.insert(0, str(folder))

# %% [markdown]
# The config names the class, and its own knobs go in its own section, `model.attention.options` ("name=value",
# typed by the class's `Options`; an unknown name or a wrong type is a config error naming the field). `context`
# gets the queries and a view of the keys/values (`kv`, in whatever layout the cache keeps: the view says, the
# variant need not); `attend` (not used here) is the configured attention a variant can build on.
# Everything else is the shipped character-level Alice config, shrunk to train in seconds on a CPU.

# %%
TINY = ["model.d_model=64", "model.d_ff=128", "model.num_decoder_layers=2", "data.num_chars=20000",
        "data.batch_size=16", "data.block_size=32", "train.steps=150", "train.eval_every=150",
        "train.checkpoint_every=150", "train.log_every=50", "train.num_examples=0"]


def config(*extra):
    return apply_overrides(load_config_file("configs/alice.py"), TINY + list(extra))


COSINE = ["model.attention.kind=my_attention:CosineAttention", "model.attention.options=temperature=10"]
cfg = config(*COSINE)
print("the attention module of every block:", cfg.model.attention.kind, cfg.model.attention.options)

# %% [markdown]
# ## It is the module its config names, and it decodes as it trains
#
# Cached decoding (one token at a time over the KV cache) must give the logits of the full uncached call: the
# variant inherited the cache handling, so it does.

# %%
model = build_model(resolve_vocab(cfg, 64).model, seed=0)
print(type(model.decoder.layers.blocks.self_attn).__name__)
tokens = jax.random.randint(jax.random.key(0), (2, 12), 1, 64)
greedy = generate_lm(model, tokens[:, :6], max_new=6)
full, _ = model(np.concatenate([tokens[:, :6], np.asarray(greedy)[:, :5]], axis=1))
assert (np.asarray(full[:, 5:].argmax(-1)) == np.asarray(greedy)).all()     # the cache and the full call agree

# %% [markdown]
# ## Train it against softmax attention
#
# The same command line trains it (`jaxformer train configs/alice.py --set model.attention.kind=my_attention:
# CosineAttention --set model.attention.options=temperature=10`, with the folder on PYTHONPATH); in Python, `train`:

# %%
runs = Path(tempfile.mkdtemp())
for name, extra in {"softmax": [], "cosine": COSINE}.items():
    train(config(*extra), runs / name, progress="none")
    rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    print(f"{name:8s} held-out loss after 150 steps: {evals[-1]['loss']:.3f}")

# %% [markdown]
# One seed and 150 steps say nothing about which is better: `jaxformer sweep` with several seeds and a claim
# ([sweeps and claims](../guide/sweeps.md)) is how this repository answers that.
