"""Device adapter slots: which adapter occupies which slot, loaded in the background.

The engine stacks adapter weights into a fixed number of device slots; every adapter is
resident in host memory. `SlotManager` decides which adapter occupies which slot and moves
adapters in without ever blocking the scheduler loop on a copy. The device work is injected:
`load(name, slot)` stages an adapter for a slot and returns a payload (device arrays in the
engine), `install(name, slot, payload)` writes the payload into the stacked slot arrays.

The life of an adapter:

1. `request(name)`: the scheduler asks for the adapter a waiting request needs. If it is
   ready, its slot comes back. Otherwise a slot is found (a free one, else the least
   recently used ready adapter that no running request uses and nobody pinned is evicted),
   `load(name, slot)` is submitted to the transfer thread, and `request` returns None; the
   scheduler moves on and asks again on a later step. If no slot can be had, nothing happens.
2. The transfer thread runs `load`. It is a single worker, so transfers are serialized like a
   DMA queue. When a load finishes, its done callback puts it on a queue.
3. `poll()`, on the scheduler's thread once per step, takes finished loads in completion order
   and calls `install`; only then is the adapter ready. A load (or install) that raised frees
   its slot and is reported as `AdapterLoadError`: background work fails loudly. `wait()`
   blocks until a load finishes, for a step in which every waiting request waits on one.
4. `acquire(name)` / `release(name)`: a running request holds its adapter. A held adapter keeps
   its slot and is never evicted. An adapter still loading may be held too (a CPU-assisted
   prefill runs while its adapter lands); the hold carries over when it is installed.
5. Eviction picks among idle (use count 0), unpinned ready adapters, least recently used first;
   install, `acquire`, and a `request` that finds the adapter ready all count as a use.
   `pin(name)` exempts an adapter (if no slot can be had, its load waits for the next
   `request()` or `poll()` that finds one). `load_all(names)` loads and pins a set of adapters
   up front: the "Cached" mode; request, wait, then prefill is the "OnDmd" mode.
6. `discard(name)` forgets an unregistered adapter; a load of it under way is let finish and
   its payload dropped by `poll()`.
7. Device memory (optional, `memory`): a pool shared with the KV cache (jlora/engine/memory) is
   asked for an adapter's pages before its load starts (`reserve`, which names them, and
   the load is given them; None: the load waits, its slot stays free), told when an
   adapter leaves a slot (`released`: evicted, failed or discarded), and orders the idle
   adapters for eviction (`evict_order`, given least recently used first), and refuses a
   pin whose pinned adapters its pages could never hold (`check_pins`).
   It may evict idle adapters itself (`evict`) to make room.

Threads: only `load` runs off the caller's thread. All bookkeeping is read and written on the
caller's (scheduler's) thread; the transfer thread sees nothing but its arguments and hands
its result back through a Future whose done callback feeds a `queue.SimpleQueue`. So the state
needs no lock, and the manager must be called from one thread. `load` may stage into the
buffers of the slot it is given: that slot's previous adapter is already evicted and idle.
"""

from __future__ import annotations

import heapq
import queue
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from jlora.engine.device_api import Payload


class AdapterLoadError(RuntimeError):
    """The background load (or the install) of `adapter` failed; the cause is chained.

    `ready` lists the adapters that the raising `poll()` installed, which it could not return.
    """

    def __init__(self, adapter: str, error: Exception, ready: list[str]) -> None:
        super().__init__(f"loading adapter {adapter!r} failed: {error}")
        self.adapter = adapter
        self.ready = ready


class SlotMemory(Protocol):
    """The device memory behind the slots (item 7 of the module docstring)."""

    def reserve(self, name: str) -> Sequence[int] | None: ...

    def released(self, name: str) -> None: ...

    def evict_order(self, names: list[str]) -> list[str]: ...

    def check_pins(self, names: Sequence[str]) -> None: ...


@dataclass(eq=False)
class _Load:
    """A load submitted to the transfer thread, into `slot`.

    `discarded` is set when the adapter was discarded mid-load: the payload is dropped.
    """

    name: str
    slot: int
    future: Future[Payload]
    discarded: bool = False


class SlotManager:
    """The bookkeeping of `num_slots` device adapter slots (see the module docstring)."""

    def __init__(
        self,
        num_slots: int,
        load: Callable[[str, int, Sequence[int] | None], Payload],
        install: Callable[[str, int, Payload], None],
        memory: SlotMemory | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be at least 1")
        self.num_slots = num_slots
        self._load = load
        self._install = install
        self._memory = memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jlora-slot-load")
        # Filled by done callbacks on the transfer thread; the only object both threads touch.
        self._done: queue.SimpleQueue[_Load] = queue.SimpleQueue()
        # Finished loads taken off `_done` (by wait()) and not yet installed, in completion order.
        self._finished: list[_Load] = []
        self._free = list(range(num_slots))  # a heap: the lowest free slot is taken first
        self._ready: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._uses: dict[str, int] = {}  # running requests per ready (or loading) adapter
        self._loading: dict[str, _Load] = {}
        self._pinned: dict[str, None] = {}  # an ordered set: waiting pins load in pin order
        self._failures: deque[tuple[str, Exception]] = deque()  # not yet raised by poll()
        self._stats = {"loads": 0, "evictions": 0, "hits": 0, "failures": 0}
        self._closed = False

    # -- the scheduler's calls ---------------------------------------------------------------

    def request(self, name: str) -> int | None:
        """The slot of `name` if it is ready; else make sure a load is under way, and None.

        A load starts only if a slot can be had now (a free one, or by evicting the least
        recently used idle, unpinned adapter); otherwise nothing happens and the caller asks
        again later. Pins still waiting for a slot are served first.
        """
        self._check_open()
        self._start_waiting_pins()
        slot = self._ready.get(name)
        if slot is not None:
            self._ready.move_to_end(name)
            self._stats["hits"] += 1
            return slot
        if name not in self._loading:
            self._start_load(name)
        return None

    def acquire(self, name: str) -> int:
        """Hold the ready or loading adapter `name` for a running request; returns its slot."""
        self._check_open()
        if name in self._loading and not self._loading[name].discarded:
            self._uses[name] = self._uses.get(name, 0) + 1
            return self._loading[name].slot
        if name not in self._ready:
            raise ValueError(f"adapter {name!r} is not on the device; request() it first")
        self._uses[name] += 1
        self._ready.move_to_end(name)
        return self._ready[name]

    def release(self, name: str) -> None:
        """Drop one hold of `name` taken by `acquire`."""
        self._check_open()
        if self._uses.get(name, 0) == 0:
            raise ValueError(f"adapter {name!r} released but not acquired")
        self._uses[name] -= 1

    def pin(self, name: str) -> None:
        """Never evict `name`; load it if it is not resident (pinning twice is a no-op).

        If no slot can be had now (every slot is held or pinned), the pin is recorded and the
        load starts at the first `request()` or `poll()` that finds a slot. A pin whose load
        fails is dropped, so a broken adapter is not retried forever.
        """
        self._check_open()
        if name in self._pinned:
            return
        if len(self._pinned) >= self.num_slots:
            raise ValueError(
                f"cannot pin adapter {name!r}: {len(self._pinned)} adapters are pinned "
                f"and num_slots={self.num_slots}"
            )
        if self._memory is not None:
            self._memory.check_pins([*self._pinned, name])
        self._pinned[name] = None
        if name not in self._ready and name not in self._loading:
            self._start_load(name)

    def unpin(self, name: str) -> None:
        """Make `name` evictable again (a load under way continues)."""
        self._check_open()
        if name not in self._pinned:
            raise ValueError(f"adapter {name!r} is not pinned")
        del self._pinned[name]

    def poll(self) -> list[str]:
        """Install every finished load, in completion order; returns the adapters now ready.

        A failed load frees its slot and is raised as `AdapterLoadError` after the others are
        installed; if several failed, each later `poll()` raises the next one. Pins waiting for
        a slot are then served, but never by evicting an adapter this call installed.
        """
        self._check_open()
        while True:
            try:
                self._finished.append(self._done.get_nowait())
            except queue.Empty:
                break
        ready = []
        for load in self._finished:
            del self._loading[load.name]
            if load.discarded:
                self._abandon(load)
                continue
            try:
                self._install(load.name, load.slot, load.future.result())
            except Exception as err:
                self._abandon(load)
                self._pinned.pop(load.name, None)
                self._failures.append((load.name, err))
                self._stats["failures"] += 1
                continue
            self._ready[load.name] = load.slot
            self._uses.setdefault(load.name, 0)  # holds taken while it loaded carry over
            ready.append(load.name)
        self._finished.clear()
        self._start_waiting_pins(keep=ready)  # what poll() returns is ready
        if self._failures:
            name, error = self._failures.popleft()
            raise AdapterLoadError(name, error, ready) from error
        return ready

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a load has finished (or `timeout` seconds); returns whether one has.

        Returns False at once when no load is under way, so it cannot wait for nothing.
        """
        self._check_open()
        if self._finished:
            return True
        if not self._loading:
            return False
        try:
            self._finished.append(self._done.get(timeout=timeout))
        except queue.Empty:
            return False
        return True

    def discard(self, name: str) -> None:
        """Forget `name` (it was unregistered): unpin it and free its slot.

        Refused while a running request holds it. A load under way finishes on the transfer
        thread; `poll()` then drops its payload (and any error) and frees the slot. Until then
        `is_loading(name)` stays true and `request(name)` starts no second load.
        """
        self._check_open()
        uses = self._uses.get(name, 0)
        if uses:
            raise ValueError(f"cannot discard adapter {name!r}: {uses} running requests use it")
        self._pinned.pop(name, None)
        if name in self._ready:
            heapq.heappush(self._free, self._forget_ready(name))
        elif name in self._loading:
            self._loading[name].discarded = True

    def evict(self, name: str) -> bool:
        """Evict the idle, unpinned, ready adapter `name` now (the memory pool makes room);
        False if it is not one."""
        self._check_open()
        if name not in self._ready or self._uses[name] or name in self._pinned:
            return False
        self._stats["evictions"] += 1
        heapq.heappush(self._free, self._forget_ready(name))
        return True

    def idle(self) -> list[str]:
        """The ready adapters no request holds and nobody pinned, least recently used first."""
        return [n for n in self._ready if self._uses[n] == 0 and n not in self._pinned]

    def load_all(
        self, names: Iterable[str], pin: bool = True, *, timeout: float | None = None
    ) -> None:
        """The "Cached" mode: load every adapter in `names`, block until all are installed.

        They stay pinned if `pin`. Raises ValueError if they do not fit in `num_slots` (with the
        adapters pinned already), RuntimeError if some cannot get a slot because running
        requests hold the others, TimeoutError after `timeout` seconds, and what `poll()`
        raises (also for other adapters' loads); on any error the pins this call added are
        removed.
        """
        self._check_open()
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise ValueError(f"cannot load {len(wanted)} adapters into num_slots={self.num_slots}")
        added = [name for name in wanted if name not in self._pinned]
        if len(self._pinned) + len(added) > self.num_slots:
            raise ValueError(
                f"cannot pin {len(added)} more adapters: {len(self._pinned)} are pinned "
                f"and num_slots={self.num_slots}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for name in added:
                self.pin(name)
            while missing := [name for name in wanted if name not in self._ready]:
                self._start_waiting_pins()  # may evict what the last poll() installed
                if not self._loading:  # nothing will land, so no slot will turn up
                    raise RuntimeError(
                        f"cannot load adapters {missing}: running requests hold the other slots"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self.wait(left):
                    raise TimeoutError(f"adapters {missing} not loaded within {timeout=} s")
                self.poll()
        except BaseException:
            for name in added:
                self._pinned.pop(name, None)
            raise
        if not pin:
            for name in added:
                del self._pinned[name]

    def close(self) -> None:
        """Shut the transfer thread down: queued loads are cancelled, the running one awaited.

        Every later call except the read-only ones raises RuntimeError.
        """
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True, cancel_futures=True)

    # -- introspection -----------------------------------------------------------------------

    def slot_of(self, name: str) -> int | None:
        """The slot of `name` if it is ready, else None."""
        return self._ready.get(name)

    def is_ready(self, name: str) -> bool:
        """Whether `name` is installed in a slot."""
        return name in self._ready

    def is_loading(self, name: str) -> bool:
        """Whether a load of `name` is under way (submitted, not yet handled by poll())."""
        return name in self._loading

    def in_use(self, name: str) -> int:
        """How many running requests hold `name`."""
        return self._uses.get(name, 0)

    def resident(self) -> dict[str, int]:
        """Ready adapter -> slot, least recently used first."""
        return dict(self._ready)

    def loading(self) -> dict[str, int]:
        """Adapter being loaded -> the slot it is loaded into (discarded loads included:
        they hold their slot until `poll()` drops them)."""
        return {name: load.slot for name, load in self._loading.items()}

    def will_land(self, name: str) -> bool:
        """Whether a load of `name` is under way and will be installed (not discarded)."""
        load = self._loading.get(name)
        return load is not None and not load.discarded

    @property
    def pinned(self) -> frozenset[str]:
        """The pinned adapters, resident or not."""
        return frozenset(self._pinned)

    @property
    def num_free(self) -> int:
        """Slots neither occupied by a ready adapter nor being loaded into."""
        return len(self._free)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: loads started, evictions, request hits, failed loads."""
        return dict(self._stats)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SlotManager is closed")

    def _start_load(self, name: str, keep: Collection[str] = ()) -> bool:
        """Submit a load of `name` if a slot can be had without evicting an adapter in `keep`;
        returns whether one started."""
        slot = self._take_slot(keep)
        if slot is None:
            return False
        pages = None
        if self._memory is not None and (pages := self._memory.reserve(name)) is None:
            heapq.heappush(self._free, slot)
            return False
        load = _Load(name, slot, self._executor.submit(self._load, name, slot, pages))
        self._loading[name] = load
        done = self._done
        load.future.add_done_callback(lambda _: done.put(load))
        self._stats["loads"] += 1
        return True

    def _take_slot(self, keep: Collection[str]) -> int | None:
        """A free slot, else the slot of the least recently used idle, unpinned adapter that
        is not in `keep`."""
        if self._free:
            return heapq.heappop(self._free)
        idle = [name for name in self.idle() if name not in keep]
        if self._memory is not None:
            idle = self._memory.evict_order(idle)
        for name in idle:
            self._stats["evictions"] += 1
            return self._forget_ready(name)
        return None

    def _forget_ready(self, name: str) -> int:
        """Take a ready adapter out of its slot (returned, not yet free)."""
        del self._uses[name]
        slot = self._ready.pop(name)
        if self._memory is not None:
            self._memory.released(name)
        return slot

    def _abandon(self, load: _Load) -> None:
        """A load that will not become ready (discarded, failed) frees its slot and pages."""
        if self._memory is not None:
            self._memory.released(load.name)
        heapq.heappush(self._free, load.slot)

    def _start_waiting_pins(self, keep: Collection[str] = ()) -> None:
        """Start the loads of pinned adapters that wait for a slot, in pin order."""
        for name in self._pinned:
            if name in self._ready or name in self._loading:
                continue
            if not self._start_load(name, keep):
                return
