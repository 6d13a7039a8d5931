"""The prefix cache's and the memory pool's numbers on every surface: the gRPC usage and
Stats of a worker, the router's sums (across workers, and across the workers a migrated
request went through), OpenAI's usage, Prometheus, `jlora generate --output jsonl`, and
the cache flags of generate, serve and up.

The engines are MockEngine orchestrators made to report what a prefix cache would
(`report_hits`): a number of cached tokens on each request's prefill, and a fixed pool.
"""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest

from configs import EngineConfig
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.cli import up
from jlora.cli.common import PoolSize, cache_config, parse_pool_size
from jlora.cli.generate import Prompt, _run_batch
from jlora.cli.main import build_parser
from jlora.engine.api import CacheStats, SamplingParams
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine
from jlora.engine.orchestrator import Orchestrator
from jlora.server import convert, serve
from jlora.server.metrics import Metrics
from router.app import start_router
from router.openai_answers import usage
from tests.engine_helpers import engine_stats
from tests.test_openai_http import Deployment
from tests.test_router import stub_for, wait_for
from tests.test_router_migration import Client, assert_unmigrated_run
from tests.test_server import VOCAB, request

# 100 pages: 30 of KV (12 of them cached history only), 20 of adapters, 50 free.
POOL = CacheStats(
    policy="fastlibra",
    page_bytes=4096,
    pages_total=100,
    pages_kv=30,
    pages_kv_cached=12,
    pages_lora=20,
    host_bytes_used=8192,
    host_bytes_capacity=1 << 20,
    prompt_tokens=200,
    hit_tokens=50,
    swaps_out=7,
    swaps_in=3,
    swap_out_bytes=7 * 4096,
    swap_in_bytes=3 * 4096,
    invalid_kv_pages=1,
)


def report_hits(engine: Orchestrator, hits: int, pool: CacheStats | None = POOL) -> Orchestrator:
    """Make `engine` report `hits` cached tokens on each request's prefill (its first
    event on this engine; 0 on the others) and `pool` in its stats."""
    step, stats = engine.step, engine.stats
    prefilled: set[str] = set()

    def step_with_hits():
        events = []
        for event in step():
            first = event.error is None and event.request_id not in prefilled
            prefilled.add(event.request_id)
            events.append(dataclasses.replace(event, cached_tokens=hits if first else 0))
        return events

    engine.step = step_with_hits
    engine.stats = lambda: dataclasses.replace(stats(), cache=pool)
    return engine


def pool_message(cache: CacheStats) -> pb.CacheStats:
    return pb.CacheStats(**dataclasses.asdict(cache))


# -- gRPC: the proto and the worker ------------------------------------------------------


def test_the_new_fields_round_trip():
    last = pb.GenerateResponse(
        finish_reason=pb.FINISH_REASON_STOP,
        usage=pb.Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=8),
    )
    assert pb.GenerateResponse.FromString(last.SerializeToString()).usage.cached_tokens == 8
    stats = pb.StatsResponse(memory=pb.Memory(cache=pool_message(POOL)))
    parsed = pb.StatsResponse.FromString(stats.SerializeToString())
    assert parsed.memory.cache == pool_message(POOL) and parsed.memory.cache.swap_in_bytes == 12288
    assert not pb.StatsResponse().memory.HasField("cache")  # an engine with no pool
    migrated = pb.MigrateResponse(request_id="r", cached_tokens=5)
    assert pb.MigrateResponse.FromString(migrated.SerializeToString()).cached_tokens == 5


def test_the_stats_message_carries_the_pool_when_the_engine_has_one():
    with_pool = convert.stats_message(engine_stats(cache=POOL), max_queue=4, draining=False)
    assert with_pool.memory.cache == pool_message(POOL)
    without = convert.stats_message(engine_stats(cache=None), max_queue=4, draining=False)
    assert not without.memory.HasField("cache")


@pytest.fixture
def servers():
    started = []

    def start(engine: Orchestrator):
        server = serve(engine, tokenizer=engine.tokenizer, model_name="smol", max_queue=8)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=0)


def test_the_worker_usage_counts_the_prefills_cache_hits(servers):
    worker = servers(report_hits(mock_engine(adapters={"a": 8}), 3))
    stub = pb_grpc.JloraStub(grpc.insecure_channel(worker.address))
    responses = list(stub.Generate(request(ids=[1, 2, 3, 4], adapter="a", max_tokens=5)))
    *tokens, last = responses
    assert [r.token_id for r in responses] == mock_completion([1, 2, 3, 4], "a", 5, VOCAB)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 5)
    assert last.usage.cached_tokens == 3
    assert not any(r.HasField("usage") for r in tokens)
    assert stub.Stats(pb.StatsRequest(), timeout=5).memory.cache == pool_message(POOL)


def test_the_router_adds_up_the_hits_of_a_migrated_requests_workers(servers):
    # The two workers report different hits, so a sum tells itself from either part.
    workers = [
        servers(report_hits(mock_engine(step_latency=0.01, adapters={"a": 8}), hits))
        for hits in (3, 5)
    ]
    router = start_router([w.address for w in workers], poll_interval=0.05, http_port=0)
    try:
        client = Client(router)
        prompt, total = [4, 2], 60
        client.send("r", ids=prompt, adapter="a", max_tokens=total)
        wait_for(lambda: len(client.tokens["r"]) >= 5, what="the first tokens")
        call = next(c for c in router.front.calls if c.request_id == "r")
        source = call.worker
        target = next(w for w in router.front.pool.workers if w is not source)
        reply = router._run(router.front.migrate("r", target))
        assert reply is not None
        client.join()
        assert_unmigrated_run(client, {"r": (prompt, "a", total)})
        source_hits = 3 if source.address == workers[0].address else 5
        assert reply.cached_tokens == source_hits
        assert client.last["r"].usage.cached_tokens == 3 + 5
        # Stats: the router's view sums the workers' pools.
        stub = stub_for(router.address)
        wait_for(lambda: stub.Stats(pb.StatsRequest()).memory.cache.pages_total == 200)
        summed = stub.Stats(pb.StatsRequest()).memory.cache
        assert (summed.policy, summed.page_bytes) == ("fastlibra", 4096)
        assert (summed.pages_kv, summed.hit_tokens, summed.swaps_out) == (60, 100, 14)
    finally:
        router.stop(grace=0)


# -- HTTP --------------------------------------------------------------------------------


def test_openai_usage_has_the_cached_tokens():
    last = pb.GenerateResponse(
        usage=pb.Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=4)
    )
    assert usage([last]) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@pytest.fixture(scope="module")
def deployment():
    deployment = Deployment(poll_interval=0.1)
    for engine in deployment.engines:
        report_hits(engine, 4)
    yield deployment
    deployment.close()


def test_completions_report_cached_tokens(deployment):
    reply = deployment.client.completions.create(model="a", prompt="Hello", max_tokens=3)
    assert reply.usage.prompt_tokens == 5
    assert reply.usage.prompt_tokens_details.cached_tokens == 4
    streamed = list(
        deployment.client.completions.create(
            model="smol",
            prompt=[3, 4, 5],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 4
    assert all(chunk.usage is None for chunk in streamed[:-1])


def test_chat_completions_report_cached_tokens(deployment):
    messages = [{"role": "user", "content": "Hi"}]
    reply = deployment.client.chat.completions.create(model="smol", messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 4
    *_, usage_chunk = deployment.client.chat.completions.create(
        model="b",
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 4


# -- Prometheus --------------------------------------------------------------------------


def test_the_pool_and_prefix_cache_metrics_follow_the_engine_stats():
    metrics = Metrics()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    metrics.observe_engine(engine_stats(cache=None))
    assert value("jlora_pool_page_bytes") == 0  # no pool: nothing reported
    assert value("jlora_pool_pages", kind="free") is None
    metrics.observe_engine(engine_stats(cache=POOL))
    # The kinds partition the 100 pages: 30 KV of which 12 cached, 20 adapters, 50 free.
    pages = {kind: value("jlora_pool_pages", kind=kind) for kind in ("kv", "kv_cached", "lora")}
    assert pages == {"kv": 18, "kv_cached": 12, "lora": 20}
    assert value("jlora_pool_pages", kind="free") == 50
    assert value("jlora_pool_page_bytes") == 4096
    assert value("jlora_host_pool_bytes_used") == 8192
    assert value("jlora_host_pool_bytes_capacity") == 1 << 20
    assert value("jlora_prefix_cache_hit_rate") == 0.25  # 50 of 200
    assert value("jlora_prefix_cache_prompt_tokens_total") == 200
    assert value("jlora_prefix_cache_hit_tokens_total") == 50
    assert value("jlora_pool_swaps_total", direction="out") == 7
    assert value("jlora_pool_swaps_total", direction="in") == 3
    assert value("jlora_pool_swap_bytes_total", direction="out") == 7 * 4096
    assert value("jlora_pool_swap_bytes_total", direction="in") == 3 * 4096
    assert value("jlora_invalid_kv_pages") == 1
    # The engine's counts are cumulative: the counters follow them, never backwards.
    later = dataclasses.replace(POOL, prompt_tokens=300, hit_tokens=150, swaps_in=5)
    metrics.observe_engine(engine_stats(cache=later))
    assert value("jlora_prefix_cache_prompt_tokens_total") == 300
    assert value("jlora_prefix_cache_hit_tokens_total") == 150
    assert value("jlora_pool_swaps_total", direction="in") == 5
    assert value("jlora_prefix_cache_hit_rate") == 0.5
    metrics.observe_engine(engine_stats(cache=POOL))  # an older snapshot
    assert value("jlora_prefix_cache_prompt_tokens_total") == 300


def test_the_adapter_wait_counter_follows_the_engine_stats():
    metrics = Metrics()
    for seconds in (0.0, 1.5, 2.25, 2.0):  # the last: an older snapshot
        metrics.observe_engine(
            dataclasses.replace(engine_stats(cache=None), adapter_wait_s=seconds)
        )
    assert metrics.registry.get_sample_value("jlora_adapter_load_wait_seconds_total") == 2.25


# -- CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [
        ("512MiB", PoolSize(pool_bytes=512 * 2**20)),
        ("2GiB", PoolSize(pool_bytes=2 * 2**30)),
        ("2gib", PoolSize(pool_bytes=2 * 2**30)),
        ("1.5GB", PoolSize(pool_bytes=1_500_000_000)),
        ("64 KiB", PoolSize(pool_bytes=65536)),
        ("1048576", PoolSize(pool_bytes=1048576)),
        ("0.8", PoolSize(pool_fraction=0.8)),
        (".5", PoolSize(pool_fraction=0.5)),
    ],
)
def test_pool_sizes_parse_and_print_back(text, size):
    assert parse_pool_size(text) == size
    assert parse_pool_size(str(size)) == size  # what `jlora up` passes on


@pytest.mark.parametrize("command", ["generate", "serve", "up"])
def test_the_cache_flags_parse_into_the_engine_config(command):
    parser = build_parser()
    defaults = cache_config(parser.parse_args([command]))
    assert defaults == {
        "cache_policy": "fastlibra",
        "kv_allocation": "lazy",
        "pool_bytes": 0,
        "pool_fraction": 0.0,
        "host_pool_mib": 1024,
        "prefill_token_budget": 512,
    }
    given = ["--cache-policy", "lru", "--pool-size", "2GiB", "--host-pool-mib", "64"]
    given += ["--kv-allocation", "upfront", "--prefill-token-budget", "128"]
    fields = cache_config(parser.parse_args([command, *given]))
    config = EngineConfig(**fields)
    assert (config.cache_policy, config.pool_bytes, config.host_pool_mib) == ("lru", 2**31, 64)
    assert (config.kv_allocation, config.prefill_token_budget) == ("upfront", 128)
    fraction = cache_config(parser.parse_args([command, "--pool-size", "0.8"]))
    assert EngineConfig(**fraction).pool_fraction == 0.8


@pytest.mark.parametrize("command", ["generate", "serve", "up"])
@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--pool-size", "1.5"], ["--pool-size", "'1.5'", "below 1"]),
        (["--pool-size", "2XB"], ["--pool-size", "unknown unit 'XB'", "GiB"]),
        (["--pool-size=-1GiB"], ["--pool-size", "'-1GiB'", "expected bytes"]),
        (["--pool-size", "0"], ["--pool-size", "at least one byte"]),
        (["--host-pool-mib", "-1"], ["--host-pool-mib", "must be >= 0"]),
        (["--host-pool-mib", "lots"], ["--host-pool-mib", "'lots'"]),
        (["--cache-policy", "fifo"], ["--cache-policy", "invalid choice: 'fifo'"]),
        (["--kv-allocation", "eager"], ["--kv-allocation", "invalid choice: 'eager'"]),
        (["--prefill-token-budget", "8"], ["--prefill-token-budget", "at least 16"]),
        (["--prefill-token-budget", "all"], ["--prefill-token-budget", "'all'"]),
    ],
)
def test_bad_cache_flags_exit_2_naming_the_flag(capsys, command, flags, fragments):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, *flags])
    assert exited.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f"jlora {command}: error: argument ")
    for fragment in fragments:
        assert fragment in last_line


@pytest.mark.parametrize("pool_size", [None, "1.5GB", "0.8"])
def test_up_passes_the_cache_flags_to_its_workers(tmp_path, pool_size):
    parser = build_parser()
    given = ["--cache-policy", "none", "--host-pool-mib", "0", "--kv-allocation", "upfront"]
    given += ["--prefill-token-budget", "64"]
    given += ["--pool-size", pool_size] if pool_size else []
    args = parser.parse_args(["up", "--state-dir", str(tmp_path), *given])
    command = up._worker_command(args, None, 50099)
    assert command[3] == "serve"
    worker = parser.parse_args(command[3:])
    assert cache_config(worker) == cache_config(args)
    assert cache_config(worker)["cache_policy"] == "none"


def test_generate_jsonl_has_each_requests_cached_tokens(capsys):
    engine = report_hits(mock_engine(), 2)
    encode = MockTokenizer().encode
    sampling = SamplingParams(max_tokens=3)
    prompts = [Prompt("Hello", None, sampling), Prompt("Hi", None, sampling)]
    try:
        status = _run_batch(engine, encode, prompts, {}, "jsonl", stream=False)
    finally:
        engine.close()
    assert status == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "Hi"]
    assert [line["cached_tokens"] for line in lines] == [2, 2]
    assert [len(line["token_ids"]) for line in lines] == [3, 3]


@pytest.mark.parametrize("command", ["generate", "serve", "up"])
def test_the_cache_flags_are_explained_in_the_help(capsys, command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for fragment in (
        "--cache-policy {fastlibra,lru,none}",
        "FastLibra's unified pool",
        "vLLM's static share",
        "S-LoRA's unified pool with no history KV",
        "--pool-size SIZE",
        "512MiB",
        "--host-pool-mib N",
        "--kv-allocation {lazy,upfront}",
        "the newest is preempted",
        "--prefill-token-budget N",
        "chunked prefill",
    ):
        assert fragment in help_text
