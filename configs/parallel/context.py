"""Data × context: every activation's sequence split 4 ways (context parallelism: GSPMD all-gathers the keys and
values each attention reads), data parallel across groups of 4 (needs a multiple of 4 devices)."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; only the parallel plan changes
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["parallel.data=-1", "parallel.context=4"])
