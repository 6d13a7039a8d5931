"""The prefix cache and the memory pool through the orchestrator, over the mock engine.

The mock records what every KV position holds (adapter, token) and raises if a prefill
is handed a cached prefix that does not hold its tokens for its adapter, so these tests
catch wrong reuse as well as missed reuse; `memory.check` is asserted after every step.
Greedy parity on the real model is in test_prefix_prefill.py.
"""

from __future__ import annotations

import random

import pytest

from jlora.engine.api import Request, SamplingParams
from jlora.engine.mock import mock_completion, mock_engine
from jlora.engine.orchestrator import Orchestrator

VOCAB = 1000  # MockEngine's default vocab_size
BLOCK = 16


def serve(engine: Orchestrator, request_id: str, prompt: list[int], adapter=None, tokens=4):
    """Run one request alone to the end: (its tokens, the cached tokens of its prefill)."""
    engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=tokens), adapter))
    out, cached = [], []
    while engine.has_unfinished:
        for event in engine.step():
            assert event.error is None, event.error
            out.append(event.token_id)
            cached.append(event.cached_tokens)
        engine.memory.check()
    assert out == mock_completion(prompt, adapter, tokens, VOCAB)
    assert cached[1:] == [0] * (len(cached) - 1)  # only the prefill's event says
    return out, cached[0]


def test_a_prompt_that_extends_a_finished_one_reuses_its_full_blocks():
    engine = mock_engine(max_seq_len=128)
    prompt = [1 + i % 50 for i in range(39)]
    answer, cached = serve(engine, "turn1", prompt, tokens=5)
    assert cached == 0
    # 39 + 5 tokens, the KV of 43 written: two full blocks are cached.
    _, cached = serve(engine, "turn2", prompt + answer + [7, 8, 9])
    assert cached == 2 * BLOCK
    stats = engine.stats().cache
    assert stats.hit_tokens == 2 * BLOCK and stats.prompt_tokens == 39 + 47
    assert engine.memory.held_pages() == 0 and stats.invalid_kv_pages == 0


def test_a_shared_prefix_ending_mid_block_reuses_only_the_full_blocks():
    engine = mock_engine(max_seq_len=128)
    serve(engine, "a", list(range(1, 41)))
    _, cached = serve(engine, "b", list(range(1, 21)) + [900] * 20)  # shares 20 tokens
    assert cached == BLOCK


def test_a_whole_cached_prompt_still_computes_its_last_token():
    engine = mock_engine(max_seq_len=128)
    prompt = list(range(1, 33))  # exactly two blocks
    serve(engine, "a", prompt)
    _, cached = serve(engine, "b", prompt)
    assert cached == BLOCK  # the second block holds the last token, which must be computed


def test_two_adapters_never_share_and_base_rows_share_among_themselves():
    engine = mock_engine(max_seq_len=128, adapters={"a": 8, "b": 8}, max_loras=2)
    prompt = list(range(100, 140))
    assert serve(engine, "a1", prompt, "a")[1] == 0
    assert serve(engine, "b1", prompt, "b")[1] == 0
    assert serve(engine, "base1", prompt)[1] == 0
    assert serve(engine, "a2", prompt, "a")[1] == 2 * BLOCK
    assert serve(engine, "b2", prompt, "b")[1] == 2 * BLOCK
    assert serve(engine, "base2", prompt)[1] == 2 * BLOCK


def test_the_none_policy_keeps_no_history():
    engine = mock_engine(max_seq_len=128, cache_policy="none")
    prompt = list(range(1, 41))
    serve(engine, "a", prompt)
    assert serve(engine, "b", prompt)[1] == 0
    stats = engine.stats().cache
    assert stats.pages_kv == 0 and stats.hit_tokens == 0


@pytest.mark.parametrize("policy", ["fastlibra", "lru"])
def test_evicted_prefixes_come_back_from_the_host_pool(policy):
    # 12 blocks: the later prompts' blocks push the first prompt's out to the host pool;
    # asking for it again swaps them back in. The link is fast enough that a block comes
    # back quicker than the mock recomputes it (see the next test).
    engine = mock_engine(
        max_seq_len=128, num_blocks=12, cache_policy=policy, emulated_link_gbps=1000
    )
    first = list(range(1, 65))  # 4 blocks, and 4 more for the answer's room
    serve(engine, "first", first)
    serve(engine, "other", list(range(200, 264)))
    serve(engine, "third", list(range(300, 364)))
    stats = engine.stats().cache
    assert stats.swaps_out > 0 and stats.host_bytes_used > 0
    _, cached = serve(engine, "again", first + [5])
    stats = engine.stats().cache
    assert cached == 4 * BLOCK and stats.swaps_in > 0
    assert stats.invalid_kv_pages == 0


@pytest.mark.parametrize("policy", ["fastlibra", "lru"])
def test_evicted_blocks_are_dropped_where_recomputing_them_is_quicker(policy):
    # 64 KiB pages over 1 MB/s take 65 ms to come back; the mock prefills a block in
    # microseconds: the cost model drops evicted blocks instead of swapping them out.
    engine = mock_engine(
        max_seq_len=128, num_blocks=12, cache_policy=policy, emulated_link_gbps=0.001
    )
    first = list(range(1, 65))
    serve(engine, "first", first)
    serve(engine, "other", list(range(200, 264)))
    serve(engine, "third", list(range(300, 364)))
    stats = engine.stats().cache
    assert stats.swaps_out == 0 and stats.host_bytes_used == 0
    _, cached = serve(engine, "again", first + [5])
    assert cached < 4 * BLOCK


def test_without_a_host_pool_evicted_prefixes_are_dropped():
    engine = mock_engine(max_seq_len=128, num_blocks=12, host_pool_mib=0)
    first = list(range(1, 65))
    serve(engine, "first", first)
    serve(engine, "other", list(range(200, 264)))
    serve(engine, "third", list(range(300, 364)))
    assert engine.stats().cache.swaps_out == 0
    _, cached = serve(engine, "again", first + [5])
    assert cached < 4 * BLOCK


def test_fastlibra_never_leaves_kv_without_its_adapter_and_lru_does():
    """One adapter slot, two adapters taking turns: FastLibra swaps an adapter's KV out
    before the adapter leaves; vLLM-style LRU leaves it on the device (invalid KV)."""
    invalid = {}
    for policy in ("fastlibra", "lru"):
        engine = mock_engine(
            max_seq_len=128, num_blocks=40, adapters={"a": 8, "b": 8}, max_loras=1,
            cache_policy=policy,
        )  # fmt: skip
        worst = 0
        for turn in range(4):
            for name in ("a", "b"):
                serve(engine, f"{name}{turn}", [ord(name)] * 30 + [turn], name)
                worst = max(worst, engine.stats().cache.invalid_kv_pages)
        invalid[policy] = worst
    assert invalid["fastlibra"] == 0
    assert invalid["lru"] > 0


@pytest.mark.parametrize("policy", ["fastlibra", "lru", "none"])
def test_a_busy_mixed_workload_gives_every_request_its_tokens(policy):
    """Concurrent requests over three adapters and the base model, prompts sharing
    prefixes, a pool small enough to swap: tokens exact, invariants after every step."""
    rng = random.Random(3)
    engine = mock_engine(
        max_seq_len=128, max_slots=4, num_blocks=40, adapters={"a": 8, "b": 16, "c": 8},
        max_loras=2, cache_policy=policy,
    )  # fmt: skip
    stems = {name: [rng.randrange(1, VOCAB) for _ in range(48)] for name in "abcx"}
    expected = {}
    for i in range(30):
        name = rng.choice("abcx")
        adapter = None if name == "x" else name
        prompt = stems[name][: rng.randint(10, 48)] + [rng.randrange(1, VOCAB)]
        count = rng.randint(1, 20)
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=count), adapter))
        expected[f"r{i}"] = mock_completion(prompt, adapter, count, VOCAB)
    got: dict[str, list[int]] = {key: [] for key in expected}
    while engine.has_unfinished:
        for event in engine.step():
            assert event.error is None, event.error
            got[event.request_id].append(event.token_id)
        engine.memory.check()
        if policy == "fastlibra":
            assert engine.memory.tree.invalid_kv_pages() == 0
    assert got == expected
    stats = engine.stats().cache
    assert engine.memory.held_pages() == 0
    assert (stats.hit_tokens > 0) == (policy != "none")


# -- the real model ----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gives_the_same_greedy_tokens_with_the_cache_on_and_off(smollm2, tmp_path):
    """Hits, misses, a prefix ending mid-block, two adapters sharing a prompt, the base
    model, the same weights under a new name, and a prefix swapped out and back in:
    every request's greedy tokens equal those of an engine that keeps no history."""
    import shutil

    from jlora.adapters.peft import make_demo_adapters
    from tests.engine_helpers import make_engine

    a, b = make_demo_adapters(smollm2.config, tmp_path, n=2, ranks=(8, 16), seed=5)
    twin = shutil.copytree(a, tmp_path / "twin")  # a's weights under another name
    rng = random.Random(11)
    stem = [rng.randrange(100, 20000) for _ in range(40)]
    other = [[rng.randrange(100, 20000) for _ in range(60)] for _ in range(3)]
    # (id, prompt maker from earlier answers, adapter, cached tokens expected with the cache)
    turns = [
        ("miss", lambda out: stem, a.name, 0),
        ("extend", lambda out: stem + out["miss"] + [13, 14], a.name, 2 * BLOCK),
        ("other-adapter", lambda out: stem, b.name, 0),
        ("base", lambda out: stem, None, 0),
        ("base-mid-block", lambda out: stem[:20] + [77] * 9, None, BLOCK),
        ("twin", lambda out: stem + [5], "twin", 2 * BLOCK),
        *[(f"filler{i}", lambda out, i=i: other[i], None, 0) for i in range(3)],
        ("swapped", lambda out: stem + out["miss"] + [13, 14], a.name, 2 * BLOCK),
    ]
    results = {}
    for policy in ("none", "fastlibra"):
        engine = make_engine(
            smollm2, max_slots=2, max_seq_len=128, min_bucket=16, kv_cache_tokens=64 * 16,
            max_loras=3, max_lora_rank=16, cache_policy=policy,
        )  # fmt: skip
        for path in (a, b, twin):
            engine.register_adapter(path.name, str(path))
        out: dict[str, list[int]] = {}
        hits = {}
        for name, prompt, adapter, _ in turns:
            if name == "swapped":  # every cached block to the host pool
                engine.memory.swap_out(engine.config.num_blocks)
            engine.add_request(Request(name, prompt(out), SamplingParams(max_tokens=6), adapter))
            out[name], hits[name] = [], None
            while engine.has_unfinished:
                for event in engine.step():
                    assert event.error is None, event.error
                    out[name].append(event.token_id)
                    hits[name] = event.cached_tokens if hits[name] is None else hits[name]
                engine.memory.check()
        results[policy] = out, hits, engine.stats().cache
        engine.close()
    (off, off_hits, _), (on, on_hits, cache) = results["none"], results["fastlibra"]
    assert on == off
    assert set(off_hits.values()) == {0}
    assert on_hits == {name: expected for name, _, _, expected in turns}
    assert cache.swaps_out > 0 and cache.swaps_in > 0 and cache.invalid_kv_pages == 0
