"""Hostile clients of the router's HTTP API, as issue 18 found them: raw JSON bytes with a
lone surrogate or 50,000 levels of nesting, raw sockets on loopback that send headers
only, less body than their Content-Length, or nothing at all, a body past the size
limit, and the `openai` client's `models.retrieve`. Each gets its status in OpenAI's
error shape within a bounded time and queues nothing; a known-good request afterwards
returns the same greedy text. The router runs with small limits so that the timeouts
are quick to observe.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import openai
import pytest

from jlora.contract.adapters import Adapter
from router.http_body import MAX_JSON_DEPTH, HttpError, HttpLimits, parse_json_body
from tests.test_openai_http import CHAT, COMPLETIONS, Deployment, expected_text, wait_for

LIMITS = HttpLimits(max_body_bytes=256 * 1024, body_timeout=0.5, idle_timeout=1.0)
SLACK = 2.0  # seconds past a limit within which the close must be seen (a busy machine)


@pytest.fixture(scope="module")
def deployment():
    started = int(time.time())
    deployment = Deployment(poll_interval=0.1, http_limits=LIMITS)
    deployment.started = started
    yield deployment
    deployment.close()


def generate_calls(deployment: Deployment) -> float:
    """Generate calls the router has taken, whatever their outcome."""
    return sum(
        sample.value
        for metric in deployment.router.front.metrics.registry.collect()
        if metric.name == "jlora_router_requests"
        for sample in metric.samples
        if sample.name == "jlora_router_requests_total"
    )


def assert_known_good(deployment: Deployment) -> None:
    """The same greedy text as before any hostile request."""
    wait_for(deployment.idle, what="idle")
    code, reply = deployment.post(COMPLETIONS, dict(model="a", prompt="ok", max_tokens=3))
    assert code == 200, reply
    assert reply["choices"][0]["text"] == expected_text(list(b"ok"), "a", 3)


def assert_openai_error(reply: dict, *, code: str, names: str, param: str | None) -> None:
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert names in error["message"] and error["param"] == param


def raw(deployment: Deployment, data: bytes) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the router closes it: what it
    answered, and the seconds from the send to the close (a hang fails at 15 s)."""
    address = ("127.0.0.1", deployment.router.http_port)
    with socket.create_connection(address, timeout=15) as conn:
        conn.sendall(data)
        sent = time.monotonic()
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer, time.monotonic() - sent


def parse_response(answer: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers in lower case, JSON body) of one raw HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines)
    }
    assert headers["content-type"].startswith("application/json"), answer
    return int(status_line.split()[1]), headers, json.loads(body)


def request_head(length: int | None, *, chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


GOOD_BODY = json.dumps(dict(model="a", prompt="ok", max_tokens=3)).encode()
DEEP = 50_000


# -- bodies that are not what they claim ---------------------------------------------------

HOSTILE_BODIES = {
    # id: (route, raw JSON text, OpenAI code, param, what the message must name)
    "surrogate": (COMPLETIONS, rb'{"model": "a", "prompt": "abc\ud800def", "max_tokens": 3}',
                  "invalid_unicode", "prompt", "prompt is not valid Unicode"),
    "surrogate-in-list": (COMPLETIONS, rb'{"model": "a", "prompt": ["abc\uDFFF"]}',
                          "invalid_unicode", "prompt[0]", "prompt[0] is not valid Unicode"),
    "surrogate-chat": (CHAT,
                       rb'{"model": "a", "messages": [{"role": "user", "content": "\ud800"}]}',
                       "invalid_unicode", "messages[0].content",
                       "messages[0].content is not valid Unicode"),
    "surrogate-key": (CHAT, rb'{"model": "a", "messages": [{"role": "user", "\ud800": 1}]}',
                      "invalid_unicode", "messages[0]",
                      "a key of messages[0] is not valid Unicode"),
    "deep-prompt": (COMPLETIONS, b'{"model": "a", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
                    "invalid_json", None, f"nests deeper than {MAX_JSON_DEPTH} levels"),
    "deep-body": (COMPLETIONS, b"[" * DEEP + b"]" * DEEP,
                  "invalid_json", None, f"nests deeper than {MAX_JSON_DEPTH} levels"),
    "deep-100": (CHAT, b'{"model": "a", "messages": ' + b"[" * 100 + b"]" * 100 + b"}",
                 "invalid_json", "messages", f"deeper than {MAX_JSON_DEPTH} levels (in messages)"),
    "huge-int": (COMPLETIONS, b'{"model": "a", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
                 "invalid_json", None, "not valid JSON"),
    "not-utf8": (COMPLETIONS, b'{"model": "a", "prompt": "\xff"}', "invalid_json", None,
                 "not UTF-8"),
}  # fmt: skip


@pytest.mark.parametrize(
    "route, body, code, param, names", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys()
)
def test_hostile_json_is_a_400_naming_the_problem(deployment, route, body, code, param, names):
    calls = generate_calls(deployment)
    status, reply = deployment.post(route, body)
    assert status == 400, reply
    assert_openai_error(reply, code=code, names=names, param=param)
    assert generate_calls(deployment) == calls  # nothing was queued
    assert_known_good(deployment)


def test_the_nesting_limit_is_exact():
    def nested(lists: int) -> bytes:  # {"x": [[...]]}: the object is level 1
        return b'{"x": ' + b"[" * lists + b"]" * lists + b"}"

    value, level = parse_json_body(nested(MAX_JSON_DEPTH - 1))["x"], 2
    while value:
        value, level = value[0], level + 1
    assert level == MAX_JSON_DEPTH  # the innermost list, still served
    with pytest.raises(HttpError) as caught:
        parse_json_body(nested(MAX_JSON_DEPTH))
    assert caught.value.status == 400 and caught.value.param == "x"


def test_a_whole_surrogate_pair_is_one_character(deployment):
    body = rb'{"model": "a", "prompt": "x\ud83d\ude00", "max_tokens": 2}'
    status, reply = deployment.post(COMPLETIONS, body)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == expected_text(list("x\U0001f600".encode()), "a", 2)


def test_an_unexpected_exception_is_a_json_500(deployment, monkeypatch, caplog):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(deployment.router.front, "models", broken)
    with caplog.at_level(logging.ERROR, logger="router.http"):
        status, body = deployment.get("/v1/models")
    assert status == 500
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "GET /v1/models" in error["message"] and "boom" not in error["message"]
    (record,) = [r for r in caplog.records if r.name == "router.http"]
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])
    monkeypatch.undo()
    assert_known_good(deployment)


# -- slow and idle clients ----------------------------------------------------------------

SLOW_BODIES = {
    "headers-only": request_head(len(GOOD_BODY)),
    "short-body": request_head(len(GOOD_BODY)) + GOOD_BODY[:10],
    "short-chunked-body": request_head(None, chunked=True) + b"%x\r\n" % 100 + b'{"model"',
}


@pytest.mark.serial
@pytest.mark.parametrize("sent", SLOW_BODIES.values(), ids=SLOW_BODIES.keys())
def test_a_body_that_does_not_arrive_is_a_408_and_the_connection_closes(deployment, sent):
    calls = generate_calls(deployment)
    answer, seconds = raw(deployment, sent)
    status, headers, reply = parse_response(answer)
    assert status == 408 and headers["connection"] == "close"
    assert_openai_error(reply, code="request_timeout", names="did not arrive within", param=None)
    assert LIMITS.body_timeout * 0.9 <= seconds <= LIMITS.body_timeout + SLACK
    assert generate_calls(deployment) == calls
    assert_known_good(deployment)


IDLE_CLIENTS = {
    "nothing-sent": b"",
    "unfinished-headers": f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode(),
}


@pytest.mark.serial
@pytest.mark.parametrize("sent", IDLE_CLIENTS.values(), ids=IDLE_CLIENTS.keys())
def test_a_connection_without_a_request_is_closed(deployment, sent):
    answer, seconds = raw(deployment, sent)
    assert answer == b""
    assert LIMITS.idle_timeout * 0.9 <= seconds <= LIMITS.idle_timeout + SLACK
    assert_known_good(deployment)


@pytest.mark.serial
def test_an_idle_keep_alive_connection_is_closed(deployment):
    answer, seconds = raw(deployment, request_head(len(GOOD_BODY)) + GOOD_BODY)
    status, headers, reply = parse_response(answer)
    assert status == 200 and headers.get("connection", "keep-alive") != "close"
    assert reply["choices"][0]["text"] == expected_text(list(b"ok"), "a", 3)
    assert LIMITS.idle_timeout * 0.9 <= seconds <= LIMITS.idle_timeout + SLACK


def test_a_body_past_the_size_limit_is_a_413(deployment):
    calls = generate_calls(deployment)
    big = dict(model="a", prompt="x" * LIMITS.max_body_bytes, max_tokens=2)
    status, reply = deployment.post(COMPLETIONS, big)
    assert status == 413
    assert_openai_error(reply, code="request_too_large", names="Content-Length", param=None)
    chunk = b"x" * 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5))
    answer, _ = raw(deployment, request_head(None, chunked=True) + chunks + b"0\r\n\r\n")
    status, _, reply = parse_response(answer)
    assert status == 413
    assert_openai_error(reply, code="request_too_large", names="more than", param=None)
    assert generate_calls(deployment) == calls
    assert_known_good(deployment)


# -- models -------------------------------------------------------------------------------


def test_models_retrieve(deployment):
    client = deployment.client
    now = time.time()
    for model_id, root in (("smol", "smol"), ("a", "smol")):
        model = client.models.retrieve(model_id)
        assert (model.id, model.object, model.owned_by) == (model_id, "model", "jlora")
        assert model.model_extra["root"] == root
        assert deployment.started <= model.created <= now  # the router's start
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model" and "nope" in caught.value.body["message"]


def test_models_report_their_registration_time(deployment):
    registry = deployment.router.registry
    registry.register(
        Adapter(
            name="a",
            base_model="smol",
            rank=8,
            alpha=16.0,
            targets=("q_proj", "v_proj"),
            path="a",
            sha256="0" * 64,
            size_bytes=1,
            created_at=1_700_000_000.5,
        )
    )
    try:
        listed = {model.id: model.created for model in deployment.client.models.list().data}
        assert listed["a"] == 1_700_000_000 == deployment.client.models.retrieve("a").created
        assert listed["b"] >= deployment.started and listed["smol"] >= deployment.started
    finally:
        registry.remove("a")
