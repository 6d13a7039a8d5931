"""What the server asks an engine beyond `jlora.engine.api.Engine`: adapter control and stats.

The `Engine` interface covers requests (add, abort, step). The worker server also
registers, loads, unloads and lists adapters, and reports the running batch, the queue,
the slots and memory. Engines that can do so implement the `AdapterControl` and
`Introspectable` protocols below (`MockEngine` does); the server answers UNIMPLEMENTED
for a method the engine lacks. Every method here is called on the scheduler thread,
between two `step()` calls, like `add_request` and `abort`.

The dataclasses they return are plain host state, defined next to `Engine` in
`jlora/engine/api.py` and re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from jlora.engine.api import (
    DEVICE,
    HOST,
    LOADING,
    AdapterInfo,
    EngineStats,
    RunningInfo,
)

__all__ = [
    "DEVICE",
    "HOST",
    "LOADING",
    "AdapterControl",
    "AdapterInfo",
    "EngineStats",
    "Introspectable",
    "RunningInfo",
]


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
