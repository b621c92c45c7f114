"""A GPT-style character model on tiny Shakespeare (decoder-only, pre-LN, GELU, learned positions, D128,
4 layers, 4 heads, blocks of 64, batch 12; model.runtime.remat="dots": at this size the CPU train step is faster
recomputing the elementwise work than storing it, benchmarks/results/train_step.md "gpt" vs "gpt-noremat"):
the whole corpus, the last 10% held out. The corpus is read from a path, never shipped: data.path defaults to
../shared/data/tiny_shakespeare.txt (run from the repository root); set data.path=/path/to/tiny_shakespeare.txt
elsewhere."""
from jaxformer.config import (Config, DataConfig, ModelConfig, NormConfig, OptimConfig, RuntimeConfig,
                              TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(arch="decoder_only", vocab_size=0, d_model=128, num_heads=4, d_ff=512,
                          num_encoder_layers=0, num_decoder_layers=4, max_len=64,
                          positional="learned", activation="gelu", norm=NormConfig(position="pre"),
                          # recomputing the elementwise work is faster here than storing it
                          runtime=RuntimeConfig(dropout=0.0, remat="dots")),
        data=DataConfig(task="text", path="../shared/data/tiny_shakespeare.txt", num_chars=None, gutenberg=False,
                        block_size=64, batch_size=12, eval_fraction=0.1),
        optim=OptimConfig(name="adamw", lr=1e-3, schedule="warmup_cosine", warmup_steps=100, clip_norm=1.0,
                          b2=0.99, weight_decay=0.1),
        train=TrainConfig(steps=5000, log_every=50, eval_every=500, checkpoint_every=500, best_metric="loss",
                          best_mode="min", eval_batch_size=256, num_examples=3),
    )
