"""Every Prometheus metric the worker exports, defined in one place, on its own registry.

Names follow Prometheus conventions (base units, `_total` added to counters by the
client library). Who updates what:

- the event loop (request bookkeeping): jlora_queued_requests, jlora_running_requests,
  jlora_requests_total{outcome}, jlora_prompt_tokens_total, jlora_generated_tokens_total,
  jlora_time_to_first_token_seconds, jlora_time_per_output_token_seconds,
  jlora_request_latency_seconds;
- the scheduler thread (per engine step): jlora_batch_size, jlora_step_seconds, and from
  the engine's stats at most every `STATS_INTERVAL` seconds: jlora_adapter_loads_total,
  jlora_adapter_evictions_total, jlora_preemptions_total, jlora_prefill_chunks_total,
  jlora_adapter_load_wait_seconds_total, jlora_kv_blocks_free,
  jlora_adapter_slots_free, and
  with merging on (dLoRA): jlora_merged_iterations_total, jlora_unmerged_iterations_total,
  jlora_merge_switches_total, jlora_merged_adapter{adapter}, jlora_merge_threshold{name},
  jlora_adapter_credit{adapter}, jlora_adapter_wait_seconds{adapter} ("" is the base
  model), and with a memory pool (EngineStats.cache): jlora_pool_pages{kind},
  jlora_pool_page_bytes, jlora_host_pool_bytes_used, jlora_host_pool_bytes_capacity,
  jlora_prefix_cache_hit_rate, jlora_prefix_cache_prompt_tokens_total,
  jlora_prefix_cache_hit_tokens_total, jlora_pool_swaps_total{direction},
  jlora_pool_swap_bytes_total{direction}, jlora_invalid_kv_pages.

Counters mirror the engine's cumulative counts: each snapshot adds what they grew by.

vLLM's names beside them, so what reads a vLLM server (Grafana's vLLM dashboard, the
Gateway API Inference Extension's endpoint picker) reads a worker. Each is labelled
{model_name} (the served model id), but vllm:lora_requests_info, whose labels are vLLM's:

- on the event loop, each with its jlora twin in the same call (`Metrics.request_queued`
  ... `stream_closed`): vllm:num_requests_running, vllm:num_requests_waiting
  (jlora_running_requests, jlora_queued_requests), vllm:prompt_tokens_total,
  vllm:generation_tokens_total, vllm:time_to_first_token_seconds,
  vllm:time_per_output_token_seconds, vllm:e2e_request_latency_seconds (histograms on
  vLLM's buckets);
- from the engine's stats: vllm:kv_cache_usage_perc, the fraction (0..1) of the device
  pool's pages in use (`kv_cache_usage`: KV blocks of requests and adapters' rank rows;
  prefix-cache history counts as free, as vLLM counts its cached blocks), and, on an
  engine that serves adapters, vllm:lora_requests_info{running_lora_adapters,
  waiting_lora_adapters, max_lora}: the adapters of the running and of the queued
  requests (sorted, comma-separated names, the base model left out) and the device's
  adapter slots (EngineStats.adapter_slots_total: the engine's max_loras, or more where
  adapters live in the pool's pages); its value is the time of the snapshot (seconds
  since the epoch), by which a reader finds the newest. vLLM keeps each earlier label
  set with its older time; here only the newest one is exported.

prometheus_client's metrics are thread-safe. `serve(..., metrics_port=...)` exposes the
registry at http://host:port/metrics.
"""

from __future__ import annotations

import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from jlora.contract.metrics import LATENCY_BUCKETS, OUTCOMES, PER_TOKEN_BUCKETS
from jlora.engine.api import CacheStats, EngineStats, MergeStats, RunningInfo

STATS_INTERVAL = 0.5  # seconds between two engine-stats refreshes


_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's buckets for its histograms of the same names.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
# jlora_pool_pages{kind}: the kinds partition the pool (they sum to its pages).
POOL_KINDS = ("kv", "kv_cached", "lora", "free")


def kv_cache_usage(stats: EngineStats) -> float:
    """The fraction (0..1) of the device pool's pages in use (vllm:kv_cache_usage_perc)."""
    if stats.kv_blocks_total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - stats.kv_blocks_free / stats.kv_blocks_total))


class Metrics:
    """The registry and its metrics; `model_name` labels the vLLM-named ones. The event
    loop's bookkeeping goes through the methods `request_queued` ... `stream_closed`,
    each of which updates a jlora metric and its vLLM twin."""

    def __init__(self, model_name: str = "base") -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.model_name = model_name
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
        self.preemptions = Counter(
            "jlora_preemptions",
            "Running requests sent back to the queue because the KV pool ran out",
            registry=registry,
        )
        self.prefill_chunks = Counter(
            "jlora_prefill_chunks",
            "Prefills cut short by an iteration's prompt-token budget (chunked prefill)",
            registry=registry,
        )
        self.adapter_load_wait = Counter(
            "jlora_adapter_load_wait_seconds",
            "Seconds queued requests waited for their adapter to be on the device",
            registry=registry,
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
        self.pool_pages = Gauge(
            "jlora_pool_pages",
            "Device pool pages by use: kv (KV blocks running requests read), kv_cached "
            "(prefix-cache history only), lora (adapter rank rows), free",
            ["kind"],
            registry=registry,
        )
        self.pool_page_bytes = Gauge(
            "jlora_pool_page_bytes",
            "Bytes of one pool page (one KV block of every layer, keys and values)",
            registry=registry,
        )
        self.host_pool_bytes_used = Gauge(
            "jlora_host_pool_bytes_used",
            "Bytes of the host pool holding swapped-out KV blocks",
            registry=registry,
        )
        self.host_pool_bytes_capacity = Gauge(
            "jlora_host_pool_bytes_capacity", "Capacity of the host pool", registry=registry
        )
        self.prefix_hit_rate = Gauge(
            "jlora_prefix_cache_hit_rate",
            "Prefilled prompt tokens taken from the prefix cache, as a fraction of all",
            registry=registry,
        )
        self.prefix_prompt_tokens = Counter(
            "jlora_prefix_cache_prompt_tokens",
            "Prompt tokens prefilled (the hit rate's denominator)",
            registry=registry,
        )
        self.prefix_hit_tokens = Counter(
            "jlora_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache instead of being computed",
            registry=registry,
        )
        self.pool_swaps = Counter(
            "jlora_pool_swaps",
            "KV blocks moved between the device pool and the host pool (out: to the host)",
            ["direction"],
            registry=registry,
        )
        self.pool_swap_bytes = Counter(
            "jlora_pool_swap_bytes",
            "Bytes moved between the device pool and the host pool (out: to the host)",
            ["direction"],
            registry=registry,
        )
        self.invalid_kv_pages = Gauge(
            "jlora_invalid_kv_pages",
            "Device KV pages whose adapter is not on the device (FastLibra's invalid KV)",
            registry=registry,
        )
        self._add_vllm_metrics()
        # What the event loop counted so far (read by the throughput log's thread).
        self.prompt_tokens_seen = 0
        self.generated_tokens_seen = 0
        self._seen: dict[Counter, float] = {}  # each mirrored counter's last engine count
        self._lora_labels: tuple[str, str, str] | None = None  # lora info's label set now

    def _add_vllm_metrics(self) -> None:
        registry, labels, model = self.registry, ["model_name"], self.model_name
        self.vllm_running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            labels,
            registry=registry,
        ).labels(model)
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            labels,
            registry=registry,
        ).labels(model)
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            labels,
            registry=registry,
        ).labels(model)
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed", labels, registry=registry
        ).labels(model)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            labels,
            registry=registry,
        ).labels(model)
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            labels,
            buckets=VLLM_TTFT_BUCKETS,
            registry=registry,
        ).labels(model)
        self.vllm_tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds",
            labels,
            buckets=VLLM_TPOT_BUCKETS,
            registry=registry,
        ).labels(model)
        self.vllm_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            labels,
            buckets=VLLM_LATENCY_BUCKETS,
            registry=registry,
        ).labels(model)
        self.vllm_lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests",
            LORA_INFO_LABELS,
            registry=registry,
        )

    # -- request bookkeeping, on the event loop ----------------------------------------

    def request_queued(self) -> None:
        """A Generate call was accepted (it waits for its first token)."""
        self.queued.inc()
        self.vllm_waiting.inc()

    def prompt_accepted(self, tokens: int) -> None:
        """The engine took a request of `tokens` prompt tokens."""
        self.prompt_tokens.inc(tokens)
        self.vllm_prompt_tokens.inc(tokens)
        self.prompt_tokens_seen += tokens

    def first_token(self, seconds: float) -> None:
        """A request's first token, `seconds` after the request arrived: it runs now."""
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)
        self.queued.dec()
        self.vllm_waiting.dec()
        self.running.inc()
        self.vllm_running.inc()

    def next_token(self, seconds: float) -> None:
        """A later token, `seconds` after the request's previous one."""
        self.tpt.observe(seconds)
        self.vllm_tpot.observe(seconds)

    def tokens_streamed(self, tokens: int) -> None:
        self.generated_tokens.inc(tokens)
        self.vllm_generation_tokens.inc(tokens)
        self.generated_tokens_seen += tokens

    def request_finished(self, seconds: float) -> None:
        """A request's last token (it has a finish reason), `seconds` after it arrived."""
        self.latency.observe(seconds)
        self.vllm_latency.observe(seconds)

    def stream_closed(self, *, started: bool) -> None:
        """A Generate call ended, after its first token (`started`) or before."""
        if started:
            self.running.dec()
            self.vllm_running.dec()
        else:
            self.queued.dec()
            self.vllm_waiting.dec()

    # -- engine snapshots, on the scheduler thread -------------------------------------

    def observe_engine(self, stats: EngineStats) -> None:
        """Fold an engine-stats snapshot in (the engine's counters are cumulative)."""
        self._catch_up(self.adapter_loads, stats.adapter_loads)
        self._catch_up(self.adapter_evictions, stats.adapter_evictions)
        self._catch_up(self.preemptions, stats.preemptions)
        self._catch_up(self.prefill_chunks, stats.prefill_chunks)
        self._catch_up(self.adapter_load_wait, stats.adapter_wait_s)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.adapter_slots_free.set(stats.adapter_slots_free)
        self.vllm_kv_usage.set(kv_cache_usage(stats))
        if stats.adapter_slots_total > 0:
            self._observe_lora_requests(stats)
        if stats.merging is not None:
            self._observe_merging(stats.merging)
        if stats.cache is not None:
            self._observe_cache(stats.cache)

    def _observe_lora_requests(self, stats: EngineStats) -> None:
        """vllm:lora_requests_info: one label set, the newest, set to the time now."""

        def names(requests: tuple[RunningInfo, ...]) -> str:
            return ",".join(sorted({r.adapter for r in requests if r.adapter}))

        labels = (names(stats.running), names(stats.queued), str(stats.adapter_slots_total))
        if self._lora_labels not in (None, labels):
            self.vllm_lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.vllm_lora_info.labels(*labels).set_to_current_time()

    def _catch_up(self, counter: Counter, count: float) -> None:
        """Advance `counter` to the engine's cumulative `count` (never backwards)."""
        seen = self._seen.get(counter, 0)
        counter.inc(max(0, count - seen))
        self._seen[counter] = max(seen, count)

    def _observe_merging(self, merging: MergeStats) -> None:
        self._catch_up(self.merged_iterations, merging.merged_iterations)
        self._catch_up(self.unmerged_iterations, merging.unmerged_iterations)
        self._catch_up(self.merge_switches, merging.switches)
        self.merge_threshold.labels("alpha").set(merging.alpha)
        self.merge_threshold.labels("beta").set(merging.beta)
        for adapter, credit in merging.credits:
            self.adapter_credit.labels(adapter).set(credit)
            self.merged_adapter.labels(adapter).set(adapter == (merging.merged or None))
        for adapter, wait in merging.waits:
            self.adapter_wait.labels(adapter).set(wait)

    def _observe_cache(self, cache: CacheStats) -> None:
        pages = {
            "kv": cache.pages_kv - cache.pages_kv_cached,
            "kv_cached": cache.pages_kv_cached,
            "lora": cache.pages_lora,
            "free": cache.pages_total - cache.pages_kv - cache.pages_lora,
        }
        for kind in POOL_KINDS:
            self.pool_pages.labels(kind).set(pages[kind])
        self.pool_page_bytes.set(cache.page_bytes)
        self.host_pool_bytes_used.set(cache.host_bytes_used)
        self.host_pool_bytes_capacity.set(cache.host_bytes_capacity)
        self.prefix_hit_rate.set(cache.hit_rate)
        self.invalid_kv_pages.set(cache.invalid_kv_pages)
        self._catch_up(self.prefix_prompt_tokens, cache.prompt_tokens)
        self._catch_up(self.prefix_hit_tokens, cache.hit_tokens)
        for direction, swaps, swapped_bytes in (
            ("in", cache.swaps_in, cache.swap_in_bytes),
            ("out", cache.swaps_out, cache.swap_out_bytes),
        ):
            self._catch_up(self.pool_swaps.labels(direction), swaps)
            self._catch_up(self.pool_swap_bytes.labels(direction), swapped_bytes)

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
