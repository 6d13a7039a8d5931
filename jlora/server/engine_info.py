"""What the server asks an engine beyond `jlora.engine.api.Engine`: adapter control and stats.

The `Engine` interface covers requests (add, abort, step). The worker server also
registers, loads, unloads and lists adapters, and reports the running batch, the queue,
the slots and memory. Engines that can do so implement the `AdapterControl` and
`Introspectable` protocols below (`MockEngine` does); the server answers UNIMPLEMENTED
for a method the engine lacks. Every method here is called on the scheduler thread,
between two `step()` calls, like `add_request` and `abort`.

The dataclasses are plain host state with no dependency on the server, so that they can
move next to `Engine` in `jlora/engine/api.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol, runtime_checkable

# AdapterInfo.state
HOST, LOADING, DEVICE = "host", "loading", "device"


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter and where it is."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # canonical order
    sha256: str  # of adapter_model.safetensors ("" if unknown)
    size_bytes: int  # of adapter_model.safetensors
    state: str  # HOST | LOADING | DEVICE
    slot: int  # the device slot, -1 when state is HOST
    pinned: bool
    running_requests: int  # running requests holding it (it cannot be evicted meanwhile)


@dataclasses.dataclass(frozen=True)
class RunningInfo:
    """One request in the running batch."""

    request_id: str
    adapter: str | None
    rank: int  # the adapter's rank; 0 for the base model
    slot: int  # its decode slot
    prompt_tokens: int
    generated_tokens: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot between two steps; counters (adapter_loads, adapter_evictions) are
    cumulative since the engine started."""

    running: tuple[RunningInfo, ...]
    waiting: int  # queued, not yet admitted
    max_slots: int
    max_seq_len: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    adapter_slots_total: int
    adapter_slots_free: int
    adapter_slots_loading: int
    adapter_loads: int
    adapter_evictions: int
    host_store_bytes_used: int = 0
    host_store_bytes_capacity: int = 0
    device_bytes_in_use: int = -1  # -1: unknown
    device_bytes_limit: int = -1


@runtime_checkable
class AdapterControl(Protocol):
    """Adapters, on the scheduler thread. Failures raise `AdapterError` (a ValueError whose
    message names the field) and change nothing."""

    def register_adapter(self, name: str, path: str | Path) -> object:
        """Validate the PEFT adapter at `path` and serve it as `name`."""

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter that no queued or running request names."""

    def load_adapter(self, name: str, *, pin: bool = False) -> None:
        """Start copying a registered adapter into a device slot and return at once (a
        no-op if it is there or on its way); `pin` keeps it there until unloaded. Raises
        if no slot can be had and `pin` is False (with `pin`, the load waits for one)."""

    def unload_adapter(self, name: str) -> None:
        """Unpin an adapter and free its device slot (a no-op if it has none); raises if a
        running request holds it. It stays registered."""

    def adapter_infos(self) -> list[AdapterInfo]:
        """Every registered adapter, in registration order."""


@runtime_checkable
class Introspectable(Protocol):
    def stats(self) -> EngineStats:
        """The running batch, the queue, the slots and memory, now."""
