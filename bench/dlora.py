"""dLoRA's two experiments on jlora: dynamic merge/unmerge batching across skewness
(the paper's §7.3, Fig. 10) and queueing delay with request migration on and off
(§7.4, Fig. 11a).

Run: `python -m bench.dlora [--quick]` (part 1; `make bench-dlora` runs both parts;
part 1 takes 5-15 minutes on two cores, merged-only being slow at low skew). Writes
`bench/results/<date>-cpu-dlora.md` and `.json`.

Part 1, batching (one process, one engine): SmolLM2, fp32, 8 demo adapters of rank 8 on
all seven projections, all cached on the device (no loads timed), 8 decode rows. For each
Zipf exponent s (0 is uniform; at s = 3 the top adapter draws 83% of the requests), one
Poisson workload (seeded: the same requests for every system) is replayed open loop
in-process, with exact token counts (EOS ignored), against three systems that share the
one warmed engine (the same compiled steps and adapters; only the batching policy
object is swapped between runs):

- `unmerged-only`: merge "never", today's default (every row's LoRA beside W);
- `merged-only`: merge "always" (one adapter at a time, merged; credits keep others from
  starving);
- `dynamic`: merge "auto" (Algorithms 1-3, thresholds tuned online).

Reported per system and skew: the paper's average latency (the sum of end-to-end
latencies over the sum of output tokens, s/token), mean and P90 end-to-end latency,
throughput (output tokens per second of the run) and the share of merged decode steps.

Part 2, migration (real processes): see `bench/dlora_migration.py`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import dated_stem, machine_facts, write_report
from bench.lib.workloads import Workload, demo_adapter_pool, poisson_workload
from configs import EngineConfig
from jlora.adapters.peft import make_demo_adapters
from jlora.device.llama_engine import build_engine
from jlora.engine.api import Request, SamplingParams
from jlora.engine.merging import DynamicBatcher
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel, load_model

SYSTEMS = ("unmerged-only", "merged-only", "dynamic")
RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    adapters: int = 8
    rank: int = 8
    slots: int = 8
    skews: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)
    requests: int = 48
    rate_per_s: float = 3.0
    prompt_tokens: tuple[int, int] = (24, 64)
    output_tokens: tuple[int, int] = (16, 48)
    max_seq_len: int = 128
    seed: int = 0


QUICK = Plan(skews=(0.0, 3.0), requests=16)


@dataclasses.dataclass
class _Record:
    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


def build(loaded: LoadedModel, plan: Plan, adapters_dir: Path) -> tuple[Orchestrator, list]:
    """One engine with every adapter cached, warmed up for every policy."""
    paths = make_demo_adapters(
        loaded.config, adapters_dir, n=plan.adapters, ranks=(plan.rank,), seed=plan.seed
    )
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(
            max_slots=plan.slots,
            max_seq_len=plan.max_seq_len,
            max_loras=plan.adapters,
            max_lora_rank=plan.rank,
            lora_mode="cached",
            merge="auto",  # so warmup compiles the merged (LoRA-free) steps too
        ),
    )
    for path in paths:
        engine.register_adapter(path.name, path, pin=True)
    engine.warmup(max_length=plan.max_seq_len)
    return engine, demo_adapter_pool(plan.adapters, (plan.rank,))


def use_policy(engine: Orchestrator, system: str) -> None:
    """Swap the batching policy of an idle engine (unmerged first)."""
    if engine.device.merged is not None:
        engine.device.unmerge()
    mode = {"unmerged-only": None, "merged-only": "always", "dynamic": "auto"}[system]
    engine.batcher = None if mode is None else DynamicBatcher(mode, engine.max_slots)


def replay(engine: Orchestrator, workload: Workload, prompts: dict[str, list[int]]) -> dict:
    """Replay `workload` open loop in this process; per-request times from its arrival."""
    pending = collections.deque(workload.requests)
    records: dict[str, _Record] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished:
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            item = pending.popleft()
            records[item.id] = _Record(item.arrival_s)
            sampling = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
            engine.add_request(Request(item.id, prompts[item.id], sampling, item.adapter))
        if not engine.has_unfinished:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        events = engine.step()
        stamp = time.monotonic() - start
        for event in events:
            if event.error is not None:
                raise RuntimeError(f"request {event.request_id} failed: {event.error}")
            record = records[event.request_id]
            record.first = stamp if record.first is None else record.first
            record.last = stamp
            record.tokens += 1
    makespan = time.monotonic() - start
    e2e = np.array([r.last - r.arrival for r in records.values()])  # type: ignore[operator]
    tokens = sum(r.tokens for r in records.values())
    ttft = np.array([r.first - r.arrival for r in records.values()])  # type: ignore[operator]
    counters = engine.batcher.counters if engine.batcher is not None else {}
    merged = counters.get("merged_iterations", 0)
    steps = merged + counters.get("unmerged_iterations", 0)
    return {
        "avg_latency_s_per_token": float(e2e.sum() / tokens),
        "mean_e2e_s": float(e2e.mean()),
        "p90_e2e_s": float(np.percentile(e2e, 90)),
        "mean_ttft_s": float(ttft.mean()),
        "throughput_tokens_per_s": tokens / makespan,
        "merged_share": merged / steps if steps else 0.0,
        "switches": counters.get("switches", 0),
        "tokens": tokens,
    }


def batching(loaded: LoadedModel, plan: Plan) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        engine, pool = build(loaded, plan, Path(tmp))
        assert loaded.tokenizer is not None
        try:
            for skew in plan.skews:
                workload = poisson_workload(
                    rate_per_s=plan.rate_per_s,
                    num_requests=plan.requests,
                    prompt_tokens=plan.prompt_tokens,
                    output_tokens=plan.output_tokens,
                    adapters=pool,
                    zipf_s=skew,
                    seed=plan.seed,
                    tokenizer=loaded.tokenizer,
                )
                prompts = {r.id: loaded.tokenizer.encode(r.prompt) for r in workload.requests}
                top = collections.Counter(r.adapter for r in workload.requests).most_common(1)
                for system in SYSTEMS:
                    use_policy(engine, system)
                    row = replay(engine, workload, prompts)
                    share = top[0][1] / plan.requests
                    row |= {"system": system, "zipf_s": skew, "top_share": share}
                    print(_row_line(row), file=sys.stderr, flush=True)
                    results.append(row)
        finally:
            engine.close()
    return results


def _row_line(row: dict[str, Any]) -> str:
    return (
        f"| {row['zipf_s']:g} | {row['top_share']:.0%} | {row['system']} | "
        f"{row['avg_latency_s_per_token'] * 1e3:.1f} | {row['mean_e2e_s']:.2f} | "
        f"{row['p90_e2e_s']:.2f} | {row['throughput_tokens_per_s']:.1f} | "
        f"{row['merged_share']:.0%} | {row['switches']} |"
    )


def render(facts: dict[str, Any], plan: Plan, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# dLoRA on jlora: dynamic batching across skewness ({facts['date'][:10]})",
        "",
        f"{plan.model} fp32 | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start",
        "",
        f"{plan.requests} Poisson requests at {plan.rate_per_s:g}/s per run, prompts "
        f"{plan.prompt_tokens[0]}-{plan.prompt_tokens[1]} tokens, outputs "
        f"{plan.output_tokens[0]}-{plan.output_tokens[1]} tokens (EOS ignored), over "
        f"{plan.adapters} adapters of rank {plan.rank} (all 7 projections) with Zipf(s) "
        f"popularity; {plan.slots} decode rows. Average latency is the paper's: the sum of "
        "end-to-end latencies over the sum of output tokens.",
        "",
        "| Zipf s | top adapter | system | avg latency (ms/token) | mean e2e (s) | "
        "P90 e2e (s) | tokens/s | merged steps | switches |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *(_row_line(row) for row in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two skews, 16 requests")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    facts = machine_facts()
    loaded = load_model(plan.model)
    rows = batching(loaded, plan)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(args.out, "cpu-dlora")
    (args.out / f"{stem}.md").write_text(render(facts, plan, rows))
    write_report(args.out / f"{stem}.json", facts, plan, rows)
    print(render(facts, plan, rows))


if __name__ == "__main__":
    main()
