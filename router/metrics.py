"""Every Prometheus metric the router exports, on its own registry, served at /metrics on
the HTTP port.

Updated on the event loop by the front door (times are as the router sees them, so they
include the hop to the worker):

- jlora_router_queued_requests: Generate calls waiting in the router's queue for a
  worker with room; jlora_router_in_flight_requests: calls forwarded to a worker;
- jlora_router_requests_total{outcome}; jlora_router_reroutes_total (a worker failed
  before the first token and another took the request); jlora_router_resumes_total (a
  worker failed after a token, and another continued the stream from there);
- jlora_router_time_to_first_token_seconds, jlora_router_time_per_output_token_seconds,
  jlora_router_request_latency_seconds.

Migration and placement (dLoRA §5, `--migration on` / `--preload on`; migrator.py),
updated by the migrator and the front door:

- jlora_router_migrations_total{state}: requests moved to another worker, by where they
  were on their worker ("queued", "running"); jlora_router_migrations_failed_total:
  moves the plan asked for that did not happen (the request ended meanwhile, Migrate or
  the adapter's load failed);
- jlora_router_migration_bytes_total: bytes sent again to resume moved requests (their
  prompt and generated token ids, 4 bytes each: jlora migrates by recomputation);
- jlora_router_migration_transfer_cheaper_total: moves for which the cost model says
  copying the KV cache would have been faster than recomputing it;
- jlora_router_migration_plans_total{result}: co-migration problems solved: "moved"
  (executed), "no_move" (the plan keeps everything in place), "violations" (skipped: the
  plan broke a constraint); jlora_router_migration_solve_seconds: the solver's time;
- jlora_router_adapter_loads_total{cause}: LoadAdapter calls the router made, for a
  migration ("migration") or ahead of demand ("preload").

Read from the workers' last snapshots at scrape time (labelled {worker="host:port"}):
jlora_router_worker_up, jlora_router_worker_running_requests (the running batch),
jlora_router_worker_queued_requests, jlora_router_worker_adapter_loads_total,
jlora_router_worker_adapter_evictions_total (the worker's own counters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jlora.contract.metrics import LATENCY_BUCKETS, OUTCOMES, PER_TOKEN_BUCKETS
from router.workers import Worker

SOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, workers: Callable[[], Sequence[Worker]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.queued = Gauge(
            "jlora_router_queued_requests",
            "Generate calls waiting in the router's queue for a worker with room",
            registry=registry,
        )
        self.in_flight = Gauge(
            "jlora_router_in_flight_requests",
            "Generate calls forwarded to a worker and not yet ended",
            registry=registry,
        )
        self.requests = Counter(
            "jlora_router_requests", "Generate calls, by outcome", ["outcome"], registry=registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.reroutes = Counter(
            "jlora_router_reroutes",
            "Requests sent to another worker after one failed before their first token",
            registry=registry,
        )
        self.resumes = Counter(
            "jlora_router_resumes",
            "Streams continued on another worker after theirs failed after a token",
            registry=registry,
        )
        self.ttft = Histogram(
            "jlora_router_time_to_first_token_seconds",
            "From the router receiving a request to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpt = Histogram(
            "jlora_router_time_per_output_token_seconds",
            "Between two consecutive tokens of one request, at the router",
            buckets=PER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "jlora_router_request_latency_seconds",
            "From the router receiving a request to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.migrations = Counter(
            "jlora_router_migrations",
            "Requests moved to another worker, by their state on the worker they left",
            ["state"],
            registry=registry,
        )
        for state in ("queued", "running"):
            self.migrations.labels(state)
        self.migrations_failed = Counter(
            "jlora_router_migrations_failed",
            "Moves a migration plan asked for that did not happen",
            registry=registry,
        )
        self.migration_bytes = Counter(
            "jlora_router_migration_bytes",
            "Bytes of token ids sent again to resume moved requests (recomputation)",
            registry=registry,
        )
        self.transfer_cheaper = Counter(
            "jlora_router_migration_transfer_cheaper",
            "Moves for which copying the KV cache would have beaten recomputing it",
            registry=registry,
        )
        self.migration_plans = Counter(
            "jlora_router_migration_plans",
            "Co-migration problems solved, by what came of the plan",
            ["result"],
            registry=registry,
        )
        for result in ("moved", "no_move", "violations"):
            self.migration_plans.labels(result)
        self.solve_seconds = Histogram(
            "jlora_router_migration_solve_seconds",
            "Time to solve one co-migration problem",
            buckets=SOLVE_BUCKETS,
            registry=registry,
        )
        self.adapter_loads = Counter(
            "jlora_router_adapter_loads",
            "LoadAdapter calls the router made, for a migration or ahead of demand",
            ["cause"],
            registry=registry,
        )
        for cause in ("migration", "preload"):
            self.adapter_loads.labels(cause)
        registry.register(_WorkerCollector(workers))


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Sequence[Worker]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["worker"]
        up = GaugeMetricFamily(
            "jlora_router_worker_up", "1 if the worker takes requests", labels=labels
        )
        running = GaugeMetricFamily(
            "jlora_router_worker_running_requests",
            "The worker's running batch at its last poll",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "jlora_router_worker_queued_requests",
            "Requests queued on the worker at its last poll",
            labels=labels,
        )
        loads = CounterMetricFamily(
            "jlora_router_worker_adapter_loads",
            "Adapter loads onto the worker's device since the worker started",
            labels=labels,
        )
        evictions = CounterMetricFamily(
            "jlora_router_worker_adapter_evictions",
            "Adapters evicted from the worker's device slots since the worker started",
            labels=labels,
        )
        for worker in self._workers():
            address = [worker.address]
            up.add_metric(address, float(worker.up))
            stats = worker.stats
            if stats is None:
                continue
            running.add_metric(address, len(stats.running))
            queued.add_metric(address, stats.queued)
            loads.add_metric(address, stats.adapter_slots.loads)
            evictions.add_metric(address, stats.adapter_slots.evictions)
        yield from (up, running, queued, loads, evictions)
