"""Chunked prefill (vLLM's): a step prefills at most `prefill_token_budget` prompt
tokens beside its decode step; a longer prompt is prefilled in chunks of whole blocks
over several steps, each continuing the KV of the last, so running streams never stall
and every stream is exact. The mock engine raises on any KV read that was not written
by the same tokens; the tiny model and SmolLM2 check the real KV (greedy tokens equal to
whole prefills)."""

from __future__ import annotations

import pytest

from configs import ConfigError, EngineConfig
from jlora.engine.api import Request, SamplingParams
from jlora.engine.mock import mock_completion, mock_engine

VOCAB = 1000  # MockEngine's default vocab_size


def _record_prefills(engine) -> list[list[tuple[int, int]]]:
    """Per step from now on: the (tokens, cached) of each prefill job the device ran."""
    steps: list[list[tuple[int, int]]] = []
    prefill_many = engine.device.prefill_many

    def recording(jobs):
        steps[-1].extend((len(job.tokens), job.cached) for job in jobs)
        return prefill_many(jobs)

    engine.device.prefill_many = recording
    step = engine.step

    def stepping():
        steps.append([])
        return step()

    engine.step = stepping
    return steps


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_decoding():
    engine = mock_engine(max_slots=2, max_seq_len=256, prefill_token_budget=48)
    engine.add_request(Request("running", [7] * 5, SamplingParams(max_tokens=30)))
    engine.step()
    steps = _record_prefills(engine)
    engine.add_request(Request("long", list(range(1, 151)), SamplingParams(max_tokens=4)))
    tokens: dict[str, list[int]] = {"running": [], "long": []}
    first_token_step = None
    while engine.has_unfinished:
        events = engine.step()
        for event in events:
            assert event.error is None, event.error
            tokens[event.request_id].append(event.token_id)
            if event.request_id == "long" and first_token_step is None:
                first_token_step = len(steps)
        if len(tokens["running"]) < 28:  # it had its first two tokens before
            assert any(e.request_id == "running" for e in events)  # never stalls
        engine.memory.check()
    # 150 tokens in chunks of whole blocks within 48: 48, 48, 48, then the last 6.
    assert [jobs for jobs in steps if jobs][:4] == [
        [(48, 0)],
        [(96, 48)],
        [(144, 96)],
        [(150, 144)],
    ]
    assert first_token_step == 4
    assert engine.stats().prefill_chunks == 3
    assert tokens["long"] == mock_completion(list(range(1, 151)), None, 4, VOCAB)
    assert tokens["running"] == mock_completion([7] * 5, None, 30, VOCAB)[2:]
    assert engine.memory.held_pages() == 0


def test_each_step_prefills_at_most_the_budget_and_admissions_fill_what_is_left():
    engine = mock_engine(max_slots=4, max_seq_len=256, prefill_token_budget=64)
    steps = _record_prefills(engine)
    prompts = {"a": [1] * 40, "b": [2] * 70, "c": [3] * 20}
    for name, prompt in prompts.items():
        engine.add_request(Request(name, prompt, SamplingParams(max_tokens=5)))
    out: dict[str, list[int]] = {name: [] for name in prompts}
    while engine.has_unfinished:
        for event in engine.step():
            out[event.request_id].append(event.token_id)
    for jobs in steps:
        assert sum(tokens - cached for tokens, cached in jobs) <= 64
    # a whole (40) and b's first block (16: all that fits of it); the rest of b (54),
    # which leaves less than a block for c; then c (20).
    assert [jobs for jobs in steps if jobs] == [[(40, 0), (16, 0)], [(70, 16)], [(20, 0)]]
    for name, prompt in prompts.items():
        assert out[name] == mock_completion(prompt, None, 5, VOCAB)


@pytest.mark.parametrize(
    "length, prefills",
    [
        (384, [(256, 0), (384, 256)]),  # 512 would pad 128 tokens; 256 + 128 pad none
        (300, [(256, 0), (300, 256)]),  # 512 pads 212; 256 + 44 (in 64) pads 20
        (257, [(256, 0), (257, 256)]),  # 512 pads 255; 256 + 1 (in 32) pads 31
        (500, [(500, 0)]),  # 512 pads 12
        (100, [(100, 0)]),  # 128 pads 28; 64 + 36 (in 64) would pad 28
    ],
)
def test_a_prefill_ends_on_a_bucket_where_padding_it_whole_would_cost_more(length, prefills):
    """Buckets 32, 64, ..., 512 (the default), a budget of 512: a prompt whose bucket
    would pad SPLIT_TOKENS more than ending on a smaller bucket and padding the rest
    runs in two steps; the stream is exact either way. Not under the "none" policy."""
    prompt = [(7 * i) % VOCAB for i in range(length)]
    for policy, expected in (("fastlibra", prefills), ("none", [(length, 0)])):
        engine = mock_engine(max_slots=2, max_seq_len=512, cache_policy=policy)
        steps = _record_prefills(engine)
        engine.add_request(Request("r", prompt, SamplingParams(max_tokens=4)))
        out = [event.token_id for _ in range(8) for event in engine.step()]
        assert [job for jobs in steps for job in jobs] == expected
        assert out == mock_completion(prompt, None, 4, VOCAB)


def test_aborting_or_preempting_a_request_between_its_chunks_gives_back_its_blocks():
    engine = mock_engine(max_slots=3, max_seq_len=128, prefill_token_budget=16)
    engine.add_request(Request("long", [5] * 100, SamplingParams(max_tokens=3)))
    engine.step()
    assert engine.admitted("long") and engine.num_running == 1
    assert engine.abort("long")
    assert engine.memory.held_pages() == 0
    engine.memory.check()
    # Two streams at 32 tokens (two blocks each) and an 80-token prompt (6 blocks), which
    # leaves one block free: when both streams need their third block, the newest
    # request, between its chunks, is preempted, and later prefilled again, exactly.
    engine = mock_engine(max_slots=3, max_seq_len=128, num_blocks=11, prefill_token_budget=32)
    for name in ("s1", "s2"):
        engine.add_request(Request(name, [1] * 15, SamplingParams(max_tokens=40)))
    engine.step()
    while engine.scheduler.admitted()[0].length < 32:
        engine.step()
    engine.add_request(Request("new", [2] * 80, SamplingParams(max_tokens=3)))
    out: dict[str, list[int]] = {"s1": [], "s2": [], "new": []}
    while engine.has_unfinished:
        for event in engine.step():
            assert event.error is None, event.error
            out[event.request_id].append(event.token_id)
        engine.memory.check()
    assert engine.stats().preemptions == 1 and engine.stats().prefill_chunks == 2 + 2
    assert out["new"] == mock_completion([2] * 80, None, 3, VOCAB)
    for name in ("s1", "s2"):
        assert out[name] == mock_completion([1] * 15, None, 40, VOCAB)[17:]
    assert engine.memory.held_pages() == 0


def test_the_budget_must_hold_a_block():
    with pytest.raises(ConfigError, match="prefill_token_budget=8 must be at least block_size=16"):
        EngineConfig(prefill_token_budget=8)


def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill_with_adapters(tiny, tmp_path):
    """The tiny model with two adapters and base rows: prompts prefilled in chunks of 32
    tokens give the greedy tokens of the same prompts prefilled whole."""
    from jlora.adapters.peft import make_demo_adapters
    from tests.engine_helpers import make_engine

    paths = make_demo_adapters(tiny.config, tmp_path, n=2, ranks=[8, 16])
    prompts = [
        (list(range(3, 3 + n)), adapter)
        for n, adapter in [(100, paths[0].name), (45, None), (70, paths[1].name)]
    ]
    results = []
    for budget in (32, 512):
        engine = make_engine(
            tiny,
            max_slots=3,
            max_seq_len=256,
            min_bucket=16,
            max_loras=2,
            max_lora_rank=16,
            prefill_token_budget=budget,
        )
        for path in paths:
            engine.register_adapter(path.name, str(path))
        for i, (prompt, adapter) in enumerate(prompts):
            sampling = SamplingParams(max_tokens=8, ignore_eos=True)
            engine.add_request(Request(f"r{i}", prompt, sampling, adapter=adapter))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                out[event.request_id].append(event.token_id)
        results.append((out, engine.stats().prefill_chunks))
        engine.close()
    (chunked, chunks), (whole, split) = results
    assert chunked == whole
    # Chunks of 32: 3 + 1 + 2. Within 512: the 70-token prompt runs as 64 + 6 (padded
    # to 16), not 70 padded to 128.
    assert chunks == 3 + 1 + 2 and split == 1


@pytest.mark.slow
def test_smollm2_chunked_prefill_gives_the_greedy_tokens_of_a_whole_prefill(smollm2):
    from tests.engine_helpers import make_engine

    prompt = [(17 * i) % 20000 + 100 for i in range(300)]
    results = []
    for budget in (64, 512):
        engine = make_engine(
            smollm2, max_slots=2, max_seq_len=512, min_bucket=16, prefill_token_budget=budget
        )
        engine.add_request(Request("r", prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
        out = []
        while engine.has_unfinished:
            out += [event.token_id for event in engine.step()]
        results.append(out)
        engine.close()
    assert results[0] == results[1]
