"""bench.sampling end to end on the tiny random preset: every system runs, its tokens are
counted, and the report and its JSON say what ran."""

from __future__ import annotations

import json

import pytest

from bench import sampling


@pytest.mark.e2e
def test_the_sampling_bench_runs_every_system(tmp_path, capsys):
    path = tmp_path / "sampling.json"
    sampling.main(["--quick", "--model", "cpu-tiny", "--batch", "4", "--json", str(path)])
    report = capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    systems = sampling.systems(8, grammar=False)  # cpu-tiny has no tokenizer
    assert [row["system"] for row in rows] == list(systems)
    assert all(row["tokens"] == 4 * 8 and len(row["seconds"]) == 1 for row in rows)
    for name in systems:
        assert f"| {name} |" in report
    assert "| greedy | " in report and "| 1.000 |" in report


def test_every_system_is_a_valid_request():
    systems = sampling.systems(32)
    assert systems["greedy"].adjusts_logits is False
    assert systems["penalties"].adjusts_logits and systems["penalties"].min_tokens == 32
    assert systems["all"].logprobs == 5 and systems["all"].temperature == 0.8
    assert systems["all"].structured == systems["grammar"].structured is not None
    assert "grammar" not in sampling.systems(32, grammar=False)
