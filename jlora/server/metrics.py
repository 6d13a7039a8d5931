"""Every Prometheus metric the worker exports, defined in one place, on its own registry.

Names follow Prometheus conventions (base units, `_total` added to counters by the
client library). Who updates what:

- the event loop (request bookkeeping): jlora_queued_requests, jlora_running_requests,
  jlora_requests_total{outcome}, jlora_prompt_tokens_total, jlora_generated_tokens_total,
  jlora_time_to_first_token_seconds, jlora_time_per_output_token_seconds,
  jlora_request_latency_seconds;
- the scheduler thread (per engine step): jlora_batch_size, jlora_step_seconds, and from
  the engine's stats at most every `STATS_INTERVAL` seconds: jlora_adapter_loads_total,
  jlora_adapter_evictions_total, jlora_kv_blocks_free, jlora_adapter_slots_free, and
  with merging on (dLoRA): jlora_merged_iterations_total, jlora_unmerged_iterations_total,
  jlora_merge_switches_total, jlora_merged_adapter{adapter}, jlora_merge_threshold{name},
  jlora_adapter_credit{adapter}, jlora_adapter_wait_seconds{adapter} ("" is the base
  model).

prometheus_client's metrics are thread-safe. `serve(..., metrics_port=...)` exposes the
registry at http://host:port/metrics.
"""

from __future__ import annotations

import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from jlora.contract.metrics import LATENCY_BUCKETS, OUTCOMES, PER_TOKEN_BUCKETS
from jlora.engine.api import EngineStats, MergeStats

STATS_INTERVAL = 0.5  # seconds between two engine-stats refreshes


_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.queued = Gauge(
            "jlora_queued_requests",
            "Accepted Generate calls that have no token yet (waiting for a decode slot)",
            registry=registry,
        )
        self.running = Gauge(
            "jlora_running_requests",
            "Generate calls that are producing tokens (the running batch)",
            registry=registry,
        )
        self.requests = Counter(
            "jlora_requests", "Generate calls, by outcome", ["outcome"], registry=registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(
            "jlora_prompt_tokens", "Prompt tokens of accepted requests", registry=registry
        )
        self.generated_tokens = Counter(
            "jlora_generated_tokens", "Tokens streamed to clients", registry=registry
        )
        self.ttft = Histogram(
            "jlora_time_to_first_token_seconds",
            "From the server receiving a request to its first token (queueing included)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpt = Histogram(
            "jlora_time_per_output_token_seconds",
            "Between two consecutive tokens of one request",
            buckets=PER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "jlora_request_latency_seconds",
            "From the server receiving a request to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "jlora_batch_size",
            "Requests that produced a token in one engine step",
            buckets=_BATCH,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "jlora_step_seconds",
            "Duration of one engine step",
            buckets=PER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.adapter_loads = Counter(
            "jlora_adapter_loads", "Adapter loads onto the device", registry=registry
        )
        self.adapter_evictions = Counter(
            "jlora_adapter_evictions", "Adapters evicted from a device slot", registry=registry
        )
        self.kv_blocks_free = Gauge(
            "jlora_kv_blocks_free", "Free KV-cache blocks", registry=registry
        )
        self.adapter_slots_free = Gauge(
            "jlora_adapter_slots_free", "Free device adapter slots", registry=registry
        )
        self.merged_iterations = Counter(
            "jlora_merged_iterations",
            "Decode steps run with an adapter merged into the base weights",
            registry=registry,
        )
        self.unmerged_iterations = Counter(
            "jlora_unmerged_iterations",
            "Decode steps run unmerged, with merging on",
            registry=registry,
        )
        self.merge_switches = Counter(
            "jlora_merge_switches", "Merges and unmerges of adapter weights", registry=registry
        )
        self.merged_adapter = Gauge(
            "jlora_merged_adapter",
            "1 for the adapter merged into the base weights now, 0 for the others",
            ["adapter"],
            registry=registry,
        )
        self.merge_threshold = Gauge(
            "jlora_merge_threshold",
            "dLoRA's tuned switching thresholds (alpha: merge above, beta: unmerge below)",
            ["name"],
            registry=registry,
        )
        self.adapter_credit = Gauge(
            "jlora_adapter_credit",
            "Each adapter's credit for out-of-order service (dLoRA Algorithm 3)",
            ["adapter"],
            registry=registry,
        )
        self.adapter_wait = Gauge(
            "jlora_adapter_wait_seconds",
            "The longest a runnable request of each adapter has gone without a token",
            ["adapter"],
            registry=registry,
        )
        self._seen_loads = 0
        self._seen_evictions = 0
        self._seen_merge: tuple[int, ...] = (0, 0, 0)

    def observe_engine(self, stats: EngineStats) -> None:
        """Fold an engine-stats snapshot in (the engine's counters are cumulative)."""
        self.adapter_loads.inc(max(0, stats.adapter_loads - self._seen_loads))
        self.adapter_evictions.inc(max(0, stats.adapter_evictions - self._seen_evictions))
        self._seen_loads = max(self._seen_loads, stats.adapter_loads)
        self._seen_evictions = max(self._seen_evictions, stats.adapter_evictions)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.adapter_slots_free.set(stats.adapter_slots_free)
        if stats.merging is not None:
            self._observe_merging(stats.merging)

    def _observe_merging(self, merging: MergeStats) -> None:
        now = (merging.merged_iterations, merging.unmerged_iterations, merging.switches)
        for counter, seen, value in zip(
            (self.merged_iterations, self.unmerged_iterations, self.merge_switches),
            self._seen_merge,
            now,
            strict=True,
        ):
            counter.inc(max(0, value - seen))
        self._seen_merge = tuple(max(a, b) for a, b in zip(self._seen_merge, now, strict=True))
        self.merge_threshold.labels("alpha").set(merging.alpha)
        self.merge_threshold.labels("beta").set(merging.beta)
        for adapter, credit in merging.credits:
            self.adapter_credit.labels(adapter).set(credit)
            self.merged_adapter.labels(adapter).set(adapter == (merging.merged or None))
        for adapter, wait in merging.waits:
            self.adapter_wait.labels(adapter).set(wait)

    def start_http(self, host: str, port: int) -> tuple[WSGIServer, int]:
        """Serve /metrics on a daemon thread; returns the HTTP server (`shutdown()` takes at
        most `_HTTP_POLL` seconds) and its bound port."""
        httpd = make_server(
            host, port, make_wsgi_app(self.registry), _ThreadingServer, _QuietHandler
        )
        threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": _HTTP_POLL},
            name="jlora-metrics",
            daemon=True,
        ).start()
        return httpd, httpd.server_port


_HTTP_POLL = 0.05


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not news."""
