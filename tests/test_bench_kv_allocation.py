"""bench/kv_allocation.py: the trace's requests, the measurement over the mock engine
under both allocations (exact tokens, preemptions only when lazy, more rows in use),
and the table; the SmolLM2 run itself is the benchmark's."""

from __future__ import annotations

from bench.kv_allocation import QUICK, make_requests, measure, render
from jlora.engine.mock import mock_completion, mock_engine
from tests.bench_helpers import FACTS


def test_the_requests_follow_the_trace_within_the_plans_bounds():
    requests = make_requests(QUICK, vocab=1000)
    assert len(requests) == QUICK.requests
    for _, prompt, max_tokens in requests:
        assert QUICK.prompt_tokens[0] <= len(prompt) <= QUICK.prompt_tokens[1]
        assert QUICK.output_tokens[0] <= max_tokens <= QUICK.output_tokens[1]
        assert len(prompt) + max_tokens <= QUICK.max_seq_len
    assert make_requests(QUICK, vocab=1000) == requests  # seeded


def test_lazy_runs_more_rows_with_the_same_tokens_on_the_mock():
    requests = make_requests(QUICK, vocab=1000)
    runs = [
        measure(
            mock_engine(
                max_slots=QUICK.max_slots,
                max_seq_len=QUICK.max_seq_len,
                num_blocks=QUICK.pool_blocks,
                kv_allocation=allocation,
                host_pool_mib=0,  # the mock's steps take no time: its swaps would dominate
            ),
            requests,
        )
        for allocation in ("upfront", "lazy")
    ]
    upfront, lazy = runs
    for name, prompt, max_tokens in requests:
        assert upfront.tokens[name] == lazy.tokens[name]
        assert upfront.tokens[name] == mock_completion(prompt, None, max_tokens, 1000)
    assert upfront.preemptions == 0 < lazy.preemptions
    assert lazy.mean_rows > upfront.mean_rows
    assert lazy.prompt_tokens > upfront.prompt_tokens == sum(len(p) for _, p, _ in requests)
    table = render(FACTS, QUICK, runs, requests)
    assert "| upfront |" in table and "| lazy |" in table
    assert f"{QUICK.requests}/{QUICK.requests}" in table
