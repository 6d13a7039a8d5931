"""bench/replay.py: the workload within the plan's bounds, a prompts file `jlora
generate` reads back as the same requests, and the table; the runs themselves are the
benchmark's (SmolLM2 and transformers for minutes)."""

from __future__ import annotations

from bench.replay import QUICK, make_workload, render, write_prompts_file
from jlora.cli.generate import _read_prompts
from jlora.engine.api import SamplingParams
from tests.bench_helpers import FACTS


def test_the_prompts_file_is_the_workload_as_jlora_generate_reads_it(tmp_path):
    workload = make_workload(QUICK)
    assert len(workload.requests) == QUICK.requests
    assert any(r.adapter for r in workload.requests)
    assert any(r.adapter is None for r in workload.requests)
    path = tmp_path / "prompts.jsonl"
    write_prompts_file(workload, path)
    prompts = _read_prompts(path, None, SamplingParams())
    for request, prompt in zip(workload.requests, prompts, strict=True):
        assert QUICK.prompt_tokens[0] <= request.prompt_tokens <= QUICK.prompt_tokens[1]
        assert (prompt.text, prompt.adapter) == (request.prompt, request.adapter)
        assert prompt.sampling.max_tokens == request.max_tokens
        assert prompt.sampling.ignore_eos and prompt.sampling.temperature == 0.0


def test_the_table_gives_each_systems_rate_against_the_baseline():
    texts = {"0": "a b", "1": "c d"}
    result = {
        "prompt_tokens": 500,
        "systems": {
            "jlora": {"seconds": 2.0, "generated": 60, "texts": texts},
            "jlora generate": {"seconds": 6.0, "generated": 60, "texts": {**texts, "1": "x"}},
            "hf-peft": {"seconds": 6.0, "generated": 60, "texts": texts},
        },
    }
    text = render(FACTS, QUICK, result)
    assert "| jlora | 2.0 | 60 | 30.0 | 3.00x | 2/2 |" in text
    assert "| jlora generate | 6.0 | 60 | 10.0 | 1.00x | 1/2 |" in text
    assert "| hf-peft | 6.0 | 60 | 10.0 | 1.00x | 2/2 |" in text
