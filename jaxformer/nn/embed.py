"""The embedding and output head of every model: token embedding (scaled by √D where the family does), the
positional table's addition (sinusoidal or learned; rotary positions are applied inside attention), dropout, and
the logits, tied to the embedding or an untied head, with µP's output multiplier and final soft-capping.

Axis legend: B batch, T length, D model width, V vocab.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.axes import ACTIVATION, LOGITS
from jaxformer.config import ConfigError, ModelConfig
from jaxformer.nn import init
from jaxformer.nn.layers import dropout
from jaxformer.nn.params import DTYPES, param
from jaxformer.ops import positional
from jaxformer.parallel import constrain


class Embedder(nnx.Module):
    """Token embedding (scaled by sqrt(D) if configured) plus absolute positions (sinusoidal/learned), and the
    output head (tied: x·Eᵀ). Called on tokens [B,T], positions [B,T] -> [B,T,D]; `logits` [B,T,D] -> [B,T,V].

    Attributes:
      tokens: [V, D] token embedding.
      positions: [max_len, D] learned positions (model.positional="learned"); table: the sinusoidal constant.
      head: [D, V] output head, unless model.tie_embeddings.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn.embed import Embedder
      >>> cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2, d_ff=32,
      ...                num_encoder_layers=0, num_decoder_layers=1, max_len=16)
      >>> embed = Embedder(cfg, rngs=nnx.Rngs(0))
      >>> x = embed(jnp.array([[1, 2, 3]]), jnp.arange(3)[None])
      >>> embed.tokens.shape, x.shape, embed.logits(x).dtype
      ((16, 16), (1, 3, 16), dtype('float32'))
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.tokens = param(rngs, init.weight(cfg, "embed"), (cfg.vocab_size, d), ("vocab", "embed"))
        if cfg.positional == "learned":
            self.positions = param(rngs, init.weight(cfg, "positions"), (cfg.max_len, d), (None, "embed"))
        if cfg.positional == "sinusoidal":
            self.table = nnx.Variable(positional.sinusoidal_table(cfg.max_len, d))  # a constant, not a Param
        if not cfg.tie_embeddings:
            self.head = param(rngs, init.weight(cfg, "head"), (d, cfg.vocab_size), ("embed", "vocab"),
                              matrix=True)
        self.drop = nnx.Dropout(cfg.runtime.dropout)

    def __call__(self, tokens: jax.Array, positions: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """tokens [B,T] int, positions [B,T] int -> [B,T,D] in the compute dtype."""
        self.cfg.check_length(tokens.shape[1])
        if self.cfg.positional in ("sinusoidal", "learned") and not isinstance(positions, jax.core.Tracer):
            # eager inputs only: under jit an out-of-table position cannot raise; it gives NaN (generate and
            # the data pipeline check lengths up front)
            top = int(np.max(np.asarray(positions), initial=-1))
            if top >= self.cfg.max_len:
                raise ConfigError(f"position {top} is outside model.max_len={self.cfg.max_len} "
                                  f"(model.positional={self.cfg.positional!r} has no position beyond it)")
        # under a plan, rows are looked up straight into the batch layout (constraining the table too, to
        # gather its D first, silences an XLA resharding warning on 3-axis meshes but more than doubles FSDP's
        # temporary memory in the train step: benchmarks/parallel.py)
        # mode="clip": padding written as -1 (model.pad_id=-1: no token id is padding) reads row 0, never NaN
        x = constrain(jnp.take(self.tokens[...], tokens, axis=0, mode="clip"), ACTIVATION)
        if self.cfg.scale_embeddings:                    # µP: √D₀, a constant of the width (`jaxformer.mup`)
            x = x * math.sqrt(self.cfg.d_model / self.cfg.width_mult)
        if self.cfg.positional == "sinusoidal":
            x = x + jnp.take(self.table[...], positions, axis=0)
        elif self.cfg.positional == "learned":
            x = x + jnp.take(self.positions[...], positions, axis=0)
        return dropout(self.drop, x, rngs).astype(DTYPES[self.cfg.runtime.dtype])

    def logits(self, x: jax.Array) -> jax.Array:
        """x [B,T,D] -> logits [B,T,V] in float32 (× D₀/D under µP; soft-capped: cap · tanh(logits / cap), with
        model.logit_softcap)."""
        return constrain(self.head_fn()(x), LOGITS)

    def head_fn(self):
        """The output head as a pure function of x [B,T,D] -> logits [B,T,V] float32 (unconstrained), closing over
        the weights read now: what `ops.losses.chunked_token_losses` calls on one slice at a time."""
        cap, tied, mult = self.cfg.logit_softcap, self.cfg.tie_embeddings, 1.0 / self.cfg.width_mult
        w = self.tokens[...] if tied else self.head[...]

        def head(x):
            out = jnp.einsum("BTD,VD->BTV" if tied else "BTD,DV->BTV", x, w.astype(x.dtype),
                             preferred_element_type=jnp.float32)
            out = out * mult if mult != 1.0 else out          # µP's output multiplier D₀/D (`jaxformer.mup`)
            return cap * jnp.tanh(out / cap) if cap else out
        return head
