"""Seed 000's char-level LM: the first 10,000 characters of Alice, blocks of 10, batch 32, D=64, 4 heads,
2 layers, d_ff=128, 10 epochs (25 batches each). Decoder-only (the seed's model only ever predicts the next
character). Post-LN and sinusoidal positions as in the seed; AdamW instead of the seed's SGD (see docs).
The corpus ships with the package ("builtin:alice"); set data.path to train on another text file."""
from jaxformer.config import (Config, DataConfig, ModelConfig, NormConfig, OptimConfig, RuntimeConfig,
                              TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(arch="decoder_only", vocab_size=0, d_model=64, num_heads=4, d_ff=128,
                          num_encoder_layers=0, num_decoder_layers=2, max_len=100,
                          positional="sinusoidal", activation="relu", norm=NormConfig(position="post"),
                          runtime=RuntimeConfig(dropout=0.0)),
        data=DataConfig(task="text", path="builtin:alice", num_chars=10000,
                        block_size=10, batch_size=32, eval_fraction=0.1),
        optim=OptimConfig(name="adamw", lr=3e-3, schedule="constant", warmup_steps=0, clip_norm=1.0),
        train=TrainConfig(steps=250, log_every=25, eval_every=25, checkpoint_every=250, best_metric="loss",
                          best_mode="min", eval_batch_size=256, num_examples=3),
    )
