"""Copy task: the target equals the source (digits 3-6 long). Used for tests and ablations."""
from jaxformer.config import (Config, DataConfig, ModelConfig, NormConfig, OptimConfig, RuntimeConfig,
                              TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(arch="encoder_decoder", vocab_size=13, d_model=64, num_heads=4, d_ff=256,
                          num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                          norm=NormConfig(position="pre"), runtime=RuntimeConfig(dropout=0.1)),
        data=DataConfig(task="copy", num_train=1000, num_eval=500, batch_size=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=100),
        train=TrainConfig(steps=1000, eval_every=500, checkpoint_every=500),
    )
