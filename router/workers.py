"""The router's view of its workers: one gRPC channel each, polled for health, stats, adapters.

Each worker has a poller task on the router's event loop. Every `poll_interval` seconds,
or at once after `WorkerPool.poke()`, it:

1. probes the worker's standard health service about `jlora.v1.Jlora`. NOT_SERVING (a
   draining or failed worker) marks it down at once: no new request goes there. An
   error or a timeout (`poll_timeout`) is a missed probe; `missed_probes` in a row
   (3 by default) mark it down. One or two misses are what a loaded machine gives (a
   worker stepping a long prefill, a router loop busy with a large body, a burst of
   streams), not a dead worker: a dead one answers the probes with a refused
   connection, three of them within a second, and the calls sent to it fail at once;
2. reads Stats (the running batch with ranks, the queue, max_slots and max_queue),
   ListAdapters (which adapters it serves, which are on its device) and, once, Models
   (the base model it serves). These wait for the worker's scheduler thread to finish
   its current step, so a busy worker that passed its probe may not answer them in
   time: one that is up keeps its last snapshot then;
3. when the worker comes (back) up, or passes a probe after missing one (it may have
   been restarted in between), first awaits `on_up(worker)` (the front door registers
   the adapters of the registry the worker lacks), then marks it up.

Between two polls the router's own traffic keeps the view fresh: every Generate call
the router sends is a `Dispatch` on its worker until it ends, and `Worker.view()`
combines the last Stats snapshot with the dispatches sent, started or ended since, so
that a burst of requests between two polls is not all sent to the worker that looked
idle. The result is the `policies.WorkerStats` the routing policy reads; its `healthy`
folds in the health check, draining, a base model that is not the router's, and a full
worker queue (running + queued >= max_slots + max_queue), so no policy picks a worker
that would refuse the request.

A call that finds the worker unreachable (UNAVAILABLE: refused, reset, draining;
`mark_down`) takes it out of routing at once, without waiting for the probes; the next
passing check brings it back.

The front door also times the tokens it forwards: `Worker.tpot` is an exponential moving
average of the time between two tokens of one stream on that worker (the migrator's
per-token time when no performance profile is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jlora.api import SERVICE_NAME
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract.auth import key_interceptors
from jlora.contract.grpc_server import MESSAGE_OPTIONS
from router.policies import QueuedRequest, WorkerStats

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVING = health_pb2.HealthCheckResponse.SERVING
# Reconnect quickly to a worker that comes back (gRPC's default backoff grows to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *MESSAGE_OPTIONS,
)
# A queued request on a worker that the router did not send: its rank and prompt are
# unknown, so it counts as a base-model request of one token.
_FOREIGN = QueuedRequest(rank=0, prompt_tokens=1)
# Seconds a call that ended is remembered: a snapshot taken before its worker aborted
# it may still list it.
ENDED_MEMORY = 2.0
# Weight of the newest gap in `Worker.tpot`'s moving average.
TPOT_EMA_WEIGHT = 0.05


@dataclasses.dataclass(eq=False)
class Dispatch:
    """A Generate call the router has sent to a worker (times are time.monotonic())."""

    request_id: str
    rank: int
    prompt_tokens: int
    sent_at: float
    started: bool = False  # its first token has arrived


class Worker:
    """One worker: its channel and stubs, its last snapshot, the router's calls on it."""

    def __init__(self, address: str, *, api_key: str | None = None) -> None:
        self.address = address
        interceptors = key_interceptors(api_key) if api_key else None
        self.channel = grpc.aio.insecure_channel(
            address, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
        self.stub = pb_grpc.JloraStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.up = False
        self.reason = "not checked yet"  # why it is down
        self.missed = 0  # health probes missed in a row
        self.base_model: str | None = None
        self.max_seq_len = 0  # the base model's context, from Models
        self.tool_call_parser = ""  # its tool-call format, from Models
        self.stats: pb.StatsResponse | None = None
        self.stats_at = 0.0  # when the Stats call of `stats` was sent
        self.adapters: dict[str, pb.Adapter] = {}
        self.full = False  # it answered RESOURCE_EXHAUSTED since the last poll
        self.dispatches: dict[str, Dispatch] = {}  # in flight
        self.tpot: float | None = None  # seconds between two tokens of a stream (an EMA)
        # Ended lately: a snapshot may still show them while the worker aborts them.
        self._ended: dict[str, tuple[float, Dispatch]] = {}  # oldest first

    def __repr__(self) -> str:
        return f"Worker({self.address!r}, {'up' if self.up else 'down: ' + self.reason})"

    # -- the router's calls -----------------------------------------------------------

    def dispatch(self, request_id: str, rank: int, prompt_tokens: int) -> Dispatch:
        dispatch = Dispatch(request_id, rank, prompt_tokens, time.monotonic())
        self.dispatches[request_id] = dispatch
        return dispatch

    def note_token_gap(self, seconds: float) -> None:
        """Two consecutive tokens of one stream from this worker arrived `seconds` apart."""
        if self.tpot is None:
            self.tpot = seconds
        else:
            self.tpot += TPOT_EMA_WEIGHT * (seconds - self.tpot)

    def release(self, dispatch: Dispatch) -> None:
        """The call has ended (finished, failed or cancelled)."""
        if self.dispatches.pop(dispatch.request_id, None) is None:
            return
        now = time.monotonic()
        self._ended.pop(dispatch.request_id, None)
        self._ended[dispatch.request_id] = (now, dispatch)
        while (oldest := next(iter(self._ended.values())))[0] < now - ENDED_MEMORY:
            del self._ended[oldest[1].request_id]

    def miss(self, reason: str, limit: int) -> None:
        """A health probe failed (`reason`): down once `limit` have in a row."""
        self.missed += 1
        if self.up and self.missed < limit:
            log.info(
                "worker %s missed health probe %d of %d: %s",
                self.address,
                self.missed,
                limit,
                reason,
            )
            return
        self.mark_down(reason if self.missed == 1 else f"{reason} ({self.missed} probes in a row)")

    def mark_down(self, reason: str) -> None:
        if self.up:
            log.warning("worker %s is down: %s", self.address, reason)
        self.up = False
        self.reason = reason
        self.stats = None  # describes nothing any more
        self.base_model = None  # asked again when it comes back (it may have restarted)

    # -- the policy's view ------------------------------------------------------------

    def view(self, base_model: str | None) -> WorkerStats:
        """The snapshot as `policies.WorkerStats`, with the router's own calls folded in.

        The router knows its calls exactly (rank, prompt, started or not); the snapshot
        adds the requests others sent: the running ones it lists that are not the
        router's, and its queue count less the router's calls it may count (sent before
        it and not running in it; an overestimate of those errs towards sending work).
        """
        stats = self.stats
        snapshot = {r.request_id: r.rank for r in stats.running} if stats else {}
        mine = self.dispatches.keys() | self._ended.keys()
        running = [rank for request_id, rank in snapshot.items() if request_id not in mine]
        running += [d.rank for d in self.dispatches.values() if d.started]
        queued = [
            QueuedRequest(d.rank, d.prompt_tokens)
            for d in self.dispatches.values()
            if not d.started
        ]
        if stats is not None:
            counted = sum(
                d.sent_at < self.stats_at and d.request_id not in snapshot
                for d in (*self.dispatches.values(), *(d for _, d in self._ended.values()))
            )
            queued = [_FOREIGN] * max(0, stats.queued - counted) + queued
        max_slots = stats.max_slots if stats else 0
        room = stats is None or len(running) + len(queued) < stats.max_slots + stats.max_queue
        same_model = base_model is None or self.base_model in (None, base_model)
        resident = {a.name for a in self.adapters.values() if a.state == pb.ADAPTER_STATE_DEVICE}
        return WorkerStats(
            worker_id=self.address,
            running=tuple(running),
            queued=tuple(queued),
            free_slots=max(0, max_slots - len(running)),
            resident_adapters=frozenset(resident),
            healthy=self.up and same_model and room and not self.full,
        )

    # -- polling ----------------------------------------------------------------------

    async def poll(self, timeout: float) -> bool:
        """One health probe and snapshot; True if the worker is serving. The probe's
        error (a missed probe) is raised; so is the snapshot's, unless the worker is up
        and the snapshot only timed out (it is busy: the last snapshot stays)."""
        check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        reply = await self.health.Check(check, timeout=timeout)
        if reply.status != SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            self.mark_down(f"its health check says {status}")
            return False
        try:
            await self._snapshot(timeout)
        except grpc.aio.AioRpcError as err:
            if not self.up or err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            log.info("worker %s is busy: no snapshot within %.1f s", self.address, timeout)
            return True
        if self.stats is not None and self.stats.draining:
            self.mark_down("it is draining")
            return False
        return True

    async def _snapshot(self, timeout: float) -> None:
        if self.base_model is None:
            models = await self.stub.Models(pb.ModelsRequest(), timeout=timeout)
            base = next((m for m in models.models if m.kind == pb.MODEL_KIND_BASE), None)
            if base is not None:
                self.base_model, self.max_seq_len = base.id, base.max_seq_len
                self.tool_call_parser = base.tool_call_parser
        sent = time.monotonic()
        stats = await _optional(self.stub.Stats(pb.StatsRequest(), timeout=timeout))
        await self.refresh_adapters(timeout)
        self.stats, self.stats_at = stats, sent
        self.full = False

    async def refresh_adapters(self, timeout: float) -> None:
        reply = await _optional(self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=timeout))
        self.adapters = {a.name: a for a in reply.adapters} if reply is not None else {}


async def _optional(call: Awaitable[T]) -> T | None:
    """The reply, or None if the worker's engine does not implement the method."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


class WorkerPool:
    """The workers, in the router's fixed order, each polled by its own task.

    Build and `start()` it on the router's event loop. `on_up(worker)` runs before a
    worker that was down (or never seen) takes requests, and when one passes a probe
    after missing some; `on_change()` after every poll. `missed_probes`: health probes
    missed in a row that mark a worker down. `api_key`: sent with every call, for
    workers that require one.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        *,
        poll_interval: float = 0.25,
        poll_timeout: float = 1.0,
        missed_probes: int = 3,
        on_up: Callable[[Worker], Awaitable[None]] | None = None,
        on_change: Callable[[], None] = lambda: None,
        api_key: str | None = None,
    ) -> None:
        self.addresses = list(dict.fromkeys(addresses))
        self._api_key = api_key
        if not self.addresses:
            raise ValueError("workers: at least one worker address is needed")
        if missed_probes < 1:
            raise ValueError(f"missed_probes={missed_probes} must be at least 1")
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self.missed_probes = missed_probes
        self._on_up = on_up
        self._on_change = on_change
        self.workers: list[Worker] = []
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self, wait: float | None = None) -> None:
        """Open the channels and start polling; wait up to `wait` seconds (default: one
        poll timeout and a little) for every worker's first answer."""
        first: list[asyncio.Event] = []
        for address in self.addresses:
            worker = Worker(address, api_key=self._api_key)
            self.workers.append(worker)
            self._wake[address] = asyncio.Event()
            polled = asyncio.Event()
            first.append(polled)
            self._tasks.append(
                asyncio.create_task(self._poll_forever(worker, polled), name=f"poll {address}")
            )
        with contextlib.suppress(TimeoutError):
            waits = [asyncio.create_task(event.wait()) for event in first]
            try:
                await asyncio.wait_for(
                    asyncio.gather(*waits), wait if wait is not None else self.poll_timeout + 0.5
                )
            finally:
                for task in waits:
                    task.cancel()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            await worker.channel.close()

    def poke(self) -> None:
        """Poll every worker now rather than at its next tick."""
        for event in self._wake.values():
            event.set()

    def get(self, address: str) -> Worker:
        return next(worker for worker in self.workers if worker.address == address)

    @property
    def up(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.up]

    def base_model(self) -> str | None:
        """The base model of the first worker that has said which it serves."""
        return next((w.base_model for w in self.workers if w.base_model is not None), None)

    def adapter_rank(self, name: str) -> int | None:
        """The rank of an adapter some worker serves (None: no worker lists it)."""
        return next((w.adapters[name].rank for w in self.workers if name in w.adapters), None)

    async def refresh_adapters(self) -> None:
        """ListAdapters on every worker that is up, now (a name the router has not seen)."""

        async def refresh(worker: Worker) -> None:
            try:
                await worker.refresh_adapters(self.poll_timeout)
            except grpc.aio.AioRpcError as err:
                log.info("worker %s: ListAdapters failed: %s", worker.address, err.details())

        await asyncio.gather(*(refresh(worker) for worker in self.up))

    async def _poll_forever(self, worker: Worker, polled: asyncio.Event) -> None:
        wake = self._wake[worker.address]
        while True:
            try:
                serving = await worker.poll(self.poll_timeout)
                if serving and (not worker.up or worker.missed):
                    if self._on_up is not None:
                        await self._on_up(worker)
                    if not worker.up:
                        log.info(
                            "worker %s is up (base model %r)", worker.address, worker.base_model
                        )
                    worker.up, worker.reason = True, ""
                worker.missed = 0
            except grpc.aio.AioRpcError as err:
                worker.miss(f"{err.code().name}: {err.details()}", self.missed_probes)
            except Exception as err:  # a bug here must not end the polling
                log.exception("polling worker %s failed", worker.address)
                worker.mark_down(f"polling failed: {err!r}")
            polled.set()
            try:
                self._on_change()
            except Exception:  # the caller's bug must not end the polling either
                log.exception("on_change after polling worker %s failed", worker.address)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.poll_interval)
            wake.clear()
