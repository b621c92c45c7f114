"""Named activation sites: read (capture) and replace (patch) any activation of a language model's forward pass,
under jit, grad and the scanned layer stack, without a Python loop over layers.

`model(tokens, capture=(names...), patch={name: fn})` (in every mode, cached decoding included): each captured
site's value comes back in `out["captured"][name]`, a per-layer site stacked over the layers ([L, ...]); a
patched site's value is replaced by fn(value, layer) wherever it is computed (layer: the layer's index, a traced
int32 inside the scan; None for a model-level site), and what follows reads the replacement (a captured site
records the value after its patch). `model.sites()` lists the names, found by tracing the call (`discover`): a
site is whatever a module passes through `Sites`, with no registry to update. Names and shapes (B batch,
T length, S keys, D width, N query heads, K kv heads, H head dim, F FFN width, V vocab):

  model   embed [B,T,D] (the stack's input: token embedding, scaled, plus positions); final_norm [B,T,D] (the
          output head's input: after the final norm where the model has one); logits [B,T,V]
  layer   resid_pre [B,T,D]; attn_in [B,T,D] (what the self-attention reads: normalised with pre-LN);
          q [B,T,N,H], k [B,S,K,H], v [B,S,K,H] (after QK-norm and RoPE, as attention uses them);
          attn_scores [B,N,T,S] (the attention logits, float32: scaled, capped, biased, before the mask, which
          applies to a patched value; asking for it runs the materialising reference backend);
          pattern [B,N,T,S] (attention probabilities, float32: fused backends recompute them from their
          log-sum-exp as the heatmaps do; a patched pattern makes the context its own probabilities times the
          values, without attention dropout); z [B,T,N,H] (each head's output, before the output projection:
          head-wise, so zeroing z[..., h, :] ablates head h); attn_out [B,T,D]; resid_mid [B,T,D];
          mlp_in [B,T,D]; mlp_hidden [B,T,F] (a dense FFN's activation output); mlp_out [B,T,D]; resid_post [B,T,D]

An encoder-decoder (`model(src, tgt, capture=..., patch=...)`) has the same names for its decoder,
plus its cross-attention's, between resid_mid and mlp_in: cross_in [B,T,D] (what it reads), cross_q [B,T,N,H],
cross_k / cross_v [B,S,K,H] (from the memory), cross_pattern [B,N,T,S], cross_z [B,T,N,H], cross_out [B,T,D],
resid_cross [B,T,D]; and its encoder's: encoder.embed [B,S,D], encoder.<layer site> (S for T), and memory
[B,S,D] (the encoder's output, what cross-attention reads).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from jaxformer.errors import ConfigError

Patch = Callable[[jax.Array, "jax.Array | None"], jax.Array]


class _Everything:
    """A capture list holding every name: what `discover` traces with."""
    def __contains__(self, name) -> bool:
        return True


class Hooks(NamedTuple):
    """What a forward pass reads and replaces: site names to capture, and (name, fn) pairs to patch.

    Attributes:
      capture: the site names whose values the pass records.
      patch: (name, fn) pairs: the site's value becomes fn(value, layer).
      prefix: prepended to the names a stack's blocks use ("encoder." for an encoder's).
      reached: where given, a dict in which every site name the pass reaches is recorded, in order (`discover`).

    Examples:
      >>> from jaxformer.nn.sites import Hooks
      >>> h = Hooks(capture=("q",), patch=(("z", lambda value, layer: 0 * value),))
      >>> h.wants("q"), h.wants("z"), h.wants("k")
      (True, True, False)
    """
    capture: tuple[str, ...] = ()
    patch: tuple[tuple[str, Patch], ...] = ()
    prefix: str = ""
    reached: dict | None = None

    def wants(self, name: str) -> bool:
        return name in self.capture or any(n == name for n, _ in self.patch)


def discover(call: Callable[[Hooks], object]) -> dict[str, bool]:
    """The sites a forward pass reaches, in the order it reaches them.

    `call(hooks)` runs the pass with hooks capturing everything, traced abstractly (jax.eval_shape: nothing is
    computed). A site is whatever a module passes through `Sites`, so adding one is a line in the module that
    computes it; a model lists its own (`model.sites()`).

    Args:
      call: a function of a `Hooks` that runs the forward pass with it.

    Returns:
      {name: per_layer}: True for a per-layer site (a value per layer of a stack, [L, ...] when captured), False
        for a model-level one.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.sites import Sites, discover
      >>> def call(hooks):                   # a model-level site, then a site of layer 0
      ...     return Sites(hooks, layer=0)("resid_post", Sites(hooks)("embed", jnp.ones(2)))
      >>> discover(call)
      {'embed': False, 'resid_post': True}
    """
    hooks = Hooks(capture=_Everything(), reached={})
    jax.eval_shape(lambda: call(hooks))
    return dict(hooks.reached)


def hooks(capture=(), patch=None, available: tuple[str, ...] = ()) -> Hooks | None:
    """A validated Hooks for a call's capture and patch arguments (None when nothing is asked).

    Args:
      capture: a site name or names to capture.
      patch: {site name: fn(value, layer) -> value}, or None.
      available: the model's site names (`discover`).

    Returns:
      A `Hooks`, or None when capture and patch are both empty.

    Raises:
      ConfigError: a site not in `available`, or a patch that is not callable.

    Examples:
      >>> from jaxformer.nn.sites import hooks
      >>> h = hooks("q", {"z": lambda value, layer: 0 * value}, available=("q", "z"))
      >>> h.capture, [name for name, _ in h.patch]
      (('q',), ['z'])
      >>> hooks(available=("q",)) is None
      True
    """
    capture = (capture,) if isinstance(capture, str) else tuple(capture or ())
    patch = dict(patch or {})
    for name in (*capture, *patch):
        if name not in available:
            raise ConfigError(f"activation site {name!r} does not exist; the model's sites: {list(available)}")
    for name, fn in patch.items():
        if not callable(fn):
            raise ConfigError(f"patch[{name!r}] must be a function (value, layer) -> value; got {type(fn).__name__}")
    return Hooks(capture, tuple(patch.items())) if capture or patch else None


class Sites:
    """One block's (or the model's) sites during a pass: sites(name, value) -> the value, patched when asked,
    recorded in `captured` (under its full name: the hooks's prefix, `sub`, name) when asked. With hooks None it
    returns every value unchanged (`NO_SITES`).

    Attributes:
      hooks: the pass's `Hooks`, or None.
      layer: the block's layer index (a traced int32 inside the scan), None for the model's own sites.
      sub: prepended to each name after the hooks's prefix (a cross-attention's "cross_").
      captured: {full name: value} of the captured sites, filled during the pass.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxformer.nn.sites import Hooks, Sites
      >>> sites = Sites(Hooks(capture=("x",), patch=(("x", lambda value, layer: value + 1),)))
      >>> sites("x", jnp.zeros(2)).tolist(), sites.captured["x"].tolist()   # captured after its patch
      ([1.0, 1.0], [1.0, 1.0])
    """

    def __init__(self, hooks: Hooks | None, layer=None, sub: str = "", captured: dict | None = None):
        self.hooks, self.layer, self.sub = hooks, layer, sub
        self.captured = {} if captured is None else captured

    def view(self, sub: str) -> "Sites":
        """The same sites, names read with `sub` before them (a cross-attention's: "cross_")."""
        return Sites(self.hooks, self.layer, sub, self.captured)

    def _full(self, name: str) -> str:
        return self.hooks.prefix + self.sub + name

    def wants(self, name: str) -> bool:
        return self.hooks is not None and self.hooks.wants(self._full(name))

    def patches(self, name: str) -> bool:
        return self.hooks is not None and any(n == self._full(name) for n, _ in self.hooks.patch)

    def __call__(self, name: str, value):
        if self.hooks is None:
            return value
        name = self._full(name)
        if self.hooks.reached is not None:
            self.hooks.reached[name] = self.layer is not None
        for n, fn in self.hooks.patch:
            if n == name:
                value = fn(value, self.layer)
        if name in self.hooks.capture:
            self.captured[name] = value
        return value

    def output(self, name: str, result: tuple):
        """A sublayer's (y, aux) with y passed through site `name`."""
        y, aux = result
        return self(name, y), aux


NO_SITES = Sites(None)


def with_captured(aux: dict, captured: dict) -> dict:
    """A stack's aux with model-level captured sites added to its per-layer ones (aux["captured"]).

    Args:
      aux: the stack's aux dict, maybe with a "captured" dict of per-layer sites.
      captured: {name: value} of the model-level sites captured.

    Returns:
      aux itself when nothing was captured, else a new dict whose "captured" holds both.

    Examples:
      >>> from jaxformer.nn.sites import with_captured
      >>> with_captured({"captured": {"q": 1}}, {"logits": 2})
      {'captured': {'q': 1, 'logits': 2}}
    """
    return aux if not captured else {**aux, "captured": {**aux.get("captured", {}), **captured}}
