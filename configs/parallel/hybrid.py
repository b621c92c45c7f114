"""Data × FSDP × tensor: 2-way tensor and 2-way FSDP inside each group of 4 devices, data parallel across groups
(needs a multiple of 4 devices, e.g. one 8-GPU node: data 2 × fsdp 2 × tensor 2)."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan (and a vocab that splits evenly) changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["model.vocab_size=16", "parallel.data=-1", "parallel.fsdp=2", "parallel.tensor=2"])
