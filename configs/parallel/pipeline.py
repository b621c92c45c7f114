"""Pipeline × data: the stacked layers split over 2 pipeline stages (a GPipe schedule over 4 micro-batches of each
step: `jaxformer.nn.pipeline`), data parallel across the stage groups (needs an even device count; the reversal
model's layer counts are even)."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["parallel.data=-1", "parallel.stage=2", "parallel.microbatches=4"])
