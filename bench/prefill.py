"""Many short prompts: packed prefill (several per compiled call) next to one per call.

Run: `python -m bench.prefill [--quick] [--json PATH]` (`make bench-prefill`; about 5
minutes on two idle cores, compilation included). On a GPU: `--model llama2-7b --dtype
bfloat16 --lengths 128,512` (random weights: prompts of random token ids; a packed call
then holds up to 8 x 512 tokens).

One process, SmolLM2-135M-Instruct fp32, the device engine alone (`LlamaEngine`, no
orchestrator, so only the prefill is timed): N = 64 prompts of 16-64 tokens (seeded
uniform lengths; real text, as `bench.lib.timing` makes it, each prompt starting
elsewhere in the passage), greedy, each into blocks of its own. Two scenarios, each
on an engine of its own: the base model, and LoRA (the reference backend, K = 4 demo
adapters of rank 16 on all 7 projections, loaded beforehand, prompts round-robin over
the adapters and the base model). Two systems per scenario, on the same engine:

- `one_per_call`: `prefill(job)` for each prompt in turn: a compiled call per prompt,
  padded to its prefill bucket (32 or 64 tokens);
- `packed`: one `prefill_many(jobs)`: calls of up to `packed_prefill_prompts` = 16
  prompts of at most `packed_prefill_tokens` = 512 tokens in all, in order, each
  padded to the bucket holding its prompts (`packed_prefill_prompt_tokens` = 64: every
  prompt here joins a packed call).

In the base scenario, two more systems bound what packing can give on this machine:
`products_one_per_call` and `products_packed` run the layers' seven dense products
alone (q, k, v, o, gate, up and down on the real weights, with the residual adds: no
norms, attention, logits or sampling) on the rows each system computes, call by call.
Their ratio is what packing gives from less padding and bigger products alone; each
system's rate against its products' is the share of its time the products take.

Both are warm (one untimed run of each first, which compiles the shapes it meets: the
engines warm up on demand); then `repeats` timed runs, alternating. Reported: prompt
tokens/s (real tokens only), the compiled calls and the tokens computed (padding
included) per run, the median's ratio packed / one_per_call (and products_packed /
products_one_per_call), and whether both systems gave every prompt the same first
token (--json: every timing, its `phase` the scenario).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.report import machine_facts
from bench.lib.timing import Measurement, compare, make_prompts, write_report
from configs import EngineConfig, bucket
from configs.engine import DTYPES
from jlora.adapters.peft import make_demo_adapters
from jlora.adapters.store import store_mib
from jlora.device.llama_engine import LlamaEngine
from jlora.engine.device_api import PrefillJob, SamplingRow
from jlora.model.loading import LoadedModel, load_model

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    prompts: int = 64
    min_len: int = 16
    max_len: int = 64
    packed_tokens: int = 512
    packed_prompts: int = 16  # packed_prefill_prompt_tokens: max_len
    adapters: int = 4  # 0: the base-model scenario only
    rank: int = 16
    repeats: int = 3


def make_engine(loaded: LoadedModel, plan: Plan, adapters: list[Path]) -> LlamaEngine:
    lora: dict = (
        {
            "max_loras": len(adapters),
            "max_lora_rank": plan.rank,
            "host_store_mib": store_mib(loaded.config, [plan.rank] * len(adapters)),
        }
        if adapters
        else {}
    )
    engine = LlamaEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=None,
        engine_config=EngineConfig(
            dtype=plan.dtype,
            max_slots=plan.packed_prompts,
            max_seq_len=plan.packed_tokens,  # the packed buckets end at max_seq_len
            kv_cache_tokens=plan.prompts * plan.max_len,
            packed_prefill_tokens=plan.packed_tokens,
            packed_prefill_prompts=plan.packed_prompts,
            packed_prefill_prompt_tokens=plan.max_len,
            cache_policy="none",  # no cached-prefix variants to compile
            **lora,
        ),
    )
    for slot, path in enumerate(adapters):
        engine.stage_adapter(path.name, str(path))
        engine.install_adapter(path.name, slot, engine.load_adapter(path.name, slot))
    # On demand: the untimed first run of each system compiles the shapes it meets, and
    # nothing else (no decode steps, no cached-prefix variants): a GPU engine unrolls its
    # layers, and a 7B engine's full warm-up compiled for longer than a device call.
    engine.warmup(
        prompt_lengths=[plan.min_len, plan.max_len], max_length=plan.max_len, on_demand=True
    )
    return engine


def make_jobs(loaded: LoadedModel, plan: Plan, engine: LlamaEngine) -> list[PrefillJob]:
    """The prompts, each on its own blocks; with adapters, prompt i on slot i mod (K + 1)
    (slot K: the base model)."""
    cfg = engine.config
    lengths = np.random.default_rng(0).integers(plan.min_len, plan.max_len + 1, plan.prompts)
    texts = make_prompts(loaded, plan.prompts, plan.max_len)
    adapters = len(engine.store.names()) if engine.store is not None else 0
    per_prompt = plan.max_len // cfg.block_size
    jobs = []
    for i, (text, length) in enumerate(zip(texts, lengths.tolist(), strict=True)):
        table = np.full(cfg.blocks_per_seq, cfg.num_blocks, np.int32)
        table[:per_prompt] = np.arange(i * per_prompt, (i + 1) * per_prompt)
        slot = i % (adapters + 1)
        jobs.append(PrefillJob(text[:length], table, GREEDY, slot if slot < adapters else -1))
    return jobs


def one_per_call(engine: LlamaEngine, jobs: list[PrefillJob], first: dict) -> float:
    start = time.perf_counter()
    first["one_per_call"] = [engine.prefill(job).token for job in jobs]
    return time.perf_counter() - start


def packed(engine: LlamaEngine, jobs: list[PrefillJob], first: dict) -> float:
    start = time.perf_counter()
    first["packed"] = [result.token for result in engine.prefill_many(jobs)]
    return time.perf_counter() - start


def computed_rows(engine: LlamaEngine, jobs: list[PrefillJob]) -> dict[str, list[int]]:
    """Per system: the tokens each of its compiled calls computes (padding included)."""
    buckets = engine.config.prefill_buckets
    lengths = [len(job.tokens) for job in jobs]
    calls = engine.packed.calls(dict(enumerate(lengths)))
    alone = set(range(len(jobs))) - {index for call in calls for index in call}
    return {
        "one_per_call": [bucket(buckets, n) for n in lengths],
        "packed": [bucket(buckets, sum(lengths[i] for i in call)) for call in calls]
        + [bucket(buckets, lengths[i]) for i in sorted(alone)],
    }


def dense_products(loaded: LoadedModel) -> Callable[[list[int]], float]:
    """`run(rows)`: seconds for the layers' seven dense products and residual adds alone,
    one compiled call per entry of `rows` on that many rows, each waited for as an
    engine's call is. The weights are the model's stacked ones, scanned over as the
    prefill scans them; the keys and values come out of each layer, as a prefill
    writes them to its cache."""
    layers = loaded.params["layers"]
    kernels = {name: layers[name]["kernel"] for name in layers if name.endswith("_proj")}
    hidden = kernels["q_proj"].shape[1]
    dtype = kernels["q_proj"].dtype

    def layer(x, w):
        keys, values = x @ w["k_proj"], x @ w["v_proj"]
        h = x + (x @ w["q_proj"]) @ w["o_proj"]
        return h + ((h @ w["gate_proj"]) * (h @ w["up_proj"])) @ w["down_proj"], (keys, values)

    products = jax.jit(lambda kernels, x: jax.lax.scan(layer, x, kernels))
    inputs: dict[int, jax.Array] = {}

    def run(rows: list[int]) -> float:
        start = time.perf_counter()
        for n in rows:
            if n not in inputs:
                inputs[n] = jnp.full((n, hidden), 0.01, dtype)
            jax.block_until_ready(products(kernels, inputs[n]))
        return time.perf_counter() - start

    return run


def render(facts: dict, plan: Plan, rows: list[dict]) -> str:
    lines = [
        f"{plan.model} {plan.dtype} | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | "
        f"{facts['date']} | 1-min load avg {facts['load_avg_1min_start']:.1f} at start, "
        f"{facts['load_avg_1min_end']:.1f} at end",
        "",
        f"{plan.prompts} prompts of {plan.min_len}-{plan.max_len} tokens, greedy; packed: up "
        f"to {plan.packed_prompts} prompts of {plan.packed_tokens} tokens per call; median "
        f"of {plan.repeats} warm runs",
        "",
        "| scenario | system | calls | tokens computed | prompt tokens/s | range | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m: Measurement = row["measurement"]
        spread = f"{m.tokens / max(m.seconds):.1f}-{m.tokens / min(m.seconds):.1f}"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else ""
        lines.append(
            f"| {row['scenario']} | {m.system} | {row['calls']} | {row['computed']} | "
            f"{m.tokens_per_s:.1f} | {spread} | {ratio} |"
        )
    lines += [
        "",
        "ratio = packed / one_per_call (medians), and products_packed / "
        "products_one_per_call. "
        + "; ".join(f"{s}: first tokens equal {eq}" for s, eq in _equal(rows).items()),
    ]
    shares = ", ".join(
        f"{row['measurement'].system} {row['share']:.0%}" for row in rows if row["share"]
    )
    if shares:
        lines.append(f"The products' share of each system's time (base model): {shares}.")
    return "\n".join(lines)


def _equal(rows: list[dict]) -> dict[str, str]:
    return {row["scenario"]: row["equal"] for row in rows if row["ratio"] is not None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts, 1 repetition")
    parser.add_argument("--adapters", type=int, default=Plan.adapters, help="0: base only")
    parser.add_argument("--model", default=Plan.model, help="a preset (default %(default)s)")
    parser.add_argument("--dtype", default=Plan.dtype, choices=DTYPES)
    parser.add_argument(
        "--lengths",
        default=f"{Plan.min_len},{Plan.max_len}",
        help="MIN,MAX prompt tokens (default %(default)s; a packed call holds MAX * 8 tokens,"
        " at least 512 and at most the model's context)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    args = parser.parse_args(argv)
    min_len, max_len = (int(n) for n in args.lengths.split(","))
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        adapters=args.adapters,
        min_len=min_len,
        max_len=max_len,
        packed_tokens=max(Plan.packed_tokens, 8 * max_len),
    )
    if args.quick:
        plan = dataclasses.replace(plan, prompts=16, repeats=1)

    facts = machine_facts()
    print("loading the model, compiling...", file=sys.stderr, flush=True)
    loaded = load_model(plan.model, plan.dtype)
    # A packed call holds at most the model's context (cpu-tiny's is 256 tokens).
    plan = dataclasses.replace(
        plan, packed_tokens=min(plan.packed_tokens, loaded.config.max_context)
    )
    if plan.max_len > plan.packed_tokens:
        parser.error(
            f"--lengths: MAX={plan.max_len} exceeds {plan.model}'s context of "
            f"{plan.packed_tokens} tokens"
        )
    rows: list[dict] = []
    products = dense_products(loaded)
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = {"base": []}
        if plan.adapters:
            paths = make_demo_adapters(
                loaded.config, tmp, n=plan.adapters, ranks=[plan.rank], seed=0
            )
            scenarios[f"lora (reference, {plan.adapters} adapters r{plan.rank})"] = paths
        for scenario, adapters in scenarios.items():
            engine = make_engine(loaded, plan, adapters)
            try:
                jobs = make_jobs(loaded, plan, engine)
                tokens = sum(len(job.tokens) for job in jobs)
                first: dict[str, list[int]] = {}
                runs: dict[str, Callable[[], float]] = {
                    name: functools.partial(run, engine, jobs, first)
                    for name, run in (("one_per_call", one_per_call), ("packed", packed))
                }
                computed = computed_rows(engine, jobs)
                if not adapters:  # the bound, once: the products alone on the same rows
                    for name in ("one_per_call", "packed"):
                        runs[f"products_{name}"] = functools.partial(products, computed[name])
                shape = f"{plan.prompts}x({plan.min_len}-{plan.max_len})"
                measured = compare(scenario, shape, tokens, plan.repeats, **runs)
            finally:
                engine.close()
            equal = sum(a == b for a, b in zip(first["one_per_call"], first["packed"], strict=True))
            rates = {m.system: m.tokens_per_s for m in measured}
            for m in measured:
                system = m.system.removeprefix("products_")  # products_X: X's rows
                rows.append(
                    {
                        "scenario": scenario,
                        "measurement": m,
                        "calls": len(computed[system]),
                        "computed": sum(computed[system]),
                        "ratio": (
                            m.tokens_per_s / rates[m.system.replace("packed", "one_per_call")]
                            if system == "packed"
                            else None
                        ),
                        "equal": f"{equal}/{len(jobs)}",
                        "share": (  # its rate as a share of its products' (where they ran)
                            m.tokens_per_s / rates[f"products_{m.system}"]
                            if f"products_{m.system}" in rates
                            else None
                        ),
                    }
                )
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    print(render(facts, plan, rows))
    if args.json:
        write_report(args.json, facts, plan, [row["measurement"] for row in rows])


if __name__ == "__main__":
    main()
