"""The worker's gRPC service, `jlora.v1.Jlora`, over one engine, on an asyncio event loop.

Threads: the event loop runs every handler and owns the stream table; the scheduler
thread owns the engine (scheduler.py). A Generate call's life:

1. The handler validates the message into an engine `Request` (convert.py; a bad field
   is INVALID_ARGUMENT naming it). It refuses with UNAVAILABLE while the server drains,
   ALREADY_EXISTS for a request id in flight, and RESOURCE_EXHAUSTED when
   max_slots + max_queue calls are in flight already. Nothing has reached the engine.
2. It opens a stream (an asyncio.Queue) in the stream table and has the scheduler
   thread run `engine.add_request`, awaiting the result (at most one engine step away).
   The engine's own checks answer NOT_FOUND (unknown adapter) or INVALID_ARGUMENT
   (a prompt over the context, ids outside the vocabulary).
3. The scheduler thread steps the engine and hands each step's tokens to the loop in
   one `call_soon_threadsafe(dispatch, ...)`. `dispatch` stamps the per-token timing,
   updates the metrics and puts each token on its stream's queue; tokens of a closed
   stream are dropped.
4. The handler awaits its queue and yields one GenerateResponse per token; the last one
   carries the finish reason and the usage, and the stream closes.
5. If the call ends before that (the client cancels, its deadline passes, the server
   stops after its grace period), grpc cancels the handler at its `await`; the `finally`
   closes the stream and queues `engine.abort(id)`, which frees the decode slot and the
   KV blocks on the scheduler's next turn. A client that cancels sees CANCELLED, one
   whose deadline passed sees DEADLINE_EXCEEDED.

Every other RPC runs one closure on the scheduler thread (`_on_engine`) and maps the
engine's exceptions to status codes. Adapter RPCs need an engine with `AdapterControl`,
Stats one with `Introspectable` (engine_info.py); otherwise they answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc

from jlora.adapters.peft import AdapterError
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.api import Engine, InvalidRequest, Request, TokenEvent, UnknownAdapter
from jlora.server import convert
from jlora.server.engine_info import AdapterControl, AdapterInfo, Introspectable
from jlora.server.metrics import Metrics
from jlora.server.scheduler import EngineFailed, Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")
Code = grpc.StatusCode


class _Status(Exception):
    """Raised inside an engine closure to answer with this code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class _Token:
    event: TokenEvent
    since_arrival: float  # seconds
    since_previous: float


@dataclasses.dataclass(eq=False)
class _Stream:
    request: Request
    last: float  # when the previous token (or the request) arrived
    queue: asyncio.Queue[_Token | BaseException] = dataclasses.field(default_factory=asyncio.Queue)
    tokens: int = 0


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")


class JloraServicer(pb_grpc.JloraServicer):
    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        tokenizer: convert.TextEncoder | None,
        model_name: str,
        max_queue: int,
        adapters_dir: Path | None,
    ) -> None:
        self._engine = engine
        self._scheduler = scheduler
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
        """One engine step's tokens, stamped with the time the step returned."""
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # aborted: the call has ended
            since_previous = stamp - stream.last
            if stream.tokens == 0:
                self._metrics.ttft.observe(since_previous)
                self._metrics.queued.dec()
                self._metrics.running.inc()
            else:
                self._metrics.tpt.observe(since_previous)
            stream.tokens += 1
            stream.last = stamp
            since_arrival = stamp - stream.request.arrival_time
            if event.finish_reason is not None:
                self._metrics.latency.observe(since_arrival)
            stream.queue.put_nowait(_Token(event, since_arrival, since_previous))
        self._metrics.generated_tokens.inc(len(events))

    def fail_all(self, error: BaseException) -> None:
        """The engine failed: end every stream with `error`."""
        for stream in self._streams.values():
            stream.queue.put_nowait(error)

    def _open(self, request: Request) -> _Stream:
        stream = _Stream(request, last=request.arrival_time)
        self._streams[request.request_id] = stream
        self._metrics.queued.inc()
        return stream

    def _close(self, stream: _Stream) -> None:
        if self._streams.pop(stream.request.request_id, None) is not None:
            (self._metrics.running if stream.tokens else self._metrics.queued).dec()

    # -- Generate -------------------------------------------------------------------

    async def Generate(  # noqa: N802 (the proto's name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        outcome = self._metrics.requests
        request_id = request.request_id or uuid.uuid4().hex
        if self.draining:
            outcome.labels("unavailable").inc()
            await _abort(context, Code.UNAVAILABLE, "the server is draining; send it elsewhere")
        try:
            engine_request = convert.to_request(
                request,
                request_id=request_id,
                tokenizer=self._tokenizer,
                max_seq_len=self.max_seq_len,
                base_model=self.model_name,
                arrival_time=arrival,
            )
        except InvalidRequest as err:
            outcome.labels("invalid").inc()
            await _abort(context, Code.INVALID_ARGUMENT, str(err))
        if request_id in self._streams:
            outcome.labels("invalid").inc()
            await _abort(
                context, Code.ALREADY_EXISTS, f"request_id={request_id!r} is already in flight"
            )
        if len(self._streams) >= self.max_slots + self.max_queue:
            outcome.labels("exhausted").inc()
            await _abort(
                context,
                Code.RESOURCE_EXHAUSTED,
                f"the queue is full: {len(self._streams)} requests in flight "
                f"(max_slots={self.max_slots} running + max_queue={self.max_queue} queued)",
            )
        stream = self._open(engine_request)
        label = "cancelled"  # unless the call ends another way
        finish: str | None = None
        try:
            add = self._scheduler.call(lambda engine: engine.add_request(engine_request))
            try:
                await asyncio.wrap_future(add)
            except UnknownAdapter as err:
                label = "not_found"
                await _abort(context, Code.NOT_FOUND, str(err))
            except InvalidRequest as err:
                label = "invalid"
                await _abort(context, Code.INVALID_ARGUMENT, str(err))
            except EngineFailed as err:
                label = "unavailable"
                await _abort(context, Code.UNAVAILABLE, str(err))
            self._metrics.prompt_tokens.inc(len(engine_request.prompt_ids))
            while finish is None:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    label = "error"
                    await _abort(context, Code.INTERNAL, f"the engine failed: {item!r}")
                finish = item.event.finish_reason
                yield self._response(stream, item)
            label = finish
        finally:
            self._close(stream)
            outcome.labels(label).inc()
            if finish is None:
                # Ended early (cancelled, deadline, stopped, or refused above): free the slot
                # and blocks. Harmless if the request never reached the engine.
                self._scheduler.abort(request_id)

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
        if event.finish_reason is not None:
            response.finish_reason = convert.FINISH_REASONS.get(
                event.finish_reason, pb.FINISH_REASON_UNSPECIFIED
            )
            response.usage.prompt_tokens = len(stream.request.prompt_ids)
            response.usage.completion_tokens = stream.tokens
        return response

    # -- adapters -------------------------------------------------------------------

    async def RegisterAdapter(  # noqa: N802
        self, request: pb.RegisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterAdapterResponse:
        await self._adapter_control(context)
        name, pin, load = request.name, request.pin, request.load or request.pin
        if not name:
            await _abort(context, Code.INVALID_ARGUMENT, "name is empty")
        if name == self.model_name:
            await _abort(context, Code.INVALID_ARGUMENT, f"name={name!r} is the base model's id")
        try:
            path = self._adapter_path(request.path)
        except InvalidRequest as err:
            await _abort(context, Code.INVALID_ARGUMENT, str(err))

        def register(engine: Any) -> AdapterInfo:
            if _find(engine, name) is not None:
                raise _Status(Code.ALREADY_EXISTS, f"adapter name={name!r} is already registered")
            engine.register_adapter(name, path)
            loaded = _get(engine, name).sha256
            if request.sha256 and loaded != request.sha256.lower():
                engine.unregister_adapter(name)
                raise _Status(
                    Code.DATA_LOSS,
                    f"adapter {name!r}: adapter_model.safetensors has sha256 {loaded}, but "
                    f"sha256={request.sha256!r} was expected (the registry's); not registered",
                )
            if load:
                try:
                    engine.load_adapter(name, pin=pin)
                except AdapterError as err:
                    engine.unregister_adapter(name)
                    raise _Status(
                        Code.FAILED_PRECONDITION, f"{err} (so adapter {name!r} was not registered)"
                    ) from err
            return _get(engine, name)

        info = await self._on_engine(context, register, adapter_error=Code.INVALID_ARGUMENT)
        return pb.RegisterAdapterResponse(adapter=convert.adapter_message(info))

    async def LoadAdapter(  # noqa: N802
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        await self._adapter_control(context)

        def load(engine: Any) -> AdapterInfo:
            _get(engine, request.name)
            engine.load_adapter(request.name, pin=request.pin)
            return _get(engine, request.name)

        info = await self._on_engine(context, load)
        return pb.LoadAdapterResponse(adapter=convert.adapter_message(info))

    async def UnloadAdapter(  # noqa: N802
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        await self._adapter_control(context)

        def unload(engine: Any) -> AdapterInfo:
            _get(engine, request.name)
            engine.unload_adapter(request.name)
            return _get(engine, request.name)

        info = await self._on_engine(context, unload)
        return pb.UnloadAdapterResponse(adapter=convert.adapter_message(info))

    async def UnregisterAdapter(  # noqa: N802
        self, request: pb.UnregisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterAdapterResponse:
        await self._adapter_control(context)
        name = request.name
        users = sum(s.request.adapter == name for s in self._streams.values())
        if users:
            await _abort(
                context,
                Code.FAILED_PRECONDITION,
                f"adapter {name!r} is named by {users} requests in flight",
            )

        def unregister(engine: Any) -> None:
            _get(engine, name)
            engine.unregister_adapter(name)

        await self._on_engine(context, unregister)
        return pb.UnregisterAdapterResponse()

    async def ListAdapters(  # noqa: N802
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        await self._adapter_control(context)
        infos = await self._on_engine(context, lambda engine: engine.adapter_infos())
        return pb.ListAdaptersResponse(adapters=[convert.adapter_message(i) for i in infos])

    # -- stats and models -------------------------------------------------------------

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        if not isinstance(self._engine, Introspectable):
            await _abort(context, Code.UNIMPLEMENTED, "this engine reports no stats")
        stats = await self._on_engine(context, lambda engine: engine.stats())
        return convert.stats_message(stats, max_queue=self.max_queue, draining=self.draining)

    async def Models(  # noqa: N802
        self, request: pb.ModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelsResponse:
        models = [
            pb.Model(id=self.model_name, kind=pb.MODEL_KIND_BASE, max_seq_len=self.max_seq_len)
        ]
        if isinstance(self._engine, AdapterControl):
            infos = await self._on_engine(context, lambda engine: engine.adapter_infos())
            models += [
                pb.Model(
                    id=info.name,
                    kind=pb.MODEL_KIND_ADAPTER,
                    parent=self.model_name,
                    rank=info.rank,
                    max_seq_len=self.max_seq_len,
                )
                for info in infos
            ]
        return pb.ModelsResponse(models=models)

    # -- helpers ----------------------------------------------------------------------

    async def _adapter_control(self, context: grpc.aio.ServicerContext) -> None:
        if not isinstance(self._engine, AdapterControl):
            await _abort(context, Code.UNIMPLEMENTED, "this engine cannot manage adapters")

    def _adapter_path(self, given: str) -> Path:
        if not given:
            raise InvalidRequest("path is empty")
        if self._adapters_dir is None:
            return Path(given)
        path = (self._adapters_dir / given).resolve()
        if not path.is_relative_to(self._adapters_dir):
            raise InvalidRequest(f"path={given!r} is outside the server's adapters directory")
        return path

    async def _on_engine(
        self,
        context: grpc.aio.ServicerContext,
        fn: Callable[[Any], T],
        *,
        adapter_error: grpc.StatusCode = Code.FAILED_PRECONDITION,
    ) -> T:
        """fn(engine) on the scheduler thread; its exceptions as status codes."""
        try:
            return await asyncio.wrap_future(self._scheduler.call(fn))
        except _Status as err:
            await _abort(context, err.code, str(err))
        except UnknownAdapter as err:
            await _abort(context, Code.NOT_FOUND, str(err))
        except InvalidRequest as err:
            await _abort(context, Code.INVALID_ARGUMENT, str(err))
        except AdapterError as err:
            await _abort(context, adapter_error, str(err))
        except EngineFailed as err:
            await _abort(context, Code.UNAVAILABLE, str(err))
        except Exception as err:
            log.exception("engine call failed")
            await _abort(context, Code.INTERNAL, f"{type(err).__name__}: {err}")


def _find(engine: Any, name: str) -> AdapterInfo | None:
    return next((info for info in engine.adapter_infos() if info.name == name), None)


def _get(engine: Any, name: str) -> AdapterInfo:
    info = _find(engine, name)
    if info is None:
        raise _Status(Code.NOT_FOUND, f"adapter name={name!r} is not registered")
    return info
