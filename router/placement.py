"""dLoRA §5.1, proactive placement: which adapters to preload where, by burst tolerance.

Semantics. dLoRA "follow[s] the existing work [AlpaServe] to maximize the minimum burst
tolerance of LoRA adapters. The burst tolerance of an adapter ... is defined as the ratio
of the peak capacity to the average load of the adapter", where "the peak capacity of a
LoRA adapter [is] the number of requests that can be served by the unallocated GPU memory
where the corresponding LoRA adapter resides". So, for an adapter k with average load
rate_k (requests/s, from the long-term history):

    burst_tolerance(k) = sum(capacity_j for the replicas j holding k) / rate_k

(seconds: how long the replicas that can serve k at once would absorb k's average
arrivals; inf for an adapter with no load). Then "the dispatcher of dLoRA greedily
preloads the LoRA adapter with the lowest burst tolerance to a replica without this
adapter until the minimum burst tolerance decreases". `plan_preloads` repeats:

1. take the adapter with the lowest burst tolerance (ties: the higher rate, then name);
2. among the replicas without it that have a free adapter slot, take the one whose
   capacity after the load is largest (it adds the most to the adapter's peak capacity);
   none that adds capacity: stop (the minimum cannot rise any more);
3. load it there: the replica's capacity drops by `adapter_cost` (the paper's trade-off:
   "it leaves less GPU memory for requests' intermediate states") and its free slots by
   one. If the minimum burst tolerance over all adapters is now lower than before, undo
   the step and stop; otherwise record (adapter, worker) and go on.

It stops when the minimum would decrease, when no replica can take the weakest adapter
(a free slot is the reserve dLoRA keeps "to replicate additional LoRA adapters"), or
after `max_loads` steps. A step that leaves the minimum unchanged (another adapter ties
at it) is taken: it raises the weakest adapter, and the next step raises the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class ReplicaSlots:
    """One worker as the placement sees it.

    adapters: the adapters resident on its device now. free_slots: how many more adapters
    it can hold (its preload reserve). capacity: the requests its unallocated memory can
    serve at once: its free KV blocks divided by an average request's blocks, at most its
    free decode slots (`request_capacity`).
    """

    adapters: frozenset[str]
    free_slots: int
    capacity: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", frozenset(self.adapters))
        if not all(isinstance(name, str) and name for name in self.adapters):
            raise ValueError(f"ReplicaSlots.adapters={set(self.adapters)!r} must be names")
        free = self.free_slots
        if isinstance(free, bool) or not isinstance(free, int) or free < 0:
            raise ValueError(f"ReplicaSlots.free_slots={free!r} must be an integer >= 0")
        _check("ReplicaSlots.capacity", self.capacity)


def request_capacity(
    free_kv_blocks: int, blocks_per_request: float, free_decode_slots: int
) -> float:
    """`ReplicaSlots.capacity` from a worker's stats: the average requests (of
    `blocks_per_request` KV blocks each) its free blocks hold, capped by its free slots."""
    _check("blocks_per_request", blocks_per_request, positive=True)
    _check("free_kv_blocks", free_kv_blocks)
    _check("free_decode_slots", free_decode_slots)
    return float(min(free_kv_blocks / blocks_per_request, free_decode_slots))


def burst_tolerance(
    rates: Mapping[str, float], replicas: Mapping[str, ReplicaSlots]
) -> dict[str, float]:
    """Each adapter's peak capacity over its rate (module docstring); inf at rate 0."""
    _check_rates(rates)
    tolerance = {}
    for name, rate in rates.items():
        peak = sum(slots.capacity for slots in replicas.values() if name in slots.adapters)
        tolerance[name] = peak / rate if rate > 0 else math.inf
    return tolerance


def plan_preloads(
    rates: Mapping[str, float],
    replicas: Mapping[str, ReplicaSlots],
    *,
    adapter_cost: float | Mapping[str, float] = 0.0,
    max_loads: int | None = None,
) -> list[tuple[str, str]]:
    """The (adapter, worker) loads to issue, in order, by dLoRA's greedy (module docstring).

    rates: requests/s per adapter (adapters with no rate, or rate 0, are never preloaded).
    replicas: worker name -> ReplicaSlots. adapter_cost: the capacity, in requests, that
    one loaded adapter takes from its replica (its bytes over an average request's KV
    bytes; 0 where adapters have slots of their own), one number or per adapter.
    max_loads: stop after this many (None: no limit).
    """
    _check_rates(rates)
    bad_limit = isinstance(max_loads, bool) or not isinstance(max_loads, int) or max_loads < 0
    if max_loads is not None and bad_limit:
        raise ValueError(f"max_loads={max_loads!r} must be None or an integer >= 0")
    costs = {
        name: adapter_cost.get(name, 0.0) if isinstance(adapter_cost, Mapping) else adapter_cost
        for name in rates
    }
    for name, cost in costs.items():
        _check(f"adapter_cost[{name!r}]", cost)
    state = dict(replicas)
    loads: list[tuple[str, str]] = []
    while max_loads is None or len(loads) < max_loads:
        tolerance = burst_tolerance(rates, state)
        loaded = [name for name, rate in rates.items() if rate > 0]
        if not loaded:
            break
        weakest = min(loaded, key=lambda name: (tolerance[name], -rates[name], name))
        cost = costs[weakest]
        options = [
            worker
            for worker, slots in state.items()
            if weakest not in slots.adapters and slots.free_slots > 0 and slots.capacity > cost
        ]
        if not options:
            break
        worker = min(options, key=lambda w: (-state[w].capacity, -state[w].free_slots, w))
        slots = state[worker]
        state[worker] = ReplicaSlots(
            slots.adapters | {weakest}, slots.free_slots - 1, slots.capacity - cost
        )
        if min(burst_tolerance(rates, state).values()) < tolerance[weakest]:
            break  # "until the minimum burst tolerance decreases": this step is not taken
        loads.append((weakest, worker))
    return loads


def _check(field: str, value: object, *, positive: bool = False) -> None:
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field}={value!r} must be a finite number {bound}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{field}={value!r} must be a finite number {bound}")


def _check_rates(rates: Mapping[str, float]) -> None:
    for name, rate in rates.items():
        _check(f"rates[{name!r}]", rate)
