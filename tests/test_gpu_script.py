"""benchmarks/gpu.py --dry: the one-shot GPU benchmark's code paths run end to end on CPU with tiny shapes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.mark.slow          # 13-18 s on 2 cores: make test-all (the script's only caller is a GPU machine)
def test_gpu_script_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("jaxformer_benchmark_gpu", SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    stem = tmp_path / "gpu"
    gpu.main(["--dry", "--out", str(stem)])
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    assert md.is_file() and js.is_file()
    rec = json.loads(js.read_text())
    train, decode, rev = (rec["sections"][k] for k in ("train", "decode", "reversal"))
    assert train["backend"] == "chunked"                              # no GPU here: cudnn is passed over
    assert "cudnn" in train["passed_over"] and not train["errors"]
    assert train["mfu"] is None and train["peak_tflops"] is None      # no peak known for a CPU
    assert train["tokens_per_s"]["median"] > 0 and train["params"] > 0
    assert set(decode["batches"]) == {"1", "2"}
    assert all(b["tokens_per_s"]["median"] > 0 for b in decode["batches"].values())
    assert set(rev["variants"]) == {"float32"}                        # dry: bfloat16 only in the full run
    assert all(v["tokens_per_s"]["median"] > 0 for v in rev["variants"].values())
    assert "chunked" in md.read_text() and "6·N + 12·L·H·Q·T" in md.read_text()
