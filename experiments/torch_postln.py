"""An independent PyTorch run of the depth study's Post-LN arms: the same char LM, data and schedule, built from
torch.nn.TransformerEncoder(norm_first=False), under each initialisation scheme.

  .venv/bin/python experiments/torch_postln.py          # -> docs/ablations/depth_torch.json (~8 min, 2 cores, alone)

Nothing of jaxformer's model, init or optimizer is used: only its data pipeline (the same 818 training and 90
held-out blocks of 10 characters from the first 10,000 of Alice) and the model sizes of configs/alice.py.
The model: nn.Embedding [V,D] scaled by √D plus the sinusoidal table (float64 NumPy), L post-norm
nn.TransformerEncoderLayer (ReLU, d_ff, no dropout) under a causal mask, no final norm, and an output head that
is the embedding transposed (tied, jaxformer's default) or its own nn.Linear without bias (untied). AdamW
(β = 0.9, 0.98, ε 1e-8, weight decay 0.01 on the layers' and the untied head's matrices), a linear warmup from 0
over 50 steps then cosine to 0 at step 300 (optax.warmup_cosine_decay_schedule's shape, lr 0 at the first
step), no clipping, batch 32 in a per-seed shuffled order.

Inits: pytorch = the modules' own defaults (in_proj Xavier-uniform over the fused [3D, D] block, out_proj,
linear1, linear2 and an untied head kaiming-uniform(a=√5), FFN biases U(±1/√fan_in), embeddings N(0, 1));
glorot = Xavier-uniform over each of q, k, v, o, linear1, linear2 and the head, biases 0, embeddings N(0, 1/D);
gpt2 = N(0, 0.02²) everywhere but out_proj and linear2, N(0, (0.02/√(2L))²), biases 0.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from jaxformer.configio import load_config_file
from jaxformer.data import resolve
from jaxformer.stats import machine

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "ablations" / "depth_torch.json"
STEPS, WARMUP, LOG_EVERY, BATCH = 300, 50, 10, 32
PLAN = ([(12, init, "untied") for init in ("pytorch", "glorot", "gpt2")]       # (layers, init, head): the study's
        + [(12, init, "tied") for init in ("pytorch", "glorot")]             # Post-LN arms it has a twin of
        + [(24, init, "untied") for init in ("pytorch", "glorot")])


class CharLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, d_ff: int, layers: int, max_len: int, tied: bool):
        super().__init__()
        self.d, self.tied = d, tied
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, activation="relu", batch_first=True,
                                           norm_first=False)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = None if tied else nn.Linear(d, vocab, bias=False)
        pos = np.arange(max_len, dtype=np.float64)[:, None]
        div = np.exp(np.arange(0, d, 2, dtype=np.float64) * (-math.log(10000.0) / d))
        pe = np.zeros((max_len, d))
        pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
        self.register_buffer("pe", torch.tensor(pe, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:         # [B,T] -> [B,T,V]
        t = ids.shape[1]
        x = self.embed(ids) * math.sqrt(self.d) + self.pe[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.layers(x, mask=mask, is_causal=True)
        return x @ self.embed.weight.T if self.tied else self.head(x)


def init_(model: CharLM, scheme: str, layers: int) -> None:
    """Re-initialise in place. pytorch: each layer's own default reset (nn.TransformerEncoder deep-copies one layer,
    so without it every layer would start from the same weights)."""
    if scheme == "pytorch":
        for layer in model.layers.layers:
            layer.self_attn._reset_parameters()
            for m in (layer.linear1, layer.linear2, layer.norm1, layer.norm2):
                m.reset_parameters()
        return
    d = model.d
    with torch.no_grad():
        for layer in model.layers.layers:
            att = layer.self_attn
            mats = [att.in_proj_weight[i * d:(i + 1) * d] for i in range(3)] + [att.out_proj.weight,
                                                                                 layer.linear1.weight,
                                                                                 layer.linear2.weight]
            for m in mats:
                if scheme == "glorot":
                    nn.init.xavier_uniform_(m)
                else:
                    small = m is att.out_proj.weight or m is layer.linear2.weight
                    nn.init.normal_(m, 0.0, 0.02 / math.sqrt(2 * layers) if small else 0.02)
            for b in (att.in_proj_bias, att.out_proj.bias, layer.linear1.bias, layer.linear2.bias):
                nn.init.zeros_(b)
        nn.init.normal_(model.embed.weight, 0.0, d ** -0.5 if scheme == "glorot" else 0.02)
        if model.head is not None:
            if scheme == "glorot":
                nn.init.xavier_uniform_(model.head.weight)
            else:
                nn.init.normal_(model.head.weight, 0.0, 0.02)


def lr_at(step: int, peak: float) -> float:
    if step < WARMUP:
        return peak * step / WARMUP
    return 0.5 * peak * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def train(train_x, train_y, eval_x, eval_y, sizes: dict, layers: int, scheme: str, tied: bool, lr: float,
          seed: int) -> dict:
    torch.manual_seed(seed)
    model = CharLM(layers=layers, tied=tied, **sizes)
    init_(model, scheme, layers)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith(("layers.", "head."))]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith(("layers.", "head.")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98), eps=1e-8)
    rng = np.random.default_rng(seed)
    n = len(train_x) // BATCH
    order, curve, t0 = [], [], time.perf_counter()
    loss = torch.tensor(float("nan"))
    for step in range(STEPS):
        if not order:
            perm = rng.permutation(len(train_x))
            order = [perm[i * BATCH:(i + 1) * BATCH] for i in range(n)]
        idx = order.pop(0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr)
        logits = model(train_x[idx])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), train_y[idx].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % LOG_EVERY == 0:
            curve.append(loss.item())
    with torch.no_grad():
        logits = model(eval_x)
        held = float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), eval_y.reshape(-1)))
    final = curve[-1]
    reach = next(((i + 1) * LOG_EVERY for i, v in enumerate(curve) if v < 2.4), None)
    return {"layers": layers, "init": scheme, "tied": tied, "lr": lr, "seed": seed, "train loss": final,
            "held-out loss": held, "steps to train loss < 2.4": reach,
            "failed": bool(not math.isfinite(final) or final > 2.9), "curve": curve,
            "wall_s": round(time.perf_counter() - t0, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--inits", nargs="+", default=["pytorch", "glorot", "gpt2"],
                    help="run only these inits, keeping the other inits' runs already in --out")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg, task = resolve(load_config_file(str(ROOT / "configs" / "alice.py")))
    m = cfg.model
    sizes = {"vocab": m.vocab_size, "d": m.d_model, "heads": m.num_heads, "d_ff": m.d_ff, "max_len": m.max_len}
    tx, ty = (torch.tensor(np.asarray(task.train[k]), dtype=torch.long) for k in ("inputs", "targets"))
    ex, ey = (torch.tensor(np.asarray(task.eval[k]), dtype=torch.long) for k in ("inputs", "targets"))
    runs = []
    if Path(args.out).is_file():
        runs = [r for r in json.loads(Path(args.out).read_text())["runs"] if r["init"] not in args.inits]
    for layers, scheme, head in [p for p in PLAN if p[1] in args.inits]:
        for seed in args.seeds:
            r = train(tx, ty, ex, ey, sizes, layers, scheme, head == "tied", args.lr, seed)
            runs.append(r)
            print(f"L={layers} init={scheme} head={head} seed={seed}: train {r['train loss']:.3f} "
                  f"held-out {r['held-out loss']:.3f} failed={r['failed']} ({r['wall_s']} s)", flush=True)
    order = {p: i for i, p in enumerate(PLAN)}
    runs.sort(key=lambda r: (order[r["layers"], r["init"], "tied" if r["tied"] else "untied"], r["seed"]))
    out = {"script": "experiments/torch_postln.py", "torch": torch.__version__, "machine": machine(),
           "sizes": sizes, "steps": STEPS, "warmup": WARMUP, "batch": BATCH, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
