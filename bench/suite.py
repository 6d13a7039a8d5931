"""`make bench`: one trace replayed through every system, side by side, on this machine.

`python -m bench.suite [--quick] [--gpu] [--systems a,b,...]`; what it runs is a `Plan`
(the defaults fit a 2-core CPU in about 13 minutes; `GPU_PLAN` for `--gpu`):

1. Adapters: `Plan.adapters` demo PEFT adapters of mixed ranks (`make_demo_adapters`, the
   same files for every system) in a temporary directory.
2. The workload (`bench.lib.workloads`): a window of the Azure 2023 code trace, its
   real inter-arrival times stretched by `Plan.rate_scale` and its real prompt and
   output lengths scaled and clipped to fit a 2-core CPU; adapters drawn from a seeded
   Zipf popularity with a share of base-model requests. Saved as JSONL beside the
   results, so the run can be repeated as is (`python -m bench.serve --workload ...`).
3. Each system in turn, alone on the machine: started as a user starts it (`jlora up`
   with the system's flags, or the PyTorch baseline's server), warmed up with a few
   base-model requests (compilation and first-touch are not what is measured), then
   driven open-loop over its OpenAI-compatible HTTP API by `bench.lib.harness` — the
   same client, the same requests, the same schedule — and stopped. A model without a
   tokenizer (`--gpu`: Llama-2-7B shapes, random weights) gets a workload of
   `WordTokenizer` words, sent as token ids over jlora's gRPC API instead.
4. One table (throughput, TTFT, time per output token, end-to-end latency; ratios to
   the PyTorch baseline; how many greedy outputs equal the baseline's), CDF plots of
   TTFT and time per token, and every request's record as JSON, under bench/results/.

Systems (`SYSTEMS`): jlora's four adapter modes on its default (jnp) LoRA backend —
`cached` (every adapter on the device before serving), `ondemand` (loaded when first
needed, the prefill waits; `Plan.max_loras` slots, fewer than the adapters, so they are
evicted and come back cold), CaraServe-style `cpu-assist` (the prefill starts at once,
layers whose adapter is still in flight run their LoRA on CPU workers) and `auto` (a
cost model picks) — S-LoRA-style (on-demand loading with the MBGMV page-pool kernel),
and `hf-peft`: Hugging Face transformers + PEFT serving mixed-adapter batches
(`bench.baselines.hf_server`). A CPU has no host-to-device link: adapter transfers are
throttled to `Plan.link_gbps` so that loading costs what it would over a slow link.
On a CPU the Pallas kernels run interpreted, so the S-LoRA-style row measures the
interpreter, not the kernel: it is left out unless asked for (`--systems`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lib.harness import run, summarize
from bench.lib.plots import cdf_plot
from bench.lib.processes import ROOT, ServerProcess
from bench.lib.report import dated_stem, machine_facts
from bench.lib.workloads import (
    WordTokenizer,
    Workload,
    azure_workload,
    demo_adapter_pool,
    load_tokenizer,
)
from configs import ModelConfig, list_presets, load_preset
from jlora.adapters.peft import make_demo_adapters
from jlora.cli.up import LISTENING
from jlora.model.loading import load_model

HF_LISTENING = re.compile(r"hf_server listening on (http://\S+)")
BASELINE = "hf-peft"


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    trace: str = "code"
    start_s: float = 0.0
    duration_s: float = 120.0  # of the trace, before compression
    rate_scale: float = 0.4  # its first 48 requests: 0.64 req/s over 75 s
    max_requests: int = 48
    prompt_scale: float = 0.05  # the code trace's prompts are ~2,000 tokens
    prompt_tokens: tuple[int, int] = (16, 256)
    output_scale: float = 1.0
    output_tokens: tuple[int, int] = (8, 64)
    adapters: int = 8
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    zipf_s: float = 1.0
    base_fraction: float = 0.1
    max_slots: int = 8
    max_loras: int = 4  # device slots for ondemand/cpu-assist/auto/slora: fewer than adapters
    link_gbps: float = 0.5
    seed: int = 0
    warmup_requests: int = 3
    request_timeout_s: float = 600.0
    warmup: str = "ahead"  # jlora's --warmup (on-demand: a smoke run, compiles timed)


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    about: str
    command: Callable[[Plan, Path, Path], list[str]]  # (plan, adapters_dir, state_dir)
    ready: re.Pattern[str]
    url: Callable[[tuple[str, ...]], str]  # the ready line's groups -> http://host:port
    grpc_url: Callable[[tuple[str, ...]], str] | None = None  # -> grpc://host:port


def _jlora(mode: str, backend: str = "reference") -> Callable[[Plan, Path, Path], list[str]]:
    def command(plan: Plan, adapters: Path, state: Path) -> list[str]:
        slots = plan.adapters if mode == "cached" else plan.max_loras
        return [
            sys.executable, "-m", "jlora.cli.main", "up", "--model", plan.model,
            "--workers", "1", "--port", "0", "--http-port", "0", "--state-dir", str(state),
            "--adapters-dir", str(adapters), "--lora-mode", mode, "--lora-backend", backend,
            "--max-loras", str(slots), "--max-lora-rank", str(max(plan.ranks)),
            "--max-slots", str(plan.max_slots), "--emulated-link-gbps", str(plan.link_gbps),
            "--warmup", plan.warmup,
        ]  # fmt: skip

    return command


def _hf(plan: Plan, adapters: Path, state: Path) -> list[str]:
    return [
        sys.executable, "-m", "bench.baselines.hf_server", "--model", plan.model,
        "--adapters-dir", str(adapters), "--port", "0", "--max-batch", str(plan.max_slots),
    ]  # fmt: skip


def _up_url(groups: tuple[str, ...]) -> str:
    return groups[1].removesuffix("/v1")


def _up_grpc(groups: tuple[str, ...]) -> str:
    return f"grpc://{groups[0]}"


SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        System("jlora-cached", "every adapter resident", _jlora("cached"), LISTENING, _up_url,
               _up_grpc),
        System("jlora-ondemand", "load, prefill once landed", _jlora("ondemand"), LISTENING,
               _up_url, _up_grpc),
        System("caraserve-style", "cpu-assist", _jlora("cpu-assist"), LISTENING, _up_url,
               _up_grpc),
        System("jlora-auto", "cost model: assist or wait", _jlora("auto"), LISTENING, _up_url,
               _up_grpc),
        System("slora-style", "ondemand + MBGMV", _jlora("ondemand", "mbgmv"), LISTENING,
               _up_url, _up_grpc),
        System(BASELINE, "transformers + PEFT, static batches", _hf, HF_LISTENING,
               lambda groups: groups[0]),
    )
}  # fmt: skip
# `make bench-gpu`: the papers' Llama-2-7B shapes on a GPU, the trace's real prompt
# lengths (clipped to the context) at twice its rate, a real host-to-device link.
GPU_PLAN = Plan(
    model="llama2-7b",
    duration_s=300.0,
    rate_scale=2.0,
    max_requests=600,
    prompt_scale=1.0,
    prompt_tokens=(32, 1536),
    output_tokens=(8, 256),
    adapters=32,
    max_slots=32,
    max_loras=8,
    link_gbps=0.0,
)
DEFAULT_SYSTEMS = tuple(name for name in SYSTEMS if name != "slora-style")


def model_config(model: str) -> ModelConfig:
    """The model's shapes, without loading (or, for a preset, making) its weights."""
    return load_preset(model).config if model in list_presets() else load_model(model).config


def has_tokenizer(model: str) -> bool:
    """False for a random-weight preset (llama2-7b, cpu-tiny): its workload is made of
    `WordTokenizer` words and sent as token ids over gRPC."""
    return model not in list_presets() or load_preset(model).weights.format != "random"


def make_workload(plan: Plan, *, word_ids: bool) -> Workload:
    tokenizer = WordTokenizer() if word_ids else load_tokenizer(plan.model)
    return azure_workload(
        trace=plan.trace,
        start_s=plan.start_s,
        duration_s=plan.duration_s,
        rate_scale=plan.rate_scale,
        max_requests=plan.max_requests,
        prompt_scale=plan.prompt_scale,
        prompt_tokens=plan.prompt_tokens,
        output_scale=plan.output_scale,
        output_tokens=plan.output_tokens,
        adapters=demo_adapter_pool(plan.adapters, plan.ranks),
        zipf_s=plan.zipf_s,
        base_fraction=plan.base_fraction,
        seed=plan.seed,
        tokenizer=tokenizer,
    )


def measure(
    system: System, plan: Plan, workload: Workload, adapters: Path, *, word_ids: bool
) -> dict[str, Any]:
    """Start `system`, warm it up, replay `workload` (as token ids over gRPC if
    `word_ids`), stop it: its summary and records."""
    print(f"bench: {system.name}: starting", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-state-") as state:
        server = ServerProcess(system.command(plan, adapters, Path(state)), system.ready)
        try:
            grpc_url = system.grpc_url if word_ids else None  # main checked it is there
            url = grpc_url(server.groups) if grpc_url else system.url(server.groups)
            warmup = Workload(
                {"warmup": True},
                tuple(
                    dataclasses.replace(request, arrival_s=0.0, adapter=None, rank=0)
                    for request in workload.requests[: plan.warmup_requests]
                ),
            )
            options = {"timeout_s": plan.request_timeout_s, "word_ids": word_ids}
            run(warmup, url, progress=False, **options)
            records = run(workload, url, **options)
        finally:
            code = server.stop()
    if code not in (0, -15):
        print(f"bench: {system.name} exited with {code}:\n{server.tail()}", file=sys.stderr)
    return {
        "system": system.name,
        "about": system.about,
        "command": server.argv,
        "summary": summarize(records),
        "requests": [dataclasses.asdict(record) for record in records],
    }


def same_text(results: list[dict[str, Any]]) -> dict[str, str]:
    """System -> 'k/n': greedy outputs equal to the baseline's, of requests both finished."""
    by_system = {
        result["system"]: {r["id"]: r["text"] for r in result["requests"] if r["error"] is None}
        for result in results
    }
    baseline = by_system.get(BASELINE)
    if baseline is None:
        return {}
    counts = {}
    for system, texts in by_system.items():
        both = [key for key in texts if key in baseline]
        equal = sum(texts[key] == baseline[key] for key in both)
        counts[system] = f"{equal}/{len(both)}"
    return counts


def render(facts: dict, plan: Plan, workload: Workload, results: list[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    base = next((r["summary"] for r in results if r["system"] == BASELINE), None)

    def ratio(summary: dict, metric: str, higher_better: bool) -> str:
        """This system's `metric` against the baseline's: throughput (a number) over the
        baseline's, or the baseline's mean latency ({"mean": ms, ...}) over this one's."""
        ours, theirs = summary[metric], base[metric] if base else None
        if isinstance(ours, dict):
            ours, theirs = ours["mean"], theirs["mean"] if theirs else None
        if not ours or not theirs:
            return "-"
        return f"{(ours / theirs if higher_better else theirs / ours):.2f}x"

    equal = same_text(results)
    link = f"throttled to {plan.link_gbps:g} GB/s" if plan.link_gbps else "over the real link"
    lines = [
        f"# Serving benchmark, {plan.model} on {facts['device']} ({facts['date'][:10]})",
        "",
        f"`python -m bench.suite` (`make bench`). {len(workload.requests)} requests from the "
        f"Azure 2023 {plan.trace} trace (its arrival times x{1 / plan.rate_scale:g} apart, "
        f"prompts x{plan.prompt_scale:g} clipped to {plan.prompt_tokens}, outputs "
        f"x{plan.output_scale:g} clipped to {plan.output_tokens} tokens), {plan.adapters} "
        f"demo adapters of ranks {plan.ranks} with Zipf({plan.zipf_s:g}) popularity and "
        f"{plan.base_fraction:.0%} base-model requests; {plan.max_slots} decode slots; "
        f"{plan.max_loras} device adapter slots (cached: {plan.adapters}); adapter "
        f"transfers {link}. Greedy, EOS ignored.",
        "",
        f"{facts['cpu_model']} x{facts['cpu_count']} | jax {facts['jax']} "
        f"({facts['jax_backend']}) | {facts['date']} | 1-min load avg "
        f"{facts['load_avg_1min_start']:.1f} at start",
        "",
        "| system | done | tokens/s | x baseline | TTFT mean | P50 | P90 | P99 "
        "| x baseline | TPOT mean | P90 | x baseline | e2e mean | P90 | same text |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        s = result["summary"]
        lines.append(
            f"| {result['system']} ({result['about']}) | {s['completed']}/{s['requests']} "
            f"| {s['output_tokens_per_s']:.1f} | {ratio(s, 'output_tokens_per_s', True)} "
            f"| {ms(s['ttft_ms']['mean'])} | {ms(s['ttft_ms']['p50'])} "
            f"| {ms(s['ttft_ms']['p90'])} | {ms(s['ttft_ms']['p99'])} "
            f"| {ratio(s, 'ttft_ms', False)} "
            f"| {ms(s['tpot_ms']['mean'])} | {ms(s['tpot_ms']['p90'])} "
            f"| {ratio(s, 'tpot_ms', False)} "
            f"| {ms(s['e2e_ms']['mean'])} | {ms(s['e2e_ms']['p90'])} "
            f"| {equal.get(result['system'], '-')} |"
        )
    lines += [
        "",
        "Times in ms. x baseline: throughput over the baseline's, the baseline's TTFT or "
        "time per output token (TPOT) over this system's: above 1 is better. same text: "
        "greedy outputs equal to the baseline's, of the requests both finished.",
    ]
    return "\n".join(lines) + "\n"


def plot(out_dir: Path, stem: str, plan: Plan, workload: Workload, results: list[dict]) -> None:
    """CDFs of TTFT (log scale: cold starts and queueing spread it over decades) and TPOT."""
    title = f"{plan.model}, Azure {plan.trace} trace, {len(workload.requests)} requests"
    for metric, label in (
        ("ttft_ms", "time to first token (ms)"),
        ("tpot_ms", "time per output token (ms)"),
    ):
        series = {
            result["system"]: [q[metric] for q in result["requests"] if q[metric] is not None]
            for result in results
        }
        path = out_dir / f"{stem}-{metric.removesuffix('_ms')}.png"
        cdf_plot(path, series, xlabel=label, title=title, log_x=metric == "ttft_ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests, a smoke run")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="Llama-2-7B shapes with random weights (GPU_PLAN), prompts sent as token ids "
        "over gRPC; every jlora system, no PyTorch baseline",
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all but slora-style)",
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names:
        parser.error(f"--systems: {unknown or names} not among {', '.join(SYSTEMS)}")
    plan = GPU_PLAN if args.gpu else Plan()
    if args.quick:
        plan = dataclasses.replace(plan, max_requests=16, duration_s=40.0)
    if args.gpu and args.systems == parser.get_default("systems"):
        names = [name for name in SYSTEMS if name != BASELINE]
    word_ids = not has_tokenizer(plan.model)
    if word_ids and (no_grpc := [name for name in names if SYSTEMS[name].grpc_url is None]):
        parser.error(f"--systems: {no_grpc} need a model with a tokenizer ({plan.model} has none)")

    facts = machine_facts()
    device = "gpu" if args.gpu else "cpu"
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(out_dir, f"{device}-serving")
    workload = make_workload(plan, word_ids=word_ids)
    workload.save(out_dir / f"{stem}-workload.jsonl")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as adapters:
        make_demo_adapters(model_config(plan.model), adapters, n=plan.adapters, ranks=plan.ranks)
        for name in names:
            results.append(
                measure(SYSTEMS[name], plan, workload, Path(adapters), word_ids=word_ids)
            )

    table = render(facts, plan, workload, results)
    (out_dir / f"{stem}.md").write_text(table)
    (out_dir / f"{stem}.json").write_text(
        json.dumps(
            {"machine": facts, "plan": dataclasses.asdict(plan), "workload": workload.meta,
             "results": results},
            indent=1, ensure_ascii=False,
        ) + "\n"
    )  # fmt: skip
    plot(out_dir, stem, plan, workload, results)
    print(table)


if __name__ == "__main__":
    main()
