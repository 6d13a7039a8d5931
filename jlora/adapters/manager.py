"""Adapters for one engine: the host store, the device slots and the loads between them.

1. `register` validates a PEFT adapter and copies it into the host store's
   shared-memory arena (`store.py`); in `cached` mode it is also loaded into a device
   slot at once and pinned there (the papers' "Cached" baseline).
2. A request for an adapter that is not on the device asks the slot manager
   (`slots.py`) for it: a slot is freed if need be (LRU among adapters no running
   request uses, never a pinned one) and the transfer thread packs the adapter into
   the backend's layout and copies it to the device (`_load`).
3. The scheduler thread installs finished transfers into the stacked device slots
   at the top of its next iteration (`_install`, a compiled in-place update), so it
   never waits on a copy; the request is prefilled once its adapter is ready (the
   papers' "OnDmd" baseline; CPU-assisted prefill is a later stage).

`weights` is the device pytree the compiled steps take; only the scheduler thread
replaces it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from configs import ModelConfig
from jlora.adapters.backends import LoraBackend, LoraWeights, Payload
from jlora.adapters.peft import AdapterError
from jlora.adapters.slots import SlotManager
from jlora.adapters.store import HostStore, StoredAdapter
from jlora.adapters.targets import target_shapes

log = logging.getLogger(__name__)


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
        emulated_link_gbps: float = 0.0,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.max_rank = max_rank
        self.num_slots = num_slots
        self.emulated_link_gbps = emulated_link_gbps
        self.dtype = dtype
        shapes = target_shapes(model_config)
        self.shapes = {target: shapes[target] for target in targets}
        self.weights: LoraWeights = backend.allocate(
            num_layers=model_config.num_layers,
            num_slots=num_slots,
            max_rank=max_rank,
            shapes=self.shapes,
            dtype=dtype,
        )
        # Compiled once here, so installing never compiles in the serving loop.
        empty = {
            target: (
                np.zeros((model_config.num_layers, fan_in, 1), np.float32),
                np.zeros((model_config.num_layers, 1, fan_out), np.float32),
            )
            for target, (fan_in, fan_out) in self.shapes.items()
        }
        self._install_exe = (
            jax.jit(backend.install, donate_argnums=0)
            .lower(self.weights, np.int32(0), self._pack(empty, slot=0))
            .compile()
        )
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
        self.store.unregister(name)

    # -- the transfer thread and the scheduler thread ----------------------------

    def _pack(self, tensors, *, slot: int) -> Payload:
        return self.backend.pack(
            tensors, slot=slot, shapes=self.shapes, max_rank=self.max_rank, dtype=self.dtype
        )

    def _load(self, name: str, slot: int) -> Payload:
        """On the transfer thread: host arena -> packed numpy -> device arrays."""
        start = time.perf_counter()
        packed = self._pack(self.store.tensors(name), slot=slot)
        payload = jax.block_until_ready(jax.device_put(packed))
        if self.emulated_link_gbps:
            nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(packed))
            time.sleep(
                max(0.0, nbytes / (self.emulated_link_gbps * 1e9) - (time.perf_counter() - start))
            )
        log.info(
            "adapter %s -> slot %d in %.1f ms", name, slot, 1e3 * (time.perf_counter() - start)
        )
        return payload

    def _install(self, name: str, slot: int, payload: object) -> None:
        """On the scheduler thread: write a transferred adapter into its device slot."""
        self.weights = self._install_exe(self.weights, np.int32(slot), payload)

    def close(self) -> None:
        self.slots.close()
        self.store.close()
