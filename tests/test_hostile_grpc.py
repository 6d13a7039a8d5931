"""Hostile gRPC input against a worker and the router on loopback, as issue 18 tried it.

What an adversary sent: raw bytes with invalid UTF-8 in a string field (through a
channel that sends bytes as they are), a second server on a taken port, a client-chosen
sha256 that is not the file's, an adapter whose weights file links out of the adapters
directory, a truncated adapter in a worker's `--adapters-dir`, and reflection asked as
current grpcurl asks (grpc.reflection.v1). Each test checks the status, the message and
the field named, that nothing changed, and that a known-good request afterwards gets
the same tokens as before.

The servers are MockEngine workers and routers in this process (their streams are
known exactly), and real `jlora router` / `jlora serve` processes where the issue used
the CLI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from bench.lib.processes import ServerProcess
from configs import load_preset
from jlora.adapters.peft import WEIGHTS_FILE, make_demo_adapters
from jlora.api import SERVICE_NAME
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract import registry as reg
from jlora.engine.mock import mock_completion, mock_engine
from jlora.server import serve
from router.app import start_router
from tests.test_server import request, rich_details, token_ids

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 1000  # MockEngine's default vocab_size
Code = grpc.StatusCode
# "\ud800" as an encoder that does not check writes it: not UTF-8 (a lone surrogate).
LONE_SURROGATE = b"\xed\xa0\x80"
PLACEHOLDER = "XYZ"  # as long as LONE_SURROGATE, so the message's lengths stay right


class Deployment:
    """A MockEngine worker (adapter "a" registered) and a router in front of it, both
    confining adapter paths to one adapters directory, which holds:

    - good/: a real PEFT adapter (cpu-tiny shapes);
    - leak/: its config, and adapter_model.safetensors a symlink to a real weights file
      outside the directory;
    - linked: a symlink to an adapter directory outside.
    """

    def __init__(self, tmp: Path) -> None:
        config = load_preset("cpu-tiny").config
        self.root = tmp / "adapters"
        (good,) = make_demo_adapters(config, self.root, n=1, ranks=[4], seed=1)
        good.rename(self.root / "good")
        (outside,) = make_demo_adapters(config, tmp / "outside", n=1, ranks=[8], seed=2)
        (self.root / "leak").mkdir()
        (self.root / "leak" / "adapter_config.json").write_bytes(
            (outside / "adapter_config.json").read_bytes()
        )
        (self.root / "leak" / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
        (self.root / "linked").symlink_to(outside, target_is_directory=True)
        self.engine = mock_engine(adapters={"a": 8})
        self.worker = serve(
            self.engine, tokenizer=self.engine.tokenizer, model_name="smol", adapters_dir=self.root
        )
        self.router = start_router(
            [self.worker.address],
            poll_interval=0.1,
            http_port=None,
            adapters_dir=self.root,
            registry=tmp / "registry.sqlite",
        )
        self.channels = {
            "worker": grpc.insecure_channel(self.worker.address),
            "router": grpc.insecure_channel(self.router.address),
        }

    def stub(self, target: str) -> pb_grpc.JloraStub:
        return pb_grpc.JloraStub(self.channels[target])

    def known_good(self, target: str) -> list[int]:
        """A text prompt's tokens on adapter "a" (the mock tokenizer encodes its bytes)."""
        message = request(text="abc def", adapter="a", max_tokens=5)
        tokens = token_ids(list(self.stub(target).Generate(message, timeout=10)))
        assert tokens == mock_completion(list(b"abc def"), "a", 5, VOCAB)
        return tokens

    def adapters(self, target: str) -> list[str]:
        reply = self.stub(target).ListAdapters(pb.ListAdaptersRequest(), timeout=10)
        return [adapter.name for adapter in reply.adapters]

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.router.stop(grace=0)
        self.worker.stop(grace=0)
        self.engine.close()


@pytest.fixture
def deployment(tmp_path):
    deployment = Deployment(tmp_path)
    yield deployment
    deployment.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One deployment for the tests that change nothing in it."""
    deployment = Deployment(tmp_path_factory.mktemp("hostile"))
    yield deployment
    deployment.close()


def no_traceback_logged(caplog) -> None:
    failures = [r for r in caplog.records if r.exc_info or "DecodeError" in r.getMessage()]
    assert not failures, [record.getMessage() for record in failures]


# -- 5: invalid UTF-8 in a string field ---------------------------------------------------


def spliced(message) -> bytes:
    """`message` serialized with its one PLACEHOLDER replaced by a lone surrogate."""
    data = message.SerializeToString()
    assert data.count(PLACEHOLDER.encode()) == 1
    return data.replace(PLACEHOLDER.encode(), LONE_SURROGATE)


def chat(*contents: str) -> pb.GenerateRequest:
    message = pb.GenerateRequest(adapter="a")
    message.chat.messages.extend(pb.ChatMessage(role="user", content=c) for c in contents)
    return message


def with_stop(*stops: str) -> pb.GenerateRequest:
    message = request(ids=[1, 2], adapter="a")
    message.sampling.stop.extend(stops)
    return message


MALFORMED = [
    # (method, message holding PLACEHOLDER, the field named)
    ("/jlora.v1.Jlora/Generate", request(text=f"abc{PLACEHOLDER}def", adapter="a"), "prompt.text"),
    ("/jlora.v1.Jlora/Generate", chat("hi", PLACEHOLDER), "prompt.chat.messages[1].content"),
    ("/jlora.v1.Jlora/Generate", request(ids=[1], adapter=PLACEHOLDER), "adapter"),
    ("/jlora.v1.Jlora/Generate", with_stop("a", PLACEHOLDER), "sampling.stop[1]"),
    ("/jlora.v1.Jlora/RegisterAdapter", pb.RegisterAdapterRequest(name=PLACEHOLDER), "name"),
    ("/jlora.v1.Jlora/UnloadAdapter", pb.UnloadAdapterRequest(name=PLACEHOLDER), "name"),
    ("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest(service=PLACEHOLDER), "service"),
]  # fmt: skip


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> None:
    """Send `data` as it is; read the whole answer."""
    if method.endswith("/Generate"):
        list(channel.unary_stream(method, request_serializer=lambda b: b)(data, timeout=10))
    else:
        channel.unary_unary(method, request_serializer=lambda b: b)(data, timeout=10)


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("method, message, field", MALFORMED, ids=[case[2] for case in MALFORMED])
def test_invalid_utf8_is_invalid_argument_naming_the_field(
    shared, caplog, target, method, message, field
):
    before = shared.known_good(target)
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(shared.channels[target], method, spliced(message))
    assert caught.value.code() == Code.INVALID_ARGUMENT
    details = caught.value.details()
    assert f"{field} holds invalid UTF-8" in details and message.DESCRIPTOR.full_name in details
    assert rich_details(caught.value) == (field, "INVALID_UTF8")
    no_traceback_logged(caplog)
    assert shared.known_good(target) == before
    assert shared.adapters(target) == ["a"]


@pytest.mark.parametrize("target", ["worker", "router"])
def test_bytes_that_are_not_a_message_are_invalid_argument(shared, caplog, target):
    before = shared.known_good(target)
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(shared.channels[target], "/jlora.v1.Jlora/Generate", b"\xff\xff\xff")
    assert caught.value.code() == Code.INVALID_ARGUMENT
    assert "not a valid jlora.v1.GenerateRequest" in caught.value.details()
    assert rich_details(caught.value) == (None, "MALFORMED")
    no_traceback_logged(caplog)
    assert shared.known_good(target) == before


def reflect(
    channel: grpc.Channel, package: str, requests: list[bytes]
) -> list[reflection_pb2.ServerReflectionResponse]:
    """A ServerReflectionInfo stream under grpc.reflection.{package} (v1's messages are
    v1alpha's, field for field)."""
    call = channel.stream_stream(
        f"/grpc.reflection.{package}.ServerReflection/ServerReflectionInfo",
        request_serializer=lambda b: b,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=10))


@pytest.mark.parametrize("target", ["worker", "router"])
def test_invalid_utf8_in_a_request_stream_ends_it(shared, caplog, target):
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    bad = spliced(reflection_pb2.ServerReflectionRequest(file_containing_symbol=PLACEHOLDER))
    with pytest.raises(grpc.RpcError) as caught:
        reflect(shared.channels[target], "v1", [good, bad])
    assert caught.value.code() == Code.INVALID_ARGUMENT
    field = "message_request.file_containing_symbol"
    assert rich_details(caught.value) == (field, "INVALID_UTF8")
    no_traceback_logged(caplog)
    [reply] = reflect(shared.channels[target], "v1", [good])
    assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}


def test_a_caller_without_the_api_key_learns_only_that(caplog):
    engine = mock_engine()
    worker = serve(engine, tokenizer=engine.tokenizer, api_key="secret")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            bad = spliced(request(text=f"abc{PLACEHOLDER}"))
            with pytest.raises(grpc.RpcError) as caught:
                raw_call(channel, "/jlora.v1.Jlora/Generate", bad)
            assert caught.value.code() == Code.UNAUTHENTICATED
            call = channel.unary_stream("/jlora.v1.Jlora/Generate", request_serializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as caught:
                list(call(bad, metadata=(("authorization", "Bearer secret"),), timeout=10))
            assert caught.value.code() == Code.INVALID_ARGUMENT
    finally:
        worker.stop(grace=0)
        engine.close()
    no_traceback_logged(caplog)


# -- 10: reflection under v1 and v1alpha --------------------------------------------------


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("package", ["v1", "v1alpha"])
def test_reflection_answers_v1_and_v1alpha(shared, target, package):
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=f"grpc.reflection.{package}.ServerReflection"
        ),
    ]
    listed, jlora, itself = reflect(
        shared.channels[target], package, [ask.SerializeToString() for ask in asks]
    )
    assert {s.name for s in listed.list_services_response.service} == {
        SERVICE_NAME,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in jlora.file_descriptor_response.file_descriptor_proto
    ]
    [service] = [s for f in files if f.package == "jlora.v1" for s in f.service]
    assert {"Generate", "RegisterAdapter", "Models"} <= {m.name for m in service.method}
    [own] = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in itself.file_descriptor_response.file_descriptor_proto
    ]
    assert own.package == f"grpc.reflection.{package}"
    assert own.name.endswith(f"/{package}/reflection.proto")
    assert (
        own.service[0].method[0].input_type == f".grpc.reflection.{package}.ServerReflectionRequest"
    )


# -- 4: a client's sha256 that is not the file's -----------------------------------------


def test_a_wrong_client_sha256_is_data_loss_on_router_and_worker_alike(deployment):
    before = deployment.known_good("router")
    actual = hashlib.sha256((deployment.root / "good" / WEIGHTS_FILE).read_bytes()).hexdigest()
    wrong = pb.RegisterAdapterRequest(name="good", path="good", sha256="0" * 64)
    for target in ("router", "worker"):
        with pytest.raises(grpc.RpcError) as caught:
            deployment.stub(target).RegisterAdapter(wrong, timeout=10)
        assert caught.value.code() == Code.DATA_LOSS, target
        assert actual in caught.value.details() and "0" * 64 in caught.value.details()
        assert rich_details(caught.value) == ("sha256", "CHECKSUM_MISMATCH")
    assert deployment.adapters("router") == deployment.adapters("worker") == ["a"]
    assert deployment.known_good("router") == before
    right = pb.RegisterAdapterRequest(name="good", path="good", sha256=actual)
    assert deployment.stub("router").RegisterAdapter(right, timeout=10).adapter.sha256 == actual
    message = request(ids=[3, 4], adapter="good", max_tokens=4)
    tokens = token_ids(list(deployment.stub("router").Generate(message, timeout=10)))
    assert tokens == mock_completion([3, 4], "good", 4, VOCAB)


# -- 6: an adapter file linking out of the adapters directory ----------------------------


@pytest.mark.parametrize("target", ["worker", "router"])
def test_an_adapter_linking_out_of_the_adapters_dir_is_refused(deployment, target):
    before = deployment.known_good(target)
    for path, says in (
        ("leak", f"has {WEIGHTS_FILE} linking to"),
        (str(deployment.root / "leak"), f"has {WEIGHTS_FILE} linking to"),
        ("linked", "outside the adapters directory"),
    ):
        message = pb.RegisterAdapterRequest(name="evil", path=path)
        with pytest.raises(grpc.RpcError) as caught:
            deployment.stub(target).RegisterAdapter(message, timeout=10)
        assert caught.value.code() == Code.INVALID_ARGUMENT, path
        assert says in caught.value.details() and "outside" in caught.value.details()
        assert rich_details(caught.value)[0] == "path"
    assert deployment.adapters("worker") == deployment.adapters("router") == ["a"]
    assert deployment.known_good(target) == before


# -- 3: a second server on a taken port ---------------------------------------------------


def test_a_second_server_on_a_taken_port_fails_naming_it(deployment):
    before = deployment.known_good("worker")
    for taken in (deployment.worker.port, deployment.router.port):
        engine = mock_engine()
        try:
            with pytest.raises(OSError, match=f"port {taken} is already in use"):
                serve(engine, port=taken)
        finally:
            engine.close()
        with pytest.raises(OSError, match=f"port {taken} is already in use"):
            start_router([deployment.worker.address], port=taken, http_port=None)
    for _ in range(4):  # every new connection reaches the first servers
        for target in ("worker", "router"):
            address = getattr(deployment, target).address
            with grpc.insecure_channel(address) as channel:
                message = request(text="abc def", adapter="a", max_tokens=5)
                reply = pb_grpc.JloraStub(channel).Generate(message, timeout=10)
                assert token_ids(list(reply)) == before


def test_jlora_router_on_a_taken_port_exits_2_naming_it(deployment, tmp_path):
    taken = deployment.router.port
    result = subprocess.run(
        [sys.executable, "-m", "jlora.cli.main", "router", "--workers",
         deployment.worker.address, "--port", str(taken), "--http-port", "0",
         "--registry", str(tmp_path / "second.sqlite")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("jlora: error:") and f"port {taken} is already in use" in last
    assert deployment.known_good("router") == deployment.known_good("worker")


# -- 9: a truncated adapter in `jlora serve --adapters-dir` ------------------------------


class ServeProcess(ServerProcess):
    """A `jlora serve` process on cpu-tiny, its stderr in a file (`output()`)."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        port_file = tmp / "port"
        super().__init__(
            [sys.executable, "-m", "jlora.cli.main", "serve", "--model", "cpu-tiny",
             "--port", "0", "--port-file", str(port_file), "--max-seq-len", "32",
             "--max-slots", "2", "--max-lora-rank", "8", "--warmup", "on-demand", *flags],
            port_file=port_file, stdout="inherit", stderr=tmp / "serve.stderr",
            session=False, start_timeout_s=300,
        )  # fmt: skip
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.JloraStub(self.channel)

    def generate(self, adapter: str) -> list[int]:
        message = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 9, 2]),
            adapter=adapter,
            sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        return token_ids(list(self.stub.Generate(message, timeout=60)))

    def stop(self, timeout: float = 30.0, *, group: bool = False) -> int:
        self.channel.close()
        return super().stop(timeout, group=group)


@pytest.mark.e2e
def test_jlora_serve_leaves_out_bad_adapters_of_its_dir_and_serves_the_rest(tmp_path):
    """A truncated adapter, one whose weights link out of the directory and a registry
    entry whose file changed since: each left out with a warning that names it and why;
    the good one is served. Named on the command line, a bad adapter stops the start
    (exit 2), as does a taken port."""
    config = load_preset("cpu-tiny").config
    root = tmp_path / "adapters"
    good, broken = make_demo_adapters(config, root, n=2, ranks=[4, 8], seed=3)
    weights = (broken / WEIGHTS_FILE).read_bytes()
    (broken / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])
    (outside,) = make_demo_adapters(config, tmp_path / "outside", n=1, ranks=[4], seed=4)
    (root / "leak").mkdir()
    (root / "leak" / "adapter_config.json").write_bytes(
        (outside / "adapter_config.json").read_bytes()
    )
    (root / "leak" / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    entry = reg.adapter_from_directory("registered", good, adapters_dir=root, base_model="cpu-tiny")
    with reg.Registry(tmp_path / "registry.sqlite") as registry:
        registry.register(dataclasses.replace(entry, sha256="f" * 64))
    worker = ServeProcess(
        tmp_path, "--adapters-dir", str(root), "--registry", str(tmp_path / "registry.sqlite")
    )
    try:
        names = [a.name for a in worker.stub.ListAdapters(pb.ListAdaptersRequest()).adapters]
        assert names == [good.name]
        log = worker.output()
        assert f"adapter {broken.name!r} is not served: " in log and "safetensors" in log
        assert "adapter 'leak' is not served: " in log and "outside the adapters directory" in log
        assert "adapter 'registered' is not served: " in log and "f" * 64 in log
        assert entry.sha256 in log
        assert f"(1 adapters, 3 left out: {broken.name}, leak, registered)" in log
        before = worker.generate(good.name)
        with pytest.raises(grpc.RpcError) as caught:
            worker.generate(broken.name)
        assert caught.value.code() == Code.NOT_FOUND
        assert worker.generate(good.name) == before

        for flags, says in (
            (["--port", str(worker.port)], f"port {worker.port} is already in use"),
            (["--adapter", f"explicit={broken}"], "safetensors"),
        ):
            result = subprocess.run(
                [sys.executable, "-m", "jlora.cli.main", "serve", "--model", "cpu-tiny",
                 "--max-seq-len", "32", *(["--port", "0"] if "--port" not in flags else []),
                 *flags],
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert result.returncode == 2, result.stderr
            last = result.stderr.strip().splitlines()[-1]
            assert last.startswith("jlora: error:") and says in last, last
        assert worker.generate(good.name) == before
    finally:
        worker.stop()
