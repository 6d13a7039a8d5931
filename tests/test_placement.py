"""router.placement, dLoRA §5.1's proactive preloading by burst tolerance: hand-computed
greedy runs, its stopping rules, and validation."""

from __future__ import annotations

import math

import pytest

from router.placement import ReplicaSlots, burst_tolerance, plan_preloads, request_capacity


def slots(adapters, free_slots, capacity):
    return ReplicaSlots(frozenset(adapters), free_slots, capacity)


def test_burst_tolerance_is_peak_capacity_over_rate():
    replicas = {"w0": slots({"A"}, 0, 10), "w1": slots({"A", "B"}, 0, 6), "w2": slots((), 0, 4)}
    # A: (10 + 6) / 8 = 2; B: 6 / 3 = 2; C is nowhere: 0 / 1 = 0; D has no load: inf.
    assert burst_tolerance({"A": 8, "B": 3, "C": 1, "D": 0}, replicas) == {
        "A": 2.0,
        "B": 2.0,
        "C": 0.0,
        "D": math.inf,
    }


def test_the_weakest_adapter_goes_where_it_adds_most_capacity():
    # Tolerances: A = 10 / 10 = 1, B = 10 / 1 = 10.
    # 1. A is the weakest; w1 (10) adds more than w2 (5): A = 20 / 10 = 2.
    # 2. A is still the weakest (2 < 10); w1 is full now, so w2: A = 25 / 10 = 2.5.
    # 3. A is still the weakest, and every replica holds it: stop (w2 keeps a free slot).
    replicas = {
        "w0": slots({"A"}, 1, 10),
        "w1": slots({"B"}, 1, 10),
        "w2": slots((), 2, 5),
    }
    assert plan_preloads({"A": 10, "B": 1}, replicas) == [("A", "w1"), ("A", "w2")]


def test_an_adapter_resident_nowhere_is_preloaded_first():
    # C (rate 1) is on no replica: tolerance 0, below A's 10 / 5 = 2. It goes to the
    # replica with the most capacity, w0 (10 > 8): C = 10. Then A (2) goes to w1:
    # A = (10 + 8) / 5 = 3.6, the minimum, and no replica without A is left.
    replicas = {"w0": slots({"A"}, 1, 10), "w1": slots((), 2, 8)}
    assert plan_preloads({"A": 5, "C": 1}, replicas) == [("C", "w0"), ("A", "w1")]


def test_it_stops_when_the_minimum_would_decrease():
    # Each loaded adapter takes 4 requests of capacity from its replica.
    # A = 10 / 10 = 1, B = 10 / 10 = 1: the tie goes to A (then by name), onto w1, which
    # drops to 6: A = (10 + 6) / 10 = 1.6 but B = 6 / 10 = 0.6 < 1. The step is not taken.
    replicas = {"w0": slots({"A"}, 1, 10), "w1": slots({"B"}, 1, 10)}
    assert plan_preloads({"A": 10, "B": 10}, replicas, adapter_cost=4.0) == []
    # Without that cost both replicate: A onto w1 (A = 2, B = 1), then B onto w0 (2, 2).
    assert plan_preloads({"A": 10, "B": 10}, replicas) == [("A", "w1"), ("B", "w0")]


def test_a_step_that_keeps_the_minimum_is_taken():
    # A and B both at 0 (resident nowhere), one slot each on w0 and w1 (capacity 8 and 6).
    # 1. A (tie by rate, then name: A) onto w0: A = 8 / 2 = 4, the minimum stays 0 (B).
    # 2. B onto w1 (the only one without B with a slot): B = 6 / 2 = 3.
    replicas = {"w0": slots((), 1, 8), "w1": slots((), 1, 6)}
    assert plan_preloads({"A": 2, "B": 2}, replicas) == [("A", "w0"), ("B", "w1")]


def test_per_adapter_costs_and_max_loads():
    # A = 10 / 10 = 1, B = 10 / 1 = 10. Loading A costs 9 of w1's 10 requests:
    # A = (10 + 1) / 10 = 1.1, B = 1 / 1 = 1: the minimum stays 1, so the step is taken.
    # Then B (1) onto w0, at no cost: B = 11, A = 1.1; then A has nowhere left to go.
    replicas = {"w0": slots({"A"}, 1, 10), "w1": slots({"B"}, 1, 10)}
    assert plan_preloads({"A": 10, "B": 1}, replicas, adapter_cost={"A": 9.0}) == [
        ("A", "w1"),
        ("B", "w0"),
    ]
    # Costing all 10 of w1's requests, A would add nothing there: w1 is no option, stop.
    assert plan_preloads({"A": 10, "B": 1}, replicas, adapter_cost={"A": 10.0}) == []
    # B and C tie at 0 (rate, then name: B); w0 and w1 tie on capacity, w1 has more free
    # slots. max_loads cuts the run short.
    replicas = {"w0": slots({"A"}, 1, 10), "w1": slots(set(), 3, 10)}
    assert plan_preloads({"A": 1, "B": 1, "C": 1}, replicas, max_loads=1) == [("B", "w1")]
    assert plan_preloads({"A": 1, "B": 1, "C": 1}, replicas, max_loads=0) == []


def test_nothing_to_do():
    replicas = {"w0": slots({"A"}, 3, 10)}
    assert plan_preloads({}, replicas) == []
    assert plan_preloads({"Z": 0.0}, replicas) == []  # no load: never preloaded
    assert plan_preloads({"B": 1.0}, {"w0": slots({"A"}, 0, 10)}) == []  # no free slot


def test_request_capacity():
    # 100 free blocks of 8 per request: 12.5 requests, capped by 10 free slots.
    assert request_capacity(100, 8, 10) == 10.0
    assert request_capacity(100, 8, 20) == 12.5
    with pytest.raises(ValueError, match="blocks_per_request"):
        request_capacity(100, 0, 20)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: slots({"A"}, -1, 10), "ReplicaSlots.free_slots"),
        (lambda: slots({"A"}, 1.5, 10), "ReplicaSlots.free_slots"),
        (lambda: slots({"A"}, 1, -2), "ReplicaSlots.capacity"),
        (lambda: slots({""}, 1, 2), "ReplicaSlots.adapters"),
        (lambda: plan_preloads({"A": -1.0}, {}), r"rates\['A'\]"),
        (lambda: plan_preloads({"A": 1.0}, {}, adapter_cost=math.nan), r"adapter_cost\['A'\]"),
        (lambda: plan_preloads({"A": 1.0}, {}, max_loads=-1), "max_loads"),
    ],
)
def test_bad_input_is_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()
