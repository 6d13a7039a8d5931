"""The worker's gRPC service, `jlora.v1.Jlora`, over one engine, on an asyncio event loop.

Threads: the event loop runs every handler and owns the stream table; the scheduler
thread owns the engine (scheduler.py). A Generate call's life:

1. The handler validates the message into an engine `Request` (convert.py), tokenizing
   a text or chat prompt on a worker thread: a long one takes seconds, and the loop
   meanwhile answers health probes and streams other calls' tokens. It refuses
   with UNAVAILABLE while the server drains, ALREADY_EXISTS for a request id in flight,
   and RESOURCE_EXHAUSTED when max_slots + max_queue calls are in flight already.
   Nothing has reached the engine.
2. It opens a stream (an asyncio.Queue) in the stream table and has the scheduler
   thread run `engine.add_request` (or `engine.resume` for a request migrated here, see
   below), awaiting the result (at most one engine step away). The engine's own checks
   refuse an unknown adapter (NOT_FOUND) or a prompt over the context or outside the
   vocabulary (INVALID_ARGUMENT).
3. The scheduler thread steps the engine and hands each step's events to the loop in
   one `call_soon_threadsafe(dispatch, ...)`. `dispatch` stamps the per-token timing,
   updates the metrics and puts each event on its stream's queue; events of a closed
   stream are dropped.
4. The handler awaits its queue and yields one GenerateResponse per token; the last one
   carries the finish reason and the usage (its cached_tokens: the prompt tokens the
   engine's prefills took from the prefix cache, `TokenEvent.cached_tokens` summed), and
   the stream closes (every call that opened one logs one line as it ends, logs.py). A
   request that fails in the engine (finish reason "error": its adapter could not be
   loaded, its CPU path broke) ends the call with the error's status, after the tokens
   it had.
5. If the call ends before that (the client cancels, its deadline passes, the server
   stops after its grace period), grpc cancels the handler at its `await`; the `finally`
   closes the stream and queues `engine.abort(id)`, which frees the decode slot and the
   KV blocks on the scheduler's next turn. A client that cancels sees CANCELLED, one
   whose deadline passed sees DEADLINE_EXCEEDED.

Migration (dLoRA §5.2; the router's migrator.py decides, frontdoor.py carries it out):
`Migrate(request_id)` runs `engine.export` on the scheduler thread. Every token the
request generated before the export was handed to the loop before the export's result
(both travel through `call_soon_threadsafe`, in order), so when the handler resumes, the
stream's queue holds all of them; it then queues the MIGRATED marker behind them and
returns the state. The Generate handler yields those tokens, then ends the call with
ABORTED, reason "MIGRATED" (`MIGRATED_REASON`): the contract the router recognises. A
GenerateRequest with `resume` (the prompt, the generated ids, the seed) is checked
here (`_resume_state`) and queued with `engine.resume`: the stream continues
with the next token, and its usage counts the resumed tokens as completion tokens. The
Migrate reply carries the prefix-cache hits of the stream it ends (`cached_tokens`), which
its caller adds to the usage of the stream that finishes the request.

Every refusal is a `RequestError` (jlora.contract.errors), raised where the fault is
found and sent as the call's status with rich details (the field, the reason).
RegisterAdapter validates and copies the adapter on a worker thread (`stage_adapter`),
so the running streams never wait for it; only the final commit runs between two steps.
Every other RPC runs one closure on the scheduler thread (`_on_engine`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract import status
from jlora.contract.adapters import Adapter, check_adapter_name, resolve_adapter_dir
from jlora.contract.errors import (
    MIGRATED_REASON,
    QUEUE_FULL,
    AlreadyExists,
    Code,
    InvalidRequest,
    NotFound,
    RequestError,
    ResourceExhausted,
    Unavailable,
)
from jlora.contract.metrics import failed_outcome
from jlora.engine.api import ERROR, Request, SamplingParams, SequenceState, TokenEvent
from jlora.engine.orchestrator import Orchestrator
from jlora.server import convert
from jlora.server.logs import log_request
from jlora.server.metrics import Metrics
from jlora.server.scheduler import EngineFailed, Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Migrated:
    """The marker Migrate queues behind a stream's last token."""


@dataclasses.dataclass(frozen=True)
class _Token:
    event: TokenEvent
    since_arrival: float  # seconds
    since_previous: float


@dataclasses.dataclass(eq=False)
class _Stream:
    request: Request
    last: float  # when the previous token (or the request) arrived
    queue: asyncio.Queue[_Token | BaseException | _Migrated] = dataclasses.field(
        default_factory=asyncio.Queue
    )
    tokens: int = 0  # handed to the queue
    first: float | None = None  # when its first token arrived
    last_token: float | None = None  # when the token with its finish reason arrived
    cached: int = 0  # prompt tokens its prefills took from the prefix cache
    resumed: int = 0  # generated before it was migrated here (GenerateRequest.resume)
    finished: bool = False  # its last event (a finish reason or an error) is queued
    migrated: bool = False  # Migrate took it: the MIGRATED marker is queued


async def _fail(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    await status.abort(context, err)


class JloraServicer(pb_grpc.JloraServicer):
    def __init__(
        self,
        engine: Orchestrator,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        tokenizer: convert.TextCodec | None,
        model_name: str,
        max_queue: int,
        adapters_dir: Path | None,
        sampling_defaults: SamplingParams,
        tool_call_parser: str = "",
    ) -> None:
        self._scheduler = scheduler
        self.tool_call_parser = tool_call_parser
        self._sampling_defaults = sampling_defaults
        self._metrics = metrics
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_slots = engine.max_slots
        self.max_seq_len = engine.max_seq_len
        self._adapters_dir = adapters_dir.resolve() if adapters_dir is not None else None
        self._streams: dict[str, _Stream] = {}
        self.draining = False

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- token fan-out (on the loop) ------------------------------------------------

    def dispatch(self, events: list[TokenEvent], stamp: float) -> None:
        """One engine step's events, stamped with the time the step returned."""
        tokens = 0
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # aborted: the call has ended
            if event.error is not None:
                stream.finished = True
                stream.queue.put_nowait(event.error)
                continue
            since_previous = stamp - stream.last
            if stream.tokens == 0:
                self._metrics.first_token(since_previous)
                stream.first = stamp
            else:
                self._metrics.next_token(since_previous)
            stream.tokens += 1
            stream.cached += event.cached_tokens
            tokens += 1
            stream.last = stamp
            since_arrival = stamp - stream.request.arrival_time
            if event.finish_reason is not None:
                stream.finished = True
                stream.last_token = stamp
                self._metrics.request_finished(since_arrival)
            stream.queue.put_nowait(_Token(event, since_arrival, since_previous))
        self._metrics.tokens_streamed(tokens)

    def fail_all(self, error: BaseException) -> None:
        """The engine failed: end every stream with `error`."""
        for stream in self._streams.values():
            stream.queue.put_nowait(error)

    def _open(self, request: Request, resumed: int) -> _Stream:
        stream = _Stream(request, last=request.arrival_time, resumed=resumed)
        self._streams[request.request_id] = stream
        self._metrics.request_queued()
        return stream

    def _close(self, stream: _Stream, outcome: str) -> None:
        """The call has ended with `outcome` (its finish reason, or how it failed): the
        stream leaves the table and the request's line is logged."""
        if self._streams.pop(stream.request.request_id, None) is None:
            return
        self._metrics.stream_closed(started=stream.tokens > 0)
        request = stream.request
        ended = stream.last_token if stream.last_token is not None else time.monotonic()
        log_request(
            request.request_id,
            adapter=request.adapter,
            prompt_tokens=len(request.prompt_ids),
            generation_tokens=stream.tokens,
            cached_tokens=stream.cached,
            ttft=stream.first - request.arrival_time if stream.first is not None else None,
            e2e=ended - request.arrival_time,
            finish_reason=outcome,
        )

    # -- Generate -------------------------------------------------------------------

    async def Generate(  # noqa: N802 (the proto's name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        outcome = self._metrics.requests
        request_id = request.request_id or uuid.uuid4().hex
        try:
            engine_request = await self._admissible(request, request_id, arrival)
            resume = self._resume_state(request, engine_request)
        except RequestError as err:
            outcome.labels(failed_outcome(err.code)).inc()
            await _fail(context, err)
        stream = self._open(engine_request, len(resume.generated) if resume else 0)
        label = "cancelled"  # unless the call ends another way
        finish: str | None = None
        try:
            if resume is None:
                add = self._scheduler.call(lambda engine: engine.add_request(engine_request))
            else:
                add = self._scheduler.call(lambda engine: engine.resume(resume))
            try:
                await asyncio.wrap_future(add)
            except RequestError as err:
                label = failed_outcome(err.code)
                await _fail(context, err)
            except EngineFailed as err:
                label = "unavailable"
                await _fail(context, Unavailable(str(err)))
            self._metrics.prompt_accepted(len(engine_request.prompt_ids))
            while finish is None:
                item = await stream.queue.get()
                if isinstance(item, _Migrated):
                    label = "migrated"
                    await _fail(
                        context,
                        RequestError(
                            f"request {request_id!r} was migrated to another worker after "
                            f"{stream.resumed + stream.tokens} tokens; its state went to the "
                            "caller of Migrate, which resumes it",
                            code=Code.ABORTED,
                            reason=MIGRATED_REASON,
                        ),
                    )
                if isinstance(item, RequestError):
                    label = "error"
                    await _fail(context, item)
                if isinstance(item, BaseException):
                    label = "error"
                    await _fail(context, RequestError(f"the engine failed: {item!r}"))
                finish = item.event.finish_reason
                yield self._response(stream, item)
            label = finish
        finally:
            self._close(stream, label)
            outcome.labels(label).inc()
            if finish is None and not stream.migrated:
                # Ended early (cancelled, deadline, stopped, or refused above): free the slot
                # and blocks. Harmless if the request never reached the engine.
                self._scheduler.abort(request_id)

    async def _admissible(
        self, request: pb.GenerateRequest, request_id: str, arrival: float
    ) -> Request:
        """The engine request of a Generate call this server may take now."""
        if self.draining:
            raise Unavailable("the server is draining; send it elsewhere", reason="DRAINING")
        convert_request = functools.partial(
            convert.to_request,
            request,
            request_id=request_id,
            tokenizer=self._tokenizer,
            max_seq_len=self.max_seq_len,
            base_model=self.model_name,
            arrival_time=arrival,
            defaults=self._sampling_defaults,
        )
        if request.WhichOneof("prompt") in ("text", "chat"):
            # Tokenizing takes seconds for a long prompt (2 s for 3 MB): on a worker
            # thread, so the loop keeps answering health probes and streaming meanwhile.
            engine_request = await asyncio.to_thread(convert_request)
        else:
            engine_request = convert_request()
        if self.draining:
            raise Unavailable("the server is draining; send it elsewhere", reason="DRAINING")
        if request_id in self._streams:
            raise AlreadyExists(
                f"request_id={request_id!r} is already in flight", field="request_id"
            )
        if len(self._streams) >= self.max_slots + self.max_queue:
            raise ResourceExhausted(
                f"the queue is full: {len(self._streams)} requests in flight "
                f"(max_slots={self.max_slots} running + max_queue={self.max_queue} queued)",
                reason=QUEUE_FULL,
            )
        return engine_request

    def _response(self, stream: _Stream, token: _Token) -> pb.GenerateResponse:
        event = token.event
        response = pb.GenerateResponse(
            request_id=event.request_id,
            token_id=event.token_id,
            text=event.text,
            timing=pb.TokenTiming(
                since_arrival_us=round(token.since_arrival * 1e6),
                since_previous_us=round(token.since_previous * 1e6),
            ),
        )
        if event.logprobs is not None:
            response.logprobs.CopyFrom(convert.logprobs_message(event.logprobs, self._tokenizer))
        if event.prompt_logprobs is not None:
            response.prompt_logprobs.extend(
                convert.prompt_logprobs_message(
                    stream.request.prompt_ids, event.prompt_logprobs, self._tokenizer
                )
            )
        if event.finish_reason is not None:
            assert event.finish_reason != ERROR
            response.finish_reason = convert.FINISH_REASONS[event.finish_reason]
            response.usage.prompt_tokens = len(stream.request.prompt_ids)
            response.usage.completion_tokens = stream.resumed + stream.tokens
            response.usage.cached_tokens = stream.cached
        return response

    def _resume_state(
        self, request: pb.GenerateRequest, engine_request: Request
    ) -> SequenceState | None:
        """The state `engine.resume` continues, for a GenerateRequest with `resume`
        (None without); InvalidRequest naming the field (the engine checks the generated
        ids against the vocabulary, max_tokens and the context)."""
        if not request.HasField("resume"):
            return None
        resume = request.resume
        if resume.seed >= 2**32:
            raise InvalidRequest(
                f"resume.seed={resume.seed} must be below 2**32", field="resume.seed"
            )
        return SequenceState(
            request_id=engine_request.request_id,
            prompt_ids=tuple(engine_request.prompt_ids),
            generated=tuple(resume.generated_ids),
            sampling=engine_request.sampling,
            seed=resume.seed,
            adapter=engine_request.adapter,
            arrival_time=engine_request.arrival_time,
        )

    # -- Migrate ----------------------------------------------------------------------

    async def Migrate(  # noqa: N802
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateResponse:
        """Export a request with a Generate stream here; its stream ends MIGRATED after
        its tokens (see the module docstring)."""
        request_id = request.request_id
        stream = self._streams.get(request_id)
        if stream is None or stream.migrated:
            await _fail(
                context,
                NotFound(
                    f"request_id={request_id!r} has no Generate stream on this worker",
                    field="request_id",
                ),
            )

        def export(engine: Orchestrator) -> tuple[SequenceState, bool]:
            running = engine.admitted(request_id)  # before the export takes it out
            return engine.export(request_id), running

        state, running = await self._on_engine(context, export)
        # Every token generated before the export is in the stream's queue by now.
        stream.migrated = True
        stream.queue.put_nowait(_Migrated())
        return pb.MigrateResponse(
            request_id=request_id,
            prompt_ids=state.prompt_ids,
            generated_ids=state.generated,
            seed=state.seed,
            sampling=convert.sampling_message(state.sampling, state.seed),
            adapter=state.adapter or "",
            streamed_tokens=stream.tokens,
            running=running,
            cached_tokens=stream.cached,
        )

    # -- adapters -------------------------------------------------------------------

    async def RegisterAdapter(  # noqa: N802
        self, request: pb.RegisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterAdapterResponse:
        async def register() -> pb.Adapter:
            name = check_adapter_name(request.name, base_model=self.model_name)
            path = resolve_adapter_dir(request.path, self._adapters_dir)
            staged = await self._stage(name, path, request.sha256 or None)

            def commit(engine: Orchestrator) -> pb.Adapter:
                info = engine.commit_adapter(staged, load=request.load, pin=request.pin)
                return convert.adapter_message(info)

            return await self._engine_call(commit)

        adapter = await self._answer(context, register())
        return pb.RegisterAdapterResponse(adapter=adapter)

    async def LoadAdapter(  # noqa: N802
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        info = await self._on_engine(
            context, lambda engine: engine.load_adapter(request.name, pin=request.pin)
        )
        return pb.LoadAdapterResponse(adapter=convert.adapter_message(info))

    async def UnloadAdapter(  # noqa: N802
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        info = await self._on_engine(context, lambda engine: engine.unload_adapter(request.name))
        return pb.UnloadAdapterResponse(adapter=convert.adapter_message(info))

    async def UnregisterAdapter(  # noqa: N802
        self, request: pb.UnregisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterAdapterResponse:
        await self._on_engine(context, lambda engine: engine.unregister_adapter(request.name))
        return pb.UnregisterAdapterResponse()

    async def ListAdapters(  # noqa: N802
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        infos = await self._on_engine(context, lambda engine: engine.adapter_infos())
        return pb.ListAdaptersResponse(adapters=[convert.adapter_message(i) for i in infos])

    # -- stats and models -------------------------------------------------------------

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        stats = await self._on_engine(context, lambda engine: engine.stats())
        return convert.stats_message(stats, max_queue=self.max_queue, draining=self.draining)

    async def Models(  # noqa: N802
        self, request: pb.ModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelsResponse:
        infos = await self._on_engine(context, lambda engine: engine.adapter_infos())
        models = [
            pb.Model(
                id=self.model_name,
                kind=pb.MODEL_KIND_BASE,
                max_seq_len=self.max_seq_len,
                tool_call_parser=self.tool_call_parser,
            )
        ]
        models += [
            pb.Model(
                id=info.adapter.name,
                kind=pb.MODEL_KIND_ADAPTER,
                parent=self.model_name,
                rank=info.adapter.rank,
                max_seq_len=self.max_seq_len,
                tool_call_parser=self.tool_call_parser,
            )
            for info in infos
        ]
        return pb.ModelsResponse(models=models)

    # -- helpers ----------------------------------------------------------------------

    async def _stage(self, name: str, path: Path, sha256: str | None) -> Adapter:
        """Validate, hash and copy an adapter into host memory on a worker thread, off
        the scheduler's; if the call is cancelled meanwhile, the staged adapter is
        discarded once staging ends."""
        engine = self._scheduler.engine
        stage = asyncio.ensure_future(
            asyncio.to_thread(engine.stage_adapter, name, path, expect_sha256=sha256)
        )
        try:
            return await asyncio.shield(stage)
        except asyncio.CancelledError:

            def discard(done: asyncio.Future[Adapter]) -> None:
                if not done.cancelled() and done.exception() is None:
                    staged = done.result()
                    self._scheduler.call(lambda engine: engine.discard_adapter(staged))

            stage.add_done_callback(discard)
            raise

    async def _engine_call(self, fn: Callable[[Orchestrator], T]) -> T:
        """fn(engine) on the scheduler thread; a failed engine as UNAVAILABLE."""
        try:
            return await asyncio.wrap_future(self._scheduler.call(fn))
        except EngineFailed as err:
            raise Unavailable(str(err)) from err

    async def _answer(self, context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
        """The result of `call`; its RequestError as the call's status, any other
        exception as INTERNAL."""
        try:
            return await call
        except RequestError as err:
            await _fail(context, err)
        except Exception as err:
            log.exception("adapter or stats call failed")
            await _fail(context, RequestError(f"{type(err).__name__}: {err}"))

    async def _on_engine(
        self, context: grpc.aio.ServicerContext, fn: Callable[[Orchestrator], T]
    ) -> T:
        return await self._answer(context, self._engine_call(fn))
