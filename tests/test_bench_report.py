"""bench.report: a benchmark's result files never overwrite a run of the same day."""

from __future__ import annotations

import datetime

from bench.report import dated_stem


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
