"""MockEngine: the engine's bookkeeping (slots, blocks, adapters, stop rules) around a pure
token function, so the server tests can predict every stream."""

from __future__ import annotations

import json
import time

import pytest

from jlora.adapters.peft import AdapterError
from jlora.engine.api import (
    DEVICE,
    HOST,
    Engine,
    InvalidRequest,
    Request,
    SamplingParams,
    UnknownAdapter,
)
from jlora.engine.mock import MockEngine, MockTokenizer, mock_completion, mock_next_token
from jlora.server.engine_info import AdapterControl, Introspectable
from tests.engine_helpers import run_to_completion


def write_adapter_config(directory, rank=4, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = ["q_proj", "v_proj"]
    config.update(fields)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def test_token_function_is_pure_and_depends_on_each_input():
    assert mock_next_token(5, None, 0, 1000) == mock_next_token(5, None, 0, 1000)
    outputs = {
        mock_next_token(5, None, 0, 1000),
        mock_next_token(6, None, 0, 1000),
        mock_next_token(5, "a", 0, 1000),
        mock_next_token(5, None, 1, 1000),
    }
    assert len(outputs) == 4
    assert mock_completion([1, 2, 5], "a", 3, 1000)[0] == mock_next_token(5, "a", 0, 1000)


def test_streams_match_mock_completion_whatever_the_batch():
    engine = MockEngine(max_slots=2, adapters={"a": 8, "b": 16})
    assert isinstance(engine, Engine)
    assert isinstance(engine, AdapterControl) and isinstance(engine, Introspectable)
    prompts = [[1, 2, 3], [4], [7, 7], [9, 8, 7, 6], [3]]
    adapters = [None, "a", "b", "a", None]
    results = run_to_completion(engine, prompts, SamplingParams(max_tokens=6), adapters)
    for prompt, adapter, result in zip(prompts, adapters, results, strict=True):
        assert result["token_ids"] == mock_completion(prompt, adapter, 6, engine.vocab_size)
        assert result["finish_reason"] == "length"
        assert result["text"] == MockTokenizer().decode(result["token_ids"])
    assert not engine.has_unfinished
    assert engine.free_blocks == engine.num_blocks


def test_max_slots_bound_the_running_batch_and_admission_gives_two_tokens():
    engine = MockEngine(max_slots=2)
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


def test_kv_blocks_bound_admission():
    # 2 blocks of 16 tokens: a 20-token sequence takes both, so the second waits.
    engine = MockEngine(max_slots=2, max_seq_len=32, num_blocks=2)
    engine.add_request(Request("big", [1] * 10, SamplingParams(max_tokens=10)))
    engine.add_request(Request("next", [1], SamplingParams(max_tokens=2)))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1 and engine.free_blocks == 0


def test_length_stops_at_max_seq_len():
    engine = MockEngine(max_seq_len=16)
    [result] = run_to_completion(engine, [[1] * 10], SamplingParams(max_tokens=100))
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"


def test_eos_and_stop_strings_finish_with_stop():
    expected = mock_completion([3], None, 10, 1000)
    engine = MockEngine(eos_id=expected[3])
    [eos] = run_to_completion(engine, [[3]], SamplingParams(max_tokens=10))
    assert eos["token_ids"] == expected[:4] and eos["finish_reason"] == "stop"
    [ignored] = run_to_completion(engine, [[3]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert ignored["token_ids"] == expected and ignored["finish_reason"] == "length"
    stop = f"t{expected[2]}"  # token 2 reads " t<id>"
    [cut] = run_to_completion(MockEngine(), [[3]], SamplingParams(max_tokens=10, stop=(stop,)))
    assert cut["finish_reason"] == "stop" and len(cut["token_ids"]) == 3
    assert cut["text"] == f" t{expected[0]} t{expected[1]} "


@pytest.mark.parametrize(
    "request_, error, field",
    [
        (Request("r", [1], adapter="nope"), UnknownAdapter, "adapter"),
        (Request("r", []), InvalidRequest, "prompt"),
        (Request("r", [1] * 64), InvalidRequest, "max_seq_len"),
        (Request("r", [1, 1000]), InvalidRequest, "prompt_ids[1]"),
        (Request("r", [-1]), InvalidRequest, "prompt_ids[0]"),
    ],
)
def test_invalid_requests_change_nothing(request_, error, field):
    engine = MockEngine(max_seq_len=64)
    with pytest.raises(error, match=field.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request(request_)
    assert not engine.has_unfinished
    engine.add_request(Request("r", [1]))  # the id is still free
    with pytest.raises(InvalidRequest, match="request_id"):
        engine.add_request(Request("r", [1]))


def test_abort_frees_the_slot_and_blocks_of_running_and_queued_requests():
    engine = MockEngine(max_slots=1)
    engine.add_request(Request("running", [1], SamplingParams(max_tokens=50)))
    engine.add_request(Request("queued", [1], SamplingParams(max_tokens=50)))
    engine.step()
    assert engine.num_running == 1 and engine.free_blocks < engine.num_blocks
    assert engine.abort("queued") and engine.abort("running")
    assert not engine.abort("running")
    assert not engine.has_unfinished and engine.free_blocks == engine.num_blocks
    assert engine.stats().running == () and engine.step() == []


def test_step_latency_is_spent_only_when_there_is_work():
    engine = MockEngine(step_latency=0.05)
    start = time.perf_counter()
    assert engine.step() == [] and engine.steps == 0
    assert time.perf_counter() - start < 0.05
    engine.add_request(Request("r", [1], SamplingParams(max_tokens=3)))
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    assert engine.steps == 2  # prefill + decode, then decode
    assert time.perf_counter() - start >= 0.1


def test_adapter_slots_lru_eviction_holds_and_pins():
    engine = MockEngine(max_slots=4, max_loras=1, adapters={"a": 4, "b": 8})
    engine.add_request(Request("ra", [1], SamplingParams(max_tokens=3), adapter="a"))
    engine.add_request(Request("rb", [1], SamplingParams(max_tokens=3), adapter="b"))
    engine.step()
    # "a" holds the only slot while ra runs, so rb waits.
    assert [r.request_id for r in engine.stats().running] == ["ra"] and engine.num_waiting == 1
    with pytest.raises(AdapterError, match="running"):
        engine.unload_adapter("a")
    while engine.has_unfinished:
        engine.step()
    stats = engine.stats()
    assert (stats.adapter_loads, stats.adapter_evictions) == (2, 1)
    infos = {info.name: info for info in engine.adapter_infos()}
    assert (infos["a"].state, infos["b"].state, infos["b"].slot) == (HOST, DEVICE, 0)
    engine.load_adapter("a", pin=True)  # evicts idle "b"
    with pytest.raises(AdapterError, match="max_loras=1"):
        engine.load_adapter("b")  # "a" is pinned
    engine.unload_adapter("a")
    assert engine.adapter_infos()[0].state == HOST and not engine.adapter_infos()[0].pinned


def test_register_and_unregister(tmp_path):
    engine = MockEngine()
    info = engine.register_adapter("mine", write_adapter_config(tmp_path / "mine", rank=16))
    assert (info.rank, info.alpha, info.target_modules) == (16, 32.0, ("q_proj", "v_proj"))
    with pytest.raises(AdapterError, match="already registered"):
        engine.register_adapter("mine", tmp_path / "mine")
    with pytest.raises(AdapterError, match="name="):
        engine.register_adapter("../x", tmp_path / "mine")
    with pytest.raises(AdapterError, match="r="):
        engine.register_adapter("bad", write_adapter_config(tmp_path / "bad", rank=0))
    engine.add_request(Request("r", [1], adapter="mine"))
    with pytest.raises(AdapterError, match="named by 1"):
        engine.unregister_adapter("mine")
    engine.abort("r")
    engine.unregister_adapter("mine")
    assert engine.adapter_infos() == []
    with pytest.raises(AdapterError, match="not registered"):
        engine.unregister_adapter("mine")
