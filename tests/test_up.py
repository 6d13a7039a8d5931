"""`jlora up` end to end: real worker processes with the real engine behind the router.

cpu-tiny: two workers, concurrent mixed-adapter streams through the router equal what
one worker gives directly; the router's /metrics shows each worker's vllm:* metrics,
and `--log-format json` makes the log JSON, with the workers' line per request.
SmolLM2 (slow): one worker and the official `openai` client, chat and completions,
streaming and not, on the base model and a demo adapter, behind an API key (401
without it).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.lib.processes import ServerProcess
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.cli.up import LISTENING

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

# A line of --log-format text (jlora.cli.common.TEXT_LOG_FORMAT).
TEXT_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


class Up(ServerProcess):
    """A `jlora up` process, its stderr in `log`; `.grpc` and `.http` are where its router
    listens. Its workers compile what the test's requests need, when they need it
    (`--warmup on-demand`)."""

    def __init__(self, state_dir: Path, *args: str) -> None:
        super().__init__(
            [sys.executable, "-m", "jlora.cli.main", "up", "--port", "0", "--http-port", "0",
             "--state-dir", str(state_dir), "--warmup", "on-demand", *args],
            LISTENING, stdout="inherit", stderr="log", start_timeout_s=600,
        )  # fmt: skip
        self.grpc, self.http, workers = self.groups
        self.workers = workers.split(", ")

    def stop(self, timeout: float = 120.0, *, group: bool = True) -> int:
        """SIGTERM to the whole process group at once (SIGKILL after `timeout` s)."""
        return super().stop(timeout, group=group)


def _generate(address: str, ids: list[int], adapter: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.JloraStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            adapter=adapter,
            sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True),
        )
        return [r.token_id for r in stub.Generate(request, timeout=120)]


def test_two_real_workers_behind_the_router_give_the_direct_tokens(tmp_path):
    up = Up(tmp_path, "--model", "cpu-tiny", "--workers", "2", "--max-seq-len", "64",
            "--max-slots", "4")  # fmt: skip
    try:
        assert len(up.workers) == 2
        with grpc.insecure_channel(up.grpc) as channel:
            models = [m.id for m in pb_grpc.JloraStub(channel).Models(pb.ModelsRequest()).models]
        adapters = [m for m in models if m.startswith("demo-")]
        assert len(adapters) == 3
        jobs = [([3, 1, 4, 1, 5, 9][: 2 + i % 5], ["", *adapters][i % 4]) for i in range(8)]
        routed: dict[int, list[int]] = {}

        def call(i: int) -> None:
            routed[i] = _generate(up.grpc, *jobs[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(jobs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        worker = up.workers[0]  # one worker, asked directly
        for i, (ids, adapter) in enumerate(jobs):
            assert routed[i] == _generate(worker, ids, adapter), (ids, adapter)
        assert len({tuple(tokens) for tokens in routed.values()}) > 1  # adapters matter
    finally:
        assert up.stop() == 0


def _scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=30) as page:
        text = page.read().decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_the_routers_metrics_show_every_worker_and_the_log_is_json(tmp_path):
    up = Up(tmp_path, "--model", "cpu-tiny", "--workers", "2", "--max-seq-len", "64",
            "--max-slots", "4", "--log-format", "json")  # fmt: skip
    try:
        with grpc.insecure_channel(up.grpc) as channel:
            stub = pb_grpc.JloraStub(channel)
            adapters = [m.id for m in stub.Models(pb.ModelsRequest()).models][1:]
            jobs = {
                f"obs-{i}": ([3, 1, 4, 1, 5][: 1 + i], ["", *adapters][i % 4]) for i in range(5)
            }
            for request_id, (ids, adapter) in jobs.items():
                request = pb.GenerateRequest(
                    request_id=request_id,
                    token_ids=pb.TokenIds(ids=ids),
                    adapter=adapter,
                    sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True),
                )
                assert len(list(stub.Generate(request, timeout=120))) == 6
        # One scrape target: the router's /metrics, each worker's metrics labelled.
        samples = _scrape(up.http.removesuffix("/v1") + "/metrics")

        def per_worker(name: str, **labels: str) -> dict[str, float]:
            return {
                found["worker"]: value
                for sample, found, value in samples
                if sample == name and labels.items() <= found.items()
            }

        model = {"model_name": "cpu-tiny"}
        assert set(per_worker("vllm:num_requests_waiting", **model)) == set(up.workers)
        assert set(per_worker("vllm:num_requests_running", **model).values()) == {0}
        assert set(per_worker("jlora_router_worker_metrics_up").values()) == {1}
        # Every token and prompt token, counted once, on the worker that served it.
        assert sum(per_worker("vllm:generation_tokens_total", **model).values()) == 5 * 6
        prompts = sum(len(ids) for ids, _ in jobs.values())
        assert sum(per_worker("vllm:prompt_tokens_total", **model).values()) == prompts
        assert sum(per_worker("vllm:e2e_request_latency_seconds_count", **model).values()) == 5
        for worker in up.workers:
            with grpc.insecure_channel(worker) as channel:
                stats = pb_grpc.JloraStub(channel).Stats(pb.StatsRequest(), timeout=30)
            (labels,) = [
                found
                for sample, found, _ in samples
                if sample == "vllm:lora_requests_info" and found["worker"] == worker
            ]
            assert labels == {
                "running_lora_adapters": "",
                "waiting_lora_adapters": "",
                "max_lora": str(stats.adapter_slots.total),
                "worker": worker,
            }
        # The log: every logging line one JSON object, the workers' one per request.
        logged = [json.loads(line) for line in up.log if line.startswith("{")]
        assert not [line for line in up.log if TEXT_LOG_LINE.match(line)]
        finished = {line["request_id"]: line for line in logged if "request_id" in line}
        assert set(finished) == set(jobs)
        for request_id, (ids, adapter) in jobs.items():
            line = finished[request_id]
            assert (line["level"], line["logger"]) == ("INFO", "jlora.server.logs")
            assert (line["prompt_tokens"], line["generation_tokens"]) == (len(ids), 6)
            assert (line["adapter"], line["finish_reason"]) == (adapter or None, "length")
            assert 0 < line["ttft_s"] <= line["e2e_s"]
    finally:
        assert up.stop() == 0


@pytest.mark.slow
def test_smollm2_through_the_openai_client(tmp_path):
    up = Up(tmp_path, "--max-seq-len", "256", "--max-slots", "2", "--api-key", "s3cret")
    try:
        client = openai.OpenAI(base_url=up.http, api_key="s3cret", max_retries=0)
        stranger = openai.OpenAI(base_url=up.http, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        names = [model.id for model in client.models.list().data]
        assert names[0] == "smollm2-135m" and len(names) == 4
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(
            model="smollm2-135m", messages=question, max_tokens=20
        )
        assert "Paris" in answer.choices[0].message.content
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="smollm2-135m", messages=question, max_tokens=20, stream=True
            )
            if chunk.choices
        )
        assert streamed == answer.choices[0].message.content
        adapted = client.completions.create(
            model=names[1], prompt="The capital of France is", max_tokens=12
        )
        base = client.completions.create(
            model="smollm2-135m", prompt="The capital of France is", max_tokens=12
        )
        assert adapted.usage.completion_tokens == 12
        assert adapted.choices[0].text != base.choices[0].text  # the adapter changes it
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=4)
    finally:
        assert up.stop() == 0


def test_n_choices_share_one_prefill_and_a_seed_repeats_them(tmp_path):
    """cpu-tiny, two workers, sampling at temperature 1: n=4 choices of a 40-token prompt
    run on one worker, whose prefix cache serves the three later ones the prompt's
    full blocks (the router's /metrics shows the workers' hits); the same seed gives the
    same four choices, and best_of=4 with n=2 returns the two of them whose tokens are
    the most likely."""
    up = Up(tmp_path, "--model", "cpu-tiny", "--workers", "2", "--max-seq-len", "64")
    try:
        client = openai.OpenAI(base_url=up.http, api_key="unused", max_retries=0)
        prompt = list(range(3, 43))
        ask = dict(model="cpu-tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=11,
                   logprobs=0)  # fmt: skip
        # cpu-tiny has no tokenizer (no text): a choice is told by its tokens' logprobs
        # (to 1e-3: a batch's arithmetic moves them by 1e-6)
        told = lambda c: tuple(round(x, 3) for x in c.logprobs.token_logprobs)  # noqa: E731
        first = client.completions.create(n=4, **ask)
        again = client.completions.create(n=4, **ask)
        choices = [told(c) for c in first.choices]
        assert choices == [told(c) for c in again.choices] and len(set(choices)) == 4
        deadline = time.monotonic() + 30  # the workers' counters follow their engines'
        while (hits := _prefix_hits(up)) < 2 * 3 * 32 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hits >= 2 * 3 * 32  # two requests, three later choices, two 16-token blocks each
        score = lambda c: sum(c.logprobs.token_logprobs)  # noqa: E731
        best = client.completions.create(n=2, best_of=4, **ask)
        ranked = sorted(first.choices, key=score, reverse=True)[:2]
        assert sorted(map(told, best.choices)) == sorted(map(told, ranked))
        assert best.usage.completion_tokens == 4 * 6
        client.close()
    finally:
        up.stop()


def _prefix_hits(up: Up) -> float:
    """The prompt tokens the workers' prefix caches served, through the router's /metrics."""
    url = up.http.removesuffix("/v1") + "/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "jlora_prefix_cache_hit_tokens"
        for sample in family.samples
        if sample.name.endswith("_total")
    )
