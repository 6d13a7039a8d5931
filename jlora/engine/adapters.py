"""The orchestrator's adapter bookkeeping: which adapters are registered, which device
slot each occupies, which are pinned; the bytes themselves are the device engine's.

1. Registration is two steps, so that the scheduler thread never validates or copies:
   `stage` (any thread) checks the name (`jlora.contract.adapters`), reserves it and
   has the device engine validate the adapter and copy it into host memory; `commit`
   (the scheduler thread) makes it servable, and in `cached` mode pins it (its load
   starts; `wait_pinned` blocks until every pinned adapter has landed, for warm-up).
   A staged adapter that is not committed is `discard`ed.
2. A request for an adapter that is not on the device asks the slot manager
   (`jlora.engine.slots.SlotManager`, the LRU and the transfer thread) for it; the
   device engine's `load_adapter` runs on the transfer thread, its `install_adapter`
   on the scheduler thread at `poll`. A load that fails is reported by `poll` (the
   orchestrator fails the requests that waited for it) and the adapter stays
   registered: the next request tries again.
3. `unregister` refuses while requests name the adapter; `load`, `unload` and `infos`
   serve the adapter RPCs.
4. Device memory: the memory manager (jlora/engine/memory) learns each committed adapter with
   its content key (`content_key`: the same weights under another name share cached
   KV, other weights under an old name never do) and the bytes its rank rows take on
   the device; the slot manager asks it for those pages before a load.

Only `stage` (and what it calls) may run off the scheduler thread; the name
reservations are the one state it shares, under a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from jlora.contract.adapters import CONFIG_FILE, Adapter, check_adapter_name, sha256_of
from jlora.contract.errors import AlreadyExists, FailedPrecondition, NotFound, RequestError
from jlora.engine.api import DEVICE, HOST, LOADING, AdapterInfo
from jlora.engine.device_api import DeviceEngine
from jlora.engine.memory.manager import MemoryManager
from jlora.engine.slots import AdapterLoadError, SlotManager

log = logging.getLogger(__name__)

WAIT_SLICE_S = 1.0  # a blocking wait for a load looks at the loads this often


class AdapterManager:
    """See the module docstring. `num_slots` device adapter slots; `mode` is the
    engine's lora_mode ("cached" pins every adapter at registration)."""

    def __init__(
        self, device: DeviceEngine, *, num_slots: int, mode: str, memory: MemoryManager
    ) -> None:
        self._device = device
        self.mode = mode
        self.memory = memory
        self.slots = SlotManager(
            num_slots, device.load_adapter, device.install_adapter, memory=memory
        )
        self._keys: dict[str, str] = {}  # staged adapter -> content key
        self._adapters: dict[str, Adapter] = {}  # registered, in registration order
        self._reserved: set[str] = set()  # registered or being staged
        self._failures: list[tuple[str, RequestError]] = []  # failed loads, for take_failures
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> Adapter:
        return self._adapters[name]

    def names(self) -> list[str]:
        return list(self._adapters)

    # -- registration --------------------------------------------------------------

    def stage(self, name: str, path: str | Path, *, expect_sha256: str | None = None) -> Adapter:
        """Any thread: validate and copy in the adapter at `path` as `name` (step 1)."""
        check_adapter_name(name)
        with self._lock:
            if name in self._reserved:
                raise AlreadyExists(f"adapter name={name!r} is already registered", field="name")
            self._reserved.add(name)
        try:
            staged = self._device.stage_adapter(name, str(path), expect_sha256=expect_sha256)
            key = content_key(staged)
        except BaseException:
            with self._lock:
                self._reserved.discard(name)
            raise
        with self._lock:
            self._keys[name] = key
        return staged

    def commit(self, staged: Adapter, *, load: bool = False, pin: bool = False) -> None:
        """Make a staged adapter servable; `load` starts copying it to the device, `pin`
        (implied in cached mode) keeps it there. If that cannot be done (no slot can be
        had), the adapter is discarded and the error raised."""
        name = staged.name
        self._adapters[name] = staged
        self.memory.register(name, self._keys[name], staged.device_bytes)
        try:
            pin = pin or self.mode == "cached"
            if load or pin:
                self.load(name, pin=pin)
        except BaseException:
            del self._adapters[name]
            self._forget(name)
            raise
        log.info(
            "adapter %s: rank %d, targets %s, %.1f MiB in host memory",
            name,
            staged.rank,
            ",".join(staged.targets),
            staged.host_bytes / 2**20,
        )

    def discard(self, staged: Adapter) -> None:
        """Forget an adapter staged but not committed."""
        self._forget(staged.name)

    def unregister(self, name: str, *, users: int) -> None:
        """Forget an adapter that `users` queued or running requests name (refused if any)."""
        self._registered(name)
        if users:
            raise FailedPrecondition(
                f"adapter {name!r} is named by {users} queued or running requests", field="name"
            )
        del self._adapters[name]
        self._forget(name)

    # -- residency ----------------------------------------------------------------------

    def load(self, name: str, *, pin: bool = False) -> None:
        """Start copying a registered adapter to a device slot and return at once (a no-op
        if it is there or on its way); `pin` keeps it there until unloaded."""
        self._registered(name)
        if pin:
            self._pin(name)
        elif self.slots.request(name) is None and not self.slots.is_loading(name):
            raise FailedPrecondition(
                f"adapter {name!r}: no device slot can be had; all max_loras="
                f"{self.slots.num_slots} slots are held by running requests or pinned",
                field="name",
            )

    def unload(self, name: str) -> None:
        """Unpin an adapter and free its device slot; it stays registered."""
        self._registered(name)
        if self.slots.in_use(name):
            raise FailedPrecondition(
                f"adapter {name!r} is used by {self.slots.in_use(name)} running requests",
                field="name",
            )
        self.slots.discard(name)

    def poll(self) -> list[str]:
        """Install the loads that have landed; returns the adapters now ready. A failed
        load is kept for `take_failures` (the adapter stays registered, on the host)."""
        ready: list[str] = []
        while True:
            try:
                return ready + self.slots.poll()
            except AdapterLoadError as err:  # one per call; the others follow
                ready += err.ready
                log.error("%s", err)
                self._failures.append((err.adapter, load_failed(err)))

    def take_failures(self) -> list[tuple[str, RequestError]]:
        """The loads that failed since the last call: (adapter, the error its requests get)."""
        failures, self._failures = self._failures, []
        return failures

    def wait_pinned(self) -> None:
        """Block until every pinned adapter is on the device (cached mode's warm-up);
        a failed load is raised."""
        while missing := [n for n in self.slots.pinned if not self.slots.is_ready(n)]:
            if not self.slots.wait(timeout=WAIT_SLICE_S) and not self.slots.loading():
                raise FailedPrecondition(f"adapters {missing} cannot get a device slot")
            self.poll()
            if self._failures:
                raise self._failures.pop(0)[1]

    # -- introspection -------------------------------------------------------------------

    def info(self, name: str) -> AdapterInfo:
        staged = self._registered(name)
        slots = self.slots
        if slots.is_ready(name):
            state, slot = DEVICE, slots.resident()[name]
        elif slots.will_land(name):
            state, slot = LOADING, slots.loading()[name]
        else:
            state, slot = HOST, -1
        return AdapterInfo(
            adapter=staged,
            state=state,
            slot=slot,
            pinned=name in slots.pinned,
            running_requests=slots.in_use(name),
        )

    def infos(self, names: Iterable[str] | None = None) -> list[AdapterInfo]:
        return [self.info(name) for name in (self._adapters if names is None else names)]

    def close(self) -> None:
        self.slots.close()

    # -- internals -------------------------------------------------------------------------

    def _registered(self, name: str) -> Adapter:
        check_adapter_name(name)  # an empty or malformed name is the caller's, not unknown
        staged = self._adapters.get(name)
        if staged is None:
            raise NotFound(
                f"adapter name={name!r} is not registered", field="name", reason="ADAPTER_NOT_FOUND"
            )
        return staged

    def _forget(self, name: str) -> None:
        """Free the slot and the host memory of `name` and release its name."""
        self.slots.discard(name)  # unpins it too
        while self.slots.is_loading(name):  # the transfer thread still reads its bytes
            self.slots.wait(timeout=WAIT_SLICE_S)
            self.poll()
        self._device.drop_adapter(name)
        self.memory.unregister(name)
        with self._lock:
            self._reserved.discard(name)
            self._keys.pop(name, None)

    def _pin(self, name: str) -> None:
        try:
            self.slots.pin(name)
        except ValueError as err:
            raise FailedPrecondition(
                f"adapter {name!r} cannot be pinned: {err} (max_loras={self.slots.num_slots})",
                field="pin",
            ) from None


def content_key(staged: Adapter) -> str:
    """What an adapter's cached KV is keyed by: the digest of its weights' file and of its
    adapter_config.json (rank, alpha, rsLoRA, targets), so that KV is shared between
    names exactly when the weights are the same. An adapter whose weights' digest is
    unknown gets a key of its own (its name and path)."""
    if not staged.sha256:
        return sha256_of(f"{staged.name}\0{staged.path}".encode())
    config = Path(staged.path) / CONFIG_FILE
    return sha256_of(staged.sha256.encode(), config if config.is_file() else repr(staged).encode())


def load_failed(err: AdapterLoadError) -> RequestError:
    """The error the requests that waited for a failed load end with."""
    return RequestError(
        f"adapter {err.adapter!r} could not be loaded onto the device: {err.__cause__}",
        reason="ADAPTER_LOAD_FAILED",
    )
