"""The engine on the tiny random model: batching invariance, limits, paging, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from jlora.contract.errors import Code, InvalidRequest, RequestError
from jlora.engine.api import Request, SamplingParams
from tests.engine_helpers import make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(lengths, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _engine(tiny, **overrides):
    config = {"max_slots": 4, "max_seq_len": 128, "min_bucket": 16, **overrides}
    return make_engine(tiny, **config)


def test_batch_equals_each_alone(tiny):
    prompts = _prompts([3, 17, 40, 1, 64, 9])  # more prompts than slots: some wait
    together = run_to_completion(_engine(tiny), prompts, GREEDY)
    for ids, result in zip(prompts, together, strict=True):
        assert result == run_to_completion(_engine(tiny), [ids], GREEDY)[0]
        assert len(result["token_ids"]) == 12 and result["finish_reason"] == "length"


def test_oversubscribed_kv_cache_queues_and_gives_the_same_tokens(tiny):
    prompts = _prompts([30, 50, 20, 60, 10])
    roomy = run_to_completion(_engine(tiny), prompts, GREEDY)
    # Room for about two sequences at a time: admission waits for blocks to return.
    tight = _engine(tiny, kv_cache_tokens=160)
    assert run_to_completion(tight, prompts, GREEDY) == roomy
    assert tight.memory.held_pages() == 0


def test_context_limit_finishes_with_length(tiny):
    engine = _engine(tiny, max_seq_len=64)
    [result] = run_to_completion(
        engine, _prompts([60]), SamplingParams(max_tokens=50, ignore_eos=True)
    )
    assert len(result["token_ids"]) == 4 and result["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    prompts = _prompts([5, 25, 12])
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=s)
        for s in (1, 2, 3)
    ]
    together = run_to_completion(_engine(tiny), prompts, params)
    alone = run_to_completion(_engine(tiny), prompts[1:2], params[1:2])[0]
    assert together[1] == alone
    greedy = run_to_completion(_engine(tiny), prompts[1:2], GREEDY)[0]
    assert together[1]["token_ids"] != greedy["token_ids"][:10]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        (list(range(128)), "prompt has 128 tokens; the context limit is 128"),
        ([1, 2, 512], "prompt_ids[2]=512 is outside the vocabulary"),
        ([1, -1], "prompt_ids[1]=-1 is outside the vocabulary"),
    ],
)
def test_bad_prompt_is_refused_and_changes_nothing(tiny, prompt, message):
    engine = _engine(tiny)
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request(Request("bad", prompt, GREEDY))
    assert not engine.has_unfinished
    engine.add_request(Request("bad", [1, 2, 3], GREEDY))  # the id was not taken either


def test_stop_strings_need_a_tokenizer(tiny):
    with pytest.raises(InvalidRequest, match="stop strings need a tokenizer"):
        _engine(tiny).add_request(Request("r", [1], SamplingParams(stop=("x",))))


def test_duplicate_request_id_is_refused(tiny):
    engine = _engine(tiny)
    engine.add_request(Request("same", [1, 2], GREEDY))
    with pytest.raises(RequestError, match="request_id='same' is already in use") as caught:
        engine.add_request(Request("same", [3], GREEDY))
    assert (caught.value.code, caught.value.field) == (Code.ALREADY_EXISTS, "request_id")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens=0"),
        ("max_tokens", -5, "max_tokens=-5"),
        ("temperature", -0.1, "temperature=-0.1"),
        ("temperature", float("nan"), "temperature=nan"),
        ("top_p", 0.0, "top_p=0.0"),
        ("top_p", 1.5, "top_p=1.5"),
        ("top_k", -1, "top_k=-1"),
        ("seed", -1, "seed=-1"),
        ("stop", ("",), "stop="),
    ],
)
def test_invalid_sampling_names_the_field(field, value, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == f"sampling.{field}"


def test_abort_frees_slot_and_blocks(tiny):
    engine = _engine(tiny)
    for i, ids in enumerate(_prompts([10, 20])):
        engine.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    assert engine.num_running == 2
    assert engine.abort("r0") and not engine.abort("r0")
    engine.add_request(Request("queued", [1, 2, 3], GREEDY))
    assert engine.abort("queued")
    while engine.has_unfinished:
        assert all(e.request_id == "r1" for e in engine.step())
    assert engine.memory.held_pages() == 0
