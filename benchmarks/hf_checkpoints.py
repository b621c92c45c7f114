"""Hugging Face checkpoints: per-family logit differences of import and export against transformers, and the
host memory of loading a multi-file checkpoint onto 8 (fake CPU) devices under FSDP, against its size.

    python benchmarks/hf_checkpoints.py [--hidden 512 --layers 8 --vocab 32000]

Parity: each family's tiny model (tests/test_hf.py's configs, random weights of std 0.2) saved by transformers;
`jaxformer.hf.from_pretrained` -> logits on a fixed batch against transformers' (max |diff| / max |ref|), then
`save_pretrained` -> `AutoModelForCausalLM.from_pretrained` -> the same comparison.
Memory: a Llama checkpoint of the given size in files of 50 MB, loaded in a child process with 8 fake devices:
its resident memory before `from_pretrained` and its peak after (/proc/self/status VmRSS, VmHWM; Linux). On CPU the 8 devices' memory is this
process's memory, so the loaded model itself adds its size once; what loading costs on top of that is the
growth minus the checkpoint's bytes. Writes benchmarks/results/hf_checkpoints.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"


def _status(field: str) -> int:
    """Bytes of /proc/self/status's field: VmRSS (resident now) or VmHWM (its peak in this program; unlike
    ru_maxrss it does not carry the parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(ckpt: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jaxformer.config import ParallelConfig
    from jaxformer.hf import from_pretrained
    from jaxformer.parallel import Plan
    plan = Plan(ParallelConfig(data=1, fsdp=8))
    jax.numpy.zeros(1).block_until_ready()
    import threading
    before, anon_before, peak_anon, done = _status("VmRSS"), _status("RssAnon"), [0], threading.Event()

    def sample():                         # anonymous memory's peak (file pages mapped by safetensors excluded)
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            done.wait(0.002)
    t = threading.Thread(target=sample)
    t.start()
    model = from_pretrained(ckpt, plan=plan)
    done.set()
    t.join()
    after = _status("VmHWM")
    from flax import nnx
    per_device = [0] * 8
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for s in v[...].addressable_shards:
            per_device[s.device.id] += s.data.nbytes
    Path(out).write_text(json.dumps({"peak_before": before, "peak_after": after, "anon_before": anon_before,
                                     "anon_peak": peak_anon[0], "anon_after": _status("RssAnon"),
                                     "per_device": per_device}))


def parity() -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import jax.numpy as jnp
    import transformers
    from test_hf import FAMILIES, hf_logits, hf_model
    from jaxformer.hf import from_pretrained, save_pretrained
    rows = []
    ids = np.random.default_rng(0).integers(0, 97, (2, 12))
    ids[0, 3] = 0
    for family in FAMILIES:
        m = hf_model(family)
        with tempfile.TemporaryDirectory() as d:
            m.save_pretrained(d)
            ours = from_pretrained(d)
            ref = hf_logits(m, ids)
            got = np.asarray(ours(jnp.asarray(ids)))
            save_pretrained(ours, Path(d) / "out")
            back = transformers.AutoModelForCausalLM.from_pretrained(Path(d) / "out", attn_implementation="eager")
            exp = hf_logits(back.eval(), ids)
        scale = float(np.abs(ref).max())
        rows.append({"family": family, "import_max_abs": float(np.abs(got - ref).max()),
                     "import_rel": float(np.abs(got - ref).max() / scale),
                     "export_max_abs": float(np.abs(exp - ref).max()), "export_rel": float(np.abs(exp - ref).max() / scale),
                     "max_abs_logit": scale})
    return rows


def memory(hidden: int, layers: int, vocab: int) -> dict:
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                   max_position_embeddings=1024)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d, max_shard_size="50MB")
        files = sorted(Path(d).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        largest = max(p.numel() * 4 for p in m.parameters())
        del m
        out = Path(d) / "mem.json"
        subprocess.run([sys.executable, __file__, "--child", d, str(out)], check=True)
        r = json.loads(out.read_text())
    return {"checkpoint_bytes": size, "files": len(files), "largest_tensor_bytes": largest,
            "peak_before": r["peak_before"], "peak_after": r["peak_after"],
            "growth": r["peak_after"] - r["peak_before"], "anon_growth": r["anon_peak"] - r["anon_before"],
            "anon_kept": r["anon_after"] - r["anon_before"], "per_device_max": max(r["per_device"]),
            "per_device_min": min(r["per_device"]), "config": {"hidden": hidden, "layers": layers, "vocab": vocab}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    import jax
    import transformers
    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
           "versions": {"jax": jax.__version__, "transformers": transformers.__version__},
           "parity": parity(), "memory": memory(a.hidden, a.layers, a.vocab)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hf_checkpoints.json").write_text(json.dumps(res, indent=1))
    mib = lambda b: f"{b / 2 ** 20:,.1f} MiB"          # noqa: E731
    lines = [f"# Hugging Face checkpoints ({res['machine']})", "", "`python benchmarks/hf_checkpoints.py`", "",
             "| family | import max abs diff | import rel | export max abs diff | export rel |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['family']} | {r['import_max_abs']:.2e} | {r['import_rel']:.1e} | {r['export_max_abs']:.2e} | "
              f"{r['export_rel']:.1e} |" for r in res["parity"]]
    mem = res["memory"]
    lines += ["", f"Loading a {mib(mem['checkpoint_bytes'])} Llama checkpoint ({mem['files']} files; largest tensor "
              f"{mib(mem['largest_tensor_bytes'])}) onto 8 devices (FSDP): anonymous memory peaked "
              f"{mib(mem['anon_growth'])} above its start and kept {mib(mem['anon_kept'])} (the loaded model: on CPU "
              f"the 8 devices' memory is this process's), so loading's transient cost is "
              f"{mib(mem['anon_growth'] - mem['anon_kept'])}; the peak of all resident memory, file pages that "
              f"safetensors maps included, rose {mib(mem['growth'])}. Each device holds "
              f"{mib(mem['per_device_min'])}–{mib(mem['per_device_max'])}.", ""]
    (OUT / "hf_checkpoints.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
