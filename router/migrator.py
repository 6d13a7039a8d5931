"""dLoRA §5 on the router: reactive request-adapter co-migration and proactive preloading.

A `Migrator` task runs on the router's event loop (`jlora router --migration on` and/or
`--preload on`; app.py starts it). Every `period` seconds it reads the workers' last
snapshots (workers.py: Stats with the running batch and the queue, each request's prompt,
generated and max tokens; KV blocks free of total and their size; the adapters on each
device) and the front door's calls (frontdoor.py: which requests the router streams,
where), then:

1. Trigger (§5.2, "when the available GPU memory of a replica is beyond a memory
   threshold or the queuing delay of requests in a replica is beyond a computation
   threshold"): a worker is overloaded when its free KV fraction is at or below
   `kv_free_threshold`, or the router's oldest request waiting on it (sent, no token
   yet) has waited `queue_delay_threshold` seconds.
   Nothing happens unless one is overloaded while another is not.
2. Problem: the top-K busiest and K idlest workers (`select_replicas`, by the seconds of
   work they hold). Each request the router streams on them is a `Candidate`: L_i (its
   exec_time) is its tokens left (max_tokens - generated) times the worker's time per
   token divided by the worker's decode slots (the request's share of a full batch's
   iterations), the time per token from the `--profile`'s decode model for the worker's
   batch, else the moving average of the gaps the router measured between the worker's
   tokens (`Worker.tpot`), else `default_tpot`; M_i is the KV its whole sequence reserves
   (prompt + max_tokens, in blocks of the worker's kv_bytes_per_block). Requests others
   sent (the router cannot move a stream it does not own) stay as the replica's fixed
   time and memory, their adapters pinned.
3. Solve (`router.migration.solve`, in a thread so the loop keeps streaming), check with
   `violations` (a plan with any is skipped and counted), then execute `plan.moves`:
   first load every adapter a target lacks (LoadAdapter, then ListAdapters until it is
   on the device), then move the queued requests, then the running ones, each with
   `FrontDoor.migrate` (Migrate on the source; the call's generator resumes it on the
   target).
4. Preload (§5.1, long-term): per-adapter arrival rates (an exponential moving average
   over `rate_window` seconds of the front door's arrivals) go to
   `router.placement.plan_preloads`, and the router sends LoadAdapter for each
   (adapter, worker) pair it returns.

KV transfer or recomputation (`move_cost`): jlora migrates by recomputation, as dLoRA
does ("migration is implemented as token transfer and subsequent intermediate state
reconstruction", §5.2): the target prefills prompt + generated tokens again, and only
token ids cross the network (4 bytes each). Copying the KV cache instead would send
tokens × 2 × layers × kv_heads × head_dim × dtype bytes (23 KB a token for SmolLM2-135M
in bf16, 512 KB for Llama-2-7B in fp16) and win only when that copy is faster than the
target's prefill: on a slow device (a CPU worker prefills a few thousand tokens a
second, so even loopback gRPC at ~1 GB/s copies faster) or for long sequences between
GPUs on a fast link (NVLink, 200 Gb/s InfiniBand). On a GPU over an ordinary network, a
prefill of tens of thousands of tokens a second beats the copy, and recomputation needs
no KV layout shared by both workers, so it is the default; the migrator counts the moves
for which the cost model says a transfer would have won
(jlora_router_migration_transfer_cheaper_total).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Mapping

import grpc

from jlora.api import jlora_pb2 as pb
from router.frontdoor import Call, FrontDoor
from router.metrics import RouterMetrics
from router.migration import (
    Candidate,
    Plan,
    Problem,
    Replica,
    select_replicas,
    solve,
    violations,
)
from router.perf_model import PerfProfile
from router.placement import ReplicaSlots, plan_preloads, request_capacity
from router.workers import Worker

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # a worker's max_tokens when the caller sets none
# Llama-2-7B in fp16 (2 x 32 layers x 32 KV heads x 128 x 2 bytes), for a worker that does
# not say (the mock engine): only the ratios between requests matter then.
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2
_LOAD_POLL = 0.05  # seconds between two looks at an adapter on its way to a device


@dataclasses.dataclass(frozen=True)
class MigrationConfig:
    """The migrator's settings (`jlora router --migration ...`; module docstring).

    migrate: reactive co-migration (§5.2). preload: proactive adapter loading (§5.1).
    period: seconds between two rounds. kv_free_threshold, queue_delay_threshold: the
    trigger. top_k: busiest and idlest workers per problem. migration_factor: dLoRA's
    γ, the cost of moving a request, as a factor on its remaining time. solve_time_limit:
    seconds the solver may take. load_timeout: seconds an adapter may take to reach a
    target's device (the move is dropped after). default_tpot: seconds per token when
    nothing is measured. rate_window: seconds the arrival rates average over.
    transfer_bandwidth: bytes/s a KV copy between workers would get (loopback gRPC),
    prefill_tokens_per_s: a target's prefill speed without a profile; both only feed
    `move_cost`'s verdict.
    """

    migrate: bool = True
    preload: bool = True
    period: float = 1.0
    kv_free_threshold: float = 0.05
    queue_delay_threshold: float = 2.0
    top_k: int = 2
    migration_factor: float = 1.2
    solve_time_limit: float = 0.5
    load_timeout: float = 30.0
    default_tpot: float = 0.05
    rate_window: float = 60.0
    transfer_bandwidth: float = 1e9
    prefill_tokens_per_s: float = 2000.0

    def __post_init__(self) -> None:
        for field in (
            "period",
            "queue_delay_threshold",
            "solve_time_limit",
            "load_timeout",
            "default_tpot",
            "rate_window",
            "transfer_bandwidth",
            "prefill_tokens_per_s",
        ):
            value = getattr(self, field)
            if not (_number(value) and value > 0):
                raise ValueError(f"MigrationConfig.{field}={value!r} must be a positive number")
        if not (_number(self.kv_free_threshold) and 0 <= self.kv_free_threshold < 1):
            raise ValueError(
                f"MigrationConfig.kv_free_threshold={self.kv_free_threshold!r} must be in [0, 1)"
            )
        if not (_number(self.migration_factor) and self.migration_factor >= 1):
            raise ValueError(
                f"MigrationConfig.migration_factor={self.migration_factor!r} must be >= 1"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"MigrationConfig.top_k={self.top_k!r} must be an integer >= 1")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- KV transfer or recomputation -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoveCost:
    """What moving a request's KV state costs, both ways (module docstring).

    transfer_seconds: KV bytes / bandwidth. recompute_seconds: the target's prefill of
    the same tokens. jlora always recomputes; `transfer_cheaper` says when it should not.
    """

    tokens: int
    kv_bytes: float
    transfer_seconds: float
    recompute_seconds: float

    @property
    def transfer_cheaper(self) -> bool:
        return self.transfer_seconds < self.recompute_seconds


def move_cost(
    tokens: int, *, kv_bytes_per_token: float, bandwidth: float, prefill_seconds: float
) -> MoveCost:
    """The cost of moving `tokens` tokens of KV: copied at `bandwidth` bytes/s, or
    rebuilt by a prefill that takes `prefill_seconds`."""
    kv_bytes = tokens * kv_bytes_per_token
    return MoveCost(tokens, kv_bytes, kv_bytes / bandwidth, prefill_seconds)


# -- the migrator ---------------------------------------------------------------------


@dataclasses.dataclass
class _Load:
    """One request on a worker as the problem sees it."""

    request_id: str
    adapter: str | None
    exec_time: float
    memory: float
    running: bool
    call: Call | None  # the router's call: it may move


@dataclasses.dataclass
class _WorkerState:
    worker: Worker
    requests: list[_Load]
    kv_free: float  # fraction of the KV blocks
    queue_delay: float  # seconds the router's oldest request without a token has waited
    kv_bytes_per_token: float
    capacity: float  # bytes of KV and adapter slots

    @property
    def work(self) -> float:
        return sum(load.exec_time for load in self.requests)


class Migrator:
    """See the module docstring. `run()` is the task; one `round()` is one period's work."""

    def __init__(
        self,
        front: FrontDoor,
        config: MigrationConfig,
        *,
        metrics: RouterMetrics,
        profile: PerfProfile | None = None,
    ) -> None:
        self.front = front
        self.config = config
        self.metrics = metrics
        self.profile = profile
        self.rates: dict[str, float] = {}  # adapter -> requests per second (an EMA)
        self._seen: dict[str, int] = {}  # arrivals per adapter at the last measurement
        self._rates_at = time.monotonic()
        self.last_problem: Problem | None = None
        self.last_plan: Plan | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.period)
            try:
                await self.round()
            except Exception:  # a bug here must not end the task
                log.exception("migration round failed")

    async def round(self) -> None:
        if self.config.preload:
            await self.preload()
        if self.config.migrate:
            await self.rebalance()

    # -- reactive migration (§5.2) ------------------------------------------------------

    async def rebalance(self) -> list[tuple[str, str, str]]:
        """One trigger check, solve and execution; returns the moves made."""
        states = {
            worker.address: self._state(worker)
            for worker in self.front.pool.workers
            if worker.up and worker.stats is not None
        }
        hot = [address for address, state in states.items() if self._overloaded(state)]
        if not hot or len(hot) == len(states):
            return []
        chosen = select_replicas({a: s.work for a, s in states.items()}, self.config.top_k)
        problem = self._problem([states[address] for address in chosen])
        if not problem.candidates:
            return []
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(
            None, functools.partial(solve, problem, time_limit=self.config.solve_time_limit)
        )
        self.last_problem, self.last_plan = problem, plan
        self.metrics.solve_seconds.observe(plan.solve_seconds)
        found = violations(problem, plan)
        if found:
            self.metrics.migration_plans.labels("violations").inc()
            log.warning("migration plan skipped: %s", "; ".join(found))
            return []
        moves = plan.moves(problem)
        if not moves:
            self.metrics.migration_plans.labels("no_move").inc()
            return []
        self.metrics.migration_plans.labels("moved").inc()
        log.info(
            "migration: %s overloaded; moving %d requests (makespan %.3g s, solved in %.3g s)",
            ", ".join(hot),
            len(moves),
            plan.makespan,
            plan.solve_seconds,
        )
        return await self._execute(problem, moves, states)

    def _overloaded(self, state: _WorkerState) -> bool:
        """§5.2's trigger: its free KV at or below the memory threshold, or its queuing
        delay at or above the computation threshold."""
        config = self.config
        return (
            state.kv_free <= config.kv_free_threshold
            or state.queue_delay >= config.queue_delay_threshold
        )

    def _state(self, worker: Worker) -> _WorkerState:
        stats = worker.stats
        assert stats is not None
        memory = stats.memory
        block_size = max(1, memory.kv_block_size)
        per_block = memory.kv_bytes_per_block or block_size * DEFAULT_KV_BYTES_PER_TOKEN
        step = self._step_seconds(worker, [r.rank for r in stats.running])
        share = step / max(1, stats.max_slots)  # a request's share of a full batch
        calls = {c.request_id: c for c in self.front.calls if c.worker is worker}

        def load(entry: pb.RunningRequest, running: bool) -> _Load:
            """`entry`'s numbers, the router's fresher ones where it has them."""
            call = calls.get(entry.request_id)
            generated = max(entry.generated_tokens, call.forwarded if call else 0)
            max_tokens = (
                entry.max_tokens or (call.max_tokens if call else None) or DEFAULT_MAX_TOKENS
            )
            prompt = entry.prompt_tokens
            sequence = prompt + max_tokens
            if stats.max_seq_len:
                sequence = min(sequence, stats.max_seq_len)
            return _Load(
                entry.request_id,
                entry.adapter or None,
                exec_time=max(1, max_tokens - generated) * share,
                memory=math.ceil(sequence / block_size) * per_block,
                running=running,
                call=call if call is not None and call.migrating is None else None,
            )

        requests = [
            load(entry, running)
            for entries, running in ((stats.running, True), (stats.waiting, False))
            for entry in entries
        ]
        listed = {request.request_id for request in requests}
        for request_id, call in calls.items():  # sent after the snapshot
            if request_id not in listed and call.dispatch is not None:
                entry = pb.RunningRequest(
                    request_id=request_id,
                    adapter=call.adapter or "",
                    prompt_tokens=call.dispatch.prompt_tokens,
                )
                requests.append(load(entry, call.dispatch.started))
        now = time.monotonic()
        waited = [
            now - call.dispatch.sent_at
            for call in calls.values()
            if call.dispatch is not None and not call.dispatch.started
        ]
        total = memory.kv_blocks_total
        adapter_bytes = max((a.size_bytes for a in worker.adapters.values()), default=0)
        return _WorkerState(
            worker=worker,
            requests=requests,
            kv_free=memory.kv_blocks_free / total if total else 1.0,
            queue_delay=max(waited, default=0.0),
            kv_bytes_per_token=per_block / block_size,
            capacity=total * per_block + stats.adapter_slots.total * adapter_bytes,
        )

    def _step_seconds(self, worker: Worker, ranks: list[int]) -> float:
        """A decode iteration's seconds on `worker`: the profile's for its batch, else
        the measured gap between its tokens, else the configured default."""
        if self.profile is not None:
            return self.profile.decode.predict(ranks or [0]) / 1000
        if worker.tpot is not None:
            return worker.tpot
        return self.config.default_tpot

    def _problem(self, states: list[_WorkerState]) -> Problem:
        candidates: list[Candidate] = []
        replicas: list[Replica] = []
        sizes: dict[str, float] = {}
        # A target must have the adapter registered to take the request (the router
        # registers every adapter everywhere; one a worker lacks does not move).
        everywhere = set.intersection(*(set(state.worker.adapters) for state in states))
        for state in states:
            worker = state.worker
            fixed_time = fixed_memory = 0.0
            pinned = {a.name for a in worker.adapters.values() if a.pinned}
            for load in state.requests:
                movable = load.adapter is None or load.adapter in everywhere
                if load.call is not None and movable:
                    candidate = Candidate(
                        load.request_id,
                        load.adapter,
                        worker.address,
                        load.exec_time,
                        load.memory,
                        load.running,
                    )
                    candidates.append(candidate)
                else:
                    fixed_time += load.exec_time
                    fixed_memory += load.memory
                    if load.adapter is not None:
                        pinned.add(load.adapter)
            resident = {
                a.name
                for a in worker.adapters.values()
                if a.state in (pb.ADAPTER_STATE_DEVICE, pb.ADAPTER_STATE_LOADING)
            }
            sizes.update({a.name: float(a.size_bytes) for a in worker.adapters.values()})
            for name in pinned:  # in use by a request others sent: kept, its size aside
                sizes.setdefault(name, 0.0)
            replica = Replica(
                worker.address,
                state.capacity,
                frozenset(resident),
                fixed_time=fixed_time,
                fixed_memory=fixed_memory,
                pinned=frozenset(pinned),
            )
            replicas.append(replica)
        return Problem(
            tuple(candidates),
            tuple(replicas),
            sizes,
            migration_factor=self.config.migration_factor,
        )

    async def _execute(
        self,
        problem: Problem,
        moves: list[tuple[str, str, str]],
        states: Mapping[str, _WorkerState],
    ) -> list[tuple[str, str, str]]:
        candidates = {c.request_id: c for c in problem.candidates}
        moves = sorted(moves, key=lambda move: candidates[move[0]].running)  # queued first
        pool = self.front.pool
        pairs = sorted(
            {(candidates[r].adapter or "", to) for r, _, to in moves if candidates[r].adapter}
        )
        loaded = await asyncio.gather(
            *(
                self.ensure_resident(pool.get(to), adapter, cause="migration")
                for adapter, to in pairs
            )
        )
        ready = {pair for pair, ok in zip(pairs, loaded, strict=True) if ok}
        done: list[tuple[str, str, str]] = []
        for request_id, source, to in moves:
            candidate = candidates[request_id]
            if candidate.adapter is not None and (candidate.adapter, to) not in ready:
                self.metrics.migrations_failed.inc()
                continue
            target = pool.get(to)
            reply = await self.front.migrate(request_id, target)
            if reply is None:
                self.metrics.migrations_failed.inc()
                continue
            done.append((request_id, source, to))
            self.metrics.migrations.labels("running" if reply.running else "queued").inc()
            cost = self._move_cost(states[to], candidate.adapter, reply)
            if cost.transfer_cheaper:
                self.metrics.transfer_cheaper.inc()
            log.info(
                "moved %s request %s from %s to %s after %d tokens (recompute %.3g s; a KV "
                "copy of %.3g MB would take %.3g s)",
                "running" if reply.running else "queued",
                request_id,
                source,
                to,
                len(reply.generated_ids),
                cost.recompute_seconds,
                cost.kv_bytes / 1e6,
                cost.transfer_seconds,
            )
        return done

    def _move_cost(
        self, target: _WorkerState, adapter: str | None, reply: pb.MigrateResponse
    ) -> MoveCost:
        tokens = len(reply.prompt_ids) + len(reply.generated_ids)
        if self.profile is not None:
            rank = target.worker.adapters[adapter].rank if adapter in target.worker.adapters else 0
            prefill = self.profile.prefill.predict([rank], [max(1, tokens)]) / 1000
        else:
            prefill = tokens / self.config.prefill_tokens_per_s
        return move_cost(
            tokens,
            kv_bytes_per_token=target.kv_bytes_per_token,
            bandwidth=self.config.transfer_bandwidth,
            prefill_seconds=prefill,
        )

    async def ensure_resident(self, worker: Worker, adapter: str, *, cause: str) -> bool:
        """LoadAdapter on `worker` unless `adapter` is on its device, then wait until it
        is (at most `load_timeout` seconds); False if it cannot be had there."""
        known = worker.adapters.get(adapter)
        if known is None:
            return False
        if known.state == pb.ADAPTER_STATE_DEVICE:
            return True
        deadline = time.monotonic() + self.config.load_timeout
        try:
            reply = await worker.stub.LoadAdapter(
                pb.LoadAdapterRequest(name=adapter), timeout=self.config.load_timeout
            )
            self.metrics.adapter_loads.labels(cause).inc()
            worker.adapters[adapter] = reply.adapter  # until its next poll
            state = reply.adapter.state
            while state != pb.ADAPTER_STATE_DEVICE:
                if time.monotonic() > deadline:
                    log.warning("adapter %s did not reach %s in time", adapter, worker.address)
                    return False
                await asyncio.sleep(_LOAD_POLL)
                listing = await worker.stub.ListAdapters(
                    pb.ListAdaptersRequest(), timeout=self.config.load_timeout
                )
                entry = next((a for a in listing.adapters if a.name == adapter), None)
                if entry is None:
                    return False
                state = entry.state
        except grpc.aio.AioRpcError as err:
            log.info(
                "adapter %s cannot be loaded on %s: %s", adapter, worker.address, err.details()
            )
            return False
        return True

    # -- proactive preloading (§5.1) ----------------------------------------------------

    def measure_rates(self, now: float | None = None) -> dict[str, float]:
        """Fold the arrivals since the last call into the per-adapter rates (requests/s,
        an exponential moving average over `rate_window` seconds)."""
        now = time.monotonic() if now is None else now
        arrivals = dict(self.front.arrivals)
        if now > self._rates_at:
            elapsed = now - self._rates_at
            weight = 1 - math.exp(-elapsed / self.config.rate_window)
            for adapter in arrivals.keys() | self.rates.keys():
                rate = (arrivals.get(adapter, 0) - self._seen.get(adapter, 0)) / elapsed
                self.rates[adapter] = self.rates.get(adapter, 0.0) + weight * (
                    rate - self.rates.get(adapter, 0.0)
                )
        self._seen, self._rates_at = arrivals, now
        return dict(self.rates)

    async def preload(self) -> list[tuple[str, str]]:
        """One round of §5.1's placement: the loads it started, (adapter, worker)."""
        rates = self.measure_rates()
        replicas = {
            worker.address: self._slots(worker)
            for worker in self.front.pool.workers
            if worker.up and worker.stats is not None
        }
        if not replicas or not any(rates.values()):
            return []
        pool = self.front.pool
        started: list[tuple[str, str]] = []
        for adapter, address in plan_preloads(rates, replicas):
            worker = pool.get(address)
            if adapter not in worker.adapters:
                continue
            try:
                reply = await worker.stub.LoadAdapter(
                    pb.LoadAdapterRequest(name=adapter), timeout=self.config.load_timeout
                )
            except grpc.aio.AioRpcError as err:
                log.info("preloading %s on %s failed: %s", adapter, address, err.details())
                continue
            worker.adapters[adapter] = reply.adapter  # until its next poll
            self.metrics.adapter_loads.labels("preload").inc()
            started.append((adapter, address))
        if started:
            log.info("preloaded %s", ", ".join(f"{a} on {w}" for a, w in started))
        return started

    @staticmethod
    def _slots(worker: Worker) -> ReplicaSlots:
        """The worker as `plan_preloads` sees it: its resident adapters, its free adapter
        slots, and the requests its free KV blocks hold (of the size of its requests now,
        or half its context when it has none) up to its free decode slots."""
        stats = worker.stats
        assert stats is not None
        resident = frozenset(
            a.name
            for a in worker.adapters.values()
            if a.state in (pb.ADAPTER_STATE_DEVICE, pb.ADAPTER_STATE_LOADING)
        )
        block_size = max(1, stats.memory.kv_block_size)
        sizes = [
            math.ceil((r.prompt_tokens + (r.max_tokens or DEFAULT_MAX_TOKENS)) / block_size)
            for r in (*stats.running, *stats.waiting)
        ]
        per_request = (
            sum(sizes) / len(sizes) if sizes else max(1, stats.max_seq_len // 2) / block_size
        )
        return ReplicaSlots(
            adapters=resident,
            free_slots=stats.adapter_slots.free,
            capacity=request_capacity(stats.memory.kv_blocks_free, per_request, stats.free_slots),
        )
