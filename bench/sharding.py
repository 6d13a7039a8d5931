"""Decode throughput and per-device memory for each sharding preset and LoRA scheme.

Run: `python -m bench.sharding [--presets tp1,tp2,tp4] [--fake-devices N] [--quick]`.
On a machine with several accelerators, leave `--fake-devices` out; on a CPU,
`--fake-devices N` splits the host into N XLA devices (before jax loads) so every
preset runs, but the shards then share the same cores: the figures show what each
device holds and that the sharded steps run, not a speed-up.

Per preset and scheme (`follow-base`, `fully-sharded`): one engine with `adapters`
distinct rank-R adapters on all seven projections, loaded and pinned (`cached`), and
B prompts of L tokens, each row on an adapter; decode tokens/s (N greedy tokens, the
median over repetitions, timed as in `bench.lib.timing`), and the bytes of the
parameters, the KV cache and the adapter slots on the busiest device.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "cpu-tiny"
    presets: tuple[str, ...] = ("tp1", "tp2", "tp4")
    schemes: tuple[str, ...] = ("follow-base", "fully-sharded")
    batch: int = 8
    prompt_len: int = 32
    new_tokens: int = 32
    adapters: int = 4
    rank: int = 16
    repeats: int = 3
    dtype: str = "float32"
    backend: str = "reference"  # on a GPU: bgmv or mbgmv (the Pallas kernels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=Plan.model, help="a preset (default %(default)s)")
    parser.add_argument("--presets", default=",".join(Plan.presets))
    parser.add_argument("--schemes", default=",".join(Plan.schemes))
    parser.add_argument("--dtype", default=Plan.dtype)
    parser.add_argument("--lora-backend", default=Plan.backend, help="reference, bgmv or mbgmv")
    parser.add_argument("--batch", type=int, default=Plan.batch)
    parser.add_argument("--fake-devices", type=int, metavar="N", help="CPU only: N XLA devices")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repetition")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    if args.fake_devices:  # before jax is imported anywhere
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.fake_devices}"
        )
    plan = Plan(
        model=args.model,
        presets=tuple(args.presets.split(",")),
        schemes=tuple(args.schemes.split(",")),
        dtype=args.dtype,
        batch=args.batch,
        backend=args.lora_backend,
    )
    if args.quick:
        plan = dataclasses.replace(plan, new_tokens=8, repeats=1)
    rows, facts = run(plan)
    print(render(plan, rows, facts))
    if args.json:
        from bench.lib.report import write_report

        write_report(args.json, facts, plan, rows)


def run(plan: Plan) -> tuple[list[dict], dict]:
    import functools

    import jax
    import numpy as np

    from bench.lib.report import machine_facts
    from bench.lib.timing import compare, jlora_decode
    from configs import EngineConfig, load_sharding
    from jlora.adapters.peft import make_demo_adapters
    from jlora.device.llama_engine import LlamaEngine, build_engine
    from jlora.model.loading import load_model
    from jlora.model.sharding import per_device_bytes

    def busiest(tree) -> int:  # type: ignore[no-untyped-def]
        """The bytes of `tree` on the device that holds the most of it."""
        totals: dict = {}
        for leaf in jax.tree.leaves(tree):
            for device, size in per_device_bytes(leaf).items():
                totals[device] = totals.get(device, 0) + size
        return max(totals.values())

    facts = machine_facts()
    loaded = load_model(plan.model, plan.dtype)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, loaded.config.vocab_size, (plan.batch, plan.prompt_len)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(loaded.config, tmp, n=plan.adapters, ranks=[plan.rank])
        names = [path.name for path in paths]
        for preset in plan.presets:
            for scheme in plan.schemes:
                sharding = load_sharding(preset).with_lora_sharding(scheme)
                print(f"  {preset} {scheme}", file=sys.stderr, flush=True)
                config = EngineConfig(
                    dtype=plan.dtype, max_slots=plan.batch, max_seq_len=256,
                    max_loras=plan.adapters, max_lora_rank=plan.rank, lora_mode="cached",
                    lora_backend=plan.backend, sharding=sharding,
                    prefill_token_budget=max(plan.batch * plan.prompt_len, 256),  # one step
                )  # fmt: skip
                engine = build_engine(
                    model_config=loaded.config,
                    params=loaded.params,
                    tokenizer=None,
                    engine_config=config,
                )
                try:
                    for path in paths:
                        engine.register_adapter(path.name, path)
                    longest = plan.prompt_len + plan.new_tokens + 2
                    engine.warmup(prompt_lengths=[plan.prompt_len], max_length=longest)
                    adapters = [names[i % len(names)] for i in range(plan.batch)]
                    decode = functools.partial(
                        jlora_decode, engine, prompts, plan.new_tokens, adapters
                    )
                    tokens = plan.batch * plan.new_tokens
                    [measured] = compare("decode", preset, tokens, plan.repeats, jlora=decode)
                    device = engine.device
                    assert isinstance(device, LlamaEngine) and device.lora is not None
                    rows.append(
                        {
                            "preset": preset,
                            "scheme": scheme,
                            "devices": sharding.num_devices,
                            "tokens_per_s": measured.tokens_per_s,
                            "seconds": measured.seconds,
                            "params_bytes": busiest(device.params),
                            "cache_bytes": busiest(device.cache),
                            "adapter_bytes": busiest(device.lora.weights),
                        }
                    )
                finally:
                    engine.close()
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    return rows, facts


def render(plan: Plan, rows: list[dict], facts: dict) -> str:
    mib = 2**20
    lines = [
        f"{plan.model} {plan.dtype} | {facts['device']} ({facts['jax_backend']}) x "
        f"{max(r['devices'] for r in rows)} | {facts['cpu_count']} CPUs | jax {facts['jax']} | "
        f"{facts['date']} | 1-min load {facts['load_avg_1min_start']:.1f} -> "
        f"{facts['load_avg_1min_end']:.1f}",
        "",
        f"decode, batch {plan.batch}, prompts of {plan.prompt_len} tokens, {plan.new_tokens} new "
        f"tokens; {plan.adapters} adapters of rank {plan.rank} on all 7 projections (cached, "
        f"{plan.backend} backend); memory on the busiest device",
        "",
        "| preset | LoRA scheme | tokens/s | params MiB | KV cache MiB | adapter slots MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['preset']} | {row['scheme']} | {row['tokens_per_s']:.1f} | "
            f"{row['params_bytes'] / mib:.2f} | {row['cache_bytes'] / mib:.2f} | "
            f"{row['adapter_bytes'] / mib:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
