"""The front door: the router's logic behind both its gRPC service and its OpenAI HTTP API.

A Generate call's life (`FrontDoor.generate`, an async generator of the workers'
GenerateResponse messages, on the router's event loop):

1. Refused at once: UNAVAILABLE while the router drains; ALREADY_EXISTS for a request id
   in flight; NOT_FOUND for an adapter no worker serves (after asking the workers
   again), or, for one the registry has but no worker took, the reason (DATA_LOSS for
   weights whose sha256 no longer matches the registry).
2. Placement: the policy picks among the workers that serve the adapter, from their
   fresh views (workers.py). If every such worker is up but full, the request waits in
   the router's FIFO queue (at most `max_queue` requests; one more gets
   RESOURCE_EXHAUSTED) until one has room; if none is up: UNAVAILABLE.
3. Forwarding: the request goes to the worker with the router's request id and the
   time left before the caller's deadline; each token is passed through as is.
4. Failures before the first token: a worker that is unreachable, draining or stopped
   (UNAVAILABLE, or CANCELLED that the router did not ask for) is taken out of routing
   and the request placed again on another worker (a re-route); one whose queue is
   full (RESOURCE_EXHAUSTED with reason QUEUE_FULL) is skipped until its next poll. Any
   other error is the caller's, passed through unchanged (status and message).
5. Failures after the first token: the worker is taken out of routing and the request
   resumed on another (GenerateRequest.resume: the prompt as the caller gave it, the
   tokens forwarded, the seed), so the caller sees one stream, no token repeated or
   missing, the same tokens the lost worker would have sent: the router gives a sampled
   request without a seed one of its own before forwarding it, so every request's
   tokens follow from what travels. Only when no worker can continue it does the call
   end with UNAVAILABLE (reason WORKER_LOST) naming the worker, how many tokens arrived
   and why none took it.
6. The caller cancelling, or its deadline passing, cancels the worker's call (which
   aborts the request in the worker's engine and frees its slot).
7. Migration (`migrate`, called by the migrator, migrator.py): Migrate on the worker
   streaming the call exports the request; that worker's stream then ends, after every
   token generated before the export, with ABORTED, reason "MIGRATED". The call does not
   fail: the router resumes the request on the target worker (GenerateRequest.resume:
   the prompt as token ids, the tokens it forwarded, the seed) and goes on passing
   tokens through, so the caller sees one stream, with no gap in the tokens and none
   repeated. The router resumes from the tokens it has forwarded: if the worker generated
   more (it does not: it flushes them first), the target generates them again, the same
   ones (the seed and the step travel). A call may migrate any number of times; a
   failure of the target before its first token places the request again (4);
   cancellation and the deadline apply across the move. The last worker's usage counts
   every completion token (the resumed ones travel); the prefix-cache hits of the
   workers left (MigrateResponse.cached_tokens) are added to its cached_tokens.

The adapter RPCs are `FrontDoor.adapters` (adapters.py). Models lists the base model
and the adapters the workers serve; Stats is the router's view of all workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path

import grpc

from jlora.api import jlora_pb2 as pb
from jlora.contract import registry as reg
from jlora.contract.errors import (
    MIGRATED_REASON,
    QUEUE_FULL,
    AlreadyExists,
    Code,
    NotFound,
    RequestError,
    ResourceExhausted,
    Unavailable,
)
from jlora.contract.metrics import failed_outcome
from jlora.contract.status import from_rpc_error
from router.adapters import AdapterCatalog
from router.metrics import RouterMetrics
from router.policies import NoHealthyWorker, Policy, RouteRequest
from router.views import served_models, summed_stats, tool_call_parser
from router.workers import Dispatch, Worker, WorkerPool

log = logging.getLogger(__name__)

# Prompt tokens of a text prompt, for routing only (the worker's tokenizer counts).
BYTES_PER_TOKEN = 4
# Errors before the first token after which the request goes to another worker.
_WORKER_GONE = (Code.UNAVAILABLE, Code.CANCELLED)
# Bytes of one token id on the wire (int32), for the migration-traffic metric.
TOKEN_ID_BYTES = 4
# Seconds a Migrate call may take: it waits for the worker's current step only, but a
# reply lost to a timeout would lose the request's state, so the limit is generous.
MIGRATE_TIMEOUT = 30.0


@dataclasses.dataclass(eq=False)
class Call:
    """A Generate call in flight, as the migrator sees it (`FrontDoor.calls`).

    worker / dispatch: the worker streaming it now (None while it waits in the router or
    between two workers). generated: the ids of the tokens the caller has had, a
    client's own resumed tokens included (`forwarded` counts them). cached_tokens:
    prefix-cache hits of the workers it migrated off, added to the final usage.
    migrating: set while a Migrate of it is under way; resolves to the state and the
    target, or None if Migrate failed.
    """

    request_id: str
    adapter: str | None = None
    rank: int = 0
    max_tokens: int | None = None  # the caller's sampling.max_tokens (None: the default)
    worker: Worker | None = None
    dispatch: Dispatch | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    migrating: asyncio.Future[tuple[pb.MigrateResponse, Worker] | None] | None = None
    migrations: int = 0

    @property
    def forwarded(self) -> int:
        return len(self.generated)


def _resumed_after(
    request: pb.GenerateRequest, generated: list[int], seed: int
) -> pb.GenerateRequest:
    """`request` (as last forwarded) to continue after the tokens `generated`, sampled
    with `seed` (a migration then gives the prompt as its token ids)."""
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.resume.CopyFrom(pb.ResumeState(generated_ids=generated, seed=seed))
    return resumed


def estimate_prompt_tokens(request: pb.GenerateRequest) -> int:
    """The prompt's length in tokens as far as routing needs it: exact for token ids,
    UTF-8 bytes / BYTES_PER_TOKEN for text, and for chat the same per message plus 4 for
    the template's markup (the router has no tokenizer)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        count = len(request.token_ids.ids)
    elif kind == "text":
        count = math.ceil(len(request.text.encode()) / BYTES_PER_TOKEN)
    elif kind == "chat":
        count = sum(
            math.ceil(len(m.content.encode()) / BYTES_PER_TOKEN) + 4 for m in request.chat.messages
        )
    else:
        count = 0
    return max(1, count)


class FrontDoor:
    """See the module docstring. Build it and call every method on the router's loop."""

    def __init__(
        self,
        pool: WorkerPool,
        policy: Policy,
        registry: reg.Registry,
        *,
        metrics: RouterMetrics,
        adapters_dir: Path | None,
        model_name: str | None,
        max_queue: int,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be non-negative")
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self._model_name = model_name
        self.max_queue = max_queue
        self.draining = False
        self._calls: dict[str, Call] = {}  # in flight, by request id
        self._groups: dict[str, str] = {}  # generate(group=...) -> its first call's worker
        self.arrivals: collections.Counter[str] = collections.Counter()  # calls per adapter
        self._waiting = 0  # calls in the router's queue
        self._queue = asyncio.Lock()  # FIFO: the head of the queue holds it
        self._room = asyncio.Event()  # set when a worker may have room
        self.adapters = AdapterCatalog(
            pool,
            registry,
            adapters_dir=adapters_dir,
            base_model=lambda: self.base_model,
            users=lambda name: sum(call.adapter == name for call in self._calls.values()),
        )

    @property
    def in_flight(self) -> int:
        """Generate calls in progress (queued or streaming)."""
        return len(self._calls)

    @property
    def calls(self) -> list[Call]:
        """The calls in flight (a copy: the list changes as calls start and end)."""
        return list(self._calls.values())

    @property
    def base_model(self) -> str | None:
        """The base model's id: as configured, else the first worker's (remembered)."""
        if self._model_name is None:
            self._model_name = self.pool.base_model()
        return self._model_name

    def workers_changed(self) -> None:
        """After every poll (`WorkerPool(on_change=...)`): a worker may have room."""
        self._room.set()

    # -- Generate -------------------------------------------------------------------

    async def generate(
        self,
        request: pb.GenerateRequest,
        *,
        deadline: float | None = None,
        group: str | None = None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Route and forward one Generate call (see the module docstring); RequestError
        for a status. `deadline` is in `loop.time()` seconds. Close the iterator when
        done with it (`contextlib.aclosing`), so an abandoned call is cancelled.
        `group`: calls of one group go to the worker its first went to while that one
        has room (the choices of one prompt: their prompt is in its prefix cache), until
        `release_group`."""
        arrival = time.monotonic()
        outcome = "cancelled"  # unless the call ends another way
        if self.draining:
            self.metrics.requests.labels("unavailable").inc()
            raise Unavailable("the router is draining; send it elsewhere", reason="DRAINING")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._calls:
            self.metrics.requests.labels("invalid").inc()
            raise AlreadyExists(
                f"request_id={request_id!r} is already in flight", field="request_id"
            )
        call = Call(request_id)
        self._calls[request_id] = call
        try:
            adapter, rank = await self._resolve_adapter(request.adapter)
            call.adapter, call.rank = adapter, rank
            if request.sampling.HasField("max_tokens"):
                call.max_tokens = request.sampling.max_tokens
            call.generated = list(request.resume.generated_ids)
            if adapter is not None:
                self.arrivals[adapter] += 1
            route = RouteRequest(rank, estimate_prompt_tokens(request), adapter)
            forwarded = pb.GenerateRequest()
            forwarded.CopyFrom(request)
            forwarded.request_id = request_id
            forwarded.adapter = adapter or ""
            if not forwarded.sampling.HasField("seed") and not forwarded.HasField("resume"):
                # what a worker would draw, drawn here, so that a resume elsewhere after a
                # fault continues with the tokens this one would have sampled (5)
                forwarded.sampling.seed = secrets.randbelow(2**32)
            tried: dict[str, str] = {}  # worker -> why it failed this request
            admitted = False  # past the router's queue-size check
            target: Worker | None = None  # where a migration resumes it
            tokens = 0  # passed to the caller by this call
            last = arrival
            lost: str | None = None  # the last worker lost after a token, while none resumes it
            while True:
                if target is not None and target.up:
                    worker = target
                else:
                    try:
                        worker = self._grouped(group, route, tried) or await self._place(
                            route, tried, deadline, admitted=admitted
                        )
                        if group is not None:
                            self._groups.setdefault(group, worker.address)
                    except RequestError as err:
                        if lost is None:
                            raise
                        raise Unavailable(
                            f"{lost}, and no worker could resume it ({err.message}): the "
                            "completion is incomplete: send the request again",
                            reason="WORKER_LOST",
                        ) from None
                target = None
                admitted = True
                leg = 0  # tokens from this worker
                try:
                    stream = self._forward(call, worker, forwarded, route, deadline)
                    async with contextlib.aclosing(stream):
                        async for response in stream:
                            now = time.monotonic()
                            histogram = self.metrics.tpt if tokens else self.metrics.ttft
                            histogram.observe(now - last)
                            if leg:
                                worker.note_token_gap(now - last)
                            last = now
                            tokens += 1
                            leg += 1
                            lost = None
                            call.generated.append(response.token_id)
                            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                                outcome = pb.FinishReason.Name(response.finish_reason)
                                outcome = outcome.removeprefix("FINISH_REASON_").lower()
                                self.metrics.latency.observe(now - arrival)
                                response.usage.cached_tokens += call.cached_tokens
                            yield response
                    return
                except grpc.aio.AioRpcError as err:
                    error = from_rpc_error(err)
                    code, details = error.code, error.message
                    if code == Code.ABORTED and error.reason == MIGRATED_REASON:
                        forwarded, target = await self._handover(call, forwarded, error)
                        prefill = len(forwarded.token_ids.ids) + call.forwarded
                        route = RouteRequest(rank, prefill, adapter)
                        tried = {}
                        continue
                    full = code == Code.RESOURCE_EXHAUSTED and error.reason == QUEUE_FULL
                    if leg == 0 and full:
                        worker.full = True  # until its next poll; wait for room elsewhere
                        continue
                    if code in _WORKER_GONE:  # out of routing; the request goes elsewhere
                        why = f"{code.name}: {details}"
                        worker.mark_down(why)
                        self.pool.poke()
                        tried[worker.address] = why
                        if leg == 0:  # placed again (4)
                            self.metrics.reroutes.inc()
                            log.warning(
                                "request %s: worker %s failed before its first token (%s); "
                                "placing it again",
                                request_id,
                                worker.address,
                                why,
                            )
                            continue
                        lost = (  # resumed after its tokens (5)
                            f"worker {worker.address} failed after {call.forwarded} tokens of "
                            f"request {request_id!r} ({why})"
                        )
                        self.metrics.resumes.inc()
                        log.warning("%s; resuming it on another worker", lost)
                        seed = (  # a migration before gave it a resume and its seed
                            forwarded.resume.seed
                            if forwarded.HasField("resume")
                            else forwarded.sampling.seed
                        )
                        forwarded = _resumed_after(forwarded, call.generated, seed)
                        route = RouteRequest(rank, route.prompt_tokens + leg, adapter)
                        continue
                    raise error from None  # the worker's, unchanged
        except RequestError as err:
            outcome = failed_outcome(err.code)
            raise
        finally:
            del self._calls[request_id]
            self.metrics.requests.labels(outcome).inc()

    async def _forward(
        self,
        call: Call,
        worker: Worker,
        request: pb.GenerateRequest,
        route: RouteRequest,
        deadline: float | None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        timeout = self._time_left(deadline)
        dispatch = worker.dispatch(request.request_id, route.rank, route.prompt_tokens)
        call.worker, call.dispatch = worker, dispatch
        self.metrics.in_flight.inc()
        rpc = worker.stub.Generate(request, timeout=timeout)
        try:
            while (response := await rpc.read()) is not grpc.aio.EOF:
                dispatch.started = True
                yield response
        finally:
            rpc.cancel()  # a no-op once the call has ended
            call.worker = call.dispatch = None
            worker.release(dispatch)
            self.metrics.in_flight.dec()
            self._room.set()

    # -- migration ----------------------------------------------------------------------

    async def migrate(self, request_id: str, target: Worker) -> pb.MigrateResponse | None:
        """Move a call the router is streaming to `target` (module docstring, 7): Migrate
        on its worker, whose reply the call's generator resumes on `target`. Returns the
        exported state, or None if the request could not be taken (it ended, it is not
        on a worker, a migration of it is under way, or Migrate failed: it stays put).
        Make sure its adapter is on `target` first (the migrator does)."""
        call = self._calls.get(request_id)
        if call is None or call.worker is None or call.migrating is not None:
            return None
        source = call.worker
        if source is target:
            return None
        handover: asyncio.Future[tuple[pb.MigrateResponse, Worker] | None]
        handover = asyncio.get_running_loop().create_future()
        call.migrating = handover
        try:
            reply = await source.stub.Migrate(
                pb.MigrateRequest(request_id=request_id), timeout=MIGRATE_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            # NOT_FOUND: it finished (or failed) meanwhile. Any other error: it stays.
            log.info(
                "request %s stays on %s: Migrate answered %s: %s",
                request_id,
                source.address,
                err.code().name,
                err.details(),
            )
            call.migrating = None
            handover.set_result(None)
            return None
        except BaseException:
            call.migrating = None
            handover.set_result(None)
            raise
        handover.set_result((reply, target))
        return reply

    async def _handover(
        self, call: Call, request: pb.GenerateRequest, error: RequestError
    ) -> tuple[pb.GenerateRequest, Worker]:
        """The request that resumes a call whose worker's stream ended MIGRATED, and the
        worker to resume it on; `error` (passed on) if the router did not migrate it."""
        future = call.migrating
        if future is None:
            raise error  # someone else called Migrate on the worker: the state is theirs
        handover = await asyncio.shield(future)  # the reply may come after the stream ends
        call.migrating = None
        if handover is None:
            raise Unavailable(
                f"request {call.request_id!r} was migrated, but the worker's reply with its "
                f"state was lost after {call.forwarded} tokens: send the request again",
                reason="MIGRATION_LOST",
            )
        reply, target = handover
        generated = list(reply.generated_ids)
        if call.forwarded > len(generated):
            raise RequestError(
                f"request {call.request_id!r}: the router forwarded {call.forwarded} tokens "
                f"but the migrated state holds {len(generated)}",
                reason="MIGRATION_MISMATCH",
            )
        if len(generated) > call.forwarded:
            log.warning(
                "request %s: %d tokens generated but not forwarded before the move; the "
                "target generates them again",
                call.request_id,
                len(generated) - call.forwarded,
            )
        resumed = _resumed_after(request, generated[: call.forwarded], reply.seed)
        resumed.token_ids.CopyFrom(pb.TokenIds(ids=reply.prompt_ids))
        call.migrations += 1
        call.cached_tokens += reply.cached_tokens
        self.metrics.migration_bytes.inc(TOKEN_ID_BYTES * (len(reply.prompt_ids) + call.forwarded))
        return resumed, target

    def _time_left(self, deadline: float | None) -> float | None:
        if deadline is None:
            return None
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RequestError(
                "the deadline passed before a worker took it", code=Code.DEADLINE_EXCEEDED
            )
        return left

    async def _resolve_adapter(self, name: str) -> tuple[str | None, int]:
        """(adapter, rank): (None, 0) for the base model; RequestError if no worker has it."""
        if not name or name == self.base_model:
            return None, 0
        rank = self.pool.adapter_rank(name)
        if rank is None:
            await self.pool.refresh_adapters()
            rank = self.pool.adapter_rank(name)
        if rank is not None:
            return name, rank
        error = self.adapters.sync_error(name)
        if error is not None:
            raise error
        if not await self.adapters.registered(name):
            raise NotFound(
                f"adapter={name!r} is not registered", field="adapter", reason="ADAPTER_NOT_FOUND"
            )
        raise Unavailable(f"adapter={name!r} is registered but no worker that is up has it")

    def release_group(self, group: str) -> None:
        """`group`'s calls are placed freely again."""
        self._groups.pop(group, None)

    def _grouped(
        self, group: str | None, route: RouteRequest, tried: dict[str, str]
    ) -> Worker | None:
        """The worker `group` went to, if it has room for `route` and has not failed it."""
        address = self._groups.get(group) if group is not None else None
        worker = next((w for w in self.pool.workers if w.address == address), None)
        if worker is None or address in tried or self._waiting:
            return None
        if route.adapter is not None and route.adapter not in worker.adapters:
            return None
        return worker if worker.view(self.base_model).healthy else None

    async def _place(
        self, route: RouteRequest, tried: dict[str, str], deadline: float | None, admitted: bool
    ) -> Worker:
        """A worker with room for `route`, waiting in the router's queue while all are
        full. `tried`: workers that failed this request already (left out)."""
        worker = self._choose(route, tried)
        if worker is not None and not self._waiting:
            return worker
        if not admitted and self._waiting >= self.max_queue:
            raise ResourceExhausted(
                f"the router's queue is full: {self._waiting} requests wait for a worker with "
                f"room (max_queue={self.max_queue})",
                reason=QUEUE_FULL,
            )
        self._waiting += 1
        self.metrics.queued.inc()
        try:
            async with asyncio.timeout_at(deadline), self._queue:
                while (worker := self._choose(route, tried)) is None:
                    self._room.clear()
                    self.pool.poke()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._room.wait(), self.pool.poll_interval)
                return worker
        except TimeoutError:
            raise RequestError(
                "the deadline passed while the request waited for a worker",
                code=Code.DEADLINE_EXCEEDED,
            ) from None
        finally:
            self._waiting -= 1
            self.metrics.queued.dec()

    def _choose(self, route: RouteRequest, tried: dict[str, str]) -> Worker | None:
        """The policy's pick among the candidates with room; None if all are full;
        Unavailable if none is up."""
        base = self.base_model
        candidates = [
            worker
            for worker in self.pool.workers
            if worker.address not in tried
            and (route.adapter is None or route.adapter in worker.adapters)
        ]
        if not any(worker.up for worker in candidates):
            down = [f"{address} ({why})" for address, why in tried.items()]
            down += [f"{w.address} ({w.reason})" for w in candidates]
            serving = f" serving adapter {route.adapter!r}" if route.adapter else ""
            raise Unavailable(f"no healthy worker{serving}: {'; '.join(down) or 'none has it'}")
        try:
            chosen = self.policy.choose(route, [worker.view(base) for worker in candidates])
        except NoHealthyWorker:
            return None
        return self.pool.get(chosen.worker_id)

    # -- stats and models -------------------------------------------------------------

    def models(self) -> list[pb.Model]:
        return served_models(self.pool.workers, self.base_model)

    def tool_call_parser(self) -> str:
        """The format the workers' chat template asks for tool calls in ("" for none)."""
        return tool_call_parser(self.pool.workers)

    def stats(self) -> pb.StatsResponse:
        """The router's view: the workers' last snapshots summed (`summed_stats`), the
        router's own queue added to the workers' queues."""
        reply = summed_stats(self.pool.workers)
        reply.queued += self._waiting
        reply.max_queue, reply.draining = self.max_queue, self.draining
        return reply
