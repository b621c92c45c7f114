"""Tensor parallel (Megatron-style) × data parallel: heads, FFN width and vocabulary split over 2 devices, the
batch over the rest (needs an even device count). The vocabulary is padded to 16 so it splits evenly."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan (and a vocab that splits evenly) changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["model.vocab_size=16", "parallel.data=-1", "parallel.tensor=2"])
