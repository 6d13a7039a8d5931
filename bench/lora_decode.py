"""Decode throughput with k distinct adapters in the batch, next to base-only.

Run: `python -m bench.lora_decode [--quick] [--json PATH]` (about 3 minutes on two
idle cores). The defaults are the CPU run below; on a GPU, the issue's step-cost
target is `--model llama2-7b --dtype bfloat16 --batch 32 --counts 32 --backends
bgmv,mbgmv` (32 distinct rank-16 adapters on Llama-2-7B shapes, random weights).

One model, one process, one batch size throughout (B prompts of L = 64 tokens, N
greedy tokens each, EOS ignored; timed as in `bench.lib.timing`: the first step,
which prefills every prompt, is not timed). Systems, all on the same prompts:

- `no-lora`: an engine without LoRA (max_loras=0): the compiled steps hold no LoRA
  code at all. The baseline of every ratio.
- `BACKEND k=0`: a LoRA engine with that backend, every row on the base model.
- `BACKEND k=1, 4, 16`: the same engine, rows spread round-robin over k distinct
  adapters (demo adapters, rank R = 16, all 7 targets; as many device slots as
  adapters, all loaded and pinned beforehand (`cached`), so no transfer is timed).
  `--targets q_proj,v_proj` gives them PEFT's default targets for Llama instead.
  The engines' slots (EngineConfig.lora_targets) cover the adapters' targets, as a
  server for such adapters is configured; with `--slot-targets adapters,all` each LoRA
  engine runs again with slots on all seven projections (`[all-targets]`), the
  engine's default: the projections no adapter touches then cost what the backend
  spends on a target without an adapter.
- `reference[FORM] k=...`: with `--reference-forms auto,gather,over-slots`, the
  reference backend once per decode form (`ReferenceBackend.decode_form`; plain
  `reference` is "auto", the form the engine picks).
- `reference[slots] k=...`, `mbgmv[slots] k=...`: with `--lora-pools kv,slots`, the
  reference and MBGMV backends once per place their adapters live
  (EngineConfig.lora_pool; plain `reference` and `mbgmv` are "kv", in the KV cache's
  pages; BGMV always keeps its own slots).

Every system runs once untimed (which compiles what it meets: the engines compile on
demand), then `repeats` times, alternating; the table shows the median, the min-max
range and the ratio to `no-lora`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path

from bench.lib.engines import SLOT_TARGETS, Plan, System, make_engine, spread
from bench.lib.report import machine_facts
from bench.lib.timing import Measurement, compare, jlora_decode, make_prompts, write_report
from configs.engine import DECODE_ATTENTIONS, DTYPES, LORA_BACKENDS, LORA_POOLS
from jlora.adapters.peft import make_demo_adapters
from jlora.cli.common import names_from, target_list
from jlora.model.loading import load_model
from jlora.model.lora.backends import POOLED
from jlora.model.lora.reference import DECODE_FORMS
from jlora.model.lora.targets import TARGETS


def _systems(plan: Plan) -> list[System]:
    """Each LoRA engine: every backend once per slot targets, the reference backend
    once per form and pool, MBGMV once per pool (the defaults, "auto", "kv" and
    "adapters", named plainly; the others in brackets)."""
    systems = []
    for backend in plan.backends:
        reference = backend == "reference"
        for form in plan.reference_forms if reference else ("auto",):
            for pool in plan.lora_pools if backend in POOLED else ("kv",):
                for targets in plan.slot_targets:
                    tags = [form, pool, f"{targets}-targets"]
                    tags = [t for t in tags if t not in ("auto", "kv", "adapters-targets")]
                    name = f"{backend}[{','.join(tags)}]" if tags else backend
                    systems.append(System(name, backend, form, pool, targets))
    return systems


def render(facts: dict, measurements: list[Measurement], plan: Plan) -> str:
    baseline = next(m.tokens_per_s for m in measurements if m.system == "no-lora")
    lines = [
        f"{plan.model} {plan.dtype} | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | {facts['date']} | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end",
        "",
        f"decode, batch {plan.batch}, prompts of {plan.prompt_len} tokens, {plan.new_tokens} "
        f"new tokens each; adapters of rank {plan.rank} on {', '.join(plan.targets)}; "
        "LoRA engines' slots on the adapters' targets ([all-targets]: on all seven); "
        f"decode attention: {plan.decode_attention}",
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
    parser.add_argument("--model", default=Plan.model, help="a preset (default %(default)s)")
    parser.add_argument("--dtype", default=Plan.dtype, choices=DTYPES)
    parser.add_argument("--batch", type=int, default=Plan.batch)
    parser.add_argument("--rank", type=int, default=Plan.rank)
    parser.add_argument(
        "--counts", default="1,4,16", help="distinct adapters per run, comma-separated"
    )
    for flag, choices, what in (
        ("--backends", LORA_BACKENDS, "the LoRA backends"),
        ("--reference-forms", DECODE_FORMS, "the reference backend's decode forms"),
        ("--lora-pools", LORA_POOLS, "where the reference and MBGMV backends keep adapters"),
        ("--slot-targets", SLOT_TARGETS, "the LoRA engines' slots: the adapters' targets, or all"),
    ):  # each defaults to its first choice, the engine's default
        parser.add_argument(
            flag,
            type=names_from(choices),
            default=choices[0],
            help=f"{what}, comma-separated, of {list(choices)} (default %(default)s)",
        )
    parser.add_argument(
        "--targets",
        type=target_list,
        default=",".join(TARGETS),
        help="the adapters' projections, comma-separated (default: all seven)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=Plan.repeats,
        help="timed runs of each system, alternating (default %(default)s; more on a noisy "
        "machine)",
    )
    parser.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTIONS,
        default=DECODE_ATTENTIONS[0],
        help="every engine's decode attention (EngineConfig.decode_attention)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        batch=args.batch,
        rank=args.rank,
        adapter_counts=tuple(int(k) for k in args.counts.split(",")),
        backends=args.backends,
        reference_forms=args.reference_forms,
        lora_pools=args.lora_pools,
        slot_targets=args.slot_targets,
        targets=args.targets,
        repeats=args.repeats,
        decode_attention=args.decode_attention,
    )
    if args.quick:
        plan = dataclasses.replace(plan, new_tokens=8, repeats=1)

    facts = machine_facts()
    print("loading the model, writing adapters, compiling...", file=sys.stderr, flush=True)
    loaded = load_model(plan.model, plan.dtype)
    prompts = make_prompts(loaded, plan.batch, plan.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(
            loaded.config,
            tmp,
            n=max(plan.adapter_counts),
            ranks=[plan.rank],
            targets=plan.targets,
            seed=0,
        )
        adapters = {path.name: path for path in paths}
        # Compiled on demand: each system's untimed first run compiles the shapes it
        # meets, and nothing else (a GPU engine unrolls its layers, and its full warm-up
        # compiles for minutes: bench/results/2026-11-28-h200-profile.md).
        engines = {"no-lora": make_engine(loaded, plan, {}, on_demand=True)}
        for system in _systems(plan):
            engines[system.name] = make_engine(loaded, plan, adapters, system, on_demand=True)
    names = list(adapters)
    runs = {
        "no-lora": functools.partial(jlora_decode, engines["no-lora"], prompts, plan.new_tokens)
    }
    for system in [name for name in engines if name != "no-lora"]:
        for k in (0, *plan.adapter_counts):
            rows = spread(names, k, plan.batch)
            runs[f"{system} k={k}"] = functools.partial(
                jlora_decode, engines[system], prompts, plan.new_tokens, rows
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
