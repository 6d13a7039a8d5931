"""router.migration, dLoRA §5.2's co-migration ILP: hand-computed plans, the independent
checker tested on bad plans, the exact plan against brute force, the relaxed plan against
the exact one, random problems through hypothesis, and the time a decision takes."""

from __future__ import annotations

import itertools
import logging
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.migration import Candidate, Plan, Problem, Replica, select_replicas, solve, violations
from router.migration import identity_plan as identity

GB = 1e9


def req(request_id, worker, exec_time, *, adapter=None, memory=0.0, running=False):
    return Candidate(request_id, adapter, worker, exec_time, memory, running)


def rep(worker, *, memory=100 * GB, adapters=(), **fields):
    return Replica(worker, memory, frozenset(adapters), **fields)


# --- hand-computed plans ----------------------------------------------------------------


def test_base_model_requests_balance_two_replicas():
    # w0 holds 4 + 3 + 2 + 1 = 10 s of base-model work, w1 none; a moved request costs
    # gamma = 1.2 times its work. Moving a set of total s: max(10 - s, 1.2 s).
    #   s=4 {r4}: max(6, 4.8) = 6    s=5 {r3,r2}: max(5, 6) = 6    s=3: max(7, 3.6) = 7
    # Makespan 6; among the plans reaching it, moving r4 alone moves the least (the tie).
    problem = Problem(
        (req("r4", "w0", 4), req("r3", "w0", 3), req("r2", "w0", 2), req("r1", "w0", 1)),
        (rep("w0"), rep("w1")),
        {},
    )
    for relax in (True, False):
        plan = solve(problem, relax=relax)
        assert plan.makespan == pytest.approx(6.0)
        assert plan.moves(problem) == [("r4", "w0", "w1")]
        assert plan.loads(problem) == pytest.approx({"w0": 6.0, "w1": 4.8})
        assert plan.adapters == {"w0": frozenset(), "w1": frozenset()}
        assert plan.relaxed is relax and plan.status == "optimal"
        assert violations(problem, plan) == []
    assert identity(problem).makespan == pytest.approx(10.0)


def test_moved_requests_bring_their_adapter():
    # Four running requests of adapter A (3 s each) on w0, which holds A; w1 holds B.
    # eta = 0.5 s per adapter served; A is 1.6 GB at B = 16 GB/s, so loading it costs 0.1 s.
    # Moving s of them: w0 = 3 (4 - s) + 0.5, w1 = 1.2 * 3 s + 0.5 + 0.1.
    #   s=1: max(9.5, 4.2) = 9.5   s=2: max(6.5, 7.8) = 7.8   s=3: max(3.5, 11.4) = 11.4
    # w1 drops B: nothing there needs it, and keeping it would cost eta.
    problem = Problem(
        tuple(req(f"r{i}", "w0", 3, adapter="A", running=True) for i in range(4)),
        (rep("w0", adapters={"A"}), rep("w1", adapters={"B"})),
        {"A": 1.6 * GB, "B": 1.6 * GB},
        affinity=0.5,
        swap_bandwidth=16 * GB,
    )
    for relax in (True, False):
        plan = solve(problem, relax=relax)
        assert plan.makespan == pytest.approx(7.8)
        assert len(plan.moves(problem)) == 2
        assert plan.adapters == {"w0": frozenset({"A"}), "w1": frozenset({"A"})}
        assert violations(problem, plan) == []
    assert identity(problem).makespan == pytest.approx(12.5)  # 4 * 3 + eta


def test_a_resident_adapter_saves_its_load():
    # r (adapter A, 5 s) sits on w0 behind 10 s of fixed work: identity = 10 + 5 + 0.05.
    # Moved: w0 = 10 (A no longer needed there), the target 1.2 * 5 + 0.05 (+ 0.1 to load A
    # where it is not resident) -> makespan 10 either way; the tie goes to w2, which has A.
    problem = Problem(
        (req("r", "w0", 5, adapter="A", running=True),),
        (rep("w0", adapters={"A"}, fixed_time=10.0), rep("w1"), rep("w2", adapters={"A"})),
        {"A": 1.6 * GB},
        swap_bandwidth=16 * GB,
    )
    plan = solve(problem, relax=False)
    assert plan.moves(problem) == [("r", "w0", "w2")]
    assert plan.loads(problem) == pytest.approx({"w0": 10.0, "w1": 0.0, "w2": 6.05})


def test_queued_requests_may_move_more_cheaply():
    # Two queued 5 s requests on w0; a moved queued request costs 1.0x (it has no state),
    # a running one 2.0x: moving a queued one gives max(5, 5) = 5, a running one 10.
    problem = Problem(
        (req("run", "w0", 5, running=True), req("queued", "w0", 5)),
        (rep("w0"), rep("w1")),
        {},
        migration_factor=2.0,
        queued_migration_factor=1.0,
    )
    plan = solve(problem, relax=False)
    assert plan.moves(problem) == [("queued", "w0", "w1")]
    assert plan.makespan == pytest.approx(5.0)


def test_memory_is_hard_when_exact_and_swapped_when_relaxed():
    # w0 (10 GB) holds r6 (6 s, 5 GB), r4a and r4b (4 s, no KV); w1 has 4 GB: r6 fits
    # there only by swapping 1 GB, 1 GB / (16 GB/s) = 0.0625 s.
    #   exact: move r4a + r4b: max(6, 9.6) = 9.6 (moving r4a alone: max(10, 4.8) = 10)
    #   relaxed: move r6: max(8, 7.2 + 0.0625) = 8
    problem = Problem(
        (req("r6", "w0", 6, memory=5 * GB), req("r4a", "w0", 4), req("r4b", "w0", 4)),
        (rep("w0", memory=10 * GB), rep("w1", memory=4 * GB)),
        {},
        swap_bandwidth=16 * GB,
    )
    exact = solve(problem, relax=False)
    assert exact.makespan == pytest.approx(9.6)
    assert sorted(exact.moves(problem)) == [("r4a", "w0", "w1"), ("r4b", "w0", "w1")]
    relaxed = solve(problem, relax=True)
    assert relaxed.makespan == pytest.approx(8.0)
    assert relaxed.moves(problem) == [("r6", "w0", "w1")]
    assert relaxed.loads(problem) == pytest.approx({"w0": 8.0, "w1": 7.2625})
    assert violations(problem, relaxed) == []  # the excess is swapped, not a violation
    exact_reading = Plan(relaxed.placement, relaxed.adapters, 8.0, 0.0, relaxed=False)
    assert [v.split(":")[0] for v in violations(problem, exact_reading)] == ["memory"]


def test_pinned_adapters_stay_and_are_charged():
    # w1 pins C for work the plan does not move: it keeps C (eta = 1 s) and loads it
    # (0.5 GB at 1 GB/s = 0.5 s) -> w1 = 1.5 s even with no candidate there.
    problem = Problem(
        (req("r", "w0", 1.0),),
        (rep("w0"), rep("w1", pinned={"C"})),
        {"C": 0.5 * GB},
        affinity=1.0,
        swap_bandwidth=1 * GB,
    )
    plan = solve(problem)
    assert plan.adapters["w1"] == frozenset({"C"})
    assert plan.loads(problem) == pytest.approx({"w0": 1.0, "w1": 1.5})
    assert plan.moves(problem) == []


def test_no_candidates_is_the_identity():
    problem = Problem((), (rep("w0", fixed_time=2.0), rep("w1")), {})
    plan = solve(problem)
    assert plan.placement == {} and plan.makespan == pytest.approx(2.0)


# --- the checker on hand-made bad plans ---------------------------------------------------


@pytest.fixture
def small():
    problem = Problem(
        (req("a", "w0", 1, adapter="A", memory=2 * GB), req("b", "w0", 1)),
        (rep("w0", memory=3 * GB, adapters={"A"}), rep("w1", memory=3 * GB, pinned={"P"})),
        {"A": 0.5 * GB, "P": 0.5 * GB},
    )
    good = identity(problem)
    assert violations(problem, good) == []
    return problem, good


def _with(problem, plan, *, placement=None, adapters=None, makespan=None, relaxed=False):
    placement = dict(plan.placement if placement is None else placement)
    adapters = dict(plan.adapters if adapters is None else adapters)
    if makespan is None:  # the true one, where the plan is complete enough to have one
        try:
            makespan = max(Plan(placement, adapters, 0.0, 0.0, relaxed).loads(problem).values())
        except KeyError:
            makespan = 0.0
    return Plan(placement, adapters, makespan, 0.0, relaxed)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"placement": {"a": "w0"}}, "existence: request 'b' not placed"),
        ({"placement": {"a": "w0", "b": "w0", "c": "w1"}}, "existence: unknown request 'c'"),
        ({"placement": {"a": "w0", "b": "w9"}}, "existence: request 'b' on unknown worker"),
        ({"placement": {"a": "w1", "b": "w0"}}, "matching: request 'a' on 'w1' needs adapter"),
        ({"adapters": {"w0": frozenset({"A"}), "w1": frozenset()}}, "matching: 'w1' drops pinned"),
        (
            {"adapters": {"w0": frozenset({"A"}), "w1": frozenset({"P"}), "w9": frozenset()}},
            "adapters: unknown worker 'w9'",
        ),
        (
            {"adapters": {"w0": frozenset({"A", "Z"}), "w1": frozenset({"P"})}},
            "adapters: 'w0' holds 'Z', whose size is unknown",
        ),
        ({"makespan": 99.0}, "makespan: 99.0 but the plan's loads give"),
    ],
)
def test_violations_names_each_broken_constraint(small, change, expected):
    problem, good = small
    found = violations(problem, _with(problem, good, **change))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_violations_memory_is_hard_unless_relaxed(small):
    problem, good = small
    problem = Problem(
        problem.candidates, problem.replicas, {**problem.adapter_memory, "B": 0.5 * GB}
    )
    # Both requests on w1 (3 GB), which holds A, its pinned P and a spare B (0.5 GB each):
    # 2 GB of KV + 1.5 GB of adapters = 3.5 GB.
    placement = {"a": "w1", "b": "w1"}
    adapters = {"w0": frozenset(), "w1": frozenset({"A", "P", "B"})}
    found = violations(problem, _with(problem, good, placement=placement, adapters=adapters))
    assert found == ["memory: 'w1' uses 3.5e+09 bytes of 3e+09"]
    relaxed = _with(problem, good, placement=placement, adapters=adapters, relaxed=True)
    assert violations(problem, relaxed) == []
    # Its load: 1.2 * (1 + 1) moved work, eta 0.05 x 3 adapters, loading the three (none
    # resident on w1) 1.5 GB / B, and swapping the 0.5 GB excess / B.
    bandwidth = problem.swap_bandwidth
    assert relaxed.loads(problem)["w1"] == pytest.approx(
        2.4 + 0.15 + 1.5 * GB / bandwidth + 0.5 * GB / bandwidth
    )


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: req("r", "w0", -1.0), "Candidate.exec_time"),
        (lambda: req("r", "w0", 1.0, memory=float("nan")), "Candidate.memory"),
        (lambda: req("", "w0", 1.0), "Candidate.request_id"),
        (lambda: rep("w0", memory=-1.0), "Replica.memory"),
        (lambda: rep("w0", fixed_time=-1.0), "Replica.fixed_time"),
        (lambda: Problem((req("r", "w0", 1), req("r", "w0", 1)), (rep("w0"),), {}), "request_id"),
        (lambda: Problem((), (rep("w0"), rep("w0")), {}), "Problem.replicas"),
        (lambda: Problem((req("r", "w9", 1),), (rep("w0"),), {}), "Candidate.worker='w9'"),
        (lambda: Problem((req("r", "w0", 1, adapter="A"),), (rep("w0"),), {}), "adapter_memory"),
        (lambda: Problem((), (rep("w0"),), {"A": -1.0}), "adapter_memory['A']"),
        (lambda: Problem((), (rep("w0"),), {}, migration_factor=0.5), "migration_factor"),
        (lambda: Problem((), (rep("w0"),), {}, swap_bandwidth=0.0), "swap_bandwidth"),
        (lambda: Problem((), (), {}), "Problem.replicas"),
    ],
)
def test_bad_problems_are_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("(", r"\(")):
        build()


# --- the top-K selection -----------------------------------------------------------------


def test_select_replicas_takes_the_most_and_least_loaded():
    loads = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 9.0, "e": 0.0}
    assert select_replicas(loads, 1) == ["d", "e"]
    assert select_replicas(loads, 2) == ["d", "a", "e", "b"]
    assert select_replicas(loads, 3) == ["d", "a", "c", "e", "b"]  # all, each once
    assert select_replicas({"x": 1.0, "w": 1.0}, 1) == ["w", "x"]  # ties by name
    with pytest.raises(ValueError, match="k=0"):
        select_replicas(loads, 0)


# --- exact against brute force, relaxed against exact -----------------------------------


def _random_problem(rng: random.Random, *, replicas: int, requests: int, ample: bool) -> Problem:
    names = [f"a{k}" for k in range(rng.randint(1, 3))]
    memory = (
        [100 * GB] * replicas if ample else [rng.choice([1, 2, 4]) * GB for _ in range(replicas)]
    )
    return Problem(
        tuple(
            req(
                f"r{i}",
                f"w{rng.randrange(replicas)}",
                rng.uniform(0, 10),
                adapter=rng.choice([*names, None]),
                memory=rng.uniform(0, 1) * GB,
                running=rng.random() < 0.5,
            )
            for i in range(requests)
        ),
        tuple(
            rep(
                f"w{j}",
                memory=memory[j],
                adapters=rng.sample(names, rng.randint(0, len(names))),
                fixed_time=rng.choice([0.0, rng.uniform(0, 5)]),
            )
            for j in range(replicas)
        ),
        {name: 0.1 * GB for name in names},
        affinity=rng.choice([0.0, 0.05, 0.5]),
        swap_bandwidth=rng.choice([1 * GB, 16 * GB]),
    )


def _brute_force(problem: Problem, *, hard: bool) -> float | None:
    """The least makespan over every placement (each replica holding exactly what its
    requests need), among those within memory when `hard`; None if none is."""
    best = None
    workers = [r.worker for r in problem.replicas]
    for combo in itertools.product(workers, repeat=len(problem.candidates)):
        placement = dict(zip((c.request_id for c in problem.candidates), combo, strict=True))
        adapters = {w: set(r.pinned) for w, r in zip(workers, problem.replicas, strict=True)}
        for candidate in problem.candidates:
            if candidate.adapter is not None:
                adapters[placement[candidate.request_id]].add(candidate.adapter)
        plan = _with(
            problem,
            identity(problem),
            placement=placement,
            adapters={w: frozenset(a) for w, a in adapters.items()},
            relaxed=not hard,
        )
        if not violations(problem, plan) and (best is None or plan.makespan < best):
            best = plan.makespan
    return best


def _one_request(problem: Problem) -> float:
    """The most one request can add to a replica: gamma L_i + its KV swapped."""
    gamma = problem.migration_factor
    return max(gamma * c.exec_time + c.memory / problem.swap_bandwidth for c in problem.candidates)


def test_exact_plan_matches_brute_force_and_relaxed_is_within_one_request():
    """The exact plan's makespan is the brute-force optimum to 1% (the tie-breaking term's
    bound, module docstring). The relaxed plan, argmax-rounded, is at most one request's
    worth (max gamma L_i + M_i / B) above the relaxed brute-force optimum, itself at most
    the exact optimum: rounding sends a few fractional requests whole to one replica.
    Measured on these cases: at most 0.55 of one request, most often 0."""
    rng = random.Random(20240)
    for _ in range(40):
        problem = _random_problem(
            rng, replicas=rng.choice([2, 3]), requests=rng.randint(1, 5), ample=rng.random() < 0.5
        )
        exact, relaxed = solve(problem, relax=False), solve(problem, relax=True)
        hard, soft = _brute_force(problem, hard=True), _brute_force(problem, hard=False)
        assert soft is not None and relaxed.makespan <= soft + _one_request(problem) + 1e-9
        assert violations(problem, relaxed) == []
        if hard is None:  # no placement fits: the exact plan is the identity, with a warning
            assert exact.status == "identity"
            continue
        assert soft <= hard + 1e-9
        assert hard - 1e-9 <= exact.makespan <= hard * 1.01 + 1e-9
        assert violations(problem, exact) == []
        assert relaxed.makespan <= exact.makespan + _one_request(problem) + 1e-9


# --- random problems through hypothesis ---------------------------------------------------


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    replicas, requests = draw(st.integers(1, 4)), draw(st.integers(0, 12))
    return _random_problem(
        random.Random(seed), replicas=replicas, requests=requests, ample=draw(st.booleans())
    )


@settings(max_examples=25, deadline=None)
@given(problems(), st.booleans())
def test_every_plan_solve_returns_is_valid(problem, relax):
    """A relaxed plan meets every constraint but memory, which it may exceed (the excess is
    swapped and charged); the checker accepts that because plan.relaxed. An exact plan
    meets all of them, unless no placement fits the memory: then it is the identity plan,
    and memory is all it breaks. Neither is worse than nobody moving (the exact one by at
    most the tie-breaking term's 1%, where the identity fits)."""
    plan = solve(problem, relax=relax)
    assert plan.relaxed is relax
    assert set(plan.placement) == {c.request_id for c in problem.candidates}
    found = violations(problem, plan)
    if plan.status == "identity" and not relax:
        assert all(v.startswith("memory:") for v in found), found
    else:
        assert found == []
    nobody_moves = identity(problem, relaxed=relax)
    if relax:
        assert plan.makespan <= nobody_moves.makespan + 1e-9
    elif not violations(problem, nobody_moves):
        assert plan.makespan <= nobody_moves.makespan * 1.01 + 1e-9


# --- failure: never raise -----------------------------------------------------------------


def test_infeasible_exact_problem_returns_the_identity_with_a_warning(caplog):
    # 3 GB of KV and 2 GB of memory in all: no placement fits.
    problem = Problem(
        (req("a", "w0", 1, memory=1.5 * GB), req("b", "w0", 1, memory=1.5 * GB)),
        (rep("w0", memory=1 * GB), rep("w1", memory=1 * GB)),
        {},
    )
    with caplog.at_level(logging.WARNING, logger="router.migration"):
        plan = solve(problem, relax=False)
    assert plan.status == "identity" and plan.moves(problem) == []
    assert "nobody moves" in caplog.text
    assert solve(problem, relax=True).status in {"optimal", "identity"}  # soft: always solvable


def test_a_time_limit_too_short_still_returns_a_valid_plan(caplog):
    problem = _large_problem(random.Random(3), replicas=4, requests=100, adapters=20)
    with caplog.at_level(logging.WARNING, logger="router.migration"):
        plan = solve(problem, relax=False, time_limit=1e-3)
    assert plan.status in {"identity", "time_limit"}
    assert "co-migration" in caplog.text
    assert [v for v in violations(problem, plan) if not v.startswith("memory:")] == []


# --- how long a decision takes ------------------------------------------------------------


def _large_problem(rng: random.Random, *, replicas: int, requests: int, adapters: int):
    """An imbalanced cluster: most requests on the first replica, KV 0.1-0.5 GB each."""
    names = [f"a{k}" for k in range(adapters)]
    return Problem(
        tuple(
            req(
                f"r{i}",
                "w0" if rng.random() < 0.6 else f"w{rng.randrange(replicas)}",
                rng.uniform(0.5, 10),
                adapter=rng.choice(names) if rng.random() < 0.9 else None,
                memory=rng.uniform(0.1, 0.5) * GB,
                running=rng.random() < 0.5,
            )
            for i in range(requests)
        ),
        tuple(
            rep(f"w{j}", memory=40 * GB, adapters=rng.sample(names, adapters // replicas))
            for j in range(replicas)
        ),
        {name: 0.05 * GB for name in names},
    )


def test_top_k_of_eight_workers_is_four_replicas():
    loads = {f"w{j}": float(j * j % 7) for j in range(8)}  # 0 1 4 2 2 4 1 0
    assert select_replicas(loads, 2) == ["w2", "w5", "w0", "w7"]


@pytest.mark.serial
@pytest.mark.parametrize("replicas, requests, adapters", [(2, 200, 20), (4, 100, 20)])
def test_a_decision_takes_well_under_a_second(replicas, requests, adapters):
    """2 replicas x 200 candidates, and the 4 replicas top-K=2 picks (each side) x 100, 20
    adapters: typically 15-30 ms here (2 shared cores), the worst of 5 well under 0.3 s;
    the bound is 1 s so that a loaded machine does not make the test flaky (-s prints)."""
    rng = random.Random(7)
    worst = 0.0
    for _ in range(5):
        problem = _large_problem(rng, replicas=replicas, requests=requests, adapters=adapters)
        started = time.perf_counter()
        plan = solve(problem)
        worst = max(worst, time.perf_counter() - started)
        assert plan.status == "optimal" and violations(problem, plan) == []
        assert plan.makespan < 0.8 * identity(problem).makespan
    print(
        f"\nsolve(): {replicas} replicas x {requests} candidates: worst of 5 {worst * 1e3:.1f} ms"
    )
    assert worst < 1.0
