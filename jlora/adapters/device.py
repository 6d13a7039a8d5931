"""Adapter weights on the device: a fixed number of slots in the backend's layout, filled
layer group by layer group (Toppings §4.1, pipelined loading).

1. `load(name, tensors, slot)`, on the transfer thread, packs an adapter (host arrays,
   read in place from the host store) into the backend's layout and copies it to the
   device one layer group at a time, each group throttled to the emulated link if
   there is one; each group's device arrays are appended to the slot's `Transfer` as
   they land.
2. On the scheduler thread, `install_landed(name, slot)` writes the landed groups into
   the slot (compiled in-place updates, so it never waits on a copy and never
   compiles while serving): a CPU-assisted prefill calls it before each of its
   segments. `install(transfer)` writes the rest once the whole adapter has landed.

`weights` is the device pytree the compiled steps take; only the scheduler thread
replaces it. On a mesh, the slots are split as `specs` says (the sharding rules applied
to the backend's layout, jlora/model/sharding.py), and each group lands already split,
every device receiving only its part. `link_bytes_per_s` is the host-to-device
bandwidth: measured at start-up when asked (the emulated rate when the link is
throttled), then averaged over transfers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import numpy as np

from configs import ModelConfig
from jlora.adapters.backends import HostTensors, LoraBackend, LoraWeights, Payload, layer_group
from jlora.adapters.backends.base import LAYER_PARTS
from jlora.adapters.targets import target_shapes
from jlora.link import wait_for_link
from jlora.model.sharding import TensorParallel

log = logging.getLogger(__name__)


PROBE_BYTES = 32 * 2**20  # the start-up measurement of the host-to-device link


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `groups` layer groups (the last may be shorter)."""
    size = math.ceil(num_layers / max(1, min(groups, num_layers)))
    return [(start, min(start + size, num_layers)) for start in range(0, num_layers, size)]


@dataclasses.dataclass(eq=False)
class Transfer:
    """An adapter on its way to a device slot, layer group by layer group.

    The transfer thread appends each group's device payload to `landed` as it lands
    (a list append is atomic); the scheduler thread installs them in order and counts
    them in `installed`.
    """

    name: str
    slot: int
    landed: list[Payload] = dataclasses.field(default_factory=list)
    installed: int = 0


class DeviceSlots:
    """`num_slots` adapter slots of rank `max_rank` for the projections `targets`."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        backend: LoraBackend,
        num_slots: int,
        max_rank: int,
        targets: tuple[str, ...],
        dtype: Any,
        tp: TensorParallel,
        layer_groups_per_load: int = 1,
        emulated_link_gbps: float = 0.0,
        measure_link: bool = False,
    ) -> None:
        self.backend = backend
        self.max_rank = max_rank
        self.emulated_link_gbps = emulated_link_gbps
        self.dtype = dtype
        self.groups = layer_groups(model_config.num_layers, layer_groups_per_load)
        self._tp = tp
        self.rank_shards = tp.rank_shards(backend.layout)
        shapes = target_shapes(tp.placed)  # k/v as wide as the replicated KV heads
        self.shapes = {target: shapes[target] for target in targets}
        weights = backend.allocate(
            num_layers=model_config.num_layers,
            num_slots=num_slots,
            max_rank=max_rank,
            shapes=self.shapes,
            dtype=dtype,
            rank_shards=self.rank_shards,
        )
        split_rank = self.rank_shards > 1
        self.specs = tp.lora_specs(weights, backend.layout, split_rank=split_rank)
        shardings = tp.named(self.specs)
        self.weights: LoraWeights = jax.device_put(weights, shardings)
        # Compiled once per group size here, so installing never compiles while serving.
        install = jax.jit(backend.install, donate_argnums=0, out_shardings=shardings)
        self._install_exe = {}
        for size in sorted({stop - start for start, stop in self.groups}):
            empty = {
                target: (
                    np.zeros((size, fan_in, 1), np.float32),
                    np.zeros((size, 1, fan_out), np.float32),
                )
                for target, (fan_in, fan_out) in self.shapes.items()
            }
            packed = self._pack(empty, slot=0)
            payload_specs = tp.lora_specs(packed, backend.payload_layout, split_rank=split_rank)
            self._payload_shardings = tp.named(payload_specs)
            payload = jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding
                ),
                packed,
                self._payload_shardings,
            )
            # Bytes one layer of any adapter moves: the packing pads every rank alike.
            self.layer_bytes = sum(
                parts[part].nbytes // size for parts in packed.values() for part in LAYER_PARTS
            )
            self._install_exe[size] = install.lower(
                self.weights, np.int32(0), np.int32(0), payload
            ).compile()
        self.link_bytes_per_s = (
            emulated_link_gbps * 1e9
            if emulated_link_gbps
            else _measure_link_bytes_per_s()
            if measure_link
            else 0.0
        )
        self._transfers: dict[int, Transfer] = {}  # slot -> its latest load (transfer thread)

    # -- the transfer thread --------------------------------------------------------

    def load(self, name: str, tensors: HostTensors, slot: int) -> Transfer:
        """Host arrays -> packed numpy -> device arrays, one layer group at a time."""
        start = time.perf_counter()
        transfer = Transfer(name, slot)
        self._transfers[slot] = transfer
        placed = {  # k/v's B as wide as the replicated KV heads
            target: (a, self._tp.expand_kv(b) if target in ("k_proj", "v_proj") else b)
            for target, (a, b) in tensors.items()
        }
        packed = self._pack(placed, slot=slot)
        nbytes = 0
        for first, stop in self.groups:
            group_start = time.perf_counter()
            group = layer_group(packed, first, stop)
            payload = jax.block_until_ready(jax.device_put(group, self._payload_shardings))
            group_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(group))
            wait_for_link(group_bytes, self.emulated_link_gbps, group_start)
            transfer.landed.append(payload)
            nbytes += group_bytes
        seconds = time.perf_counter() - start
        observed = nbytes / max(seconds, 1e-9)
        previous = self.link_bytes_per_s
        self.link_bytes_per_s = 0.8 * previous + 0.2 * observed if previous else observed
        log.info(
            "adapter %s -> slot %d in %.1f ms (%d layer groups, %.2f MB)",
            name,
            slot,
            1e3 * seconds,
            len(self.groups),
            nbytes / 1e6,
        )
        return transfer

    # -- the scheduler thread -------------------------------------------------------

    def install_landed(self, name: str, slot: int) -> int:
        """Install the landed layer groups of `name`'s load into `slot` that are not yet;
        returns how many groups (from the first) are resident."""
        transfer = self._transfers.get(slot)
        if transfer is None or transfer.name != name:  # its load has not started yet
            return 0
        self._install_groups(transfer)
        return transfer.installed

    def install(self, transfer: Transfer) -> None:
        """Write the rest of a landed adapter into its slot."""
        self._install_groups(transfer)
        if self._transfers.get(transfer.slot) is transfer:
            del self._transfers[transfer.slot]

    def layers_left(self, name: str, slot: int) -> int:
        """Layers of `name` not yet installed into `slot` (all, before its load starts)."""
        landed = self.install_landed(name, slot)
        return sum(stop - start for start, stop in self.groups[landed:])

    def _install_groups(self, transfer: Transfer) -> None:
        for index in range(transfer.installed, len(transfer.landed)):
            first, stop = self.groups[index]
            self.weights = self._install_exe[stop - first](
                self.weights, np.int32(transfer.slot), np.int32(first), transfer.landed[index]
            )
            transfer.landed[index] = {}  # installed: let the device copy go
            transfer.installed = index + 1

    def _pack(self, tensors: HostTensors, *, slot: int) -> Payload:
        return self.backend.pack(
            tensors, slot=slot, shapes=self.shapes, max_rank=self.max_rank, dtype=self.dtype,
            rank_shards=self.rank_shards,
        )  # fmt: skip


def _measure_link_bytes_per_s() -> float:
    """Host-to-device bandwidth of one PROBE_BYTES copy (after a warm-up copy)."""
    probe = np.ones(PROBE_BYTES // 4, np.float32)
    jax.block_until_ready(jax.device_put(probe[:1024]))
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(probe))
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-9)
