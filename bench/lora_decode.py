"""Decode throughput with 1, 4 and 16 distinct adapters in the batch, next to base-only.

Run: `python -m bench.lora_decode [--quick] [--json PATH]` (about 3 minutes on two
idle cores).

SmolLM2-135M-Instruct fp32, one process, one batch size throughout (B = 16 prompts
of L = 64 tokens, N = 32 greedy tokens each, EOS ignored; timed as in
`bench.throughput`: the first step, which prefills every prompt, is not timed).
Systems, all on the same prompts:

- `no-lora`: an engine without LoRA (max_loras=0): the compiled steps hold no LoRA
  code at all. The baseline of every ratio.
- `lora k=0`: the LoRA engine, every row on the base model (the backend skips the
  LoRA work when no row has an adapter).
- `lora k=1, 4, 16`: the same engine, rows spread round-robin over k distinct
  adapters (demo adapters, rank R = 16, all 7 targets; 16 device slots, all loaded
  and pinned beforehand (`cached`), so no transfer is timed).

Every system runs once untimed, then `repeats` times, alternating; the table shows
the median, the min-max range and the ratio to `no-lora`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path

from bench.throughput import (
    Measurement,
    compare,
    jlora_decode,
    machine_facts,
    make_prompts,
    write_report,
)
from configs import EngineConfig
from jlora.adapters.peft import make_demo_adapters
from jlora.engine.engine import LLMEngine
from jlora.model.loading import LoadedModel, load_model

MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Plan:
    batch: int = 16
    prompt_len: int = 64
    new_tokens: int = 32
    rank: int = 16
    adapter_counts: tuple[int, ...] = (1, 4, 16)
    repeats: int = 3


FULL = Plan()
QUICK = Plan(new_tokens=8, repeats=1)


def make_engine(loaded: LoadedModel, plan: Plan, adapters: dict[str, Path]) -> LLMEngine:
    lora = (
        {"max_loras": len(adapters), "max_lora_rank": plan.rank, "lora_mode": "cached"}
        if adapters
        else {}
    )
    engine = LLMEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(max_slots=plan.batch, max_seq_len=256, **lora),
    )
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    engine.warmup(
        prompt_lengths=[plan.prompt_len], max_length=plan.prompt_len + plan.new_tokens + 2
    )
    return engine


def render(facts: dict, measurements: list[Measurement], plan: Plan) -> str:
    baseline = next(m.tokens_per_s for m in measurements if m.system == "no-lora")
    lines = [
        f"SmolLM2-135M fp32 | {facts['cpu_count']} CPUs ({facts['cpu_model']}) | "
        f"jax {facts['jax']} ({facts['jax_backend']}) | {facts['date']} | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end",
        "",
        f"decode, batch {plan.batch}, prompts of {plan.prompt_len} tokens, {plan.new_tokens} "
        f"new tokens each; adapters of rank {plan.rank} on all 7 projections "
        "(reference backend)",
        "",
        "| system | tokens/s | range | ratio to no-lora |",
        "|---|---:|---:|---:|",
    ]
    for m in measurements:
        spread = f"{m.tokens / max(m.seconds):.1f}-{m.tokens / min(m.seconds):.1f}"
        lines.append(
            f"| {m.system} | {m.tokens_per_s:.1f} | {spread} | {m.tokens_per_s / baseline:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repetition")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    facts = machine_facts()
    print("loading the model, writing adapters, compiling...", file=sys.stderr, flush=True)
    loaded = load_model(MODEL)
    prompts = make_prompts(loaded, plan.batch, plan.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(
            loaded.config, tmp, n=max(plan.adapter_counts), ranks=[plan.rank], seed=0
        )
        adapters = {path.name: path for path in paths}
        engines = {
            "no-lora": make_engine(loaded, plan, {}),
            "lora": make_engine(loaded, plan, adapters),
        }
    names = list(adapters)
    runs = {
        "no-lora": functools.partial(jlora_decode, engines["no-lora"], prompts, plan.new_tokens)
    }
    for k in (0, *plan.adapter_counts):
        rows = [names[row % k] if k else None for row in range(plan.batch)]
        runs[f"lora k={k}"] = functools.partial(
            jlora_decode, engines["lora"], prompts, plan.new_tokens, rows
        )
    shape = f"{plan.batch}x({plan.prompt_len}+{plan.new_tokens})"
    measurements = compare("decode", shape, plan.batch * plan.new_tokens, plan.repeats, **runs)
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    for engine in engines.values():
        engine.close()

    print(render(facts, measurements, plan))
    if args.json:
        write_report(args.json, facts, plan, measurements)


if __name__ == "__main__":
    main()
