"""Typed configuration: model shapes, weight sources, serving settings and sharding.

YAML presets in `configs/models/` and `configs/sharding/` load into the frozen
dataclasses defined here; every dataclass validates itself in `__post_init__` and
names the bad field. This package imports neither jax nor flax.
"""

from configs.engine import CACHE_POLICIES, MERGE_MODES, SPLIT_TOKENS, EngineConfig, bucket
from configs.model import (
    ConfigError,
    ModelConfig,
    ModelPreset,
    WeightsSource,
    list_presets,
    load_preset,
)
from configs.sharding import ShardingConfig, list_sharding_presets, load_sharding

__all__ = [
    "ConfigError",
    "EngineConfig",
    "CACHE_POLICIES",
    "MERGE_MODES",
    "SPLIT_TOKENS",
    "ModelConfig",
    "ModelPreset",
    "ShardingConfig",
    "WeightsSource",
    "list_presets",
    "list_sharding_presets",
    "load_preset",
    "bucket",
    "load_sharding",
]
