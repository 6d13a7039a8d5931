"""The worker's two kinds of log line about its traffic, as vLLM writes them.

- One line per Generate call that got as far as opening a stream, as the call ends
  (`log_request`, on the event loop): the request id, the adapter, its prompt tokens
  (and how many of them the prefix cache served), the tokens generated here, the time to
  the first token and to the end, and the finish reason or how the call failed (an
  outcome of jlora.contract.metrics: "stop", "length", "cancelled", "migrated", ...).
- Every `LOG_INTERVAL` seconds while the worker is busy, and once more when it has gone
  idle, a throughput line (`ThroughputLog`, on the scheduler thread, from its engine
  snapshots): prompt and generation tokens per second over the interval, the running and
  waiting requests, and the KV-cache usage (vllm:kv_cache_usage_perc's fraction).

Each line's fields also travel as attributes of the log record (the names of `extra`),
so that `--log-format json` (jlora/cli/common.py) writes them as keys of their own. Both
lines go to this module's logger at INFO, which `jlora serve`, `up` and `router` leave
at INFO whatever the level of the others.
"""

from __future__ import annotations

import logging

from jlora.engine.api import EngineStats
from jlora.server.metrics import Metrics, kv_cache_usage

log = logging.getLogger(__name__)

LOG_INTERVAL = 10.0  # seconds between two throughput lines


def log_request(
    request_id: str,
    *,
    adapter: str | None,
    prompt_tokens: int,
    cached_tokens: int,
    generation_tokens: int,
    ttft: float | None,
    e2e: float,
    finish_reason: str,
) -> None:
    """The line of one call that has ended. adapter: None for the base model; ttft: the
    seconds from arrival to the first token (None: no token came), e2e: to the end."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields = {
        "request_id": request_id,
        "adapter": adapter,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "generation_tokens": generation_tokens,
        "ttft_s": None if ttft is None else round(ttft, 6),
        "e2e_s": round(e2e, 6),
        "finish_reason": finish_reason,
    }
    log.info(
        "request %s finished: adapter=%s prompt_tokens=%d cached_tokens=%d "
        "generation_tokens=%d ttft=%s e2e=%.3fs finish_reason=%s",
        request_id,
        adapter or "-",
        prompt_tokens,
        cached_tokens,
        generation_tokens,
        "-" if ttft is None else f"{ttft:.3f}s",
        e2e,
        finish_reason,
        extra=fields,
    )


class ThroughputLog:
    """The throughput line's state: the token counts (`Metrics.prompt_tokens_seen`,
    `generated_tokens_seen`, written on the event loop) at the last line. `observe` is
    called with each engine snapshot; `now` is time.monotonic()."""

    def __init__(self, metrics: Metrics, *, now: float, interval: float = LOG_INTERVAL) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval} must be positive")
        self._metrics = metrics
        self.interval = interval
        self._since = now
        self._prompt = metrics.prompt_tokens_seen
        self._generated = metrics.generated_tokens_seen
        self._busy = False  # in the last interval

    def observe(self, stats: EngineStats, now: float) -> bool:
        """Once `interval` seconds have passed since the last line: write one if this
        interval or the last was busy (tokens, running or waiting requests), and start
        the next interval. True if a line was written."""
        elapsed = now - self._since
        if elapsed < self.interval:
            return False
        prompt = self._metrics.prompt_tokens_seen - self._prompt
        generated = self._metrics.generated_tokens_seen - self._generated
        self._since, self._prompt, self._generated = (
            now,
            self._prompt + prompt,
            self._generated + generated,
        )
        busy = bool(prompt or generated or stats.running or stats.waiting)
        was_busy, self._busy = self._busy, busy
        if not (busy or was_busy):
            return False
        fields = {
            "prompt_throughput": round(prompt / elapsed, 3),
            "generation_throughput": round(generated / elapsed, 3),
            "running": len(stats.running),
            "waiting": stats.waiting,
            "kv_cache_usage": round(kv_cache_usage(stats), 6),
        }
        log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
            prompt / elapsed,
            generated / elapsed,
            len(stats.running),
            stats.waiting,
            100 * kv_cache_usage(stats),
            extra=fields,
        )
        return True
