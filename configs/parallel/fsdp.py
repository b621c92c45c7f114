"""FSDP: batch, parameters and optimizer state split over every device (each weight along its model width D,
gathered layer by layer where used; gradients reduce-scattered). Per-device parameter + optimizer memory is
1/devices of data parallel's."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan (and a vocab that splits evenly) changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["parallel.data=1", "parallel.fsdp=-1"])
