"""The memory manager: the pool, the prefix tree and the swaps, behind one interface.

The orchestrator asks it for a request's KV (`admit`), tells it when a prompt's KV is
written (`prefilled`) and when the request leaves (`release`), and calls `tick` once
per step; the adapter slot manager asks it for an adapter's pages (`reserve`) and
tells it when an adapter lands or leaves (`installed`, `released`). Policies
(EngineConfig.cache_policy):

- "fastlibra": one pool for KV and adapters, each adapter charged the pages of its own
  rank (pool.py); prompts' full blocks are kept after their request in the tree, keyed
  by adapter content (tree.py), and swapped to and from the host pool by the cost model
  (swapper.py), on demand when pages run out and periodically between the marks. An
  adapter leaves the device only after its KV has (FastLibra §4.2: no invalid KV).
- "lru": vLLM's: the adapters' share of the pool is fixed when the manager is made
  (max_loras slots at max_lora_rank; each adapter takes its pages out of it); the prefix
  cache evicts its least recently used leaf to the host pool when pages run out;
  adapters are evicted by the slot manager's LRU, whatever KV depends on them (that KV
  is then invalid).
- "none": S-LoRA's: one pool for KV and adapters, no history: a request's blocks are
  freed when it leaves.

A request's lease grows as its sequence does (`grow`, a block at a time while it
decodes); when it cannot, the scheduler preempts a request (`release`s its lease, whose
full blocks join the cache like any leaving request's) and recomputes it later.

A request reuses the longest cached prefix of full blocks for the same adapter content,
less its last token (a prefill computes at least one token). If part of that prefix is
in the host pool (or on its way there), it is swapped in (asynchronously) and the
request waits for it, as it would for its adapter; if the pages for it cannot be had,
the request uses the part on the device. Swaps run on one background thread, over the
link the engine emulates or has: `device.kv_to_host` / `kv_to_device` take its time;
`tick` installs what landed. A block leaving the device goes to the host pool only if
bringing it back over the link is quicker than computing it again (`observe_prefill`
measures that); otherwise it is dropped, and recomputed if it is needed again.

Threads: everything but the copies (transfers.py) runs on the scheduler's thread.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from jlora.engine.api import CacheStats
from jlora.engine.device_api import DeviceEngine, HostBlocks
from jlora.engine.memory import swapper
from jlora.engine.memory.invariants import check_invariants
from jlora.engine.memory.pool import KV, LORA, PagePool
from jlora.engine.memory.transfers import Transfers
from jlora.engine.memory.tree import (
    BASE,
    DEVICE,
    GONE,
    HOST,
    TO_DEVICE,
    TO_HOST,
    Lease,
    Node,
    Tree,
    leading,
)

SWAPPING, FULL = "swapping", "full"  # why `admit` gave no lease
STATIC_SHARE = ("static share",)  # the owner of "lru"'s LoRA pages no adapter holds


class Slots(Protocol):
    """What the pool needs of the adapter slot manager (jlora/engine/slots.py)."""

    def idle(self) -> list[str]: ...

    def evict(self, name: str) -> bool: ...


@dataclasses.dataclass(eq=False)
class _Adapter:
    key: Hashable
    device_bytes: int
    pages: list[int] = dataclasses.field(default_factory=list)
    resident: bool = False  # its pages are reserved (landing or landed)


class MemoryManager:
    """See the module docstring."""

    def __init__(
        self,
        *,
        policy: str,
        device: DeviceEngine,
        num_pages: int,
        page_bytes: int,
        block_size: int,
        host_bytes: int,
        lora_slots: int = 0,
        lora_slot_bytes: int = 0,
        min_kv_pages: int = 1,
        link_bytes_per_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.device = device
        self.pool = PagePool(num_pages, page_bytes)
        self.tree = Tree()
        self.block_size = block_size
        self.host_capacity = host_bytes
        self.host_used = 0
        self._transfers = Transfers(link_bytes_per_s, self.pool.page_bytes, block_size)
        self._clock = clock
        self._adapters: dict[str, _Adapter] = {}
        self._leases: set[Lease] = set()  # granted, not yet released
        self._waiting: dict[Hashable, list[Node]] = {}  # owner -> the path it waits on
        self._base = self.tree.adapter(BASE)
        self._base.where = DEVICE
        self._batch = swapper.BatchWindow()
        self._last_tick = clock()
        self._stats = dict.fromkeys(
            ("prompt_tokens", "hit_tokens", "swaps_out", "swaps_in", "out_bytes", "in_bytes"), 0
        )
        self._slots: Slots | None = None  # `attach`ed
        self._share: list[int] = []  # "lru": the static share's pages no adapter holds
        self._min_kv_pages = min_kv_pages
        if policy == "lru" and lora_slots:
            # vLLM sizes every LoRA slot for the largest rank, once; KV keeps min_kv_pages.
            share = lora_slots * self.pool.pages_for(lora_slot_bytes)
            share = min(share, num_pages - min_kv_pages)
            self._share = self.pool.allocate(share, LORA, STATIC_SHARE)

    def attach(self, slots: Slots) -> None:
        """The adapter slots whose idle adapters the pool may evict to make room."""
        self._slots = slots

    # -- adapters (the slot manager's hooks) ----------------------------------------------

    def register(self, name: str, key: Hashable, device_bytes: int) -> None:
        """A registered adapter: its content key (what its KV is cached under) and the
        bytes of its rank rows on the device."""
        self._adapters[name] = _Adapter(key, device_bytes)

    def unregister(self, name: str) -> None:
        """Forget an adapter (no-op for one never registered); it left the device first."""
        adapter = self._adapters.pop(name, None)
        assert adapter is None or not adapter.resident, f"adapter {name!r} is on the device"

    def reserve(self, name: str) -> list[int] | None:
        """Pages for `name`'s load (it is about to start), which it is written into where
        the adapters live in the pool; None: not now. Under "lru" they come out of the
        static share (a slot's worth each, which max_loras adapters always find)."""
        adapter = self._adapters[name]
        need = self.pool.pages_for(adapter.device_bytes)
        if self.policy == "lru":
            if len(self._share) < need:
                return None
            adapter.pages, self._share = self._share[:need], self._share[need:]
            self.pool.transfer(adapter.pages, (LORA, name))
        else:
            if self.pool.num_free < need:
                self._make_room(need - self.pool.num_free, evict_adapters=True, keep=name)
            if self.pool.num_free < need:
                return None
            adapter.pages = self.pool.allocate(need, LORA, (LORA, name))
        adapter.resident = True
        self.tree.adapter(adapter.key).where = DEVICE
        return adapter.pages

    def check_pins(self, names: Sequence[str]) -> None:
        """ValueError if adapters `names`, pinned (never evicted), could never all be on
        the device and leave the pool a sequence's KV (min_kv_pages), which would starve
        a pinned load forever. Under "lru" the slot count bounds the pins instead (each
        slot's share holds an adapter of any rank)."""
        if self.policy == "lru":
            return
        need = sum(self.pool.pages_for(self._adapters[name].device_bytes) for name in names)
        room = self.pool.num_pages - self._min_kv_pages
        if need > room:
            raise ValueError(
                f"the {len(names)} pinned adapters would take {need} of the device pool's "
                f"{self.pool.num_pages} pages, which must keep {self._min_kv_pages} for a "
                "sequence's KV"
            )

    def released(self, name: str) -> None:
        """`name` left the device (evicted, failed or discarded)."""
        adapter = self._adapters.get(name)
        if adapter is None or not adapter.resident:
            return
        adapter.resident = False
        if self.policy == "lru":  # back to the static share
            self.pool.transfer(adapter.pages, STATIC_SHARE)
            self._share.extend(adapter.pages)
        else:
            self.pool.free(adapter.pages)
        adapter.pages = []
        if any(a.resident and a.key == adapter.key for a in self._adapters.values()):
            return  # the same weights are still resident under another name
        node = self.tree.adapter(adapter.key)
        if self.policy == "fastlibra":
            for kv in reversed(list(self.tree.kv_nodes(node))):  # children before parents
                if kv.where in (DEVICE, TO_DEVICE):
                    assert kv.refs == 0, "an idle adapter's KV is read by a request"
                    self._swap_out(kv)
        node.where = HOST

    def evict_order(self, names: list[str]) -> list[str]:
        """The order in which idle adapters (given least recently used first) are evicted."""
        if self.policy != "fastlibra":
            return names
        now, demand, awaited = self._clock(), self._demand(), self._awaited()

        def value(name: str) -> tuple[bool, bool, float]:
            adapter = self._adapters[name]
            node = self.tree.adapter(adapter.key)
            has_kv = any(kv.where == DEVICE for kv in self.tree.kv_nodes(node))
            evaluated = swapper.evaluate(self._candidate(node, adapter), demand, now)
            return adapter.key in awaited, has_kv, evaluated

        return sorted(names, key=value)

    # -- requests ---------------------------------------------------------------------------

    def admit(
        self, owner: Hashable, adapter: str | None, tokens: Sequence[int], blocks: int, reuse: bool
    ) -> Lease | str:
        """A lease of `blocks` blocks for a request of `tokens` (its prompt and anything
        generated), the cached prefix first; SWAPPING if part of that prefix is being
        swapped in (ask again later), FULL if the pages cannot be had now."""
        self.forget(owner)
        if self.policy == "none":
            pages = self._allocate(blocks, owner, protect=[], keep=adapter)
            return FULL if pages is None else self._grant(Lease(owner, None, [], pages, 0), tokens)
        node = self._base if adapter is None else self.tree.adapter(self._adapters[adapter].key)
        full = (len(tokens) - 1) // self.block_size if reuse else 0
        bs = self.block_size
        matched = self.tree.match(node, [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(full)])
        prefix = leading(matched, DEVICE)
        rest = matched[len(prefix) :]
        if rest and rest[0].where in (TO_DEVICE, TO_HOST):  # in flight: wait for it
            return self._wait(owner, prefix + leading(rest, rest[0].where))
        if rest and rest[0].where == HOST and node.where == DEVICE:
            run = leading(rest, HOST)
            if self._swap_in(run, protect=prefix, keep=adapter):
                return self._wait(owner, prefix + run)
        pages = self._allocate(blocks - len(prefix), owner, protect=prefix, keep=adapter)
        if pages is None:
            return FULL
        now = self._clock()
        for visited in (node, *prefix):
            visited.visits += 1
            visited.last_used = now
        for kv in prefix:
            kv.refs += 1
        return self._grant(Lease(owner, node, prefix, pages, len(prefix) * bs), tokens)

    def grow(self, lease: Lease, count: int) -> bool:
        """`count` more pages at the end of `lease`'s table (its sequence grows), making
        room as `admit` does, and if that is not enough, letting go of what queued
        requests keep for their swap-ins; False (and no change) if they cannot be had."""
        pages = self._allocate(count, lease.owner, protect=[])  # its adapter is held
        if pages is None and self._waiting:  # queued requests' swap-ins give way
            for owner in list(self._waiting):
                self.forget(owner)
            pages = self._allocate(count, lease.owner, protect=[])
        if pages is None:
            return False
        lease.pages.extend(pages)
        return True

    def available(self) -> int:
        """Pages a lease could have now without preempting a request: free ones and
        cached KV that no request reads (idle adapters' pages not counted)."""
        return self.pool.num_free + self.tree.cached_pages()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` tokens in `seconds` (the recompute side of the
        swap-or-drop choice)."""
        self._transfers.observe_prefill(tokens, seconds)

    def forget(self, owner: Hashable) -> None:
        """A queued request no longer waits for the swap-in its last `admit` started (it
        asks again, or leaves, or gives way to a running request's `grow`)."""
        for kv in self._waiting.pop(owner, ()):
            kv.reserved -= 1

    def prefilled(self, lease: Lease, tokens: Sequence[int]) -> None:
        """`tokens`' keys and values are written: cache their full blocks."""
        self._cache(lease, tokens, len(tokens))

    def release(self, lease: Lease, tokens: Sequence[int], written: int) -> None:
        """The request leaves; the first `written` of `tokens` have their KV written."""
        self._cache(lease, tokens, written)
        now = self._clock()
        for kv in lease.nodes:
            kv.refs -= 1
            kv.last_used = now
        self.pool.free(lease.pages)
        lease.nodes, lease.pages = [], []
        self._leases.discard(lease)

    # -- each step --------------------------------------------------------------------------

    def tick(self, rows: int) -> None:
        """Once per step (`rows` running): install finished swaps; every INTERVAL_S, let the
        swapper move nodes between the marks (fastlibra)."""
        self._poll()
        now = self._clock()
        self._batch.add(now, rows)
        if self.policy != "fastlibra" or now - self._last_tick < swapper.INTERVAL_S:
            return
        self._last_tick = now
        if self.pool.usage > swapper.HIGH:
            target = int(self.pool.num_pages * swapper.HIGH)
            self._make_room(self.pool.num_pages - target - self.pool.num_free, evict_adapters=True)
        elif self.pool.usage < swapper.LOW and self.host_used:
            self._fill(int(self.pool.num_pages * swapper.LOW))

    def swap_out(self, pages: int) -> None:
        """Swap out (or drop, without host room) up to `pages` cached KV pages that no
        request reads, least valuable first: an operator's (and a test's) lever."""
        self._make_room(pages)

    def wait(self, timeout: float) -> bool:
        """Block until a swap finishes (or the timeout); True if one did."""
        landed = self._transfers.wait(timeout)
        if landed is not None:
            self._finish(*landed)
        return landed is not None

    @property
    def swapping(self) -> bool:
        return self._transfers.in_flight > 0

    def close(self) -> None:
        self._transfers.close()

    # -- reports ------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        s = self._stats
        return CacheStats(
            policy=self.policy,
            page_bytes=self.pool.page_bytes,
            pages_total=self.pool.num_pages,
            pages_kv=self.pool.used(KV),
            pages_kv_cached=self.tree.cached_pages(),
            pages_lora=self.pool.used(LORA),
            host_bytes_used=self.host_used,
            host_bytes_capacity=self.host_capacity,
            prompt_tokens=s["prompt_tokens"],
            hit_tokens=s["hit_tokens"],
            swaps_out=s["swaps_out"],
            swaps_in=s["swaps_in"],
            swap_out_bytes=s["out_bytes"],
            swap_in_bytes=s["in_bytes"],
            invalid_kv_pages=self.tree.invalid_kv_pages(),
        )

    def held_pages(self) -> int:
        """KV pages that requests hold (their own, and cached ones they read): 0 when none
        runs, whatever stays cached."""
        return self.pool.used(KV) - self.tree.cached_pages()

    def check(self) -> None:
        """Assert the invariants (invariants.py): the tests call it after each operation."""
        check_invariants(self)

    @property
    def leases(self) -> frozenset[Lease]:
        """The leases granted and not yet released."""
        return frozenset(self._leases)

    def pending_host_bytes(self) -> int:
        """Host pool bytes that copies on their way to the host hold."""
        return sum(self.pool.page_bytes for kv in self.tree.kv_nodes() if kv.where == TO_HOST)

    # -- internals --------------------------------------------------------------------------

    def _wait(self, owner: Hashable, path: list[Node]) -> str:
        """SWAPPING, with `path` (the cached prefix and the blocks landing) kept on the
        device for `owner` until it asks again: the swapper must not send back out what
        it is waiting for."""
        for kv in path:
            kv.reserved += 1
        self._waiting[owner] = path
        return SWAPPING

    def _grant(self, lease: Lease, tokens: Sequence[int]) -> Lease:
        self._leases.add(lease)
        self._stats["prompt_tokens"] += len(tokens)
        self._stats["hit_tokens"] += lease.cached_tokens
        return lease

    def _cache(self, lease: Lease, tokens: Sequence[int], written: int) -> None:
        """Move the lease's pages that hold full written blocks into the tree."""
        if lease.adapter is None:
            return
        bs, now = self.block_size, self._clock()
        parent = lease.nodes[-1] if lease.nodes else lease.adapter
        for i in range(len(lease.nodes), written // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            if block in parent.children or not lease.pages or parent.where != DEVICE:
                return  # cached already (another request's copy), or nowhere to hang it
            page = lease.pages.pop(0)
            node = self.tree.add(parent, block, page, now)
            node.refs = 1
            self.pool.transfer([page], node)
            lease.nodes.append(node)
            parent = node

    def _allocate(
        self, count: int, owner: Hashable, protect: list[Node], keep: str | None = None
    ) -> list[int] | None:
        """`count` pages for `owner`, making room if needed (never by moving `protect` or
        evicting adapter `keep`, what the pages are for); None if they cannot be had."""
        for kv in protect:
            kv.refs += 1
        try:
            if self.pool.num_free < count:
                self._make_room(count - self.pool.num_free, evict_adapters=True, keep=keep)
            if self.pool.num_free < count:
                return None
            return self.pool.allocate(count, KV, owner)
        finally:
            for kv in protect:
                kv.refs -= 1

    def _make_room(self, pages: int, evict_adapters: bool = False, keep: str | None = None) -> None:
        """Free `pages` pages by swapping out (or dropping) cached leaves, lowest value
        first (LRU under "lru"); with `evict_adapters`, idle adapters but `keep` compete
        too (not under "lru", whose adapters have their own share)."""
        freed = 0
        while freed < pages:  # a pass ranks the candidates once, then takes them in order
            leaves = self.tree.device_leaves()
            idle = [n for n in self._idle_adapters() if n != keep] if evict_adapters else []
            if not leaves and not idle:
                return
            now, demand = self._clock(), self._demand()
            ranked: list[tuple[float, Node | str]] = [
                (self._score(kv, demand, now), kv) for kv in leaves
            ]
            for name in idle:  # none under "lru"
                a = self._adapters[name]
                node = self.tree.adapter(a.key)
                ranked.append((swapper.evaluate(self._candidate(node, a), demand, now), name))
            ranked.sort(key=lambda r: (r[0], isinstance(r[1], str)))
            for _, chosen in ranked:
                if freed >= pages:
                    return
                if isinstance(chosen, str):  # its KV leaves with it: rank again
                    before = self.pool.num_free
                    assert self._slots is not None
                    self._slots.evict(chosen)
                    freed += self.pool.num_free - before
                    break
                self._swap_out(chosen)  # the other leaves stay leaves
                freed += 1

    def _idle_adapters(self) -> list[str]:
        """Resident adapters that no request holds and no queued request waits on."""
        if self._slots is None or self.policy == "lru":
            return []
        adapters, awaited = self._adapters, self._awaited()
        return [
            n
            for n in self._slots.idle()
            if n in adapters and adapters[n].resident and adapters[n].key not in awaited
        ]

    def _awaited(self) -> set[Hashable]:
        """The adapter keys whose KV queued requests wait to have swapped in."""
        keys: set[Hashable] = set()
        for path in self._waiting.values():
            for kv in path[:1]:
                keys.update(node.key for node in kv.path() if node.kind == "lora")
        return keys

    def _fill(self, target_used: int) -> None:
        """Swap in the most valuable host roots while usage stays at or below the target."""
        now, demand = self._clock(), self._demand()
        while True:
            used = self.pool.num_pages - self.pool.num_free
            roots = self.tree.host_roots()
            if not roots or used + 1 > target_used:
                return
            best = max(roots, key=lambda kv: self._score(kv, demand, now))
            if not self._swap_in([best], protect=[]):
                return

    def _swap_out(self, kv: Node) -> None:
        """Move a device leaf to the host pool (or drop it if the host pool cannot take it);
        its page is free when this returns."""
        assert kv.refs == 0 and kv.where in (DEVICE, TO_DEVICE)
        nbytes = self.pool.page_bytes
        if kv.where == TO_DEVICE:  # called off: its host copy is still there
            self.pool.free([kv.page])
            kv.page, kv.where = -1, HOST
            return
        if not self._transfers.worth_keeping() or not self._host_room(nbytes):
            self.pool.free([kv.page])
            kv.page = -1
            self._drop(kv)
            return
        snapshot = self.device.kv_snapshot([kv.page])
        self.pool.free([kv.page])
        kv.page, kv.where = -1, TO_HOST
        self.host_used += nbytes
        self._transfers.submit(kv, TO_HOST, lambda: self.device.kv_to_host(snapshot))
        self._stats["swaps_out"] += 1
        self._stats["out_bytes"] += nbytes

    def _swap_in(self, run: list[Node], protect: list[Node], keep: str | None = None) -> bool:
        """Start moving host nodes (a parent before its children) to the device, never
        making room by evicting adapter `keep` (theirs); False if the pages cannot be had."""
        # The run is protected too: making room must not drop it from the host pool.
        pages = self._allocate(len(run), ("swap-in",), [*protect, *run], keep=keep)
        if pages is None:
            return False
        for kv, page in zip(run, pages, strict=True):
            self.pool.transfer([page], kv)
            kv.page, kv.where = page, TO_DEVICE
            host = kv.host
            assert host is not None
            self._transfers.submit(kv, TO_DEVICE, functools.partial(self.device.kv_to_device, host))
            self._stats["swaps_in"] += 1
            self._stats["in_bytes"] += host.nbytes
        return True

    def _poll(self) -> None:
        for landed in self._transfers.landed():
            self._finish(*landed)

    def _finish(self, kv: Node, direction: str, result: object) -> None:
        """A copy landed: the node moves where it went (unless dropped meanwhile)."""
        if isinstance(result, BaseException):
            raise RuntimeError(f"a KV swap ({direction}) failed") from result
        nbytes = self.pool.page_bytes
        if kv.where != direction:  # dropped, or a swap-in called off (or landed already)
            return
        if direction == TO_HOST:
            assert isinstance(result, HostBlocks)
            kv.host, kv.where = result, HOST
            self.host_used += result.nbytes - nbytes
        else:
            self.device.kv_restore([kv.page], result)
            assert kv.host is not None
            self.host_used -= kv.host.nbytes
            kv.host, kv.where = None, DEVICE

    def _host_room(self, nbytes: int) -> bool:
        """Make room in the host pool for `nbytes` by dropping its least valuable leaves."""
        if nbytes > self.host_capacity:
            return False
        now, demand = self._clock(), self._demand()
        while self.host_used + nbytes > self.host_capacity:
            leaves = self.tree.host_leaves()
            if not leaves:
                return False
            self._drop(min(leaves, key=lambda kv: self._score(kv, demand, now)))
        return True

    def _drop(self, kv: Node) -> None:
        """Forget a node and its subtree (none of it on the device)."""
        for node in [kv, *self.tree.kv_nodes(kv)]:
            assert node.refs == 0 and node.page == -1, "dropping a node in use"
            if node.host is not None:  # in the host pool, or on its way from it
                self.host_used -= node.host.nbytes
            elif node.where == TO_HOST:
                self.host_used -= self.pool.page_bytes
            node.host, node.where = None, GONE
        self.tree.remove(kv)

    def _demand(self) -> swapper.Demand:
        adapters = [a for a in self.tree.adapters() if a is not self._base]
        return swapper.Demand(
            link_bytes_per_s=self._transfers.bytes_per_s,
            total_visits=sum(a.visits for a in self.tree.adapters()),
            adapter_visits=[a.visits for a in adapters],
            batch=self._batch.mean(),
            now_lora=sum(1 for a in adapters if a.where == DEVICE),
        )

    def _score(self, kv: Node, demand: swapper.Demand, now: float) -> float:
        """A cached block's worth on the device: its last use under "lru", else Eq. 6."""
        if self.policy == "lru":
            return kv.last_used
        return swapper.evaluate(self._candidate(kv), demand, now)

    def _candidate(self, node: Node, adapter: _Adapter | None = None) -> swapper.Candidate:
        nbytes = adapter.device_bytes if adapter is not None else self.pool.page_bytes
        return swapper.Candidate(node, adapter is not None, nbytes, node.visits, node.last_used)
