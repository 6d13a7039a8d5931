"""Resolve `--model PATH_OR_PRESET` into a config, parameters and a tokenizer.

Accepted: a preset name (`configs/models/*.yaml`), a `.gguf` file, a Hugging Face
model directory (`config.json` + `*.safetensors`), or a directory written by
`jlora convert` (orbax).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.typing import DTypeLike

from configs import ModelConfig, ShardingConfig, list_presets, load_preset
from jlora.model import checkpoint
from jlora.model.gguf import GGUFFile
from jlora.model.llama import Llama, Params
from jlora.model.sharding import TensorParallel
from jlora.model.weights import Progress, Put, WeightsError, default_device, load_safetensors_dir
from jlora.tokenizer import Tokenizer

# generation_config.json's sampling fields a server takes as its defaults (vLLM's).
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for logs
    # The model's default sampling (a Hugging Face directory's generation_config.json:
    # GENERATION_FIELDS; none where it samples greedily, do_sample false).
    generation: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.config.vocab_size:
            raise WeightsError(
                f"{self.source}: the tokenizer has {self.tokenizer.vocab_size} tokens but the "
                f"model's vocab_size is {self.config.vocab_size}"
            )


def load_model(
    spec: str,
    serving_dtype: DTypeLike = jnp.float32,
    progress: Progress | None = None,
    sharding: ShardingConfig | None = None,
) -> LoadedModel:
    """`progress(done, total)` is called after each tensor read from a GGUF or HF file.
    With `sharding`, every parameter goes straight to the mesh's layout as it is read:
    a checkpoint's each process restores only its shards; a GGUF or Hugging Face file's
    each device receives only its shard. (A preset's random weights are drawn on one
    device and split later.)"""
    dtype = jnp.dtype(serving_dtype)

    def put(config: ModelConfig) -> Put:
        if sharding is None:
            return default_device
        return TensorParallel.build(config, sharding).put_stored

    if spec in list_presets():
        return _load_preset(spec, dtype, progress, put)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, progress, put)
    if path.is_dir() and checkpoint.is_checkpoint(path):
        shardings = None
        if sharding is not None:
            config = checkpoint.checkpoint_config(path)
            tp = TensorParallel.build(config, sharding)
            shardings = tp.restore_shardings(Llama(config, dtype).param_shapes())
        config, params, tokenizer = checkpoint.load_checkpoint(path, dtype, shardings)
        return LoadedModel(config, params, tokenizer, f"orbax checkpoint {path}")
    if path.is_dir() and (path / "config.json").is_file():
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), path.name)
        params = load_safetensors_dir(path, config, dtype, progress, put(config))
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        source = f"Hugging Face directory {path}"
        return LoadedModel(config, params, tokenizer, source, generation_defaults(path))
    if path.exists():
        raise WeightsError(
            f"model path {spec!r} is neither a .gguf file, a Hugging Face directory "
            f"(config.json + *.safetensors) nor a jlora checkpoint ({checkpoint.MARKER})"
        )
    raise WeightsError(
        f"unknown model path or preset {spec!r}; presets: {', '.join(list_presets())}"
    )


def _load_gguf(
    path: Path,
    dtype: jnp.dtype,
    progress: Progress | None,
    put: Callable[[ModelConfig], Put],
    expected: ModelConfig | None = None,
) -> LoadedModel:
    gguf_file = GGUFFile(path)
    config = gguf_file.config(expected.name if expected else "")
    diff = _config_diff(config, expected) if expected is not None else {}
    if expected is not None and diff:
        raise WeightsError(
            f"{path}: GGUF metadata disagrees with preset {expected.name} "
            f"(field: (gguf, preset)) {diff}"
        )
    tokenizer = Tokenizer.from_gguf_fields(gguf_file.fields)  # refused before any weight is read
    params = gguf_file.params(config, dtype, progress, put(config))
    return LoadedModel(config, params, tokenizer, f"GGUF {path}")


def _config_diff(actual: ModelConfig, expected: ModelConfig) -> dict[str, tuple]:
    """Fields that differ (floats compared at fp32 precision, as GGUF stores them)."""
    diff = {}
    for field in dataclasses.fields(actual):
        a, b = getattr(actual, field.name), getattr(expected, field.name)
        same = math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b
        if not same:
            diff[field.name] = (a, b)
    return diff


def _load_preset(
    name: str, dtype: jnp.dtype, progress: Progress | None, put: Callable[[ModelConfig], Put]
) -> LoadedModel:
    preset = load_preset(name)
    if preset.weights.format == "gguf":
        path = preset.weights.resolve_path()
        return _load_gguf(path, dtype, progress, put, expected=preset.config)
    params = Llama(preset.config, dtype).init_params(preset.weights.seed)
    return LoadedModel(
        preset.config, params, None, f"preset {name} (random weights, seed {preset.weights.seed})"
    )


def generation_defaults(path: Path) -> dict[str, Any]:
    """The sampling fields of `path/generation_config.json` (GENERATION_FIELDS) that are
    set; none where it is absent or decodes greedily (do_sample false)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{file}: cannot read it as JSON ({err})") from err
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}
    return {field: config[field] for field in GENERATION_FIELDS if config.get(field) is not None}
