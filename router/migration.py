"""dLoRA §5.2, request-adapter co-migration: which requests move where, which adapters load.

Semantics. `solve` places the candidate requests of a few replicas so as to minimise the
makespan, the paper's "overall running time ... the maximum running time of all replicas":

    min z  s.t. for each replica j, request i, adapter k:
      z >= fixed_time_j + sum_i gamma_ij L_i x_ij                    (execution)
           + sum_k (eta + [k not resident on j] M_k^A / B) y_kj      (affinity, loading)
           + e_j                                                     (swapping; relax only)
      sum_j x_ij = 1                                                 (existence)
      x_ij <= y_{k(i),j}  for requests with an adapter               (matching)
      fixed_memory_j + sum_i M_i^R x_ij + sum_k M_k^A y_kj <= M_j^G   (memory; relax=False)
      e_j >= (that same memory - M_j^G) / B,  e_j >= 0               (memory; relax=True)

How jlora reads the paper:

- gamma "account[s] for the migration time of request i ... inhibiting the frequent
  migration": applied to every x_ij it would be a constant factor that inhibits nothing,
  so gamma_ij = 1 where request i is now and `migration_factor` elsewhere (or
  `queued_migration_factor` for a request not prefilled yet).
- eta, "a penalty term η Σ_k y_k,j to represent the affinity among the same type of
  requests", charges every adapter a replica serves, resident or not: one more adapter
  type costs batching whenever it arrived. Keeping a resident adapter costs no loading;
  loading a new one adds M_k^A / B (one copy serves every request moved for it, which
  gamma, per request, cannot say). y = 0 on a resident adapter means evictable: the
  worker's LRU frees it when it needs the room. eta defaults to 0.05 s, about two decode
  iterations of a 7B model: small next to a request's seconds of work, so it never blocks
  a balancing move, yet it keeps an adapter's requests together for a tiny gain.
- The relaxation: "the variable matrix x is relaxed to the real number ... request i is
  placed in replica j' if x_ij' = max_j x_ij", and memory beyond capacity "is swapped out
  to the host memory ... with only the swapping overhead added" (e_j). y stays binary.
  Each request goes to the argmax of its row (ties: where it is); a replica then holds
  exactly the adapters its requests need, its pinned ones and the resident ones the
  solution keeps, and the makespan is recomputed from that plan. A rounded plan worse
  than the identity plan is never returned.
- Ties: a makespan is indifferent to everything off the bottleneck, so a secondary term
  (1e-3 / replicas x the total work, plus a cost per move) makes the solver prefer fewer
  moves and adapters among plans of one makespan; it costs the exact plan under 1%.

Units: seconds and bytes. Should the solver find nothing within `time_limit` (or the hard
memory constraint be infeasible), `solve` logs a warning and returns the identity plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

log = logging.getLogger(__name__)

_TIE = 1e-3  # weight of the secondary objective (divided by the number of replicas)


def _check(field: str, value: object, *, positive: bool = False, minimum: float = 0.0) -> None:
    """ValueError unless `value` is a finite number >= minimum (> minimum with positive)."""
    bound = f"{'>' if positive else '>='} {minimum}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field}={value!r} must be a finite number {bound}")
    if not math.isfinite(value) or value < minimum or (positive and value == minimum):
        raise ValueError(f"{field}={value!r} must be a finite number {bound}")


def _check_name(field: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}={value!r} must be a non-empty str")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One request the plan may place (queued or running on `worker`).

    exec_time: L_i, seconds of work it still needs. memory: M_i^R, bytes of KV it holds
    or will hold. running: prefilled already (moving it costs a re-prefill). adapter:
    None for the base model (it needs no adapter).
    """

    request_id: str
    adapter: str | None
    worker: str
    exec_time: float
    memory: float
    running: bool

    def __post_init__(self) -> None:
        _check_name("Candidate.request_id", self.request_id)
        if self.adapter is not None:
            _check_name("Candidate.adapter", self.adapter)
        _check_name("Candidate.worker", self.worker)
        _check("Candidate.exec_time", self.exec_time)
        _check("Candidate.memory", self.memory)
        if not isinstance(self.running, bool):
            raise ValueError(f"Candidate.running={self.running!r} must be a bool")


@dataclasses.dataclass(frozen=True)
class Replica:
    """One worker taking part: M_j^G = `memory` device bytes for KV + adapters, the
    adapters resident on its device now, and the work on it the plan does not move
    (`fixed_time` seconds, `fixed_memory` bytes of KV; adapter bytes count through y).
    pinned: adapters that must stay (the unmoved work uses them); y = 1 for them.
    """

    worker: str
    memory: float
    adapters: frozenset[str]
    fixed_time: float = 0.0
    fixed_memory: float = 0.0
    pinned: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _check_name("Replica.worker", self.worker)
        _check("Replica.memory", self.memory)
        _check("Replica.fixed_time", self.fixed_time)
        _check("Replica.fixed_memory", self.fixed_memory)
        for field in ("adapters", "pinned"):
            names = frozenset(getattr(self, field))
            for name in names:
                _check_name(f"Replica.{field}", name)
            object.__setattr__(self, field, names)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The co-migration instance (Table 1's notation in the module docstring).

    adapter_memory: M_k^A for every adapter a candidate needs or a replica pins.
    migration_factor: gamma >= 1 for a moved running request; queued_migration_factor
    for a moved queued one (None: the same gamma, as the paper has one). affinity: eta
    seconds per adapter a replica serves. swap_bandwidth: B bytes/s, the host link (16e9:
    a conservative PCIe 4.0 x16 rate; pass the measured one).
    """

    candidates: tuple[Candidate, ...]
    replicas: tuple[Replica, ...]
    adapter_memory: Mapping[str, float]
    migration_factor: float = 1.2
    affinity: float = 0.05
    swap_bandwidth: float = 16e9
    queued_migration_factor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "adapter_memory", dict(self.adapter_memory))
        if not self.replicas:
            raise ValueError("Problem.replicas=() must name at least one replica")
        workers = [replica.worker for replica in self.replicas]
        _no_duplicates("Problem.replicas (worker)", workers)
        _no_duplicates("Problem.candidates (request_id)", [c.request_id for c in self.candidates])
        for name, size in self.adapter_memory.items():
            _check(f"Problem.adapter_memory[{name!r}]", size)
        for candidate in self.candidates:
            if candidate.worker not in workers:
                raise ValueError(
                    f"Candidate.worker={candidate.worker!r} (request {candidate.request_id!r}) "
                    f"is not among Problem.replicas {workers}"
                )
        needed = {c.adapter for c in self.candidates if c.adapter is not None}
        needed |= {name for replica in self.replicas for name in replica.pinned}
        missing = sorted(needed - self.adapter_memory.keys())
        if missing:
            raise ValueError(f"Problem.adapter_memory lacks {missing} (needed or pinned)")
        _check("Problem.migration_factor", self.migration_factor, minimum=1.0)
        if self.queued_migration_factor is not None:
            _check("Problem.queued_migration_factor", self.queued_migration_factor, minimum=1.0)
        _check("Problem.affinity", self.affinity)
        _check("Problem.swap_bandwidth", self.swap_bandwidth, positive=True)

    def gamma(self, candidate: Candidate, worker: str) -> float:
        """gamma_ij: 1 where the request is now, the migration factor elsewhere."""
        if worker == candidate.worker:
            return 1.0
        if candidate.running or self.queued_migration_factor is None:
            return self.migration_factor
        return self.queued_migration_factor


def _no_duplicates(field: str, names: Iterable[str]) -> None:
    dupes = sorted(name for name, count in Counter(names).items() if count > 1)
    if dupes:
        raise ValueError(f"{field} repeats {dupes}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A solution: where every candidate goes and the adapters each worker must hold.

    makespan: the objective recomputed from this plan (max of `loads`), not the LP's.
    relaxed: solved with relax=True (x rounded; memory beyond capacity is swapped).
    status: "optimal" (within the solver's gap), "time_limit" (the best found in time),
    "identity" (nobody moves: the solver found nothing, or rounding was no better).
    """

    placement: Mapping[str, str]
    adapters: Mapping[str, frozenset[str]]
    makespan: float
    solve_seconds: float
    relaxed: bool
    status: str = "optimal"

    def moves(self, problem: Problem) -> list[tuple[str, str, str]]:
        """(request_id, from, to) for every candidate whose worker changes, in order."""
        return [
            (c.request_id, c.worker, self.placement[c.request_id])
            for c in problem.candidates
            if self.placement[c.request_id] != c.worker
        ]

    def loads(self, problem: Problem) -> dict[str, float]:
        """Each replica's running time under the plan, the objective's terms: fixed time,
        gamma-scaled execution, eta and loading per adapter, and the swap time of the
        memory beyond capacity (zero for a plan that fits)."""
        bandwidth = problem.swap_bandwidth
        seconds = {r.worker: r.fixed_time for r in problem.replicas}
        memory = {r.worker: r.fixed_memory for r in problem.replicas}
        for candidate in problem.candidates:
            worker = self.placement[candidate.request_id]
            seconds[worker] += problem.gamma(candidate, worker) * candidate.exec_time
            memory[worker] += candidate.memory
        for replica in problem.replicas:
            for name in self.adapters.get(replica.worker, frozenset()):
                size = problem.adapter_memory.get(name, 0.0)
                memory[replica.worker] += size
                load = 0.0 if name in replica.adapters else size / bandwidth
                seconds[replica.worker] += problem.affinity + load
            excess = max(0.0, memory[replica.worker] - replica.memory)
            seconds[replica.worker] += excess / bandwidth
        return seconds


def _plan(
    problem: Problem,
    placement: dict[str, str],
    kept: Mapping[str, Iterable[str]],
    started: float,
    *,
    relaxed: bool,
    status: str,
) -> Plan:
    """The plan for `placement`: each replica holds the adapters its requests need, its
    pinned ones and the resident ones in `kept`; the makespan recomputed."""
    adapters = {
        r.worker: set(r.pinned) | (set(kept.get(r.worker, ())) & r.adapters)
        for r in problem.replicas
    }
    for candidate in problem.candidates:
        if candidate.adapter is not None:
            adapters[placement[candidate.request_id]].add(candidate.adapter)
    frozen = {worker: frozenset(names) for worker, names in adapters.items()}
    plan = Plan(placement, frozen, 0.0, time.perf_counter() - started, relaxed, status)
    return dataclasses.replace(plan, makespan=max(plan.loads(problem).values()))


def identity_plan(problem: Problem, *, relaxed: bool = False) -> Plan:
    """Nobody moves: each replica holds its requests' adapters and its pinned ones."""
    placement = {c.request_id: c.worker for c in problem.candidates}
    return _plan(problem, placement, {}, time.perf_counter(), relaxed=relaxed, status="identity")


def solve(problem: Problem, *, relax: bool = True, time_limit: float = 1.0) -> Plan:
    """The co-migration plan minimising the makespan (module docstring), solved with HiGHS
    through `scipy.optimize.milp` within `time_limit` seconds. relax=True is the paper's
    fast form (x real, memory soft; the MIP gap on y is 1%, about what rounding x moves the
    makespan by); relax=False the exact ILP with hard memory (HiGHS's default gap, 0.01%).
    Never raises on a valid Problem: on failure it returns the identity plan, warning."""
    started = time.perf_counter()
    _check("time_limit", time_limit, positive=True)
    candidates, replicas = problem.candidates, problem.replicas
    identity = identity_plan(problem, relaxed=relax)
    if not candidates:
        return dataclasses.replace(identity, status="optimal")
    names = sorted(
        {c.adapter for c in candidates if c.adapter is not None}
        | {name for r in replicas for name in r.pinned}
    )
    n, m, kinds = len(candidates), len(replicas), len(names)
    bandwidth = problem.swap_bandwidth
    work = np.array([c.exec_time for c in candidates])
    swap = np.array([c.memory for c in candidates]) / bandwidth  # seconds to move its KV
    size = np.array([problem.adapter_memory[name] for name in names]) / bandwidth
    index = {r.worker: j for j, r in enumerate(replicas)}
    moved = np.arange(m)[None, :] != np.array([index[c.worker] for c in candidates])[:, None]
    # c[i, j] = gamma_ij * L_i; a[k, j] = eta + M_k^A / B unless k is resident on j.
    exec_cost = np.array([[problem.gamma(c, r.worker) for r in replicas] for c in candidates])
    exec_cost *= work[:, None]
    resident = np.array([[name in r.adapters for r in replicas] for name in names], bool)
    adapter_cost = problem.affinity + np.where(resident, 0.0, size[:, None]).reshape(kinds, m)

    # Columns x[i, j] (row-major), y[k, j], e[j] (relax only), z; the rows are blocks of
    # sparse.bmat. `to_replica` [m, count*m] sums the (., j) columns into row j.
    eye = sparse.eye_array(m)
    to_replica = {count: sparse.kron(np.ones((1, count)), eye) for count in (n, kinds)}
    with_adapter = [i for i, c in enumerate(candidates) if c.adapter is not None]
    which = np.zeros((len(with_adapter), kinds))  # one-hot: request -> its adapter
    for row, i in enumerate(with_adapter):
        which[row, names.index(candidates[i].adapter)] = 1  # type: ignore[arg-type]
    select = sparse.eye_array(n, format="csr")[with_adapter]
    blocks = [
        # Load: sum_i c_ij x_ij + sum_k a_kj y_kj (+ e_j) - z <= -fixed_time_j.
        [
            to_replica[n].multiply(exec_cost.ravel()),
            to_replica[kinds].multiply(adapter_cost.ravel()),
            eye,
            -np.ones((m, 1)),
        ],
        # Existence: sum_j x_ij = 1.
        [sparse.kron(sparse.eye_array(n), np.ones((1, m))), None, None, None],
        # Matching: x_ij - y_{k(i),j} <= 0 for each request with an adapter, each replica.
        [sparse.kron(select, eye), -sparse.kron(which, eye), None, None],
        # Memory in seconds at B (well conditioned): hard, or its excess e_j >= 0 swapped.
        [
            to_replica[n].multiply(np.repeat(swap, m)),
            to_replica[kinds].multiply(np.repeat(size, m)),
            -eye,
            None,
        ],
    ]
    ne = m if relax else 0
    matrix = sparse.bmat([row if relax else row[:2] + row[3:] for row in blocks], format="csr")
    matched = len(with_adapter) * m
    lower = np.concatenate([np.full(m, -np.inf), np.ones(n), np.full(matched + m, -np.inf)])
    upper = np.concatenate(
        [
            [-r.fixed_time for r in replicas],
            np.ones(n),
            np.zeros(matched),
            [(r.memory - r.fixed_memory) / bandwidth for r in replicas],
        ]
    )

    # The secondary objective (ties): total work plus a cost per move, weighted _TIE / m.
    tie = _TIE / m
    unit = max(float(np.mean(work + swap)), 1e-6)
    moving = moved * (work + swap + unit)[:, None]
    objective = np.concatenate([(exec_cost + moving).ravel(), adapter_cost.ravel(), np.ones(ne)])
    objective = np.append(tie * objective, 1.0)
    pinned = [name in r.pinned for name in names for r in replicas]
    bounds = Bounds(
        np.concatenate([np.zeros(n * m), pinned, np.zeros(ne + 1)]),
        np.concatenate([np.ones((n + kinds) * m), np.full(ne + 1, np.inf)]),
    )
    integrality = np.concatenate(
        [np.full(n * m, 0 if relax else 1), np.ones(kinds * m), np.zeros(ne + 1)]
    )
    options = {"time_limit": time_limit, **({"mip_rel_gap": 1e-2} if relax else {})}
    try:
        result = milp(
            objective,
            integrality=integrality,
            bounds=bounds,
            constraints=LinearConstraint(matrix, lower, upper),
            options=options,
        )
    except (ValueError, RuntimeError) as error:  # HiGHS refusing the model: never raise
        result = None
        log.warning("co-migration solver failed (%s): nobody moves", error)
    if result is not None and result.x is None:
        log.warning("co-migration found no plan (%s): nobody moves", result.message)
    if result is None or result.x is None:
        return dataclasses.replace(identity, solve_seconds=time.perf_counter() - started)
    status = "optimal" if result.status == 0 else "time_limit"
    if status != "optimal":
        log.warning("co-migration stopped at its %s s limit: the best plan found", time_limit)
    x = result.x[: n * m].reshape(n, m)
    choice = np.argmax(x + 1e-9 * ~moved, axis=1)  # the row's argmax; ties: stay
    placement = {c.request_id: replicas[j].worker for c, j in zip(candidates, choice, strict=True)}
    keep = result.x[n * m : (n + kinds) * m].reshape(kinds, m) > 0.5
    kept = {
        r.worker: [names[k] for k in np.flatnonzero(keep[:, j])] for j, r in enumerate(replicas)
    }
    plan = _plan(problem, placement, kept, started, relaxed=relax, status=status)
    if relax and plan.makespan > identity.makespan:
        return dataclasses.replace(identity, solve_seconds=time.perf_counter() - started)
    return plan


def violations(problem: Problem, plan: Plan, *, tolerance: float = 1e-6) -> list[str]:
    """Every constraint of the model the plan breaks, each named; [] for a valid plan.

    Plain arithmetic, independent of the solver. Checked: existence (every candidate
    placed once, no unknown request, on a known replica), matching (each placed request's
    adapter held by its replica; pinned adapters held; every adapter known), memory (hard
    unless `plan.relaxed`: a relaxed plan may exceed capacity, the excess being swapped and
    charged in its loads) and the makespan (the max of the plan's loads, to `tolerance`
    relative).
    """
    found: list[str] = []
    workers = {r.worker: r for r in problem.replicas}
    ids = {c.request_id for c in problem.candidates}
    for request_id in sorted(plan.placement.keys() - ids):
        found.append(f"existence: unknown request {request_id!r} placed")
    for candidate in problem.candidates:
        worker = plan.placement.get(candidate.request_id)
        if worker is None:
            found.append(f"existence: request {candidate.request_id!r} not placed")
        elif worker not in workers:
            found.append(
                f"existence: request {candidate.request_id!r} on unknown worker {worker!r}"
            )
        elif candidate.adapter is not None and candidate.adapter not in plan.adapters.get(
            worker, frozenset()
        ):
            found.append(
                f"matching: request {candidate.request_id!r} on {worker!r} needs adapter "
                f"{candidate.adapter!r}, which it does not hold"
            )
    for worker in sorted(plan.adapters.keys() - workers.keys()):
        found.append(f"adapters: unknown worker {worker!r}")
    for replica in problem.replicas:
        held = plan.adapters.get(replica.worker, frozenset())
        for name in sorted(replica.pinned - held):
            found.append(f"matching: {replica.worker!r} drops pinned adapter {name!r}")
        for name in sorted(held - problem.adapter_memory.keys()):
            found.append(f"adapters: {replica.worker!r} holds {name!r}, whose size is unknown")
    if found:
        return found  # the memory and makespan sums need a complete plan
    for replica in problem.replicas:
        used = replica.fixed_memory + sum(
            problem.adapter_memory[name] for name in plan.adapters.get(replica.worker, ())
        )
        used += sum(
            c.memory for c in problem.candidates if plan.placement[c.request_id] == replica.worker
        )
        if not plan.relaxed and used > replica.memory * (1 + tolerance):
            found.append(
                f"memory: {replica.worker!r} uses {used:.6g} bytes of {replica.memory:.6g}"
            )
    makespan = max(plan.loads(problem).values())
    if not math.isclose(plan.makespan, makespan, rel_tol=tolerance, abs_tol=1e-12):
        found.append(f"makespan: {plan.makespan!r} but the plan's loads give {makespan!r}")
    return found


def select_replicas(loads: Mapping[str, float], k: int) -> list[str]:
    """dLoRA §5.2: "dLoRA only considers migration between top K overloaded replicas and
    top K underloaded replicas": the K most loaded workers (most first), then the K least
    loaded (least first), distinct, so all of them when 2K >= len(loads). Ties by name."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1")
    for worker, load in loads.items():
        _check(f"loads[{worker!r}]", load)
    top = sorted(loads, key=lambda worker: (-loads[worker], worker))[:k]
    rest = sorted(set(loads) - set(top), key=lambda worker: (loads[worker], worker))
    return top + rest[:k]
