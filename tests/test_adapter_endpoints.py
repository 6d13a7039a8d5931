"""Registering adapters through the router, as a vLLM user (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) and as a gRPC client would: the same names, the same checks,
the same errors, and every worker serves what the router registered.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from configs import load_preset
from jlora.adapters.peft import make_demo_adapters
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine
from jlora.server import serve
from router.app import start_router
from tests.test_server import rich_details

VOCAB = 1000
TAGGED = "org/c-lora:v2"


class Deployment:
    """Two in-process mock workers and a router sharing an adapters directory."""

    def __init__(self, root, registry) -> None:
        self.engines = [mock_engine() for _ in range(2)]
        self.workers = [
            serve(engine, tokenizer=engine.tokenizer, model_name="smol", adapters_dir=root)
            for engine in self.engines
        ]
        self.router = start_router(
            [w.address for w in self.workers],
            poll_interval=0.1,
            adapters_dir=root,
            registry=registry,
        )
        self.url = f"http://127.0.0.1:{self.router.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def post(self, path: str, body: dict) -> tuple[int, str]:
        message = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(message, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def worker_adapters(self) -> list[list[str]]:
        return [[info.adapter.name for info in engine.adapter_infos()] for engine in self.engines]

    def close(self) -> None:
        self.client.close()
        self.router.stop(grace=0)
        for worker in self.workers:
            worker.stop(grace=0)


@pytest.fixture
def deployment(tmp_path):
    root = tmp_path / "adapters"
    config = load_preset("cpu-tiny").config
    make_demo_adapters(config, root / "team", n=1, ranks=[4], seed=1)
    make_demo_adapters(config, tmp_path / "outside", n=1, ranks=[8], seed=2)
    deployment = Deployment(root, tmp_path / "registry.sqlite")
    yield deployment
    deployment.close()


def test_load_lora_adapter_registers_a_tagged_name_on_every_worker(deployment):
    status, text = deployment.post(
        "/v1/load_lora_adapter", {"lora_name": TAGGED, "lora_path": "team/demo-00-r4"}
    )
    assert (status, text) == (200, f"Success: LoRA adapter '{TAGGED}' added successfully.")
    assert deployment.worker_adapters() == [[TAGGED], [TAGGED]]
    models = {m.id: m for m in deployment.client.models.list()}
    assert set(models) == {"smol", TAGGED} and models[TAGGED].model_extra["lora_rank"] == 4
    reply = deployment.client.completions.create(model=TAGGED, prompt="Hi", max_tokens=5)
    expected = MockTokenizer().decode(mock_completion(list(b"Hi"), TAGGED, 5, VOCAB))
    assert reply.choices[0].text == expected
    status, text = deployment.post("/v1/unload_lora_adapter", {"lora_name": TAGGED})
    assert (status, text) == (200, f"Success: LoRA adapter '{TAGGED}' removed successfully.")
    assert deployment.worker_adapters() == [[], []]
    assert [m.id for m in deployment.client.models.list()] == ["smol"]


def test_grpc_register_takes_the_same_name(deployment):
    with grpc.insecure_channel(deployment.router.address) as channel:
        stub = pb_grpc.JloraStub(channel)
        request = pb.RegisterAdapterRequest(name=TAGGED, path="team/demo-00-r4")
        assert stub.RegisterAdapter(request, timeout=10).adapter.name == TAGGED
        wrong_hash = pb.RegisterAdapterRequest(
            name="other", path="team/demo-00-r4", sha256="0" * 64
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterAdapter(wrong_hash, timeout=10)
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert rich_details(caught.value) == ("sha256", "CHECKSUM_MISMATCH")
    assert deployment.worker_adapters() == [[TAGGED], [TAGGED]]


@pytest.mark.parametrize(
    "body, status, param, names",
    [
        ({"lora_name": "x", "lora_path": "../outside/demo-00-r8"}, 400, "lora_path", "'..'"),
        ({"lora_name": "x", "lora_path": "{outside}"}, 400, "lora_path", "outside the adapters"),
        ({"lora_name": "x", "lora_path": "missing"}, 400, "lora_path", "does not exist"),
        ({"lora_name": "x"}, 400, "lora_path", "path is empty"),
        ({"lora_path": "team/demo-00-r4"}, 400, "lora_name", "name is empty"),
        ({"lora_name": "b//c", "lora_path": "team/demo-00-r4"}, 400, "lora_name", "b//c"),
        ({"lora_name": "smol", "lora_path": "team/demo-00-r4"}, 400, "lora_name", "base model"),
        ({"lora_name": 7, "lora_path": "team/demo-00-r4"}, 400, "lora_name", "must be a str"),
        ({"lora_name": "kept", "lora_path": "team/demo-00-r4"}, 409, "lora_name", "already"),
    ],
)
def test_bad_loads_name_the_field_and_change_nothing(
    deployment, tmp_path, body, status, param, names
):
    assert (
        deployment.post(
            "/v1/load_lora_adapter", {"lora_name": "kept", "lora_path": "team/demo-00-r4"}
        )[0]
        == 200
    )
    if body.get("lora_path") == "{outside}":
        body = {**body, "lora_path": str(tmp_path / "outside" / "demo-00-r8")}
    code, text = deployment.post("/v1/load_lora_adapter", body)
    error = json.loads(text)["error"]
    assert (code, error["param"]) == (status, param) and names in error["message"], error
    assert deployment.worker_adapters() == [["kept"], ["kept"]]


def test_unloading_an_unknown_adapter_is_404(deployment):
    code, text = deployment.post("/v1/unload_lora_adapter", {"lora_name": "ghost"})
    error = json.loads(text)["error"]
    assert (code, error["param"], error["code"]) == (404, "lora_name", "model_not_found")
