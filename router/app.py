"""`start_router()`: the router in this process, its gRPC and HTTP servers on one loop.

Threads of a running router: the event loop thread (`jlora-router`) runs everything, the
worker pollers (workers.py), the front door (frontdoor.py), the migrator's task when
migration or preloading is on (migrator.py; it solves in a thread of the loop's default
executor), the grpc.aio server with the
`jlora.v1.Jlora` service (service.py), health and reflection (built as a worker's server
is: jlora.contract.grpc_server), and the aiohttp server with the OpenAI API, /metrics
(the router's, and the workers' scraped at each request: metrics.py) and /health
(http.py); the caller's thread gets a `RouterHandle` back once both listen
and every worker has been polled once (or the poll timed out).

Stopping (`RouterHandle.stop(grace)`, or SIGTERM after `stop_on_signals`) drains:

1. new Generate calls and HTTP requests get UNAVAILABLE (503) and the health service
   reports NOT_SERVING, so a load balancer stops sending work here;
2. the calls in flight (queued or streaming) get `grace` seconds to finish;
3. then the servers stop, cancelling what is left (which cancels the workers' calls),
   the pollers stop and the registry closes. The workers keep running.

With an API key, both front doors require it (jlora.contract.auth: gRPC metadata or the
HTTP Authorization header; health, reflection, /health and /metrics stay open), and the
router sends it to its workers, which may require the same key.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2

from jlora.api import SERVICE_NAME
from jlora.contract.grpc_server import start_server
from jlora.contract.registry import Registry
from jlora.contract.signals import DRAIN_SIGNALS, drain_on_signals, wait_awake
from router.frontdoor import FrontDoor
from router.http import OpenAIApi, start_http
from router.http_body import HttpLimits
from router.metrics import RouterMetrics
from router.migrator import MigrationConfig, Migrator
from router.perf_model import PerfProfile
from router.policies import Policy, PolicyError, ResidentFirst, ShortestPending, make_policy
from router.service import RouterServicer
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
T = TypeVar("T")

NEEDS_PROFILE = ("rank-aware", "shortest-pending")
SLO_TIMES_BASE = 1.5  # default SLO: 1.5 x the profile's decode time without adapters
_DRAIN_POLL = 0.01
_FINAL_GRACE = 0.25


def build_policy(
    name: str,
    *,
    profile: str | Path | PerfProfile | None = None,
    slo_ms: float | None = None,
    avg_resp_len: float = 128.0,
    adapter_load_ms: float = 0.0,
    seed: int = 0,
) -> Policy:
    """The routing policy `--policy name` selects; PolicyError (or ProfileError, naming the
    file and field) for a bad name or option.

    rank-aware and shortest-pending evaluate a worker's fitted performance models, so
    they need `profile` (a `jlora profile` JSON file, `--profile`); the others take
    none. rank-aware's SLO defaults to 1.5 x the profile's decode iteration without
    adapters (its β), the papers' "1.5 x no-LoRA time per token".
    """
    if name in NEEDS_PROFILE and profile is None:
        raise PolicyError(
            f"--policy {name} needs a performance profile: pass --profile FILE (profile= in "
            "Python), the JSON file `jlora profile` writes for the workers' hardware"
        )
    loaded = PerfProfile.load(profile) if isinstance(profile, str | Path) else profile
    if name == "rank-aware" and slo_ms is None and loaded is not None:
        slo_ms = SLO_TIMES_BASE * loaded.decode.predict([0])
        if not (math.isfinite(slo_ms) and slo_ms > 0):
            raise PolicyError(
                f"the profile's decode time without adapters is {slo_ms / SLO_TIMES_BASE} ms, "
                "so no default SLO follows from it: pass --slo-ms"
            )
    return make_policy(
        name,
        profile=loaded,
        slo_ms=slo_ms,
        avg_resp_len=avg_resp_len,
        adapter_load_ms=adapter_load_ms,
        seed=seed,
    )


def parse_workers(workers: str | Iterable[str]) -> list[str]:
    """The addresses in "host:port,host:port" (or a list); ValueError naming a bad one."""
    items = workers.split(",") if isinstance(workers, str) else list(workers)
    addresses = [item.strip() for item in items if item.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"workers: {address!r} is not HOST:PORT")
    if not addresses:
        raise ValueError("workers: at least one HOST:PORT is needed")
    return addresses


class RouterHandle:
    """A running router; build it with `start_router()`."""

    def __init__(
        self,
        workers: list[str],
        policy: Policy,
        registry: Registry,
        *,
        host: str,
        port: int,
        http_port: int | None,
        adapters_dir: Path | None,
        model_name: str | None,
        max_queue: int,
        request_timeout: float | None,
        poll_interval: float,
        poll_timeout: float,
        missed_probes: int,
        api_key: str | None,
        http_limits: HttpLimits | None = None,
        migration: MigrationConfig | None = None,
        profile: PerfProfile | None = None,
        worker_metrics: Mapping[str, str] | None = None,
    ) -> None:
        self.host = host
        self.registry = registry
        self.migrator: Migrator | None = None
        self._migration = migration
        self._profile = profile
        self._migrator_task: asyncio.Task | None = None
        self._api_key = api_key
        self._http_limits = http_limits
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._health = health.aio.HealthServicer()
        self._stop_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="jlora-router", daemon=True
        )
        self._thread.start()

        async def build() -> FrontDoor:
            # On the loop: grpc.aio channels and asyncio primitives bind to it.
            pool = WorkerPool(
                workers,
                poll_interval=poll_interval,
                poll_timeout=poll_timeout,
                missed_probes=missed_probes,
                on_up=lambda worker: front.adapters.register_missing(worker),
                on_change=lambda: front.workers_changed(),
                api_key=api_key,
            )
            front = FrontDoor(
                pool,
                policy,
                registry,
                metrics=RouterMetrics(lambda: pool.workers, worker_metrics),
                adapters_dir=adapters_dir,
                model_name=model_name,
                max_queue=max_queue,
            )
            return front

        try:
            self.front = self._run(build())
            self.port, self.http_port = self._run(self._start(port, http_port, request_timeout))
        except BaseException:
            self._run(self._close(0))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            registry.close()
            raise
        log.info(
            "jlora router on %s:%d (HTTP: %s), %d workers, policy %s",
            host,
            self.port,
            self.http_port,
            len(workers),
            policy.name,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def workers(self) -> list[Worker]:
        return self.front.pool.workers

    def stop(self, grace: float = 30.0) -> None:
        """Drain (see the module docstring) and return once everything has stopped; a
        second call waits for the first."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            try:
                self._run(self._drain(grace))
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
                self.registry.close()
                self._stopped.set()
                log.info("jlora router on %s stopped", self.address)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the router has stopped (True) or `timeout` passed (False)."""
        return wait_awake(self._stopped, timeout)

    def stop_on_signals(self, grace: float = 30.0, signals: Iterable[int] = DRAIN_SIGNALS) -> None:
        """On the first of `signals`, drain with `grace` on a helper thread (call this on
        the main thread, then `wait()`)."""
        drain_on_signals(self.stop, grace, signals)

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)

    # -- on the event loop ------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the router's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(
        self, port: int, http_port: int | None, request_timeout: float | None
    ) -> tuple[int, int | None]:
        await self.front.pool.start()
        if self._migration is not None:
            self.migrator = Migrator(
                self.front, self._migration, metrics=self.front.metrics, profile=self._profile
            )
            self._migrator_task = asyncio.create_task(self.migrator.run(), name="migrator")
        self._server, bound = await start_server(
            RouterServicer(self.front),
            self._health,
            host=self.host,
            port=port,
            api_key=self._api_key,
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        bound_http = None
        if http_port is not None:
            api = OpenAIApi(
                self.front,
                request_timeout=request_timeout,
                api_key=self._api_key,
                limits=self._http_limits,
            )
            self._runner, bound_http = await start_http(api, self.host, http_port)
        return bound, bound_http

    async def _drain(self, grace: float) -> None:
        self.front.draining = True
        await self._health.enter_graceful_shutdown()
        deadline = self._loop.time() + grace
        while self.front.in_flight and self._loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL)
        await self._close(_FINAL_GRACE)

    async def _close(self, grace: float) -> None:
        if self._migrator_task is not None:
            self._migrator_task.cancel()
            await asyncio.gather(self._migrator_task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            await self._server.stop(grace)
        front = getattr(self, "front", None)
        if front is not None:
            await front.pool.close()


def start_router(
    workers: str | Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    http_port: int | None = 0,
    policy: str = "most-idle",
    profile: str | Path | PerfProfile | None = None,
    slo_ms: float | None = None,
    avg_resp_len: float = 128.0,
    adapter_load_ms: float = 0.0,
    seed: int = 0,
    registry: str | Path = ":memory:",
    adapters_dir: str | Path | None = None,
    model_name: str | None = None,
    max_queue: int = 64,
    request_timeout: float | None = None,
    poll_interval: float = 0.25,
    poll_timeout: float = 1.0,
    missed_probes: int = 3,
    api_key: str | None = None,
    http_limits: HttpLimits | None = None,
    migration: MigrationConfig | None = None,
    worker_metrics: Mapping[str, str] | None = None,
) -> RouterHandle:
    """Start a router in front of `workers` ("host:port,..." or a list) and return once it
    listens.

    port / http_port 0 pick free ports (`RouterHandle.port`, `.http_port`); http_port None
    serves no HTTP. `policy` is a `router.policies.POLICIES` name (see `build_policy`
    for `profile`, `slo_ms`, `avg_resp_len`, `adapter_load_ms`, `seed`). `registry`: the
    SQLite adapter registry file (":memory:": a private one). `adapters_dir`: where
    RegisterAdapter paths resolve (without it the router registers no adapters); the
    workers must see the same directory as their own --adapters-dir, since they get
    paths relative to it. `model_name`: the base model's id (default: the workers' own).
    `max_queue`: requests that may wait in the router for a worker with room; more get
    RESOURCE_EXHAUSTED. `request_timeout`: the HTTP API's deadline in seconds.
    `poll_interval` / `poll_timeout`: the workers' health and stats polling;
    `missed_probes` health probes missed in a row mark a worker down. `api_key`:
    required of clients on both front doors, and sent to the workers. `http_limits`: the
    HTTP API's body size, body and idle timeouts (default: `HttpLimits()`'s).
    `migration`: dLoRA's request-adapter co-migration and adapter preloading
    (migrator.py; None: off). With it on, a policy other than shortest-pending is wrapped
    in `ResidentFirst` (workers holding the request's adapter with a free slot first).
    `worker_metrics`: worker address -> the URL of its Prometheus /metrics, which the
    router's /metrics then serves too, labelled by worker (router/metrics.py).
    """
    addresses = parse_workers(workers)
    loaded = PerfProfile.load(profile) if isinstance(profile, str | Path) else profile
    chosen = build_policy(
        policy,
        profile=loaded,
        slo_ms=slo_ms,
        avg_resp_len=avg_resp_len,
        adapter_load_ms=adapter_load_ms,
        seed=seed,
    )
    if migration is not None and not isinstance(chosen, ShortestPending):
        chosen = ResidentFirst(chosen)
    if max_queue < 0:
        raise ValueError(f"max_queue={max_queue} must be >= 0")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval={poll_interval} must be positive")
    if os.fspath(registry) != ":memory:":
        Path(registry).parent.mkdir(parents=True, exist_ok=True)
    opened = Registry(registry)
    return RouterHandle(
        addresses,
        chosen,
        opened,
        host=host,
        port=port,
        http_port=http_port,
        adapters_dir=Path(adapters_dir) if adapters_dir is not None else None,
        model_name=model_name,
        max_queue=max_queue,
        request_timeout=request_timeout,
        poll_interval=poll_interval,
        poll_timeout=poll_timeout,
        missed_probes=missed_probes,
        api_key=api_key,
        http_limits=http_limits,
        migration=migration,
        profile=loaded,
        worker_metrics=worker_metrics,
    )
