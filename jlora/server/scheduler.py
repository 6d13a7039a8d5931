"""The scheduler thread: the only thread that drives the engine (the orchestrator).

The orchestrator is not thread-safe (only its `stage_adapter` may run elsewhere), so
one thread owns it and runs, in a loop:

1. the commands queued by the gRPC handlers (`call(fn)`: add a request, abort one,
   commit an adapter, read stats), in order, each between two steps; a command's
   result or exception comes back through a `concurrent.futures.Future`;
2. one `engine.step()` if the engine has unfinished requests, and hands the step's
   tokens, stamped with the time the step returned, to `deliver` (which forwards them
   to the event loop);
3. every `STATS_INTERVAL` seconds, and after the step that leaves the engine idle
   (before its tokens go out, so a client that sees its last token scrapes idle gauges),
   an engine-stats snapshot into the metrics and the throughput log (logs.py: a line
   every `LOG_INTERVAL` seconds while busy).

When the engine has nothing to do the thread blocks on the command queue (waking every
`STATS_INTERVAL` for the metrics), so an idle worker burns no CPU. A request that fails
ends as an event of its own (the orchestrator isolates it); a step that raises means
the device is broken, which is fatal: the thread records the error, fails every pending
and later command with `EngineFailed`, calls `on_failure` and exits; it never dies
silently.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from jlora.engine.api import TokenEvent
from jlora.engine.orchestrator import Orchestrator
from jlora.server.logs import ThroughputLog
from jlora.server.metrics import STATS_INTERVAL, Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
# deliver(events of one step, the monotonic time the step returned)
Deliver = Callable[[list[TokenEvent], float], None]


class EngineFailed(RuntimeError):
    """The engine raised in step(): the device is broken; the worker cannot serve any more."""


class Scheduler:
    def __init__(
        self,
        engine: Orchestrator,
        *,
        deliver: Deliver,
        metrics: Metrics,
        on_failure: Callable[[BaseException], None] = lambda err: None,
    ) -> None:
        self.engine = engine
        self._deliver = deliver
        self._metrics = metrics
        self._throughput = ThroughputLog(metrics, now=time.monotonic())
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue[tuple[Callable[[Orchestrator], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()  # orders `call` against the thread's exit
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jlora-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[Orchestrator], T]) -> Future[T]:
        """Run fn(engine) on the scheduler thread between two steps."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                future.set_exception(self._closed_error())
            else:
                self._commands.put((fn, future))
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request (queued or running) without waiting; unknown ids are ignored."""
        self.call(lambda engine: engine.abort(request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Run the commands already queued, then end the thread (the engine is left open)."""
        with self._lock:
            if not self._stopped:
                self._commands.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        next_stats = 0.0
        try:
            while True:
                if not self._run_commands(block=not self.engine.has_unfinished):
                    break
                if self.engine.has_unfinished:
                    start = time.monotonic()
                    events = self.engine.step()
                    now = time.monotonic()
                    self._metrics.step_seconds.observe(now - start)
                    if not self.engine.has_unfinished:  # idle: the gauges say so before the
                        next_stats = self._snapshot()  # last tokens reach their clients
                    if events:
                        self._metrics.batch_size.observe(len({e.request_id for e in events}))
                        self._deliver(events, now)
                if time.monotonic() >= next_stats:
                    next_stats = self._snapshot()
        except BaseException as err:
            log.exception("the engine failed; the worker stops serving")
            self.error = err
            self._on_failure(err)
        finally:
            with self._lock:
                self._stopped = True
            self._fail_pending()

    def _snapshot(self) -> float:
        """The engine's stats into the metrics and the throughput line; returns when the
        next snapshot is due."""
        stats = self.engine.stats()
        self._metrics.observe_engine(stats)
        self._throughput.observe(stats, time.monotonic())
        return time.monotonic() + STATS_INTERVAL

    def _run_commands(self, *, block: bool) -> bool:
        """Run every queued command (waiting up to STATS_INTERVAL for one if `block`);
        False once the stop sentinel is reached."""
        try:
            item = self._commands.get(block=block, timeout=STATS_INTERVAL if block else None)
        except queue.Empty:
            return True
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:  # the caller's to handle (RequestError, ...)
                    future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(self._closed_error())

    def _closed_error(self) -> Exception:
        if self.error is not None:
            return EngineFailed(f"the engine failed: {self.error!r}")
        return EngineFailed("the scheduler is stopped")
