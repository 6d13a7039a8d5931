"""Request-adapter co-migration through the router (dLoRA §5; router/migrator.py,
router/frontdoor.py) with MockEngine workers, whose streams are known exactly: a request
that moves, once or more, must still give the caller the unmigrated run's tokens, none
lost or repeated, with its finish reason and usage."""

from __future__ import annotations

import argparse
import socket
import threading

import grpc
import pytest

from jlora.api import jlora_pb2 as pb
from jlora.engine.mock import mock_completion, mock_engine
from jlora.server import WorkerServer, serve
from router.app import start_router
from router.migration import violations
from router.migrator import MigrationConfig, move_cost
from router.policies import ResidentFirst
from tests.test_router import router_metrics, scrape, stub_for, wait_for
from tests.test_server import VOCAB, request

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

Code = grpc.StatusCode


@pytest.fixture
def cluster():
    """start(engine options per worker..., late=(index,...), migration=...) -> (router,
    workers, start_late): workers in this process; the `late` ones are only given a
    port, and `start_late()` serves them there (a worker that joins a loaded cluster)."""
    servers: list[WorkerServer] = []
    routers: list = []

    def start(*engines: dict, late: tuple[int, ...] = (), **router_options):
        addresses, pending = [], []
        for index, options in enumerate(engines):
            options = {"adapters": {"a": 8, "b": 16}, **options}
            if index in late:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = probe.getsockname()[1]
                addresses.append(f"127.0.0.1:{port}")
                pending.append((options, port))
                continue
            server = serve(mock_engine(**options), max_queue=16)
            servers.append(server)
            addresses.append(server.address)
        router = start_router(addresses, poll_interval=0.05, http_port=0, **router_options)
        routers.append(router)

        def start_late() -> list[WorkerServer]:
            started = [serve(mock_engine(**options), port=port) for options, port in pending]
            servers.extend(started)
            return started

        return router, start_late

    yield start
    for router in routers:
        router.stop(grace=0)
    for server in servers:
        server.stop(grace=0)


class Client:
    """Generate calls through the router, each read on its own thread."""

    def __init__(self, router) -> None:
        self.stub = stub_for(router.address)
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.last: dict[str, pb.GenerateResponse] = {}
        self.errors: dict[str, grpc.RpcError] = {}
        self.threads: list[threading.Thread] = []
        self.calls: dict[str, grpc.Future] = {}

    def send(self, request_id: str, timeout: float = 60, **fields) -> None:
        message = request(request_id=request_id, **fields)
        call = self.stub.Generate(message, timeout=timeout)
        self.calls[request_id] = call
        self.tokens[request_id] = []
        self.text[request_id] = ""

        def read() -> None:
            try:
                for response in call:
                    self.tokens[request_id].append(response.token_id)
                    self.text[request_id] += response.text
                    self.last[request_id] = response
            except grpc.RpcError as err:
                self.errors[request_id] = err

        thread = threading.Thread(target=read)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive(), "a stream hung"


def assert_unmigrated_run(client: Client, cases: dict[str, tuple[list[int], str, int]]) -> None:
    """Every stream is the one an unmigrated run gives: same tokens, each once, its
    finish reason and usage."""
    assert client.errors == {}
    for request_id, (prompt, adapter, total) in cases.items():
        assert client.tokens[request_id] == mock_completion(prompt, adapter or None, total, VOCAB)
        last = client.last[request_id]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), total)


def router_idle(router) -> bool:
    front = router.front
    return not front.in_flight and not any(w.dispatches for w in front.pool.workers)


def metric(router, name: str, **labels) -> float:
    return scrape(router_metrics(router), name, **labels)


def test_a_stream_moved_twice_by_the_front_door_keeps_its_tokens(cluster):
    router, _ = cluster({"step_latency": 0.01}, {"step_latency": 0.01})
    first, second = (router.front.pool.get(w.address) for w in router.workers)
    client = Client(router)
    prompt, total = [4, 2], 80
    client.send("r", ids=prompt, adapter="a", max_tokens=total)
    wait_for(lambda: len(client.tokens["r"]) >= 5, what="the first tokens")
    reply = router._run(router.front.migrate("r", second))
    assert reply is not None and reply.running and len(reply.generated_ids) >= 5
    wait_for(lambda: second.dispatches.get("r") is not None, what="the resume on the second")
    wait_for(lambda: len(client.tokens["r"]) >= len(reply.generated_ids) + 5, what="tokens")
    again = router._run(router.front.migrate("r", first))
    assert again is not None and len(again.generated_ids) > len(reply.generated_ids)
    client.join()
    assert_unmigrated_run(client, {"r": (prompt, "a", total)})
    assert router._run(router.front.migrate("r", second)) is None  # it has ended
    wait_for(lambda: router_idle(router), what="the router's bookkeeping to empty")
    sent = metric(router, "jlora_router_migration_bytes_total")
    assert sent == 4 * (2 * len(prompt) + len(reply.generated_ids) + len(again.generated_ids))


def test_the_router_sends_every_request_with_a_seed(monkeypatch):
    """So that a resume after a fault continues what the lost worker would have sampled,
    the router sends every request with a seed: the caller's, or its own draw (what a
    worker would otherwise draw for itself, unknown to the router)."""
    engine = mock_engine(adapters={"a": 8})
    seen: dict[str, int | None] = {}
    add = engine.add_request

    def record(request):
        seen[request.request_id] = request.sampling.seed
        return add(request)

    monkeypatch.setattr(engine, "add_request", record)
    server = serve(engine, max_queue=16)
    router = start_router([server.address], poll_interval=0.05, http_port=None)
    try:
        stub = stub_for(router.address)
        for request_id, fields in (
            ("sampled", dict(temperature=0.8)),
            ("greedy", {}),
            ("seeded", dict(temperature=0.8, seed=1234)),
        ):
            message = request(ids=[4, 2], max_tokens=3, request_id=request_id, **fields)
            assert len(list(stub.Generate(message, timeout=10))) == 3
    finally:
        router.stop(grace=0)
        server.stop(grace=0)
    assert seen["seeded"] == 1234
    assert all(seed is not None and 0 <= seed < 2**32 for seed in seen.values()), seen


def test_cancelling_a_moved_stream_frees_both_workers(cluster):
    router, _ = cluster({"step_latency": 0.01}, {"step_latency": 0.01})
    first, second = (router.front.pool.get(w.address) for w in router.workers)
    client = Client(router)
    client.send("c", ids=[7], max_tokens=100)
    wait_for(lambda: len(client.tokens["c"]) >= 3, what="the first tokens")
    target = second if "c" in first.dispatches else first
    assert router._run(router.front.migrate("c", target)) is not None
    wait_for(lambda: "c" in target.dispatches and target.dispatches["c"].started, what="resume")
    client.calls["c"].cancel()
    client.join()
    assert client.errors["c"].code() == Code.CANCELLED
    received = client.tokens["c"]
    assert received == mock_completion([7], None, len(received), VOCAB)
    for worker in router.workers:
        wait_for(lambda w=worker: not stub_for(w.address).Stats(pb.StatsRequest()).running)
    wait_for(lambda: router_idle(router), what="the router's bookkeeping to empty")


def test_the_deadline_holds_across_a_move(cluster):
    router, _ = cluster({"step_latency": 0.01}, {"step_latency": 0.01})
    first, second = (router.front.pool.get(w.address) for w in router.workers)
    client = Client(router)
    client.send("d", timeout=0.6, ids=[3], max_tokens=120)
    wait_for(lambda: len(client.tokens["d"]) >= 3, what="the first tokens")
    target = second if "d" in first.dispatches else first
    assert router._run(router.front.migrate("d", target)) is not None
    client.join()
    assert client.errors["d"].code() == Code.DEADLINE_EXCEEDED
    received = client.tokens["d"]
    assert 3 < len(received) < 120 and received == mock_completion([3], None, len(received), VOCAB)
    for worker in router.workers:
        wait_for(lambda w=worker: not stub_for(w.address).Stats(pb.StatsRequest()).running)
    wait_for(lambda: router_idle(router), what="the router's bookkeeping to empty")


def test_the_migrator_moves_running_requests_off_a_full_worker(cluster):
    """Worker 0 takes four long requests that fill its KV cache while worker 1 is down;
    worker 1 comes up; the migrator moves running requests to it."""
    # 4 blocks a request, and a page of the pool for each of the adapters a and b;
    # reserved up front, so worker 0 is full from the start (lazily, it would fill only
    # as the answers grow, and have no reason to shed them before)
    busy = {"max_slots": 4, "num_blocks": 18, "step_latency": 0.02, "kv_allocation": "upfront"}
    config = MigrationConfig(period=0.1, preload=False)
    router, start_late = cluster(busy, busy, late=(1,), migration=config)
    client = Client(router)
    cases = {f"r{i}": ([i + 1, 3], ["a", "b", ""][i % 3], 56) for i in range(4)}
    for request_id, (prompt, adapter, total) in cases.items():
        client.send(request_id, ids=prompt, adapter=adapter, max_tokens=total)
    [loaded] = [w for w in router.workers if w.up]
    wait_for(
        lambda: len(loaded.dispatches) == 4 and all(d.started for d in loaded.dispatches.values()),
        what="four running on worker 0",
    )
    start_late()
    client.join()
    assert_unmigrated_run(client, cases)
    assert metric(router, "jlora_router_migrations_total", state="running") >= 1
    assert metric(router, "jlora_router_migration_plans_total", result="violations") == 0
    problem, plan = router.migrator.last_problem, router.migrator.last_plan
    assert problem is not None and plan is not None and violations(problem, plan) == []
    assert metric(router, "jlora_router_migration_solve_seconds_count") >= 1
    wait_for(lambda: router_idle(router), what="the router's bookkeeping to empty")


def test_the_migrator_moves_queued_requests_to_a_worker_that_joins(cluster):
    """Two decode slots and six requests on worker 0, worker 1 down: four queue there.
    Worker 1 comes up; their queuing delay triggers the migrator, which moves queued ones
    (and the adapters they need) to it."""
    small = {"max_slots": 2, "step_latency": 0.02, "max_loras": 2}
    config = MigrationConfig(period=0.1, queue_delay_threshold=0.2, preload=False)
    router, start_late = cluster(small, small, late=(1,), migration=config)
    client = Client(router)
    cases = {f"q{i}": ([9, i + 2], ["a", "b"][i % 2], 30) for i in range(6)}
    for request_id, (prompt, adapter, total) in cases.items():
        client.send(request_id, ids=prompt, adapter=adapter, max_tokens=total)
    [loaded] = [w for w in router.workers if w.up]
    wait_for(lambda: len(loaded.dispatches) == 6, what="all six on worker 0")
    start_late()
    client.join()
    assert_unmigrated_run(client, cases)
    assert metric(router, "jlora_router_migrations_total", state="queued") >= 1
    assert metric(router, "jlora_router_adapter_loads_total", cause="migration") >= 1
    assert metric(router, "jlora_router_migration_plans_total", result="violations") == 0
    problem, plan = router.migrator.last_problem, router.migrator.last_plan
    assert problem is not None and plan is not None and violations(problem, plan) == []
    wait_for(lambda: router_idle(router), what="the router's bookkeeping to empty")


def test_preloading_puts_a_busy_adapter_on_the_other_worker(cluster):
    config = MigrationConfig(period=0.1, migrate=False, rate_window=1.0)
    router, _ = cluster({}, {}, migration=config)
    assert isinstance(router.front.policy, ResidentFirst)
    stub = stub_for(router.address)
    for i in range(6):
        list(stub.Generate(request(ids=[i + 1], adapter="a", max_tokens=2), timeout=10))

    def everywhere() -> bool:
        listings = [
            stub_for(w.address).ListAdapters(pb.ListAdaptersRequest()).adapters
            for w in router.workers
        ]
        return all(
            any(a.name == "a" and a.state == pb.ADAPTER_STATE_DEVICE for a in listing)
            for listing in listings
        )

    wait_for(everywhere, what="adapter a on both workers")
    assert metric(router, "jlora_router_adapter_loads_total", cause="preload") >= 1
    assert router.migrator.rates["a"] > 0


def test_the_router_answers_migrate_unimplemented(cluster):
    router, _ = cluster({})
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(router.address).Migrate(pb.MigrateRequest(request_id="x"), timeout=5)
    assert caught.value.code() == Code.UNIMPLEMENTED
    assert "worker" in caught.value.details()


# -- the cost model and the flags ---------------------------------------------------------


def test_the_cost_model_says_when_a_kv_copy_would_beat_recomputation():
    smollm2 = 2 * 30 * 3 * 64 * 2  # bytes of KV a token: 2 x layers x kv_heads x dim x bf16
    cpu = move_cost(1000, kv_bytes_per_token=smollm2, bandwidth=1e9, prefill_seconds=0.5)
    assert cpu.kv_bytes == 23_040_000 and cpu.transfer_seconds == pytest.approx(0.02304)
    assert cpu.transfer_cheaper  # a CPU prefill of 1000 tokens takes far longer
    llama7b = 2 * 32 * 32 * 128 * 2
    gpu = move_cost(1000, kv_bytes_per_token=llama7b, bandwidth=1e9, prefill_seconds=0.1)
    assert gpu.transfer_seconds == pytest.approx(0.524288) and not gpu.transfer_cheaper


def parse(*argv: str) -> argparse.Namespace:
    from jlora.cli import router as cli

    parser = argparse.ArgumentParser(prog="jlora")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", "--workers", "h:1", *argv])


def test_the_migration_flags_parse_into_a_config():
    from jlora.cli.common import UsageError
    from jlora.cli.router import migration_config

    assert migration_config(parse()) is None  # off by default: routing as before
    config = migration_config(
        parse("--migration", "on", "--migration-period", "0.5", "--migration-top-k", "3")
    )
    assert config == MigrationConfig(period=0.5, top_k=3)
    only_preload = migration_config(parse("--preload", "on"))
    assert only_preload is not None and (only_preload.migrate, only_preload.preload) == (
        False,
        True,
    )
    no_preload = migration_config(parse("--migration", "on", "--preload", "off"))
    assert no_preload is not None and (no_preload.migrate, no_preload.preload) == (True, False)
    with pytest.raises(SystemExit):
        parse("--migration", "maybe")
    with pytest.raises(UsageError, match="--migration-kv-free"):
        migration_config(parse("--migration", "on", "--migration-kv-free", "1.5"))
    with pytest.raises(UsageError, match="--migration-period"):
        migration_config(parse("--migration", "on", "--migration-period", "0"))


def test_jlora_up_takes_the_migration_flags():
    from jlora.cli import up
    from jlora.cli.router import migration_config

    parser = argparse.ArgumentParser(prog="jlora")
    up.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["up", "--migration", "on", "--migration-queue-delay", "1"])
    config = migration_config(args)
    assert config is not None and config.migrate and config.queue_delay_threshold == 1.0
    assert migration_config(parser.parse_args(["up"])) is None


def test_the_default_keeps_routing_as_it_was(cluster):
    router, _ = cluster({})
    assert router.migrator is None and not isinstance(router.front.policy, ResidentFirst)
    message = request(ids=[1, 2], max_tokens=3)
    assert [r.token_id for r in stub_for(router.address).Generate(message, timeout=10)] == (
        mock_completion([1, 2], None, 3, VOCAB)
    )


# -- real workers ---------------------------------------------------------------------------


@pytest.mark.slow
def test_two_smollm2_workers_continue_a_moved_or_orphaned_stream_exactly(tmp_path):
    """Two `jlora serve` processes with the real SmolLM2 (fp32): a greedy text-prompt
    stream with an adapter, moved mid-way by the router (recomputed on the target from
    the prompt's and the generated token ids), gives the unmigrated run's tokens and
    text; then a sampled one whose worker is SIGKILLed mid-way, resumed by the router on
    the other from the caller's text and the tokens it forwarded, with its seed, gives
    the tokens and text of a run that was never interrupted."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from jlora.adapters.peft import make_demo_adapters
    from jlora.cli.common import model_config

    root = Path(__file__).resolve().parent.parent
    adapters_dir = tmp_path / "adapters"
    [adapter] = make_demo_adapters(model_config("smollm2-135m"), adapters_dir, n=1, ranks=[8])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    processes, port_files = [], []
    for index in range(2):
        port_file = tmp_path / f"port-{index}"
        port_files.append(port_file)
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jlora.cli.main",
                    "serve",
                    "--model",
                    "smollm2-135m",
                    "--dtype",
                    "float32",
                    "--port",
                    "0",
                    "--port-file",
                    str(port_file),
                    "--max-seq-len",
                    "128",
                    "--max-slots",
                    "2",
                    "--adapters-dir",
                    str(adapters_dir),
                    "--warmup",
                    "on-demand",
                ],
                cwd=root,
                env=env,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        )
    router = None
    try:
        deadline = time.monotonic() + 600
        for process, port_file in zip(processes, port_files, strict=True):
            while not port_file.exists() or not port_file.read_text().strip():
                assert process.poll() is None, "jlora serve exited"
                assert time.monotonic() < deadline, "jlora serve did not start"
                time.sleep(0.2)
        addresses = [f"127.0.0.1:{port_file.read_text().strip()}" for port_file in port_files]
        message = request(
            text="The capital of France is", adapter=adapter.name, max_tokens=24, ignore_eos=True
        )
        direct = list(stub_for(addresses[0]).Generate(message, timeout=300))
        router = start_router(addresses, poll_interval=0.1, http_port=None)
        first, second = (router.front.pool.get(address) for address in addresses)
        wait_for(lambda: first.up and second.up, timeout=30, what="both workers up")
        client = Client(router)
        client.send(
            "moved",
            text="The capital of France is",
            adapter=adapter.name,
            max_tokens=24,
            ignore_eos=True,
        )
        wait_for(lambda: len(client.tokens["moved"]) >= 6, timeout=120, what="six tokens")
        source = first if "moved" in first.dispatches else second
        target = second if source is first else first
        reply = router._run(router.front.migrate("moved", target))
        assert reply is not None and len(reply.generated_ids) >= 6
        client.join()
        assert client.errors == {}
        assert client.tokens["moved"] == [r.token_id for r in direct]
        assert client.text["moved"] == "".join(r.text for r in direct)
        assert client.last["moved"].usage == direct[-1].usage
        sampled = dict(
            text="Once upon a time", max_tokens=24, ignore_eos=True, temperature=0.9, seed=7
        )
        alone = list(stub_for(addresses[1]).Generate(request(**sampled), timeout=300))
        client.send("orphaned", **sampled)
        wait_for(lambda: len(client.tokens["orphaned"]) >= 6, timeout=120, what="six tokens")
        doomed = first if "orphaned" in first.dispatches else second
        processes[addresses.index(doomed.address)].kill()
        client.join()
        assert client.errors == {}
        assert client.tokens["orphaned"] == [r.token_id for r in alone]
        assert client.text["orphaned"] == "".join(r.text for r in alone)
        assert client.last["orphaned"].usage.completion_tokens == 24
        assert not doomed.up
    finally:
        if router is not None:
            router.stop(grace=0)
        for process in processes:
            process.kill()
            process.wait()
