"""bench/dlora_migration.py: the bimodal workload, the metrics scrape and the table fast;
the whole `--quick` run (two SmolLM2 workers, the router twice) as a slow test."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.dlora_migration import COUNTERS, QUICK, SYSTEMS, Plan, make_workload, render
from bench.lib.processes import parse_counters
from bench.lib.workloads import WordTokenizer
from tests.bench_helpers import FACTS

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`


def test_the_workload_has_bimodal_output_lengths_and_is_seeded():
    plan = dataclasses.replace(Plan(), requests=200)
    workload = make_workload(plan, WordTokenizer())
    lengths = [r.max_tokens for r in workload.requests]
    long = [n for n in lengths if n >= plan.long_tokens[0]]
    short = [n for n in lengths if n < plan.long_tokens[0]]
    assert all(plan.long_tokens[0] <= n <= plan.long_tokens[1] for n in long)
    assert all(plan.short_tokens[0] <= n <= plan.short_tokens[1] for n in short)
    assert 0.15 < len(long) / len(lengths) < 0.45  # long_share 0.3
    assert workload.meta["long_requests"] == len(long)
    assert all(r.adapter is not None for r in workload.requests)
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)
    assert all(r.prompt_tokens + r.max_tokens <= plan.max_seq_len for r in workload.requests)
    again = make_workload(plan, WordTokenizer())
    assert again.requests == workload.requests


def test_the_router_counters_are_read_from_prometheus_text():
    text = "\n".join(
        [
            "# HELP jlora_router_migrations_total Requests moved",
            "# TYPE jlora_router_migrations_total counter",
            'jlora_router_migrations_total{state="queued"} 3.0',
            'jlora_router_migrations_total{state="running"} 2.0',
            'jlora_router_migrations_created{state="queued"} 1.7e9',
            "jlora_router_migrations_failed_total 1.0",
            'jlora_router_migration_plans_total{result="moved"} 4.0',
            'jlora_router_migration_plans_total{result="empty"} 6.0',
            'jlora_router_adapter_loads_total{cause="migration"} 1.0',
            'jlora_router_adapter_loads_total{cause="preload"} 2.0',
        ]
    )
    counts = parse_counters(text, COUNTERS)
    assert counts["moved_queued"] == 3 and counts["moved_running"] == 2
    assert counts["moves_failed"] == 1
    assert (counts["plans_moved"], counts["plans"]) == (4, 10)
    assert counts["adapter_loads"] == 3
    assert counts["migration_bytes"] == 0  # not there: 0


def _result(system: str, ttft: float, moved: int) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft}
    return {
        "system": system,
        "summary": {
            "requests": 4,
            "completed": 4,
            "output_tokens_per_s": 12.5,
            "ttft_ms": stats,
            "e2e_ms": {"mean": 5000.0},
        },
        "short_ttft_ms_mean": ttft / 2,
        "migration": parse_counters(
            f'jlora_router_migrations_total{{state="queued"}} {moved}', COUNTERS
        ),
    }


def test_the_table_has_one_row_per_system():
    plan = QUICK
    workload = make_workload(plan, WordTokenizer())
    table = render(
        FACTS, plan, workload.meta, [_result(SYSTEMS[0], 3000.0, 0), _result(SYSTEMS[1], 800.0, 5)]
    )
    rows = [line for line in table.splitlines() if line.startswith("| migration")]
    assert len(rows) == 2
    assert rows[0].startswith(
        "| migration off | 4/4 | 3.00 | 6.00 | - | 1.50 | 5.00 | 12.5 | 0 / 0"
    )
    assert rows[1].startswith("| migration on | 4/4 | 0.80 | 1.60 | - | 0.40 | 5.00 | 12.5 | 5 / 0")
    assert f"{len(workload.requests)} Poisson requests" in table


@pytest.mark.slow
def test_the_quick_run_writes_both_systems(tmp_path):
    from bench.dlora_migration import main

    main(["--quick", "--out", str(tmp_path)])
    [report] = tmp_path.glob("*-cpu-dlora-migration.json")
    assert report.with_suffix(".md").exists()
    results = json.loads(report.read_text())["results"]
    assert [r["system"] for r in results] == list(SYSTEMS)
    for result in results:
        summary = result["summary"]
        assert summary["completed"] == summary["requests"] == QUICK.requests
        assert summary["ttft_ms"]["mean"] > 0
    assert results[0]["migration"]["moved_queued"] + results[0]["migration"]["moved_running"] == 0
