"""A PyTorch decoder-only Transformer with a preallocated KV cache: the reference `benchmarks/decode.py` times
our cached decoder against.

Same structure and compute as the TransformerLM that decode.py builds from a decode_sizes.SIZES entry
(decoder-only, pre-LN, LayerNorm eps 1e-5 and a final LayerNorm, RoPE (half-split, base 10000, on q and k after their
biases), separate q/k/v/o projections with biases, 1/sqrt(H) attention scale, ReLU FFN with biases, token
embedding scaled by sqrt(D), output head tied to the embedding (no bias), float32, every KV head its own).
Weights are random (or copied from one of our models with `load_jax`, to check the two compute the same).
The cache is allocated once, k and v [L,B,N,Smax,H], and written in place by slice assignment; `step` attends
over cache[..., :pos+1, :] with F.scaled_dot_product_attention. Eager PyTorch under torch.inference_mode(), no
torch.compile; importing this module sets torch.set_num_threads(os.cpu_count()).

Axis legend: B batch, T query length, S key length (Smax cache slots), D width, N heads, H head dim, F FFN width,
V vocab, L layers.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(os.cpu_count())


class TorchDecoder:
    """Decoder-only LM for a fixed batch B and at most `max_len` cached positions (Smax)."""

    def __init__(self, vocab: int, d_model: int, num_heads: int, d_ff: int, num_decoder_layers: int, *,
                 batch: int, max_len: int, rope_base: float = 10000.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        v, d, n, f, L = vocab, d_model, num_heads, d_ff, num_decoder_layers
        self.n, self.h, self.d = n, d // n, d
        rnd = lambda *shape, std: torch.randn(*shape, generator=g) * std                     # noqa: E731
        self.emb = rnd(v, d, std=d ** -0.5)                                      # [V,D], also the head
        self.wq, self.wk, self.wv = (rnd(L, d, d, std=d ** -0.5) for _ in range(3))   # [L,NH,D] (F.linear)
        self.bq, self.bk, self.bv, self.bo = (rnd(L, d, std=0.02) for _ in range(4))  # [L,NH] / [L,D]
        self.wo = rnd(L, d, d, std=d ** -0.5)                                    # [L,D,NH]
        self.w1, self.b1 = rnd(L, f, d, std=d ** -0.5), rnd(L, f, std=0.02)      # [L,F,D], [L,F]
        self.w2, self.b2 = rnd(L, d, f, std=f ** -0.5), rnd(L, d, std=0.02)      # [L,D,F], [L,D]
        self.ln1_w, self.ln2_w = (1 + rnd(L, d, std=0.02) for _ in range(2))        # [L,D] norm scales
        self.ln1_b, self.ln2_b = (rnd(L, d, std=0.02) for _ in range(2))            # [L,D] norm biases
        self.lnf_w, self.lnf_b = 1 + rnd(d, std=0.02), rnd(d, std=0.02)          # [D]
        # RoPE angles pos * base^(-2i/H) in float32, as ours (ours computes them per call; a table here)
        inv = 1.0 / (rope_base ** (torch.arange(0, self.h, 2, dtype=torch.float32) / self.h))
        ang = torch.arange(max_len, dtype=torch.float32)[:, None] * inv         # [Smax,H/2]
        self.cos, self.sin = ang.cos(), ang.sin()
        self.k_cache = torch.zeros(L, batch, n, max_len, self.h)               # [L,B,N,Smax,H]
        self.v_cache = torch.zeros(L, batch, n, max_len, self.h)
        self.layers, self.max_len = L, max_len

    def load_jax(self, state) -> "TorchDecoder":
        """Copy the parameters of one of our TransformerLMs (nnx.state(model, nnx.Param), layout of
        jaxformer.nn: stacked [L,...], wq [L,D,N,H], wo [L,N,H,D], w1 [L,D,F], ...) into this model."""
        t = lambda x: torch.from_numpy(np.array(x[...], np.float32))            # noqa: E731
        blk, L, d = state["decoder"]["layers"]["blocks"], self.layers, self.d
        a, ffn = blk["self_attn"], blk["ffn"]
        self.emb = t(state["embed"]["tokens"])
        lin = lambda w: t(w).reshape(L, d, -1).transpose(1, 2).contiguous()      # noqa: E731 [L,D,out] -> [L,out,D]
        self.wq, self.wk, self.wv = (lin(a[w]) for w in ("wq", "wk", "wv"))
        self.bq, self.bk, self.bv = (t(a[b]).reshape(L, d) for b in ("bq", "bk", "bv"))
        self.wo, self.bo = lin(a["wo"]), t(a["bo"])                              # wo [L,N,H,D] -> [L,D,NH]
        self.w1, self.b1 = lin(ffn["w1"]), t(ffn["b1"])
        self.w2, self.b2 = t(ffn["w2"]).transpose(1, 2).contiguous(), t(ffn["b2"])
        self.ln1_w, self.ln1_b = t(blk["res_self"]["norm"]["scale"]), t(blk["res_self"]["norm"]["bias"])
        self.ln2_w, self.ln2_b = t(blk["res_ffn"]["norm"]["scale"]), t(blk["res_ffn"]["norm"]["bias"])
        fn = state["decoder"]["final_norm"]
        self.lnf_w, self.lnf_b = t(fn["scale"]), t(fn["bias"])
        return self

    def _rope(self, x, pos: int):
        """x [B,N,T,H] at positions pos..pos+T-1 -> rotated [B,N,T,H] (half-split convention, as ours)."""
        h2 = self.h // 2
        cos, sin = self.cos[pos:pos + x.shape[2]], self.sin[pos:pos + x.shape[2]]   # [T,H/2]
        x1, x2 = x[..., :h2], x[..., h2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def _forward(self, tokens, pos: int):
        """tokens [B,T] at positions pos..pos+T-1 -> last hidden state [B,D]; writes k/v into cache slots
        [pos, pos+T) of every layer and attends over slots [0, pos+T) (causally among the T new ones)."""
        b, t = tokens.shape
        n, h, d, end = self.n, self.h, self.d, pos + tokens.shape[1]
        x = F.embedding(tokens, self.emb) * math.sqrt(d)                        # [B,T,D]
        heads = lambda y: y.view(b, t, n, h).transpose(1, 2)                    # noqa: E731 [B,T,D] -> [B,N,T,H]
        for i in range(self.layers):
            y = F.layer_norm(x, (d,), self.ln1_w[i], self.ln1_b[i], 1e-5)
            q = self._rope(heads(F.linear(y, self.wq[i], self.bq[i])), pos)
            self.k_cache[i, :, :, pos:end] = self._rope(heads(F.linear(y, self.wk[i], self.bk[i])), pos)
            self.v_cache[i, :, :, pos:end] = heads(F.linear(y, self.wv[i], self.bv[i]))
            if pos == 0:     # prefill: the T new keys only, causal
                o = F.scaled_dot_product_attention(q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end],
                                                   is_causal=t > 1)
            else:            # one new query over every valid slot: no mask needed
                assert t == 1, "after the prefill, step one token at a time"
                o = F.scaled_dot_product_attention(q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end])
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, d), self.wo[i], self.bo[i])      # [B,T,D]
            y = F.layer_norm(x, (d,), self.ln2_w[i], self.ln2_b[i], 1e-5)
            x = x + F.linear(F.relu(F.linear(y, self.w1[i], self.b1[i])), self.w2[i], self.b2[i])
        return F.layer_norm(x[:, -1], (d,), self.lnf_w, self.lnf_b, 1e-5)      # [B,D]

    @torch.inference_mode()
    def prefill(self, tokens) -> torch.Tensor:
        """tokens [B,T] (int64 tensor or array) -> logits of the last position [B,V]; fills cache slots [0,T)."""
        return F.linear(self._forward(torch.as_tensor(tokens, dtype=torch.long), 0), self.emb)

    @torch.inference_mode()
    def step(self, token, pos: int) -> torch.Tensor:
        """token [B] at position pos (slots [0,pos) filled) -> logits [B,V]; writes cache slot pos."""
        if not 0 < pos < self.max_len:
            raise ValueError(f"pos={pos} outside (0, {self.max_len})")
        return F.linear(self._forward(torch.as_tensor(token, dtype=torch.long)[:, None], pos), self.emb)

    @torch.inference_mode()
    def greedy_steps(self, token, pos: int, steps: int) -> torch.Tensor:
        """`steps` cached steps from position pos, each feeding the argmax of the last -> last token [B]
        (the loop decode.py times, as our compiled decode loop)."""
        for p in range(pos, pos + steps):
            token = self.step(token, p).argmax(-1)
        return token


def build(size: str, batch: int, max_len: int, seed: int = 0) -> TorchDecoder:
    """The TorchDecoder for decode_sizes.SIZES[size] and decode_sizes.VOCAB."""
    from decode_sizes import SIZES, VOCAB    # benchmarks/decode_sizes.py (this folder is on sys.path)
    return TorchDecoder(VOCAB, **SIZES[size], batch=batch, max_len=max_len, seed=seed)


def _close(a, b) -> float:
    """max |a - b| / (1e-4 · max(1, max |b|)): <= 1 passes (rtol = atol = 1e-4 scaled by b's magnitude)."""
    return float((a - b).abs().max() / (1e-4 * max(1.0, float(b.abs().max()))))


def check_cache_consistency(size: str = "tiny", batch: int = 2, context: int = 16, steps: int = 3) -> float:
    """prefill(c tokens) then `steps` cached steps must give the same last logits as prefill of the c+1, c+2, ...
    tokens (no cache): the cache is not cheating. Returns the worst `_close` ratio; raises if it exceeds 1."""
    toks = torch.randint(1, 256, (batch, context + steps), generator=torch.Generator().manual_seed(1))
    m = build(size, batch, context + steps)
    m.prefill(toks[:, :context])
    got = [m.step(toks[:, context + i], context + i) for i in range(steps)]
    worst = max(_close(g, build(size, batch, context + steps).prefill(toks[:, :context + i + 1]))
                for i, g in enumerate(got))
    if worst > 1:
        raise AssertionError(f"torch cached logits differ from recomputation: {worst:.2f} x tolerance")
    return worst


def check_matches_jax(size: str = "tiny", batch: int = 2, context: int = 16) -> float:
    """With our model's weights copied in, prefill's last logits equal our TransformerLM's (same structure).
    Returns the worst `_close` ratio; raises if it exceeds 1."""
    import jax
    from decode_sizes import SIZES, VOCAB
    from flax import nnx

    from jaxformer.config import ModelConfig, replaced
    from jaxformer.nn import build_model
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=VOCAB, max_len=context, positional="rope",
                      norm__position="pre", runtime__dropout=0.0, **SIZES[size])
    model = build_model(cfg)
    toks = np.array(jax.random.randint(jax.random.key(2), (batch, context), 1, VOCAB))
    ours = torch.from_numpy(np.array(model(toks)[:, -1]))
    worst = _close(build(size, batch, context).load_jax(nnx.state(model, nnx.Param)).prefill(toks), ours)
    if worst > 1:
        raise AssertionError(f"torch logits differ from ours with the same weights: {worst:.2f} x tolerance")
    return worst


if __name__ == "__main__":
    import sys
    for s in sys.argv[1:] or ["tiny"]:
        print(s, "cache consistency", f"{check_cache_consistency(s):.3f}", "matches ours",
              f"{check_matches_jax(s):.3f}", "(x tolerance, <= 1 passes)")
