"""Expert parallelism: the reversal model with a Mixture-of-Experts FFN (8 experts, top-2) on every layer, the
experts split 4 ways over the expert mesh axis (and the batch with them), data parallel across groups of 4
(needs a multiple of 4 devices, e.g. one 8-GPU node: data 2 × expert 4)."""

from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file


def get_config():   # the reversal config; the FFN becomes MoE and the plan splits its experts
    return apply_overrides(load_config_file(Path(__file__).parents[1] / "reverse.py"),
                           ["model.ffn=moe", "model.moe.num_experts=8", "model.moe.top_k=2", "parallel.data=-1",
                            "parallel.expert=4"])
