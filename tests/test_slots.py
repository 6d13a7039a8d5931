"""SlotManager: hand-written sequences for each rule, then a hypothesis state machine that
interleaves requests, holds, pins, discards and slow or failing background loads."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jlora.engine.slots import AdapterLoadError, SlotManager

# No load in these tests takes this long unless a gate was never opened: then it fails.
GATE_TIMEOUT_S = 10.0


class FakeDevice:
    """`load` and `install` for a SlotManager, with the slots simulated as slot -> adapter.

    `load` (on the transfer thread) waits for `gate`, sleeps `delays[name]` seconds, raises
    OSError for the adapters in `bad`, and returns (name, slot). `install` checks that it got
    the payload loaded for that slot, on the thread that made the manager, and records it.
    """

    def __init__(self, bad: set[str] | None = None, delays: dict[str, float] | None = None):
        self.bad = bad or set()
        self.delays = delays or {}
        self.gate = threading.Event()
        self.gate.set()
        self.slots: dict[int, str] = {}
        self.loads: list[tuple[str, int]] = []
        self.installs: list[tuple[str, int]] = []
        self._owner = threading.get_ident()

    def load(self, name: str, slot: int, pages: object = None) -> tuple[str, int]:
        assert threading.get_ident() != self._owner, "load ran on the scheduler's thread"
        self.loads.append((name, slot))
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"the gate of the load of {name!r} never opened")
        time.sleep(self.delays.get(name, 0.0))
        if name in self.bad:
            raise OSError(f"corrupt adapter_model.safetensors for {name!r}")
        return name, slot

    def install(self, name: str, slot: int, payload: object) -> None:
        assert threading.get_ident() == self._owner, "install ran off the scheduler's thread"
        assert payload == (name, slot)
        self.slots[slot] = name
        self.installs.append((name, slot))


@pytest.fixture
def make_slots():
    """make_slots(num_slots, **FakeDevice kwargs) -> (device, manager); closed afterwards."""
    made: list[tuple[FakeDevice, SlotManager]] = []

    def make(num_slots: int, **device_kwargs) -> tuple[FakeDevice, SlotManager]:
        device = FakeDevice(**device_kwargs)
        slots = SlotManager(num_slots, device.load, device.install)
        made.append((device, slots))
        return device, slots

    yield make
    for device, slots in made:
        device.gate.set()
        slots.close()


def settle(slots: SlotManager, timeout: float = 5.0) -> list[str]:
    """wait() and poll() until no load is under way; returns the adapters that became ready."""
    deadline = time.monotonic() + timeout
    ready: list[str] = []
    while slots.loading():
        assert time.monotonic() < deadline, f"loads never finished: {slots.loading()}"
        slots.wait(0.05)
        ready += slots.poll()
    return ready


def load_in_order(slots: SlotManager, *names: str) -> None:
    """Request and install each adapter in turn (so the LRU order is the order given)."""
    for name in names:
        assert slots.request(name) is None
        assert settle(slots) == [name]


def test_num_slots_must_be_positive():
    device = FakeDevice()
    with pytest.raises(ValueError, match="num_slots=0"):
        SlotManager(0, device.load, device.install)


def test_request_loads_in_the_background_and_poll_installs(make_slots):
    device, slots = make_slots(2)
    device.gate.clear()
    assert slots.request("a") is None
    assert slots.request("a") is None  # already loading: no second load
    assert slots.loading() == {"a": 0} and slots.num_free == 1
    assert slots.poll() == [] and not slots.is_ready("a")
    assert not slots.wait(0.01)  # the load is held at the gate
    device.gate.set()
    assert slots.wait(5.0)
    assert device.installs == []  # finished, but installed only by poll()
    assert slots.poll() == ["a"]
    assert device.installs == [("a", 0)] and device.loads == [("a", 0)]
    assert slots.request("a") == 0 and slots.slot_of("a") == 0 and slots.resident() == {"a": 0}
    assert slots.stats() == {"loads": 1, "evictions": 0, "hits": 1, "failures": 0}


def test_wait_returns_at_once_when_nothing_is_loading(make_slots):
    _, slots = make_slots(1)
    start = time.monotonic()
    assert not slots.wait(5.0)
    assert time.monotonic() - start < 1.0


def test_lru_evicts_the_least_recently_used_idle_adapter(make_slots):
    device, slots = make_slots(3)
    load_in_order(slots, "a", "b", "c")  # slots 0, 1, 2; LRU order a, b, c
    assert slots.acquire("a") == 0
    slots.release("a")  # order b, c, a
    assert slots.request("c") == 2  # a hit is a use too: order b, a, c
    assert list(slots.resident()) == ["b", "a", "c"]
    assert slots.request("d") is None
    assert slots.loading() == {"d": 1}  # b's slot
    settle(slots)
    assert slots.resident() == {"a": 0, "c": 2, "d": 1}
    assert device.slots == {0: "a", 1: "d", 2: "c"}
    assert slots.stats()["evictions"] == 1


def test_request_does_nothing_while_every_slot_is_in_use(make_slots):
    _, slots = make_slots(2)
    load_in_order(slots, "a", "b")
    slots.acquire("a")
    slots.acquire("b")
    slots.acquire("b")
    assert slots.request("c") is None
    assert slots.loading() == {} and slots.num_free == 0 and slots.stats()["loads"] == 2
    slots.release("b")
    assert slots.request("c") is None and slots.loading() == {}  # b is still held once
    slots.release("a")
    assert slots.request("c") is None and slots.loading() == {"c": 0}
    settle(slots)
    assert slots.resident() == {"b": 1, "c": 0} and slots.in_use("b") == 1


def test_a_pinned_adapter_survives_pressure(make_slots):
    _, slots = make_slots(2)
    slots.pin("a")
    assert settle(slots) == ["a"]
    load_in_order(slots, "b", "c", "d")  # each evicts the one before, never a
    assert slots.resident() == {"a": 0, "d": 1} and slots.stats()["evictions"] == 2
    slots.unpin("a")
    load_in_order(slots, "e")  # a is now the least recently used idle adapter
    assert slots.resident() == {"d": 1, "e": 0}


def test_a_pin_without_a_slot_loads_when_one_can_be_had(make_slots):
    _, slots = make_slots(1)
    load_in_order(slots, "a")
    slots.acquire("a")
    slots.pin("b")  # every slot is in use: the intent is recorded
    assert slots.pinned == {"b"} and slots.loading() == {}
    assert slots.poll() == [] and slots.loading() == {}
    slots.release("a")
    assert slots.poll() == [] and slots.loading() == {"b": 0}  # poll() starts it
    assert settle(slots) == ["b"]
    assert slots.resident() == {"b": 0} and slots.pinned == {"b"}
    with pytest.raises(ValueError, match=r"'c'.*num_slots=1"):
        slots.pin("c")
    with pytest.raises(ValueError, match="'a' is not pinned"):
        slots.unpin("a")


def test_poll_keeps_what_it_installs_from_a_waiting_pin(make_slots):
    device, slots = make_slots(1)
    device.gate.clear()
    slots.request("x")
    slots.pin("p")  # x's load holds the only slot
    assert slots.loading() == {"x": 0}
    device.gate.set()
    assert settle(slots) == ["x"] and slots.slot_of("x") == 0  # ready, as poll() said
    slots.acquire("x")
    assert slots.poll() == [] and slots.loading() == {}  # p waits while x is held
    slots.release("x")
    assert slots.poll() == [] and slots.loading() == {"p": 0}


def test_a_failed_load_raises_names_the_adapter_and_frees_its_slot(make_slots):
    device, slots = make_slots(3, bad={"bad"})
    device.gate.clear()
    slots.request("a")
    slots.pin("bad")
    slots.request("c")
    device.gate.set()
    ready: list[str] = []
    deadline = time.monotonic() + 5.0
    with pytest.raises(AdapterLoadError, match="loading adapter 'bad' failed: corrupt") as caught:
        while time.monotonic() < deadline:
            slots.wait(0.05)
            ready += slots.poll()
    assert caught.value.adapter == "bad" and isinstance(caught.value.__cause__, OSError)
    ready += caught.value.ready + settle(slots)
    assert sorted(ready) == ["a", "c"]
    assert slots.resident() == {"a": 0, "c": 2} and slots.num_free == 1
    assert not slots.is_loading("bad") and slots.pinned == frozenset()  # no retry loop
    assert slots.stats()["failures"] == 1


def test_a_failed_install_is_a_failed_load():
    device = FakeDevice()

    def install(name: str, slot: int, payload: object) -> None:
        raise MemoryError(f"no room for {name!r}")

    slots = SlotManager(1, device.load, install)
    try:
        slots.request("a")
        slots.wait(5.0)
        with pytest.raises(AdapterLoadError, match="'a' failed: no room"):
            slots.poll()
        assert slots.resident() == {} and slots.loading() == {} and slots.num_free == 1
    finally:
        slots.close()


def test_discard_while_loading_drops_the_payload(make_slots):
    device, slots = make_slots(2, bad={"b"})
    device.gate.clear()
    slots.request("a")
    slots.request("b")
    slots.discard("a")
    slots.discard("b")
    assert slots.is_loading("a") and slots.request("a") is None  # no second load
    assert slots.stats()["loads"] == 2
    device.gate.set()
    assert settle(slots) == []  # b's failure is dropped with it
    assert device.installs == [] and slots.num_free == 2 and slots.loading() == {}
    assert slots.request("a") is None and slots.loading() == {"a": 0}  # a fresh load


def test_discard_frees_a_resident_slot_and_refuses_one_in_use(make_slots):
    _, slots = make_slots(2)
    load_in_order(slots, "a")
    slots.pin("a")
    slots.acquire("a")
    with pytest.raises(ValueError, match="'a': 1 running requests"):
        slots.discard("a")
    slots.release("a")
    slots.discard("a")
    assert slots.resident() == {} and slots.num_free == 2 and slots.pinned == frozenset()
    slots.discard("never-loaded")
    assert slots.num_free == 2


def test_a_hold_taken_while_loading_carries_over_and_blocks_eviction(make_slots):
    """A CPU-assisted prefill holds its adapter before it has landed: the hold names the
    slot being loaded, survives the install, and keeps the adapter from eviction."""
    device, slots = make_slots(1)
    device.gate.clear()
    assert slots.request("a") is None
    assert slots.acquire("a") == 0 and slots.in_use("a") == 1
    device.gate.set()
    assert settle(slots) == ["a"]
    assert slots.in_use("a") == 1
    assert slots.request("b") is None and slots.loading() == {}  # no slot for b: a is held
    slots.release("a")
    assert slots.request("b") is None and slots.loading() == {"b": 0}


def test_acquire_and_release_check_their_adapter(make_slots):
    _, slots = make_slots(1)
    with pytest.raises(ValueError, match="'a' released but not acquired"):
        slots.release("a")
    with pytest.raises(ValueError, match="'a' is not on the device"):
        slots.acquire("a")
    load_in_order(slots, "a")
    assert slots.acquire("a") == 0 and slots.in_use("a") == 1
    slots.release("a")
    with pytest.raises(ValueError, match="'a' released but not acquired"):
        slots.release("a")
    assert slots.in_use("a") == 0


def test_load_all_loads_and_pins_every_adapter(make_slots):
    _, slots = make_slots(3)
    slots.load_all(["a", "b", "a"], timeout=5.0)
    assert slots.resident() == {"a": 0, "b": 1} and slots.pinned == {"a", "b"}
    slots.load_all(["c"], pin=False, timeout=5.0)
    assert slots.is_ready("c") and slots.pinned == {"a", "b"}


def test_load_all_waits_for_a_load_that_holds_the_last_slot(make_slots):
    device, slots = make_slots(1)
    device.gate.clear()
    slots.request("x")
    threading.Timer(0.05, device.gate.set).start()
    slots.load_all(["a"], timeout=5.0)  # x lands, then is evicted for the pin
    assert slots.resident() == {"a": 0} and slots.pinned == {"a"}
    assert device.installs == [("x", 0), ("a", 0)]


def test_a_pin_after_a_discard_mid_load_loads_the_adapter_anew(make_slots):
    """The discarded load's payload (the old weights) is dropped; the new pin's own load
    then starts at that poll, and only it can be held and installed."""
    device, slots = make_slots(2)
    device.gate.clear()
    slots.pin("a")
    slots.discard("a")  # unregistered while loading
    slots.pin("a")  # registered again
    assert slots.is_loading("a") and not slots.will_land("a")
    with pytest.raises(ValueError, match="'a'"):
        slots.acquire("a")
    device.gate.set()
    assert slots.wait(5.0)
    assert slots.poll() == [] and slots.will_land("a")
    slot = slots.acquire("a")
    assert slots.wait(5.0) and slots.poll() == ["a"]
    assert slots.slot_of("a") == slot and device.installs == [("a", slot)]
    assert [name for name, _ in device.loads] == ["a", "a"]


def test_load_all_over_capacity_is_refused(make_slots):
    _, slots = make_slots(2)
    with pytest.raises(ValueError, match="3 adapters into num_slots=2"):
        slots.load_all(["a", "b", "c"])
    slots.pin("a")
    with pytest.raises(ValueError, match="1 are pinned and num_slots=2"):
        slots.load_all(["b", "c"])
    assert slots.pinned == {"a"} and slots.loading() == {"a": 0}


def test_load_all_fails_when_running_requests_hold_the_slots(make_slots):
    _, slots = make_slots(1)
    load_in_order(slots, "a")
    slots.acquire("a")
    with pytest.raises(RuntimeError, match=r"\['b'\].*running requests hold the other slots"):
        slots.load_all(["b"])
    assert slots.pinned == frozenset()


def test_load_all_times_out_and_reports_failures(make_slots):
    device, slots = make_slots(2, bad={"bad"})
    device.gate.clear()
    with pytest.raises(TimeoutError, match=r"\['a'\] not loaded within timeout=0.05"):
        slots.load_all(["a"], timeout=0.05)
    assert slots.pinned == frozenset()
    device.gate.set()
    with pytest.raises(AdapterLoadError, match="'bad'"):
        slots.load_all(["a", "bad"], timeout=5.0)
    assert slots.pinned == frozenset() and slots.is_ready("a")


def test_a_closed_manager_refuses_calls(make_slots):
    _, slots = make_slots(1)
    load_in_order(slots, "a")
    slots.close()
    slots.close()
    for call in (slots.poll, lambda: slots.request("b"), lambda: slots.wait(0.0)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert slots.resident() == {"a": 0}  # still readable


NAMES = ("a", "b", "c", "d", "bad")
GOOD = NAMES[:-1]
names = st.sampled_from(NAMES)


class SlotMachine(RuleBasedStateMachine):
    """Random interleavings against the model: the holds taken, and the slot of each."""

    @initialize(num_slots=st.integers(1, 3))
    def start(self, num_slots: int) -> None:
        self.device = FakeDevice(bad={"bad"}, delays={"b": 0.001, "c": 0.0005})
        self.slots = SlotManager(num_slots, self.device.load, self.device.install)
        self.holds: Counter[str] = Counter()
        self.held_slot: dict[str, int] = {}  # slot of each held adapter when first acquired
        self.pinned_ready: set[str] = set()  # pinned adapters seen ready since pinned
        self.wanted: set[str] = set()  # requested or pinned since last discarded
        self.discarded_loading: set[str] = set()  # discarded while their load ran

    @rule(name=names)
    def request(self, name: str) -> None:
        self.wanted.add(name)
        slot = self.slots.request(name)
        if slot is None:
            assert not self.slots.is_ready(name)
        else:
            assert self.slots.slot_of(name) == slot and self.device.slots[slot] == name
        self.check_waiting_pins()

    @rule(name=names, hold=st.booleans())
    def land(self, name: str, hold: bool) -> None:
        """Request `name` with the gate open, poll until its load (if one started) is done, and
        acquire it if `hold` (states with held adapters under pressure are otherwise rare)."""
        self.device.gate.set()
        self.request(name)
        deadline = time.monotonic() + 5.0
        while self.slots.is_loading(name):
            assert time.monotonic() < deadline, f"the load of {name!r} never finished"
            self.slots.wait(0.05)
            self.poll()
        if hold and self.slots.is_ready(name):
            self.acquire(name)

    @rule(name=names)
    def acquire(self, name: str) -> None:
        """A ready adapter, or one loading (not discarded meanwhile), can be held."""
        loading = self.slots.is_loading(name) and name not in self.discarded_loading
        if not self.slots.is_ready(name) and not loading:
            with pytest.raises(ValueError, match=repr(name)):
                self.slots.acquire(name)
            return
        slot = self.slots.acquire(name)
        assert self.held_slot.setdefault(name, slot) == slot
        self.holds[name] += 1

    @rule(name=names)
    def release(self, name: str) -> None:
        if not self.holds[name]:
            with pytest.raises(ValueError, match=repr(name)):
                self.slots.release(name)
            return
        self.slots.release(name)
        self.holds[name] -= 1
        if not self.holds[name]:
            del self.held_slot[name]

    @rule(name=names)
    def pin(self, name: str) -> None:
        pinned = self.slots.pinned
        if name not in pinned and len(pinned) == self.slots.num_slots:
            with pytest.raises(ValueError, match=repr(name)):
                self.slots.pin(name)
            return
        self.slots.pin(name)
        self.wanted.add(name)
        assert name in self.slots.pinned

    @rule(name=names)
    def unpin(self, name: str) -> None:
        if name not in self.slots.pinned:
            with pytest.raises(ValueError, match=repr(name)):
                self.slots.unpin(name)
            return
        self.slots.unpin(name)
        self.pinned_ready.discard(name)

    @rule()
    def poll(self) -> None:
        try:
            ready = self.slots.poll()
        except AdapterLoadError as err:
            assert err.adapter == "bad" and isinstance(err.__cause__, OSError)
            assert not self.slots.is_ready("bad") and not self.slots.is_loading("bad")
            ready = err.ready
            for _ in range(self.holds.pop("bad", 0)):  # as the engine does: fail its users
                self.slots.release("bad")
            self.held_slot.pop("bad", None)
        # A discarded load is dropped by the poll that finds it finished; a pin may then
        # start a new load of the same name at once, which will land (`will_land`).
        self.discarded_loading = {
            n
            for n in self.discarded_loading
            if self.slots.is_loading(n) and not self.slots.will_land(n)
        }
        for name in ready:
            slot = self.slots.slot_of(name)
            assert slot is not None and self.device.slots[slot] == name
        self.check_waiting_pins(just_installed=frozenset(ready))

    def check_waiting_pins(self, just_installed: frozenset[str] = frozenset()) -> None:
        """After request() or poll(), a pin waits for its load only if no slot can be had
        (poll() does not evict the adapters it has just installed)."""
        waiting = [
            name
            for name in self.slots.pinned
            if not self.slots.is_ready(name) and not self.slots.is_loading(name)
        ]
        if waiting:
            assert self.slots.num_free == 0
            for name in self.slots.resident().keys() - just_installed:
                assert self.slots.in_use(name) or name in self.slots.pinned

    @rule(timeout=st.sampled_from([0.0, 0.005]))
    def wait(self, timeout: float) -> None:
        was_loading = bool(self.slots.loading())
        finished = self.slots.wait(timeout)
        assert was_loading or not finished

    @rule(name=names)
    def discard(self, name: str) -> None:
        if self.holds[name]:
            with pytest.raises(ValueError, match=repr(name)):
                self.slots.discard(name)
            return
        self.slots.discard(name)
        if self.slots.is_loading(name):
            self.discarded_loading.add(name)
        self.wanted.discard(name)
        assert not self.slots.is_ready(name) and name not in self.slots.pinned
        self.pinned_ready.discard(name)

    @rule(open_gate=st.booleans())
    def gate(self, open_gate: bool) -> None:
        if open_gate:
            self.device.gate.set()
        else:
            self.device.gate.clear()

    @invariant()
    def held_adapters_keep_their_slot(self) -> None:
        """A held adapter is ready in the slot it was held in, or still loading into it."""
        for name, slot in self.held_slot.items():
            if self.slots.is_loading(name):
                assert self.slots.loading()[name] == slot
            else:
                assert self.slots.slot_of(name) == slot and self.device.slots[slot] == name

    @invariant()
    def use_counts_match_the_holds(self) -> None:
        for name in NAMES:
            assert self.slots.in_use(name) == self.holds[name] >= 0

    @invariant()
    def only_wanted_adapters_land(self) -> None:
        """A load under way when its adapter was discarded is never installed."""
        assert self.slots.resident().keys() <= self.wanted

    @invariant()
    def pinned_adapters_stay_ready(self) -> None:
        for name in self.pinned_ready:
            assert name in self.slots.pinned and self.slots.is_ready(name)
        self.pinned_ready |= {name for name in self.slots.pinned if self.slots.is_ready(name)}

    @invariant()
    def every_slot_has_one_owner(self) -> None:
        resident, loading = self.slots.resident(), self.slots.loading()
        assert not resident.keys() & loading.keys()
        occupied = [*resident.values(), *loading.values()]
        assert len(set(occupied)) == len(occupied)
        assert set(occupied) <= set(range(self.slots.num_slots))
        assert self.slots.num_free + len(occupied) == self.slots.num_slots

    @invariant()
    def the_device_agrees_with_resident(self) -> None:
        for name, slot in self.slots.resident().items():
            assert self.device.slots[slot] == name

    def teardown(self) -> None:
        """Liveness: once nothing holds the slots, adapters that fit all become ready."""
        if not hasattr(self, "slots"):
            return
        try:
            self.device.gate.set()
            for name, count in self.holds.items():
                for _ in range(count):
                    self.slots.release(name)
            pinned_good = [name for name in GOOD if name in self.slots.pinned]
            if "bad" in self.slots.pinned:
                self.slots.unpin("bad")
            others = [name for name in GOOD if name not in pinned_good]
            target = (pinned_good + others)[: self.slots.num_slots]
            deadline = time.monotonic() + 3.0
            while not all(self.slots.is_ready(name) for name in target):
                assert time.monotonic() < deadline, f"never ready: {target}"
                for name in target:
                    self.slots.request(name)
                try:
                    self.slots.poll()
                except AdapterLoadError as err:
                    assert err.adapter == "bad"
                self.slots.wait(0.05)
        finally:
            self.device.gate.set()
            self.slots.close()


SlotMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestSlotMachine = SlotMachine.TestCase
