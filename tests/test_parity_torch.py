"""Numerical parity with PyTorch's reference Transformer pieces (float32, CPU).

Compares, with weights copied from torch into our modules:
  ops.dot_product_attention      vs torch.nn.functional.scaled_dot_product_attention
  nn.MultiHeadAttention          vs torch.nn.MultiheadAttention (self / cross, masks, weights)
  nn.EncoderBlock / DecoderBlock vs torch.nn.TransformerEncoderLayer / TransformerDecoderLayer (post / pre norm)
  nn.Encoder + nn.Decoder stacks vs torch.nn.Transformer (2+2 layers, with and without final norms)
  nn.Transformer / TransformerLM (token-level wiring of masks) vs torch on our embeddings.

Layouts: ours q [B,T,N,H], k/v [B,S,K,H]; torch SDPA is [B,N,T,H]. Masks: ours True = may attend; torch SDPA
bool attn_mask True = take part; torch MultiheadAttention / Transformer* attn_mask and key_padding_mask
True = IGNORE. Torch runs with grad enabled so its inference "fast path" (nested tensors) is never taken.
Every torch parameter (biases and LayerNorm affine too) is perturbed away from its init so that a
mis-mapped or forgotten parameter shows up. Run with `pytest -s` to see the measured errors.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if os.environ.get("CI"):             # CI has torch (constraints.txt): a missing one fails here, never skips silently
    import torch  # noqa: E402
else:
    torch = pytest.importorskip("torch", reason="the PyTorch reference is a test dependency: pip install torch==2.13.0")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flax import nnx  # noqa: E402

from helpers import attention_pattern  # noqa: E402
from jaxformer import ops  # noqa: E402
from jaxformer.config import ModelConfig, replaced  # noqa: E402
from jaxformer.nn.layers import Context  # noqa: E402
from jaxformer.nn import (Decoder, DecoderBlock, Encoder, EncoderBlock, MultiHeadAttention,  # noqa: E402
                          Transformer, TransformerLM)

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

TOL = 1e-5
B, T, S, D, N, FF = 2, 6, 7, 32, 4, 64
H = D // N
SRC_LENS = (7, 4)   # right padding; no query row is ever fully masked
TGT_LENS = (6, 3)
ERRORS: dict[str, float] = {}


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if ERRORS:
        width = max(len(k) for k in ERRORS)
        print("\n\ntorch parity, max abs error (float32, tol %.0e):" % TOL)
        for k, v in ERRORS.items():
            print(f"  {k:<{width}}  {v:.2e}")


def check(name: str, ours, ref, tol: float = TOL) -> float:
    """Record and assert max |ours - ref| <= tol; also refuse NaNs and degenerate (all-zero) references."""
    ours = np.asarray(ours, dtype=np.float32)
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} vs torch {ref.shape}"
    assert np.isfinite(ours).all() and np.isfinite(ref).all(), f"{name}: non-finite values"
    assert np.abs(ref).max() > 1e-2, f"{name}: degenerate reference"
    err = float(np.max(np.abs(ours - ref)))
    ERRORS[name] = err
    print(f"parity {name}: {err:.2e}")
    assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.0e}"
    return err


def seed(s: int = 0) -> np.random.Generator:
    torch.manual_seed(s)
    return np.random.default_rng(s)


def randn(rng: np.random.Generator, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def tt(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).copy())


def t2n(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def perturb_(module: nn.Module, scale: float = 0.1) -> nn.Module:
    """Move every parameter off its init (zero biases, unit LayerNorm scales) so every mapping is exercised."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))
    return module.float().eval()


def lens_valid(lens, length) -> np.ndarray:
    """[B] lengths -> [B,length] bool, True for real (non-pad) positions."""
    return np.arange(length)[None, :] < np.asarray(lens)[:, None]


def pad_mask(valid: np.ndarray) -> jax.Array:
    """[B,S] bool valid -> ours [B,1,1,S]."""
    return jnp.asarray(valid)[:, None, None, :]


def torch_causal(t: int, s: int | None = None) -> torch.Tensor:
    """torch attn_mask for nn.MultiheadAttention/Transformer*: True = NOT allowed (inverse of ours)."""
    return tt(~np.asarray(ops.causal_mask(t, s)))


def make_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=13, d_model=D, num_heads=N, d_ff=FF, num_encoder_layers=2, num_decoder_layers=2,
                runtime__dropout=0.0, max_len=64)
    base.update(kw)
    return replaced(ModelConfig(), **base)


# --- torch -> ours parameter trees (nested dicts of numpy arrays, keyed like our module attributes)

def mha_params(m: nn.MultiheadAttention, n: int) -> dict:
    d = m.embed_dim
    h = d // n
    wq, wk, wv = (t2n(w) for w in m.in_proj_weight.chunk(3, dim=0))   # each [D_out, D_in]; y = x W^T
    p = {"wq": wq.T.reshape(d, n, h), "wk": wk.T.reshape(d, n, h), "wv": wv.T.reshape(d, n, h),
         "wo": t2n(m.out_proj.weight).T.reshape(n, h, d)}
    if m.in_proj_bias is not None:
        bq, bk, bv = (t2n(b) for b in m.in_proj_bias.chunk(3))
        p.update(bq=bq.reshape(n, h), bk=bk.reshape(n, h), bv=bv.reshape(n, h), bo=t2n(m.out_proj.bias))
    return p


def norm_params(ln: nn.LayerNorm) -> dict:
    return {"scale": t2n(ln.weight), "bias": t2n(ln.bias)}


def ffn_params(layer) -> dict:
    return {"w1": t2n(layer.linear1.weight).T, "b1": t2n(layer.linear1.bias),
            "w2": t2n(layer.linear2.weight).T, "b2": t2n(layer.linear2.bias)}


def encoder_block_params(layer: nn.TransformerEncoderLayer, n: int) -> dict:
    return {"self_attn": mha_params(layer.self_attn, n), "res_attn": {"norm": norm_params(layer.norm1)},
            "ffn": ffn_params(layer), "res_ffn": {"norm": norm_params(layer.norm2)}}


def decoder_block_params(layer: nn.TransformerDecoderLayer, n: int) -> dict:
    return {"self_attn": mha_params(layer.self_attn, n), "res_self": {"norm": norm_params(layer.norm1)},
            "cross_attn": mha_params(layer.multihead_attn, n), "res_cross": {"norm": norm_params(layer.norm2)},
            "ffn": ffn_params(layer), "res_ffn": {"norm": norm_params(layer.norm3)}}


def self_block_params(layer: nn.TransformerEncoderLayer, n: int) -> dict:
    """A torch encoder layer run causally is our decoder block without cross-attention."""
    return {"self_attn": mha_params(layer.self_attn, n), "res_self": {"norm": norm_params(layer.norm1)},
            "ffn": ffn_params(layer), "res_ffn": {"norm": norm_params(layer.norm2)}}


def _load(module: nnx.Module, tree: dict) -> int:
    count = 0
    for key, val in tree.items():
        if isinstance(val, dict):
            count += _load(getattr(module, key), val)
            continue
        var = getattr(module, key)
        assert var[...].shape == val.shape, f"{key}: ours {var[...].shape} vs torch-derived {val.shape}"
        var[...] = jnp.asarray(val, dtype=var[...].dtype)
        count += 1
    return count


def load(module: nnx.Module, tree: dict) -> None:
    """Write `tree` into `module`'s parameters; every nnx.Param of the module must be covered."""
    n_set = _load(module, tree)
    n_params = len(jax.tree.leaves(nnx.state(module, nnx.Param)))
    assert n_set == n_params, f"set {n_set} of {n_params} parameters"


def stack_trees(trees: list[dict]) -> dict:
    """Per-layer trees -> one tree with a leading [L] axis (our LayerStack layout)."""
    return jax.tree.map(lambda *a: np.stack(a), *trees)


# ----------------------------------------------------------------------------- 1. ops.dot_product_attention

def _sdpa_case(kind: str, rng):
    """-> (mask ours broadcastable to [B,N,T,S] or None, same mask for torch SDPA or None)."""
    t, s = T, S
    causal = np.asarray(ops.causal_mask(t, s))                        # [T,S], t < s: last-t queries
    pad = lens_valid(SRC_LENS, s)[:, None, None, :]                   # [B,1,1,S]
    m = {"none": None, "causal": causal, "padding": pad, "combined": causal[None, None] & pad,
         "dense": rng.random((B, N, t, s)) < 0.7}[kind]
    if m is not None and kind == "dense":
        m[..., 0] = True                                              # no fully masked rows
    return m


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "combined", "dense"])
@pytest.mark.parametrize("kv_heads", [N, 2, 1])
def test_sdpa_parity(kind, kv_heads):
    rng = seed(1)
    q, k, v = randn(rng, B, T, N, H), randn(rng, B, S, kv_heads, H), randn(rng, B, S, kv_heads, H)
    mask = _sdpa_case(kind, rng)
    ours = ops.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     mask=None if mask is None else jnp.asarray(mask)).out
    qt, kt, vt = (tt(a).permute(0, 2, 1, 3) for a in (q, k, v))      # -> [B,heads,len,H]
    g = N // kv_heads
    kr, vr = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)  # query head n uses kv head n//g
    am = None if mask is None else tt(mask)
    ref = F.scaled_dot_product_attention(qt, kr, vr, attn_mask=am).permute(0, 2, 1, 3)
    check(f"sdpa[{kind},K={kv_heads}]", ours, ref)
    if kv_heads != N:  # torch's own GQA path agrees with the repeat_interleave reading
        ref_gqa = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=am, enable_gqa=True).permute(0, 2, 1, 3)
        np.testing.assert_allclose(t2n(ref_gqa), t2n(ref), atol=1e-6)
    if mask is not None:  # the mask must matter, or this case tests nothing
        assert np.abs(t2n(ref) - np.asarray(ops.dot_product_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)).out)).max() > 1e-2


def test_sdpa_parity_scale_and_weights():
    rng = seed(2)
    q, k, v = randn(rng, B, T, N, H), randn(rng, B, S, N, H), randn(rng, B, S, N, H)
    mask = np.asarray(ops.causal_mask(T, S))[None, None] & lens_valid(SRC_LENS, S)[:, None, None, :]
    out, w, _ = ops.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask),
                                       scale=0.3, return_probs=True)
    qt, kt, vt = (tt(a).permute(0, 2, 1, 3) for a in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=tt(mask), scale=0.3).permute(0, 2, 1, 3)
    check("sdpa[scale=0.3]", out, ref)
    logits = (qt @ kt.transpose(-1, -2)) * 0.3
    ref_w = torch.softmax(logits.masked_fill(~tt(mask), float("-inf")), dim=-1)
    check("sdpa[weights]", w, ref_w)


# ----------------------------------------------------------------------------- 2. MultiHeadAttention

@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("mode", ["self", "cross"])
def test_mha_parity(mode, use_bias):
    rng = seed(3)
    tm = perturb_(nn.MultiheadAttention(D, N, batch_first=True, bias=use_bias))
    cfg = make_cfg(use_bias=use_bias)
    ours = MultiHeadAttention(cfg, self_attention=(mode == "self"), rngs=nnx.Rngs(0))
    load(ours, mha_params(tm, N))

    s = T if mode == "self" else S
    x = randn(rng, B, T, D)
    kv = x if mode == "self" else randn(rng, B, S, D)
    valid = lens_valid(TGT_LENS if mode == "self" else SRC_LENS, s)
    mask = ops.combine_masks(ops.causal_mask(T, s)[None, None], pad_mask(valid))   # [B,1,T,S]
    args = (jnp.asarray(x), None if mode == "self" else jnp.asarray(kv))
    out, _ = ours(*args, mask=mask)
    w = attention_pattern(ours, *args, mask=mask)

    ref, ref_w = tm(tt(x), tt(kv), tt(kv), key_padding_mask=tt(~valid), attn_mask=torch_causal(T, s),
                    need_weights=True, average_attn_weights=False)
    check(f"mha[{mode},bias={use_bias}]", out, ref)
    check(f"mha[{mode},bias={use_bias}] weights", w, ref_w)


def test_mha_gqa_parity():
    """GQA projections: torch has no GQA module, so compose torch linear algebra with SDPA(enable_gqa)."""
    rng = seed(4)
    kvh = 2
    cfg = make_cfg(num_kv_heads=kvh)
    ours = MultiHeadAttention(cfg, self_attention=True, rngs=nnx.Rngs(0))
    wq, wk, wv = torch.randn(D, D) * D ** -0.5, torch.randn(kvh * H, D) * D ** -0.5, torch.randn(kvh * H, D) * D ** -0.5
    wo = torch.randn(D, D) * D ** -0.5
    bq, bk, bv, bo = (0.1 * torch.randn(n) for n in (D, kvh * H, kvh * H, D))
    load(ours, {"wq": t2n(wq).T.reshape(D, N, H), "wk": t2n(wk).T.reshape(D, kvh, H),
                "wv": t2n(wv).T.reshape(D, kvh, H), "wo": t2n(wo).T.reshape(N, H, D),
                "bq": t2n(bq).reshape(N, H), "bk": t2n(bk).reshape(kvh, H), "bv": t2n(bv).reshape(kvh, H),
                "bo": t2n(bo)})
    x = randn(rng, B, T, D)
    valid = lens_valid(TGT_LENS, T)
    mask = ops.combine_masks(ops.causal_mask(T)[None, None], pad_mask(valid))
    out, _ = ours(jnp.asarray(x), mask=mask)

    xt = tt(x)
    q = F.linear(xt, wq, bq).view(B, T, N, H).transpose(1, 2)
    k = F.linear(xt, wk, bk).view(B, T, kvh, H).transpose(1, 2)
    v = F.linear(xt, wv, bv).view(B, T, kvh, H).transpose(1, 2)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=tt(np.asarray(mask)), enable_gqa=True)
    ref = F.linear(ctx.transpose(1, 2).reshape(B, T, D), wo, bo)
    check("mha[gqa K=2]", out, ref)


# ----------------------------------------------------------------------------- 3. EncoderBlock

@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_parity(norm_first, activation):
    rng = seed(5)
    tl = perturb_(nn.TransformerEncoderLayer(D, N, FF, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first))
    cfg = make_cfg(norm__position="pre" if norm_first else "post", activation=activation)
    ours = EncoderBlock(cfg, rngs=nnx.Rngs(0))
    load(ours, encoder_block_params(tl, N))

    x = randn(rng, B, S, D)
    valid = lens_valid(SRC_LENS, S)
    out = ours(jnp.asarray(x), Context(mask=pad_mask(valid)), layer=0).x
    assert torch.is_grad_enabled()
    ref = tl(tt(x), src_key_padding_mask=tt(~valid))   # grad on + params require grad: no fast path
    name = f"encoder_block[{'pre' if norm_first else 'post'},{activation}]"
    check(name, out, ref)   # all positions, pad rows included (the slow path computes them normally)


# ----------------------------------------------------------------------------- 4. DecoderBlock

@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_parity(norm_first, activation):
    rng = seed(6)
    tl = perturb_(nn.TransformerDecoderLayer(D, N, FF, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first))
    cfg = make_cfg(norm__position="pre" if norm_first else "post", activation=activation)
    ours = DecoderBlock(cfg, cross=True, rngs=nnx.Rngs(0))
    load(ours, decoder_block_params(tl, N))

    y, mem = randn(rng, B, T, D), randn(rng, B, S, D)
    tv, sv = lens_valid(TGT_LENS, T), lens_valid(SRC_LENS, S)
    self_mask = ops.combine_masks(ops.causal_mask(T), pad_mask(tv))
    out = ours(jnp.asarray(y), Context(mask=self_mask, memory=jnp.asarray(mem), memory_mask=pad_mask(sv)),
               layer=0).x
    ref = tl(tt(y), tt(mem), tgt_mask=torch_causal(T), tgt_key_padding_mask=tt(~tv),
             memory_key_padding_mask=tt(~sv))
    check(f"decoder_block[{'pre' if norm_first else 'post'},{activation}]", out, ref)


# ----------------------------------------------------------------------------- 5. Encoder + Decoder stacks

def _torch_transformer(norm_first: bool, activation: str = "relu") -> nn.Transformer:
    return perturb_(nn.Transformer(D, N, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF,
                                   dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first))


def _load_stacks(tr: nn.Transformer, enc: Encoder, dec: Decoder) -> None:
    load(enc.layers.blocks, stack_trees([encoder_block_params(l, N) for l in tr.encoder.layers]))
    load(dec.layers.blocks, stack_trees([decoder_block_params(l, N) for l in tr.decoder.layers]))
    for ours, theirs in ((enc.final_norm, tr.encoder.norm), (dec.final_norm, tr.decoder.norm)):
        assert (ours is None) == (theirs is None), "final norm presence differs from torch"
        if ours is not None:
            load(ours, norm_params(theirs))


# (norm_first, our final_norm, keep torch's final norms)
STACK_CASES = {
    "post+final_norm": (False, True, True),      # torch nn.Transformer always has final LayerNorms
    "post,no_final": (False, None, False),       # our post default (no final norm) vs torch with norms removed
    "pre(default final)": (True, None, True),    # our pre default has a final norm, as torch
}


@pytest.mark.parametrize("case", list(STACK_CASES))
def test_transformer_stacks_parity(case):
    norm_first, final_norm, torch_final = STACK_CASES[case]
    rng = seed(7)
    tr = _torch_transformer(norm_first)
    if not torch_final:
        tr.encoder.norm = None
        tr.decoder.norm = None
    cfg = make_cfg(norm__position="pre" if norm_first else "post", norm__final=final_norm)
    enc, dec = Encoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, cross=True, rngs=nnx.Rngs(1))
    _load_stacks(tr, enc, dec)

    x, y = randn(rng, B, S, D), randn(rng, B, T, D)
    sv, tv = lens_valid(SRC_LENS, S), lens_valid(TGT_LENS, T)
    memory = enc(jnp.asarray(x), Context(mask=pad_mask(sv))).x
    out = dec(jnp.asarray(y), Context(mask=ops.combine_masks(ops.causal_mask(T), pad_mask(tv)), memory=memory,
                                      memory_mask=pad_mask(sv))).x

    ref_mem = tr.encoder(tt(x), src_key_padding_mask=tt(~sv))
    ref = tr(tt(x), tt(y), tgt_mask=torch_causal(T), src_key_padding_mask=tt(~sv), tgt_key_padding_mask=tt(~tv),
             memory_key_padding_mask=tt(~sv))
    check(f"stacks[{case}] memory", memory, ref_mem)
    check(f"stacks[{case}] output", out, ref)


def test_layer_stack_layer_matches_torch_layer():
    """LayerStack.layer(i) must be block i: layer 1 of our stack == torch encoder layer 1."""
    rng = seed(8)
    tr = _torch_transformer(False)
    cfg = make_cfg()
    enc, dec = Encoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, cross=True, rngs=nnx.Rngs(1))
    tr.encoder.norm = tr.decoder.norm = None
    _load_stacks(tr, enc, dec)
    x = randn(rng, B, S, D)
    sv = lens_valid(SRC_LENS, S)
    out = enc.layers.layer(1)(jnp.asarray(x), Context(mask=pad_mask(sv)), layer=1).x
    check("stack.layer(1)", out, tr.encoder.layers[1](tt(x), src_key_padding_mask=tt(~sv)))


# ----------------------------------------------------------------------------- 6. token-level models

def _tokens(rng, lens, length, vocab, pad):
    tok = rng.integers(1, vocab, size=(len(lens), length))
    tok[~lens_valid(lens, length)] = pad
    return jnp.asarray(tok, dtype=jnp.int32)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_model_parity(norm_first):
    """Transformer.__call__ (masks built from each side's segment ids, causal decoder) vs torch nn.Transformer
    fed our embeddings, its key padding masks from the same lengths; logits through our tied head on both sides,
    at every real target (a padding query sees no key here, and every key but padding in torch)."""
    rng = seed(9)
    tr = _torch_transformer(norm_first, activation="gelu")
    cfg = make_cfg(norm__position="pre" if norm_first else "post", norm__final=True, activation="gelu")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _load_stacks(tr, model.encoder, model.decoder)

    src = _tokens(rng, SRC_LENS, S, cfg.vocab_size, cfg.pad_id)
    tgt = _tokens(rng, TGT_LENS, T, cfg.vocab_size, cfg.pad_id)
    s_seg, t_seg = (jnp.asarray(lens_valid(n, w), jnp.int32) for n, w in ((SRC_LENS, S), (TGT_LENS, T)))
    logits = model(src, tgt, src_segment_ids=s_seg, tgt_segment_ids=t_seg)[0]

    pos = lambda a: jnp.broadcast_to(jnp.arange(a.shape[1]), a.shape)  # noqa: E731
    xs, ys = (tt(np.asarray(model.embed(a, pos(a)))) for a in (src, tgt))
    sv, tv = tt(lens_valid(SRC_LENS, S)), tt(lens_valid(TGT_LENS, T))
    h = tr(xs, ys, tgt_mask=torch_causal(T), src_key_padding_mask=~sv, tgt_key_padding_mask=~tv,
           memory_key_padding_mask=~sv)
    ref = h @ tt(np.asarray(model.embed.tokens[...])).T
    real = lens_valid(TGT_LENS, T)[..., None]
    check(f"Transformer model[{'pre' if norm_first else 'post'},gelu] logits", np.where(real, logits, 0),
          ref * tt(real))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_only_parity(norm_first):
    """TransformerLM (decoder without cross-attention) vs a causal torch TransformerEncoder."""
    rng = seed(10)
    layer = nn.TransformerEncoderLayer(D, N, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    te = perturb_(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D) if norm_first else None,
                                        enable_nested_tensor=False))
    cfg = make_cfg(arch="decoder_only", norm__position="pre" if norm_first else "post")
    lm = TransformerLM(cfg, rngs=nnx.Rngs(0))
    load(lm.decoder.layers.blocks, stack_trees([self_block_params(l, N) for l in te.layers]))
    if norm_first:
        load(lm.decoder.final_norm, norm_params(te.norm))
    else:
        assert lm.decoder.final_norm is None

    tok = _tokens(rng, TGT_LENS, T, cfg.vocab_size, cfg.pad_id)
    real = lens_valid(TGT_LENS, T)
    logits = lm(tok, segment_ids=jnp.asarray(real, jnp.int32))[0]
    x = tt(np.asarray(lm.embed(tok, jnp.broadcast_to(jnp.arange(T), tok.shape))))
    h = te(x, mask=torch_causal(T), src_key_padding_mask=tt(~real))
    ref = h @ tt(np.asarray(lm.embed.tokens[...])).T
    check(f"TransformerLM[{'pre' if norm_first else 'post'}] logits", np.where(real[..., None], logits, 0),
          ref * tt(real[..., None]))


# ----------------------------------------------------------------------------- 7. training loss

@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_token_losses_match_torch_cross_entropy_with_label_smoothing(eps):
    """ops.losses.token_losses(objective) vs torch.nn.functional.cross_entropy(label_smoothing=eps,
    ignore_index=pad, reduction="sum") on the same logits, with pad targets (whose logits are made extreme, so
    counting them would show). nll is the eps=0 cross-entropy; count and correct are over non-pad targets."""
    from jaxformer.ops.losses import token_losses

    rng = seed(11)
    b, t, v, pad = 3, 7, 13, 0
    logits = randn(rng, b, t, v) * 3.0
    targets = rng.integers(1, v, (b, t))
    targets[0, 5:] = pad
    targets[2, 2] = pad                                    # a pad target inside a row, too
    logits[targets == pad] *= 50.0
    s = token_losses(jnp.asarray(logits), jnp.asarray(targets, jnp.int32), pad, label_smoothing=eps)

    flat, tgt = tt(logits.reshape(-1, v)), tt(targets.reshape(-1))
    ref = F.cross_entropy(flat, tgt, label_smoothing=eps, ignore_index=pad, reduction="sum")
    ref_nll = F.cross_entropy(flat, tgt, ignore_index=pad, reduction="sum")
    rtol = 2 ** -16          # float32 sums of ~20 terms of size ~10, computed two ways: ~1e-6 relative
    np.testing.assert_allclose(float(s["objective"]), float(ref), rtol=rtol)
    np.testing.assert_allclose(float(s["nll"]), float(ref_nll), rtol=rtol)
    live = targets != pad
    assert float(s["count"]) == live.sum()
    assert float(s["correct"]) == (logits.argmax(-1) == targets)[live].sum()
    # the comparison discriminates: smoothing and the pad mask each move the sum far beyond rtol
    if eps:
        assert abs(float(ref) - float(ref_nll)) > 100 * rtol * abs(float(ref))
    unmasked = F.cross_entropy(flat, tgt, label_smoothing=eps, reduction="sum")
    assert abs(float(unmasked) - float(ref)) > 100 * rtol * abs(float(ref))
