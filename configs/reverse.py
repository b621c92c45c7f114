"""Digit reversal (seed 004): [7,1,4] -> [4,1,7]; 1000 training strings of length 3-6, a disjoint held-out set.
The README's main job. A small Pre-LN encoder-decoder that trains in about a minute on 2 CPU cores."""
from jaxformer.config import (Config, DataConfig, ModelConfig, NormConfig, OptimConfig, RuntimeConfig,
                              TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(arch="encoder_decoder", vocab_size=13, d_model=64, num_heads=4, d_ff=256,
                          num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                          positional="sinusoidal", activation="relu", norm=NormConfig(position="pre"),
                          runtime=RuntimeConfig(dropout=0.1)),
        data=DataConfig(task="reverse", num_train=1000, num_eval=500, min_len=3, max_len=6, batch_size=64),
        optim=OptimConfig(name="adamw", lr=3e-3, schedule="warmup_cosine", warmup_steps=100, clip_norm=1.0),
        train=TrainConfig(steps=1500, log_every=50, eval_every=500, checkpoint_every=500,
                          best_metric="exact_match"),
    )
