# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # The Transformer from first principles, with `jaxformer.ops`
#
# Seed article 000 writes a Transformer in NumPy: scaled dot-product attention, multi-head attention, the
# position-wise FFN, LayerNorm, sinusoidal positions, the padding and causal masks, and a decoder layer
# (masked self-attention, cross-attention, FFN, each followed by Add & Norm). Here each piece is written the
# article's way in float64 NumPy and compared with the pure JAX function jaxformer uses for it. Shapes follow the
# axis legend: B batch, T query length, S key length, D model width, N heads, H head dim, F FFN width.
#
# Run it as a script (`python docs/tutorials/first_principles.py`) or as a notebook (`jupytext --to ipynb`).

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxformer import ops

jax.config.update("jax_enable_x64", True)   # float64 inputs; attention's softmax still runs in float32 (by design)
rng = np.random.default_rng(0)
B, T, S, D, N, F = 2, 5, 7, 16, 4, 64
H = D // N

# %% [markdown]
# ## Masks: True = may attend
#
# The article builds a padding mask from token ids equal to 0 and a lower-triangular causal mask, and combines
# them. jaxformer's masks are boolean with the same meaning (True = this key may be read); the padding mask is
# taken from the token ids only where a caller says which id pads.

# %%
tokens = np.array([[1, 2, 3, 0, 0], [1, 2, 0, 0, 0]])
np_padding = (tokens != 0)[:, None, None, :]                       # [B,1,1,S]
np_causal = np.tril(np.ones((T, T), bool))                         # [T,S]
np_combined = np_padding & np_causal[None, None]                   # [B,1,T,S]
ours = ops.combine_masks(ops.padding_mask(jnp.asarray(tokens), 0), ops.causal_mask(T))
assert ours.shape == np_combined.shape and (np.asarray(ours) == np_combined).all()
print("combined mask of row 1:\n", np.asarray(ours[1, 0]).astype(int))

# %% [markdown]
# ## Scaled dot-product attention
#
# The article's version works on heads-first arrays [B,N,T,H] and fills masked scores with −1e9. jaxformer's
# `dot_product_attention` takes [B,T,N,H], always computes the softmax in float32 (so the two agree to float32's
# precision, ~1e-7, not float64's), and gives a row with no visible key zeros (the article's −1e9 would give it a
# uniform average of every key instead; no row here is empty).

# %%
def np_attention(q, k, v, mask=None):                               # q/k/v [B,N,T,H]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return w @ v, w


q, k, v = (rng.standard_normal((B, N, T, H)) for _ in range(3))
want, want_w = np_attention(q, k, v, np_combined)
heads_last = lambda a: jnp.asarray(a.transpose(0, 2, 1, 3))         # [B,N,T,H] -> [B,T,N,H]
got = ops.dot_product_attention(heads_last(q), heads_last(k), heads_last(v), mask=ours, return_probs=True)
print("attention: max |ours - numpy| =", float(np.abs(np.asarray(got.out).transpose(0, 2, 1, 3) - want).max()))
assert np.allclose(np.asarray(got.out).transpose(0, 2, 1, 3), want, atol=1e-6)
assert np.allclose(np.asarray(got.probs), want_w, atol=1e-6)

# %% [markdown]
# ## Sinusoidal positions
#
# PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...), interleaved, computed in float64 as the
# article insists (the high frequencies lose their precision in float32 at large positions).

# %%
def np_positional_encoding(max_len, d_model):
    pos = np.arange(max_len)[:, None]
    div = np.exp(np.arange(0, d_model, 2) * (-np.log(10000.0) / d_model))
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    return pe


table = ops.positional.sinusoidal_table(64, D, dtype=jnp.float64)
print("positions: max |ours - numpy| =", float(np.abs(np.asarray(table) - np_positional_encoding(64, D)).max()))
assert np.allclose(np.asarray(table), np_positional_encoding(64, D), atol=1e-12)
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.imshow(np.asarray(table).T, aspect="auto", cmap="RdBu")
ax.set(xlabel="position", ylabel="dimension", title="sinusoidal positions (low dimensions: high frequency)")
plt.show()                                                          # inline in a notebook

# %% [markdown]
# ## LayerNorm and the position-wise FFN
#
# The article's LayerNorm divides by (std + eps); jaxformer's (as PyTorch's and the paper's implementations)
# divides by sqrt(var + eps). They agree to about eps / std: compare with the textbook form, and see the size of
# the article's variant.

# %%
x = rng.standard_normal((B, T, D))
gamma, beta = rng.standard_normal(D), rng.standard_normal(D)
textbook = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gamma + beta
article = (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-5) * gamma + beta
ln = np.asarray(ops.norms.layer_norm(jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(beta), eps=1e-5))
print("layer norm: vs textbook", float(np.abs(ln - textbook).max()), "| vs the article's (std + eps)",
      float(np.abs(ln - article).max()))
assert np.allclose(ln, textbook, atol=1e-12)

w1, w2 = rng.standard_normal((D, F)) * 0.1, rng.standard_normal((F, D)) * 0.1
ffn = lambda x: ops.activations.relu(x @ w1) @ w2                   # position-wise: each token on its own
assert np.allclose(np.asarray(ffn(jnp.asarray(x))), np.maximum(0, x @ w1) @ w2, atol=1e-12)

# %% [markdown]
# ## One decoder layer, Post-LN, as the article assembles it
#
# Masked self-attention, cross-attention over the encoder's output (Q from the decoder, K/V from the encoder, the
# source's padding masked), the FFN, each followed by LayerNorm(x + sublayer(x)). The NumPy side is the article's
# `DecoderLayer`; ours is the same assembly of `jaxformer.ops` calls.

# %%
def params(d):
    return {n: rng.standard_normal((d, d)) * 0.2 for n in ("wq", "wk", "wv", "wo")}


P = {"self": params(D), "cross": params(D), "w1": w1, "w2": w2}


def np_mha(p, x, source, mask):
    split = lambda a: a.reshape(a.shape[0], a.shape[1], N, H).transpose(0, 2, 1, 3)
    ctx, _ = np_attention(split(x @ p["wq"]), split(source @ p["wk"]), split(source @ p["wv"]), mask)
    return ctx.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], D) @ p["wo"]


def np_norm(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def np_decoder_layer(x, memory, src_mask, tgt_mask):
    x = np_norm(x + np_mha(P["self"], x, x, tgt_mask))
    x = np_norm(x + np_mha(P["cross"], x, memory, src_mask))
    return np_norm(x + np.maximum(0, x @ P["w1"]) @ P["w2"])


def mha(p, x, source, mask):
    split = lambda a: a.reshape(a.shape[0], a.shape[1], N, H)       # [B,T,N,H]
    out = ops.dot_product_attention(split(x @ p["wq"]), split(source @ p["wk"]), split(source @ p["wv"]),
                                    mask=mask).out
    return out.reshape(x.shape[0], x.shape[1], D) @ p["wo"]


def norm(x):
    return ops.norms.layer_norm(x, None, None, eps=1e-5)


@jax.jit
def decoder_layer(x, memory, src_mask, tgt_mask):
    x = norm(x + mha(P["self"], x, x, tgt_mask))
    x = norm(x + mha(P["cross"], x, memory, src_mask))
    return norm(x + ffn(x))


src = np.array([[4, 5, 6, 7, 8, 9, 0], [4, 5, 6, 0, 0, 0, 0]])
src_mask = (src != 0)[:, None, None, :]                              # [B,1,1,S]
x, memory = rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))
want = np_decoder_layer(x, memory, src_mask, np_combined)
got = decoder_layer(jnp.asarray(x), jnp.asarray(memory), jnp.asarray(src_mask), ours)
print("decoder layer: max |ours - numpy| =", float(np.abs(np.asarray(got) - want).max()))
assert np.allclose(np.asarray(got), want, atol=1e-5)

# %% [markdown]
# The same functions are differentiable and batch under `vmap` as they are: the gradient of the layer's output
# with respect to its input, through every mask, is one call.

# %%
grad = jax.grad(lambda x: jnp.sum(jnp.sin(decoder_layer(x, jnp.asarray(memory), jnp.asarray(src_mask), ours))))
print("gradient shape:", grad(jnp.asarray(x)).shape)
