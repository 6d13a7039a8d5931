"""bench/startup.py: the table from a made-up result; the runs themselves are the
benchmark's (they start SmolLM2 processes for minutes)."""

from __future__ import annotations

from bench.startup import QUICK, WARMUPS, render
from tests.bench_helpers import FACTS


def _phase(first_token: float, tokens: dict) -> dict:
    marks = {
        "import": 1.0,
        "load": 2.0,
        "engine": 2.5,
        "warmup": first_token - 1.0,
        "first_token": first_token,
        "done": first_token + 3.0,
    }
    return {"marks": marks, "compiles": 4, "tokens": tokens}


def test_the_table_reports_each_warmup_and_cache_state_and_flags_different_tokens():
    same, other = {"0": [1, 2]}, {"0": [1, 3]}
    result = {
        "command": {
            "cold": [{"first_token_s": 9.0, "exit_s": 10.0}],
            "warm": [{"first_token_s": 4.0, "exit_s": 5.0}],
        },
        "phases": {
            "ahead cold": [_phase(12.0, same)],
            "ahead warm": [_phase(6.0, same)],
            "on-demand cold": [_phase(8.0, same)],
            "on-demand warm": [_phase(5.0, other)],
        },
        "loading": {
            "dequantize_gguf_package_s": 1.3,
            "dequantize_jlora_s": 0.4,
            "import_engine_s": 1.0,
            "import_cpu_offload_extra_s": 0.5,
        },
    }
    text = render(FACTS, QUICK, result)
    assert "| cold | 9.00 | 10.00 |" in text
    assert "| ahead | cold | 1.00 | 2.00 | 2.50 | 11.00 | 12.00 | 15.00 | 4 | yes |" in text
    assert "| on-demand | warm |" in text and "| 4 | NO |" in text
    assert "cold: first token after 8.00 s on demand against 12.00 s ahead (1.50x sooner)" in text
    assert "| 1.30 (gguf package) | 0.40 (jlora) |" in text
    assert "| 1.50 (with `cpu_offload`) | 1.00 |" in text
    assert len(WARMUPS) == 2
