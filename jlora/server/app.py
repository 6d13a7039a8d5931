"""`serve()`: a worker's gRPC server (plus health, reflection and /metrics) around an engine.

Threads of a running worker:

- the event loop thread (`jlora-grpc`) runs the grpc.aio server: the `jlora.v1.Jlora`
  handlers (servicer.py), the standard health service and server reflection (v1alpha
  and v1), built as the router's is (jlora.contract.grpc_server: a port of its own, a
  request that does not parse answered INVALID_ARGUMENT);
- the scheduler thread (`jlora-scheduler`) owns the engine (scheduler.py);
- the metrics HTTP server's thread, if `metrics_port` is given;
- the caller's thread gets a `WorkerServer` back at once and may `wait()` on it.

While a server runs, what the process held when it started is frozen out of the
garbage collector's full passes (`gc.freeze`), which would otherwise stall every stream
for as long as they take (`_freeze_heap`).

Stopping (`WorkerServer.stop(grace)`, or SIGTERM after `stop_on_signals`) drains:

1. new Generate calls are refused (UNAVAILABLE) and the health service reports
   NOT_SERVING, so a router stops sending work here;
2. the Generate streams in flight get `grace` seconds to finish; then the gRPC server
   stops, cancelling what is left (streams past their grace, health Watch calls), and
   the cancelled handlers abort their engine requests;
3. the scheduler thread runs those aborts and exits; the metrics server and the loop
   stop. The engine is left open: its owner closes it.

A request that fails (a bad adapter load, a broken CPU path) ends alone; the worker
keeps serving. Only a broken device (step() raises) stops it: every stream ends with
INTERNAL, health reports NOT_SERVING, and later calls get UNAVAILABLE;
`WorkerServer.error` holds the cause.

With an API key (`api_key`), every call but health checks and reflection must carry
`authorization: Bearer <key>` (jlora.contract.auth), else UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2

from jlora.api import SERVICE_NAME
from jlora.contract.grpc_server import start_server
from jlora.contract.signals import DRAIN_SIGNALS, drain_on_signals, wait_awake
from jlora.contract.tool_calls import FORMATS, detect
from jlora.engine.api import SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.server.convert import TextCodec
from jlora.server.metrics import Metrics
from jlora.server.scheduler import Scheduler
from jlora.server.servicer import JloraServicer

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
_DRAIN_POLL = 0.01  # seconds between two looks at the streams in flight while draining
_FINAL_GRACE = 0.25  # seconds the other calls get once the streams are done

# The servers running in this process, which keep its heap frozen (see _freeze_heap).
_serving = 0
_serving_lock = threading.Lock()


def _freeze_heap() -> None:
    """A server starts: what the process holds now (weights, compiled steps, tables) is
    moved out of the collector's reach. A full collection walks every tracked object with
    the GIL held; at the 0.9M objects of a long test process it took 0.4 s, and every
    stream stalled for it (vLLM freezes its start-up heap for the same reason). Whatever
    is garbage already is collected once the last server stops (`_thaw_heap`), so
    nothing is lost and no collection is paid for here."""
    global _serving
    with _serving_lock:
        _serving += 1
        gc.freeze()


def _thaw_heap() -> None:
    """A server stopped: with none left, the frozen heap is collectable again."""
    global _serving
    with _serving_lock:
        _serving -= 1
        if not _serving:
            gc.unfreeze()


class WorkerServer:
    """A running worker; build it with `serve()`."""

    def __init__(
        self,
        engine: Orchestrator,
        *,
        host: str,
        port: int,
        metrics_port: int | None,
        tokenizer: TextCodec | None,
        model_name: str,
        max_queue: int,
        adapters_dir: Path | None,
        api_key: str | None,
        sampling_defaults: SamplingParams,
        tool_call_parser: str,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be non-negative")
        self.engine = engine
        self.host = host
        self._api_key = api_key
        self.metrics = Metrics(model_name)
        self._loop = asyncio.new_event_loop()
        self.scheduler = Scheduler(
            engine,
            deliver=self._deliver,
            metrics=self.metrics,
            on_failure=self.fail,
        )
        self.servicer = JloraServicer(
            engine,
            self.scheduler,
            self.metrics,
            tokenizer=tokenizer,
            model_name=model_name,
            max_queue=max_queue,
            adapters_dir=adapters_dir,
            sampling_defaults=sampling_defaults,
            tool_call_parser=tool_call_parser,
        )
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._http: WSGIServer | None = None
        self._stop_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="jlora-grpc", daemon=True
        )
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(port), self._loop).result()
            self.metrics_port: int | None = None
            if metrics_port is not None:
                self._http, self.metrics_port = self.metrics.start_http(host, metrics_port)
        except BaseException:
            if self._server is not None:
                asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise
        _freeze_heap()
        self.scheduler.start()
        log.info("jlora worker on %s:%d (metrics: %s)", host, self.port, self.metrics_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def error(self) -> BaseException | None:
        """Why the engine failed, if it did."""
        return self.scheduler.error

    def stop(self, grace: float = 30.0) -> None:
        """Drain (see the module docstring) and return once everything has stopped;
        a second call waits for the first."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            try:
                asyncio.run_coroutine_threadsafe(self._drain(grace), self._loop).result()
            finally:
                self.scheduler.stop()
                if self._http is not None:
                    self._http.shutdown()
                    self._http.server_close()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
                _thaw_heap()
                self._stopped.set()
                log.info("jlora worker on %s stopped", self.address)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (True) or `timeout` passed (False)."""
        return wait_awake(self._stopped, timeout)

    def stop_on_signals(self, grace: float = 30.0, signals: Iterable[int] = DRAIN_SIGNALS) -> None:
        """On the first of `signals`, drain with `grace` on a helper thread (call this on
        the main thread, then `wait()`)."""
        drain_on_signals(self.stop, grace, signals)

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)

    # -- on the event loop ------------------------------------------------------------

    async def _start(self, port: int) -> int:
        self._server, bound = await start_server(
            self.servicer, self._health, host=self.host, port=port, api_key=self._api_key
        )
        await self._set_health(SERVING)
        return bound

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _drain(self, grace: float) -> None:
        self.servicer.draining = True
        await self._health.enter_graceful_shutdown()
        # Still listening, so health checks see NOT_SERVING and new Generate calls get
        # UNAVAILABLE, while the streams in flight finish (or `grace` runs out).
        deadline = self._loop.time() + grace
        while self.servicer.in_flight and self._loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL)
        # Then close: unary calls and final statuses get a moment; long-lived calls
        # (health Watch, streams past their grace) are cancelled.
        if self._server is not None:
            await self._server.stop(_FINAL_GRACE)

    def _deliver(self, events: list, stamp: float) -> None:
        """From the scheduler thread: hand one step's tokens to the loop."""
        self._loop.call_soon_threadsafe(self.servicer.dispatch, events, stamp)

    def fail(self, error: BaseException) -> None:
        """The engine can serve no more (any thread): every stream ends with INTERNAL,
        health reports NOT_SERVING, later calls get UNAVAILABLE."""

        def fail() -> None:
            self.servicer.draining = True
            self.servicer.fail_all(error)
            self._loop.create_task(self._health.enter_graceful_shutdown())

        if not self._loop.is_closed():  # a server stopped already has nothing to fail
            self._loop.call_soon_threadsafe(fail)


def serve(
    engine: Orchestrator,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    tokenizer: TextCodec | None = None,
    model_name: str = "base",
    max_queue: int = 64,
    adapters_dir: str | Path | None = None,
    api_key: str | None = None,
    sampling_defaults: SamplingParams | None = None,
    tool_call_parser: str | None = None,
) -> WorkerServer:
    """Serve `engine` over gRPC and return once it listens.

    port 0 picks a free port (`WorkerServer.port`); metrics_port None serves no /metrics,
    0 picks a free port. `tokenizer` encodes text and chat prompts (None: token ids
    only). `model_name` is the base model's id in Models (and as Generate's adapter, the
    base model) and the vllm:* metrics' model_name label. At most max_slots +
    `max_queue` Generate calls are in flight; more get RESOURCE_EXHAUSTED. With
    `adapters_dir`, RegisterAdapter paths resolve inside it and may not leave it.
    `api_key`: required of every call but health and reflection.
    `sampling_defaults`: what a request's unset sampling fields take (the model's
    generation_config, where it has one; `SamplingParams()` by default).
    `tool_call_parser`: the format Models reports for tool calls (one of
    jlora.contract.tool_calls.FORMATS, or "" for none; None: the one the tokenizer's chat
    template asks for). The caller owns the engine: stop the server, then close it.
    """
    if tool_call_parser is None:
        tool_call_parser = detect(getattr(tokenizer, "chat_template", None))
    elif tool_call_parser and tool_call_parser not in FORMATS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r} is not one of {FORMATS}")
    return WorkerServer(
        engine,
        host=host,
        port=port,
        metrics_port=metrics_port,
        tokenizer=tokenizer,
        model_name=model_name,
        max_queue=max_queue,
        adapters_dir=Path(adapters_dir) if adapters_dir is not None else None,
        api_key=api_key,
        sampling_defaults=sampling_defaults or SamplingParams(),
        tool_call_parser=tool_call_parser,
    )
