"""Routing policies: which worker serves a new request.

The router keeps one `WorkerStats` snapshot per worker (its GetStats answer: the ranks
of the running batch, the queued requests, free decode slots, the adapters on its
device, whether its health check passes) and asks a policy to `choose` one for each
arriving request. Every policy sees the same candidates: the healthy workers, in the
router's fixed order; an unhealthy worker is never chosen, and with none healthy
`choose` raises NoHealthyWorker (UNAVAILABLE to the client). The router is expected to
pass only workers of the request's base model (jlora serves one base model per router).

Policies, by their `--policy` name (`POLICIES`, `make_policy`):

- rank-aware: Toppings §5 / CaraServe §5, Algorithm 1, with the fitted performance
  models of `router.perf_model` (see `RankAware`).
- shortest-pending: dLoRA §5.1's dispatcher, the shortest estimated pending time (see
  `ShortestPending`).
- most-idle, first-fit, random: the baselines of Toppings §7.4 and CaraServe §7.5.

Ranks are ints >= 0 (0: a request for the base model, no adapter); times are ms.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import ClassVar, TypeVar

from router.perf_model import PerfProfile

_T = TypeVar("_T")


class PolicyError(ValueError):
    """A bad policy name or option, request or worker snapshot; the message names the field."""


class NoHealthyWorker(RuntimeError):
    """No candidate worker is healthy: the request cannot be routed now."""


@dataclasses.dataclass(frozen=True)
class QueuedRequest:
    """A request waiting in a worker's queue: its adapter's rank and its prompt length."""

    rank: int
    prompt_tokens: int

    def __post_init__(self) -> None:
        _check_int("QueuedRequest.rank", self.rank, minimum=0)
        _check_int("QueuedRequest.prompt_tokens", self.prompt_tokens, minimum=1)


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a new request: the rank of its adapter (from the registry;
    0 for the base model), its prompt length, and the adapter's name (None: base model)."""

    rank: int
    prompt_tokens: int
    adapter: str | None = None

    def __post_init__(self) -> None:
        _check_int("RouteRequest.rank", self.rank, minimum=0)
        _check_int("RouteRequest.prompt_tokens", self.prompt_tokens, minimum=1)
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise PolicyError(f"RouteRequest.adapter={self.adapter!r} must be a name or None")


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A snapshot of one worker (Algorithm 1's `instance.GetStats()`).

    worker_id: the router's name for it. running: the ranks of the running (decoding)
    batch. queued: the requests waiting for a slot or their prefill, oldest first.
    free_slots: decode slots not in use. resident_adapters: names of the adapters on
    the device (no load needed). healthy: the worker may be sent a request: its last
    health check passed, it is not draining and its queue is not full (the router
    folds all three in, so that no policy sends a request to be refused).
    Sequences are stored as tuples, the adapter names as a frozenset.
    """

    worker_id: str
    running: tuple[int, ...] = ()
    queued: tuple[QueuedRequest, ...] = ()
    free_slots: int = 0
    resident_adapters: frozenset[str] = frozenset()
    healthy: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise PolicyError(f"WorkerStats.worker_id={self.worker_id!r} must be a non-empty str")
        object.__setattr__(self, "running", tuple(self.running))
        object.__setattr__(self, "queued", tuple(self.queued))
        object.__setattr__(self, "resident_adapters", frozenset(self.resident_adapters))
        where = f"(worker {self.worker_id!r})"
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.running):
            raise PolicyError(f"WorkerStats.running={self.running!r} {where} must hold ranks >= 0")
        if not all(isinstance(queued, QueuedRequest) for queued in self.queued):
            raise PolicyError(
                f"WorkerStats.queued={self.queued!r} {where} must hold QueuedRequest items"
            )
        _check_int("WorkerStats.free_slots", self.free_slots, minimum=0, where=where)
        if not isinstance(self.healthy, bool):
            raise PolicyError(f"WorkerStats.healthy={self.healthy!r} {where} must be a bool")

    @property
    def num_requests(self) -> int:
        """Requests on the worker: running plus queued (Algorithm 1, line 7)."""
        return len(self.running) + len(self.queued)


class Policy(abc.ABC):
    """Chooses a worker for each request among the healthy ones."""

    name: ClassVar[str]

    def choose(self, request: RouteRequest, workers: Sequence[WorkerStats]) -> WorkerStats:
        """The worker to serve `request`; NoHealthyWorker if no worker is healthy."""
        candidates = [worker for worker in workers if worker.healthy]
        if not candidates:
            raise NoHealthyWorker(
                f"no healthy worker among {len(workers)} "
                f"({', '.join(w.worker_id for w in workers) or 'none registered'})"
            )
        return self._pick(request, candidates)

    @abc.abstractmethod
    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        """The choice among `candidates`: healthy, at least one, in the router's order."""


@dataclasses.dataclass(frozen=True)
class Cost:
    """Algorithm 1's numbers for one candidate.

    cost: CalcCost's cost_score (inf when penalised). total_cost: cost × requests (inf
    when penalised, even on an idle worker, where the paper's inf × 0 would be NaN).
    decode_ms: DecPerf(exists + req), the predicted decode iteration after admission,
    compared with the SLO.
    """

    cost: float
    total_cost: float
    decode_ms: float

    @property
    def penalised(self) -> bool:
        return math.isinf(self.cost)


@dataclasses.dataclass(frozen=True)
class RankAware(Policy):
    """Toppings §5 "Scheduling requests across inference servers", Algorithm 1:

        for instance in candidates:
            running_batch, queue = instance.GetStats()
            cost = CalcCost(i, running_batch, queue)
            requests = len(running_batch) + len(queue)
            instance.total_cost = cost * requests
        best = min(candidates, key=lambda x: x.total_cost)

        CalcCost(req, running_batch, queue):
            exists = running_batch + queue
            Δprefill = PrePerf(queue + req) - PrePerf(queue)
            Δdecode = DecPerf(exists + req) - DecPerf(exists)
            cost_score = Δprefill / avg_resp_len + Δdecode
            if DecPerf(exists + req) > SLO: cost_score += inf

    The new prefill stalls the worker once, Δdecode slows every later step: dividing
    Δprefill by avg_resp_len spreads the stall over a response's tokens, a per-token
    cost comparable with Δdecode. Multiplying by `requests` weighs the slowdown by how
    many requests suffer it, so an idle worker costs 0 and wins unless it would break
    the SLO. Ties go to the first
    candidate, as Python's min does. PrePerf and DecPerf are the profile's prefill and
    decode models; an empty batch costs 0 (`PerfModel.predict`).

    When every candidate is penalised the paper's min() returns the first one, whatever
    its load. jlora instead picks the candidate whose decode iteration after admission,
    DecPerf(exists + req), is shortest: the smallest SLO violation, so the request is
    still served (the router drops nothing) where it hurts least.

    slo_ms: the decode-latency (time per token) SLO. avg_resp_len: the average response
    length in tokens.
    """

    name: ClassVar[str] = "rank-aware"
    profile: PerfProfile
    slo_ms: float
    avg_resp_len: float

    def __post_init__(self) -> None:
        _check_profile(self.profile, self.name)
        _check_number("slo_ms", self.slo_ms, positive=True)
        _check_number("avg_resp_len", self.avg_resp_len, positive=True)

    def cost(self, request: RouteRequest, worker: WorkerStats) -> Cost:
        """CalcCost and total_cost of sending `request` to `worker`."""
        prefill, decode = self.profile.prefill, self.profile.decode
        queue_ranks = [queued.rank for queued in worker.queued]
        queue_tokens = [queued.prompt_tokens for queued in worker.queued]
        delta_prefill = prefill.predict(
            [*queue_ranks, request.rank], [*queue_tokens, request.prompt_tokens]
        ) - prefill.predict(queue_ranks, queue_tokens)
        exists = [*worker.running, *queue_ranks]
        decode_after = decode.predict([*exists, request.rank])
        delta_decode = decode_after - decode.predict(exists)
        if decode_after > self.slo_ms:
            return Cost(math.inf, math.inf, decode_after)
        cost = delta_prefill / self.avg_resp_len + delta_decode
        return Cost(cost, cost * worker.num_requests, decode_after)

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        costs = [self.cost(request, worker) for worker in candidates]
        if all(cost.penalised for cost in costs):
            best = min(range(len(costs)), key=lambda i: costs[i].decode_ms)
        else:
            best = min(range(len(costs)), key=lambda i: costs[i].total_cost)
        return candidates[best]


@dataclasses.dataclass(frozen=True)
class ShortestPending(Policy):
    """dLoRA §5.1: "dLoRA calculates an estimated pending time for each replica, which
    includes the time to load the LoRA adapter (if not already loaded) and the estimated
    queuing time on this replica ... [and] dispatches requests to the replica with the
    shortest estimated pending time".

    dLoRA does not say how it estimates the queuing time; jlora uses the profile:

        pending = load + PrePerf(queue) + slot_wait

    load: `adapter_load_ms` unless the adapter is resident on the worker (0 for the base
    model). PrePerf(queue): prefilling the requests ahead. slot_wait: if the queue plus
    this request (k more than the free slots) must wait for slots, the running batch
    (with the queued requests that do get slots) frees them at its size / avg_resp_len
    per decode iteration (each request stays about avg_resp_len iterations), so
    slot_wait = k · avg_resp_len / batch · DecPerf(batch); infinite if nothing runs.
    Ties go to the first candidate.
    """

    name: ClassVar[str] = "shortest-pending"
    profile: PerfProfile
    avg_resp_len: float
    adapter_load_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_profile(self.profile, self.name)
        _check_number("avg_resp_len", self.avg_resp_len, positive=True)
        _check_number("adapter_load_ms", self.adapter_load_ms, positive=False)

    def pending_ms(self, request: RouteRequest, worker: WorkerStats) -> float:
        """The estimated time `request` would wait on `worker` before its prefill runs."""
        resident = request.adapter is None or request.adapter in worker.resident_adapters
        load = 0.0 if resident else self.adapter_load_ms
        queue_ranks = [queued.rank for queued in worker.queued]
        queue_tokens = [queued.prompt_tokens for queued in worker.queued]
        prefill_ahead = self.profile.prefill.predict(queue_ranks, queue_tokens)
        waiting = len(worker.queued) + 1 - worker.free_slots
        if waiting <= 0:
            return load + prefill_ahead
        batch = [*worker.running, *queue_ranks[: worker.free_slots]]
        if not batch:
            return math.inf
        iterations = waiting * self.avg_resp_len / len(batch)
        return load + prefill_ahead + iterations * self.profile.decode.predict(batch)

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        return min(candidates, key=lambda worker: self.pending_ms(request, worker))


@dataclasses.dataclass(frozen=True)
class MostIdle(Policy):
    """CaraServe §7.5: "selects the inference server that has the least workload": the
    fewest requests (running + queued), then the most free slots, then the first."""

    name: ClassVar[str] = "most-idle"

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        return min(candidates, key=lambda worker: (worker.num_requests, -worker.free_slots))


@dataclasses.dataclass(frozen=True)
class FirstFit(Policy):
    """Toppings §7.4: "picks a server following the first-fit bin-packing strategy" (as
    Punica does): the first worker, in the router's order, with a free slot for the
    request (free_slots > queued). When none has room, the one whose queue overflows its
    free slots the least, then the first."""

    name: ClassVar[str] = "first-fit"

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        return min(
            candidates, key=lambda worker: max(0, len(worker.queued) + 1 - worker.free_slots)
        )


@dataclasses.dataclass(frozen=True)
class RandomChoice(Policy):
    """Toppings §7.4: "randomly picks an inference server", uniformly among the healthy
    ones, from a generator seeded with `seed` (the same seed, the same choices)."""

    name: ClassVar[str] = "random"
    seed: int = 0
    _rng: random.Random = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("seed", self.seed, minimum=0)
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        return self._rng.choice(candidates)


POLICIES: dict[str, type[Policy]] = {
    policy.name: policy for policy in (RankAware, ShortestPending, MostIdle, FirstFit, RandomChoice)
}


def make_policy(
    name: str,
    *,
    profile: PerfProfile | None = None,
    slo_ms: float | None = None,
    avg_resp_len: float | None = None,
    adapter_load_ms: float = 0.0,
    seed: int = 0,
) -> Policy:
    """The policy `--policy name` selects, from the options it uses (others are ignored).

    rank-aware needs profile, slo_ms and avg_resp_len; shortest-pending needs profile and
    avg_resp_len (and adapter_load_ms); random uses seed. PolicyError names what is wrong.
    """
    if name not in POLICIES:
        raise PolicyError(f"policy={name!r} must be one of {', '.join(POLICIES)}")
    if name == RankAware.name:
        return RankAware(
            _required(profile, "profile", name),
            _required(slo_ms, "slo_ms", name),
            _required(avg_resp_len, "avg_resp_len", name),
        )
    if name == ShortestPending.name:
        return ShortestPending(
            _required(profile, "profile", name),
            _required(avg_resp_len, "avg_resp_len", name),
            adapter_load_ms,
        )
    if name == RandomChoice.name:
        return RandomChoice(seed)
    return POLICIES[name]()


def _required(value: _T | None, field: str, policy: str) -> _T:
    if value is None:
        hint = " (`jlora profile` writes one)" if field == "profile" else ""
        raise PolicyError(f"{field}=None: the {policy} policy needs it{hint}")
    return value


def _check_profile(profile: object, policy: str) -> None:
    if not isinstance(profile, PerfProfile):
        raise PolicyError(f"profile={profile!r}: the {policy} policy needs a PerfProfile")


def _check_number(field: str, value: object, *, positive: bool) -> None:
    """PolicyError unless `value` is a finite number > 0 (positive) or >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise PolicyError(
            f"{field}={value!r} must be a finite number {'>' if positive else '>='} 0"
        )


def _check_int(field: str, value: object, *, minimum: int, where: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        where = f" {where}" if where else ""
        raise PolicyError(f"{field}={value!r}{where} must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class ResidentFirst(Policy):
    """dLoRA §5.1's short-term rule over another policy: among the workers with the
    request's adapter on their device and a decode slot for it (free slots beyond their
    queue), `inner` chooses; if there are none, `inner` chooses among all. The router
    uses it with migration or preloading on, unless the policy is shortest-pending, whose
    pending time already charges the load of an adapter that is not resident."""

    name: ClassVar[str] = "resident-first"
    inner: Policy

    def _pick(self, request: RouteRequest, candidates: Sequence[WorkerStats]) -> WorkerStats:
        if request.adapter is not None:
            holding = [
                worker
                for worker in candidates
                if request.adapter in worker.resident_adapters
                and worker.free_slots > len(worker.queued)
            ]
            if holding:
                return self.inner.choose(request, holding)
        return self.inner.choose(request, candidates)
