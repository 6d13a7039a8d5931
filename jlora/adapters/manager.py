"""Adapters for one engine: the host store, the device slots and the loads between them.

1. `register` validates a PEFT adapter and copies it into the host store's
   shared-memory arena (`store.py`); in `cached` mode it is also loaded into a device
   slot at once and pinned there (the papers' "Cached" baseline).
2. A request for an adapter that is not on the device asks the slot manager
   (`slots.py`) for it: a slot is freed if need be (LRU among adapters no running
   request uses, never a pinned one) and the transfer thread packs the adapter into
   the backend's layout and copies it to the device layer group by layer group
   (`_load`, Toppings §4.1 pipelined loading): each group's device arrays are
   appended to the adapter's `Transfer` as they land.
3. The scheduler thread installs landed groups into the stacked device slots
   (compiled in-place updates), so it never waits on a copy: a CPU-assisted prefill
   installs what has landed before each of its segments (`install_landed`), and once
   the whole adapter has landed `SlotManager.poll` installs the rest (`_install`) and
   the adapter is ready. Waiting for that is the papers' "OnDmd" baseline.

`weights` is the device pytree the compiled steps take; only the scheduler thread
replaces it. `link_bytes_per_s` is the host-to-device bandwidth: measured at start-up in
`auto` mode (the emulated rate when the link is throttled), then averaged over transfers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from configs import ModelConfig
from jlora.adapters.backends import LoraBackend, LoraWeights, Payload, layer_group
from jlora.adapters.backends.base import LAYER_PARTS
from jlora.adapters.peft import AdapterError
from jlora.adapters.slots import SlotManager
from jlora.adapters.store import HostStore, StoredAdapter
from jlora.adapters.targets import target_shapes

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


class AdapterManager:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        backend: LoraBackend,
        num_slots: int,
        max_rank: int,
        targets: tuple[str, ...],
        mode: str,
        dtype: Any,
        host_store_bytes: int,
        layer_groups_per_load: int = 1,
        emulated_link_gbps: float = 0.0,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.max_rank = max_rank
        self.num_slots = num_slots
        self.emulated_link_gbps = emulated_link_gbps
        self.dtype = dtype
        self.groups = layer_groups(model_config.num_layers, layer_groups_per_load)
        shapes = target_shapes(model_config)
        self.shapes = {target: shapes[target] for target in targets}
        self.weights: LoraWeights = backend.allocate(
            num_layers=model_config.num_layers,
            num_slots=num_slots,
            max_rank=max_rank,
            shapes=self.shapes,
            dtype=dtype,
        )
        # Compiled once per group size here, so installing never compiles while serving.
        install = jax.jit(backend.install, donate_argnums=0)
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
            payload = jax.eval_shape(lambda p: p, packed)
            # Bytes one layer of any adapter moves: the packing pads every rank alike.
            self.layer_bytes = sum(
                parts[part].nbytes // size for parts in packed.values() for part in LAYER_PARTS
            )
            self._install_exe[size] = install.lower(
                self.weights, np.int32(0), np.int32(0), payload
            ).compile()
        # Only `auto`'s cost model needs the link before the first transfer.
        self.link_bytes_per_s = (
            emulated_link_gbps * 1e9
            if emulated_link_gbps
            else _measure_link_bytes_per_s()
            if mode == "auto"
            else 0.0
        )
        self._transfers: dict[str, Transfer] = {}  # written by the transfer thread
        self.store = HostStore(model_config, host_store_bytes)
        self.slots = SlotManager(num_slots, self._load, self._install)

    # -- registration ------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> StoredAdapter:
        """Add an adapter (and in cached mode load and pin it). Raises AdapterError and
        changes nothing if it cannot be served here."""
        stored = self.store.register(name, path)
        spec = stored.spec
        problem = None
        if spec.rank > self.max_rank:
            problem = (
                f"adapter {name!r} has rank r={spec.rank}, above this engine's "
                f"max_lora_rank={self.max_rank}"
            )
        elif missing := sorted(set(spec.targets) - set(self.shapes)):
            problem = (
                f"adapter {name!r} targets {missing}, which this engine's "
                f"lora_targets={sorted(self.shapes)} do not hold"
            )
        elif self.mode == "cached":
            try:
                self.slots.load_all([name], pin=True)
            except ValueError as err:
                problem = (
                    f"adapter {name!r}: lora_mode=cached keeps every adapter on the device "
                    f"and all max_loras={self.num_slots} slots are taken ({err})"
                )
            except RuntimeError as err:  # a failed transfer (AdapterLoadError) among them
                problem = f"adapter {name!r} could not be loaded onto the device: {err}"
        if problem is not None:
            self.store.unregister(name)
            raise AdapterError(problem)
        log.info(
            "adapter %s: rank %d, targets %s, %.1f MiB in the host store",
            name,
            spec.rank,
            ",".join(spec.targets),
            stored.nbytes / 2**20,
        )
        return stored

    def unregister(self, name: str) -> None:
        """Forget an adapter no running request uses (AdapterError otherwise)."""
        if name not in self.store:
            raise AdapterError(f"adapter name={name!r} is not registered")
        if self.slots.in_use(name):
            raise AdapterError(
                f"adapter {name!r} is used by {self.slots.in_use(name)} running requests"
            )
        self.slots.discard(name)  # unpins it too
        while self.slots.is_loading(name):  # the transfer thread still reads the arena
            self.slots.wait(timeout=1.0)
            self.slots.poll()
        self._transfers.pop(name, None)
        self.store.unregister(name)

    # -- residency, layer group by layer group -------------------------------------

    def install_landed(self, name: str) -> int:
        """On the scheduler thread: install the landed layer groups of `name` that are
        not installed yet; returns how many groups (from the first) are resident."""
        if self.slots.is_ready(name):
            return len(self.groups)
        transfer = self._transfers.get(name)
        if transfer is None or not self.slots.is_loading(name):
            return 0
        self._install_groups(transfer)
        return transfer.installed

    # -- the transfer thread and the scheduler thread ----------------------------

    def _pack(self, tensors, *, slot: int) -> Payload:
        return self.backend.pack(
            tensors, slot=slot, shapes=self.shapes, max_rank=self.max_rank, dtype=self.dtype
        )

    def _load(self, name: str, slot: int) -> Transfer:
        """On the transfer thread: host arena -> packed numpy -> device arrays, one layer
        group at a time (each throttled to the emulated link, if any)."""
        start = time.perf_counter()
        transfer = Transfer(name, slot)
        self._transfers[name] = transfer
        packed = self._pack(self.store.tensors(name), slot=slot)
        nbytes = 0
        for first, stop in self.groups:
            group_start = time.perf_counter()
            group = layer_group(packed, first, stop)
            payload = jax.block_until_ready(jax.device_put(group))
            group_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(group))
            if self.emulated_link_gbps:
                left = group_bytes / (self.emulated_link_gbps * 1e9)
                time.sleep(max(0.0, left - (time.perf_counter() - group_start)))
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

    def _install(self, name: str, slot: int, transfer: object) -> None:
        """On the scheduler thread: write the rest of a landed adapter into its slot."""
        assert isinstance(transfer, Transfer) and transfer.slot == slot
        self._install_groups(transfer)
        self._transfers.pop(name, None)

    def _install_groups(self, transfer: Transfer) -> None:
        for index in range(transfer.installed, len(transfer.landed)):
            first, stop = self.groups[index]
            self.weights = self._install_exe[stop - first](
                self.weights, np.int32(transfer.slot), np.int32(first), transfer.landed[index]
            )
            transfer.landed[index] = {}  # installed: let the device copy go
            transfer.installed = index + 1

    def close(self) -> None:
        self.slots.close()
        self.store.close()


def _measure_link_bytes_per_s() -> float:
    """Host-to-device bandwidth of one PROBE_BYTES copy (after a warm-up copy)."""
    probe = np.ones(PROBE_BYTES // 4, np.float32)
    jax.block_until_ready(jax.device_put(probe[:1024]))
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(probe))
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-9)
