"""A long prompt arriving while streams decode: whole prefill against chunked prefill.

Run: `python -m bench.chunked_prefill [--quick]` (`make bench-chunked-prefill`; about 5
minutes on two cores). Writes `bench/results/<date>-cpu-chunked-prefill.md` and `.json`.

One process, SmolLM2-135M-Instruct fp32, the orchestrator over `LlamaEngine`: `streams`
requests of `stream_prompt` tokens decode (greedy, EOS ignored, `stream_tokens` each);
after `arrive_after` steps a prompt of `long_prompt` tokens arrives. Each
`prefill_token_budget` runs on an engine of its own: `max_seq_len` (the whole prompt in
the step it is admitted, as before chunking) and smaller budgets (the prompt in chunks
of whole blocks, one per step, beside the decode step). Each engine runs the scenario
once untimed (every shape compiles), then `repeats` timed runs, each with prompts of
its own (no run hits another's prefix cache).

Reported per budget (medians over the runs): the longest wait between two tokens of a
running stream (the stall the long prompt causes), the median wait, the long prompt's
time to first token, and the generated tokens per second over the run; and whether
every request's greedy tokens equal those of the whole prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

from bench.lib import report


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    max_seq_len: int = 2048
    streams: int = 4
    stream_prompt: int = 32
    stream_tokens: int = 160
    long_prompt: int = 1536
    long_tokens: int = 8
    arrive_after: int = 8  # steps
    budgets: tuple[int, ...] = (2048, 512, 256)
    repeats: int = 3


QUICK = dataclasses.replace(Plan(), long_prompt=768, stream_tokens=64, repeats=1)


def run_once(engine: Any, plan: Plan, run: int = 0) -> dict[str, Any]:
    """The scenario on `engine`: token waits of the streams, the long prompt's TTFT.
    Each `run` has prompts of its own, so no run hits the prefix cache of another."""
    from jlora.engine.api import Request, SamplingParams

    tokens: dict[str, list[int]] = {}
    last: dict[str, float] = {}
    waits: list[float] = []
    for i in range(plan.streams):
        prompt = [(31 * i + 7 * k + 997 * run) % 20000 + 100 for k in range(plan.stream_prompt)]
        sampling = SamplingParams(max_tokens=plan.stream_tokens, ignore_eos=True)
        engine.add_request(Request(f"s{i}", prompt, sampling))
    start = time.perf_counter()
    arrived = ttft = None
    steps = generated = 0
    while engine.has_unfinished:
        if steps == plan.arrive_after:
            prompt = [(13 * k + 991 * run) % 20000 + 100 for k in range(plan.long_prompt)]
            sampling = SamplingParams(max_tokens=plan.long_tokens, ignore_eos=True)
            engine.add_request(Request("long", prompt, sampling))
            arrived = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        steps += 1
        for event in events:
            assert event.error is None, event.error
            name = event.request_id
            tokens.setdefault(name, []).append(event.token_id)
            generated += 1
            if name == "long" and ttft is None and arrived is not None:
                ttft = now - arrived
            if name != "long" and name in last and event.finish_reason is None:
                waits.append(now - last[name])
            last[name] = now
    assert ttft is not None
    return {
        "max_wait_s": max(waits),
        "median_wait_s": statistics.median(waits),
        "long_ttft_s": ttft,
        "tokens_per_s": generated / (time.perf_counter() - start),
        "tokens": tokens,
    }


def measure(plan: Plan) -> list[dict[str, Any]]:
    from configs import EngineConfig
    from jlora.device.llama_engine import build_engine
    from jlora.model.loading import load_model

    loaded = load_model(plan.model)
    rows = []
    for budget in plan.budgets:
        engine = build_engine(
            model_config=loaded.config,
            params=loaded.params,
            tokenizer=loaded.tokenizer,
            engine_config=EngineConfig(
                max_slots=plan.streams + 1,
                max_seq_len=plan.max_seq_len,
                prefill_token_budget=budget,
            ),
        )
        try:
            engine.warmup(on_demand=True)
            run_once(engine, plan, run=plan.repeats)  # compiles what the runs use
            runs = [run_once(engine, plan, run) for run in range(plan.repeats)]
        finally:
            engine.close()
        row: dict[str, Any] = {"budget": budget, "runs": runs}
        for key in ("max_wait_s", "median_wait_s", "long_ttft_s", "tokens_per_s"):
            row[key] = statistics.median(run[key] for run in runs)
        rows.append(row)
    return rows


def render(facts: dict, plan: Plan, rows: list[dict[str, Any]]) -> str:
    reference = [run["tokens"] for run in rows[0]["runs"]]
    lines = [
        f"{report.cpu_header(facts, plan.model)} | medians of {plan.repeats}",
        "",
        f"{plan.streams} streams of {plan.stream_prompt}-token prompts decoding "
        f"{plan.stream_tokens} tokens each; after {plan.arrive_after} steps a "
        f"{plan.long_prompt}-token prompt arrives ({plan.long_tokens} tokens to generate).",
        "",
        "| prefill_token_budget | longest wait between a stream's tokens (ms) | median wait "
        "(ms) | long prompt's TTFT (ms) | tokens/s | same tokens |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        same = [run["tokens"] for run in row["runs"]] == reference
        whole = " (whole)" if row["budget"] >= plan.long_prompt else ""
        lines.append(
            f"| {row['budget']}{whole} | {1e3 * row['max_wait_s']:.0f} | "
            f"{1e3 * row['median_wait_s']:.0f} | {1e3 * row['long_ttft_s']:.0f} | "
            f"{row['tokens_per_s']:.1f} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter prompt, one run")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    facts = report.machine_facts()
    rows = measure(plan)
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    text = render(facts, plan, rows)
    print(text)
    title = "Chunked prefill: a long prompt arriving while streams decode"
    for row in rows:
        for run in row["runs"]:
            del run["tokens"]
    report.save_cpu_results("chunked-prefill", title, text, facts, plan, rows)


if __name__ == "__main__":
    sys.exit(main())
