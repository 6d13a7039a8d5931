"""The router (`router.app.start_router`, `jlora router`) in front of MockEngine workers on
loopback.

Workers run as real processes where the test is about a process (killed, restarted,
drained) and in this process elsewhere; either way every stream is known exactly
(`mock_completion`), so a token lost, repeated or taken from another request shows.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.lib.processes import ServerProcess, wait_for
from configs import load_preset
from jlora.adapters.peft import WEIGHTS_FILE, make_demo_adapters
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.mock import mock_completion, mock_engine
from jlora.engine.orchestrator import Orchestrator
from jlora.server import WorkerServer, serve
from router.app import start_router
from router.perf_model import PerfModel, PerfProfile
from router.policies import POLICIES, PolicyError
from tests.test_server import BAD_INPUTS, request, rich_details, token_ids

ROOT = Path(__file__).resolve().parent.parent
Code = grpc.StatusCode
VOCAB = 1000  # MockEngine's default vocab_size

WORKER_SCRIPT = """
import json, sys
from jlora.engine.mock import mock_engine
from jlora.server import serve
options = json.loads(sys.argv[1])
engine = mock_engine(**options.pop("engine"))
server = serve(engine, tokenizer=engine.tokenizer, **options)
server.stop_on_signals(grace=10)
print(server.port, server.metrics_port, flush=True)
server.wait()
"""
WORKER_PORTS = re.compile(r"^(\d+) (\d+)$")  # WORKER_SCRIPT's one line on stdout


class WorkerProcess(ServerProcess):
    """A MockEngine worker in its own process (`jlora.server.serve`); `kill()` SIGKILLs it."""

    def __init__(self, *, port: int = 0, adapters_dir: Path | None = None, **engine) -> None:
        options = {"engine": engine, "port": port, "metrics_port": 0, "max_queue": 16}
        if adapters_dir is not None:
            options["adapters_dir"] = str(adapters_dir)
        super().__init__(
            [sys.executable, "-c", WORKER_SCRIPT, json.dumps(options)],
            WORKER_PORTS,
            stdout="log",
            stderr="inherit",
            session=False,
            start_timeout_s=600,
        )
        assert WORKER_PORTS.search(self.log[0]), self.log  # its first line, as printed
        self.port, self.metrics_port = map(int, self.groups)
        self.address = f"127.0.0.1:{self.port}"

    def metric(self, name: str, **labels) -> float:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics", name, **labels)


def scrape(url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(url, timeout=5) as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name}{labels} not in {url}")


@pytest.fixture
def processes():
    started: list[WorkerProcess] = []

    def start(**options) -> WorkerProcess:
        worker = WorkerProcess(**options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def routers():
    """start_router(...) (polling every 0.1 s); the routers stop after the test."""
    handles: list = []

    def start(workers, **options):
        handle = start_router(workers, poll_interval=0.1, **options)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop(grace=0)


@pytest.fixture
def workers():
    """In-process workers around MockEngines, stopped after the test."""
    servers: list[WorkerServer] = []

    def start(engine: Orchestrator | None = None, **options) -> WorkerServer:
        engine = engine or mock_engine(adapters={"a": 8})
        server = serve(engine, tokenizer=engine.tokenizer, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


def stub_for(address: str) -> pb_grpc.JloraStub:
    return pb_grpc.JloraStub(grpc.insecure_channel(address))


def running_ids(address: str) -> set[str]:
    return {r.request_id for r in stub_for(address).Stats(pb.StatsRequest(), timeout=5).running}


def idle(address: str) -> bool:
    stats = stub_for(address).Stats(pb.StatsRequest(), timeout=5)
    return not stats.running and stats.queued == 0


def router_metrics(router) -> str:
    return f"http://127.0.0.1:{router.http_port}/metrics"


def router_health(router) -> str:
    return f"http://127.0.0.1:{router.http_port}/health"


# -- streams through the router ----------------------------------------------------------


def test_two_worker_processes_serve_concurrent_mixed_adapter_streams(processes, routers):
    engine = dict(max_slots=3, step_latency=0.005, adapters={"a": 8, "b": 16})
    first, second = processes(**engine), processes(**engine)
    router = routers([first.address, second.address])
    stub = stub_for(router.address)
    cases = [(dict(ids=[i + 1, 2 * i + 3]), [None, "a", "b"][i % 3], 4 + i % 7) for i in range(18)]
    cases += [(dict(text=f"hi {i}"), "a", 5) for i in range(3)]
    cases += [(dict(chat=[("user", "hey")]), "b", 6)]
    results: dict[int, list[pb.GenerateResponse]] = {}

    def run(i: int) -> None:
        prompt, adapter, n = cases[i]
        message = request(**prompt, adapter=adapter or "", max_tokens=n)
        results[i] = list(stub.Generate(message, timeout=20))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    direct = stub_for(first.address)
    for i, (prompt, adapter, n) in enumerate(cases):
        message = request(**prompt, adapter=adapter or "", max_tokens=n)
        expected = list(direct.Generate(message, timeout=10))  # what a worker gives directly
        assert token_ids(results[i]) == token_ids(expected)
        assert [r.text for r in results[i]] == [r.text for r in expected]
        # The direct run may hit the prefix cache where the routed one did not.
        usage, direct_usage = results[i][-1].usage, expected[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            direct_usage.prompt_tokens,
            direct_usage.completion_tokens,
        )
        assert results[i][-1].finish_reason == pb.FINISH_REASON_LENGTH
        if "ids" in prompt:
            assert token_ids(results[i]) == mock_completion(prompt["ids"], adapter, n, VOCAB)
    served = [w.metric("jlora_requests_total", outcome="length") for w in (first, second)]
    assert served[0] >= len(cases) and served[1] > 0  # both served; the first also directly
    assert sum(served) == 2 * len(cases)


POLICY_PROFILE = PerfProfile(
    prefill=PerfModel("bgmv", alpha=0.001, beta=5.0, gamma=0.002),
    decode=PerfModel("bgmv", alpha=0.01, beta=10.0),
)


@pytest.mark.parametrize("policy, chosen", [("rank-aware", 1), ("most-idle", 0)])
def test_the_policy_picks_the_worker(workers, routers, tmp_path, policy, chosen):
    """Toppings' point: under BGMV a rank-64 request costs less beside a rank-64 request
    (no extra padding) than beside a rank-8 one. Both workers run one request, so
    most-idle takes the first; rank-aware the one already padded to rank 64."""
    engine = dict(max_slots=4, step_latency=0.01, adapters={"r8": 8, "r64": 64})
    low, high = workers(mock_engine(**engine)), workers(mock_engine(**engine))
    profile = tmp_path / "profile.json"
    POLICY_PROFILE.save(profile)
    router = routers([low.address, high.address], policy=policy, profile=profile)
    busy = [
        stub_for(worker.address).Generate(request(ids=[1], max_tokens=100, adapter=adapter))
        for worker, adapter in ((low, "r8"), (high, "r64"))
    ]
    for call in busy:
        next(call)
    router_stub = stub_for(router.address)
    wait_for(lambda: len(router_stub.Stats(pb.StatsRequest()).running) == 2, what="a poll")
    probe = router_stub.Generate(
        request(ids=[2], max_tokens=100, adapter="r64", request_id="probe"), timeout=10
    )
    next(probe)
    assert "probe" in running_ids([low, high][chosen].address)
    for call in [*busy, probe]:
        call.cancel()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_routes_concurrent_requests(workers, routers, tmp_path, policy):
    pair = [workers(mock_engine(max_slots=2, step_latency=0.002, adapters={"a": 8}))]
    pair.append(workers(mock_engine(max_slots=2, step_latency=0.002, adapters={"a": 8})))
    profile = tmp_path / "profile.json"
    POLICY_PROFILE.save(profile)
    router = routers([w.address for w in pair], policy=policy, profile=profile)
    stub = stub_for(router.address)
    calls = [
        stub.Generate(request(ids=[i + 1], max_tokens=8, adapter="a" if i % 2 else ""))
        for i in range(8)
    ]
    for i, call in enumerate(calls):
        assert token_ids(list(call)) == mock_completion([i + 1], "a" if i % 2 else None, 8, VOCAB)


def test_profile_policies_refuse_to_start_without_a_profile():
    for policy in ("rank-aware", "shortest-pending"):
        with pytest.raises(PolicyError, match="--profile"):
            start_router("127.0.0.1:1", policy=policy)
    result = subprocess.run(
        [sys.executable, "-m", "jlora.cli.router", "--workers", "127.0.0.1:1"]
        + ["--policy", "rank-aware", "--port", "0", "--http-port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "--profile" in result.stderr


def test_the_cli_subcommand_parses_its_flags():
    import argparse

    from jlora.cli import router as cli

    parser = argparse.ArgumentParser(prog="jlora")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["router", "--workers", "h:1,h:2", "--policy", "random", "--http-port", "0"]
    )
    assert args.run is cli.run and (args.workers, args.policy) == ("h:1,h:2", "random")
    assert (args.port, args.http_port, args.max_queue, args.profile) == (50050, 0, 64, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "--workers", "h:1", "--policy", "fastest"])


# -- faults ---------------------------------------------------------------------------


def test_a_worker_killed_during_a_run_loses_nothing(processes, routers):
    """Each worker runs two requests and queues four when one is killed: its running
    requests are resumed on the other worker after the tokens they got, its queued ones
    re-routed there; every caller gets its whole completion, each token once."""
    engine = dict(max_slots=2, step_latency=0.01, adapters={"a": 8})
    doomed, survivor = processes(**engine), processes(**engine)
    router = routers([doomed.address, survivor.address])
    stub = stub_for(router.address)
    prompts = [[i + 1, i + 2] for i in range(12)]
    outcomes: dict[int, tuple[list[int], grpc.RpcError | None]] = {}
    started = threading.Semaphore(0)

    def run(i: int) -> None:
        received: list[int] = []
        error = None
        try:
            for response in stub.Generate(request(ids=prompts[i], max_tokens=40, adapter="a")):
                received.append(response.token_id)
                if len(received) == 1:
                    started.release()
        except grpc.RpcError as err:
            error = err
        outcomes[i] = (received, error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for _ in range(4):  # two running on each worker
        assert started.acquire(timeout=10)
    doomed.kill()
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == len(prompts), "a request hung"
    for i, (received, error) in outcomes.items():
        assert error is None, error
        assert received == mock_completion(prompts[i], "a", 40, VOCAB)
    metrics = router_metrics(router)
    assert scrape(metrics, "jlora_router_resumes_total") == 2  # its two running streams
    assert scrape(metrics, "jlora_router_reroutes_total") >= 1  # its queued requests
    # The router keeps serving, on the survivor, and shows the dead worker down.
    again = list(stub.Generate(request(ids=[5], max_tokens=3, adapter="a"), timeout=10))
    assert token_ids(again) == mock_completion([5], "a", 3, VOCAB)
    assert not router.workers[0].up and router.workers[1].up
    health = json.loads(urllib.request.urlopen(router_health(router), timeout=5).read())
    assert health["workers"][doomed.address].startswith("down")
    # A worker back on the same address is health-checked back into routing.
    revived = processes(port=doomed.port, **engine)
    wait_for(lambda: router.workers[0].up, what="the revived worker")
    calls = [stub.Generate(request(ids=[i], max_tokens=100), timeout=10) for i in (1, 2)]
    for call in calls:
        next(call)
    assert len(running_ids(revived.address)) == 1  # most-idle: one on each
    for call in calls:
        call.cancel()


def test_a_full_router_queue_answers_resource_exhausted(workers, routers):
    """One decode slot and no worker queue: the second request waits in the router, a
    third finds the router's queue (max_queue=1) full."""
    worker = workers(mock_engine(max_slots=1, step_latency=0.01), max_queue=0)
    router = routers([worker.address], max_queue=1)
    stub = stub_for(router.address)
    running = stub.Generate(request(ids=[1], max_tokens=120))
    next(running)
    waiting = stub.Generate(request(ids=[2], max_tokens=3), timeout=10)
    wait_for(lambda: stub.Stats(pb.StatsRequest()).queued == 1, what="the router's queue")
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(ids=[3], max_tokens=1), timeout=5))
    assert caught.value.code() == Code.RESOURCE_EXHAUSTED
    assert "max_queue=1" in caught.value.details()
    running.cancel()
    assert token_ids(list(waiting)) == mock_completion([2], None, 3, VOCAB)
    again = list(stub.Generate(request(ids=[3], max_tokens=1), timeout=5))
    assert token_ids(again) == mock_completion([3], None, 1, VOCAB)
    assert scrape(router_metrics(router), "jlora_router_requests_total", outcome="exhausted") == 1


def test_the_deadline_reaches_the_worker(workers, routers):
    engine = mock_engine(max_slots=1, step_latency=0.01)
    worker = workers(engine, max_queue=0)
    router = routers([worker.address])
    stub = stub_for(router.address)
    started = time.monotonic()
    # The first runs on the worker, the second waits in the router's queue.
    calls = [stub.Generate(request(ids=[i], max_tokens=100), timeout=0.3) for i in (1, 2)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == Code.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2
    wait_for(lambda: idle(worker.address), what="the worker to free the slot")
    assert engine.device.steps < 60  # aborted on the worker, not run to 100 tokens
    assert not router.front.in_flight


def test_cancelling_a_stream_cancels_the_worker_request(workers, routers):
    engine = mock_engine(step_latency=0.01)
    worker = workers(engine)
    router = routers([worker.address])
    call = stub_for(router.address).Generate(request(ids=[1], max_tokens=100, request_id="c"))
    next(call), next(call)
    assert running_ids(worker.address) == {"c"}
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == Code.CANCELLED
    wait_for(lambda: idle(worker.address), what="the worker to abort the request")
    assert engine.device.steps < 50
    wait_for(lambda: not router.front.in_flight, what="the router to forget the call")


# -- bad input ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_router():
    engine = mock_engine(max_seq_len=64, adapters={"a": 8})
    worker = serve(engine, tokenizer=engine.tokenizer)
    router = start_router([worker.address], poll_interval=0.1)
    yield router, worker
    router.stop(grace=0)
    worker.stop(grace=0)


@pytest.mark.parametrize(
    "fields, code, names, field",
    BAD_INPUTS,
    ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_INPUTS)],
)
def test_bad_input_through_the_router(shared_router, fields, code, names, field):
    """The worker's statuses, messages and rich details, unchanged; nothing changes on
    the worker."""
    router, worker = shared_router
    stub = stub_for(router.address)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(**fields), timeout=10))
    assert caught.value.code() == code
    assert names in caught.value.details()
    assert rich_details(caught.value)[0] == field
    wait_for(lambda: idle(worker.address) and not router.front.in_flight, what="idle")
    ok = list(stub.Generate(request(ids=[1, 2], max_tokens=2, adapter="a"), timeout=10))
    assert token_ids(ok) == mock_completion([1, 2], "a", 2, VOCAB)


def test_a_request_id_in_flight_is_refused_by_the_router(shared_router):
    router, _ = shared_router
    stub = stub_for(router.address)
    first = stub.Generate(request(ids=[1], max_tokens=50, request_id="same"))
    next(first)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(ids=[1], request_id="same"), timeout=5))
    assert caught.value.code() == Code.ALREADY_EXISTS and "request_id" in caught.value.details()
    first.cancel()


# -- adapters -------------------------------------------------------------------------


def make_adapter(root: Path, rank: int = 4) -> str:
    """A real PEFT directory (cpu-tiny shapes) under root; its path relative to root."""
    config = load_preset("cpu-tiny").config
    (path,) = make_demo_adapters(config, root / f"r{rank}", n=1, ranks=[rank], seed=rank)
    return path.relative_to(root).as_posix()


def adapter_names(address: str) -> list[str]:
    return [a.name for a in stub_for(address).ListAdapters(pb.ListAdaptersRequest()).adapters]


def test_register_through_the_router_reaches_every_worker(workers, routers, tmp_path):
    root = tmp_path / "adapters"
    path = make_adapter(root, rank=4)
    pair = [workers(mock_engine(), adapters_dir=root, model_name="smol") for _ in range(2)]
    router = routers(
        [w.address for w in pair], adapters_dir=root, registry=tmp_path / "registry.sqlite"
    )
    stub = stub_for(router.address)
    reply = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="tiny", path=path), timeout=10)
    weights = (root / path / WEIGHTS_FILE).read_bytes()
    assert (reply.adapter.name, reply.adapter.rank, reply.adapter.path) == ("tiny", 4, path)
    assert reply.adapter.size_bytes == len(weights) and len(reply.adapter.sha256) == 64
    assert all(adapter_names(w.address) == ["tiny"] for w in pair)
    listed = stub.ListAdapters(pb.ListAdaptersRequest()).adapters
    assert [(a.name, a.sha256) for a in listed] == [("tiny", reply.adapter.sha256)]
    models = stub.Models(pb.ModelsRequest()).models
    assert [(m.id, m.kind, m.rank) for m in models] == [
        ("smol", pb.MODEL_KIND_BASE, 0),
        ("tiny", pb.MODEL_KIND_ADAPTER, 4),
    ]
    calls = [stub.Generate(request(ids=[i], max_tokens=5, adapter="tiny")) for i in (3, 4)]
    for i, call in zip((3, 4), calls, strict=True):
        assert token_ids(list(call)) == mock_completion([i], "tiny", 5, VOCAB)
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="tiny", pin=True), timeout=10)
    assert loaded.adapter.pinned
    assert loaded.adapter.state in (pb.ADAPTER_STATE_LOADING, pb.ADAPTER_STATE_DEVICE)
    wait_for(
        lambda: (
            stub.ListAdapters(pb.ListAdaptersRequest()).adapters[0].state == pb.ADAPTER_STATE_DEVICE
        ),
        what="the adapter on every worker's device",
    )
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="tiny"), timeout=10)
    stub.UnregisterAdapter(pb.UnregisterAdapterRequest(name="tiny"), timeout=10)
    assert all(adapter_names(w.address) == [] for w in pair)
    assert list(stub.ListAdapters(pb.ListAdaptersRequest()).adapters) == []


BAD_REGISTRATIONS = [
    # (name, path, status, what the message must name, the field in the details)
    ("x", "../outside", Code.INVALID_ARGUMENT, "path='../outside'", "path"),
    ("x", "/etc", Code.INVALID_ARGUMENT, "path='/etc'", "path"),
    ("x", "escape", Code.INVALID_ARGUMENT, "path='escape'", "path"),  # a symlink out
    ("x", "missing", Code.INVALID_ARGUMENT, "does not exist", "path"),
    ("x", "corrupt", Code.INVALID_ARGUMENT, "cannot read it as safetensors", "path"),
    ("x", "", Code.INVALID_ARGUMENT, "path", "path"),
    ("", "r4/demo-00-r4", Code.INVALID_ARGUMENT, "name", "name"),
    ("b//c", "r4/demo-00-r4", Code.INVALID_ARGUMENT, "name='b//c'", "name"),
    ("b:c:d", "r4/demo-00-r4", Code.INVALID_ARGUMENT, "name='b:c:d'", "name"),
    ("smol", "r4/demo-00-r4", Code.INVALID_ARGUMENT, "base model", "name"),
    ("kept", "r4/demo-00-r4", Code.ALREADY_EXISTS, "name='kept'", "name"),
]


def test_bad_registrations_are_refused_and_change_nothing(workers, routers, tmp_path):
    root = tmp_path / "adapters"
    good = make_adapter(root, rank=4)
    outside = tmp_path / "outside"
    make_adapter(outside, rank=8)
    (root / "escape").symlink_to(outside / "r8" / "demo-00-r8")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((root / good / "adapter_config.json").read_text())
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    pair = [workers(mock_engine(), adapters_dir=root, model_name="smol") for _ in range(2)]
    router = routers(
        [w.address for w in pair], adapters_dir=root, registry=tmp_path / "registry.sqlite"
    )
    stub = stub_for(router.address)
    stub.RegisterAdapter(pb.RegisterAdapterRequest(name="kept", path=good), timeout=10)
    for name, path, code, names, field in BAD_REGISTRATIONS:
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterAdapter(pb.RegisterAdapterRequest(name=name, path=path), timeout=10)
        assert (caught.value.code(), names) == (code, names) and names in caught.value.details()
        assert rich_details(caught.value)[0] == field
        assert [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters] == ["kept"]
        assert all(adapter_names(w.address) == ["kept"] for w in pair)
    ok = list(stub.Generate(request(ids=[3], max_tokens=2, adapter="kept"), timeout=10))
    assert token_ids(ok) == mock_completion([3], "kept", 2, VOCAB)


def test_a_corrupted_registered_adapter_is_not_served(workers, routers, tmp_path):
    """A worker that joins gets the registry's adapters, each file checked against the
    sha256 registered: a file changed since is refused (DATA_LOSS, naming both hashes),
    the intact one is served."""
    root = tmp_path / "adapters"
    paths = {"intact": make_adapter(root, rank=4), "damaged": make_adapter(root, rank=8)}
    registry = tmp_path / "registry.sqlite"
    first = workers(mock_engine(), adapters_dir=root)
    router = routers([first.address], adapters_dir=root, registry=registry)
    stub = stub_for(router.address)
    hashes = {}
    for name, path in paths.items():
        reply = stub.RegisterAdapter(pb.RegisterAdapterRequest(name=name, path=path), timeout=10)
        hashes[name] = reply.adapter.sha256
    router.stop(grace=0)
    weights = root / paths["damaged"] / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    fresh = workers(mock_engine(), adapters_dir=root)  # knows no adapter yet
    router = routers([fresh.address], adapters_dir=root, registry=registry)
    stub = stub_for(router.address)
    assert adapter_names(fresh.address) == ["intact"]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request(ids=[1], max_tokens=2, adapter="damaged"), timeout=10))
    assert caught.value.code() == Code.DATA_LOSS
    details = caught.value.details()
    assert "'damaged'" in details and hashes["damaged"] in details and "corrupt" in details
    ok = list(stub.Generate(request(ids=[1], max_tokens=2, adapter="intact"), timeout=10))
    assert token_ids(ok) == mock_completion([1], "intact", 2, VOCAB)


def test_registering_needs_an_adapters_dir(workers, routers):
    router = routers([workers().address])
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(router.address).RegisterAdapter(
            pb.RegisterAdapterRequest(name="x", path="y"), timeout=10
        )
    assert caught.value.code() == Code.FAILED_PRECONDITION
    assert "--adapters-dir" in caught.value.details()


# -- drain ----------------------------------------------------------------------------


ROUTER_LISTENING = re.compile(r"gRPC on (\S+), OpenAI HTTP on http://\S+:(\d+)/v1")


def test_sigterm_drains_the_router_process(processes):
    worker = processes(step_latency=0.01)
    router = ServerProcess(
        [sys.executable, "-m", "jlora.cli.router", "--workers", worker.address]
        + ["--port", "0", "--http-port", "0", "--registry", ":memory:"],
        ROUTER_LISTENING,
        stdout="inherit",
        stderr="log",
        session=False,
        start_timeout_s=600,
    )
    try:
        first_line = router.log[0]
        assert ROUTER_LISTENING.search(first_line), router.log
        stub = stub_for(router.groups[0])
        call = stub.Generate(request(ids=[1], max_tokens=80))
        first = next(call)
        router.process.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(stub) == Code.UNAVAILABLE, timeout=5, what="new calls refused")
        rest = list(call)
        assert token_ids([first, *rest]) == mock_completion([1], None, 80, VOCAB)
        assert router.wait(timeout=10) == 0
        assert "drained" in router.output().removeprefix(first_line)
    finally:
        router.kill()


def _refused(stub: pb_grpc.JloraStub) -> Code | None:
    try:
        list(stub.Generate(request(ids=[1], max_tokens=1), timeout=2))
    except grpc.RpcError as err:
        assert err.code() != Code.UNAVAILABLE or "draining" in err.details()
        return err.code()
    return None
