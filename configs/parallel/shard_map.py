"""The explicit per-device data-parallel step (what a pmap user writes): `jax.shard_map` over the batch, each
device's gradients all-reduced with an explicit `lax.psum`. Same losses as `parallel/data.py`."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan (and a vocab that splits evenly) changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["parallel.mode=shard_map", "parallel.data=-1"])
