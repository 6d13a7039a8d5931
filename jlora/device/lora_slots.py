"""Adapter weights on the device: a fixed number of slots in the backend's layout, filled
layer group by layer group (Toppings §4.1, pipelined loading).

What crosses the host-to-device link is rank-exact: an adapter's own targets and its
rank rows alone (jlora/model/lora/base.py, `exact_rows`: the rank rounded up to a power of
two), so a rank-8 adapter of q/v costs the link its A [in, 8] and B [8, out] of those
two projections, not a slot's worth. The slots stay padded (the compiled steps take
fixed shapes); the padding to the slots' rank, and the zeros of the targets the
adapter lacks, are written on the device, by the compiled install.

0. `prepare(rank, targets)`, when an adapter is staged (off the scheduler thread),
   compiles the install of that shape for each layer-group size: one variant per
   (group size, rank bucket, targets), so a handful per engine. `load` compiles a shape
   nobody prepared on the transfer thread, never on the scheduler's.
1. `load(name, tensors, slot)`, on the transfer thread, packs an adapter (host arrays,
   read in place from the host store) into its rank-exact payload and copies it to the
   device one layer group at a time, each group throttled to the emulated link if
   there is one by the bytes it really sends; each group's device arrays are appended
   to the slot's `Transfer` as they land.
2. On the scheduler thread, `install_landed(name, slot)` writes the landed groups into
   the slot (compiled in-place updates, so it never waits on a copy and never
   compiles while serving): a CPU-assisted prefill calls it before each of its
   segments. `install(transfer)` writes the rest once the whole adapter has landed.

`weights` is the device pytree the compiled steps take; only the scheduler thread
replaces it. A pooled backend (the reference on one device) keeps the adapters in the KV
cache's pages instead: `weights` are then page tables, `load` is given the pages the
memory manager reserved (jlora/model/lora/reference.py), and the installs write into the cache,
which they take and give back (`attach_pool`).

On a mesh, the slots are split as `specs` says (the sharding rules applied to the
backend's layout, jlora/model/sharding.py), and each group lands already split,
every device receiving only its part (fully-sharded A: an equal share of the
adapter's rank rows, which the install moves to the devices whose part of the slot
holds them, device to device). `link_bytes_per_s` is the host-to-device bandwidth:
measured at start-up when asked (the emulated rate when the link is throttled), then
averaged over transfers, by the bytes they sent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from configs import ModelConfig
from jlora.contract.errors import InvalidRequest
from jlora.link import wait_for_link
from jlora.model.kv_cache import KVCache
from jlora.model.lora.base import (
    LAYER_PARTS,
    POOL,
    HostTensors,
    LoraBackend,
    LoraWeights,
    Packed,
    layer_group,
)
from jlora.model.lora.targets import target_shapes
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

    The transfer thread sets `installs` (the compiled install of each group), then
    appends each group's device payload to `landed` as it lands (a list append is
    atomic) and counts its bytes in `nbytes`; the scheduler thread installs them in
    order and counts them in `installed`.
    """

    name: str
    slot: int
    installs: list[Any] = dataclasses.field(default_factory=list)
    landed: list[Packed] = dataclasses.field(default_factory=list)
    installed: int = 0
    nbytes: int = 0  # what crossed the link so far


@dataclasses.dataclass(frozen=True)
class _Install:
    """The compiled install of one payload shape, and where the payload's parts go."""

    shardings: Any  # the payload's NamedShardings
    run: Any  # (weights, slot, first layer, payload) -> weights, the weights donated


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
        self._host_shapes = target_shapes(model_config)  # as the host store holds them
        self._num_layers = model_config.num_layers
        self._installs: dict[tuple, _Install] = {}  # payload shape -> its compiled install
        self.resize(num_slots)
        self._layer_bytes: dict[tuple[int, tuple[str, ...]], int] = {}
        self._compiling = threading.Lock()  # staging and transfer threads may both compile
        self.link_bytes_per_s = (
            emulated_link_gbps * 1e9
            if emulated_link_gbps
            else _measure_link_bytes_per_s()
            if measure_link
            else 0.0
        )
        self._transfers: dict[int, Transfer] = {}  # slot -> its latest load (transfer thread)

    def resize(self, num_slots: int) -> None:
        """`num_slots` empty slots, placed (at construction; again only before anything
        is prepared, loaded or attached: where a pooled backend's slots are rows of page
        tables, the engine sets their number once the pool's size is known)."""
        assert not self._installs, "slots resized after an install was prepared"
        self.num_slots = num_slots
        weights = self.backend.allocate(
            num_layers=self._num_layers,
            num_slots=num_slots,
            max_rank=self.max_rank,
            shapes=self.shapes,
            dtype=self.dtype,
            rank_shards=self.rank_shards,
        )
        split_rank = self.rank_shards > 1
        self.specs = self._tp.lora_specs(weights, self.backend.layout, split_rank=split_rank)
        shardings = self._tp.named(self.specs)
        self.weights: LoraWeights = jax.device_put(weights, shardings)
        self._abstract = _abstract(self.weights)
        self._jitted_install = jax.jit(
            self.backend.install, donate_argnums=0, out_shardings=shardings
        )

    def attach_pool(self, cache: KVCache) -> None:
        """The KV cache a pooled backend keeps the adapters in (before anything is
        prepared): its installs then take and give back the cache with the slots."""
        if not self.backend.pooled:
            return
        with_pool = self.backend.with_pool(self.weights, cache)
        self._abstract = _abstract(with_pool)
        shardings = jax.tree.map(lambda leaf: leaf.sharding, with_pool)
        self._jitted_install = jax.jit(
            self.backend.install, donate_argnums=0, out_shardings=shardings
        )

    # -- staging (any thread but the scheduler's) -------------------------------------

    def check_fits(self, name: str, rank: int, targets: Sequence[str]) -> None:
        """InvalidRequest naming `path` unless adapter `name` (of `rank` on `targets`)
        fits these slots."""
        if rank > self.max_rank:
            raise InvalidRequest(
                f"adapter {name!r} has rank r={rank}, above this engine's "
                f"max_lora_rank={self.max_rank}",
                field="path",
            )
        if missing := sorted(set(targets) - set(self.shapes)):
            raise InvalidRequest(
                f"adapter {name!r} targets {missing}, which this engine's "
                f"lora_targets={sorted(self.shapes)} do not hold",
                field="path",
            )

    def prepare(self, rank: int, targets: tuple[str, ...]) -> None:
        """Compile the installs of an adapter of `rank` on `targets`, one per layer-group
        size, unless an adapter of the same shape (rank bucket, targets) did."""
        layer = self._stand_in(rank, targets)
        for size in sorted({stop - start for start, stop in self.groups}):
            self._install_for(
                {
                    target: {
                        part: jax.ShapeDtypeStruct(
                            (size, *value.shape[1:]) if part in LAYER_PARTS else value.shape,
                            value.dtype,
                        )
                        for part, value in parts.items()
                    }
                    for target, parts in layer.items()
                }
            )

    @property
    def install_variants(self) -> int:
        """How many install variants (payload shapes) are compiled."""
        return len(self._installs)

    def layer_bytes(self, rank: int, targets: tuple[str, ...]) -> int:
        """The bytes one layer of an adapter of `rank` on `targets` sends over the link
        (its rank rows, bucketed; the cost model's load time). Any thread; compiles
        nothing."""
        key = (rank, tuple(targets))
        if key not in self._layer_bytes:
            self._layer_bytes[key] = sum(
                parts[part].nbytes
                for parts in self._stand_in(rank, targets).values()
                for part in LAYER_PARTS
            )
        return self._layer_bytes[key]

    def _stand_in(self, rank: int, targets: tuple[str, ...]) -> Packed:
        """The payload of one layer of an adapter of this shape (zeros, no slot)."""
        zero = np.float32(0)
        zeros = {
            target: (
                np.broadcast_to(zero, (1, self._host_shapes[target][0], rank)),
                np.broadcast_to(zero, (1, rank, self._host_shapes[target][1])),
            )
            for target in targets
        }
        return self._pack(zeros, slot=None)

    def _install_for(self, group: Packed) -> _Install:
        """The compiled install of `group`'s shape (arrays or ShapeDtypeStructs),
        compiled now if no one has."""
        key = tuple(
            (target, part, value.shape, np.dtype(value.dtype).str)
            for target, parts in group.items()
            for part, value in parts.items()
        )
        with self._compiling:
            if key not in self._installs:
                start = time.perf_counter()
                payload_specs = self._tp.lora_specs(
                    group, self.backend.payload_layout, split_rank=self.rank_shards > 1
                )
                shardings = self._tp.named(payload_specs)
                abstract = jax.tree.map(
                    lambda leaf, sharding: jax.ShapeDtypeStruct(
                        leaf.shape, leaf.dtype, sharding=sharding
                    ),
                    group,
                    shardings,
                )
                run = self._jitted_install.lower(
                    self._abstract, np.int32(0), np.int32(0), abstract
                ).compile()
                self._installs[key] = _Install(shardings, run)
                log.info(
                    "compiled the install of %d layers of %s in %.0f ms",
                    next(iter(group.values()))["b"].shape[0],
                    ", ".join(f"{t} ({p['b'].shape[1]} rank rows)" for t, p in group.items()),
                    1e3 * (time.perf_counter() - start),
                )
            return self._installs[key]

    # -- the transfer thread --------------------------------------------------------

    def load(
        self, name: str, tensors: HostTensors, slot: int, pages: Sequence[int] | None = None
    ) -> Transfer:
        """Host arrays -> rank-exact numpy -> device arrays, one layer group at a time.
        pages: a pooled backend's pool pages for the adapter (`pool_pages` of them)."""
        transfer = Transfer(name, slot)
        self._transfers[slot] = transfer
        packed = self._pack(tensors, slot=slot, pages=pages)
        groups = [layer_group(packed, first, stop) for first, stop in self.groups]
        installs = [self._install_for(group) for group in groups]
        transfer.installs = [install.run for install in installs]
        start = time.perf_counter()
        for group, install in zip(groups, installs, strict=True):
            group_start = time.perf_counter()
            payload = jax.block_until_ready(jax.device_put(group, install.shardings))
            group_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(group))
            wait_for_link(group_bytes, self.emulated_link_gbps, group_start)
            transfer.landed.append(payload)
            transfer.nbytes += group_bytes
        seconds = time.perf_counter() - start
        observed = transfer.nbytes / max(seconds, 1e-9)
        previous = self.link_bytes_per_s
        self.link_bytes_per_s = 0.8 * previous + 0.2 * observed if previous else observed
        log.info(
            "adapter %s -> slot %d in %.1f ms (%d layer groups, %.2f MB)",
            name,
            slot,
            1e3 * seconds,
            len(self.groups),
            transfer.nbytes / 1e6,
        )
        return transfer

    # -- the scheduler thread -------------------------------------------------------

    def install_landed(self, name: str, slot: int, cache: KVCache) -> tuple[int, KVCache]:
        """Install the landed layer groups of `name`'s load into `slot` that are not yet;
        returns how many groups (from the first) are resident, and the KV cache (a
        pooled backend writes the adapter into it; any other passes it through)."""
        transfer = self._transfers.get(slot)
        if transfer is None or transfer.name != name:  # its load has not started yet
            return 0, cache
        cache = self._install_groups(transfer, cache)
        return transfer.installed, cache

    def install(self, transfer: Transfer, cache: KVCache) -> KVCache:
        """Write the rest of a landed adapter into its slot; returns the KV cache."""
        cache = self._install_groups(transfer, cache)
        if self._transfers.get(transfer.slot) is transfer:
            del self._transfers[transfer.slot]
        return cache

    def layers_left(self, name: str, slot: int) -> int:
        """Layers of `name` not yet landed in `slot` (all, before its load starts)."""
        transfer = self._transfers.get(slot)
        landed = 0 if transfer is None or transfer.name != name else len(transfer.landed)
        return sum(stop - start for start, stop in self.groups[landed:])

    def _install_groups(self, transfer: Transfer, cache: KVCache) -> KVCache:
        for index in range(transfer.installed, len(transfer.landed)):
            first = self.groups[index][0]
            weights = self.backend.with_pool(self.weights, cache)
            weights = transfer.installs[index](
                weights, np.int32(transfer.slot), np.int32(first), transfer.landed[index]
            )
            if POOL in weights:
                pool = weights.pop(POOL)
                cache = KVCache(k=pool["k"], v=pool["v"])
            self.weights = weights
            transfer.landed[index] = {}  # installed: let the device copy go
            transfer.installed = index + 1
        return cache

    def _pack(
        self, tensors: HostTensors, *, slot: int | None, pages: Sequence[int] | None = None
    ) -> Packed:
        placed = {  # k/v's B as wide as the replicated KV heads
            target: (a, self._tp.expand_kv(b) if target in ("k_proj", "v_proj") else b)
            for target, (a, b) in tensors.items()
        }
        return self.backend.pack(
            placed, slot=slot, shapes=self.shapes, max_rank=self.max_rank, dtype=self.dtype,
            rank_shards=self.rank_shards, pages=pages,
        )  # fmt: skip


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), tree
    )


def _measure_link_bytes_per_s() -> float:
    """Host-to-device bandwidth of one PROBE_BYTES copy (after a warm-up copy)."""
    probe = np.ones(PROBE_BYTES // 4, np.float32)
    jax.block_until_ready(jax.device_put(probe[:1024]))
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(probe))
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-9)
