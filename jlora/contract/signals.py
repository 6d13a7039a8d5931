"""Drain on SIGTERM/SIGINT: the same for a worker, the router and `jlora up`."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType

log = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
