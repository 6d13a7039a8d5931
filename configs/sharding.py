"""Sharding configs (`ShardingConfig`) and named presets (`configs/sharding/*.yaml`).

A sharding config is a device mesh (named axes and their sizes) and rules that map
the model's *logical* axes to mesh axes, in the spirit of MaxText's logical-axis rules:

    vocab     the vocabulary: rows of the embedding, columns of the LM head
    embed     the hidden dimension
    heads     query heads: columns of q_proj, rows of o_proj
    kv_heads  key/value heads: columns of k_proj and v_proj, the KV cache's heads
    mlp       the MLP's inner dimension: columns of gate/up_proj, rows of down_proj
    layers    the stacked layers

Every parameter names its logical axes (jlora/model/sharding.py), so a rule edits the
placement of every weight that has that axis. The engine runs the Megatron layout:
heads, kv_heads and mlp on the tensor axis make q/k/v/gate/up column-parallel and
o/down row-parallel (one all-reduce each per layer); vocab on it makes the embedding
and the head vocab-parallel (a masked lookup and an all-gather of the logits); each of
them may also be left replicated (null). The hidden dimension and the layer stack stay
replicated. `lora_sharding` places the adapters (see LORA_SHARDINGS).

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from configs.model import ConfigError, ModelConfig

SHARDING_DIR = Path(__file__).parent / "sharding"
DEFAULT_SHARDING = "tp1"
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "mlp", "layers")
# follow-base (CaraServe §6, vLLM's default): a column-parallel projection keeps A
# replicated and shards B like W; a row-parallel one shards A like W and keeps B
# replicated, so its LoRA partial sum joins the base all-reduce: no collective beyond
# the base model's. fully-sharded (S-LoRA, vLLM --fully-sharded-loras): A is sharded on
# its rank too (an all-gather of x·A per column-parallel projection), and a row-parallel
# B on its output (an all-reduce of x·A per row-parallel one): 1/tp of every adapter
# weight per device.
LORA_SHARDINGS = ("follow-base", "fully-sharded")
_REPLICATED_ONLY = {"embed", "layers"}  # sharding these is not implemented


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """A mesh and the placement rules (see the module docstring).

    mesh: (axis name, size) pairs, in mesh order. rules: (logical axis, mesh axis or
    None) pairs; a logical axis without a rule is replicated. Every axis but the
    tensor axis (the one `heads` maps to) must have size 1: one worker is one model
    replica (run several workers for data parallelism).
    """

    name: str
    mesh: tuple[tuple[str, int], ...]
    rules: tuple[tuple[str, str | None], ...] = ()
    lora_sharding: str = "follow-base"
    description: str = ""

    def __post_init__(self) -> None:
        names = [axis for axis, _ in self.mesh]
        if not self.mesh or len(set(names)) != len(names):
            raise ConfigError(f"ShardingConfig.mesh={dict(self.mesh)!r} needs distinct axes")
        for axis, size in self.mesh:
            if not isinstance(axis, str) or not axis.isidentifier():
                raise ConfigError(f"ShardingConfig.mesh axis {axis!r} must be an identifier")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"ShardingConfig.mesh.{axis}={size!r} must be a positive integer")
        rules = dict(self.rules)
        for logical, target in rules.items():
            if logical not in LOGICAL_AXES:
                raise ConfigError(
                    f"ShardingConfig.rules: unknown logical axis {logical!r}; "
                    f"known: {', '.join(LOGICAL_AXES)}"
                )
            if target is not None and target not in names:
                raise ConfigError(
                    f"ShardingConfig.rules.{logical}={target!r} is not a mesh axis ({names})"
                )
            if target is not None and logical in _REPLICATED_ONLY:
                raise ConfigError(
                    f"ShardingConfig.rules.{logical}={target!r}: sharding {logical} is not "
                    "supported (the engine runs the Megatron layout); set it to null"
                )
        if rules.get("heads") != rules.get("kv_heads"):
            raise ConfigError(
                f"ShardingConfig.rules: heads={rules.get('heads')!r} and "
                f"kv_heads={rules.get('kv_heads')!r} must name the same axis (each device "
                "attends with the KV heads of its own query heads)"
            )
        sharded = {axis for axis in rules.values() if axis is not None}
        if len(sharded) > 1:
            raise ConfigError(
                f"ShardingConfig.rules map to several mesh axes {sorted(sharded)}; "
                "the tensor-parallel layout uses one"
            )
        for axis, size in self.mesh:
            if size > 1 and axis not in sharded:
                raise ConfigError(
                    f"ShardingConfig.mesh.{axis}={size}: no rule shards anything on {axis!r} "
                    "(data parallelism within a worker is not supported: run more workers)"
                )
        if self.lora_sharding not in LORA_SHARDINGS:
            raise ConfigError(
                f"ShardingConfig.lora_sharding={self.lora_sharding!r} must be one of "
                f"{LORA_SHARDINGS}"
            )

    def axis_of(self, logical: str) -> str | None:
        """The mesh axis a logical axis is sharded on (None: replicated)."""
        return dict(self.rules).get(logical)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(axis for axis, _ in self.mesh)

    @property
    def num_devices(self) -> int:
        size = 1
        for _, count in self.mesh:
            size *= count
        return size

    @property
    def tensor_axis(self) -> str:
        """The mesh axis the tensor-parallel layout shards on (the first if none does)."""
        sharded = [axis for _, axis in self.rules if axis is not None]
        return sharded[0] if sharded else self.mesh[0][0]

    @property
    def tensor_parallel(self) -> int:
        """Devices that share one model replica's weights (the tensor axis's size)."""
        return dict(self.mesh)[self.tensor_axis]

    def check(self, model: ModelConfig, devices: int) -> None:
        """ConfigError, naming the sizes, unless `model` can run on this mesh of the
        `devices` present."""
        if self.num_devices > devices:
            raise ConfigError(
                f"sharding {self.name!r}: the mesh {dict(self.mesh)} needs {self.num_devices} "
                f"devices, only {devices} {'is' if devices == 1 else 'are'} present"
            )
        tp = self.tensor_parallel
        for logical, field, size in (
            ("heads", "num_heads", model.num_heads),
            ("mlp", "intermediate_size", model.intermediate_size),
        ):
            if self.axis_of(logical) is not None and size % tp:
                raise ConfigError(
                    f"sharding {self.name!r}: {model.name} has {field}={size}, which "
                    f"{self.tensor_axis}={tp} devices do not divide"
                )
        kv_heads = model.num_kv_heads
        if self.axis_of("kv_heads") is not None and kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                f"sharding {self.name!r}: {model.name} has num_kv_heads={kv_heads}; "
                f"{self.tensor_axis}={tp} devices must divide it, or be a multiple of it "
                "(each KV head is then replicated on tp / num_kv_heads devices)"
            )

    def with_lora_sharding(self, scheme: str | None) -> ShardingConfig:
        """This config with `lora_sharding` replaced (None: unchanged)."""
        return self if scheme is None else dataclasses.replace(self, lora_sharding=scheme)

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> ShardingConfig:
        unknown = sorted(set(data) - {"mesh", "rules", "lora_sharding", "description"})
        if unknown:
            raise ConfigError(
                f"sharding {name!r}: unknown field(s) {unknown}; "
                "known: mesh, rules, lora_sharding, description"
            )
        mesh, rules = data.get("mesh"), data.get("rules") or {}
        if not isinstance(mesh, dict) or not isinstance(rules, dict):
            raise ConfigError(f"sharding {name!r}: mesh and rules must be mappings")
        return cls(
            name=name,
            mesh=tuple(mesh.items()),
            rules=tuple(rules.items()),
            lora_sharding=data.get("lora_sharding", "follow-base"),
            description=data.get("description", ""),
        )


def list_sharding_presets() -> list[str]:
    return sorted(p.stem for p in SHARDING_DIR.glob("*.yaml"))


def load_sharding(spec: str | Path) -> ShardingConfig:
    """A preset's name (`configs/sharding/NAME.yaml`) or a YAML file's path."""
    path = Path(spec)
    if not path.suffix:
        path = SHARDING_DIR / f"{spec}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"unknown sharding preset {str(spec)!r}; presets: "
                f"{', '.join(list_sharding_presets())} (or a .yaml file)"
            )
    if not path.is_file():
        raise ConfigError(f"sharding file {str(spec)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"sharding file {str(spec)!r} is not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sharding file {str(spec)!r} must hold a mapping")
    return ShardingConfig.from_dict(path.stem, data)
