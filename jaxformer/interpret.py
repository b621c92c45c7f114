"""Research instruments over a model's activation sites (`jaxformer.nn.sites`): the logit lens, a head-ablation
table and a linear probe (activation patching and its attribution estimate: `jaxformer.patching`). Each takes a
model and its inputs (`*inputs`: (tokens,) for a language model, (src, tgt) for an encoder-decoder: what the
model call takes) and returns arrays; the plots are `jaxformer viz --workdir RUN --plot lens --plot heads`
(`jaxformer.viz`). Axis legend: L layers, B batch, T length, D width, N heads, H head dim, V vocab, R rows.

    lens = logit_lens(model, tokens)                           # [L+1,B,T,V]: the head read at every layer
    table = head_ablation(model, tokens, targets=targets)      # [L,N]: loss increase when head (l, n) is zeroed
    acc = linear_probe(features, labels, train)                # [L]: held-out accuracy of a ridge probe per layer

Each compiles one program (the layers and heads are a traced index inside it, not a Python loop of passes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.errors import ConfigError, DataError
from jaxformer.ops.losses import mean_nll


def logit_lens(model, *inputs, **forward_kw) -> jax.Array:
    """The logit lens (nostalgebraist 2020): the output head read off the residual stream at every layer.

    The head is applied, through the final norm where the model has one, to the residual stream before layer 0
    (`embed`) and after each layer (`resid_post`).

    Args:
      model: a jaxformer model (`nn.build_model`) with activation sites (`nn.sites`).
      *inputs: what the model call takes: (tokens [B, T],) for a language model, (src, tgt) for an
        encoder-decoder.
      **forward_kw: more of the model call's keywords (segment_ids, ...).

    Returns:
      [L+1, B, T, V] float32 logits; row 0 reads the embeddings, row L is the model's own logits.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.interpret import logit_lens
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> tokens = jnp.array([[3, 4, 5, 6]])
      >>> lens = logit_lens(model, tokens)
      >>> lens.shape, lens.dtype, bool(jnp.allclose(lens[-1], model(tokens)[0], atol=1e-5))
      ((3, 1, 4, 16), dtype('float32'), True)
    """
    _, aux = model(*inputs, capture=("embed", "resid_post"), **forward_kw)
    resid = jnp.concatenate([aux["captured"]["embed"][None], aux["captured"]["resid_post"]])       # [L+1,B,T,D]
    norm, head = model.decoder.final_norm, model.embed.head_fn()
    read = (lambda r: head(norm(r))) if norm is not None else head
    return jnp.stack([read(r) for r in resid])


HEAD_SITES = ("z", "cross_z", "encoder.z")


def head_ablation(model, *inputs, targets: jax.Array, weights: jax.Array | None = None, how: str = "zero",
                  site: str = "z", **forward_kw) -> jax.Array:
    """Loss increase when one attention head's output is replaced, for every layer and head.

    The head's slice of a head-wise site ([B, T, N, H]) is replaced in one layer at a time and the loss
    (`ops.losses.mean_nll` of `targets`) compared with the clean one; all L·N passes run in one compiled program.

    Args:
      model: a jaxformer model (`nn.build_model`) with activation sites (`nn.sites`).
      *inputs: what the model call takes: (tokens [B, T],) for a language model, (src, tgt) for an
        encoder-decoder.
      targets: [B, T] int target token ids scored by the loss.
      weights: [B, T] per-position loss weights (None = every position).
      how: "zero" (the head's output set to 0: the same as zeroing its slice of the output projection) or "mean"
        (its mean over batch and positions: removes what the head says about this input, keeps its constant part).
      site: "z" (the decoder's self-attention), and in an encoder-decoder "cross_z" (its cross-attention) or
        "encoder.z" (the encoder's self-attention: then L = model.num_encoder_layers).
      **forward_kw: more of the model call's keywords (segment_ids, ...).

    Returns:
      [L, N] float32: ablated loss − clean loss for head n of layer l.

    Raises:
      ConfigError: `how` is not "zero" or "mean", or `site` is not a head-wise site of this model.
      DataError: no position is scored (no targets, or weights 0 everywhere; concrete inputs only).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.interpret import head_ablation
      >>> from jaxformer.nn import build_model
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> tokens = jnp.array([[3, 4, 5, 6]])
      >>> table = head_ablation(model, tokens[:, :-1], targets=tokens[:, 1:])     # each token predicts the next
      >>> table.shape, table.dtype
      ((2, 2), dtype('float32'))
    """
    if how not in ("zero", "mean"):
        raise ConfigError(f"head_ablation how={how!r} must be 'zero' or 'mean'")
    empty = not isinstance(targets, jax.core.Tracer) and jnp.size(targets) == 0
    unweighted = weights is not None and not isinstance(weights, jax.core.Tracer) and not bool(jnp.any(weights))
    if empty or unweighted:                  # concrete inputs only: under a trace there is nothing to look at
        raise DataError(f"head_ablation: {'no targets' if empty else 'weights 0 at every position'}: no token to "
                        f"score, every head's loss increase would be 0 (a language model's prompt needs at least "
                        f"2 tokens: each predicts the next)")
    if site not in HEAD_SITES or site not in model.sites():
        raise ConfigError(f"head_ablation site={site!r} is not a head-wise site of this model "
                          f"({[s for s in HEAD_SITES if s in model.sites()]})")
    cfg = model.cfg
    layers = cfg.num_encoder_layers if site == "encoder.z" else cfg.num_decoder_layers
    graphdef, state = nnx.split(model)

    def loss(state, layer, head):
        def patch(z, at):
            fill = jnp.zeros_like(z[:, :, 0]) if how == "zero" else jnp.broadcast_to(
                z[:, :, head].mean(axis=(0, 1), keepdims=True), z[:, :, 0].shape)
            return jnp.where(at == layer, z.at[:, :, head].set(fill.astype(z.dtype)), z)
        logits = nnx.merge(graphdef, state)(*inputs, patch={site: patch}, **forward_kw)[0]
        return mean_nll(logits, targets, weights)

    @jax.jit
    def table(state):
        clean = loss(state, -1, 0)                                    # layer −1: no layer patched
        lh = jnp.stack(jnp.meshgrid(jnp.arange(layers), jnp.arange(cfg.num_heads), indexing="ij"),
                       -1).reshape(-1, 2)
        return jax.lax.map(lambda p: loss(state, p[0], p[1]), lh).reshape(layers, cfg.num_heads) - clean
    return table(state)


def linear_probe(features: jax.Array, labels: jax.Array, train: jax.Array, *, num_classes: int | None = None,
                 l2: float = 1e-3) -> jax.Array:
    """A linear probe per layer: ridge regression onto one-hot labels, scored on held-out rows.

    Features are standardised on the training rows, with a bias and penalty l2 × rows; the probe is fitted on the
    rows where `train` is True and scored on the others. A closed-form probe: deterministic, no optimiser to
    tune, and a ceiling on what a linear read-out finds (a logistic probe ranks layers the same way on our tests).

    Args:
      features: [L, R, D] one row of D features per example and layer (e.g. captured resid_post [L, B, T, D]
        reshaped to rows).
      labels: [R] int class of each row.
      train: [R] bool, True for the rows the probe is fitted on; the others are scored.
      num_classes: the number of classes (None = max(labels) + 1).
      l2: the ridge penalty per training row.

    Returns:
      [L] float32 held-out accuracy per layer (argmax of the fitted scores; 0 when no row is held out).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jaxformer.interpret import linear_probe
      >>> labels = jnp.arange(16) % 2
      >>> noise = jax.random.normal(jax.random.key(0), (16, 4))
      >>> features = jnp.stack([noise, noise + 3.0 * labels[:, None]])    # layer 1 encodes the label
      >>> linear_probe(features, labels, train=jnp.arange(16) < 12).tolist()
      [0.75, 1.0]
    """
    k = int(num_classes or int(jnp.max(labels)) + 1)
    y = jax.nn.one_hot(labels, k)
    w_tr = train.astype(jnp.float32)[:, None]
    n = jnp.sum(w_tr)

    def one(x):
        x = x.astype(jnp.float32)
        mu = jnp.sum(x * w_tr, 0) / n
        sd = jnp.sqrt(jnp.sum(((x - mu) * w_tr) ** 2, 0) / n) + 1e-6
        xs = jnp.concatenate([(x - mu) / sd, jnp.ones_like(x[:, :1])], axis=1)             # [R,D+1]
        a = (xs * w_tr).T @ xs + l2 * n * jnp.eye(xs.shape[1]).at[-1, -1].set(0.0)         # bias unpenalised
        w = jnp.linalg.solve(a, (xs * w_tr).T @ y)
        hit = jnp.argmax(xs @ w, -1) == labels
        test = 1.0 - w_tr[:, 0]
        return jnp.sum(hit * test) / jnp.maximum(jnp.sum(test), 1.0)
    return jax.vmap(one)(features)
