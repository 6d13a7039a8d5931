"""The orchestrator over the mock device engine: batching, admission, stop rules, adapter
bookkeeping, failures that stay with their request, and requests that move.

The mock's tokens are a pure function (`mock_next_token`), so every stream is known in
advance whatever shares the batch; everything else here is the real orchestrator, the
one the server and the router tests run too.
"""

from __future__ import annotations

import threading
import time

import pytest

from jlora.contract.errors import Code, RequestError
from jlora.engine.api import DEVICE, HOST, Request, SamplingParams
from jlora.engine.mock import (
    MockEngine,
    MockTokenizer,
    mock_adapter_dir,
    mock_completion,
    mock_engine,
    mock_next_token,
    write_adapter_config,
)
from jlora.engine.orchestrator import Orchestrator
from tests.engine_helpers import run_to_completion, step_until

VOCAB = 1000  # MockEngine's default vocab_size


def test_token_function_is_pure_and_depends_on_each_input():
    assert mock_next_token(5, None, 0, VOCAB) == mock_next_token(5, None, 0, VOCAB)
    outputs = {
        mock_next_token(5, None, 0, VOCAB),
        mock_next_token(6, None, 0, VOCAB),
        mock_next_token(5, "a", 0, VOCAB),
        mock_next_token(5, None, 1, VOCAB),
    }
    assert len(outputs) == 4
    assert mock_completion([1, 2, 5], "a", 3, VOCAB)[0] == mock_next_token(5, "a", 0, VOCAB)


def test_streams_match_mock_completion_whatever_the_batch():
    engine = mock_engine(max_slots=2, adapters={"a": 8, "b": 16})
    prompts = [[1, 2, 3], [4], [7, 7], [9, 8, 7, 6], [3]]
    adapters = [None, "a", "b", "a", None]
    results = run_to_completion(engine, prompts, SamplingParams(max_tokens=6), adapters)
    for prompt, adapter, result in zip(prompts, adapters, results, strict=True):
        assert result["token_ids"] == mock_completion(prompt, adapter, 6, VOCAB)
        assert result["finish_reason"] == "length"
        assert result["text"] == MockTokenizer().decode(result["token_ids"])
    assert not engine.has_unfinished
    assert engine.memory.held_pages() == 0


def test_max_slots_bound_the_running_batch_and_admission_gives_two_tokens():
    engine = mock_engine(max_slots=2)
    for i in range(5):
        engine.add_request(Request(f"r{i}", [i + 1], SamplingParams(max_tokens=3)))
    first = engine.step()
    # r0 and r1 are admitted: each prefill token plus one decode token in the same step.
    assert [e.request_id for e in first] == ["r0", "r1", "r0", "r1"]
    peak = engine.num_running
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, engine.num_running)
    assert peak == 2


def test_upfront_kv_blocks_bound_admission():
    # 2 blocks of 16 tokens: a 20-token sequence takes both up front, so the second waits.
    engine = mock_engine(max_slots=2, max_seq_len=32, num_blocks=2, kv_allocation="upfront")
    engine.add_request(Request("big", [1] * 10, SamplingParams(max_tokens=10)))
    engine.add_request(Request("next", [1], SamplingParams(max_tokens=2)))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.memory.pool.num_free == 0
    step_until(engine, lambda: not engine.has_unfinished)
    assert engine.stats().preemptions == 0


def test_length_stops_at_max_seq_len():
    engine = mock_engine(max_seq_len=16)
    [result] = run_to_completion(engine, [[1] * 10], SamplingParams(max_tokens=100))
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"


def test_eos_and_stop_strings_finish_with_stop():
    expected = mock_completion([3], None, 10, VOCAB)
    engine = mock_engine(eos_id=expected[3])
    [eos] = run_to_completion(engine, [[3]], SamplingParams(max_tokens=10))
    assert eos["token_ids"] == expected[:4] and eos["finish_reason"] == "stop"
    [ignored] = run_to_completion(engine, [[3]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert ignored["token_ids"] == expected and ignored["finish_reason"] == "length"
    stop = f"t{expected[2]}"  # token 2 reads " t<id>"
    [cut] = run_to_completion(mock_engine(), [[3]], SamplingParams(max_tokens=10, stop=(stop,)))
    assert cut["finish_reason"] == "stop" and len(cut["token_ids"]) == 3
    assert cut["text"] == f" t{expected[0]} t{expected[1]} "


@pytest.mark.parametrize(
    "request_, code, field, names",
    [
        (Request("r", [1], adapter="nope"), Code.NOT_FOUND, "adapter", "adapter='nope'"),
        (Request("r", []), Code.INVALID_ARGUMENT, "prompt", "prompt is empty"),
        (Request("r", [1] * 64), Code.INVALID_ARGUMENT, "prompt", "max_seq_len"),
        (Request("r", [1, 1000]), Code.INVALID_ARGUMENT, "prompt", "prompt_ids[1]"),
        (Request("r", [-1]), Code.INVALID_ARGUMENT, "prompt", "prompt_ids[0]"),
    ],
)
def test_invalid_requests_change_nothing(request_, code, field, names):
    engine = mock_engine(max_seq_len=64)
    with pytest.raises(RequestError) as caught:
        engine.add_request(request_)
    assert (caught.value.code, caught.value.field) == (code, field)
    assert names in caught.value.message
    assert not engine.has_unfinished
    engine.add_request(Request("r", [1]))  # the id is still free
    with pytest.raises(RequestError) as caught:
        engine.add_request(Request("r", [1]))
    assert (caught.value.code, caught.value.field) == (Code.ALREADY_EXISTS, "request_id")


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("seed", 2**32)],
)
def test_sampling_errors_name_their_field(field, value):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})
    assert (caught.value.code, caught.value.field) == (Code.INVALID_ARGUMENT, f"sampling.{field}")
    assert f"{field}={value!r}" in caught.value.message


def test_abort_frees_the_slot_and_blocks_of_running_and_queued_requests():
    engine = mock_engine(max_slots=1)
    engine.add_request(Request("running", [1], SamplingParams(max_tokens=50)))
    engine.add_request(Request("queued", [1], SamplingParams(max_tokens=50)))
    engine.step()
    assert engine.num_running == 1 and engine.memory.held_pages() > 0
    assert engine.abort("queued") and engine.abort("running")
    assert not engine.abort("running")
    assert not engine.has_unfinished and engine.memory.held_pages() == 0
    assert engine.stats().running == () and engine.step() == []


def test_step_latency_is_spent_only_when_there_is_work():
    device = MockEngine(step_latency=0.05)
    engine = Orchestrator(device)
    start = time.perf_counter()
    assert engine.step() == [] and device.steps == 0
    assert time.perf_counter() - start < 0.05
    engine.add_request(Request("r", [1], SamplingParams(max_tokens=3)))
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    assert device.steps == 2  # prefill + decode, then decode
    assert time.perf_counter() - start >= 0.1


def test_adapter_slots_lru_eviction_holds_and_pins():
    engine = mock_engine(max_slots=4, max_loras=1, adapters={"a": 4, "b": 8})
    engine.add_request(Request("ra", [1], SamplingParams(max_tokens=30), adapter="a"))
    engine.add_request(Request("rb", [1], SamplingParams(max_tokens=3), adapter="b"))
    step_until(engine, lambda: engine.num_running == 1)
    # "a" holds the only slot while ra runs, so rb waits.
    assert [r.request_id for r in engine.stats().running] == ["ra"] and engine.num_waiting == 1
    with pytest.raises(RequestError, match="running") as caught:
        engine.unload_adapter("a")
    assert caught.value.code == Code.FAILED_PRECONDITION
    while engine.has_unfinished:
        engine.step()
    stats = engine.stats()
    assert (stats.adapter_loads, stats.adapter_evictions) == (2, 1)
    infos = {info.adapter.name: info for info in engine.adapter_infos()}
    assert (infos["a"].state, infos["b"].state, infos["b"].slot) == (HOST, DEVICE, 0)
    engine.load_adapter("a", pin=True)  # evicts idle "b"
    with pytest.raises(RequestError, match="max_loras=1") as caught:
        engine.load_adapter("b")  # "a" is pinned
    assert caught.value.code == Code.FAILED_PRECONDITION
    engine.unload_adapter("a")
    assert engine.adapter_infos()[0].state == HOST and not engine.adapter_infos()[0].pinned


def test_the_time_queued_requests_wait_for_their_adapter_is_counted():
    """ra waits for its adapter's load; rc (the base model) for nothing; rb for the only
    slot, which ra's adapter holds until ra finishes."""
    engine = mock_engine(max_slots=3, max_loras=1, step_latency=0.005, adapters={"a": 4, "b": 8})
    engine.add_request(Request("ra", [1], SamplingParams(max_tokens=20), adapter="a"))
    step_until(engine, lambda: engine.num_running == 1)
    loading = engine.stats().adapter_wait_s
    engine.add_request(Request("rc", [2], SamplingParams(max_tokens=3)))
    step_until(engine, lambda: engine.num_running == 2)
    assert engine.stats().adapter_wait_s == loading
    queued = time.monotonic()
    engine.add_request(Request("rb", [1], SamplingParams(max_tokens=3), adapter="b"))
    step_until(engine, lambda: "rb" in {r.request_id for r in engine.stats().running})
    waited = engine.stats().adapter_wait_s - loading
    assert 0.02 < waited <= time.monotonic() - queued  # ra's ~18 more steps of 5 ms


def test_register_and_unregister(tmp_path):
    engine = mock_engine()
    info = engine.register_adapter("mine", write_adapter_config(tmp_path / "mine", rank=16))
    adapter = info.adapter
    assert (adapter.rank, adapter.alpha, adapter.targets) == (16, 32.0, ("q_proj", "v_proj"))
    refusals = [
        ("mine", tmp_path / "mine", Code.ALREADY_EXISTS, "name", "already registered"),
        ("../x", tmp_path / "mine", Code.INVALID_ARGUMENT, "name", "name='../x'"),
        ("a b", tmp_path / "mine", Code.INVALID_ARGUMENT, "name", "name='a b'"),
        ("org//x", tmp_path / "mine", Code.INVALID_ARGUMENT, "name", "segments"),
        (
            "bad",
            write_adapter_config(tmp_path / "bad", rank=0),
            Code.INVALID_ARGUMENT,
            "path",
            "r=",
        ),
        (
            "big",
            write_adapter_config(tmp_path / "big", rank=128),
            Code.INVALID_ARGUMENT,
            "path",
            "max_lora_rank",
        ),
    ]
    for name, path, code, field, names in refusals:
        with pytest.raises(RequestError) as caught:
            engine.register_adapter(name, path)
        assert (caught.value.code, caught.value.field) == (code, field), name
        assert names in caught.value.message
    tagged = engine.register_adapter("org/c-lora:v2", tmp_path / "mine")
    assert tagged.adapter.name == "org/c-lora:v2"
    engine.add_request(Request("r", [1], adapter="mine"))
    with pytest.raises(RequestError, match="named by 1") as caught:
        engine.unregister_adapter("mine")
    assert caught.value.code == Code.FAILED_PRECONDITION
    engine.abort("r")
    engine.unregister_adapter("mine")
    assert [info.adapter.name for info in engine.adapter_infos()] == ["org/c-lora:v2"]
    with pytest.raises(RequestError, match="not registered") as caught:
        engine.unregister_adapter("mine")
    assert caught.value.code == Code.NOT_FOUND


def test_a_failed_load_fails_only_the_requests_of_that_adapter():
    engine = mock_engine(max_slots=4, adapters={"good": 8, "bad": 8}, fail_loads={"bad"})
    prompts = [[1], [2], [3], [4], [5]]
    adapters = [None, "bad", "good", "bad", "good"]
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=5), adapter=adapter))
    results: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for event in engine.step():
            results[event.request_id].append(event)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        events = results[f"r{i}"]
        if adapter == "bad":
            [failed] = events  # no token, then the error
            assert (failed.finish_reason, failed.token_id) == ("error", -1)
            assert failed.error.reason == "ADAPTER_LOAD_FAILED"
            assert "'bad' could not be loaded" in failed.error.message
        else:
            assert [e.token_id for e in events] == mock_completion(prompt, adapter, 5, VOCAB)
    stats = engine.stats()
    assert stats.running == () and engine.memory.held_pages() == 0
    assert {i.adapter.name: i.state for i in engine.adapter_infos()} == {
        "good": DEVICE,
        "bad": HOST,
    }
    [again] = run_to_completion(engine, [[9]], SamplingParams(max_tokens=3), ["good"])
    assert again["token_ids"] == mock_completion([9], "good", 3, VOCAB)


@pytest.mark.parametrize("where", ["queued", "running"])
def test_an_exported_request_resumes_elsewhere_with_the_same_tokens(where):
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    expected = mock_completion([5, 6], "a", 12, VOCAB)
    first = mock_engine(max_slots=1, adapters={"a": 8})
    first.add_request(Request("blocker", [1], SamplingParams(max_tokens=40)))
    first.add_request(Request("moving", [5, 6], sampling, adapter="a"))
    streamed = []
    if where == "running":
        first.abort("blocker")
        for _ in range(6):
            streamed += [e.token_id for e in first.step() if e.request_id == "moving"]
    state = first.export("moving")
    assert list(state.generated) == streamed and state.seed == 7
    assert not any(r.request_id == "moving" for r in first.stats().running)
    with pytest.raises(RequestError) as caught:
        first.export("moving")
    assert caught.value.code == Code.NOT_FOUND
    second = mock_engine(adapters={"a": 8})
    second.resume(state)
    while second.has_unfinished:
        streamed += [e.token_id for e in second.step()]
    assert streamed == expected


def test_staging_runs_on_another_thread_while_the_engine_steps(tmp_path):
    """Registration's slow half (validate, hash, copy) may run beside the steps; only
    the commit runs on the stepping thread."""
    engine = mock_engine(step_latency=0.002)
    engine.add_request(Request("r", [1], SamplingParams(max_tokens=200)))
    path = write_adapter_config(tmp_path / "late", rank=4)
    staged = []
    stager = threading.Thread(target=lambda: staged.append(engine.stage_adapter("late", path)))
    stager.start()
    while stager.is_alive():
        engine.step()
    with pytest.raises(RequestError) as caught:
        engine.stage_adapter("late", path)  # the name is taken from staging on
    assert caught.value.code == Code.ALREADY_EXISTS
    assert "late" not in [i.adapter.name for i in engine.adapter_infos()]  # not committed yet
    engine.commit_adapter(staged[0])
    assert "late" in [i.adapter.name for i in engine.adapter_infos()]
    assert engine.has_unfinished and engine.abort("r")


def test_mock_adapter_dirs_are_shared_and_complete():
    path = mock_adapter_dir(8)
    assert path == mock_adapter_dir(8) and (path / "adapter_config.json").is_file()
