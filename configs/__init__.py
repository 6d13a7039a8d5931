"""Typed configuration: model shapes, weight sources and serving settings.

YAML presets in `configs/models/` load into the frozen dataclasses defined here;
every dataclass validates itself in `__post_init__` and names the bad field.
This package imports neither jax nor flax.
"""

from configs.engine import EngineConfig
from configs.model import (
    ConfigError,
    ModelConfig,
    ModelPreset,
    WeightsSource,
    list_presets,
    load_preset,
)

__all__ = [
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ModelPreset",
    "WeightsSource",
    "list_presets",
    "load_preset",
]
