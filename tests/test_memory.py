"""jlora/engine/memory: FastLibra's cost model on tiny hand-computed cases, the manager's prefix
cache and swaps against a fake device whose pages hold checkable content, then a
hypothesis state machine per cache policy that interleaves adapters coming and going,
requests, swaps and ticks under the manager's invariants.

The fake device's page content is (adapter key, the tokens up to the page's last
written position): a KV block depends on its adapter and on its whole prefix, so a
cached block that lands in the wrong page, a swap that brings back the wrong block,
or a request that reuses another adapter's KV all show up as a content mismatch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jlora.engine.device_api import HostBlocks
from jlora.engine.memory import swapper
from jlora.engine.memory.manager import FULL, SWAPPING, MemoryManager
from jlora.engine.memory.pool import LORA
from jlora.engine.memory.tree import BASE, DEVICE, HOST, TO_DEVICE, TO_HOST, Lease, Node
from jlora.engine.slots import SlotManager

PAGE_BYTES = 100
BLOCK_SIZE = 2
LINK_BYTES_PER_S = 1000.0  # a page takes 0.1 s: Eq. 5's cost_i of one KV block


def decay(idle_s: float) -> float:
    """Eq. 5's recency factor, 1 - sigmoid(t), written out for the hand computations."""
    return 1.0 - 1.0 / (1.0 + math.exp(-idle_s))


# -- the swapper's cost model (Eqs. 3-6) ------------------------------------------------------


def test_low_lora_is_the_expected_number_of_adapters_in_a_batch():
    # Eq. 3, BS = 2: (1 - 0.5²) + 2 · (1 - 0.75²) = 0.75 + 0.4375 + 0.4375 (exact in binary)
    assert swapper.low_lora([0.5, 0.25, 0.25], 2) == 0.75 + 0.4375 + 0.4375 == 1.625
    # One request needs one adapter: the probabilities themselves, summing to 1.
    assert swapper.low_lora([0.5, 0.25, 0.25], 1) == 1.0
    # An adapter nobody used adds nothing; one every request used adds exactly 1.
    assert swapper.low_lora([0.0, 1.0], 7) == 1.0


def test_lora_eval_rewards_loading_adapters_up_to_low_lora():
    assert swapper.lora_eval(1.625, 1) == 1.625  # max(1, 1.625 / 1)
    assert swapper.lora_eval(3.0, 2) == 1.5  # max(1, 3 / 2)
    assert swapper.lora_eval(1.625, 2) == 1.0  # max(1, 0.8125): enough adapters loaded
    assert swapper.lora_eval(1.625, 0) == 1.625  # none loaded: Low_lora itself


def test_retain_eval_is_cost_times_probability_times_recency():
    assert swapper.retain_eval(2.0, 0.5, 0.0) == 2.0 * 0.5 * 0.5  # sigmoid(0) = 1/2
    # sigmoid(ln 3) = 1 / (1 + 1/3) = 3/4: a quarter of the value is left
    assert swapper.retain_eval(4.0, 0.25, math.log(3.0)) == pytest.approx(4.0 * 0.25 * 0.25)
    assert swapper.retain_eval(4.0, 0.0, 0.0) == 0.0  # never visited
    assert swapper.retain_eval(4.0, 1.0, 1e6) == 0.0  # idle for ever (no overflow)


# Eq. 3's inputs: 8 requests, adapters used 4, 2, 2 times (probs 0.5, 0.25, 0.25), BS 2:
# Low_lora = 1.625 (above); with one adapter on the device Eq. 4 gives 1.625.
DEMAND = swapper.Demand(
    link_bytes_per_s=1000.0, total_visits=8, adapter_visits=[4, 2, 2], batch=2.0, now_lora=1
)
NOW = 10.0


def test_evaluate_a_kv_node_and_an_adapter():
    kv = swapper.Candidate("kv", False, nbytes=500, visits=2, last_used=NOW - math.log(3.0))
    # cost 500 / 1000 = 0.5 s, prob 2/8, decay(ln 3) = 1/4, no Eq. 4 factor for KV
    assert swapper.evaluate(kv, DEMAND, NOW) == pytest.approx(0.5 * 0.25 * 0.25)
    adapter = swapper.Candidate("a", True, nbytes=2000, visits=4, last_used=NOW)
    # cost 2 s, prob 4/8, decay(0) = 1/2, times LoRA_Eval = 1.625 / 1
    assert swapper.evaluate(adapter, DEMAND, NOW) == pytest.approx(2.0 * 0.5 * 0.5 * 1.625)
    two_loaded = dataclasses.replace(DEMAND, now_lora=2)  # max(1, 1.625 / 2) = 1
    assert swapper.evaluate(adapter, two_loaded, NOW) == pytest.approx(2.0 * 0.5 * 0.5)


def test_order_follows_eval_and_eq4_can_lift_an_adapter_above_a_kv_node():
    cold = swapper.Candidate("cold", False, nbytes=1000, visits=1, last_used=NOW - 10.0)
    mid = swapper.Candidate("mid", False, nbytes=1000, visits=2, last_used=NOW - math.log(3.0))
    hot = swapper.Candidate("hot", False, nbytes=2400, visits=4, last_used=NOW)
    adapter = swapper.Candidate("adapter", True, nbytes=2000, visits=4, last_used=NOW)
    evals = {
        "cold": 1.0 * (1 / 8) * decay(10.0),  # 5.7e-6
        "mid": 1.0 * (2 / 8) * 0.25,  # 0.0625
        "hot": 2.4 * (4 / 8) * 0.5,  # 0.6
        "adapter": 2.0 * (4 / 8) * 0.5 * 1.625,  # 0.8125 with Eq. 4's reward, 0.5 without
    }
    assert evals["cold"] < evals["mid"] < evals["hot"] < evals["adapter"]
    candidates = [adapter, hot, cold, mid]

    def names(ordered: list[swapper.Candidate]) -> list[object]:
        return [c.ref for c in ordered]

    assert names(swapper.order(candidates, DEMAND, NOW, ascending=True)) == [
        "cold",
        "mid",
        "hot",
        "adapter",
    ]
    assert names(swapper.order(candidates, DEMAND, NOW, ascending=False)) == [
        "adapter",
        "hot",
        "mid",
        "cold",
    ]
    # Two adapters on the device: no reward, 0.5 < 0.6, the adapter goes before the KV.
    two_loaded = dataclasses.replace(DEMAND, now_lora=2)
    assert names(swapper.order(candidates, two_loaded, NOW, ascending=True)) == [
        "cold",
        "mid",
        "adapter",
        "hot",
    ]


def test_order_breaks_ties_by_least_recent_use():
    newer = swapper.Candidate("newer", False, 1000, visits=0, last_used=5.0)
    older = swapper.Candidate("older", False, 1000, visits=0, last_used=3.0)
    never = [newer, older]
    for ascending in (True, False):  # Eval 0 for both (never visited)
        ordered = swapper.order(never, DEMAND, NOW, ascending=ascending)
        assert [c.ref for c in ordered] == ["older", "newer"]


def test_batch_window_is_the_mean_over_the_last_five_seconds():
    window = swapper.BatchWindow()
    assert window.mean() == 1.0  # no samples yet: one request
    window.add(0.0, 4)
    window.add(3.0, 2)
    window.add(6.0, 6)  # the sample at 0 s falls out of (1 s, 6 s]
    assert window.mean() == (2 + 6) / 2
    idle = swapper.BatchWindow()
    idle.add(0.0, 0)
    assert idle.mean() == 1.0  # never below one


# -- a fake device, a fake clock ----------------------------------------------------------------


class FakeClock:
    """The manager's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeDevice:
    """The KV calls of a DeviceEngine over `pages` (page -> content, see the module
    docstring), one block per swap as the manager makes them; and an adapter load/install
    pair for a SlotManager (slot -> adapter)."""

    def __init__(self) -> None:
        self.pages: dict[int, object] = {}
        self.slots: dict[int, str] = {}

    def write(self, table: list[int], key: Hashable, tokens: list[int], start: int, end: int):
        """Write the KV of positions [start, end) of `tokens` into the blocks of `table`;
        returns page -> its new content."""
        written = {}
        for block in range(start // BLOCK_SIZE, math.ceil(end / BLOCK_SIZE)):
            content = (key, tuple(tokens[: min(end, (block + 1) * BLOCK_SIZE)]))
            self.pages[table[block]] = written[table[block]] = content
        return written

    def kv_snapshot(self, blocks: list[int]) -> object:
        (page,) = blocks
        return self.pages[page]

    def kv_to_host(self, snapshot: object) -> HostBlocks:
        return HostBlocks(count=1, nbytes=PAGE_BYTES, data=snapshot)

    def kv_to_device(self, host: HostBlocks) -> object:
        assert host.count == 1 and host.nbytes == PAGE_BYTES
        return host.data

    def kv_restore(self, blocks: list[int], staged: object) -> None:
        (page,) = blocks
        self.pages[page] = staged

    def load_adapter(self, name: str, slot: int, pages: list[int] | None = None) -> str:
        """Writes the adapter into its pages, as an engine whose adapters live in the
        KV cache does (a KV write into them would show)."""
        for page in pages or ():
            self.pages[page] = ("lora", name)
        return name

    def install_adapter(self, name: str, slot: int, payload: object) -> None:
        assert payload == name
        self.slots[slot] = name


def content_of(node: Node) -> tuple[Hashable, tuple[int, ...]]:
    """What the page of a cached KV node must hold: its adapter's key, its path's tokens."""
    path = list(node.path())
    adapter = path[-1]
    assert adapter.kind == "lora"
    return adapter.key, tuple(t for kv in reversed(path[:-1]) for t in kv.key)


class Harness:
    """A manager over a FakeDevice and a FakeClock; `serve` and `finish` run a request's
    KV as the orchestrator does (admit, prefill, release)."""

    def __init__(
        self, policy: str, num_pages: int, host_pages: int, max_loras: int = 0, max_rank: int = 8
    ) -> None:
        self.clock = FakeClock()
        self.device = FakeDevice()
        self.manager = MemoryManager(
            policy=policy,
            device=self.device,  # type: ignore[arg-type]
            num_pages=num_pages,
            page_bytes=PAGE_BYTES,
            block_size=BLOCK_SIZE,
            host_bytes=host_pages * PAGE_BYTES,
            # the "lru" policy's static share: max_loras slots at max_rank, PAGE_BYTES a rank 8
            lora_slots=max_loras,
            lora_slot_bytes=PAGE_BYTES * max_rank // 8,
            link_bytes_per_s=LINK_BYTES_PER_S,
            clock=self.clock,
        )
        self.keys: dict[str | None, Hashable] = {None: BASE}
        self._owners = 0

    def adapter(self, name: str, key: Hashable) -> None:
        """Register `name` (one page of rank rows) and put it on the device."""
        self.manager.register(name, key, PAGE_BYTES)
        assert self.manager.reserve(name)
        self.keys[name] = key

    def admit(
        self, adapter: str | None, tokens: list[int], blocks: int | None = None
    ) -> Lease | str:
        self._owners += 1
        blocks = math.ceil(len(tokens) / BLOCK_SIZE) if blocks is None else blocks
        return self.manager.admit(f"r{self._owners}", adapter, tokens, blocks, True)

    def serve(self, adapter: str | None, tokens: list[int], blocks: int | None = None) -> Lease:
        """Admit (it must get a lease) and prefill `tokens`."""
        lease = self.admit(adapter, tokens, blocks)
        assert isinstance(lease, Lease), lease
        self.write(lease, adapter, tokens, lease.cached_tokens, len(tokens))
        self.manager.prefilled(lease, tokens)
        return lease

    def write(self, lease: Lease, adapter: str | None, tokens: list[int], start: int, end: int):
        self.device.write(lease.table, self.keys[adapter], tokens, start, end)

    def finish(self, lease: Lease, tokens: list[int], written: int | None = None) -> None:
        self.manager.release(lease, tokens, len(tokens) if written is None else written)

    def cache(self, adapter: str | None, tokens: list[int]) -> list[Node]:
        """Serve and finish a request; returns the nodes it read or cached."""
        lease = self.serve(adapter, tokens)
        nodes = list(lease.nodes)
        self.finish(lease, tokens)
        return nodes

    def cached(self, blocks: list[tuple[int, ...]]) -> list[Node]:
        """The base model's cached nodes along `blocks` (wherever they are)."""
        return self.manager.tree.match(self.manager.tree.adapter(BASE), blocks)

    def settle(self) -> None:
        """Land every swap under way."""
        while self.manager.swapping:
            assert self.manager.wait(5.0), "a swap never finished"

    def assert_holds(self, nodes: list[Node]) -> None:
        """The nodes are on the device and their pages hold their blocks."""
        for node in nodes:
            assert node.where == DEVICE
            assert self.device.pages[node.page] == content_of(node)


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(
        policy: str = "fastlibra", num_pages: int = 8, host_pages: int = 16, max_loras: int = 0
    ) -> Harness:
        made.append(Harness(policy, num_pages, host_pages, max_loras))
        return made[-1]

    yield build
    for harness in made:
        harness.manager.close()


# -- the manager ------------------------------------------------------------------------------


def test_a_prefix_hit_reads_the_cached_nodes(make):
    mem = make()
    first = mem.serve(None, [1, 2, 3, 4, 5])  # 3 blocks; its 2 full ones are cached
    assert first.cached_tokens == 0 and [n.key for n in first.nodes] == [(1, 2), (3, 4)]
    cached = list(first.nodes)
    table = first.table
    mem.finish(first, [1, 2, 3, 4, 5])
    assert mem.manager.pool.num_free == 8 - 2  # the partial block's page is freed
    second = mem.admit(None, [1, 2, 3, 4, 5, 6, 7], blocks=4)
    assert isinstance(second, Lease)
    assert second.nodes == cached and second.cached_tokens == 4
    assert second.table[:2] == table[:2]
    mem.assert_holds(cached)
    assert [mem.device.pages[page] for page in second.table[:2]] == [
        (BASE, (1, 2)),
        (BASE, (1, 2, 3, 4)),
    ]
    stats = mem.manager.stats()
    assert (stats.prompt_tokens, stats.hit_tokens) == (5 + 7, 4)
    assert all(n.refs == 1 for n in cached)
    mem.manager.check()


def test_a_prefix_ending_mid_block_reuses_its_full_blocks_only(make):
    mem = make()
    mem.cache(None, [1, 2, 3, 4, 5])
    mid = mem.admit(None, [1, 2, 3, 9, 9])  # blocks (1, 2), (3, 9): only the first is cached
    assert isinstance(mid, Lease) and mid.cached_tokens == 2
    assert [n.key for n in mid.nodes] == [(1, 2)]
    # A prefill computes at least one token: a prompt of exactly the cached blocks reuses
    # all but the block of its last token.
    exact = mem.admit(None, [1, 2, 3, 4])
    assert isinstance(exact, Lease) and exact.cached_tokens == 2
    mem.manager.check()


def test_adapters_share_kv_by_content_only(make):
    mem = make(num_pages=12)
    mem.adapter("a", "ka")
    mem.adapter("a2", "ka")  # the same weights under another name
    mem.adapter("b", "kb")
    mem.cache("a", [1, 2, 3])
    other = mem.admit("b", [1, 2, 3])
    base = mem.admit(None, [1, 2, 3])
    same = mem.admit("a2", [1, 2, 3])
    assert isinstance(other, Lease) and other.cached_tokens == 0
    assert isinstance(base, Lease) and base.cached_tokens == 0
    assert isinstance(same, Lease) and same.cached_tokens == 2
    assert mem.device.pages[same.table[0]] == ("ka", (1, 2))
    mem.manager.check()


def test_base_model_requests_share_among_themselves(make):
    mem = make()
    mem.adapter("a", "ka")
    mem.cache(None, [4, 4, 4])
    again = mem.admit(None, [4, 4, 7])
    assert isinstance(again, Lease) and again.cached_tokens == 2
    assert mem.device.pages[again.table[0]] == (BASE, (4, 4))
    with_adapter = mem.admit("a", [4, 4, 4])
    assert isinstance(with_adapter, Lease) and with_adapter.cached_tokens == 0


def test_release_caches_the_full_written_blocks(make):
    mem = make()
    prompt = [1, 2, 3]
    lease = mem.serve(None, prompt, blocks=4)  # room for 8 tokens
    assert [n.key for n in lease.nodes] == [(1, 2)]
    tokens = [*prompt, 4, 5, 6, 7]  # 4 generated; the newest one's KV is not written
    mem.write(lease, None, tokens, len(prompt), 6)
    mem.finish(lease, tokens, written=6)
    nodes = mem.cached([(1, 2), (3, 4), (5, 6)])
    assert [n.key for n in nodes] == [(1, 2), (3, 4), (5, 6)]
    mem.assert_holds(nodes)
    assert mem.manager.pool.num_free == 8 - 3
    assert mem.manager.stats().pages_kv_cached == 3
    # Written up to mid-block: that block is not cached.
    short = mem.serve(None, [8, 8, 8], blocks=3)
    mem.write(short, None, [8, 8, 8, 9, 9], 3, 4)
    mem.finish(short, [8, 8, 8, 9, 9], written=4)
    assert [n.key for n in mem.cached([(8, 8), (8, 9), (9,)])] == [(8, 8), (8, 9)]
    assert mem.manager.pool.num_free == 8 - 5
    mem.manager.check()


def test_the_none_policy_caches_nothing(make):
    mem = make("none", num_pages=6)
    lease = mem.serve(None, [1, 2, 3, 4, 5])
    assert lease.nodes == [] and len(lease.pages) == 3
    mem.finish(lease, [1, 2, 3, 4, 5])
    assert mem.manager.pool.num_free == 6 and list(mem.manager.tree.kv_nodes()) == []
    again = mem.admit(None, [1, 2, 3, 4, 5])
    assert isinstance(again, Lease) and again.cached_tokens == 0
    assert mem.manager.stats().hit_tokens == 0
    mem.manager.check()


@pytest.mark.parametrize("policy, victim", [("fastlibra", "y"), ("lru", "x")])
def test_demand_eviction_swaps_a_leaf_out_and_back_with_its_content(make, policy, victim):
    mem = make(policy, num_pages=4)
    (x,) = mem.cache(None, [1, 1, 9])  # at 0 s
    mem.clock.now = 1.0
    for _ in range(3):  # x is hit three times, last used at 1 s
        mem.cache(None, [1, 1, 5])
    mem.clock.now = 2.0
    (y,) = mem.cache(None, [2, 2, 9])  # used once, at 2 s
    mem.clock.now = 3.0
    # 5 requests so far, x visited 4 times, y once; a page takes 0.1 s:
    eval_x = 0.1 * (4 / 5) * decay(3.0 - 1.0)  # 0.0095
    eval_y = 0.1 * (1 / 5) * decay(3.0 - 2.0)  # 0.0054: lowest, though the more recent
    assert eval_y < eval_x
    big = mem.admit(None, [3, 3, 3, 3, 3], blocks=3)  # 2 pages free: one leaf must go
    assert isinstance(big, Lease)
    out, kept = (y, x) if victim == "y" else (x, y)
    assert out.where in (TO_HOST, HOST) and out.page == -1
    mem.assert_holds([kept])
    mem.manager.check()
    mem.write(big, None, [3, 3, 3, 3, 3], 0, 5)  # overwrites the page the victim had
    mem.finish(big, [3, 3, 3, 3, 3], written=0)
    mem.settle()
    assert out.where == HOST and out.host is not None and out.host.data == content_of(out)

    mem.clock.now = 4.0
    prompt = [*out.key, 7]
    assert mem.admit(None, prompt) == SWAPPING
    assert out.where == TO_DEVICE
    mem.manager.check()
    assert mem.admit(None, prompt) == SWAPPING  # still on its way
    mem.settle()
    lease = mem.admit(None, prompt)
    assert isinstance(lease, Lease) and lease.nodes == [out] and lease.cached_tokens == 2
    mem.assert_holds([out])
    stats = mem.manager.stats()
    assert (stats.swaps_out, stats.swaps_in) == (1, 1)
    assert (stats.swap_out_bytes, stats.swap_in_bytes) == (PAGE_BYTES, PAGE_BYTES)
    assert stats.host_bytes_used == 0
    mem.manager.check()


def test_a_chain_swaps_out_deepest_first_and_back_in_as_one_run(make):
    mem = make(num_pages=4)
    nodes = mem.cache(None, [1, 2, 3, 4, 5, 6, 7])  # (1, 2) -> (3, 4) -> (5, 6)
    filler = mem.admit(None, [9] * 8, blocks=4)  # takes every page: the chain leaves
    assert isinstance(filler, Lease)
    assert [n.where for n in nodes] == [TO_HOST] * 3
    mem.write(filler, None, [9] * 8, 0, 8)
    mem.finish(filler, [9] * 8, written=0)
    mem.settle()
    assert mem.admit(None, [1, 2, 3, 4, 5, 6, 7, 8]) == SWAPPING
    assert [n.where for n in nodes] == [TO_DEVICE] * 3  # a parent lands before its child
    mem.manager.check()
    mem.settle()
    lease = mem.admit(None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert isinstance(lease, Lease) and lease.nodes == nodes and lease.cached_tokens == 6
    mem.assert_holds(nodes)
    mem.manager.check()


def test_the_host_pool_drops_its_least_valuable_leaves(make):
    mem = make(num_pages=3, host_pages=1)
    nodes = []
    for second, token in enumerate((1, 2, 3)):
        mem.clock.now = float(second)
        nodes += mem.cache(None, [token, token])
    x, y, z = nodes
    mem.clock.now = 3.0
    first = mem.admit(None, [4, 4])  # x is the least valuable device leaf
    assert isinstance(first, Lease) and x.where == TO_HOST
    mem.settle()
    mem.clock.now = 4.0
    second = mem.admit(None, [5, 5])  # y goes; the host pool drops x for it
    assert isinstance(second, Lease)
    assert x.where == "gone" and mem.cached([(1, 1)]) == []
    mem.settle()
    assert y.where == HOST and mem.manager.host_used == PAGE_BYTES
    mem.assert_holds([z])
    mem.manager.check()
    mem.finish(first, [4, 4], written=0)
    mem.finish(second, [5, 5], written=0)
    forgotten = mem.admit(None, [1, 1, 7])  # no swap: x is gone
    assert isinstance(forgotten, Lease) and forgotten.cached_tokens == 0


def test_no_host_pool_drops_what_is_swapped_out(make):
    mem = make(num_pages=1, host_pages=0)
    (x,) = mem.cache(None, [1, 1])
    lease = mem.admit(None, [2, 2])
    assert isinstance(lease, Lease) and x.where == "gone"
    assert mem.manager.stats().swaps_out == 0 and mem.manager.host_used == 0
    mem.manager.check()


def test_a_swap_in_keeps_its_blocks_when_the_host_pool_is_full(make):
    """A swap-in that must swap a device leaf out for pages must not have the host pool
    drop the very blocks it brings in (it made room by dropping them, then read their
    host copy: an AssertionError)."""
    mem = make(num_pages=2, host_pages=1)
    (x,) = mem.cache(None, [1, 1, 9])
    filler = mem.admit(None, [8, 8, 8], blocks=2)
    assert isinstance(filler, Lease) and x.where == TO_HOST
    mem.finish(filler, [8, 8, 8], written=0)
    mem.settle()
    mem.clock.now = 100.0  # x has lost all its value; the new chain has it all
    chain = mem.cache(None, [7, 7, 8, 8])  # the pool is full of it
    assert mem.admit(None, [1, 1, 5]) == SWAPPING
    assert x.where == TO_DEVICE and chain[1].where == "gone"  # the host pool was full
    mem.settle()
    lease = mem.admit(None, [1, 1, 5])
    assert isinstance(lease, Lease) and lease.nodes == [x]
    mem.assert_holds([x])
    assert chain[0].where == TO_HOST  # the lease's own page: the host pool has room again
    mem.manager.check()


def test_a_swap_in_never_evicts_the_adapter_it_is_for(make):
    """Between its slot request and its hold, a request's adapter is idle: the pages for
    swapping its prefix in must not come from evicting it (its KV, protected for the
    swap-in, would be swapped out: an AssertionError; or the run would land under an
    adapter that left: invalid KV)."""
    mem = make(num_pages=4)
    idle: list[str] = []  # the slot manager's idle adapters

    class Slots:
        def idle(self) -> list[str]:
            return list(idle)

        def evict(self, name: str) -> bool:
            idle.remove(name)
            mem.manager.released(name)
            return True

    mem.manager.attach(Slots())
    mem.adapter("a", "ka")
    nodes = mem.cache("a", [1, 1, 2, 2, 9])  # (1, 1) -> (2, 2), and a's page: 3 used
    filler = mem.admit(None, [5, 5, 5], blocks=2)
    assert isinstance(filler, Lease) and nodes[1].where == TO_HOST
    mem.settle()
    idle.append("a")
    assert mem.admit("a", [1, 1, 2, 2, 7]) == FULL  # the only page to take is a's own
    assert idle == ["a"] and mem.manager.tree.invalid_kv_pages() == 0
    assert [n.where for n in nodes] == [DEVICE, HOST]
    mem.manager.check()
    mem.finish(filler, [5, 5, 5], written=0)
    assert mem.admit("a", [1, 1, 2, 2, 7]) == SWAPPING
    mem.settle()
    lease = mem.admit("a", [1, 1, 2, 2, 7])
    assert isinstance(lease, Lease) and lease.nodes == nodes
    mem.assert_holds(nodes)
    mem.manager.check()


@pytest.mark.parametrize("policy", ["fastlibra", "lru"])
def test_an_adapter_leaves_after_its_kv_under_fastlibra_only(make, policy):
    mem = make(policy, num_pages=9, max_loras=1)  # "lru": a page of static share
    mem.adapter("a", "ka")
    nodes = mem.cache("a", [1, 2, 3, 4, 5])
    mem.manager.released("a")
    if policy == "fastlibra":
        assert [n.where for n in nodes] == [TO_HOST, TO_HOST]
        assert mem.manager.tree.invalid_kv_pages() == 0 and mem.manager.pool.used(LORA) == 0
    else:  # vLLM's: the KV stays behind, invalid until the adapter is back
        assert [n.where for n in nodes] == [DEVICE, DEVICE]
        assert mem.manager.tree.invalid_kv_pages() == 2 == mem.manager.stats().invalid_kv_pages
    mem.manager.check()
    mem.settle()
    assert mem.manager.reserve("a")
    if policy == "fastlibra":
        assert mem.admit("a", [1, 2, 3, 4, 5, 6]) == SWAPPING
        mem.settle()
    assert mem.manager.tree.invalid_kv_pages() == 0
    lease = mem.admit("a", [1, 2, 3, 4, 5, 6])
    assert isinstance(lease, Lease) and lease.nodes == nodes and lease.cached_tokens == 4
    mem.assert_holds(nodes)
    mem.manager.check()


def test_the_marks_leave_usage_between_them_alone(make):
    """Above HIGH (95% of 20 pages: more than 19 used) the swapper swaps out down to 19;
    below LOW (fewer than 14 used) it swaps in up to 14, never above; in between, and on
    the tick after a move, nothing moves: no ping-pong."""
    num_pages = 20
    mem = make(num_pages=num_pages, host_pages=32)
    manager = mem.manager
    for token in range(1, 17):
        mem.cache(None, [token, token])  # 16 one-block prefixes: 80%, between the marks
    high, low = int(num_pages * swapper.HIGH), int(num_pages * swapper.LOW)
    assert (high, low) == (19, 14)

    def used() -> int:
        return num_pages - manager.pool.num_free

    def tick() -> tuple[int, int, int]:
        """One periodic tick; returns (pages used before, swaps out, swaps in) it made."""
        before, stats = used(), manager.stats()
        mem.clock.now += 1.0
        manager.tick(rows=1)
        mem.settle()
        after = manager.stats()
        return before, after.swaps_out - stats.swaps_out, after.swaps_in - stats.swaps_in

    for cycle in range(6):
        before, out, into = tick()
        assert (out, into) == (0, 0) and used() == before  # between the marks
        lease = mem.admit(None, [100 + cycle], blocks=manager.pool.num_free)  # 100% used
        assert isinstance(lease, Lease)
        assert tick() == (20, 1, 0) and used() == high  # down to the high mark exactly
        assert tick() == (high, 0, 0)  # at the mark: nothing more
        mem.finish(lease, [100 + cycle], written=0)
        before, out, into = tick()
        assert out == 0
        if before < low:
            assert into == low - before and used() == low  # up to the low mark, not above
        else:
            assert into == 0 and used() == before
        assert tick()[1:] == (0, 0)  # the tick after a move moves nothing
        manager.check()
    # 16 cached, then 15, 14, 13 -> 14 (and 13 -> 14 in every later cycle)
    assert (manager.stats().swaps_out, manager.stats().swaps_in) == (6, 4)
    assert manager.tree.invalid_kv_pages() == 0
    mem.assert_holds([n for n in manager.tree.kv_nodes() if n.where == DEVICE])


# -- a state machine per policy -------------------------------------------------------------


class InlineExecutor:
    """Runs each job when it is submitted: swaps and loads finish at once but still land
    only at the next tick, wait or poll, and the machine stays deterministic."""

    def submit(self, job: Callable[..., object], *args: object) -> Future:
        future: Future = Future()
        try:
            future.set_result(job(*args))
        except Exception as error:
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


def run_inline(*owners: MemoryManager | SlotManager) -> None:
    """The owners' background copies run at once, on the caller's thread (the memory
    manager's are its transfers')."""
    for owner in owners:
        runner = owner._transfers if isinstance(owner, MemoryManager) else owner
        runner._executor.shutdown()
        runner._executor = InlineExecutor()  # type: ignore[assignment]


ADAPTERS = {  # name: (content key, device bytes, rank); a and a2 are the same weights
    "a": ("ka", PAGE_BYTES, 8),
    "a2": ("ka", PAGE_BYTES, 8),
    "b": ("kb", 2 * PAGE_BYTES, 16),
}
ALPHABET = (1, 2)
# A few common heads (chains of 1 to 3 blocks, two of them branching) and a short tail:
# prompts share prefixes all the time.
HEADS = ((1, 1), (1, 1, 2, 2), (1, 1, 2, 2, 1, 1), (1, 1, 2, 1), (2, 1))
adapter_names = st.sampled_from(sorted(ADAPTERS))
prompts = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from(HEADS),
    st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3),
)
picks = st.integers(0, 7)


@dataclasses.dataclass(eq=False)
class Running:
    """A request holding a lease, as the machine expects it to stay."""

    lease: Lease
    adapter: str | None
    key: Hashable
    tokens: list[int]
    limit: int
    written: int  # positions whose KV is written
    table: list[int]  # the lease's table: it only grows (lazily, as the sequence does)
    expected: dict[int, object]  # page -> the content it must hold
    prefilled: bool = False


class MemoryMachine(RuleBasedStateMachine):
    """Adapters registered, loaded by a real SlotManager and evicted; requests admitted,
    prefilled, decoded and finished; swaps forced and landed; ticks. After every step:
    the manager's own check, the invalid-KV count, every cached block's content, and the
    pages of every running request untouched."""

    POLICY = "fastlibra"

    @initialize(
        num_pages=st.integers(8, 16), host_pages=st.integers(0, 6), num_slots=st.integers(1, 2)
    )
    def start(self, num_pages: int, host_pages: int, num_slots: int) -> None:
        harness = Harness(self.POLICY, num_pages, host_pages, max_loras=num_slots, max_rank=16)
        self.clock, self.device, self.manager = harness.clock, harness.device, harness.manager
        self.slots = SlotManager(
            num_slots, self.device.load_adapter, self.device.install_adapter, memory=self.manager
        )
        run_inline(self.manager, self.slots)
        self.manager.attach(self.slots)
        self.registered: set[str] = set()
        self.running: dict[int, Running] = {}
        self.waiting: dict[int, tuple[str | None, list[int], int, bool]] = {}
        self.owners = 0

    # -- rules ----------------------------------------------------------------------------

    @rule(name=adapter_names)
    def register(self, name: str) -> None:
        if name not in self.registered:
            key, nbytes, _ = ADAPTERS[name]
            self.manager.register(name, key, nbytes)
            self.registered.add(name)

    @rule(
        adapter=st.none() | adapter_names,
        prompt=prompts,
        max_new=st.integers(0, 3),
        reuse=st.booleans(),
        land_now=st.booleans(),
        prefill_now=st.booleans(),
    )
    def request(
        self,
        adapter: str | None,
        prompt: list[int],
        max_new: int,
        reuse: bool,
        land_now: bool,
        prefill_now: bool,
    ) -> None:
        """A new request; with `prefill_now`, prefilled in the same step (as the
        orchestrator does), else left admitted for a later `prefill`."""
        if adapter is not None and adapter not in self.registered:
            return
        self.owners += 1
        self.admit(self.owners, adapter, prompt, len(prompt) + max_new, reuse, land_now)
        if prefill_now and self.owners in self.running:
            self.prefill_run(self.running[self.owners], ALPHABET[0])

    @precondition(lambda self: self.waiting)
    @rule(pick=picks)
    def retry(self, pick: int) -> None:
        """A request whose cached prefix was swapping in asks again."""
        owner = sorted(self.waiting)[pick % len(self.waiting)]
        self.admit(owner, *self.waiting.pop(owner), land_now=False)

    @precondition(lambda self: any(not r.prefilled for r in self.running.values()))
    @rule(pick=picks, token=st.sampled_from(ALPHABET))
    def prefill(self, pick: int, token: int) -> None:
        waiting = [r for r in self.running.values() if not r.prefilled]
        self.prefill_run(self.pick(waiting, pick), token)

    @precondition(lambda self: any(r.prefilled for r in self.running.values()))
    @rule(pick=picks, token=st.sampled_from(ALPHABET))
    def decode(self, pick: int, token: int) -> None:
        runs = [r for r in self.running.values() if r.prefilled and len(r.tokens) < r.limit]
        if runs:
            run = self.pick(runs, pick)
            need = (len(run.tokens) - 1) // BLOCK_SIZE + 1  # the block of the next write
            if len(run.table) < need:
                if not self.manager.grow(run.lease, need - len(run.table)):
                    assert run.lease.table == run.table, "a failed grow changed the lease"
                    self.release(run)  # the orchestrator preempts it
                    return
                assert run.lease.table[: len(run.table)] == run.table
                assert len(run.lease.table) == need
                run.table = list(run.lease.table)
            self.write(run, len(run.tokens) - 1, len(run.tokens))
            run.tokens.append(token)

    @precondition(lambda self: self.running)
    @rule(pick=picks)
    def finish(self, pick: int) -> None:
        self.release(self.pick(list(self.running.values()), pick))

    def release(self, run: Running) -> None:
        self.manager.release(run.lease, run.tokens, run.written)
        if run.adapter is not None:
            self.slots.release(run.adapter)
        del self.running[next(o for o, r in self.running.items() if r is run)]

    @rule(pages=st.integers(1, 4), adapters=st.booleans())
    def swap_out(self, pages: int, adapters: bool) -> None:
        """Demand for pages: cached leaves (and under fastlibra idle adapters) make room."""
        self.manager._make_room(pages, evict_adapters=adapters and self.POLICY == "fastlibra")

    @rule()
    def land(self) -> None:
        self.land_swaps()

    @rule(seconds=st.sampled_from([0.0, 0.05, 0.1, 2.0, 30.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        swaps_in = self.manager.stats().swaps_in
        self.manager.tick(len(self.running))
        if self.manager.stats().swaps_in > swaps_in:
            pool = self.manager.pool
            assert pool.num_pages - pool.num_free <= int(pool.num_pages * swapper.LOW)
        self.slots.poll()

    @rule(name=adapter_names)
    def evict(self, name: str) -> None:
        held = any(r.adapter == name for r in self.running.values())
        evicted = self.slots.evict(name)
        assert not (evicted and held), "an adapter a running request holds was evicted"

    # -- helpers ----------------------------------------------------------------------------

    def admit(
        self,
        owner: int,
        adapter: str | None,
        prompt: list[int],
        limit: int,
        reuse: bool,
        land_now: bool,
    ) -> None:
        """As the orchestrator: the adapter's slot first, then the lease; a request that
        gets neither is dropped, one whose prefix is swapping in waits (or lands it now)."""
        if adapter is not None and not self.adapter_ready(adapter):
            return
        blocks = math.ceil(min(len(prompt) + 1, limit) / BLOCK_SIZE)  # lazily
        result = self.manager.admit(owner, adapter, prompt, blocks, reuse)
        # Landing brings the next part of the prefix: the part a periodic swap-in started
        # may be followed by more in the host pool, and a part on its way to the host
        # lands there before it is swapped back in. Each round gets one step further.
        for _ in range(2 * (len(prompt) // BLOCK_SIZE)):
            if result != SWAPPING or not land_now:
                break
            self.land_swaps()
            result = self.manager.admit(owner, adapter, prompt, blocks, reuse)
        assert not (land_now and result == SWAPPING), "a landed prefix is never leased"
        if result == SWAPPING:
            self.waiting[owner] = (adapter, prompt, limit, reuse)
            return
        if result == FULL:
            return
        assert isinstance(result, Lease)
        if adapter is not None:
            self.slots.acquire(adapter)
        key = BASE if adapter is None else ADAPTERS[adapter][0]
        lease = result
        assert lease.cached_tokens == BLOCK_SIZE * len(lease.nodes) < len(prompt)
        assert reuse or not lease.nodes
        expected = {}
        for index, node in enumerate(lease.nodes):  # the right blocks of the right adapter
            assert node.key == tuple(prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            expected[node.page] = (key, tuple(prompt[: (index + 1) * BLOCK_SIZE]))
            assert self.device.pages[node.page] == expected[node.page]
        self.running[owner] = Running(
            lease, adapter, key, list(prompt), limit, lease.cached_tokens, list(lease.table),
            expected,
        )  # fmt: skip

    def prefill_run(self, run: Running, token: int) -> None:
        self.write(run, run.lease.cached_tokens, len(run.tokens))
        self.manager.prefilled(run.lease, run.tokens)
        run.prefilled = True
        if len(run.tokens) < run.limit:
            run.tokens.append(token)  # the first generated token

    def adapter_ready(self, name: str) -> bool:
        """Ask the slot manager for `name`; an inline load is installed at once."""
        if self.slots.request(name) is None:
            self.slots.poll()
        return self.slots.is_ready(name)

    def land_swaps(self) -> None:
        while self.manager.swapping:
            assert self.manager.wait(1.0)

    def write(self, run: Running, start: int, end: int) -> None:
        run.expected |= self.device.write(run.lease.table, run.key, run.tokens, start, end)
        run.written = end

    @staticmethod
    def pick(runs: list[Running], pick: int) -> Running:
        return runs[pick % len(runs)]

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def the_manager_checks(self) -> None:
        self.manager.check()  # every lease it granted and not released: the running ones
        assert 0 <= self.manager.host_used <= self.manager.host_capacity

    @invariant()
    def invalid_kv_is_counted_and_none_under_fastlibra(self) -> None:
        resident = {BASE} | {
            ADAPTERS[name][0]
            for name in self.registered
            if self.slots.is_ready(name) or self.slots.is_loading(name)
        }
        for node in self.manager.tree.adapters():
            assert (node.where == DEVICE) == (node.key in resident)
        invalid = sum(
            1
            for kv in self.manager.tree.kv_nodes()
            if kv.where in (DEVICE, TO_DEVICE) and content_of(kv)[0] not in resident
        )
        stats = self.manager.stats()
        assert self.manager.tree.invalid_kv_pages() == invalid == stats.invalid_kv_pages
        if self.POLICY != "lru":
            assert invalid == 0

    @invariant()
    def running_requests_keep_their_pages(self) -> None:
        for run in self.running.values():
            assert run.lease.table == run.table
            for page, content in run.expected.items():
                assert self.device.pages[page] == content, f"page {page} changed under a request"
            if run.adapter is not None:
                assert self.slots.is_ready(run.adapter)

    @invariant()
    def cached_blocks_hold_their_content(self) -> None:
        for node in self.manager.tree.kv_nodes():
            if node.where == DEVICE:
                assert self.device.pages[node.page] == content_of(node)
            elif node.host is not None:
                assert node.host.data == content_of(node)

    @invariant()
    def adapters_are_charged_their_pages_and_keep_them(self) -> None:
        """Each adapter on the device (or landing) owns its pages and they hold it: no KV
        was written into them. Under "lru" they come out of a fixed share."""
        pool = self.manager.pool
        loaded = [n for n in self.registered if self.slots.is_ready(n) or self.slots.is_loading(n)]
        owned = pool.owned()
        for name in loaded:
            pages = [p for p, (kind, owner) in owned.items() if owner == (LORA, name)]
            assert len(pages) == pool.pages_for(ADAPTERS[name][1])
            assert all(self.device.pages[p] == ("lora", name) for p in pages), name
        if self.POLICY != "lru":
            assert pool.used(LORA) == sum(pool.pages_for(ADAPTERS[n][1]) for n in loaded)

    def teardown(self) -> None:
        """Every request leaves: only cached blocks and adapters keep pages."""
        if not hasattr(self, "manager"):
            return
        try:
            for run in self.running.values():
                self.manager.release(run.lease, run.tokens, run.written)
            self.running.clear()
            self.land_swaps()
            self.manager.check()
            pool = self.manager.pool
            cached = sum(1 for n in self.manager.tree.kv_nodes() if n.where == DEVICE)
            assert pool.num_pages - pool.num_free == cached + pool.used(LORA)
        finally:
            self.manager.close()
            self.slots.close()


class FastLibraMachine(MemoryMachine):
    POLICY = "fastlibra"


class LruMachine(MemoryMachine):
    POLICY = "lru"


class NoneMachine(MemoryMachine):
    POLICY = "none"


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
FastLibraMachine.TestCase.settings = MACHINE_SETTINGS
LruMachine.TestCase.settings = MACHINE_SETTINGS
NoneMachine.TestCase.settings = MACHINE_SETTINGS
TestFastLibraMachine = FastLibraMachine.TestCase
TestLruMachine = LruMachine.TestCase
TestNoneMachine = NoneMachine.TestCase
