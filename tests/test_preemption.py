"""Lazy KV allocation and preemption (vLLM's recompute preemption) through the
orchestrator: admission by prompt, growth a block at a time, the newest request
preempted when the pool runs out, and every stream exact afterwards; the mock engine
(which raises on any wrong KV reuse) and the real SmolLM2 (greedy parity)."""

from __future__ import annotations

import math

import pytest

from jlora.contract.errors import Code
from jlora.engine.api import Request, SamplingParams
from jlora.engine.mock import mock_completion, mock_engine
from tests.engine_helpers import step_until

VOCAB = 1000  # MockEngine's default vocab_size


def test_lazy_kv_admits_by_prompt_and_grows_a_block_at_a_time():
    engine = mock_engine(max_slots=2, max_seq_len=64, num_blocks=8, cache_policy="none")
    engine.add_request(Request("r", [1] * 10, SamplingParams(max_tokens=40)))
    engine.step()  # the prefill: 10 tokens and the first generated one fit one block
    [seq] = engine.scheduler.admitted()
    held = [len(seq.lease.table)]
    while engine.has_unfinished:
        engine.step()
        if seq.lease is not None:  # a step wrote position length - 2: no block ahead
            assert len(seq.lease.table) == math.ceil((seq.length - 1) / 16)
            held.append(len(seq.lease.table))
    # The step writing position 48 takes a 4th block and samples the 50th, last, token.
    assert held[0] == 1 and held[-1] == 3 and held == sorted(held)
    assert engine.memory.pool.num_free == 8


@pytest.mark.parametrize("policy", ["fastlibra", "lru", "none"])
def test_preemption_runs_more_requests_at_once_with_the_same_tokens(policy):
    """6 blocks of 16 tokens; requests of 10-token prompts that grow to 40 tokens (3
    blocks): up front two run at once; lazily more are admitted, the pool runs out as
    they grow, the newest are preempted and recomputed, and every stream is exact."""
    prompts = [[i + 1] * 10 for i in range(5)]
    sampling = SamplingParams(max_tokens=30)
    peaks = {}
    for allocation in ("upfront", "lazy"):
        engine = mock_engine(
            max_slots=5, max_seq_len=64, num_blocks=6, cache_policy=policy, max_loras=0,
            kv_allocation=allocation, host_pool_mib=1,
        )  # fmt: skip
        peak = 0
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt, sampling))
        results = {f"r{i}": [] for i in range(len(prompts))}
        cached = 0
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                results[event.request_id].append(event.token_id)
                cached += event.cached_tokens
            peak = max(peak, engine.num_running)
            engine.memory.check()
        for i, prompt in enumerate(prompts):
            assert results[f"r{i}"] == mock_completion(prompt, None, 30, VOCAB), allocation
        assert cached == 0  # re-prefills after preemption report no cached prompt tokens
        preemptions = engine.stats().preemptions
        assert (preemptions > 0) == (allocation == "lazy")
        assert engine.memory.held_pages() == 0
        peaks[allocation] = peak
    assert peaks == {"upfront": 2, "lazy": 5}


def test_preempted_request_keeps_its_place_before_later_arrivals():
    engine = mock_engine(max_slots=3, max_seq_len=64, num_blocks=4, cache_policy="none")
    for i in range(3):
        engine.add_request(Request(f"r{i}", [i + 1] * 15, SamplingParams(max_tokens=40)))
    step_until(engine, lambda: engine.stats().preemptions > 0)
    engine.add_request(Request("late", [9], SamplingParams(max_tokens=2)))
    queued = [info.request_id for info in engine.stats().queued]
    assert queued.index("late") == len(queued) - 1 and queued[0].startswith("r")


def test_a_sequence_the_pool_cannot_hold_fails_naming_max_tokens():
    # 4 pages, one sequence of max_seq_len; the adapter (rank 32) takes 2 of them.
    engine = mock_engine(max_slots=1, max_seq_len=64, num_blocks=4, adapters={"a": 32})
    engine.add_request(Request("long", [1] * 10, SamplingParams(max_tokens=54), adapter="a"))
    engine.add_request(Request("short", [2] * 3, SamplingParams(max_tokens=3)))
    events = step_until(engine, lambda: not engine.has_unfinished)
    [failed] = [e for e in events if e.error is not None]
    assert failed.request_id == "long" and failed.error.field == "sampling.max_tokens"
    assert failed.error.code == Code.RESOURCE_EXHAUSTED
    tokens = [e.token_id for e in events if e.request_id == "long" and e.error is None]
    # Position 32 needs a third block: the 23rd token is the last.
    assert tokens == mock_completion([1] * 10, "a", 54, VOCAB)[:23]
    short = [e.token_id for e in events if e.request_id == "short"]
    assert short == mock_completion([2] * 3, None, 3, VOCAB)
    assert engine.memory.stats().pages_lora == 2


# -- a real model ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, model",
    [pytest.param("fastlibra", "smollm2", marks=pytest.mark.slow), ("none", "tiny")],
)
def test_preempted_requests_give_the_same_greedy_tokens(request, tmp_path, policy, model):
    """Six requests over two adapters and the base model, 12 KV blocks besides the
    adapters' pages: run lazily they are preempted and recomputed (from their cached
    blocks under fastlibra, from scratch under none), and each one's greedy tokens equal
    those of the same requests run up front, never preempted. On the real SmolLM2 with
    the default policy; on cpu-tiny for S-LoRA's, where only the recomputation differs."""
    import random

    from jlora.adapters.peft import make_demo_adapters
    from tests.engine_helpers import make_engine

    loaded = request.getfixturevalue(model)
    vocab = loaded.config.vocab_size
    # At max_lora_rank, the adapters take exactly the pages the default pool adds for them.
    a, b = make_demo_adapters(loaded.config, tmp_path, n=2, ranks=(16, 16), seed=7)
    rng = random.Random(5)
    requests = [
        (f"r{i}", [rng.randrange(100, min(20000, vocab)) for _ in range(20 + 5 * i)], adapter)
        for i, adapter in enumerate([a.name, None, b.name, a.name, None, b.name])
    ]
    results = {}
    for allocation in ("upfront", "lazy"):
        engine = make_engine(
            loaded, max_slots=4, max_seq_len=128, min_bucket=16, kv_cache_tokens=12 * 16,
            max_loras=2, max_lora_rank=16, cache_policy=policy, kv_allocation=allocation,
        )  # fmt: skip
        for path in (a, b):
            engine.register_adapter(path.name, str(path))
        for name, prompt, adapter in requests:
            engine.add_request(
                Request(name, prompt, SamplingParams(max_tokens=40, ignore_eos=True), adapter)
            )
        out: dict[str, list[int]] = {name: [] for name, _, _ in requests}
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                out[event.request_id].append(event.token_id)
            engine.memory.check()
        results[allocation] = out, engine.stats().preemptions
        engine.close()
    (upfront, never), (lazy, preempted) = results.values()
    assert lazy == upfront
    assert never == 0 and preempted > 0
