"""The optional API key on every front door: the router's OpenAI HTTP (the official
`openai` client) and gRPC, and a worker's gRPC; health checks stay open, and the router
sends the key on to workers that require it too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine
from jlora.server import serve
from router.app import start_router
from tests.test_server import request, rich_details, token_ids

KEY = "s3cret-key"
VOCAB = 1000


@pytest.fixture(scope="module")
def keyed():
    """A worker and a router, both with the key (the router sends it to the worker)."""
    engine = mock_engine(adapters={"a": 8})
    worker = serve(engine, tokenizer=engine.tokenizer, model_name="smol", api_key=KEY)
    router = start_router([worker.address], poll_interval=0.1, api_key=KEY)
    yield worker, router
    router.stop(grace=0)
    worker.stop(grace=0)


def _http(router, path: str, *, key: str | None, body: dict | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    message = urllib.request.Request(
        f"http://127.0.0.1:{router.http_port}{path}", data=data, headers=headers
    )
    try:
        with urllib.request.urlopen(message, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_openai_client_works_with_the_key_and_gets_401_without(keyed):
    _, router = keyed
    url = f"http://127.0.0.1:{router.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0) as client:
        reply = client.completions.create(model="a", prompt="Hi", max_tokens=4)
        expected = MockTokenizer().decode(mock_completion(list(b"Hi"), "a", 4, VOCAB))
        assert reply.choices[0].text == expected
        assert [m.id for m in client.models.list()] == ["smol", "a"]
    for wrong in ("wrong-key", "Bearer"):
        with openai.OpenAI(base_url=url, api_key=wrong, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as caught:
                client.completions.create(model="a", prompt="Hi", max_tokens=4)
            assert caught.value.status_code == 401
            assert caught.value.body["code"] == "invalid_api_key"
    status, body = _http(router, "/v1/load_lora_adapter", key=None, body={"lora_name": "x"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_health_and_metrics_stay_open(keyed):
    worker, router = keyed
    assert _http(router, "/health", key=None)[0] == 200
    assert _http(router, "/metrics", key=None)[0] == 200
    for address in (worker.address, router.address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("side", ["router", "worker"])
def test_grpc_calls_need_the_key(keyed, side):
    worker, router = keyed
    address = router.address if side == "router" else worker.address
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.JloraStub(channel)
        for call in (
            lambda metadata: list(stub.Generate(request(ids=[3], max_tokens=2), metadata=metadata)),
            lambda metadata: stub.Models(pb.ModelsRequest(), metadata=metadata),
        ):
            for metadata in ((), (("authorization", "Bearer nope"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    call(metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert rich_details(caught.value) == (None, "INVALID_API_KEY")
        good = (("authorization", f"Bearer {KEY}"),)
        responses = list(stub.Generate(request(ids=[3], max_tokens=2), metadata=good))
        assert token_ids(responses) == mock_completion([3], None, 2, VOCAB)


def test_a_router_without_the_workers_key_says_why_it_cannot_use_them():
    engine = mock_engine()
    worker = serve(engine, tokenizer=engine.tokenizer, api_key=KEY)
    router = start_router([worker.address], poll_interval=0.1)  # no key
    try:
        [seen] = router.workers
        assert not seen.up and "UNAUTHENTICATED" in seen.reason
        channel = grpc.insecure_channel(router.address)
        with channel, pytest.raises(grpc.RpcError) as caught:
            list(pb_grpc.JloraStub(channel).Generate(request(ids=[3], max_tokens=2)))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "a valid API key is required" in caught.value.details()
    finally:
        router.stop(grace=0)
        worker.stop(grace=0)
