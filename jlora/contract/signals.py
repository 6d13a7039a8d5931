"""Drain on SIGTERM/SIGINT: the same for a worker, the router and `jlora up`."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType

log = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
WAKE_S = 0.25  # the longest the main thread sleeps between two looks at pending signals


def drain_on_signals(
    stop: Callable[[float], None], grace: float, signals: Iterable[int] = DRAIN_SIGNALS
) -> None:
    """Install handlers that call `stop(grace)` on a helper thread at the first of
    `signals` (a handler must return at once; the drain blocks). Call on the main thread."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: draining (grace %.0f s)", signum, grace)
        threading.Thread(target=stop, args=(grace,), name="jlora-drain").start()

    for signum in signals:
        signal.signal(signum, handler)


def wait_awake(event: threading.Event, timeout: float | None = None) -> bool:
    """`event.wait(timeout)` in slices of WAKE_S, for the main thread of a process that
    drains on signals: Python runs a signal's handler on the main thread between two
    bytecodes, so one asleep in a single long wait runs it only if the signal interrupts
    that wait, which it does not when the kernel hands it to another thread (gRPC's, the
    event loop's). True once the event is set, False after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
        if event.wait(max(0.0, left)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
