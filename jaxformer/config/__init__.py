"""Frozen, validated configuration dataclasses (files, overrides and JSON: `jaxformer.configio`).

Every config section is a frozen dataclass with a `validate()` that raises ConfigError naming the dotted key and
the value. Constructing a section validates it; `configio.apply_overrides` validates once, after all overrides,
so the order of `--set` flags never matters. Sections nest: `model` (`jaxformer.config.model`) holds
`model.norm.position`, `model.runtime.dtype`, ... (`jaxformer.config.sections`); `data`, `optim`, `train`,
`parallel` (`jaxformer.config.run`, `jaxformer.config.parallel`).
"""
from jaxformer.config.checks import _deferred_validation, flat_items, replaced
from jaxformer.config.model import BIASES, SECTIONED, ModelConfig
from jaxformer.config.parallel import ParallelConfig
from jaxformer.config.run import (RESUME_MUST_MATCH, Config, DataConfig, OptimConfig, TrainConfig,
                                  resolve_vocab, resume_differences, to_dict)
from jaxformer.config.sections import (ATTENTION_KINDS, REMAT_POLICIES, AblationConfig, AttentionConfig, LoraConfig,
                                       MoEConfig, NormConfig, RopeConfig, RuntimeConfig)
from jaxformer.errors import ConfigError

__all__ = ["ATTENTION_KINDS", "AblationConfig", "AttentionConfig", "BIASES", "Config", "ConfigError", "DataConfig", "LoraConfig", "MoEConfig",
           "ModelConfig", "NormConfig", "OptimConfig", "ParallelConfig", "REMAT_POLICIES", "RESUME_MUST_MATCH",
           "RopeConfig", "RuntimeConfig", "SECTIONED", "TrainConfig", "_deferred_validation", "flat_items",
           "replaced", "resolve_vocab", "resume_differences", "to_dict"]
