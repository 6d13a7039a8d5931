"""The five defects an independent battery found (issue 63), on real servers on loopback:

1. a body between gRPC's default message limit (4 MiB) and the HTTP limit (32 MiB) was
   retried forever: it now reaches a worker, whose 400 names `prompt`, within seconds;
2. more than 128 streams on one gRPC channel were partly refused (REFUSED_STREAM): 200
   now each complete or get the router's documented RESOURCE_EXHAUSTED;
3. a second `jlora up` on taken ports failed only after its workers had compiled: it now
   fails before any worker starts;
4. malformed HTTP framing got aiohttp's plain-text 400 and a traceback per request: it
   now gets OpenAI's error shape and one WARNING line;
5. unload without `lora_name` was 404 about name '' (now 400 naming `lora_name`), a NUL
   in `lora_path` said "path is empty" (now it names the NUL).

After each, a known-good greedy request gets the same text as before.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time

import grpc
import pytest

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract.errors import QUEUE_FULL
from jlora.contract.status import from_rpc_error
from jlora.engine.mock import mock_completion
from router.http_body import MAX_BODY_BYTES, HttpLimits
from tests.test_http_limits import assert_known_good, assert_openai_error, parse_response, raw
from tests.test_openai_http import COMPLETIONS, VOCAB, Deployment
from tests.test_server import token_ids


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Two mock workers (a context of 64 tokens) behind a router with the default limits,
    its adapter paths confined to an (empty) adapters directory."""
    deployment = Deployment(
        poll_interval=0.1, max_queue=64, adapters_dir=tmp_path_factory.mktemp("adapters")
    )
    yield deployment
    deployment.close()


# -- 1: a body over gRPC's default message limit ---------------------------------------


def test_a_5_mib_prompt_gets_its_400_naming_prompt_within_seconds(deployment):
    """5 MiB of prompt: forwarded whole (every jlora server and client takes messages up to
    the HTTP limit and more), refused by the worker for its length."""
    body = dict(model="a", prompt="word " * (1 << 20), max_tokens=4)
    started = time.monotonic()
    code, reply = deployment.post(COMPLETIONS, body)
    assert time.monotonic() - started < 30  # it hung until the client gave up
    assert code == 400, reply
    assert_openai_error(reply, code="invalid_argument", names="prompt has", param="prompt")
    assert_known_good(deployment)


def test_the_http_body_limit_cannot_pass_the_message_limit():
    with pytest.raises(ValueError, match="max_body_bytes=.*must be at most"):
        HttpLimits(max_body_bytes=MAX_BODY_BYTES + 1)
    assert HttpLimits().max_body_bytes <= MAX_BODY_BYTES


# -- 2: many streams on one channel ------------------------------------------------------


def test_200_streams_on_one_channel_complete_or_get_the_documented_status(deployment):
    """Every stream either gets its exact completion or RESOURCE_EXHAUSTED with reason
    QUEUE_FULL (the router's queue of 64 requests is full); none is refused by HTTP/2."""

    async def run() -> list[tuple[str, list[int] | None]]:
        async with grpc.aio.insecure_channel(deployment.router.address) as channel:
            stub = pb_grpc.JloraStub(channel)

            async def one(i: int) -> tuple[str, list[int] | None]:
                message = pb.GenerateRequest(
                    text="abc", adapter="a", sampling=pb.SamplingParams(max_tokens=4)
                )
                try:
                    replies = [reply async for reply in stub.Generate(message, timeout=60)]
                except grpc.aio.AioRpcError as err:
                    error = from_rpc_error(err)
                    return f"{error.code.name}:{error.reason}", None
                return "OK", token_ids(replies)

            return await asyncio.gather(*(one(i) for i in range(200)))

    outcomes = asyncio.run(run())
    done = [tokens for status, tokens in outcomes if status == "OK"]
    assert {status for status, _ in outcomes} <= {"OK", f"RESOURCE_EXHAUSTED:{QUEUE_FULL}"}
    assert done and all(tokens == mock_completion(list(b"abc"), "a", 4, VOCAB) for tokens in done)
    assert_known_good(deployment)


# -- 3: a second `jlora up` on taken ports --------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_second_up_on_a_taken_port_fails_before_any_worker_starts(tmp_path, flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--http-port" if flag == "--port" else "--port"
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "jlora.cli.main", "up", "--model", "cpu-tiny",
             "--state-dir", str(tmp_path), flag, str(port), other, "0"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30
    assert f"{flag}: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "already in use" in result.stderr
    assert "starting" not in result.stderr  # no worker was started


# -- 4: malformed HTTP framing --------------------------------------------------------------

FRAMING = {
    "bad-request-line": b"THIS IS NOT HTTP\r\n\r\n",
    "bad-chunk-size": (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    ).encode(),
    "length-and-chunked": (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ).encode(),
}


@pytest.mark.parametrize("case", sorted(FRAMING))
def test_malformed_framing_gets_the_json_error_shape_and_one_warning(deployment, caplog, case):
    with caplog.at_level(logging.DEBUG):
        answer, closed_after = raw(deployment, FRAMING[case])
    status, _, reply = parse_response(answer)
    assert status == 400 and closed_after < 5  # answered, and the connection closed
    assert_openai_error(reply, code="malformed_request", names="cannot be parsed", param=None)
    records = [r for r in caplog.records if r.name.startswith(("router", "aiohttp"))]
    assert [r.levelno for r in records if r.levelno >= logging.WARNING] == [logging.WARNING]
    assert not any(r.exc_info for r in records)
    assert "malformed HTTP request" in records[-1].getMessage()
    assert "\n" not in records[-1].getMessage()  # one line
    assert_known_good(deployment)


# -- 5: small ones --------------------------------------------------------------------------


def test_unload_without_lora_name_is_a_400_naming_it(deployment):
    code, reply = deployment.post("/v1/unload_lora_adapter", {})
    assert code == 400, reply
    assert_openai_error(reply, code="invalid_argument", names="name is empty", param="lora_name")
    assert_known_good(deployment)


def test_a_nul_in_lora_path_is_named(deployment, tmp_path):
    code, reply = deployment.post(
        "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ada\u0000pter"}
    )
    assert code == 400, reply
    assert "NUL character" in reply["error"]["message"] and reply["error"]["param"] == "lora_path"
    assert_known_good(deployment)
