"""bench.suite end to end on cpu-tiny: real `jlora up` processes, the workload sent as
token ids over gRPC (the path `make bench-gpu` takes with Llama-2-7B shapes), the
table, the CDF plots and the raw JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import suite

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

TINY = dataclasses.replace(
    suite.Plan(),
    model="cpu-tiny",
    duration_s=20.0,
    rate_scale=2.0,
    max_requests=6,
    prompt_tokens=(8, 64),
    output_tokens=(4, 12),
    adapters=3,
    ranks=(4, 8),
    max_slots=4,
    max_loras=2,
    warmup_requests=1,
    request_timeout_s=120.0,
    warmup="on-demand",
)


@pytest.mark.slow
def test_two_systems_on_cpu_tiny_token_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "Plan", lambda: TINY)
    suite.main(["--systems", "jlora-cached,jlora-ondemand", "--out-dir", str(tmp_path)])

    [table] = tmp_path.glob("*-cpu-serving.md")
    [raw] = tmp_path.glob("*-cpu-serving.json")
    [workload] = tmp_path.glob("*-cpu-serving-workload.jsonl")
    assert {path.name.rsplit("-", 1)[1] for path in tmp_path.glob("*.png")} == {
        "ttft.png",
        "tpot.png",
    }
    report = json.loads(raw.read_text())
    requests = len(workload.read_text().splitlines()) - 1  # the header line
    assert requests == len(report["results"][0]["requests"]) >= 3
    for result in report["results"]:
        assert result["summary"]["completed"] == requests, result["summary"]
        for record in result["requests"]:
            assert record["error"] is None
            assert record["output_tokens"] > 0 and record["ttft_ms"] <= record["e2e_ms"]
    # Greedy and batch-invariant: both modes give every request the same tokens.
    cached, ondemand = ({r["id"]: r["text"] for r in res["requests"]} for res in report["results"])
    assert cached == ondemand
    lines = table.read_text().splitlines()
    assert any(
        line.startswith("| jlora-cached") and f"{requests}/{requests}" in line for line in lines
    )


def test_same_text_counts_outputs_equal_to_the_baseline():
    def result(system, texts):
        return {
            "system": system,
            "requests": [
                {"id": key, "text": text, "error": None if text is not None else "HTTP 500"}
                for key, text in texts.items()
            ],
        }

    results = [
        result("hf-peft", {"a": "x", "b": "y", "c": None}),
        result("jlora-cached", {"a": "x", "b": "z", "c": "w"}),
    ]
    assert suite.same_text(results) == {"hf-peft": "2/2", "jlora-cached": "1/2"}
    assert suite.same_text(results[1:]) == {}
