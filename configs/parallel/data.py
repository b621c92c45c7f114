"""Data parallel: the reversal config with its batch split over every device (parameters replicated, gradients
all-reduced). The same run on 1 CPU, 8 GPUs or several hosts: `jaxformer train configs/parallel/data.py`."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan (and a vocab that splits evenly) changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["parallel.data=-1"])
