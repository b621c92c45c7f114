"""The 2017 paper's base model (D=512, N=8, F=2048, 6+6 layers, Post-LN, vocab 32k) on the reversal data.
For parameter counts (`jaxformer params configs/base.py`) and benchmarks, not for CPU training."""

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config() -> Config:
    return Config(model=ModelConfig(), data=DataConfig(task="reverse"),
                  optim=OptimConfig(schedule="noam", lr=1e-3, warmup_steps=4000),
                  train=TrainConfig(steps=100000))
