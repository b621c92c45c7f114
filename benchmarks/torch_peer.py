"""The PyTorch peer of benchmarks/gpu.py's model, trained and decoded the way a PyTorch user would on the same machine.

The same decoder-only LM as `gpu.lm_config`: D model width, N heads of H = D/N, F FFN width with exact (erf) GELU,
L layers, V vocab with the output head tied to the embedding (unscaled), pre-RMSNorm (eps 1e-5, a scale, no bias)
and a final RMSNorm, RoPE (half-split, base 10000) on q and k, 1/sqrt(H) attention scale, causal, no biases, no
dropout. `load_jax` copies one of our models' parameters in, to check that the two compute the same
(tests/test_torch_peer.py).

train: float32 parameters and AdamW state (torch.optim.AdamW, fused on CUDA), forward and backward under
torch.autocast(bfloat16), attention by F.scaled_dot_product_attention(is_causal=True) (FlashAttention-2 on CUDA),
cross-entropy on float32 logits; eager, or the model under torch.compile.
decode: bfloat16 weights, a static KV cache [L,B,N,Smax,H] allocated once; a step reads every slot with the slots
past its position masked (static shapes, so torch.compile can capture it: "reduce-overhead" = CUDA graphs);
greedy, prefill then one token per step, eager or compiled.

Axis legend: B batch, T length, S cache slots, D width, N heads, H head dim, F FFN width, V vocab, L layers.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.scale, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.scale.float()).to(x.dtype)


def rope(x, pos, base: float = 10000.0):
    """x [B,N,T,H], pos [T] or [B,T] int -> rotated (half-split), computed in float32."""
    h = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, h, 2, device=x.device, dtype=torch.float32) / h)
    ang = pos.float()[..., None] * inv                                 # [T,H/2] or [B,T,H/2]
    cos, sin = ang.cos(), ang.sin()
    if ang.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d: int, n: int, f: int):
        super().__init__()
        self.n, self.h = n, d // n
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def heads(self, x):                                                # [B,T,D] -> [B,N,T,H]
        return x.view(*x.shape[:2], self.n, self.h).transpose(1, 2)

    def forward(self, x, pos, cache=None, index=None):
        """cache (k, v) [B,N,S,H] of this layer: the T new keys/values written at `index`, the queries attend
        over every slot up to their position (static shapes)."""
        y = self.norm1(x)
        q, k, v = (self.heads(w(y)) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, pos), rope(k, pos)
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            ck, cv = cache
            ck.index_copy_(2, index, k)
            cv.index_copy_(2, index, v)
            visible = torch.arange(ck.shape[2], device=x.device)[None, :] <= index[:, None]    # [T,S]
            a = F.scaled_dot_product_attention(q, ck, cv, attn_mask=visible)
        x = x + self.wo(a.transpose(1, 2).reshape(x.shape))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class PeerLM(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        d = s["d_model"]
        self.embed = nn.Embedding(s["vocab"], d)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)          # logits of order 1 at the start, as ours
        self.blocks = nn.ModuleList(Block(d, s["num_heads"], s["d_ff"]) for _ in range(s["layers"]))
        self.final = RMSNorm(d)

    def forward(self, tokens, pos=None, caches=None, index=None):
        """tokens [B,T] -> logits [B,T,V] (float32). With caches (one (k, v) per layer) and index [T] (the slots,
        = positions): cached."""
        pos = torch.arange(tokens.shape[1], device=tokens.device) if pos is None else pos
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, pos, None if caches is None else caches[i], index)
        return (self.final(x) @ self.embed.weight.to(x.dtype).T).float()


def load_jax(model: PeerLM, state) -> PeerLM:
    """Copy one of our TransformerLM's parameters (nnx.state(model, nnx.Param), gpu.lm_config's layout) in."""
    t = lambda a: torch.from_numpy(np.array(a, np.float32))        # noqa: E731
    blocks = state["decoder"]["layers"]["blocks"]
    att, ffn = blocks["self_attn"], blocks["ffn"]
    with torch.no_grad():
        model.embed.weight.copy_(t(state["embed"]["tokens"][...]))
        model.final.scale.copy_(t(state["decoder"]["final_norm"]["scale"][...]))
        for i, blk in enumerate(model.blocks):
            d = blk.wq.weight.shape[1]
            for name in ("wq", "wk", "wv"):
                getattr(blk, name).weight.copy_(t(att[name][...][i]).reshape(d, -1).T)
            blk.wo.weight.copy_(t(att["wo"][...][i]).reshape(-1, d).T)
            blk.w1.weight.copy_(t(ffn["w1"][...][i]).T)
            blk.w2.weight.copy_(t(ffn["w2"][...][i]).T)
            blk.norm1.scale.copy_(t(blocks["res_self"]["norm"]["scale"][...][i]))
            blk.norm2.scale.copy_(t(blocks["res_ffn"]["norm"]["scale"][...][i]))
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gb(device):
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None


def train(s: dict, compiled: bool, device, reps: int, room=lambda next_s: True) -> dict:
    """Seconds per repetition of s["steps"] train steps (after s["warmup"] + 1 untimed; the first compiles when
    compiled), on random tokens [B,T+1] drawn once."""
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = PeerLM(s).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    fwd = torch.compile(model) if compiled else model
    tokens = torch.randint(1, s["vocab"], (s["batch"], s["seq"] + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = fwd(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    step()
    _sync(device)
    compile_s = time.perf_counter() - t0
    for _ in range(s["warmup"]):
        step()
    _sync(device)
    ts = []
    for _ in range(reps):
        if ts and not room(ts[-1]):
            break
        t0 = time.perf_counter()
        for _ in range(s["steps"]):
            loss = step().detach()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return {"params": n_params, "compile_s": compile_s, "seconds": ts, "final_loss": loss.item(),
            "peak_memory_gb": _peak_gb(device)}


def decode(s: dict, batch: int, compiled: bool, device, reps: int, room=lambda next_s: True) -> dict:
    """Greedy decoding of s["new"] tokens after a s["prompt"]-token prefill, bfloat16 weights, static cache;
    seconds per call (after one untimed call)."""
    torch.manual_seed(0)
    model = PeerLM(s).to(device=device, dtype=torch.bfloat16).eval()
    slots, n, h = s["prompt"] + s["new"], s["num_heads"], s["d_model"] // s["num_heads"]
    caches = [tuple(torch.zeros(batch, n, slots, h, device=device, dtype=torch.bfloat16) for _ in range(2))
              for _ in model.blocks]
    prompt = torch.randint(1, s["vocab"], (batch, s["prompt"]), device=device)
    if compiled:                          # the cache is written in place: its buffers stay where they are
        for t in (t for kv in caches for t in kv):
            torch._dynamo.mark_static_address(t)
    one = torch.compile(model, mode="reduce-overhead", fullgraph=True) if compiled else model

    @torch.inference_mode()
    def call():
        idx = torch.arange(s["prompt"], device=device)
        tok = model(prompt, idx, caches, idx)[:, -1].argmax(-1)
        out = [tok]
        for i in range(s["prompt"], slots - 1):
            idx = torch.tensor([i], device=device)
            tok = one(tok[:, None], idx, caches, idx)[:, -1].argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)

    t0 = time.perf_counter()
    shape = list(call().shape)
    _sync(device)
    compile_s, ts = time.perf_counter() - t0, []
    for _ in range(reps):
        if ts and not room(ts[-1]):
            break
        t0 = time.perf_counter()
        call()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "seconds": ts, "generated_shape": shape,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def describe() -> str:
    v = torch.__version__
    return f"torch {v}" + (f", CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"
                           if torch.cuda.is_available() else ", CPU")


def flops_per_token(s: dict, n_params: int) -> int:
    """6·N + 12·L·D·T: as gpu.py counts ours."""
    return 6 * n_params + 12 * s["layers"] * s["d_model"] * s["seq"]



def main(argv=None) -> dict:
    """python benchmarks/torch_peer.py --settings JSON --out FILE [--items ...] [--budget S]: the items in turn
    (train_eager, train_compiled, decode_eager, decode_compiled: decode at each of settings' decode_batches),
    FILE rewritten after each (what benchmarks/gpu.py starts in a child process of its own, so that PyTorch has the
    GPU's memory to itself, and reads)."""
    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--settings", required=True, help="gpu.py's settings as JSON (sizes, steps, reps, ...)")
    p.add_argument("--out", required=True)
    p.add_argument("--items", nargs="+", default=["train_eager", "train_compiled", "decode_eager", "decode_compiled"])
    p.add_argument("--budget", type=float, default=1e9, help="seconds: an item that would pass them is skipped")
    a = p.parse_args(argv)
    s = json.loads(a.settings)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0, out = time.perf_counter(), {"torch": describe(), "items": {}, "skipped": []}
    room = lambda next_s: time.perf_counter() - t0 + next_s <= a.budget            # noqa: E731
    last = 0.0
    for item in a.items:
        kind, mode = item.split("_")
        for b in (s["decode_batches"] if kind == "decode" else [s["batch"]]):
            name = f"{item}" + (f"_b{b}" if kind == "decode" else "")
            if not room(last):
                out["skipped"].append(name)
                continue
            t = time.perf_counter()
            try:
                r = (train(s, mode == "compiled", device, s["reps"], room) if kind == "train" else
                     decode(s, b, mode == "compiled", device, s["reps"], room))
            except Exception as e:  # noqa: BLE001  one failed item must not lose the others
                r = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
            out["items"][name] = r | {"batch": b}
            last = time.perf_counter() - t
            print(f"  peer {name}: {last:.1f} s", flush=True)
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
