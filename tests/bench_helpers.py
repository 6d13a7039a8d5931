"""What the benchmarks' table tests share: the machine facts of a made-up run."""

from __future__ import annotations

FACTS = {
    "date": "2026-11-25T06:00:00+00:00",
    "device": "cpu",
    "cpu_count": 2,
    "cpu_model": "test",
    "jax": "0",
    "jax_backend": "cpu",
    "load_avg_1min_start": 0.0,
    "load_avg_1min_end": 0.0,
}
