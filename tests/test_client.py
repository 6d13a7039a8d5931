"""jlora.client against a real worker on loopback (a MockEngine, whose tokens are
predictable), with an API key: the blocking and the asyncio client give the raw stub's
tokens, manage adapters, and raise the server's errors as typed exceptions."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from jlora.api import SERVICE_NAME
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    JloraError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
    generate_request,
)
from jlora.contract.auth import call_metadata
from jlora.contract.errors import QUEUE_FULL, Code, RequestError
from jlora.contract.status import DETAILS_KEY, status_proto
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine, write_adapter_config
from jlora.server import serve

KEY = "client-key"
VOCAB = 1000  # MockEngine's default vocab_size


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    adapters_dir = tmp_path_factory.mktemp("adapters")
    write_adapter_config(adapters_dir / "mine", rank=16)
    engine = mock_engine(adapters={"a": 8})
    server = serve(
        engine,
        tokenizer=engine.tokenizer,
        model_name="smol",
        api_key=KEY,
        adapters_dir=adapters_dir,
    )
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def busy_worker():
    """One decode slot, no queue, 50 ms a step: while a stream of 100 tokens runs (5 s), a
    second request finds the queue full; one closed early is gone well before."""
    server = serve(mock_engine(max_slots=1, step_latency=0.05), max_queue=0)
    yield server
    server.stop(grace=0)


def wait_idle(stats, timeout: float = 2) -> None:
    deadline = time.monotonic() + timeout
    while stats().running:
        assert time.monotonic() < deadline, "a closed stream kept running"
        time.sleep(0.01)


@pytest.fixture
def client(worker):
    with Client(worker.address, api_key=KEY, timeout=10) as client:
        yield client


def raw_stream(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.JloraStub(channel).Generate(request, timeout=10, metadata=call_metadata(KEY))
        return list(call)


# -- Generate -----------------------------------------------------------------------------


def test_generate_and_stream_give_the_raw_stubs_tokens(worker, client):
    raw = raw_stream(
        worker.address,
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 9]),
            adapter="a",
            sampling=pb.SamplingParams(max_tokens=6),
        ),
    )
    expected = mock_completion([5, 6, 9], "a", 6, VOCAB)
    assert [r.token_id for r in raw] == expected
    done = client.generate([5, 6, 9], adapter="a", max_tokens=6)
    assert done.token_ids == expected
    assert done.text == "".join(r.text for r in raw) == MockTokenizer().decode(expected)
    assert done.finish_reason == "length"
    usage = done.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (3, 6, 0)
    assert done.logprobs is None and done.prompt_logprobs is None
    streamed = list(client.stream([5, 6, 9], adapter="a", max_tokens=6))
    assert [r.token_id for r in streamed] == expected
    assert [r.text for r in streamed] == [r.text for r in raw]
    assert streamed[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in streamed[:-1])


def test_text_and_chat_prompts(client):
    text = client.generate("Hi", max_tokens=3)
    assert text.token_ids == mock_completion(list(b"Hi"), None, 3, VOCAB)
    assert text.usage.prompt_tokens == 2
    chat = client.generate(chat=[{"role": "user", "content": "Hi"}], max_tokens=3)
    ids = list(MockTokenizer().apply_chat_template([{"role": "user", "content": "Hi"}]).encode())
    assert chat.token_ids == mock_completion(ids, None, 3, VOCAB)
    assert client.generate(chat=[("user", "Hi")], max_tokens=3).token_ids == chat.token_ids
    # A ChatMessages message carries the tools too: the mock's template shows them.
    tools = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")],
        tools=[pb.Tool(name="f", parameters='{"type": "object"}')],
    )
    shown = MockTokenizer().apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    )
    offered = client.generate(chat=tools, max_tokens=3)
    assert offered.usage.prompt_tokens == len(shown.encode())


def test_logprobs_pass_through(client):
    """The mock's log-probabilities (mock_logprobs): a generated token is its position's
    most likely, -1/8, the next id -2/8; prompt token t after p has -(t - p + 1)/8."""
    done = client.generate([5, 6, 9], max_tokens=3, logprobs=2, prompt_logprobs=1)
    assert done.logprobs is not None and done.prompt_logprobs is not None
    assert [p.token.token_id for p in done.logprobs] == done.token_ids
    assert [p.token.logprob for p in done.logprobs] == [-0.125] * 3
    first = done.logprobs[0].top
    assert [(t.token_id, t.logprob) for t in first] == [
        (done.token_ids[0], -0.125),
        (done.token_ids[0] + 1, -0.25),
    ]
    prompt = done.prompt_logprobs
    assert [p.token.token_id for p in prompt] == [5, 6, 9]
    assert not prompt[0].token.HasField("logprob")
    assert [p.token.logprob for p in prompt[1:]] == [-0.25, -0.5]


def test_sampling_fields_pass_through_by_name():
    request = generate_request([1], stop="\n", seed=7, temperature=None, top_k=3)
    assert list(request.sampling.stop) == ["\n"]
    assert (request.sampling.seed, request.sampling.top_k) == (7, 3)
    assert not request.sampling.HasField("temperature")  # None: the server's default
    given = pb.SamplingParams(max_tokens=4, temperature=0.5)
    merged = generate_request("x", sampling=given, temperature=0.0).sampling
    assert (merged.max_tokens, merged.HasField("temperature"), merged.temperature) == (4, True, 0)
    assert given.temperature == 0.5  # copied, not changed
    if "logit_bias" in pb.SamplingParams.DESCRIPTOR.fields_by_name:  # a map field
        assert dict(generate_request([1], logit_bias={5: -2.0}).sampling.logit_bias) == {5: -2.0}
    with pytest.raises(TypeError, match="'temprature' is not a field"):
        generate_request([1], temprature=0.5)
    with pytest.raises(TypeError, match="exactly one"):
        generate_request([1], chat=[("user", "hi")])


# -- errors -------------------------------------------------------------------------------


def test_an_unknown_adapter_is_not_found(client):
    with pytest.raises(NotFound) as caught:
        client.generate([1], adapter="nope", max_tokens=2)
    err = caught.value
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.NOT_FOUND,
        "ADAPTER_NOT_FOUND",
        "adapter",
    )
    assert "adapter='nope'" in err.message
    assert isinstance(err.__cause__, grpc.RpcError)
    with pytest.raises(NotFound) as caught:
        client.load_adapter("nope")
    assert (caught.value.reason, caught.value.field) == ("ADAPTER_NOT_FOUND", "name")


@pytest.mark.parametrize(
    "sampling, field",
    [
        (dict(temperature=-0.5), "sampling.temperature"),
        (dict(top_p=1.5), "sampling.top_p"),
        (dict(max_tokens=0), "sampling.max_tokens"),
        (dict(logprobs=21), "sampling.logprobs"),
    ],
)
def test_a_bad_sampling_value_is_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(InvalidArgument) as caught:
        list(client.stream([1], **sampling))
    err = caught.value
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    assert field.removeprefix("sampling.") in err.message


def test_a_missing_or_wrong_api_key_is_unauthenticated(worker):
    for key in (None, "wrong"):
        with Client(worker.address, api_key=key, timeout=10) as client:
            with pytest.raises(Unauthenticated) as caught:
                client.generate([1], max_tokens=1)
            assert caught.value.reason == "INVALID_API_KEY"
            with pytest.raises(Unauthenticated):
                client.list_adapters()
            assert client.health() and client.health(SERVICE_NAME)  # open without a key


def test_a_full_queue_a_closed_stream_and_a_deadline(busy_worker):
    with Client(busy_worker.address, timeout=10) as client:
        running = client.stream([1], max_tokens=100)
        assert next(running).token_id == mock_completion([1], None, 1, VOCAB)[0]
        with pytest.raises(ResourceExhausted) as caught:
            client.generate([2], max_tokens=1)
        assert caught.value.queue_full and caught.value.reason == "QUEUE_FULL"
        assert "max_queue=0" in caught.value.message
        running.close()  # cancels the call: the server frees its slot
        wait_idle(client.stats)
        with pytest.raises(DeadlineExceeded):
            client.generate([3], max_tokens=100, timeout=0.2)  # 100 steps of 50 ms
        wait_idle(client.stats)


def test_no_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=5) as client, pytest.raises(Unavailable) as caught:
        client.stats()
    assert caught.value.field is None and caught.value.reason == "UNAVAILABLE"


class _FailedCall(grpc.RpcError):
    """A failed call as grpc gives it, with the trailer a jlora server sends."""

    def __init__(self, code: grpc.StatusCode, status: status_pb2.Status) -> None:
        self._code, self._status = code, status

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._status.message

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((DETAILS_KEY, self._status.SerializeToString()),)


def test_a_retry_delay_and_an_unlisted_code():
    status = status_proto(RequestError("busy", code=Code.RESOURCE_EXHAUSTED, reason=QUEUE_FULL))
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)
    )
    status.details.add().Pack(retry)
    busy = error_from_rpc(_FailedCall(grpc.StatusCode.RESOURCE_EXHAUSTED, status))
    assert isinstance(busy, ResourceExhausted)
    assert (busy.retry_delay, busy.queue_full, busy.message) == (1.5, True, "busy")
    internal = error_from_rpc(_FailedCall(grpc.StatusCode.INTERNAL, status_pb2.Status(message="x")))
    assert type(internal) is JloraError
    assert (internal.code, internal.reason, internal.retry_delay) == (
        grpc.StatusCode.INTERNAL,
        "INTERNAL",
        None,
    )


# -- adapters and the server --------------------------------------------------------------


def test_adapter_lifecycle(client):
    adapter = client.register_adapter("mine", "mine")
    assert (adapter.name, adapter.rank, adapter.state) == ("mine", 16, pb.ADAPTER_STATE_HOST)
    loaded = client.load_adapter("mine", pin=True)
    assert loaded.pinned
    assert client.generate([4], adapter="mine", max_tokens=2).token_ids == mock_completion(
        [4], "mine", 2, VOCAB
    )
    assert [(m.id, m.kind) for m in client.models()] == [
        ("smol", pb.MODEL_KIND_BASE),
        ("a", pb.MODEL_KIND_ADAPTER),
        ("mine", pb.MODEL_KIND_ADAPTER),
    ]
    unloaded = client.unload_adapter("mine")
    assert (unloaded.state, unloaded.pinned) == (pb.ADAPTER_STATE_HOST, False)
    client.unregister_adapter("mine")
    assert [a.name for a in client.list_adapters()] == ["a"]
    stats = client.stats()
    assert stats.max_queue == 64 and stats.adapter_slots.total > 0


# -- the asyncio client -------------------------------------------------------------------


def test_the_async_client_does_the_same(worker):
    async def main() -> None:
        async with AsyncClient(worker.address, api_key=KEY, timeout=10) as client:
            expected = mock_completion([5, 6, 9], "a", 6, VOCAB)
            done = await client.generate([5, 6, 9], adapter="a", max_tokens=6)
            assert done.token_ids == expected and done.finish_reason == "length"
            assert done.text == MockTokenizer().decode(expected)
            streamed = [r async for r in client.stream([5, 6, 9], adapter="a", max_tokens=6)]
            assert [r.token_id for r in streamed] == expected
            assert streamed[-1].usage.completion_tokens == 6
            with pytest.raises(NotFound) as not_found:
                await client.generate([1], adapter="nope")
            assert (not_found.value.reason, not_found.value.field) == (
                "ADAPTER_NOT_FOUND",
                "adapter",
            )
            with pytest.raises(InvalidArgument) as invalid:
                await client.generate([1], temperature=-0.5)
            assert invalid.value.field == "sampling.temperature"
            assert [a.name for a in await client.list_adapters()] == ["a"]
            assert [m.id for m in await client.models()] == ["smol", "a"]
            assert await client.health()
        async with AsyncClient(worker.address, api_key="wrong") as client:
            with pytest.raises(Unauthenticated) as caught:
                await client.stats()
            assert caught.value.reason == "INVALID_API_KEY"

    asyncio.run(main())


def test_the_async_client_queue_full_closed_stream_and_deadline(busy_worker):
    async def main() -> None:
        async with AsyncClient(busy_worker.address, timeout=10) as client:
            running = client.stream([1], max_tokens=100)
            assert (await anext(running)).token_id == mock_completion([1], None, 1, VOCAB)[0]
            with pytest.raises(ResourceExhausted) as caught:
                await client.generate([2], max_tokens=1)
            assert caught.value.queue_full
            await running.aclose()  # cancels the call
            deadline = time.monotonic() + 2
            while (await client.stats()).running:
                assert time.monotonic() < deadline, "a closed stream kept running"
                await asyncio.sleep(0.01)
            with pytest.raises(DeadlineExceeded):
                await client.generate([3], max_tokens=100, timeout=0.2)

    asyncio.run(main())
