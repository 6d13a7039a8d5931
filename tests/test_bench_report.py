"""bench.report: a benchmark's result files never overwrite a run of the same day."""

from __future__ import annotations

import dataclasses
import datetime
import json

from bench.lib.report import dated_stem, save_cpu_results


def test_a_second_run_of_the_day_gets_the_next_free_name(tmp_path):
    today = datetime.date.today().isoformat()
    assert dated_stem(tmp_path, "cpu-cache") == f"{today}-cpu-cache"
    (tmp_path / f"{today}-cpu-cache.md").write_text("the first run")
    (tmp_path / f"{today}-cpu-cache-contention.md").write_text("another scenario's")
    assert dated_stem(tmp_path, "cpu-cache") == f"{today}-cpu-cache-2"
    (tmp_path / f"{today}-cpu-cache-2.md").write_text("the second run")
    assert dated_stem(tmp_path, "cpu-cache") == f"{today}-cpu-cache-3"
    assert dated_stem(tmp_path, "cpu-cache-contention") == f"{today}-cpu-cache-contention-2"
    assert dated_stem(tmp_path, "simulator") == f"{today}-simulator"


@dataclasses.dataclass
class _Plan:
    requests: int = 3


def test_saved_results_hold_the_rows_and_a_second_save_keeps_the_first(tmp_path):
    facts, rows = {"cpu_count": 2}, [{"system": "jlora", "tokens_per_s": 12.5}]
    first = save_cpu_results("replay", "Replay", "| table |", facts, _Plan(), rows, tmp_path)
    second = save_cpu_results("replay", "Replay", "| again |", facts, _Plan(), [], tmp_path)
    assert first.read_text() == "# Replay\n\n| table |\n"
    assert second.name.endswith("-cpu-replay-2.md")
    report = json.loads(first.with_suffix(".json").read_text())
    assert report == {"machine": facts, "plan": {"requests": 3}, "results": rows}
