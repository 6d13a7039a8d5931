"""What every benchmark records: the machine's facts and the raw results as JSON.

Imports neither torch nor transformers, so the kernel benchmarks run where only jax
is installed (a GPU machine with no network).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

import jax


def machine_facts() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu_model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("model name")), "unknown")  # fmt: skip
    return {
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count() or 0,
        "cpu_model": cpu_model,
        "load_avg_1min_start": os.getloadavg()[0],  # other processes skew a shared machine
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write_report(path: Path, facts: dict, plan: Any, results: list[dict], **extra: Any) -> None:
    """{"machine": facts, "plan": the plan (a dataclass), **extra, "results": results}."""
    report = {"machine": facts, "plan": dataclasses.asdict(plan), **extra, "results": results}
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
