"""What every benchmark records: the machine's facts and the raw results as JSON, under
names that never overwrite an earlier run's (`dated_stem`).

Imports neither torch nor transformers, so the kernel benchmarks run where only jax
is installed (a GPU machine with no network); jax itself only where the facts are
taken, so the simulator's processes, which never use it, do not load it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any


def machine_facts() -> dict[str, Any]:
    import jax

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


def emit(text: str, facts: dict, results: list[dict], *, json_path: Path | None,
         markdown_path: Path | None) -> None:  # fmt: skip
    """Print a run's markdown `text`; write it to `markdown_path` and {"facts", "results"}
    to `json_path` where given."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps({"facts": facts, "results": results}, indent=2) + "\n")
    if markdown_path:
        markdown_path.write_text(text + "\n")


def write_report(path: Path, facts: dict, plan: Any, results: list[dict], **extra: Any) -> None:
    """{"machine": facts, "plan": the plan (a dataclass), **extra, "results": results}."""
    report = {"machine": facts, "plan": dataclasses.asdict(plan), **extra, "results": results}
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


def cpu_header(facts: dict, model: str) -> str:
    """The first line under a CPU table's title: the model, the machine, jax, the date and
    the load average at the start and end of the run (`load_avg_1min_end` set by then)."""
    return (
        f"{model} fp32 | {facts['cpu_count']} CPUs ({facts['cpu_model']}) | "
        f"jax {facts['jax']} ({facts['jax_backend']}) | {facts['date']} | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end"
    )


def dated_stem(directory: Path, name: str) -> str:
    """`<today>-<name>`, or `<today>-<name>-2`, `-3`, ... where a run of the same day has
    written its `.md` in `directory` already: a second run never overwrites the first's
    results."""
    base = f"{datetime.date.today().isoformat()}-{name}"
    stem, count = base, 1
    while (directory / f"{stem}.md").exists():
        count += 1
        stem = f"{base}-{count}"
    return stem


RESULTS = Path(__file__).resolve().parents[1] / "results"


def save_cpu_results(
    name: str,
    title: str,
    text: str,
    facts: dict,
    plan: Any,
    results: list,
    directory: Path = RESULTS,
) -> Path:
    """<directory>/<today>-cpu-<name>.md (`# title`, then `text`) and .json (the facts,
    the plan and `results`), under the next free name (`dated_stem`); the .md's path."""
    stem = directory / dated_stem(directory, f"cpu-{name}")
    stem.with_suffix(".md").write_text(f"# {title}\n\n{text}\n")
    write_report(stem.with_suffix(".json"), facts, plan, results)
    return stem.with_suffix(".md")
