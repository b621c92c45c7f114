"""The GPT-style model of configs/shakespeare_char.py on prepared token shards of tiny Shakespeare (the `tokens`
task: windows of 64 tokens at a per-epoch random offset; the held-out split is the last 10% of the text).
Prepare the shards first, from the repository root (nothing is downloaded; the tokenizer is trained here):

    jaxformer data prepare ../shared/data/tiny_shakespeare.txt --tokenizer bpe --vocab-size 512 \\
        --out runs/data/shakespeare-bpe512

and point data.path elsewhere for another tokenizer (`--tokenizer char`, `--vocab-size 2048`, ...)."""
from jaxformer.config import (Config, DataConfig, ModelConfig, NormConfig, OptimConfig, RuntimeConfig,
                              TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(arch="decoder_only", vocab_size=0, d_model=128, num_heads=4, d_ff=512,
                          num_encoder_layers=0, num_decoder_layers=4, max_len=64,
                          positional="learned", activation="gelu", norm=NormConfig(position="pre"),
                          runtime=RuntimeConfig(dropout=0.0)),
        data=DataConfig(task="tokens", path="runs/data/shakespeare-bpe512", block_size=64, batch_size=12),
        optim=OptimConfig(name="adamw", lr=1e-3, schedule="warmup_cosine", warmup_steps=100, clip_norm=1.0,
                          b2=0.99, weight_decay=0.1),
        train=TrainConfig(steps=1500, log_every=50, eval_every=250, checkpoint_every=500, best_metric="loss",
                          best_mode="min", eval_batch_size=256, num_examples=3),
    )
