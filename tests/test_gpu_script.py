"""benchmarks/gpu.py --dry: the one prepared GPU script's every item (the GPU lane, the PyTorch peer, the train
step, each lever's paired A/B, decoding against its floor) runs end to end on CPU with tiny shapes, and its report
says what ran."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.mark.slow          # about 4 minutes on 2 cores (every lever compiles a step): make test-slow
def test_gpu_script_dry_run(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("jaxformer_benchmark_gpu", SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    stem = tmp_path / "gpu"
    gpu.main(["--dry", "--out", str(stem)])
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    rec = json.loads(js.read_text())
    lane, peer, train, levers, decode = (rec["sections"][k] for k in ("lane", "peer", "train", "levers", "decode"))
    assert lane["returncode"] == 0 and lane["counts"]["passed"] == 1 and lane["log"][0].startswith("# jax")
    assert set(peer["items"]) == {"train_eager", "train_compiled", "decode_eager_b1", "decode_eager_b2",
                                  "decode_compiled_b1", "decode_compiled_b2"}, peer
    assert all(r["tokens_per_s"]["median"] > 0 for r in peer["items"].values())
    assert train["backend"] == "chunked"                              # no GPU here: cudnn is passed over
    assert "cudnn" in train["passed_over"] and not train["errors"]
    assert train["mfu"] is None and train["peak_tflops"] is None      # no peak known for a CPU
    assert train["tokens_per_s"]["median"] > 0 and train["params"] > 0 and train["memory_gb"] > 0
    assert set(levers["items"]) == set(gpu.gpu_levers.ITEMS)          # every lever, each with its paired ratio
    for name, row in levers["items"].items():
        assert "error" not in row, (name, row)
        assert row["ratio"]["pairs"] == 2 and row["ratio"]["lo"] <= row["ratio"]["ratio"] <= row["ratio"]["hi"]
    assert set(decode["batches"]) == {"1", "2"} and decode["weights"] == "bfloat16"
    assert all(b["tokens_per_s"]["median"] > 0 and b["floor_ms"] > 0 for b in decode["batches"].values())
    text = md.read_text()
    for part in ("## GPU lane", "PyTorch torch.compile", "## Levers", "chunked_loss", "floor ms/step",
                 "6·N + 12·L·H·Q·T"):
        assert part in text, part
