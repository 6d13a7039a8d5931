"""bench/cache.py: prompt assembly from turns, the closed-loop replay over the mock
engine under each cache policy, the divergence report and the table, all fast; a tiny
configuration end to end on SmolLM2 as a slow test."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from bench.cache import (
    POLICIES,
    Conversations,
    Plan,
    TurnRecord,
    compare,
    divergences,
    kv_block_bytes,
    make_workload,
    measure,
    mismatches,
    render,
)
from bench.lib.workloads import Turn, WordTokenizer, demo_adapter_pool, multiturn_workload
from configs import load_preset
from jlora.engine.mock import MockEngine, mock_adapter_dir
from jlora.engine.orchestrator import Orchestrator
from tests.bench_helpers import FACTS

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

WORDS = WordTokenizer()
POOL = demo_adapter_pool(2, (8, 16))


def _turn(session: str, index: int, message: str, max_tokens: int = 2) -> Turn:
    return Turn(
        id=f"{session}-t{index}",
        session=session,
        index=index,
        arrival_s=float(index),
        message=message,
        message_tokens=len(message.split()),
        max_tokens=max_tokens,
        context_tokens=0,
        adapter=None,
        rank=0,
    )


def _workload(**options):
    defaults = dict(
        trace="conv",
        max_turns=24,
        rate_scale=20.0,
        message_scale=0.02,
        output_scale=0.05,
        message_tokens=(4, 24),
        output_tokens=(2, 8),
        continue_p=0.8,
        mean_turns=5.0,
        max_context_tokens=120,
        think_s=0.01,
        adapters=POOL,
        zipf_s=0.0,
        base_fraction=0.2,
        seed=1,
        tokenizer=WORDS,
    )
    return multiturn_workload(**{**defaults, **options})


# -- prompt assembly -------------------------------------------------------------------


def test_a_turn_s_prompt_is_the_last_prompt_its_answer_and_the_new_message():
    conversations = Conversations(WORDS.encode)
    first, second = _turn("s0", 0, "the of and"), _turn("s0", 1, "to in")
    prompt = conversations.prompt(first)
    assert prompt == WORDS.encode("the of and") == [0, 1, 2]
    conversations.finish(first, prompt, [900, 901])  # the answer: any token ids
    assert conversations.prompt(second) == [0, 1, 2, 900, 901, 3, 4]
    # Another session starts from nothing.
    assert conversations.prompt(_turn("s1", 0, "is")) == [5]


def test_a_turn_cannot_be_sent_before_its_previous_turn_finished():
    conversations = Conversations(WORDS.encode)
    with pytest.raises(ValueError, match="session 's0' is at turn 0, not 1"):
        conversations.prompt(_turn("s0", 1, "the"))
    first = _turn("s0", 0, "the")
    conversations.finish(first, conversations.prompt(first), [7])
    with pytest.raises(ValueError, match="s0-t0: session 's0' is at turn 1, not 0"):
        conversations.prompt(first)


def test_assembled_prompts_have_the_workload_s_context_lengths():
    workload = _workload()
    conversations = Conversations(WORDS.encode)
    for turn in workload.turns:  # sessions interleave; each in order
        prompt = conversations.prompt(turn)
        assert len(prompt) == turn.context_tokens
        conversations.finish(turn, prompt, [999] * turn.max_tokens)


# -- the replay over the mock engine ------------------------------------------------------


def _mock(policy: str) -> Orchestrator:
    """Two adapter slots, a pool of 10 blocks of 16 tokens (a sequence needs 8 at most),
    an adapter of rank 16 in one block: history must leave the pool."""
    engine = Orchestrator(
        MockEngine(
            max_slots=3,
            max_seq_len=128,
            step_latency=0.002,
            max_loras=2,
            max_lora_rank=16,
            cache_policy=policy,
            pool_bytes=10 * 2**16,
            kv_block_bytes=2**16,
            rank_row_bytes=2**12,
        )
    )
    for name, rank in POOL:
        engine.register_adapter(name, mock_adapter_dir(rank))
    return engine


@pytest.fixture(scope="module")
def replays():
    """policy: (row, records) of one replay of the same workload."""
    workload = _workload()
    results = {}
    for policy in POLICIES:
        engine = _mock(policy)
        try:
            results[policy] = measure(engine, workload, WORDS.encode)
        finally:
            engine.close()
    return workload, results


def test_the_replay_is_closed_loop_within_a_session(replays):
    workload, results = replays
    for _, records in results.values():
        assert sorted(records) == sorted(turn.id for turn in workload.turns)
        for turns in workload.sessions().values():
            chain = [records[turn.id] for turn in turns]
            for record in chain:
                assert len(record.tokens) == record.turn.max_tokens  # EOS ignored
                assert len(record.prompt) == record.turn.context_tokens
                assert record.due >= record.turn.arrival_s
                assert record.due <= record.first <= record.finished
            for before, after in itertools.pairwise(chain):
                assert after.due >= before.finished + workload.think_s
                message = WORDS.encode(after.turn.message)
                assert after.prompt == before.prompt + before.tokens + message


def test_history_is_reused_except_under_none_and_tokens_agree(replays):
    workload, results = replays
    # The mock engine raises on a wrong prefix reuse, so agreeing tokens and hits mean
    # the reused KV was the right one.
    rows = {policy: row for policy, (row, _) in results.items()}
    for policy in ("fastlibra", "lru"):
        assert 0 < rows[policy]["hit_rate"] < 1
        assert rows[policy]["hit_tokens"] == sum(
            record.cached_tokens for record in results[policy][1].values()
        )
        assert rows[policy]["kv_cached_share"] > 0
        assert rows[policy]["swaps_out"] > 0
    assert rows["none"]["hit_rate"] == 0 and rows["none"]["kv_cached_share"] == 0
    assert rows["none"]["swaps_out"] == rows["none"]["swaps_in"] == 0
    assert rows["fastlibra"]["max_invalid_kv_pages"] == 0
    prompt_tokens = sum(turn.context_tokens for turn in workload.turns)
    assert all(row["prompt_tokens"] == prompt_tokens for row in rows.values())
    reference = results["fastlibra"][1]
    for policy in POLICIES:
        assert mismatches(reference, results[policy][1]) == []
        row = rows[policy]
        assert row["policy"] == policy and row["turns"] == len(workload.turns)
        assert row["output_tokens"] == sum(turn.max_tokens for turn in workload.turns)
        assert 0 < row["kv_running_share"] < 1 and 0 <= row["free_share"] < 1
        assert 0 < row["mean_ttft_s"] <= row["p90_ttft_s"] and row["mean_tpot_s"] > 0


# -- the report -------------------------------------------------------------------------


def _record(turn: Turn, tokens: list[int], cached: int = 0) -> TurnRecord:
    return TurnRecord(turn, 0.0, [], first=0.5, finished=1.0, cached_tokens=cached, tokens=tokens)


def test_divergences_name_each_session_s_first_differing_turn_and_token():
    turns = [_turn("s0", 0, "the"), _turn("s0", 1, "of"), _turn("s1", 0, "and")]
    ours = {t.id: _record(t, [1, 2, 3], cached=16 * t.index) for t in turns}
    theirs = {
        "s0-t0": _record(turns[0], [1, 2, 3]),
        "s0-t1": _record(turns[1], [1, 9, 9]),  # differs at its second token
        "s1-t0": _record(turns[2], [1, 2, 3]),
    }
    assert mismatches(ours, theirs) == ["s0-t1"]
    assert divergences(ours, theirs) == [
        {"turn": "s0-t1", "index": 1, "token": 1, "cached_tokens": [16, 0]}
    ]
    theirs["s0-t0"] = _record(turns[0], [5, 2, 3])
    assert divergences(ours, theirs)[0] | {"cached_tokens": None} == {
        "turn": "s0-t0",
        "index": 0,
        "token": 0,
        "cached_tokens": None,
    }


def test_the_table_has_one_row_per_policy(replays):
    workload, results = replays
    plan = dataclasses.replace(Plan(), turns=len(workload.turns))
    rows = [row | {"mismatched_turns": 0, "divergences": []} for row, _ in results.values()]
    rows[0] |= {"mean_ttft_s": 1.234, "p90_ttft_s": 2.5, "mean_tpot_s": 0.0456, "hit_rate": 0.5}
    table = render(FACTS, plan, workload, rows)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(POLICIES)  # the header, then the policies in order
    assert [line.split(" | ")[0] for line in lines[1:]] == [f"| {p}" for p in POLICIES]
    assert lines[1].startswith("| fastlibra | 1.23 | 2.50 | 46 | 50% | ")
    assert f"{len(workload.turns)} turns in {workload.meta['sessions']} sessions" in table
    assert "device pool of 224 KV blocks" in table


def test_a_kv_block_is_computed_as_the_engine_measures_it():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; keys and values of 16 tokens in fp32.
    assert kv_block_bytes(load_preset("smollm2-135m").config, 16) == 2 * 30 * 16 * 3 * 64 * 4


# -- end to end ----------------------------------------------------------------------------


TINY = Plan(
    adapters=2,
    max_loras=1,  # the two adapters take turns: fastlibra must swap KV out first
    slots=1,  # one row: no other row changes a step's padding, so tokens are exact
    max_seq_len=128,
    prefill_buckets=(32, 64, 128),
    pool_blocks=48,
    turns=8,
    rate_scale=50.0,
    message_tokens=(8, 24),
    output_tokens=(4, 8),
    max_context_tokens=120,
    continue_p=0.7,
    think_s=0.0,
    zipf_s=0.0,
    base_fraction=0.0,
    seed=5,  # three sessions of 4, 1 and 3 turns, the first of rank 16, then rank 8
    warmup_on_demand=True,
)


@pytest.mark.slow
def test_the_three_policies_give_the_same_tokens_on_smollm2(smollm2):
    workload, rows = compare(TINY, smollm2)
    assert workload == make_workload(TINY, smollm2.tokenizer)
    assert max(len(turns) for turns in workload.sessions().values()) > 1
    by_policy = {row["policy"]: row for row in rows}
    assert list(by_policy) == list(POLICIES)
    for row in rows:
        assert row["mismatched_turns"] == 0, row["divergences"]
        assert row["turns"] == TINY.turns
    assert by_policy["fastlibra"]["max_invalid_kv_pages"] == 0
    # lru keeps the other adapter's KV on the device while that adapter is away
    # (invalid) and reuses it when it is back; fastlibra swaps it out before its adapter
    # leaves and in again after; none never keeps it.
    assert by_policy["lru"]["hit_rate"] > 0 and by_policy["fastlibra"]["hit_rate"] > 0
    assert by_policy["none"]["hit_rate"] == 0
