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

The workers' own metrics, where the router knows their URLs (`worker_metrics`: `jlora
up` gives each worker a metrics port and tells the router): `exposition()`, which the
HTTP /metrics serves, scrapes every worker's /metrics at once (at most
`SCRAPE_TIMEOUT` seconds each) and adds its families after the router's, each sample
labelled {worker="host:port"} (the worker's gRPC address, as above), so one scrape
target shows every worker's vllm:num_requests_waiting, vllm:lora_requests_info, ...;
jlora_router_worker_metrics_up{worker} is 1 for the workers whose /metrics answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from jlora.contract.metrics import LATENCY_BUCKETS, OUTCOMES, PER_TOKEN_BUCKETS
from router.workers import Worker

log = logging.getLogger(__name__)

SOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SCRAPE_TIMEOUT = 2.0  # seconds a worker's /metrics may take to answer a scrape


class RouterMetrics:
    """The router's registry. `workers()`: the pool's workers, read at scrape time;
    `worker_metrics`: worker address -> the URL of its /metrics (see the module
    docstring)."""

    def __init__(
        self,
        workers: Callable[[], Sequence[Worker]],
        worker_metrics: Mapping[str, str] | None = None,
    ) -> None:
        self.worker_metrics = dict(worker_metrics or {})
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

    async def exposition(self) -> bytes:
        """/metrics in Prometheus' text format: the router's registry, then the workers'
        metrics, scraped now and relabelled (on the router's event loop)."""
        own = generate_latest(self.registry)
        if not self.worker_metrics:
            return own
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            pages = await asyncio.gather(
                *(_scrape(session, url) for url in self.worker_metrics.values())
            )
        scraped = CollectorRegistry(auto_describe=False)
        scraped.register(_ScrapedCollector(dict(zip(self.worker_metrics, pages, strict=True))))
        return own + generate_latest(scraped)


async def _scrape(session: aiohttp.ClientSession, url: str) -> list[Metric] | None:
    """The metric families at `url`; None if it does not answer them in time."""
    try:
        async with session.get(url) as reply:
            reply.raise_for_status()
            return list(text_string_to_metric_families(await reply.text()))
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        log.info("no metrics from %s: %s", url, err or type(err).__name__)
        return None


class _ScrapedCollector(Collector):
    """The workers' families (address -> families, None for a worker that did not
    answer), merged by name, each sample labelled with its worker."""

    def __init__(self, pages: Mapping[str, list[Metric] | None]) -> None:
        self._pages = pages

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "jlora_router_worker_metrics_up",
            "1 if the worker's /metrics answered this scrape",
            labels=["worker"],
        )
        merged: dict[str, Metric] = {}
        for address, families in self._pages.items():
            up.add_metric([address], float(families is not None))
            for family in families or ():
                into = merged.get(family.name)
                if into is None:
                    into = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = into
                for sample in family.samples:
                    labels = {**sample.labels, "worker": address}
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield up
        yield from merged.values()


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
