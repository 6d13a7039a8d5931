"""The emulated host-to-device link (`EngineConfig.emulated_link_gbps`), shared by the
copies that cross it: adapter transfers (jlora/device/lora_slots.py) and the prefix
cache's KV swaps (the device engines). Imports nothing heavy, so the mock engine can
throttle as the JAX engine does."""

from __future__ import annotations

import time


def wait_for_link(nbytes: int, gbps: float, started: float) -> None:
    """Sleep until a copy of `nbytes` that began at `started` (time.perf_counter) has
    taken at least nbytes / (gbps · 1e9) seconds; no wait when `gbps` is 0 (no throttle)."""
    if gbps > 0:
        time.sleep(max(0.0, nbytes / (gbps * 1e9) - (time.perf_counter() - started)))
