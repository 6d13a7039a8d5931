"""What a worker tells about itself: vLLM's metric names beside jlora's, the workers'
metrics through the router's /metrics, and the log lines (one per request, throughput;
text and JSON).

The servers are real (gRPC, the metrics HTTP server, the router) around MockEngines, whose
streams are known: every value asserted is a count or a time the test can name.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.cli import up
from jlora.cli.main import build_parser
from jlora.engine.api import RunningInfo
from jlora.engine.mock import mock_engine
from jlora.engine.orchestrator import Orchestrator
from jlora.server import WorkerServer, serve
from jlora.server.logs import ThroughputLog
from jlora.server.metrics import VLLM_LATENCY_BUCKETS, Metrics
from router.app import start_router
from tests.engine_helpers import engine_stats
from tests.test_server import request

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-base"  # the served model id: the vllm:* metrics' model_name
VLLM = {"model_name": MODEL}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def labelled(samples: Samples, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), v) for (sample, labels), v in samples.items() if sample == name]


def wait_until(check, timeout: float = 10.0, what: str = "the metrics"):
    """check()'s first true result, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.05)
    return result


@pytest.fixture
def workers():
    """In-process workers around MockEngines serving MODEL, with /metrics on a free port."""
    servers: list[WorkerServer] = []

    def start(engine: Orchestrator) -> WorkerServer:
        server = serve(engine, tokenizer=engine.tokenizer, model_name=MODEL, metrics_port=0)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


def metrics_url(server: WorkerServer) -> str:
    return f"http://127.0.0.1:{server.metrics_port}/metrics"


def stub_for(address: str) -> pb_grpc.JloraStub:
    return pb_grpc.JloraStub(grpc.insecure_channel(address))


def info(request_id: str, adapter: str | None) -> RunningInfo:
    return RunningInfo(
        request_id=request_id,
        adapter=adapter,
        rank=8 if adapter else 0,
        slot=0,
        prompt_tokens=1,
        generated_tokens=1,
        max_tokens=8,
    )


# -- the vLLM-named metrics on a worker --------------------------------------------------


def test_the_vllm_metrics_count_what_their_jlora_twins_count(workers):
    server = workers(mock_engine(step_latency=0.002, adapters={"a": 8}))
    stub = stub_for(server.address)
    for ids, adapter in (([1, 2], ""), ([3, 4, 5], "a"), ([6], "")):
        assert len(list(stub.Generate(request(ids=ids, adapter=adapter, max_tokens=4)))) == 4
    page = scrape(metrics_url(server))
    # 6 prompt tokens, 3 requests of 4 tokens: 3 first tokens, 9 gaps between tokens.
    assert value(page, "vllm:prompt_tokens_total", **VLLM) == 6
    assert value(page, "jlora_prompt_tokens_total") == 6
    assert value(page, "vllm:generation_tokens_total", **VLLM) == 12
    assert value(page, "jlora_generated_tokens_total") == 12
    for vllm, jlora, count in (
        ("vllm:time_to_first_token_seconds", "jlora_time_to_first_token_seconds", 3),
        ("vllm:time_per_output_token_seconds", "jlora_time_per_output_token_seconds", 9),
        ("vllm:e2e_request_latency_seconds", "jlora_request_latency_seconds", 3),
    ):
        assert value(page, f"{vllm}_count", **VLLM) == value(page, f"{jlora}_count") == count
        # The same observations, in the same order: the same sum, to the last bit.
        assert value(page, f"{vllm}_sum", **VLLM) == value(page, f"{jlora}_sum") > 0
    buckets = labelled(page, "vllm:e2e_request_latency_seconds_bucket")
    assert sorted(float(labels["le"]) for labels, _ in buckets) == [
        *VLLM_LATENCY_BUCKETS,
        float("inf"),
    ]
    assert value(page, "vllm:e2e_request_latency_seconds_bucket", le="+Inf", **VLLM) == 3
    assert value(page, "vllm:num_requests_running", **VLLM) == 0
    assert value(page, "vllm:num_requests_waiting", **VLLM) == 0


def test_running_waiting_and_the_lora_requests_info_follow_the_engine(workers):
    # One decode slot: a's request runs while b's waits for it.
    engine = mock_engine(max_slots=1, step_latency=0.02, adapters={"a": 8, "b": 16})
    server = workers(engine)
    stub = stub_for(server.address)
    url = metrics_url(server)
    slots = stub.Stats(pb.StatsRequest(), timeout=5).adapter_slots.total
    assert slots == 2  # MockEngine's max_loras
    running = stub.Generate(request(ids=[1], adapter="a", max_tokens=120))  # 2.4 s
    next(running)
    waiting = stub.Generate(request(ids=[2], adapter="b", max_tokens=3))
    before = time.time()

    def busy() -> Samples | None:
        page = scrape(url)
        infos = labelled(page, "vllm:lora_requests_info")
        lora = {"running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "2"}
        counts = (
            value(page, "vllm:num_requests_running", **VLLM),
            value(page, "vllm:num_requests_waiting", **VLLM),
        )
        return page if counts == (1, 1) and [labels for labels, _ in infos] == [lora] else None

    page = wait_until(busy, what="a running and b waiting")
    (_, stamp), *_ = labelled(page, "vllm:lora_requests_info")
    assert before - 1 <= stamp <= time.time()  # the snapshot's time, in epoch seconds
    assert 0 < value(page, "vllm:kv_cache_usage_perc", **VLLM) <= 1
    running.cancel()
    assert len(list(waiting)) == 3

    def settled() -> bool:
        stats = stub.Stats(pb.StatsRequest(), timeout=5)
        if stats.running or stats.queued:
            return False
        page = scrape(url)
        free, total = stats.memory.kv_blocks_free, stats.memory.kv_blocks_total
        # Idle: the adapters' pages are all the pool holds (the requests' KV is cached).
        usage = value(page, "vllm:kv_cache_usage_perc", **VLLM)
        infos = [labels for labels, _ in labelled(page, "vllm:lora_requests_info")]
        nothing = {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
        return usage == pytest.approx(1 - free / total) and infos == [nothing]

    wait_until(settled, what="the idle engine's metrics")


def test_the_lora_requests_info_keeps_only_the_newest_label_set():
    metrics = Metrics("m")
    registry = metrics.registry
    before = time.time()
    # Running: a (twice) and the base model; queued: b and a. Names are sorted, unique.
    metrics.observe_engine(
        engine_stats(
            running=(info("1", "a"), info("2", None), info("3", "a")),
            queued=(info("4", "b"), info("5", "a")),
            waiting=2,
        )
    )
    first = {"running_lora_adapters": "a", "waiting_lora_adapters": "a,b", "max_lora": "2"}
    stamp = registry.get_sample_value("vllm:lora_requests_info", first)
    assert stamp is not None and before <= stamp <= time.time()
    metrics.observe_engine(engine_stats())
    assert registry.get_sample_value("vllm:lora_requests_info", first) is None
    idle = {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    assert registry.get_sample_value("vllm:lora_requests_info", idle) >= stamp
    # An engine without adapter slots serves no adapters: no lora info, as in vLLM.
    base_only = Metrics("m")
    base_only.observe_engine(engine_stats(adapter_slots_total=0, adapter_slots_free=0))
    assert not [
        sample
        for family in base_only.registry.collect()
        if family.name == "vllm:lora_requests_info"
        for sample in family.samples
    ]


@pytest.mark.parametrize(
    "free, total, usage", [(12, 16, 0.25), (16, 16, 0.0), (0, 16, 1.0), (0, 0, 0.0)]
)
def test_the_kv_cache_usage_is_the_fraction_of_pool_pages_in_use(free, total, usage):
    metrics = Metrics("m")
    metrics.observe_engine(engine_stats(kv_blocks_total=total, kv_blocks_free=free))
    assert metrics.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "m"}) == (
        usage
    )


# -- the workers' metrics through the router ---------------------------------------------


def test_the_router_metrics_serve_each_workers_metrics_labelled(workers):
    first = workers(mock_engine(step_latency=0.002, adapters={"a": 8}))
    second = workers(mock_engine(step_latency=0.002, adapters={"a": 8}))
    silent = "127.0.0.1:1"  # a worker whose metrics URL leads nowhere (port 9: refused)
    worker_metrics = {
        first.address: metrics_url(first),
        second.address: metrics_url(second),
        silent: "http://127.0.0.1:9/metrics",
    }
    router = start_router(
        [first.address, second.address], poll_interval=0.1, worker_metrics=worker_metrics
    )
    try:
        for server, tokens in ((first, 3), (second, 5), (first, 2)):
            list(stub_for(server.address).Generate(request(ids=[1, 2], max_tokens=tokens)))
        url = f"http://127.0.0.1:{router.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            text = page.read().decode()
        # One family each, whichever workers report it (a valid exposition).
        assert text.count("# TYPE vllm:num_requests_waiting gauge") == 1
        routed = scrape(url)
        for server, tokens in ((first, 5), (second, 5)):
            own = scrape(metrics_url(server))
            where = {"worker": server.address}
            assert value(routed, "jlora_router_worker_metrics_up", **where) == 1
            generated = value(routed, "vllm:generation_tokens_total", **VLLM, **where)
            assert generated == value(own, "vllm:generation_tokens_total", **VLLM) == tokens
            assert value(routed, "jlora_requests_total", outcome="length", **where) == (
                value(own, "jlora_requests_total", outcome="length")
            )
            assert value(routed, "vllm:num_requests_waiting", **VLLM, **where) == 0
            (labels, stamp), *more = [
                (labels, v)
                for labels, v in labelled(routed, "vllm:lora_requests_info")
                if labels["worker"] == server.address
            ]
            assert not more and labels["max_lora"] == "2" and stamp > 0
        assert value(routed, "jlora_router_worker_metrics_up", worker=silent) == 0
        said = {name for name, labels in routed if ("worker", silent) in labels}
        assert said == {"jlora_router_worker_metrics_up"}
        assert "jlora_router_requests_total" in {name for name, _ in routed}  # its own too
    finally:
        router.stop(grace=0)


# -- the log ---------------------------------------------------------------------------


def test_each_request_that_ends_logs_one_line_with_its_numbers(workers, caplog):
    caplog.set_level(logging.INFO, logger="jlora.server.logs")
    server = workers(mock_engine(step_latency=0.005, adapters={"a": 8}))
    stub = stub_for(server.address)
    message = request(ids=[1, 2, 3], adapter="a", max_tokens=4, request_id="r-1")
    responses = list(stub.Generate(message))
    cancelled = stub.Generate(request(ids=[5], max_tokens=120, request_id="r-2"))
    next(cancelled)
    cancelled.cancel()

    def lines() -> dict[str, logging.LogRecord] | None:
        found = {
            record.request_id: record
            for record in caplog.records
            if record.name == "jlora.server.logs" and hasattr(record, "request_id")
        }
        return found if len(found) == 2 else None

    found = wait_until(lines, what="both requests' lines")
    line = found["r-1"]
    assert line.levelno == logging.INFO
    assert (line.adapter, line.prompt_tokens, line.cached_tokens) == ("a", 3, 0)
    assert (line.generation_tokens, line.finish_reason) == (4, "length")
    # The times the stream's tokens carried: the first token's and the last one's.
    assert line.ttft_s == pytest.approx(responses[0].timing.since_arrival_us / 1e6, abs=2e-6)
    assert line.e2e_s == pytest.approx(responses[-1].timing.since_arrival_us / 1e6, abs=2e-6)
    assert 0 < line.ttft_s < line.e2e_s
    assert re.fullmatch(
        r"request r-1 finished: adapter=a prompt_tokens=3 cached_tokens=0 "
        r"generation_tokens=4 ttft=\d+\.\d{3}s e2e=\d+\.\d{3}s finish_reason=length",
        line.getMessage(),
    )
    gone = found["r-2"]
    assert (gone.adapter, gone.prompt_tokens, gone.finish_reason) == (None, 1, "cancelled")
    assert gone.generation_tokens >= 1 and gone.ttft_s is not None


def test_the_throughput_line_comes_every_interval_while_busy(caplog):
    caplog.set_level(logging.INFO, logger="jlora.server.logs")
    metrics = Metrics("m")
    throughput = ThroughputLog(metrics, now=100.0, interval=10.0)
    busy = engine_stats(running=(info("1", "a"),), waiting=2, kv_blocks_free=12)
    metrics.prompt_accepted(50)
    metrics.tokens_streamed(200)
    assert not throughput.observe(busy, 105.0)  # not 10 s yet
    assert throughput.observe(busy, 110.0)
    (record,) = caplog.records
    assert record.getMessage() == (
        "Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%"
    )
    assert (record.prompt_throughput, record.generation_throughput) == (5.0, 20.0)
    assert (record.running, record.waiting, record.kv_cache_usage) == (1, 2, 0.25)
    metrics.tokens_streamed(30)  # the last tokens, then nothing runs
    assert throughput.observe(engine_stats(), 125.0)  # 30 tokens over 15 s
    assert caplog.records[-1].generation_throughput == 2.0
    assert caplog.records[-1].prompt_throughput == 0.0
    assert throughput.observe(engine_stats(), 135.0)  # once more after going idle: zeros
    assert caplog.records[-1].generation_throughput == 0.0
    assert not throughput.observe(engine_stats(), 145.0)  # idle twice: silent
    assert len(caplog.records) == 3


LOGGING_SCRIPT = """
import logging, sys, warnings
from jlora.cli.common import configure_logging
from jlora.server.logs import log_request
configure_logging(verbose=False, log_format=sys.argv[1])
logging.getLogger("jlora.elsewhere").info("not shown: the rest's INFO needs -v")
logging.getLogger("jlora.elsewhere").warning("shown: %d", 7)
log_request("r-1", adapter="a", prompt_tokens=3, cached_tokens=1, generation_tokens=4,
            ttft=0.0123, e2e=0.25, finish_reason="stop")
warnings.warn("careful")
"""


def _logged(log_format: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", LOGGING_SCRIPT, log_format],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_the_default_log_shows_the_request_line_as_text():
    warning, line, *warned = _logged("text")
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(rf"{stamp} WARNING jlora.elsewhere: shown: 7", warning)
    assert re.fullmatch(
        rf"{stamp} INFO jlora.server.logs: request r-1 finished: adapter=a prompt_tokens=3 "
        r"cached_tokens=1 generation_tokens=4 ttft=0.012s e2e=0.250s finish_reason=stop",
        line,
    )
    assert "careful" in "\n".join(warned)  # Python's own warning format, as before


def test_log_format_json_makes_every_line_one_object_with_the_fields_as_keys():
    warning, line, warned = (json.loads(text) for text in _logged("json"))
    assert set(warning) == {"time", "level", "logger", "message"}
    assert (warning["level"], warning["logger"], warning["message"]) == (
        "WARNING",
        "jlora.elsewhere",
        "shown: 7",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", warning["time"])
    assert line == {
        "time": line["time"],
        "level": "INFO",
        "logger": "jlora.server.logs",
        "message": "request r-1 finished: adapter=a prompt_tokens=3 cached_tokens=1 "
        "generation_tokens=4 ttft=0.012s e2e=0.250s finish_reason=stop",
        "request_id": "r-1",
        "adapter": "a",
        "prompt_tokens": 3,
        "cached_tokens": 1,
        "generation_tokens": 4,
        "ttft_s": 0.0123,
        "e2e_s": 0.25,
        "finish_reason": "stop",
    }
    assert (warned["level"], warned["logger"]) == ("WARNING", "py.warnings")
    assert "careful" in warned["message"]


@pytest.mark.parametrize("command", [["serve"], ["up"], ["router", "--workers", "h:1"]])
def test_serve_up_and_router_take_log_format(command, tmp_path, capsys):
    parser = build_parser()
    assert parser.parse_args(command).log_format == "text"
    args = parser.parse_args([*command, "--log-format", "json"])
    assert args.log_format == "json"
    if command == ["up"]:  # its workers log the same way, and serve their metrics
        args.state_dir = tmp_path
        worker = parser.parse_args(up._worker_command(args, None, 50099, 9123)[3:])
        assert (worker.log_format, worker.metrics_port) == ("json", 9123)
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--log-format", "xml"])
    assert "--log-format: invalid choice: 'xml'" in capsys.readouterr().err
