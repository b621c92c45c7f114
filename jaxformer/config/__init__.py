"""Frozen, validated configuration dataclasses (files, overrides and JSON: `jaxformer.configio`).

Every config section is a frozen dataclass with a `validate()` that raises ConfigError naming the dotted key and
the value. Constructing a section validates it; `configio.apply_overrides` validates once, after all overrides,
so the order of `--set` flags never matters. Sections nest: `model.norm.position`, `model.runtime.dtype`
(`jaxformer.config.model`); `data`, `optim`, `train`, `parallel` (`jaxformer.config.run`).
"""
from jaxformer.config.checks import _deferred_validation, flat_items, replaced
from jaxformer.config.model import (ATTENTION_KINDS, BIASES, REMAT_POLICIES, SECTIONED, AblationConfig, AttentionConfig, LoraConfig,
                                    MoEConfig, ModelConfig, NormConfig, RopeConfig, RuntimeConfig)
from jaxformer.config.run import (RESUME_MUST_MATCH, Config, DataConfig, OptimConfig, ParallelConfig, TrainConfig,
                                  resolve_vocab, resume_differences, to_dict)
from jaxformer.errors import ConfigError

__all__ = ["ATTENTION_KINDS", "AblationConfig", "AttentionConfig", "BIASES", "Config", "ConfigError", "DataConfig", "LoraConfig", "MoEConfig",
           "ModelConfig", "NormConfig", "OptimConfig", "ParallelConfig", "REMAT_POLICIES", "RESUME_MUST_MATCH",
           "RopeConfig", "RuntimeConfig", "SECTIONED", "TrainConfig", "_deferred_validation", "flat_items",
           "replaced", "resolve_vocab", "resume_differences", "to_dict"]
