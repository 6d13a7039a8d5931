"""The worker gRPC server on loopback, around the orchestrator over a MockEngine (whose
streams are predictable).

Every test runs a real grpc.aio server on a free port and talks to it with the blocking
client, as a router or an application would.
"""

from __future__ import annotations

import gc
import hashlib
import math
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from jlora.api import SERVICE_NAME
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.mock import MockEngine, mock_completion, mock_engine, write_adapter_config
from jlora.engine.orchestrator import Orchestrator
from jlora.server import WorkerServer, serve

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 1000  # MockEngine's default vocab_size
Code = grpc.StatusCode
INVALID = Code.INVALID_ARGUMENT
SHA_X = "a" * 64  # not the sha256 of any adapter here


class Worker:
    """A server, a channel to it and its engine."""

    def __init__(self, engine: Orchestrator, **options) -> None:
        self.engine = engine
        tokenizer = getattr(engine, "tokenizer", None)
        self.server: WorkerServer = serve(engine, tokenizer=tokenizer, **options)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.JloraStub(self.channel)

    def generate(self, timeout: float = 10, **fields) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(request(**fields), timeout=timeout))

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=5)

    def wait_idle(self, timeout: float = 5) -> pb.StatsResponse:
        """Stats once nothing runs or waits and no request holds a KV block (adapters may
        hold pages of the pool)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = not stats.running and stats.queued == 0
            memory = stats.memory
            if idle and memory.kv_blocks_free + memory.cache.pages_lora == memory.kv_blocks_total:
                return stats
            assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
            time.sleep(0.01)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=0)


@pytest.fixture
def start():
    workers: list[Worker] = []

    def start_worker(engine: Orchestrator | None = None, **options) -> Worker:
        worker = Worker(engine or mock_engine(adapters={"a": 8}), **options)
        workers.append(worker)
        return worker

    yield start_worker
    for worker in workers:
        worker.close()


def request(
    *, text=None, ids=None, adapter="", request_id="", chat=None, **sampling
) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(adapter=adapter, request_id=request_id)
    if text is not None:
        msg.text = text
    if ids is not None:
        msg.token_ids.ids.extend(ids)
    if chat is not None:
        msg.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    for name, value in sampling.items():
        if name == "stop":
            msg.sampling.stop.extend(value)
        else:
            setattr(msg.sampling, name, value)
    return msg


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [r.token_id for r in responses]


# -- Generate ------------------------------------------------------------------------


def test_concurrent_streams_get_their_own_tokens(start):
    engine = mock_engine(max_slots=3, step_latency=0.002, adapters={"a": 8, "b": 16})
    worker = start(engine, max_queue=8)
    cases = [([i + 1, 2 * i + 3], [None, "a", "b"][i % 3], 5 + i) for i in range(10)]
    results: dict[int, list[pb.GenerateResponse]] = {}

    def run(i: int) -> None:
        ids, adapter, n = cases[i]
        results[i] = worker.generate(ids=ids, adapter=adapter or "", max_tokens=n)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, (ids, adapter, n) in enumerate(cases):
        assert token_ids(results[i]) == mock_completion(ids, adapter, n, VOCAB)
        last = results[i][-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), n)
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in results[i][:-1])
        assert all(not r.HasField("usage") for r in results[i][:-1])
        assert len({r.request_id for r in results[i]}) == 1
    worker.wait_idle()


def test_per_token_timing_is_present_and_monotonic(start):
    worker = start(mock_engine(step_latency=0.01))
    responses = worker.generate(ids=[1, 2], max_tokens=6, request_id="timed")
    assert {r.request_id for r in responses} == {"timed"}
    arrival = [r.timing.since_arrival_us for r in responses]
    previous = [r.timing.since_previous_us for r in responses]
    assert arrival[0] == previous[0] > 0  # the first token's gap is the time to first token
    assert all(b >= a for a, b in zip(arrival, arrival[1:], strict=False))
    # The admission step yields two tokens at once (gap 0); each later step takes >= 10 ms.
    assert previous[1] == 0 and min(previous[2:]) >= 9_000
    assert abs(sum(previous) - arrival[-1]) <= len(responses)  # rounding to whole us


def test_text_and_chat_prompts_use_the_tokenizer(start):
    engine = mock_engine(adapters={"a": 8})
    worker = start(engine, model_name="smol")
    text = worker.generate(text="hi", max_tokens=3)
    assert token_ids(text) == mock_completion(list(b"hi"), None, 3, VOCAB)
    assert "".join(r.text for r in text) == engine.tokenizer.decode(token_ids(text))
    chat = worker.generate(chat=[("user", "hi")], max_tokens=2, adapter="a")
    rendered = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    )
    assert token_ids(chat) == mock_completion(rendered, "a", 2, VOCAB)
    base = worker.generate(ids=[5], max_tokens=2, adapter="smol")  # the base model's id
    assert token_ids(base) == mock_completion([5], None, 2, VOCAB)


@pytest.fixture(scope="module")
def shared_worker():
    worker = Worker(mock_engine(max_seq_len=64, adapters={"a": 8}))
    yield worker
    worker.close()


BAD_INPUTS = [
    # (request fields, status, what the message must name, the field in the rich details)
    (dict(ids=[1], adapter="nope"), Code.NOT_FOUND, "adapter='nope'", "adapter"),
    (dict(), Code.INVALID_ARGUMENT, "prompt", "prompt"),
    (dict(text=""), Code.INVALID_ARGUMENT, "prompt", "prompt"),
    (dict(ids=[]), Code.INVALID_ARGUMENT, "prompt", "prompt"),
    (dict(chat=[]), Code.INVALID_ARGUMENT, "prompt", "prompt"),
    (dict(chat=[("robot", "hi")]), Code.INVALID_ARGUMENT, "role", "prompt.chat.messages[0].role"),
    (dict(ids=[1] * 64), Code.INVALID_ARGUMENT, "max_seq_len", "prompt"),
    (dict(text="x" * 100), Code.INVALID_ARGUMENT, "prompt has 100 tokens", "prompt"),
    (dict(ids=[1, 5000]), Code.INVALID_ARGUMENT, "prompt_ids[1]", "prompt"),
    (dict(ids=[-3]), Code.INVALID_ARGUMENT, "prompt_ids[0]", "prompt"),
    (dict(ids=[1], max_tokens=0), INVALID, "max_tokens", "sampling.max_tokens"),
    (dict(ids=[1], max_tokens=-5), INVALID, "max_tokens", "sampling.max_tokens"),
    (dict(ids=[1], max_tokens=2**31 - 1), INVALID, "max_tokens", "sampling.max_tokens"),
    (dict(ids=[1], temperature=-0.5), INVALID, "temperature", "sampling.temperature"),
    (dict(ids=[1], temperature=1e30), INVALID, "temperature", "sampling.temperature"),
    (dict(ids=[1], temperature=math.nan), INVALID, "temperature", "sampling.temperature"),
    (dict(ids=[1], temperature=math.inf), INVALID, "temperature", "sampling.temperature"),
    (dict(ids=[1], top_p=0.0), Code.INVALID_ARGUMENT, "top_p", "sampling.top_p"),
    (dict(ids=[1], top_p=-0.1), Code.INVALID_ARGUMENT, "top_p", "sampling.top_p"),
    (dict(ids=[1], top_p=1.5), Code.INVALID_ARGUMENT, "top_p", "sampling.top_p"),
    (dict(ids=[1], top_k=-1), Code.INVALID_ARGUMENT, "top_k", "sampling.top_k"),
    (dict(ids=[1], seed=2**40), Code.INVALID_ARGUMENT, "seed", "sampling.seed"),
    (dict(ids=[1], stop=[""]), Code.INVALID_ARGUMENT, "stop", "sampling.stop"),
    (dict(ids=[1], stop=["x"] * 17), Code.INVALID_ARGUMENT, "stop", "sampling.stop"),
    (dict(ids=[1], request_id="r" * 200), Code.INVALID_ARGUMENT, "request_id", "request_id"),
]  # fmt: skip


def rich_details(err: grpc.RpcError) -> tuple[str | None, str]:
    """(the BadRequest field, the ErrorInfo reason) of a failed call, read straight from
    its `grpc-status-details-bin` trailer with the google.rpc protos."""
    [raw] = [v for k, v in err.trailing_metadata() if k == "grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0] and status.message == err.details()
    field, reason = None, ""
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            [violation] = bad.field_violations
            field = violation.field
        else:
            info = error_details_pb2.ErrorInfo()
            assert detail.Unpack(info) and info.domain == "jlora.v1"
            reason = info.reason
    return field, reason


@pytest.mark.parametrize(
    "fields, code, names, field", BAD_INPUTS, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_INPUTS)]
)
def test_bad_input_gets_its_status_and_changes_nothing(shared_worker, fields, code, names, field):
    with pytest.raises(grpc.RpcError) as caught:
        shared_worker.generate(**fields)
    assert caught.value.code() == code
    assert names in caught.value.details()
    assert rich_details(caught.value)[0] == field
    stats = shared_worker.wait_idle()
    assert stats.adapter_slots.loads <= 1  # nothing loaded for a refused request
    ok = shared_worker.generate(ids=[1, 2], max_tokens=2, adapter="a")
    assert token_ids(ok) == mock_completion([1, 2], "a", 2, 1000)


def test_a_request_id_in_flight_is_refused(start):
    worker = start(mock_engine(step_latency=0.01))
    first = worker.stub.Generate(request(ids=[1], max_tokens=50, request_id="same"))
    next(first)
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[1], request_id="same")
    assert caught.value.code() == Code.ALREADY_EXISTS and "request_id" in caught.value.details()
    first.cancel()
    worker.wait_idle()


def test_a_full_queue_answers_resource_exhausted(start):
    worker = start(mock_engine(max_slots=1, step_latency=0.01), max_queue=1)
    running = worker.stub.Generate(request(ids=[1], max_tokens=100))
    next(running)
    queued = worker.stub.Generate(request(ids=[2], max_tokens=3))
    deadline = time.monotonic() + 5
    while worker.stats().queued != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[3], max_tokens=1)
    assert caught.value.code() == Code.RESOURCE_EXHAUSTED
    assert "max_queue=1" in caught.value.details()
    running.cancel()
    assert token_ids(list(queued)) == mock_completion([2], None, 3, 1000)
    worker.wait_idle()
    assert token_ids(worker.generate(ids=[3], max_tokens=1)) == mock_completion([3], None, 1, 1000)


def test_client_cancel_aborts_the_engine_request(start):
    engine = mock_engine(step_latency=0.01)
    worker = start(engine, metrics_port=0)
    call = worker.stub.Generate(request(ids=[1], max_tokens=100))
    next(call), next(call)
    assert len(worker.stats().running) == 1
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == Code.CANCELLED
    stats = worker.wait_idle()
    assert stats.free_slots == stats.max_slots
    assert engine.device.steps < 50  # aborted, not run to its 100 tokens
    assert metric(worker, "jlora_requests_total", outcome="cancelled") == 1


def test_deadline_exceeded_frees_running_and_queued_requests(start):
    engine = mock_engine(max_slots=1, step_latency=0.01)
    worker = start(engine)
    calls = [worker.stub.Generate(request(ids=[i], max_tokens=100), timeout=0.3) for i in (1, 2)]
    for call in calls:  # the second waits in the queue until its deadline
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == Code.DEADLINE_EXCEEDED
    worker.wait_idle()
    assert engine.device.steps < 60


# -- adapters, stats, models ------------------------------------------------------------


def test_adapter_lifecycle(start, tmp_path):
    engine = mock_engine(max_loras=2, step_latency=0.01)
    worker = start(engine, adapters_dir=tmp_path, model_name="smol")
    stub = worker.stub
    write_adapter_config(tmp_path / "mine", rank=16)
    adapter = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="mine", path="mine")).adapter
    assert (adapter.rank, adapter.state, adapter.slot) == (16, pb.ADAPTER_STATE_HOST, -1)
    assert list(adapter.target_modules) == ["q_proj", "v_proj"]
    assert adapter.path == str(tmp_path / "mine")
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="mine", pin=True)).adapter
    assert loaded.pinned and loaded.state in (pb.ADAPTER_STATE_LOADING, pb.ADAPTER_STATE_DEVICE)
    deadline = time.monotonic() + 5
    while stub.ListAdapters(pb.ListAdaptersRequest()).adapters[0].state != (
        pb.ADAPTER_STATE_DEVICE
    ):
        assert time.monotonic() < deadline, "the adapter never landed"
        time.sleep(0.005)
    assert token_ids(worker.generate(ids=[4], max_tokens=2, adapter="mine")) == (
        mock_completion([4], "mine", 2, VOCAB)
    )
    models = stub.Models(pb.ModelsRequest()).models
    assert [(m.id, m.kind, m.parent, m.rank) for m in models] == [
        ("smol", pb.MODEL_KIND_BASE, "", 0),
        ("mine", pb.MODEL_KIND_ADAPTER, "smol", 16),
    ]
    unloaded = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="mine")).adapter
    assert (unloaded.state, unloaded.pinned) == (pb.ADAPTER_STATE_HOST, False)
    call = stub.Generate(request(ids=[4], max_tokens=100, adapter="mine"))
    next(call)
    with pytest.raises(grpc.RpcError) as caught:
        stub.UnregisterAdapter(pb.UnregisterAdapterRequest(name="mine"))
    assert caught.value.code() == Code.FAILED_PRECONDITION
    call.cancel()
    worker.wait_idle()
    stub.UnregisterAdapter(pb.UnregisterAdapterRequest(name="mine"))
    assert list(stub.ListAdapters(pb.ListAdaptersRequest()).adapters) == []


BAD_ADAPTER_CALLS = [
    # (rpc, request fields, status, what the message must name, the field in the details)
    ("RegisterAdapter", dict(name="a", path="ok"), Code.ALREADY_EXISTS, "name='a'", "name"),
    ("RegisterAdapter", dict(name="", path="ok"), Code.INVALID_ARGUMENT, "name", "name"),
    ("RegisterAdapter", dict(name="b//c", path="ok"), Code.INVALID_ARGUMENT, "name=", "name"),
    ("RegisterAdapter", dict(name="b c", path="ok"), Code.INVALID_ARGUMENT, "name=", "name"),
    ("RegisterAdapter", dict(name="smol", path="ok"), Code.INVALID_ARGUMENT, "base model", "name"),
    ("RegisterAdapter", dict(name="b", path=""), Code.INVALID_ARGUMENT, "path", "path"),
    ("RegisterAdapter", dict(name="b", path="../outside"), Code.INVALID_ARGUMENT, "path=", "path"),
    ("RegisterAdapter", dict(name="b", path="/etc"), Code.INVALID_ARGUMENT, "path=", "path"),
    ("RegisterAdapter", dict(name="b", path="missing"), INVALID, "does not exist", "path"),
    ("RegisterAdapter", dict(name="b", path="broken"), Code.INVALID_ARGUMENT, "lora_alpha", "path"),
    ("RegisterAdapter", dict(name="b", path="linked"), Code.INVALID_ARGUMENT, "outside", "path"),
    ("RegisterAdapter", dict(name="b", path="ok", sha256=SHA_X), Code.DATA_LOSS, "sha", "sha256"),
    ("LoadAdapter", dict(name="nope"), Code.NOT_FOUND, "name='nope'", "name"),
    ("UnloadAdapter", dict(name="nope"), Code.NOT_FOUND, "name='nope'", "name"),
    ("UnregisterAdapter", dict(name="nope"), Code.NOT_FOUND, "name='nope'", "name"),
]  # fmt: skip


@pytest.mark.parametrize("rpc, fields, code, names, field", BAD_ADAPTER_CALLS)
def test_bad_adapter_calls(start, tmp_path, rpc, fields, code, names, field):
    root = tmp_path / "adapters"
    write_adapter_config(root / "ok")
    (root / "ok" / "adapter_model.safetensors").write_bytes(b"weights")
    write_adapter_config(root / "broken", lora_alpha=-1)
    write_adapter_config(root / "linked")
    (root / "linked" / "adapter_model.safetensors").symlink_to("/etc/passwd")
    worker = start(mock_engine(adapters={"a": 8}), adapters_dir=root, model_name="smol")
    with pytest.raises(grpc.RpcError) as caught:
        getattr(worker.stub, rpc)(getattr(pb, f"{rpc}Request")(**fields))
    assert caught.value.code() == code
    assert names in caught.value.details()
    assert rich_details(caught.value)[0] == field
    adapters = worker.stub.ListAdapters(pb.ListAdaptersRequest()).adapters
    assert [a.name for a in adapters] == ["a"]
    # Nothing stays reserved: the name registers once the input is right.
    ok = worker.stub.RegisterAdapter(pb.RegisterAdapterRequest(name="org/c-lora:v2", path="ok"))
    assert (
        ok.adapter.name == "org/c-lora:v2"
        and ok.adapter.sha256 == hashlib.sha256(b"weights").hexdigest()
    )


def test_register_and_pin_rolls_back_when_no_slot_is_free(start, tmp_path):
    worker = start(mock_engine(max_loras=1, adapters={"a": 8}))
    worker.stub.LoadAdapter(pb.LoadAdapterRequest(name="a", pin=True))
    path = str(write_adapter_config(tmp_path / "new"))
    with pytest.raises(grpc.RpcError) as caught:
        worker.stub.RegisterAdapter(pb.RegisterAdapterRequest(name="new", path=path, pin=True))
    assert caught.value.code() == Code.FAILED_PRECONDITION
    assert "max_loras=1" in caught.value.details()
    assert [a.name for a in worker.stub.ListAdapters(pb.ListAdaptersRequest()).adapters] == ["a"]


def test_stats_show_the_running_batch_with_ranks(start):
    worker = start(mock_engine(max_slots=2, step_latency=0.01, adapters={"a": 8}), max_queue=3)
    calls = [
        worker.stub.Generate(request(ids=[1], max_tokens=100, request_id="base")),
        worker.stub.Generate(request(ids=[1], max_tokens=100, request_id="lora", adapter="a")),
    ]
    for call in calls:
        next(call)
    calls.append(worker.stub.Generate(request(ids=[1], max_tokens=100, request_id="waits")))
    deadline = time.monotonic() + 5
    while (stats := worker.stats()).queued != 1:
        assert time.monotonic() < deadline, stats
        time.sleep(0.005)
    running = {r.request_id: (r.adapter, r.rank, r.prompt_tokens) for r in stats.running}
    assert running == {"base": ("", 0, 1), "lora": ("a", 8, 1)}
    assert (stats.max_slots, stats.free_slots, stats.max_queue) == (2, 0, 3)
    assert stats.memory.kv_blocks_free < stats.memory.kv_blocks_total
    assert (stats.adapter_slots.total, stats.adapter_slots.loads) == (2, 1)
    for call in calls:
        call.cancel()
    worker.wait_idle()


def test_a_base_only_engine_generates_and_refuses_adapter_calls(start, tmp_path):
    worker = start(mock_engine(max_loras=0))
    assert token_ids(worker.generate(ids=[3], max_tokens=2)) == mock_completion([3], None, 2, VOCAB)
    assert worker.stats().adapter_slots.total == 0
    assert list(worker.stub.ListAdapters(pb.ListAdaptersRequest()).adapters) == []
    path = str(write_adapter_config(tmp_path / "x"))
    with pytest.raises(grpc.RpcError) as caught:
        worker.stub.RegisterAdapter(pb.RegisterAdapterRequest(name="x", path=path))
    assert caught.value.code() == Code.FAILED_PRECONDITION
    assert "max_loras=0" in caught.value.details()
    assert [m.id for m in worker.stub.Models(pb.ModelsRequest()).models] == ["base"]


# -- health, reflection, metrics, failure, drain ---------------------------------------


def test_health_and_reflection(start):
    worker = start()
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(worker.channel)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(database.get_services())
    service = descriptor_pool.DescriptorPool(database).FindServiceByName(SERVICE_NAME)
    assert service.file.name == "jlora/v1/jlora.proto"
    assert {"Generate", "RegisterAdapter", "Stats", "Models"} <= set(service.methods_by_name)


def metric(worker: Worker, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.server.metrics_port}/metrics") as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_metrics_serve_the_histograms(start):
    worker = start(mock_engine(step_latency=0.002, adapters={"a": 8}), metrics_port=0)
    for adapter in ("", "a", ""):
        worker.generate(ids=[1], max_tokens=4, adapter=adapter)
    with pytest.raises(grpc.RpcError):
        worker.generate(ids=[1], adapter="nope")
    assert metric(worker, "jlora_time_to_first_token_seconds_count") == 3
    assert metric(worker, "jlora_time_per_output_token_seconds_count") == 9
    assert metric(worker, "jlora_request_latency_seconds_count") == 3
    assert metric(worker, "jlora_batch_size_count") > 0
    assert metric(worker, "jlora_generated_tokens_total") == 12
    assert metric(worker, "jlora_requests_total", outcome="length") == 3
    assert metric(worker, "jlora_requests_total", outcome="not_found") == 1
    assert metric(worker, "jlora_queued_requests") == metric(worker, "jlora_running_requests") == 0
    deadline = time.monotonic() + 5  # engine counters are sampled every STATS_INTERVAL
    while metric(worker, "jlora_adapter_loads_total") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


class BrokenDevice(MockEngine):
    """A device that fails for good after two decode steps."""

    def generate(self):
        if self.steps >= 2:
            raise RuntimeError("device lost")
        return super().generate()


def test_a_broken_device_ends_streams_and_health(start):
    worker = start(Orchestrator(BrokenDevice(step_latency=0.005)))
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[1], max_tokens=50)
    assert caught.value.code() == Code.INTERNAL and "device lost" in caught.value.details()
    health = health_pb2_grpc.HealthStub(worker.channel)
    deadline = time.monotonic() + 5
    while health.Check(health_pb2.HealthCheckRequest()).status != (
        health_pb2.HealthCheckResponse.NOT_SERVING
    ):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[1])
    assert caught.value.code() == Code.UNAVAILABLE
    assert isinstance(worker.server.error, RuntimeError)


def test_stop_drains_running_streams(start):
    engine = mock_engine(step_latency=0.01)
    worker = start(engine)
    health = health_pb2_grpc.HealthStub(worker.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    call = worker.stub.Generate(request(ids=[1], max_tokens=80))
    first = next(call)
    stopper = threading.Thread(target=worker.server.stop, args=(10,))
    stopper.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[1])
    assert caught.value.code() == Code.UNAVAILABLE and "draining" in caught.value.details()
    rest = list(call)
    assert token_ids([first, *rest]) == mock_completion([1], None, 80, VOCAB)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    stopper.join(10)
    assert worker.server.wait(0) and not engine.has_unfinished
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(ids=[1], timeout=2)
    assert caught.value.code() == Code.UNAVAILABLE


def test_a_running_server_keeps_its_heap_out_of_full_collections(start):
    """A full collection walks every object the collector tracks, with the GIL held: 0.4 s
    at a long test process's 0.9M objects, a stall of every stream. What start-up built
    is frozen while a server runs, and collectable again once the last one stops."""
    alone = gc.get_freeze_count() == 0  # no other test's server runs in this process
    engine = mock_engine()
    worker = start(engine)
    assert gc.get_freeze_count() > 0
    assert not any(tracked is engine for tracked in gc.get_objects())
    assert token_ids(worker.generate(ids=[1], max_tokens=4)) == mock_completion([1], None, 4, VOCAB)
    worker.server.stop(grace=0)
    if alone:
        assert gc.get_freeze_count() == 0
        assert any(tracked is engine for tracked in gc.get_objects())


def test_stop_after_the_grace_period_cancels_and_frees(start):
    engine = mock_engine(step_latency=0.01)
    worker = start(engine)
    call = worker.stub.Generate(request(ids=[1], max_tokens=100))
    next(call)
    worker.server.stop(grace=0.1)
    with pytest.raises(grpc.RpcError):
        list(call)
    assert not engine.has_unfinished and engine.memory.held_pages() == 0


SIGTERM_WORKER = """
import sys
from jlora.engine.mock import mock_engine
from jlora.server import serve
server = serve(mock_engine(step_latency=0.01), port=0)
server.stop_on_signals(grace=10)
print(server.port, flush=True)
server.wait()
print("jax loaded" if "jax" in sys.modules else "drained", flush=True)
"""


def test_sigterm_drains_then_exits():
    process = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_WORKER], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.JloraStub(channel).Generate(request(ids=[1], max_tokens=20))
            first = next(call)
            process.terminate()
            rest = list(call)
        assert token_ids([first, *rest]) == mock_completion([1], None, 20, 1000)
        assert process.wait(timeout=10) == 0
        assert process.stdout.read().strip() == "drained"
    finally:
        process.kill()
        process.wait()
