"""The sampling controls' cost: a decode step whose rows all ask for log-probabilities
and penalties, next to a plain greedy step.

Run: `python -m bench.sampling [--quick] [--json PATH]` (about 2 minutes on two idle
cores). One engine, one batch of B prompts of L = 64 tokens, N tokens each (timed as in
`bench.lib.timing`: the first step, which prefills every prompt, is not timed). Every
row of a run samples alike:

- `greedy`: no control (the baseline of every ratio);
- `sampled`: temperature 0.8, top-p 0.95, top-k 50 (the sort every sampled step pays);
- `logprobs`: greedy, each token's log-probability and the 5 most likely
  (OpenAI's `logprobs=5`);
- `penalties`: greedy with repetition_penalty 1.1, presence and frequency penalties
  0.5, a logit bias on 8 tokens and min_tokens of N (the stop tokens banned throughout);
- `grammar`: greedy, the text a JSON object whose one string is at least 400
  characters long (so no row completes it within N tokens): the grammar's mask is
  computed on the host before each step and applied in it;
- `all`: sampled, with log-probabilities, every penalty and the grammar.

A model without a tokenizer (a random-weight preset) runs no grammar.

Each system runs once untimed (compiling what it meets), then `repeats` times,
alternating; the table shows the median tokens/s, the range and the ratio to `greedy`.
The issue's target: `all` within 1.15x of `greedy`'s step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

from bench.lib.engines import Plan, make_engine
from bench.lib.report import machine_facts
from bench.lib.timing import Measurement, compare, jlora_decode, make_prompts, write_report
from configs.engine import DTYPES
from jlora.engine.api import SamplingParams, StructuredOutput
from jlora.model.loading import load_model

STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
    "additionalProperties": False,
}


def systems(new_tokens: int, grammar: bool = True) -> dict[str, SamplingParams]:
    """Each system's sampling; `grammar`: with the systems that constrain the text."""
    sampled = dict(temperature=0.8, top_p=0.95, top_k=50, seed=1)
    structured = StructuredOutput("json_schema", json.dumps(STORY)) if grammar else None
    penalties = dict(
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=tuple((token, -5.0) for token in range(100, 108)),
        min_tokens=new_tokens,
    )
    out = {
        "greedy": SamplingParams(),
        "sampled": SamplingParams(**sampled),
        "logprobs": SamplingParams(logprobs=5),
        "penalties": SamplingParams(max_tokens=new_tokens + 2, **penalties),
        "grammar": SamplingParams(structured=structured),
        "all": SamplingParams(
            max_tokens=new_tokens + 2, logprobs=5, structured=structured, **sampled, **penalties
        ),
    }
    return out if grammar else {name: s for name, s in out.items() if name != "grammar"}


def render(facts: dict, measurements: list[Measurement], plan: Plan) -> str:
    baseline = next(m for m in measurements if m.system == "greedy")
    lines = [
        f"{plan.model} {plan.dtype} | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | {facts['date']} | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end",
        "",
        f"decode, batch {plan.batch}, prompts of {plan.prompt_len} tokens, {plan.new_tokens} "
        "new tokens each, every row sampling alike",
        "",
        "| system | tokens/s | range | step time / greedy's |",
        "|---|---:|---:|---:|",
    ]
    for m in measurements:
        spread = f"{m.tokens / max(m.seconds):.1f}-{m.tokens / min(m.seconds):.1f}"
        ratio = baseline.tokens_per_s / m.tokens_per_s
        lines.append(f"| {m.system} | {m.tokens_per_s:.1f} | {spread} | {ratio:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repetition")
    parser.add_argument("--model", default=Plan.model, help="a preset (default %(default)s)")
    parser.add_argument("--dtype", default=Plan.dtype, choices=DTYPES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each system")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        batch=args.batch,
        repeats=args.repeats,
        adapter_counts=(),
    )
    if args.quick:
        plan = dataclasses.replace(plan, new_tokens=8, repeats=1)

    facts = machine_facts()
    print("loading the model, compiling...", file=sys.stderr, flush=True)
    loaded = load_model(plan.model, plan.dtype)
    prompts = make_prompts(loaded, plan.batch, plan.prompt_len)
    engine = make_engine(loaded, plan, {}, on_demand=True)
    runs = {
        name: functools.partial(jlora_decode, engine, prompts, plan.new_tokens, sampling=sampling)
        for name, sampling in systems(plan.new_tokens, loaded.tokenizer is not None).items()
    }
    shape = f"{plan.batch}x({plan.prompt_len}+{plan.new_tokens})"
    measurements = compare("decode", shape, plan.batch * plan.new_tokens, plan.repeats, **runs)
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    engine.close()

    print(render(facts, measurements, plan))
    if args.json:
        write_report(args.json, facts, plan, measurements)


if __name__ == "__main__":
    main()
