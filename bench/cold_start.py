"""Cold starts: time to first token for cached, ondemand, cpu-assist and auto, and what
one adapter load costs.

Run: `python -m bench.cold_start [--quick] [--model smollm2-135m] [--dtype D] [--rate R]
[--link-gbps G] [--sections trace,loads]` (`make bench-cold-start`; a few minutes on a
2-core CPU). `--link-gbps 0` leaves transfers unthrottled: on a GPU, the real link. The
tables are written after every mode, so a run cut short keeps the modes it finished.
The host-callback overhead a CPU-routed layer pays is section 4 of `bench.cpu_offload`
(the engine's own callbacks, next to the io_callback pairs this bench used to time).

1. Time to first token on a trace: seeded Poisson arrivals, adapters drawn from a
   Zipf(1.2) popularity over `--adapters` demo adapters of mixed ranks, prompts of
   40-200 tokens, 8 new tokens each. `max_loras` device slots hold fewer adapters than
   the trace uses, so adapters are evicted and come back cold; transfers are throttled
   to `--link-gbps` (`emulated_link_gbps`; a CPU has no host-to-device link). `cached`
   pins every adapter before the trace (as many slots as adapters): the lower bound.
   TTFT runs from a request's arrival to its first token; "cold" requests are those
   whose adapter was not resident when they arrived. Every engine is warmed up first;
   a step shape compiled during the trace anyway (a stall) is counted in the mode's
   counters as `compiles_in_trace`.

2. Adapter loads: one adapter at a time copied to a slot of rank `max(--ranks)` over
   the emulated link at `--link-gbps` and installed (`load_adapter`, then
   `install_adapter`, on one engine with no requests), for a small adapter (rank 8,
   q/v) and a large one (the slots' rank, every target), alternating, medians of
   `LOAD_REPEATS`. Its bytes next to the bytes the transfer sent (the engine's
   `Transfer.nbytes`) and to the link's floor for its real bytes; the install (on the
   scheduler thread, in serving) apart.

The modes run one after another in one process, on the same trace; the table records
the 1-minute load average. Results are ratios on this machine, not absolute claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.report import machine_facts, write_report
from configs import EngineConfig
from configs.engine import DTYPES
from jlora.adapters.peft import make_demo_adapters
from jlora.adapters.store import store_mib
from jlora.cli.common import names_from
from jlora.device.llama_engine import LlamaEngine, build_engine
from jlora.engine.api import Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import load_model
from jlora.model.lora.targets import TARGETS, rank_row_bytes, target_shapes

MODES = ("cached", "ondemand", "cpu-assist", "auto")
SECTIONS = ("trace", "loads")
LOAD_REPEATS = 7


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    requests: int = 24
    rate_per_s: float = 0.5
    adapters: int = 6
    ranks: tuple[int, ...] = (16, 32, 64)
    max_loras: int = 2
    link_gbps: float = 0.1
    new_tokens: int = 8
    seed: int = 0


# -- 1. time to first token on a trace ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float
    adapter: str
    prompt: list[int]


def make_trace(plan: Plan, names: list[str], vocab: int) -> list[Arrival]:
    rng = np.random.default_rng(plan.seed)
    weights = 1.0 / np.arange(1, len(names) + 1) ** 1.2
    picks = rng.choice(len(names), plan.requests, p=weights / weights.sum())
    gaps = rng.exponential(1.0 / plan.rate_per_s, plan.requests)
    lengths = rng.integers(40, 201, plan.requests)
    return [
        Arrival(float(t), names[i], rng.integers(0, vocab, n).tolist())
        for t, i, n in zip(np.cumsum(gaps), picks, lengths, strict=True)
    ]


def make_engine(loaded, plan: Plan, mode: str, adapters: dict[str, Path]) -> Orchestrator:
    config = EngineConfig(
        dtype=plan.dtype,
        max_slots=4,
        max_seq_len=256,
        max_loras=len(adapters) if mode == "cached" else plan.max_loras,
        max_lora_rank=max(plan.ranks),
        lora_mode=mode,
        emulated_link_gbps=0.0 if mode == "cached" else plan.link_gbps,
        host_store_mib=store_mib(loaded.config, [max(plan.ranks)] * len(adapters)),
    )
    engine = build_engine(
        model_config=loaded.config, params=loaded.params, tokenizer=None, engine_config=config
    )
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    engine.warmup(prompt_lengths=list(range(40, 201)), max_length=200 + plan.new_tokens)
    return engine


def replay(engine: Orchestrator, trace: list[Arrival], new_tokens: int) -> list[dict]:
    """Feed the trace in real time; per request: TTFT and whether it arrived cold."""
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    results: dict[str, dict] = {}
    start, pending = time.perf_counter(), list(enumerate(trace))
    while pending or engine.has_unfinished:
        now = time.perf_counter() - start
        while pending and pending[0][1].at_s <= now:
            index, arrival = pending.pop(0)
            rid = f"r{index}"
            assert engine.adapters is not None
            cold = not engine.adapters.slots.is_ready(arrival.adapter)
            results[rid] = {"adapter": arrival.adapter, "cold": cold, "arrived": now}
            engine.add_request(Request(rid, arrival.prompt, sampling, adapter=arrival.adapter))
        if not engine.has_unfinished:
            time.sleep(max(0.0, min(pending[0][1].at_s - now, 0.05)))
            continue
        for event in engine.step():
            result = results[event.request_id]
            if "ttft_s" not in result:
                result["ttft_s"] = time.perf_counter() - start - result["arrived"]
    return list(results.values())


def summarize(mode: str, results: list[dict], counters: dict) -> dict:
    def stats(values: list[float]) -> dict:
        if not values:
            return {"n": 0}
        return {
            "n": len(values),
            "median_ms": 1e3 * statistics.median(values),
            "p90_ms": 1e3 * float(np.percentile(values, 90)),
            "mean_ms": 1e3 * statistics.fmean(values),
        }

    cold = [r["ttft_s"] for r in results if r["cold"]]
    return {
        "mode": mode,
        "all": stats([r["ttft_s"] for r in results]),
        "cold": stats(cold),
        "counters": counters,
    }


# -- 2. adapter loads over the emulated link ----------------------------------------------


def load_times(loaded, plan: Plan, root: Path) -> list[dict]:
    """Per adapter (rank 8 on q/v, and max rank on every target): its real bytes, the
    bytes its transfer sent, and the median seconds of a load plus install."""
    max_rank = max(plan.ranks)
    cases = {"r8-qv": (8, ("q_proj", "v_proj")), f"r{max_rank}-all": (max_rank, TARGETS)}
    config = EngineConfig(
        dtype=plan.dtype, max_slots=1, max_seq_len=64, max_loras=1, max_lora_rank=max_rank,
        emulated_link_gbps=plan.link_gbps, host_store_mib=store_mib(loaded.config, [8, max_rank]),
    )  # fmt: skip
    engine = build_engine(
        model_config=loaded.config, params=loaded.params, tokenizer=None, engine_config=config
    )
    device = cast(LlamaEngine, engine.device)
    assert device.lora is not None
    rows: dict[str, dict] = {}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    installs: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for name, (rank, targets) in cases.items():
            [path] = make_demo_adapters(
                loaded.config, root / name, n=1, ranks=[rank], targets=targets
            )
            engine.register_adapter(name, str(path))
            real = rank * rank_row_bytes(
                target_shapes(loaded.config), targets, loaded.config.num_layers,
                jnp.dtype(config.dtype).itemsize,
            )  # fmt: skip
            rows[name] = {"adapter": name, "rank": rank, "targets": list(targets)}
            floor = real / plan.link_gbps / 1e6 if plan.link_gbps else None  # 0: the real link
            rows[name] |= {"real_bytes": real, "link_floor_ms": floor}
        for _ in range(LOAD_REPEATS):
            for name, row in rows.items():  # alternating: the machine's drift hits both
                start = time.perf_counter()
                payload = device.load_adapter(name, 0)
                landed = time.perf_counter()
                device.install_adapter(name, 0, payload)
                jax.block_until_ready(device.lora.weights)
                samples[name].append(time.perf_counter() - start)
                installs[name].append(time.perf_counter() - landed)
                row["sent_bytes"] = getattr(payload, "nbytes", None)  # the engine's count
    finally:
        engine.close()
    for name, row in rows.items():
        row["load_median_ms"] = 1e3 * statistics.median(samples[name])
        row["install_median_ms"] = 1e3 * statistics.median(installs[name])
    return list(rows.values())


def render_loads(plan: Plan, loads: list[dict]) -> list[str]:
    lines = [
        f"## Adapter loads, {plan.model}, slots of rank {max(plan.ranks)}, "
        f"{_link(plan)} (medians of {LOAD_REPEATS})",
        "",
        "| adapter | real MB | sent MB | link floor ms (real bytes) | load + install ms "
        "| of which install ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in loads:
        sent = "?" if row["sent_bytes"] is None else f"{row['sent_bytes'] / 1e6:.2f}"
        lines.append(
            f"| {row['adapter']} | {row['real_bytes'] / 1e6:.2f} | {sent} "
            f"| {_ms(row['link_floor_ms'])} | {row['load_median_ms']:.1f} "
            f"| {row['install_median_ms']:.1f} |"
        )
    return lines


def _link(plan: Plan) -> str:
    return f"link {plan.link_gbps} GB/s" if plan.link_gbps else "the real host-to-device link"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(facts: dict, plan: Plan, rows: list[dict], loads: list[dict]) -> str:
    lines = [
        f"# Cold starts: {facts['cpu_count']} x {facts['cpu_model']}, device {facts['device']}",
        "",
        f"jax {facts['jax']}, {facts['date']}, 1-minute load average "
        f"{facts['load_avg_1min_start']:.2f} at the start, {facts['load_avg_1min_end']:.2f} "
        "at the end",
    ]
    if rows:
        lines += [
            "",
            f"## Time to first token, {plan.model}, {plan.requests} requests at "
            f"{plan.rate_per_s}/s, {plan.adapters} adapters (ranks {plan.ranks}), "
            f"{plan.max_loras} device slots, {_link(plan)}",
            "",
            "| mode | cold n | cold median ms | cold p90 ms | all median ms | all p90 ms "
            "| vs cached (cold median) |",
            "|---|---|---|---|---|---|---|",
        ]
    cached = next((r for r in rows if r["mode"] == "cached"), None)
    for row in rows:
        cold, every = row["cold"], row["all"]
        ratio = ""
        if cached and cold.get("n") and cached["all"].get("n"):
            ratio = f"{cold['median_ms'] / cached['all']['median_ms']:.2f}x"
        lines.append(
            f"| {row['mode']} | {cold.get('n', 0)} | {cold.get('median_ms', 0):.0f} "
            f"| {cold.get('p90_ms', 0):.0f} | {every['median_ms']:.0f} | {every['p90_ms']:.0f} "
            f"| {ratio} |"
        )
    if rows:
        lines += ["", "Counters: " + "; ".join(f"{r['mode']}: {r['counters']}" for r in rows)]
    if loads:
        lines += ["", *render_loads(plan, loads)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, cpu-tiny")
    parser.add_argument("--model", default=Plan.model)
    parser.add_argument("--dtype", default=Plan.dtype, choices=DTYPES)
    parser.add_argument("--rate", type=float, default=Plan.rate_per_s, help="requests per second")
    parser.add_argument("--link-gbps", type=float, default=Plan.link_gbps)
    parser.add_argument("--requests", type=int, default=Plan.requests)
    parser.add_argument("--modes", type=names_from(MODES), default=",".join(MODES))
    parser.add_argument("--sections", type=names_from(SECTIONS), default=",".join(SECTIONS))
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument("--markdown", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        link_gbps=args.link_gbps,
        requests=args.requests,
        rate_per_s=args.rate,
    )
    if args.quick:
        plan = dataclasses.replace(plan, model="cpu-tiny", requests=8, link_gbps=0.0005)
    facts = machine_facts()
    loaded = load_model(plan.model, plan.dtype)
    rows: list[dict] = []
    loads: list[dict] = []

    def report() -> None:  # after every mode, so a run cut short keeps what it measured
        facts["load_avg_1min_end"] = os.getloadavg()[0]
        text = render(facts, plan, rows, loads)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        if args.json:
            write_report(args.json, facts, plan, rows, loads=loads)

    with tempfile.TemporaryDirectory() as tmp:
        if "trace" in args.sections:
            paths = make_demo_adapters(
                loaded.config, tmp, n=plan.adapters, ranks=list(plan.ranks), seed=plan.seed
            )
            adapters = {path.name: path for path in paths}
            trace = make_trace(plan, list(adapters), loaded.config.vocab_size)
        for mode in args.modes if "trace" in args.sections else ():
            print(f"{mode}: warming up, then {len(trace)} requests", file=sys.stderr, flush=True)
            start = time.perf_counter()
            engine = make_engine(loaded, plan, mode, adapters)
            warm = time.perf_counter()
            steps = engine.device.steps  # type: ignore[attr-defined]
            compiled = steps.num_compiles
            try:
                results = replay(engine, trace, plan.new_tokens)
                counters = dict(engine.counters)
                if late := steps.num_compiles - compiled:  # a stall no warm-up should leave
                    counters["compiles_in_trace"] = late
                rows.append(summarize(mode, results, counters))
            finally:
                engine.close()
            rows[-1] |= {"warmup_s": warm - start, "replay_s": time.perf_counter() - warm}
            print(f"  {mode}: warm-up {warm - start:.0f} s, replay {rows[-1]['replay_s']:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            report()
        if "loads" in args.sections:
            print("adapter loads...", file=sys.stderr, flush=True)
            loads = load_times(loaded, plan, Path(tmp) / "loads")
    report()
    print(render(facts, plan, rows, loads))


if __name__ == "__main__":
    main()
