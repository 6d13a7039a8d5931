"""The model on a device mesh: where every array lives, and the shard's view of the model.

Every parameter names its logical axes (`PARAM_AXES`), a `ShardingConfig`'s rules map
them to mesh axes, and `TensorParallel` turns that into `PartitionSpec`s for the
parameters, the KV cache and the adapter slots, plus what a shard computes with:

- `local`: the ModelConfig of one shard (num_heads / tp, num_kv_heads / tp,
  intermediate_size / tp for the sharded axes), the shapes the step functions see
  inside `shard_map`;
- `attn_reduce` / `mlp_reduce`: the mesh axis to all-reduce over after o_proj /
  down_proj (row-parallel), None when that block is replicated;
- `vocab_axis`: the axis the vocabulary is split on (a masked embedding lookup with
  an all-reduce, and an all-gather of the logits), None when replicated; the
  vocabulary is padded with zero rows to a multiple of tp, and padded logits are cut.

With more devices than KV heads (GQA), each KV head is replicated on
`kv_replicas` = tp / num_kv_heads devices, as vLLM does: k_proj and v_proj (and the
adapters' B for them) repeat each head's columns, and the KV cache holds tp heads,
one per device.

Adapters follow the base weights (`lora_specs`): see `configs.sharding.LORA_SHARDINGS`.
With one device every spec is replicated and every collective is over an axis of size
one, so a single-device engine runs the same code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import ConfigError, ModelConfig
from configs.sharding import ShardingConfig

# Logical axes of every parameter, by path in the parameter pytree (llama.py).
PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("layers", "attn_norm", "scale"): ("layers", "embed"),
    ("layers", "q_proj", "kernel"): ("layers", "embed", "heads"),
    ("layers", "k_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("layers", "v_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("layers", "o_proj", "kernel"): ("layers", "heads", "embed"),
    ("layers", "mlp_norm", "scale"): ("layers", "embed"),
    ("layers", "gate_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "up_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "down_proj", "kernel"): ("layers", "mlp", "embed"),
    # Biases (ModelConfig.qkv_bias, o_bias, mlp_bias): a column-parallel projection's
    # split like its output, a row-parallel one's whole on every device.
    ("layers", "q_proj", "bias"): ("layers", "heads"),
    ("layers", "k_proj", "bias"): ("layers", "kv_heads"),
    ("layers", "v_proj", "bias"): ("layers", "kv_heads"),
    ("layers", "o_proj_bias", "bias"): ("layers", "embed"),
    ("layers", "gate_proj", "bias"): ("layers", "mlp"),
    ("layers", "up_proj", "bias"): ("layers", "mlp"),
    ("layers", "down_proj_bias", "bias"): ("layers", "embed"),
    ("final_norm", "scale"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}
# The leaves of k_proj and v_proj whose columns are KV heads (replicated past them).
KV_LEAVES = ("kernel", "bias")
# The KV cache: [layers, blocks, block_size, kv_heads, head_dim].
KV_AXES = ("layers", None, None, "kv_heads", None)
# Each LoRA target's (input, output) logical axes: those of its base kernel.
TARGET_AXES = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A model placed on a mesh by a sharding config (see the module docstring)."""

    config: ModelConfig
    sharding: ShardingConfig
    mesh: Mesh

    @classmethod
    def build(
        cls, config: ModelConfig, sharding: ShardingConfig, devices: list | None = None
    ) -> TensorParallel:
        """The mesh over the first devices (jax.devices() by default); ConfigError,
        naming the sizes, if the model cannot be split so."""
        devices = jax.devices() if devices is None else devices
        sharding.check(config, len(devices))
        shape = tuple(size for _, size in sharding.mesh)
        grid = np.array(devices[: sharding.num_devices]).reshape(shape)
        return cls(config, sharding, Mesh(grid, sharding.axis_names))

    # -- what a shard computes with ------------------------------------------------

    @property
    def size(self) -> int:
        return self.sharding.tensor_parallel

    def _split(self, logical: str) -> str | None:
        axis = self.sharding.axis_of(logical)
        return axis if axis is not None and self.size > 1 else None

    @property
    def attn_reduce(self) -> str | None:
        return self._split("heads")

    @property
    def mlp_reduce(self) -> str | None:
        return self._split("mlp")

    @property
    def vocab_axis(self) -> str | None:
        return self._split("vocab")

    @property
    def kv_replicas(self) -> int:
        """How many devices hold each KV head (1 unless tp exceeds num_kv_heads)."""
        heads = self.config.num_kv_heads
        return self.size // heads if self._split("kv_heads") and self.size > heads else 1

    @property
    def kv_heads(self) -> int:
        """KV heads of the whole (placed) model: num_kv_heads, times kv_replicas."""
        return self.config.num_kv_heads * self.kv_replicas

    def expand_kv(self, array: Any, axis: int = -1) -> Any:
        """k/v columns (num_kv_heads * head_dim along `axis`) with each head repeated
        kv_replicas times, in place order (numpy or jax arrays)."""
        if self.kv_replicas == 1:
            return array
        xp = jnp if isinstance(array, jax.Array) else np
        axis = axis % array.ndim
        shape = array.shape
        heads = array.reshape(*shape[:axis], self.config.num_kv_heads, -1, *shape[axis + 1 :])
        return xp.repeat(heads, self.kv_replicas, axis=axis).reshape(
            *shape[:axis], -1, *shape[axis + 1 :]
        )

    @property
    def padded_vocab(self) -> int:
        """The vocabulary rounded up to a multiple of tp when it is split."""
        vocab = self.config.vocab_size
        return math.ceil(vocab / self.size) * self.size if self.vocab_axis else vocab

    @property
    def placed(self) -> ModelConfig:
        """The whole model as placed: its KV heads replicated where needed."""
        return dataclasses.replace(self.config, num_kv_heads=self.kv_heads)

    @property
    def local(self) -> ModelConfig:
        """The model one shard computes (its heads, its MLP slice, its vocabulary rows)."""
        cfg, tp = self.config, self.size

        def part(logical: str, size: int) -> int:
            return size // tp if self._split(logical) else size

        return dataclasses.replace(
            cfg,
            num_heads=part("heads", cfg.num_heads),
            num_kv_heads=part("kv_heads", self.kv_heads),
            intermediate_size=part("mlp", cfg.intermediate_size),
            vocab_size=self.padded_vocab // tp if self.vocab_axis else cfg.vocab_size,
        )

    @property
    def lora_axis(self) -> str | None:
        """The axis fully-sharded adapters are split on (None under follow-base, whose
        deltas need no collective of their own)."""
        fully = self.sharding.lora_sharding == "fully-sharded"
        return (self._split("heads") or self._split("mlp")) if fully else None

    def rank_shards(self, layout: dict[str, tuple[str, ...]]) -> int:
        """The devices that split a column-parallel target's A on its rank in slots of
        this layout: fully-sharded stacked slots (a "rank" dim); 1 for follow-base and
        for a page pool (whose pages stay whole)."""
        return self.size if self.lora_axis and "rank" in layout["a"] else 1

    def lora_split(self, target: str, layout: dict[str, tuple[str, ...]]) -> tuple[bool, bool]:
        """A fully-sharded target's collectives on x·A: (all-gather it over the rank: A
        is split on its rank, the column-parallel case; all-reduce it: x is split, the
        row-parallel case, whose B is then split on its output)."""
        in_axis, out_axis = (self._split(a) for a in TARGET_AXES[target])
        return out_axis is not None and self.rank_shards(layout) > 1, in_axis is not None

    # -- where the arrays live --------------------------------------------------------

    def spec(self, *logical: str | None) -> PartitionSpec:
        """The PartitionSpec of an array with these logical axes."""
        return PartitionSpec(*(None if name is None else self._split(name) for name in logical))

    def param_specs(self, params: Any) -> Any:
        """A PartitionSpec for every parameter (the pytree's structure)."""

        def spec_of(path: tuple, leaf: Any) -> PartitionSpec:
            keys = tuple(getattr(k, "key", k) for k in path)
            if keys not in PARAM_AXES:
                raise ConfigError(f"parameter {'/'.join(keys)} has no logical axes (sharding.py)")
            return self.spec(*PARAM_AXES[keys])

        return jax.tree_util.tree_map_with_path(spec_of, params)

    @property
    def kv_spec(self) -> PartitionSpec:
        return self.spec(*KV_AXES)

    def lora_specs(
        self, weights: Any, layouts: dict[str, tuple[str, ...]], *, split_rank: bool
    ) -> Any:
        """A PartitionSpec for every part of the adapter slots (or of a packed adapter).

        layouts: part -> its dims, by name: "layers", "slot", "page" (replicated),
        "rank", "in", "out" (the backend's layout or payload layout). Under
        follow-base, "in" and "out" follow the target's base kernel and the rank is
        replicated; under fully-sharded, a row-parallel target's B is split on its
        output and, where `split_rank` (`rank_shards` of the slots' layout > 1), a
        column-parallel target's A on its rank.
        """
        fully = self.sharding.lora_sharding == "fully-sharded"
        tensor = self._split("heads") or self._split("mlp")

        def dims_to_spec(target: str, dims: tuple[str, ...]) -> PartitionSpec:
            in_axis, out_axis = (self._split(a) for a in TARGET_AXES[target])
            is_a = "in" in dims
            axes = []
            for dim in dims:
                if dim == "in":
                    axes.append(in_axis)
                elif dim == "out":
                    axes.append(out_axis or (tensor if fully and in_axis else None))
                elif dim == "rank":
                    axes.append(tensor if split_rank and is_a and out_axis else None)
                else:
                    axes.append(None)
            return PartitionSpec(*axes)

        return {
            target: {part: dims_to_spec(target, layouts[part]) for part in parts}
            for target, parts in weights.items()
        }

    def named(self, specs: Any) -> Any:
        """The NamedShardings of a pytree of PartitionSpecs, on this mesh."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def restore_shardings(self, shapes: Any) -> Any:
        """Where a checkpoint's parameters (`shapes`, as stored) go when restored: their
        final shards, except leaves the layout pads or widens (restored whole, then
        placed by `place_params`)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: self.stored_sharding(tuple(getattr(k, "key", k) for k in path)),
            shapes,
        )

    def stored_sharding(self, keys: tuple[str, ...]) -> NamedSharding:
        """Where the parameter at `keys` goes as read from a file (restore_shardings')."""
        whole = keys in self._reshaped_paths()
        return NamedSharding(self.mesh, PartitionSpec() if whole else self.spec(*PARAM_AXES[keys]))

    def put_stored(self, keys: tuple[str, ...], host: np.ndarray) -> jax.Array:
        """One parameter as read (the whole array, on the host) onto the mesh: each device
        receives only its shard, or the whole array where the layout reshapes it."""
        sharding = self.stored_sharding(keys)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _reshaped_paths(self) -> list[tuple[str, ...]]:
        paths: list[tuple[str, ...]] = []
        if self.padded_vocab != self.config.vocab_size:
            paths += [("embed", "embedding"), ("lm_head", "kernel")]
        if self.kv_replicas > 1:
            paths += [("layers", name, leaf) for name in ("k_proj", "v_proj") for leaf in KV_LEAVES]
        return paths

    def place_params(self, params: Any) -> Any:
        """The parameters laid out for the mesh (vocabulary padded, KV heads replicated
        where needed) and put on it, each device holding only its shards."""
        placed = self.layout_params(params)
        if jax.process_count() > 1:  # each process puts its devices' shards of its own copy
            placed = jax.tree.map(_host_if_local, placed)
        return jax.device_put(placed, self.named(self.param_specs(placed)))

    def layout_params(self, params: Any) -> Any:
        """The parameters padded and expanded as the mesh needs (a no-op on one device)."""
        params = dict(params)
        extra = self.padded_vocab - self.config.vocab_size
        if extra:
            table = params["embed"]["embedding"]
            params["embed"] = {"embedding": jnp.pad(table, ((0, extra), (0, 0)))}
            if "lm_head" in params:
                head = params["lm_head"]["kernel"]
                params["lm_head"] = {"kernel": jnp.pad(head, ((0, 0), (0, extra)))}
        if self.kv_replicas > 1:
            layers = dict(params["layers"])
            for name in ("k_proj", "v_proj"):
                layers[name] = {leaf: self.expand_kv(w) for leaf, w in layers[name].items()}
            params["layers"] = layers
        return params


def _host_if_local(array: Any) -> Any:
    """A parameter one process holds whole, as numpy (to be split across processes); one
    already on the mesh, as is."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return array
    return np.asarray(array)


def to_host(array: jax.Array) -> np.ndarray:
    """A replicated result on the host: this process's copy (with several processes a
    global array is not fully addressable, and every copy is the same)."""
    return np.asarray(array if array.is_fully_addressable else array.addressable_data(0))


def per_device_bytes(array: jax.Array) -> dict[Any, int]:
    """Bytes each device holds of `array` (its addressable shards)."""
    return {shard.device: shard.data.nbytes for shard in array.addressable_shards}


def unrolled_layer_loop(layer_loop: str, mesh: jax.sharding.Mesh) -> bool:
    """Whether EngineConfig.layer_loop unrolls the layers on this mesh ("auto": on a GPU,
    whose scan copies each layer's weights out of the stack)."""
    if layer_loop == "auto":
        return mesh.devices.flat[0].platform == "gpu"
    return layer_loop == "unrolled"
