"""Sparse autoencoders on a model's activation sites: trained on activations captured as the model runs (no
dump), reported by what they keep of the model, used as a patch, saved in SAELens' folder format.

Axis legend: R rows (the B·T positions of a batch), D the site's width (d_in), F latents (d_sae), L layers.

    spec = SAESpec(d_in=D, d_sae=8 * D, site="resid_post", layer=1, architecture="topk", k=16)
    params, log = train_sae(model, batches, spec, steps=2000)     # batches: iterable of the model's inputs
    report = evaluate_sae(model, params, spec, tokens, targets)   # fve, l0, dead, spliced-in loss
    logits, _ = model(tokens, patch={spec.site: sae_patch(params, spec, edit=ablate(7))})
    save_saelens(params, spec, "out/sae"); params, spec = load_saelens("out/sae")

Parameters are SAELens' (a dict): W_enc [D,F], b_enc [F], W_dec [F,D], b_dec [D]; the input has b_dec subtracted
before encoding (SAELens' apply_b_dec_to_input). Architectures: "topk" (Gao et al. 2024: the k largest
pre-activations, ReLU'd, the rest 0; trained on the reconstruction error plus the AuxK loss, whose top k_aux =
D/2 dead latents reconstruct the residual, scaled by min(dead / k_aux, 1), as SAELens does) and "standard" (ReLU,
trained on the reconstruction error plus l1 · Σ_i f_i·‖W_dec_i‖) and "jumprelu" (Rajamanoharan et al. 2024, as
SAELens 6 trains it: f = pre · [pre > θ] with a learned threshold θ [F] (params["threshold"], kept >= 0), trained
on the reconstruction error plus l0_coefficient · Σ_i [pre_i > θ_i], the threshold learning through
`jaxformer.ops.sparse`'s straight-through estimates of bandwidth ε). The reconstruction error is Σ_D (x̂ − x)²
averaged over rows (SAELens' mse). A latent is dead once it has not fired for `dead_steps` steps; a standard
SAE's dead latents are resampled every `resample_every` steps (Bricken et al. 2023: each pointed at a row the SAE
reconstructs worst, its encoder scaled to 0.2 of the live latents' mean norm, its Adam moments reset).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxformer.errors import ConfigError, DataError, Interrupted
from jaxformer.ops import sparse
from jaxformer.ops.losses import mean_nll
from jaxformer.saelens import ARCHITECTURES, CFG, WEIGHTS, hook_name
from jaxformer.signals import pending



_NOT_ROWS = {"pattern": "is [B,N,T,S], weights over the keys, not a vector per position",
             "attn_scores": "is [B,N,T,S], the attention logits over the keys, not a vector per position",
             **{h: "is [B,T,N,H] per head; SAELens flattens the heads of z only (its hook_z): read z or attn_out"
                for h in ("q", "k", "v")}}


@dataclasses.dataclass(frozen=True)
class SAESpec:
    """What an SAE reads and how it is trained: the per-layer `site` [B,T,D] of `layer`, its sizes, its
    architecture and training settings. Validated on construction (ConfigError naming the field).

    Attributes:
      d_in: D, the width of the rows the SAE reads (the site's width; N·H for z).
      d_sae: F, the number of latents.
      site: the per-layer activation site it reads (`jaxformer.nn.sites`), e.g. "resid_post".
      layer: the layer of that site (an "encoder." site counts the encoder's layers).
      architecture: "topk" or "standard" (module docstring).
      k: topk: the active latents per row, at most d_sae.
      l1: standard: the sparsity coefficient.
      l0_coefficient: jumprelu: the L0 penalty's coefficient (SAELens' l0_coefficient).
      threshold: jumprelu: every latent's threshold at the start (SAELens' jumprelu_init_threshold).
      bandwidth: jumprelu: ε, the width of the threshold's straight-through estimate (jumprelu_bandwidth).
      aux: topk: the AuxK loss's weight (Gao et al.'s α).
      lr: Adam's learning rate (> 0).
      dead_steps: a latent not fired for this many steps is dead.
      resample_every: standard: resample dead latents every n steps (0: never).

    Raises:
      ConfigError: an unknown architecture or empty site; d_in, d_sae, k or dead_steps not a positive int;
        layer or resample_every not an int >= 0; a topk k above d_sae; l1, aux, lr, l0_coefficient or threshold
        not a finite number >= 0
        (lr > 0).

    Examples:
      >>> from jaxformer.sae import SAESpec
      >>> spec = SAESpec(d_in=16, d_sae=64, site="resid_post", layer=0, k=4)
      >>> spec.architecture, spec.k
      ('topk', 4)
      >>> SAESpec(d_in=16, d_sae=8, k=16)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: sae.k=16 exceeds sae.d_sae=8
    """
    d_in: int
    d_sae: int
    site: str = "resid_post"
    layer: int = 0
    architecture: str = "topk"
    k: int = 32                        # topk: active latents per row
    l1: float = 5.0                    # standard: the sparsity coefficient
    l0_coefficient: float = 1.0        # jumprelu: the L0 penalty's coefficient
    threshold: float = 0.01            # jumprelu: the thresholds' start
    bandwidth: float = 0.05            # jumprelu: ε of the threshold's straight-through estimate
    aux: float = 1 / 32                # topk: the AuxK loss's weight (Gao et al.'s α)
    lr: float = 4e-4
    dead_steps: int = 200              # a latent not fired for this many steps is dead
    resample_every: int = 0            # standard: resample dead latents every n steps (0: never)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"sae.architecture={self.architecture!r} is not one of {ARCHITECTURES}")
        if not isinstance(self.site, str) or not self.site:
            raise ConfigError(f"sae.site={self.site!r} must name an activation site")
        for name in ("d_in", "d_sae", "k", "dead_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise ConfigError(f"sae.{name}={getattr(self, name)!r} must be a positive int")
        for name in ("layer", "resample_every"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"sae.{name}={getattr(self, name)!r} must be an int >= 0")
        if self.architecture == "topk" and self.k > self.d_sae:
            raise ConfigError(f"sae.k={self.k} exceeds sae.d_sae={self.d_sae}")
        for name in ("l1", "aux", "lr", "l0_coefficient", "threshold", "bandwidth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (name in ("lr", "bandwidth") and v == 0):
                raise ConfigError(f"sae.{name}={v!r} must be a finite number "
                                  + ("> 0" if name in ("lr", "bandwidth") else ">= 0"))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def init_sae(spec: SAESpec, key: jax.Array, mean: jax.Array | None = None) -> dict:
    """Decoder rows uniform on the unit sphere, the encoder their transpose (Gao et al.), b_enc 0, b_dec the
    activations' mean when given (else 0).

    Args:
      spec: the SAE's `SAESpec` (its d_in D and d_sae F).
      key: a `jax.random` key for the decoder rows.
      mean: [D] the activations' mean row, b_dec's start (None: zeros).

    Returns:
      SAELens' parameter dict: W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D] (and threshold [F], all
        spec.threshold, for jumprelu), float32.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.sae import SAESpec, init_sae
      >>> params = init_sae(SAESpec(d_in=16, d_sae=64, k=4), jax.random.key(0))
      >>> {name: w.shape for name, w in params.items()}
      {'W_enc': (16, 64), 'b_enc': (64,), 'W_dec': (64, 16), 'b_dec': (16,)}
      >>> bool(jnp.allclose(jnp.linalg.norm(params["W_dec"], axis=-1), 1.0))     # unit decoder rows
      True
    """
    w = jax.random.normal(key, (spec.d_sae, spec.d_in))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    params = {"W_enc": w.T, "b_enc": jnp.zeros(spec.d_sae), "W_dec": w,
              "b_dec": jnp.zeros(spec.d_in) if mean is None else jnp.asarray(mean, jnp.float32)}
    if spec.architecture == "jumprelu":
        params["threshold"] = jnp.full(spec.d_sae, spec.threshold, jnp.float32)
    return params


def pre_activations(params: dict, x: jax.Array) -> jax.Array:
    """x [..., D] -> (x − b_dec) @ W_enc + b_enc [..., F], float32.

    Args:
      params: the SAE's parameters (`init_sae`, `train_sae`).
      x: [..., D] rows of the site's values, any float dtype.

    Returns:
      [..., F] float32 pre-activations, before ReLU or top-k.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.sae import SAESpec, init_sae, pre_activations
      >>> params = init_sae(SAESpec(d_in=16, d_sae=64, k=4), jax.random.key(0))
      >>> pre_activations(params, jnp.ones((2, 3, 16), jnp.bfloat16)).shape
      (2, 3, 64)
    """
    return (x.astype(jnp.float32) - params["b_dec"]) @ params["W_enc"] + params["b_enc"]


def encode(params: dict, x: jax.Array, spec: SAESpec) -> jax.Array:
    """x [..., D] -> the latents f [..., F] (topk: the k largest pre-activations ReLU'd, the rest 0).

    A standard SAE's latents are its pre-activations ReLU'd; a jumprelu SAE's, those above its thresholds (ReLU'd,
    as SAELens' JumpReLUSAE.encode).

    Args:
      params: the SAE's parameters (`init_sae`, `train_sae`).
      x: [..., D] rows of the site's values.
      spec: the SAE's `SAESpec` (its architecture and k).

    Returns:
      [..., F] float32 latents, >= 0; topk: at most k of each row are nonzero.

    Examples:
      >>> import jax
      >>> from jaxformer.sae import SAESpec, encode, init_sae
      >>> spec = SAESpec(d_in=16, d_sae=64, k=4)
      >>> f = encode(init_sae(spec, jax.random.key(0)), jax.random.normal(jax.random.key(1), (3, 16)), spec)
      >>> f.shape, (f > 0).sum(-1).tolist()                      # 4 active latents per row
      ((3, 64), [4, 4, 4])
    """
    pre = pre_activations(params, x)
    if spec.architecture == "standard":
        return jax.nn.relu(pre)
    if spec.architecture == "jumprelu":
        return jax.nn.relu(pre) * (pre > params["threshold"])
    return _keep_top(pre, spec.k)


def _keep_top(pre: jax.Array, k: int) -> jax.Array:
    values, index = jax.lax.top_k(pre, k)
    rows = pre.reshape(-1, pre.shape[-1])
    out = jnp.zeros_like(rows).at[jnp.arange(rows.shape[0])[:, None], index.reshape(rows.shape[0], k)].set(
        jax.nn.relu(values).reshape(rows.shape[0], k))
    return out.reshape(pre.shape)


def decode(params: dict, f: jax.Array) -> jax.Array:
    """f [..., F] -> x̂ = f @ W_dec + b_dec [..., D].

    Args:
      params: the SAE's parameters (`init_sae`, `train_sae`).
      f: [..., F] latents (`encode`'s, or edited ones).

    Returns:
      [..., D] the reconstruction x̂ (float32 for float32 parameters).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.sae import SAESpec, decode, encode, init_sae
      >>> spec = SAESpec(d_in=16, d_sae=64, k=4)
      >>> params = init_sae(spec, jax.random.key(0), mean=jnp.full(16, 0.5))
      >>> x = jax.random.normal(jax.random.key(1), (3, 16))
      >>> decode(params, encode(params, x, spec)).shape
      (3, 16)
      >>> decode(params, jnp.zeros(64)).tolist() == [0.5] * 16     # no active latent: b_dec
      True
    """
    return f @ params["W_dec"] + params["b_dec"]


def sae_loss(params: dict, x: jax.Array, spec: SAESpec, dead: jax.Array,
             w: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The training loss on rows x [R,D] (module docstring) and its parts; dead [F] bool: the dead latents; w [R]:
    1 for a real row, 0 for padding (None: every row), what every mean is over.

    Args:
      params: the SAE's parameters (`init_sae`).
      x: [R, D] rows of the site's values.
      spec: the SAE's `SAESpec` (architecture, k, l1, aux).
      dead: [F] bool, the latents counted dead (topk: the AuxK loss reconstructs the residual with them).
      w: [R] row weights, 1 for a real row and 0 for padding (None: every row real).

    Returns:
      `(loss, parts)`: loss a float32 scalar (the reconstruction error plus AuxK, the L1 or the L0 penalty); parts a
        dict of mse (scalar, Σ_D (x̂ − x)² averaged over the real rows), l0 (scalar, mean active latents per
        row) and fired ([F] bool, the latents active on some real row).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.sae import SAESpec, init_sae, sae_loss
      >>> spec = SAESpec(d_in=16, d_sae=64, k=4)
      >>> params = init_sae(spec, jax.random.key(0))
      >>> x = jax.random.normal(jax.random.key(1), (8, 16))
      >>> loss, parts = jax.jit(sae_loss, static_argnames="spec")(params, x, spec, dead=jnp.zeros(64, bool))
      >>> loss.shape, sorted(parts), float(parts["l0"]), parts["fired"].shape
      ((), ['fired', 'l0', 'mse'], 4.0, (64,))
    """
    x = x.astype(jnp.float32)
    w = jnp.ones(x.shape[0], jnp.float32) if w is None else w.astype(jnp.float32)
    mean = lambda v: jnp.sum(v * w) / jnp.maximum(jnp.sum(w), 1.0)                  # noqa: E731
    pre = pre_activations(params, x)
    f = jax.nn.relu(pre) if spec.architecture == "standard" else _keep_top(pre, spec.k) \
        if spec.architecture == "topk" else sparse.jumprelu(pre, params["threshold"], spec.bandwidth)
    x_hat = decode(params, f)
    mse = mean(jnp.sum((x_hat - x) ** 2, -1))
    if spec.architecture == "standard":
        extra = spec.l1 * mean(jnp.sum(f * jnp.linalg.norm(params["W_dec"], axis=-1), -1))
    elif spec.architecture == "jumprelu":
        extra = spec.l0_coefficient * mean(jnp.sum(sparse.step(pre, params["threshold"], spec.bandwidth), -1))
    else:
        k_aux = max(spec.d_in // 2, 1)
        n_dead = jnp.sum(dead)
        ranked = jnp.where(dead, pre, -jnp.inf)
        values, index = jax.lax.top_k(ranked, min(k_aux, spec.d_sae))
        keep = jnp.arange(values.shape[-1]) < n_dead                             # only dead latents
        acts = jnp.zeros_like(pre).at[jnp.arange(pre.shape[0])[:, None], index].set(
            jnp.where(keep, values, 0.0))
        residual = jax.lax.stop_gradient(x - x_hat)
        aux = mean(jnp.sum((acts @ params["W_dec"] - residual) ** 2, -1))
        extra = spec.aux * jnp.minimum(n_dead / k_aux, 1.0) * jnp.where(n_dead > 0, aux, 0.0)
    return mse + extra, {"mse": mse, "l0": mean(jnp.sum(f > 0, -1)), "fired": jnp.any((f > 0) & (w[:, None] > 0), 0)}


class SiteInputs(NamedTuple):
    """One batch of the model's inputs: positional args ((tokens,) or (src, tgt)), keywords of the call
    (segment_ids, positions, ...) and valid [B,T] (1 = a real position, 0 = padding: not a row to fit or score;
    None = every position).

    Attributes:
      args: the model's positional inputs: (tokens,) or (src, tgt), each [B, T] int.
      kw: keyword arguments of the model call (segment_ids, positions, ...); default none.
      valid: [B, T] 1 at a real position, 0 on padding (not a row to fit or score); None = every position.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.sae import SiteInputs
      >>> tokens = jnp.array([[3, 4, 5, 0]])
      >>> batch = SiteInputs((tokens,), {"segment_ids": jnp.array([[1, 1, 1, 0]])}, valid=tokens != 0)
      >>> batch.valid.sum().item(), sorted(batch.kw)
      (3, ['segment_ids'])
    """
    args: tuple
    kw: dict = {}
    valid: jax.Array | None = None


def _as_inputs(batch) -> SiteInputs:
    return batch if isinstance(batch, SiteInputs) else SiteInputs(tuple(batch))


def site_rows(model, inputs, spec: SAESpec) -> tuple[jax.Array, jax.Array]:
    """The site's values at `spec.layer` for a batch (a `SiteInputs`, or a tuple of positional inputs) as rows
    [B·T, D] (float32), with their weights [B·T] (1 real, 0 padding).

    Args:
      model: a model of `jaxformer.nn`.
      inputs: a `SiteInputs`, or a tuple of the model's positional inputs ((tokens,) or (src, tgt)).
      spec: the SAE's `SAESpec` (its site and layer).

    Returns:
      `(rows, weights)`: rows [B·T, D] float32 (z's heads flattened to N·H); weights [B·T] float32, 1 at a real
        position and 0 on padding (SiteInputs.valid; all 1 without it).

    Raises:
      ConfigError: a site the model does not have (the model's refusal); `check_site` says which sites an SAE
        can read.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import SAESpec, SiteInputs, site_rows
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> tokens = jnp.array([[3, 4, 5, 0]])                     # the last position is padding
      >>> rows, w = site_rows(model, SiteInputs((tokens,), valid=tokens != 0), SAESpec(d_in=16, d_sae=64, k=4))
      >>> rows.shape, w.tolist()
      ((4, 16), [1.0, 1.0, 1.0, 0.0])
    """
    inputs = _as_inputs(inputs)
    value = model(*inputs.args, capture=(spec.site,), **inputs.kw)[1]["captured"][spec.site][spec.layer]
    rows = value.reshape(value.shape[0] * value.shape[1], -1).astype(jnp.float32)         # z: heads flattened
    valid = jnp.ones(rows.shape[0]) if inputs.valid is None else jnp.asarray(inputs.valid).reshape(-1)
    return rows, valid.astype(jnp.float32)


def check_site(model, site: str, layer: int) -> None:
    """ConfigError unless an SAE can read `site` at `layer` of `model`: a per-layer site whose value is a vector
    per position, [B,T,D] (z, [B,T,N,H], has its heads flattened to N·H, as SAELens' hook_z SAEs read it), at a
    layer its stack has (an "encoder." site counts the encoder's layers).

    Args:
      model: a model of `jaxformer.nn`.
      site: an activation site name (`model.sites()`).
      layer: the layer of that site, in [0, layers of its stack).

    Returns:
      None, when the site can be read (else it raises).

    Raises:
      ConfigError: a site the model does not have; a model-level site (one value, not one per layer); a site
        that is not a vector per position (pattern, attn_scores, and q, k, v per head); a layer outside its
        stack.

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import check_site
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> check_site(model, "z", 0)                             # readable: nothing returned
      >>> check_site(model, "resid_post", 2)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: sae.layer=2 is outside the 2 layers of site 'resid_post' (0..1)
    """
    if site not in model.sites():
        raise ConfigError(f"sae.site={site!r} is not one of the model's sites {list(model.sites())}")
    layers = model.site_layers(site)
    if not layers:
        raise ConfigError(f"sae.site={site!r} is model-level (one value for the model, not one per layer); an SAE "
                          f"reads a per-layer site (resid_pre at layer 0 is what the stack reads from embed)")
    base = site.removeprefix("encoder.").removeprefix("cross_")
    if base in _NOT_ROWS:
        raise ConfigError(f"sae.site={site!r} {_NOT_ROWS[base]}")
    if not _is_int(layer) or not 0 <= layer < layers:
        raise ConfigError(f"sae.layer={layer!r} is outside the {layers} layers of site {site!r} (0..{layers - 1})")


def site_width(model, site: str) -> int:
    """The width D of the rows an SAE on `site` reads (N·H for z), from the model's shapes (nothing computed).

    Args:
      model: a model of `jaxformer.nn`.
      site: an activation site name (`model.sites()`); `check_site` says whether an SAE can read it.

    Returns:
      The int D: the product of the site's value's axes after [B, T] (d_model for the residual stream, N·H for
        z, F for mlp_hidden).

    Raises:
      ConfigError: a site the model does not have (the model's refusal).

    Examples:
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import site_width
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> site_width(model, "resid_post"), site_width(model, "z"), site_width(model, "mlp_hidden")
      (16, 16, 32)
    """
    t = jnp.zeros((1, 2), jnp.int32)
    args = (t,) if model.cfg.arch == "decoder_only" else (t, t)
    shape = jax.eval_shape(lambda: model(*args, capture=(site,))[1]["captured"][site]).shape       # [L,B,T,...]
    return math.prod(shape[3:])


def _check_site(model, spec: SAESpec) -> None:
    check_site(model, spec.site, spec.layer)
    width = site_width(model, spec.site)
    if width != spec.d_in:
        raise ConfigError(f"sae.d_in={spec.d_in} but site {spec.site!r} has width {width}")



def _normalized(params: dict, spec: SAESpec) -> dict:
    """topk keeps unit-norm decoder rows (Gao et al.); standard's L1 reads the norms instead; jumprelu keeps its
    thresholds >= 0 (below 0 the gate would pass negative pre-activations; SAELens projects them so)."""
    if spec.architecture == "standard":
        return params
    if spec.architecture == "jumprelu":
        return {**params, "threshold": jnp.maximum(params["threshold"], 0.0)}
    return {**params, "W_dec": params["W_dec"] / jnp.linalg.norm(params["W_dec"], axis=-1, keepdims=True)}


def _step_program(train: dict, graphdef, model_state, inputs: tuple, *, spec: SAESpec, tx) -> tuple[dict, dict]:
    x, w = site_rows(nnx.merge(graphdef, model_state), inputs, spec)
    dead = train["since_fired"] >= spec.dead_steps
    (loss, parts), grads = jax.value_and_grad(sae_loss, has_aux=True)(train["params"], x, spec, dead, w)
    updates, opt = tx.update(grads, train["opt"], train["params"])
    params = _normalized(optax.apply_updates(train["params"], updates), spec)
    since = jnp.where(parts["fired"], 0, train["since_fired"] + 1)
    return ({"params": params, "opt": opt, "since_fired": since},
            {"loss": loss, "mse": parts["mse"], "l0": parts["l0"], "dead": jnp.mean(dead)})


def _resample_program(train: dict, graphdef, model_state, inputs: tuple, *, spec: SAESpec) -> dict:
    """Dead latents pointed at the rows reconstructed worst (module docstring), their Adam moments reset."""
    p = train["params"]
    x, w = site_rows(nnx.merge(graphdef, model_state), inputs, spec)
    err = jnp.where(w > 0, jnp.sum((decode(p, encode(p, x, spec)) - x) ** 2, -1), -1.0)     # padding last
    worst = jnp.argsort(-err)
    dead = train["since_fired"] >= spec.dead_steps
    row = worst[jnp.maximum(jnp.cumsum(dead) - 1, 0) % worst.shape[0]]                  # [F]
    direction = x[row] - p["b_dec"]
    direction = direction / jnp.maximum(jnp.linalg.norm(direction, axis=-1, keepdims=True), 1e-8)
    live = jnp.linalg.norm(p["W_enc"], axis=0)
    scale = 0.2 * jnp.sum(jnp.where(dead, 0.0, live)) / jnp.maximum(jnp.sum(~dead), 1)
    params = {"W_dec": jnp.where(dead[:, None], direction, p["W_dec"]),
              "W_enc": jnp.where(dead[None, :], direction.T * scale, p["W_enc"]),
              "b_enc": jnp.where(dead, 0.0, p["b_enc"]), "b_dec": p["b_dec"]}
    masks = {"W_dec": dead[:, None], "W_enc": dead[None, :], "b_enc": dead, "b_dec": jnp.zeros((), bool)}

    def reset(state):
        if isinstance(state, optax.ScaleByAdamState):
            zero = lambda t: {n: jnp.where(masks[n], 0.0, v) for n, v in t.items()}      # noqa: E731
            return state._replace(mu=zero(state.mu), nu=zero(state.nu))
        return state
    opt = jax.tree.map(reset, train["opt"], is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    return {"params": params, "opt": opt, "since_fired": jnp.where(dead, 0, train["since_fired"])}


# jitted by assignment, not by decorator: mutation testing (tools/mutation.py) mutates undecorated functions only
_step = jax.jit(_step_program, static_argnames=("graphdef", "spec", "tx"), donate_argnums=(0,))
_resample = jax.jit(_resample_program, static_argnames=("graphdef", "spec"), donate_argnums=(0,))


def train_sae(model, batches: Iterable[tuple], spec: SAESpec, steps: int, *, seed: int = 0,
              params: dict | None = None) -> tuple[dict, list[dict]]:
    """Train an SAE on the site's activations, captured from the model (frozen) batch by batch inside one jitted
    step (nothing is dumped).

    batches: the model's inputs per step (`SiteInputs`, or tuples of positional inputs: (tokens,) or (src, tgt)),
    at least `steps` of them; padding positions (SiteInputs.valid 0) are not fitted. b_dec starts at the first
    batch's mean row unless `params` are given. Adam at spec.lr; a topk SAE's decoder rows are kept unit-norm; a
    standard SAE's dead latents are resampled every spec.resample_every steps (module docstring).

    Args:
      model: a model of `jaxformer.nn` (not changed).
      batches: an iterable of the model's inputs, one per step: `SiteInputs`, or tuples ((tokens,) or
        (src, tgt)) of [B, T] int arrays.
      spec: the SAE's `SAESpec`: the site and layer it reads, its sizes and training settings.
      steps: how many steps to train (an int >= 1).
      seed: the seed of `init_sae`'s key (not read when params are given).
      params: parameters to start from (a dict as `init_sae` returns); None = `init_sae`.

    Returns:
      `(params, log)`: params SAELens' dict (W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D]); log one dict per
        step of loss, mse, l0 and dead (the dead fraction), float32 scalars (device arrays: read them after
        training).

    Raises:
      ConfigError: steps not an int >= 1; a site the SAE cannot read at spec.layer (`check_site`); spec.d_in
        other than the site's width (`site_width`).
      DataError: batches that run out before `steps`.
      Interrupted: a stop signal the command line holds (library calls: never).

    Examples:
      One step, the fewest it takes, to show the call (a real SAE trains for thousands):

      >>> import jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import SAESpec, train_sae
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> tokens = jnp.array([[3, 4, 5, 6]])
      >>> spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
      >>> params, log = train_sae(model, [(tokens,)], spec, steps=1)
      >>> len(log), sorted(log[0]), params["W_dec"].shape
      (1, ['dead', 'l0', 'loss', 'mse'], (32, 16))
      >>> train_sae(model, [(tokens,)], spec, steps=0)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: steps=0: an SAE trains for at least one step
    """
    if not _is_int(steps) or steps < 1:
        raise ConfigError(f"steps={steps!r}: an SAE trains for at least one step")
    _check_site(model, spec)
    graphdef, model_state = nnx.split(model)
    it = iter(batches)
    tx = optax.adam(spec.lr)
    log = []
    for i in range(steps):
        if pending():       # a stop signal the command line holds (`signals.hold_from_start`; library calls: never)
            raise Interrupted(f"jaxformer sae stopped on {pending()} at step {i} of {steps}; nothing was written",
                              pending())
        inputs = next(it, None)
        if inputs is None:
            raise DataError(f"train_sae: the batches ran out after {i} of {steps} steps")
        inputs = _as_inputs(inputs)
        if i == 0:
            if params is None:
                x, w = site_rows(model, inputs, spec)
                mean = jnp.sum(x * w[:, None], 0) / jnp.maximum(jnp.sum(w), 1.0)
                params = init_sae(spec, jax.random.key(seed), mean)
            params = jax.tree.map(jnp.array, params)                  # copies: the step donates its state
            train = {"params": params, "opt": tx.init(params), "since_fired": jnp.zeros(spec.d_sae, jnp.int32)}
        if spec.architecture == "standard" and spec.resample_every and i and i % spec.resample_every == 0:
            train = _resample(train, graphdef, model_state, inputs, spec=spec)
        train, metrics = _step(train, graphdef, model_state, inputs, spec=spec, tx=tx)
        log.append(metrics)
    return train["params"], log


def sae_patch(params: dict, spec: SAESpec, edit: Callable[[jax.Array], jax.Array] | None = None,
              keep_error: bool = False) -> Callable:
    """A patch for the model call (`patch={spec.site: ...}`): at spec.layer the site's value becomes the SAE's
    reconstruction of it, with edit(f) applied to the latents [B,T,F] first (e.g. ablating or clamping one
    feature).

    keep_error: add the SAE's own error (x − x̂ of the unedited latents) back, so that only the edit changes the
    model (with no edit the model is exactly itself). z's heads [B,T,N,H] are read flattened, as its SAE was
    trained. The function's `layer` attribute lets the model refuse a layer it does not have (ConfigError at the
    call).

    Args:
      params: the SAE's parameters (`train_sae`, `load_saelens`).
      spec: the SAE's `SAESpec`: the site and layer it replaces.
      edit: a function of the latents [B, T, F] -> latents [B, T, F] (None: none).
      keep_error: add the SAE's reconstruction error back (only the edit changes the model).

    Returns:
      A patch function (value [B, T, ...], layer) -> value of the same shape and dtype, changed at spec.layer
        only, with a `layer` attribute (spec.layer).

    Raises:
      ConfigError: at the model call, a site whose width is not spec.d_in, or a spec.layer the model does not
        have.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import SAESpec, init_sae, sae_patch
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
      >>> params = init_sae(spec, jax.random.key(0))
      >>> tokens = jnp.array([[3, 4, 5, 6]])
      >>> same = model(tokens, patch={spec.site: sae_patch(params, spec, keep_error=True)})[0]
      >>> bool(jnp.allclose(same, model(tokens)[0], atol=1e-5))          # keep_error and no edit: the model itself
      True
      >>> ablate_7 = lambda f: f.at[..., 7].set(0.0)                      # feature 7 switched off
      >>> model(tokens, patch={spec.site: sae_patch(params, spec, edit=ablate_7)})[0].shape
      (1, 4, 16)
    """
    def fn(value, at):
        x = value.reshape(*value.shape[:2], -1)
        if x.shape[-1] != spec.d_in:
            raise ConfigError(f"the SAE reads sae.d_in={spec.d_in} but site {spec.site!r} has width {x.shape[-1]}")
        f = encode(params, x, spec)
        out = decode(params, edit(f) if edit is not None else f)
        if keep_error:
            out = out + (x.astype(jnp.float32) - decode(params, f))
        return jnp.where(at == spec.layer, out.reshape(value.shape).astype(value.dtype), value)
    fn.layer = spec.layer
    return fn


def evaluate_sae(model, params: dict, spec: SAESpec, inputs, targets: jax.Array,
                 weights: jax.Array | None = None) -> dict:
    """What the SAE keeps, on one batch (`SiteInputs` or a tuple of positional inputs) and its next-token targets
    [B,T] (weights [B,T]: which count; None = the batch's valid positions).

    Args:
      model: a model of `jaxformer.nn`.
      params: the SAE's parameters (`train_sae`, `load_saelens`).
      spec: the SAE's `SAESpec`.
      inputs: a `SiteInputs`, or a tuple of the model's positional inputs ((tokens,) or (src, tgt)).
      targets: [B, T] int next-token targets of the model's loss.
      weights: [B, T] which targets count (None: the batch's valid positions; all without them).

    Returns:
      A dict of Python floats: fve (fraction of variance explained, 1 − Σ(x − x̂)² / Σ(x − x̄)² over the real
        rows), mse, l0 (mean active latents per row), dead (the fraction of latents that fire on no row), and the
        spliced-in loss: the model's loss (`ops.losses.mean_nll`) clean (loss_clean), with the SAE's
        reconstruction patched in (loss_spliced), and with the site zeroed at that layer (loss_zero); recovered
        = (zero − spliced) / (zero − clean), 1 when the reconstruction loses nothing.

    Raises:
      ConfigError: a site the SAE cannot read at spec.layer (`check_site`); spec.d_in other than the site's
        width.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxformer.config import ModelConfig, replaced
      >>> from jaxformer.nn import build_model
      >>> from jaxformer.sae import SAESpec, evaluate_sae, init_sae
      >>> model = build_model(replaced(ModelConfig(), arch="decoder_only", vocab_size=16, d_model=16, num_heads=2,
      ...                              d_ff=32, num_decoder_layers=2, max_len=16), seed=0)
      >>> spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
      >>> tokens = jnp.array([[3, 4, 5, 6, 7]])
      >>> report = evaluate_sae(model, init_sae(spec, jax.random.key(0)), spec, (tokens[:, :-1],), tokens[:, 1:])
      >>> sorted(report)
      ['dead', 'fve', 'l0', 'loss_clean', 'loss_spliced', 'loss_zero', 'mse', 'recovered']
      >>> report["l0"]                                     # topk: k latents per row
      4.0
    """
    _check_site(model, spec)
    inputs = _as_inputs(inputs)
    weights = inputs.valid if weights is None else weights
    x, w = site_rows(model, inputs, spec)
    f = encode(params, x, spec)
    err = jnp.sum((x - decode(params, f)) ** 2, -1)
    mean = lambda v: float(jnp.sum(v * w) / jnp.sum(w))                                       # noqa: E731
    centre = jnp.sum(x * w[:, None], 0) / jnp.sum(w)
    loss = lambda patch=None: float(mean_nll(model(*inputs.args, patch=patch, **inputs.kw)[0], targets,  # noqa: E731
                                             weights))
    zero = lambda v, at: jnp.where(at == spec.layer, jnp.zeros_like(v), v)                         # noqa: E731
    clean, spliced, zeroed = loss(), loss({spec.site: sae_patch(params, spec)}), loss({spec.site: zero})
    return {"fve": float(1 - jnp.sum(err * w) / jnp.sum(jnp.sum((x - centre) ** 2, -1) * w)), "mse": mean(err),
            "l0": mean(jnp.sum(f > 0, -1)), "dead": float(jnp.mean(~jnp.any((f > 0) & (w[:, None] > 0), 0))),
            "loss_clean": clean, "loss_spliced": spliced, "loss_zero": zeroed,
            "recovered": (zeroed - spliced) / (zeroed - clean)}


def save_saelens(params: dict, spec: SAESpec, path: str | Path, model_name: str = "jaxformer") -> Path:
    """The SAE as an SAELens folder: cfg.json and sae_weights.safetensors.

    cfg.json holds SAELens 6's fields: architecture, d_in, d_sae, dtype, device, apply_b_dec_to_input,
    normalize_activations, reshape_activations, k and rescale_acts_by_decoder_norm (false: the weights are as
    they act) for topk, metadata with hook_name in TransformerLens' naming where the site has one, else
    SITE.LAYER, and hook_layer; sae_weights.safetensors holds W_enc, b_enc, W_dec, b_dec, float32. Our own fields
    (the site name, training settings) go under "jaxformer", which SAELens ignores. Written whole
    (`jaxformer.staging.staged`: into PATH.partial, renamed to PATH when complete).

    Args:
      params: the SAE's parameters (W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D]).
      spec: the SAE's `SAESpec`.
      path: the folder PATH to write: it must not exist, or be an empty folder.
      model_name: the metadata's model_name.

    Returns:
      PATH, as a `pathlib.Path`.

    Raises:
      OutputError: PATH holds anything (a user's cfg.json, an earlier SAE): the message names what it holds, and
        nothing in it is replaced.

    Examples:
      >>> import jax, tempfile
      >>> from pathlib import Path
      >>> from jaxformer.sae import SAESpec, init_sae, save_saelens
      >>> spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> folder = save_saelens(init_sae(spec, jax.random.key(0)), spec, Path(tmp.name) / "sae")
      >>> sorted(p.name for p in folder.iterdir())
      ['cfg.json', 'sae_weights.safetensors']
      >>> save_saelens(init_sae(spec, jax.random.key(1)), spec, folder)
      Traceback (most recent call last):
      ...
      jaxformer.errors.OutputError: ...sae is not empty (it holds cfg.json, sae_weights.safetensors); ...
      >>> tmp.cleanup()
    """
    from safetensors.numpy import save_file

    from jaxformer.staging import staged
    path = Path(path)
    cfg = {"architecture": spec.architecture, "d_in": spec.d_in, "d_sae": spec.d_sae, "dtype": "float32",
           "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
           "reshape_activations": "hook_z" if spec.site.rsplit(".", 1)[-1] in ("z", "cross_z") else "none",
           **({"k": spec.k, "rescale_acts_by_decoder_norm": False} if spec.architecture == "topk" else {}),
           "metadata": {"model_name": model_name, "hook_name": hook_name(spec.site, spec.layer),
                        "hook_layer": spec.layer, "sae_lens_version": "6.0.0"},
           "jaxformer": dataclasses.asdict(spec)}
    with staged(path, noun="SAE folder") as tmp:
        save_file({n: np.asarray(v, np.float32) for n, v in params.items()}, str(tmp / WEIGHTS))
        (tmp / CFG).write_text(json.dumps(cfg, indent=1) + "\n")
    return path


def load_saelens(path: str | Path) -> tuple[dict, SAESpec]:
    """An SAELens folder (cfg.json + sae_weights.safetensors), ours or SAELens' own (6, a trainer's checkpoint, or
    before 6), read as SAELens reads it (`jaxformer.saelens`: the site and layer from the hook name, settings
    folded into the weights or refused) -> (params, spec).

    Args:
      path: the folder (`save_saelens`' PATH, or one SAELens wrote).

    Returns:
      `(params, spec)`: params the dict W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D]; spec its `SAESpec`.

    Raises:
      DataError: naming what is missing, unreadable or unsupported (no cfg.json or weights, a setting that
        cannot be folded into the weights, fields no SAESpec takes).

    Examples:
      >>> import jax, tempfile
      >>> from pathlib import Path
      >>> from jaxformer.sae import SAESpec, init_sae, load_saelens, save_saelens
      >>> spec = SAESpec(d_in=16, d_sae=32, site="resid_post", layer=0, k=4)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> folder = save_saelens(init_sae(spec, jax.random.key(0)), spec, Path(tmp.name) / "sae")
      >>> params, loaded = load_saelens(folder)
      >>> loaded == spec, params["W_enc"].shape
      (True, (16, 32))
      >>> load_saelens(Path(tmp.name) / "elsewhere")
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: ...elsewhere: an SAELens folder holds cfg.json and sae_weights.safetensors
      >>> tmp.cleanup()
    """
    from jaxformer.saelens import check_ours, read_folder
    cfg, params, fields = read_folder(path)
    ours = check_ours(Path(path), fields, cfg.get("jaxformer"))
    try:
        spec = SAESpec(**{**ours, **fields})
    except (TypeError, ConfigError) as e:
        raise DataError(f"{Path(path) / CFG}: not a usable SAE ({type(e).__name__}: {e})") from None
    return params, spec
