"""bench/chunked_prefill.py: the scenario on the mock engine (every stream exact, the
long prompt's first token after its chunks) and the table; the SmolLM2 runs are the
benchmark's."""

from __future__ import annotations

import dataclasses

from bench.chunked_prefill import QUICK, render, run_once
from jlora.engine.mock import mock_completion, mock_engine
from tests.bench_helpers import FACTS

VOCAB = 30000  # the prompts' token ids run to 20100
PLAN = dataclasses.replace(QUICK, max_seq_len=256, long_prompt=200, stream_tokens=30)


def test_the_scenario_runs_every_stream_exactly_whatever_the_budget():
    runs = []
    for budget in (256, 32):
        engine = mock_engine(
            max_slots=PLAN.streams + 1,
            max_seq_len=PLAN.max_seq_len,
            prefill_token_budget=budget,
            vocab_size=VOCAB,
        )
        run = run_once(engine, PLAN)
        assert set(run["tokens"]) == {f"s{i}" for i in range(PLAN.streams)} | {"long"}
        assert len(run["tokens"]["long"]) == PLAN.long_tokens
        assert run["max_wait_s"] >= run["median_wait_s"] > 0 and run["long_ttft_s"] > 0
        runs.append(run)
        assert engine.stats().prefill_chunks == (0 if budget == 256 else 200 // 32)
    assert runs[0]["tokens"] == runs[1]["tokens"]
    long_prompt = [(13 * k) % 20000 + 100 for k in range(PLAN.long_prompt)]
    assert runs[0]["tokens"]["long"] == mock_completion(long_prompt, None, 8, VOCAB)


def test_the_table_marks_the_whole_prefill_and_different_tokens():
    def row(budget, tokens):
        run = {
            "max_wait_s": 0.5,
            "median_wait_s": 0.05,
            "long_ttft_s": 2.0,
            "tokens_per_s": 40.0,
            "tokens": tokens,
        }
        return {"budget": budget, "runs": [run], **{k: v for k, v in run.items() if k != "tokens"}}

    text = render(FACTS, PLAN, [row(2048, {"a": [1]}), row(128, {"a": [2]})])
    assert "| 2048 (whole) | 500 | 50 | 2000 | 40.0 | yes |" in text
    assert "| 128 | 500 | 50 | 2000 | 40.0 | NO |" in text
