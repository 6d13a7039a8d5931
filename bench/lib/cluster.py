"""The simulated cluster of `bench.simulator`: the workload drawn from the Azure trace, one
instance's continuous batching and adapter loads, and the event loop that routes each
arrival through a router policy. What is modelled, and from which paper, is told step
by step in `bench.simulator`'s docstring; this module is its mechanics."""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.lib.workloads import DATA_DIR, read_trace, zipf_weights
from router.perf_model import PerfProfile
from router.policies import Policy, QueuedRequest, RouteRequest, WorkerStats

CONTEXT_TOKENS = 4096  # Llama-2's context: prompt + output
# A rank-r adapter of Llama-2-7B's q, k, v: 32 layers x 3 x (4096·r + r·4096) fp16 values.
ADAPTER_MIB_PER_RANK = 1.5
LINK_GBPS = 8.0  # host-to-device copies; CaraServe Fig. 3: "a few to tens of milliseconds"


# -- workload -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What `make_workload` draws: `rate` requests/s over the cluster for `duration_s`
    seconds of `trace` (conv or code), its prompts scaled to a mean of `prompt_mean`
    tokens (0: as they are); each request's rank uniform over `ranks`, its adapter one
    of that rank's `adapters / len(ranks)`, with Zipf(`zipf`) popularity; from `seed`."""

    rate: float
    duration_s: float = 600.0
    trace: str = "conv"
    adapters: int = 1000
    zipf: float = 1.1
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    seed: int = 0
    data_dir: Path = DATA_DIR
    prompt_mean: float = 70.0  # 0: the trace's own prompt lengths

    def __post_init__(self) -> None:
        for field in ("rate", "duration_s", "zipf"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field}={getattr(self, field)!r} must be > 0")
        if self.adapters < len(self.ranks) or not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"{self.adapters=} {self.ranks=}: ranks >= 1, an adapter each")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the workload; times in ms from the start."""

    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    adapter: str
    rank: int


_trace = functools.cache(read_trace)  # every run of a sweep's process reads it once


def make_workload(spec: WorkloadSpec) -> list[Request]:
    """The requests of `spec`, in arrival order (see the module docstring, step 1): the
    trace's first rate x duration requests (repeating the hour if need be), their
    times scaled so that the next one would arrive at `duration_s`."""
    trace = _trace(spec.trace, spec.data_dir)
    seconds, prompts, outputs = trace.arrival_s, trace.context_tokens, trace.generated_tokens
    if spec.prompt_mean > 0:
        prompts = np.maximum(1, np.rint(prompts * spec.prompt_mean / prompts.mean()))
    count = round(spec.rate * spec.duration_s)
    rows = np.arange(count + 1) % len(seconds)
    period = seconds[-1] * len(seconds) / (len(seconds) - 1)  # the hour and a mean gap
    timeline = seconds[rows] + period * (np.arange(count + 1) // len(seconds))
    arrivals_ms = timeline[:count] * (1000.0 * spec.duration_s / timeline[count])
    rng = np.random.default_rng(spec.seed)
    per_rank = math.ceil(spec.adapters / len(spec.ranks))
    popularity = zipf_weights(per_rank, spec.zipf)
    rank_of = rng.integers(len(spec.ranks), size=count)
    member = rng.choice(per_rank, size=count, p=popularity)
    requests = []
    for i in range(count):
        output = int(min(outputs[rows[i]], CONTEXT_TOKENS - 1))
        prompt = int(max(1, min(prompts[rows[i]], CONTEXT_TOKENS - output)))
        rank = spec.ranks[rank_of[i]]
        requests.append(
            Request(float(arrivals_ms[i]), prompt, max(1, output), f"r{rank}-{member[i]:04d}", rank)
        )
    return requests


# -- one instance ---------------------------------------------------------------------


def load_ms_per_rank(link_gbps: float, mib_per_rank: float = ADAPTER_MIB_PER_RANK) -> float:
    """Milliseconds to copy one unit of adapter rank over a `link_gbps` GB/s host link."""
    return mib_per_rank * 2**20 / (link_gbps * 1e9) * 1e3


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
    """An instance's limits: `max_batch` decode slots, `max_prefill_tokens` prompt tokens
    per prefill iteration, `adapter_slots` adapters on the device; a rank-r adapter takes
    r · `load_ms_per_rank` ms to copy to it."""

    max_batch: int = 64
    max_prefill_tokens: int = CONTEXT_TOKENS
    adapter_slots: int = 32
    load_ms_per_rank: float = load_ms_per_rank(LINK_GBPS)

    def __post_init__(self) -> None:
        for field in ("max_batch", "max_prefill_tokens", "adapter_slots"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)!r} must be >= 1")
        if not self.load_ms_per_rank >= 0:
            raise ValueError(f"{self.load_ms_per_rank=} must be >= 0")

    def load_ms(self, rank: int) -> float:
        """Milliseconds to copy a rank-`rank` adapter to the device."""
        return rank * self.load_ms_per_rank


@dataclasses.dataclass(eq=False, slots=True)
class _Job:
    """A request's state in one run."""

    index: int
    request: Request
    queued: QueuedRequest
    ready: bool = False  # its adapter is on the device
    instance: int = -1
    first_token_ms: float = math.nan
    finish_ms: float = math.nan


class _Instance:
    """One serving instance: continuous batching over the profile's iteration times."""

    def __init__(
        self, position: int, config: InstanceConfig, profile: PerfProfile, changed: set[int]
    ) -> None:
        self.position, self.worker_id = position, f"instance-{position:02d}"
        self.changed = changed  # positions whose WorkerStats must be rebuilt
        self.config, self.profile = config, profile
        self.waiting: list[_Job] = []  # routed, not yet prefilled, oldest first
        self.running: dict[int, int] = {}  # job index -> rank: prefilling or decoding
        self.prefilling: list[_Job] = []
        self.finishing: list[tuple[int, int, _Job]] = []  # (last decode step, index, job)
        self.steps = 0  # decode steps done
        self.busy = False
        self.resident: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.in_use: collections.Counter[str] = collections.Counter()
        self.loading: set[str] = set()
        self.link_free_ms = 0.0
        self._decode_ms: float | None = None
        self._stats: WorkerStats | None = None

    def stats(self) -> WorkerStats:
        """What the router's policy sees of this instance (rebuilt only after a change)."""
        if self._stats is None:
            self._stats = WorkerStats(
                worker_id=self.worker_id,
                running=tuple(self.running.values()),
                queued=tuple(job.queued for job in self.waiting),
                free_slots=max(0, self.config.max_batch - len(self.running)),
                resident_adapters=frozenset(self.resident),
            )
        return self._stats

    def _invalidate(self) -> None:
        self._stats = None
        self.changed.add(self.position)

    def assign(self, job: _Job, now: float) -> float | None:
        """Queue `job`; the time its adapter's copy ends if one starts now, else None."""
        adapter = job.request.adapter
        job.instance = self.position
        self.waiting.append(job)
        self.in_use[adapter] += 1
        self._invalidate()
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            job.ready = True
            return None
        if adapter in self.loading:
            return None
        self.loading.add(adapter)
        self.link_free_ms = max(now, self.link_free_ms) + self.config.load_ms(job.request.rank)
        return self.link_free_ms

    def loaded(self, adapter: str) -> None:
        """`adapter`'s copy ended: it is resident, its requests may be prefilled."""
        self.loading.discard(adapter)
        self.resident[adapter] = None
        for name in list(self.resident):
            if len(self.resident) <= self.config.adapter_slots:
                break
            if self.in_use[name] == 0:
                del self.resident[name]
        for job in self.waiting:
            if job.request.adapter == adapter:
                job.ready = True
        self._invalidate()

    def start(self) -> float | None:
        """Start the next iteration; its duration in ms, None if there is nothing to do."""
        free = self.config.max_batch - len(self.running)
        admitted: list[_Job] = []
        if free > 0:
            tokens, skipped, scanned = 0, [], 0
            for job in self.waiting:
                if len(admitted) == free or (
                    admitted and tokens + job.queued.prompt_tokens > self.config.max_prefill_tokens
                ):
                    break
                scanned += 1
                if job.ready:
                    admitted.append(job)
                    tokens += job.queued.prompt_tokens
                else:
                    skipped.append(job)
            if admitted:
                self.waiting = skipped + self.waiting[scanned:]
        if admitted:
            self.prefilling = admitted
            for job in admitted:
                self.running[job.index] = job.request.rank
            self._decode_ms = None
            self._invalidate()
            self.busy = True
            ranks = [job.request.rank for job in admitted]
            return max(
                0.0, self.profile.prefill.predict(ranks, [j.queued.prompt_tokens for j in admitted])
            )
        if self.running:
            if self._decode_ms is None:
                self._decode_ms = self.profile.decode.predict(list(self.running.values()))
            self.busy = True
            return max(0.0, self._decode_ms)
        return None

    def end(self, now: float) -> None:
        """The iteration started last ends at `now`: first tokens, or a decode step."""
        self.busy = False
        if self.prefilling:
            for job in self.prefilling:
                job.first_token_ms = now
                last_step = self.steps + job.request.output_tokens - 1
                heapq.heappush(self.finishing, (last_step, job.index, job))
            self.prefilling = []
        else:
            self.steps += 1
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.finishing)
            job.finish_ms = now
            del self.running[job.index]
            self.in_use[job.request.adapter] -= 1
            self._decode_ms = None
            self._invalidate()


# -- the cluster ----------------------------------------------------------------------

_ITERATION, _LOAD = 0, 1


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Per request, in workload order: its instance, TTFT and TPT in ms (TPT NaN for a
    single output token)."""

    instance: np.ndarray  # i32[n]
    ttft_ms: np.ndarray  # f64[n]
    tpt_ms: np.ndarray  # f64[n]


def simulate(
    requests: Sequence[Request],
    policy: Policy,
    *,
    instances: int,
    profile: PerfProfile,
    config: InstanceConfig = InstanceConfig(),
) -> RunResult:
    """Serve `requests` on `instances` instances routed by `policy`, until all finish."""
    changed: set[int] = set()
    cluster = [_Instance(i, config, profile, changed) for i in range(instances)]
    by_id = {instance.worker_id: instance for instance in cluster}
    snapshot = [instance.stats() for instance in cluster]
    jobs = [_Job(i, r, QueuedRequest(r.rank, r.prompt_tokens)) for i, r in enumerate(requests)]
    events: list[tuple[float, int, int, _Instance, str]] = []  # (time, seq, kind, ...)
    seq, next_job = 0, 0
    while next_job < len(jobs) or events:
        arrival = jobs[next_job].request.arrival_ms if next_job < len(jobs) else math.inf
        now = min(arrival, events[0][0] if events else math.inf)
        kicked: dict[int, _Instance] = {}
        while events and events[0][0] == now:
            _, _, kind, instance, adapter = heapq.heappop(events)
            if kind == _ITERATION:
                instance.end(now)
            else:
                instance.loaded(adapter)
            kicked[instance.position] = instance
        while next_job < len(jobs) and jobs[next_job].request.arrival_ms == now:
            job = jobs[next_job]
            route = RouteRequest(job.request.rank, job.request.prompt_tokens, job.request.adapter)
            for position in changed:
                snapshot[position] = cluster[position].stats()
            changed.clear()
            instance = by_id[policy.choose(route, snapshot).worker_id]
            load_end = instance.assign(job, now)
            if load_end is not None:
                heapq.heappush(events, (load_end, seq, _LOAD, instance, job.request.adapter))
                seq += 1
            kicked[instance.position] = instance
            next_job += 1
        for position in sorted(kicked):
            instance = kicked[position]
            if not instance.busy and (duration := instance.start()) is not None:
                heapq.heappush(events, (now + duration, seq, _ITERATION, instance, ""))
                seq += 1
    arrivals = np.array([job.request.arrival_ms for job in jobs])
    first = np.array([job.first_token_ms for job in jobs])
    finish = np.array([job.finish_ms for job in jobs])
    outputs = np.array([job.request.output_tokens for job in jobs])
    with np.errstate(invalid="ignore", divide="ignore"):
        tpt = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
    return RunResult(
        instance=np.array([job.instance for job in jobs], dtype=np.int32),
        ttft_ms=first - arrivals,
        tpt_ms=tpt,
    )
