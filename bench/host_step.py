"""The host's time per decode step: the microseconds a step spends outside its compiled
call, where a GPU would sit idle unless the next step were dispatched meanwhile.

Run: `python -m bench.host_step [--rows 8,32,64] [--adapters 32] [--steps 100]
[--json PATH] [--markdown PATH]` (a minute or two on 2 cores).

The `cpu-tiny` preset (two layers of 64 wide: the compiled call is short, so the
host's share stands out), `rows` decode rows, each on one of `adapters` rank-16
adapters on q_proj and v_proj (round-robin, all on the device: `lora_mode` cached),
greedy, no EOS. After the step that prefills them, `steps` decode steps are timed one
by one: the step's wall time (`Orchestrator.step()`, scheduling, the call, detokenizing
and the events), and inside it the device's (the decode executable's call until its
tokens are ready: the engine reads them at once after it). Host time = wall - device,
per step; the table gives its median and 90th percentile.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench.lib.engines import Plan, System, make_engine, spread
from bench.lib.report import emit, machine_facts
from jlora.adapters.peft import make_demo_adapters
from jlora.device.steps import CompiledSteps
from jlora.engine.api import Request, SamplingParams
from jlora.model.loading import load_model

PROMPT = 16
TARGETS = ("q_proj", "v_proj")


class DeviceClock:
    """The seconds spent in the decode calls of an engine's compiled steps."""

    def __init__(self, steps: list[CompiledSteps]) -> None:
        self.seconds = 0.0
        for compiled in steps:
            original = compiled.decode

            def timed(*args: Any, _original=original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                jax.block_until_ready(out[0])
                self.seconds += time.perf_counter() - start
                return out

            compiled.decode = timed  # type: ignore[method-assign]


def measure(loaded, adapters: dict[str, Path], rows: int, steps: int) -> dict[str, Any]:
    plan = Plan(model="cpu-tiny", batch=rows, prompt_len=PROMPT, new_tokens=steps + 2,
                rank=16, targets=TARGETS)  # fmt: skip
    engine = make_engine(loaded, plan, adapters, System("reference", "reference"))
    device = engine.device
    clock = DeviceClock([s for s in (device.steps, device.base_steps) if s is not None])
    names = spread(list(adapters), len(adapters), rows)
    sampling = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    rng = np.random.default_rng(rows)
    for adapter in names:
        prompt = rng.integers(1, loaded.config.vocab_size, PROMPT).tolist()
        engine.add_request(Request(uuid.uuid4().hex, prompt, sampling, adapter=adapter))
    engine.step()  # the prefills, and the first decode
    if engine.num_running != rows:
        raise RuntimeError(f"{engine.num_running} of {rows} rows running after the first step")
    host, device_s = [], []
    for _ in range(steps):
        before, start = clock.seconds, time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        device_s.append(clock.seconds - before)
        host.append(wall - device_s[-1])
    engine.close()
    host_us = sorted(1e6 * h for h in host)
    return {
        "rows": rows,
        "adapters": len(adapters),
        "steps": steps,
        "host_us_median": round(statistics.median(host_us), 1),
        "host_us_p90": round(host_us[int(0.9 * (len(host_us) - 1))], 1),
        "device_us_median": round(1e6 * statistics.median(device_s), 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,64")
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    facts = machine_facts()
    loaded = load_model("cpu-tiny")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(
            loaded.config, Path(tmp), n=args.adapters, ranks=[16], targets=list(TARGETS)
        )
        adapters = {path.name: path for path in paths}
        results = [measure(loaded, adapters, int(n), args.steps) for n in args.rows.split(",")]
    lines = [
        f"# Host time per decode step ({facts['date'][:10]})",
        "",
        f"`python -m bench.host_step` on {facts['cpu_count']} cores ({facts['cpu_model']}), "
        f"JAX {facts['jax']}: cpu-tiny, {args.adapters} rank-16 adapters on q/v, "
        f"{args.steps} decode steps timed one by one. Host = a step's wall time minus its "
        "compiled call's (until the tokens are ready).",
        "",
        "| rows | host µs, median | host µs, p90 | device µs, median |",
        "|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['host_us_median']} | {r['host_us_p90']} | "
            f"{r['device_us_median']} |"
        )
    text = "\n".join(lines)
    emit(text, facts, results, json_path=args.json, markdown_path=args.markdown)


if __name__ == "__main__":
    main()
