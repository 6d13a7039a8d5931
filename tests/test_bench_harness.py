"""bench.serve against real servers on loopback: MockEngine workers behind the router
(`tests.test_openai_http.Deployment`) and, made slow, one worker
(`tests.test_server.Worker`) with a router in front. MockTokenizer encodes a prompt's
UTF-8 bytes, and the mock's completion is known exactly (`expected_text`), so both
the counts and the texts the harness records can be checked.

Every test drives both front doors: the OpenAI-compatible HTTP API and jlora.v1 gRPC.
"""

from __future__ import annotations

import json
import socket

import pytest

from bench.lib.harness import RequestFailed, RequestRecord, run, summarize
from bench.lib.workloads import WordTokenizer, Workload, WorkloadRequest
from bench.serve import main
from jlora.engine.mock import mock_engine
from router.app import start_router
from tests.test_openai_http import Deployment, expected_text
from tests.test_server import Worker

KINDS = ("http", "grpc")


class Servers:
    """A target URL per front door of one deployment."""

    def __init__(self, router, *, http: str) -> None:
        self.targets = {"http": http, "grpc": f"grpc://{router.address}"}


@pytest.fixture(scope="module")
def deployment():
    deployment = Deployment(max_seq_len=128, poll_interval=0.1)
    yield Servers(deployment.router, http=deployment.url)
    deployment.close()


@pytest.fixture(scope="module")
def slow():
    """One worker, 4 decode slots, 20 ms a decode step, behind a router."""
    worker = Worker(mock_engine(max_slots=4, step_latency=0.02), model_name="smol")
    router = start_router([worker.server.address], poll_interval=0.1)
    yield Servers(router, http=f"http://127.0.0.1:{router.http_port}")
    router.stop(grace=0)
    worker.close()


def request(index: int, arrival_s: float, max_tokens: int, adapter: str | None = None):
    rank = {None: 0, "a": 8, "b": 16}.get(adapter, 4)
    return WorkloadRequest(f"r{index}", arrival_s, f"Hello {index}", 7, max_tokens, adapter, rank)


def workload(*requests: WorkloadRequest) -> Workload:
    return Workload({"kind": "test"}, tuple(requests))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- what each request records -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_request_gets_its_tokens_text_and_timings(deployment, kind):
    adapters = [None, "a", "b"]
    plan = workload(*(request(i, 0.01 * i, 1 + i, adapters[i % 3]) for i in range(12)))
    records = run(plan, deployment.targets[kind], progress=False)
    assert [r.id for r in records] == [r.id for r in plan.requests]
    for record, asked in zip(records, plan.requests, strict=True):
        assert record.error is None, record
        assert record.adapter == asked.adapter and record.scheduled_s == asked.arrival_s
        assert record.output_tokens == asked.max_tokens  # ignore_eos: exactly max_tokens
        # The base model (None) is what the server answers for "smol" / the empty adapter.
        prompt_ids = list(asked.prompt.encode())
        assert record.text == expected_text(prompt_ids, asked.adapter, asked.max_tokens)
        assert record.prompt_tokens == len(prompt_ids)
        assert 0 < record.ttft_ms <= record.e2e_ms
        assert record.sent_s >= record.scheduled_s
        assert record.finished_s == pytest.approx(record.sent_s + record.e2e_ms / 1e3, abs=1e-3)
        if asked.max_tokens == 1:
            assert record.tpot_ms is None
        else:
            tpot = (record.e2e_ms - record.ttft_ms) / (asked.max_tokens - 1)
            assert record.tpot_ms == pytest.approx(tpot)
    summary = summarize(records)
    assert summary["completed"] == 12 and summary["errors"] == 0
    assert summary["output_tokens"] == sum(r.max_tokens for r in plan.requests)


def test_word_ids_send_each_prompts_words_as_token_ids_over_grpc(deployment):
    """A model without a tokenizer (`make bench-gpu`): the prompt's words go as ids."""
    prompts = ["the of and", "water less public put think"]
    plan = workload(
        *(WorkloadRequest(f"w{i}", 0.0, text, len(text.split()), 4, "a", 8) for i, text in
          enumerate(prompts))
    )  # fmt: skip
    records = run(plan, deployment.targets["grpc"], progress=False, word_ids=True)
    for record, text in zip(records, prompts, strict=True):
        ids = WordTokenizer().encode(text)
        assert record.error is None and record.prompt_tokens == len(text.split())
        assert record.text == expected_text(ids, "a", 4)
    with pytest.raises(ValueError, match="word_ids needs a grpc:// target"):
        run(plan, deployment.targets["http"], progress=False, word_ids=True)


@pytest.mark.parametrize("kind, error", [("http", "HTTP 404: "), ("grpc", "NOT_FOUND: ")])
def test_an_unknown_adapter_is_an_error_and_the_run_goes_on(deployment, kind, error):
    plan = workload(request(0, 0.0, 3, "a"), request(1, 0.0, 3, "nope"), request(2, 0.01, 3))
    first, unknown, last = run(plan, deployment.targets[kind], progress=False)
    assert unknown.error.startswith(error) and "nope" in unknown.error
    assert unknown.output_tokens == 0 and unknown.e2e_ms is None and unknown.ttft_ms is None
    assert first.error is None and last.error is None and last.output_tokens == 3
    summary = summarize([first, unknown, last])
    assert summary["errors"] == 1 and summary["errors_by_kind"] == {error[:-2]: 1}
    assert summary["completed"] == 2 and summary["output_tokens"] == 6


@pytest.mark.parametrize("kind, error", [("http", "connection: "), ("grpc", "UNAVAILABLE: ")])
def test_a_refused_connection_is_recorded_per_request(kind, error):
    scheme = "http" if kind == "http" else "grpc"
    plan = workload(request(0, 0.0, 2), request(1, 0.01, 2))
    records = run(plan, f"{scheme}://127.0.0.1:{free_port()}", base_model="m", progress=False)
    assert all(r.error is not None and r.error.startswith(error) for r in records), records
    assert summarize(records)["errors"] == 2


def test_the_http_base_model_comes_from_v1_models_unless_given(deployment):
    """Deployment's base model is "smol": a wrong --base-model is a 404 per request,
    an unreachable /v1/models stops the run before it starts."""
    plan = workload(request(0, 0.0, 2))
    (record,) = run(plan, deployment.targets["http"], base_model="other", progress=False)
    assert record.error.startswith("HTTP 404: ") and "other" in record.error
    with pytest.raises(RequestFailed, match="GET http://127.0.0.1:.*/v1/models"):
        run(plan, f"http://127.0.0.1:{free_port()}", progress=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_past_its_timeout_is_an_error(slow, kind):
    plan = workload(request(0, 0.0, 40), request(1, 0.0, 1))
    long, short = run(plan, slow.targets[kind], progress=False, timeout_s=0.3)
    assert long.error == "timeout after 0.3 s" and long.e2e_ms is None
    assert 300 <= 1e3 * (long.finished_s - long.sent_s) < 800
    assert short.error is None and short.output_tokens == 1


# -- open loop ---------------------------------------------------------------------------


@pytest.mark.serial
@pytest.mark.parametrize("kind", KINDS)
def test_requests_leave_on_schedule_while_the_server_queues_them(slow, kind):
    """24 requests 20 ms apart, each holding one of 4 slots for 10 steps of 20 ms: the
    server serves about 20 a second, a closed-loop client would take 24 x 0.2 s. Every
    send must still leave on time, and most of the requests overlap."""
    plan = workload(*(request(i, 0.02 * i, 10) for i in range(24)))
    records = run(plan, slow.targets[kind], progress=False)
    assert all(r.error is None and r.output_tokens == 10 for r in records), records
    lateness = [r.sent_s - r.scheduled_s for r in records]
    assert max(lateness) < 0.05, lateness
    last_send = records[-1].sent_s
    in_flight = sum(r.finished_s > last_send for r in records[:-1])
    assert in_flight >= 12, in_flight
    # The server really queued: a request sent later waited for a slot.
    assert max(r.ttft_ms for r in records) > 150


# -- summary and CLI ---------------------------------------------------------------------


def test_summarize_counts_and_percentiles():
    def done(sent, finished, ttft, tpot, tokens):
        e2e = 1e3 * (finished - sent)
        return RequestRecord("x", None, sent, sent, finished, ttft, tpot, e2e, tokens, 5)

    records = [
        done(0.0, 1.0, 100.0, 10.0, 91),
        done(0.5, 2.0, 300.0, 20.0, 61),
        RequestRecord("y", "a", 1.0, 1.001, 1.2, error="HTTP 404: no such model"),
        done(1.5, 1.6, 50.0, None, 1),
    ]
    summary = summarize(records)
    # Makespan: the first send (0.0) to the last finish of a completed request (2.0).
    assert summary["duration_s"] == 2.0
    assert summary["requests"] == 4 and summary["completed"] == 3 and summary["errors"] == 1
    assert summary["errors_by_kind"] == {"HTTP 404": 1}
    assert summary["output_tokens"] == 153
    assert summary["output_tokens_per_s"] == 76.5 and summary["requests_per_s"] == 1.5
    # TTFT [50, 100, 300]: linear interpolation, p90 at rank 1.8 = 100 + 0.8 * 200.
    assert summary["ttft_ms"] == pytest.approx({"mean": 150, "p50": 100, "p90": 260, "p99": 296})
    assert summary["tpot_ms"] == pytest.approx({"mean": 15, "p50": 15, "p90": 19, "p99": 19.9})
    assert summary["e2e_ms"]["p50"] == pytest.approx(1000)
    assert summary["send_lag_ms"]["max"] == pytest.approx(1.0)
    assert summarize(records, duration_s=4.0)["output_tokens_per_s"] == 38.25
    empty = summarize([])
    assert empty["requests"] == 0 and empty["ttft_ms"]["p50"] is None


def test_the_cli_writes_raw_json_and_prints_the_summary(deployment, tmp_path, capsys):
    plan = workload(*(request(i, 0.005 * i, 4, [None, "a"][i % 2]) for i in range(6)))
    plan.save(tmp_path / "w.jsonl")
    out = tmp_path / "out.json"
    target = deployment.targets["http"]
    main(["--workload", str(tmp_path / "w.jsonl"), "--target", target, "--system", "mock",
          "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert f"mock @ {target}: 6 requests, 6 completed, 0 errors" in printed.out
    assert "TTFT ms" in printed.out and "6/6" in printed.err  # the progress bar
    report = json.loads(out.read_text())
    assert set(report) == {"target", "system", "workload", "machine", "summary", "requests"}
    assert report["system"] == "mock" and report["workload"] == {"kind": "test"}
    assert report["summary"]["output_tokens"] == 24 and "device" in report["machine"]
    assert [r["id"] for r in report["requests"]] == [f"r{i}" for i in range(6)]
    assert report["requests"][1]["text"] == expected_text(list(b"Hello 1"), "a", 4)
