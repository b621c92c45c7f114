import jax
import jax.numpy as jnp

from jaxformer import ops
from jaxformer.config import ModelConfig, replaced
from jaxformer.decode import generate_lm
from jaxformer.nn import build_model

# A pure op: causal attention from explicit positions (True = may attend), q/k/v [B,T,N,H].
q = k = v = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
out = ops.dot_product_attention(q, k, v, mask=ops.CausalMask(pos, pos)).out          # [B,T,N,H]

# A model from a frozen config; dotted names are what `--set model.norm.position=pre` takes.
cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=64, d_model=64, num_heads=4, d_ff=128,
               num_decoder_layers=2, positional="rope", norm__position="pre")
model = build_model(cfg, seed=0)
tokens = jnp.ones((2, 16), jnp.int32)
logits, aux = model(tokens, capture=("resid_post",))         # [B,T,V]; activations read in the same call
print(logits.shape, aux["captured"]["resid_post"].shape)     # (2, 16, 64) (2, 2, 16, 64): [L,B,T,D]

# KV-cached decoding samples over the model's own cached step.
print(generate_lm(model, tokens[:, :4], max_new=8).shape)    # (2, 8)
