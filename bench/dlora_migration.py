"""dLoRA's §7.4 experiment on jlora: queueing delay with request-adapter co-migration
on and off (Fig. 11a), side by side in one run, with real processes.

Run: `python -m bench.dlora_migration [--quick] [--out DIR]` (about 4 minutes on two
idle cores; `--quick` about 1). Writes `bench/results/<date>-cpu-dlora-migration.md`
and `.json`.

What runs: two `jlora serve` workers (SmolLM2-135M, fp32, `Plan.slots` decode slots
each, a short context, `Plan.adapters` demo adapters of rank 8 from one
`--adapters-dir`), started once and warmed up directly (compilation is not what is
measured), and in front of them one `jlora router` with `--policy random --seed 0`,
started twice against the same workers: first `--migration off`, then `--migration on`
(a check every `Plan.period_s` seconds; a worker where a request has waited
`Plan.queue_delay_s` seconds for its first token is overloaded). The same seeded
workload is replayed open loop through the router's gRPC API (`bench.lib.harness`)
each time, and the random policy, with the same seed and the same arrivals, makes the
same first placements.

Why there is an imbalance: dLoRA §5.2 — a dispatcher cannot know how long a request
will generate, so requests with long outputs pile up on some replicas while others
drain. The workload makes that explicit: Poisson arrivals whose output lengths are
bimodal (`Plan.long_share` of the requests generate `Plan.long_tokens` tokens, the
rest `Plan.short_tokens`; EOS ignored, so exactly that many), routed by a policy that
looks at neither output length nor load. When one worker's slots fill with long
requests, the short ones sent there wait for a slot while the other worker idles;
with migration on, the router moves queued (then running) requests, and their
adapters, to the idle worker, and each stream goes on without a gap.

What is measured, per request, at the client: the time from sending it to its first
token (TTFT), the practical proxy for dLoRA's queueing delay. It includes the prefill
and the first step on two processes sharing two cores (the run's smallest TTFT, the
"floor" column, about 0.4 s here); what lies above that floor is waiting.
Reported per system: mean and P90 TTFT, mean end-to-end latency, throughput (output
tokens/s over the run's makespan) and the router's migration counters, scraped from
its Prometheus endpoint (`/metrics` on its HTTP port): requests moved (queued,
running), failed moves, co-migration plans solved, adapter loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.harness import run, summarize
from bench.lib.processes import ROOT, ServerProcess, scrape
from bench.lib.report import dated_stem, machine_facts, write_report
from bench.lib.workloads import (
    TextTokenizer,
    Workload,
    demo_adapter_pool,
    load_tokenizer,
    poisson_workload,
)

SYSTEMS = ("migration off", "migration on")
RESULTS = ROOT / "bench" / "results"
WORKER_READY = re.compile(r"jlora serve: listening on (\S+) \(")
ROUTER_READY = re.compile(r"jlora router: gRPC on (\S+), OpenAI HTTP on http://([^/\s]+)/v1")
# Counters scraped from the router, summed over their labels unless a label is named.
COUNTERS = {
    "moved_queued": ("jlora_router_migrations_total", {"state": "queued"}),
    "moved_running": ("jlora_router_migrations_total", {"state": "running"}),
    "moves_failed": ("jlora_router_migrations_failed_total", {}),
    "plans": ("jlora_router_migration_plans_total", {}),
    "plans_moved": ("jlora_router_migration_plans_total", {"result": "moved"}),
    "adapter_loads": ("jlora_router_adapter_loads_total", {}),
    "migration_bytes": ("jlora_router_migration_bytes_total", {}),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    adapters: int = 4
    rank: int = 8
    slots: int = 4
    max_seq_len: int = 256
    requests: int = 36
    rate_per_s: float = 0.6
    prompt_tokens: tuple[int, int] = (16, 32)
    short_tokens: tuple[int, int] = (4, 8)
    long_tokens: tuple[int, int] = (96, 128)
    long_share: float = 0.3
    period_s: float = 0.5
    queue_delay_s: float = 1.0
    router_seed: int = 0
    seed: int = 0
    request_timeout_s: float = 300.0
    warmup: str = "ahead"  # the workers' --warmup


# A smoke run: every part, little waiting; the workers compile what it meets (its
# figures include compiles).
QUICK = Plan(requests=8, rate_per_s=2.0, long_tokens=(32, 48), warmup="on-demand")


def make_workload(plan: Plan, tokenizer: TextTokenizer) -> Workload:
    """Poisson arrivals with bimodal output lengths: `long_share` of the requests (a
    seeded draw) generate `long_tokens`, the rest `short_tokens`; adapters uniform."""
    base = poisson_workload(
        rate_per_s=plan.rate_per_s,
        num_requests=plan.requests,
        prompt_tokens=plan.prompt_tokens,
        output_tokens=plan.short_tokens,
        adapters=demo_adapter_pool(plan.adapters, (plan.rank,)),
        zipf_s=0.0,
        seed=plan.seed,
        tokenizer=tokenizer,
    )
    rng = np.random.default_rng([plan.seed, 74])
    is_long = rng.random(len(base.requests)) < plan.long_share
    long_lengths = rng.integers(plan.long_tokens[0], plan.long_tokens[1] + 1, len(is_long))
    requests = tuple(
        dataclasses.replace(request, max_tokens=int(length)) if long else request
        for request, long, length in zip(base.requests, is_long, long_lengths, strict=True)
    )
    meta = {
        **base.meta,
        "kind": "poisson-bimodal",
        "output_tokens": None,
        "short_tokens": list(plan.short_tokens),
        "long_tokens": list(plan.long_tokens),
        "long_share": plan.long_share,
        "long_requests": int(is_long.sum()),
    }
    return Workload(meta, requests)


def start_workers(plan: Plan, adapters: Path, state: Path) -> list[ServerProcess]:
    workers = []
    try:
        for index in range(2):
            argv = [
                sys.executable, "-m", "jlora.cli.main", "serve", "--model", plan.model,
                "--dtype", "float32", "--port", "0", "--max-seq-len", str(plan.max_seq_len),
                "--max-slots", str(plan.slots), "--adapters-dir", str(adapters),
                "--warmup", plan.warmup,
            ]  # fmt: skip
            print(f"bench: starting worker {index}", file=sys.stderr, flush=True)
            workers.append(ServerProcess(argv, WORKER_READY, env={"JAX_PLATFORMS": "cpu"}))
    except BaseException:
        for worker in workers:
            worker.stop(timeout=10)
        raise
    return workers


def warm_up(plan: Plan, workload: Workload, addresses: list[str]) -> None:
    """A few requests straight to each worker: with and without an adapter, so the
    steps the replay needs are compiled and every adapter has been touched."""
    picks = [dataclasses.replace(r, arrival_s=0.0, max_tokens=4) for r in workload.requests[:3]]
    names = sorted({name for name, _ in demo_adapter_pool(plan.adapters, (plan.rank,))})
    requests = [
        dataclasses.replace(picks[0], id="warm-base", adapter=None, rank=0),
        *(
            dataclasses.replace(picks[i % len(picks)], id=f"warm-{name}", adapter=name)
            for i, name in enumerate(names)
        ),
    ]
    for address in addresses:
        records = run(Workload({"warmup": True}, tuple(requests)), f"grpc://{address}",
                      progress=False, timeout_s=plan.request_timeout_s)  # fmt: skip
        failed = [r.error for r in records if r.error is not None]
        if failed:
            raise RuntimeError(f"warm-up on {address} failed: {failed[0]}")


def measure(
    system: str, plan: Plan, workload: Workload, addresses: list[str], state: Path
) -> dict[str, Any]:
    """Start the router for `system`, replay `workload` through it, scrape, stop it."""
    migration = "on" if system == "migration on" else "off"
    argv = [
        sys.executable, "-m", "jlora.cli.main", "router", "--workers", ",".join(addresses),
        "--port", "0", "--http-port", "0", "--policy", "random",
        "--seed", str(plan.router_seed), "--registry", str(state / f"router-{migration}.sqlite"),
        "--migration", migration, "--migration-period", str(plan.period_s),
        "--migration-queue-delay", str(plan.queue_delay_s),
    ]  # fmt: skip
    print(f"bench: {system}: starting the router", file=sys.stderr, flush=True)
    router = ServerProcess(argv, ROUTER_READY, start_timeout_s=120)
    try:
        grpc_address, http = router.groups
        records = run(workload, f"grpc://{grpc_address}", timeout_s=plan.request_timeout_s)
        counters = scrape(f"http://{http}/metrics", COUNTERS)
    finally:
        code = router.stop(timeout=30)
    if code not in (0, -15):
        print(f"bench: the router exited with {code}:\n{router.tail()}", file=sys.stderr)
    summary = summarize(records)
    long_ids = {r.id for r in workload.requests if r.max_tokens >= plan.long_tokens[0]}
    short_ttft = [
        r.ttft_ms for r in records if r.error is None and r.id not in long_ids and r.ttft_ms
    ]
    return {
        "system": system,
        "command": argv,
        "summary": summary,
        "short_ttft_ms_mean": float(np.mean(short_ttft)) if short_ttft else None,
        "migration": counters,
        "router_log_tail": router.tail(40),
        "requests": [dataclasses.asdict(record) for record in records],
    }


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1e3:.2f}"


def _row(result: dict[str, Any]) -> str:
    s, m = result["summary"], result["migration"]
    rate = s["output_tokens_per_s"]
    ttfts = [r["ttft_ms"] for r in result.get("requests", ()) if r["ttft_ms"] is not None]
    return (
        f"| {result['system']} | {s['completed']}/{s['requests']} "
        f"| {_s(s['ttft_ms']['mean'])} | {_s(s['ttft_ms']['p90'])} "
        f"| {_s(min(ttfts)) if ttfts else '-'} "
        f"| {_s(result['short_ttft_ms_mean'])} | {_s(s['e2e_ms']['mean'])} "
        f"| {'-' if rate is None else f'{rate:.1f}'} "
        f"| {m['moved_queued']} / {m['moved_running']} | {m['moves_failed']} "
        f"| {m['plans_moved']}/{m['plans']} | {m['adapter_loads']} |"
    )


def render(facts: dict[str, Any], plan: Plan, meta: dict[str, Any], results: list[dict]) -> str:
    """The markdown report; `meta`: the workload's (`make_workload`)."""
    long = meta.get("long_requests", "?")
    lines = [
        f"# dLoRA on jlora: queueing delay with migration on and off ({facts['date'][:10]})",
        "",
        f"{plan.model} fp32 | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start",
        "",
        f"Two `jlora serve` workers ({plan.slots} decode slots, context {plan.max_seq_len}, "
        f"{plan.adapters} demo adapters of rank {plan.rank}) behind one `jlora router "
        f"--policy random`; migration checked every {plan.period_s:g} s, a worker overloaded "
        f"once a request has waited {plan.queue_delay_s:g} s for its first token. "
        f"{meta['requests']} Poisson requests at {plan.rate_per_s:g}/s, prompts "
        f"{plan.prompt_tokens[0]}-{plan.prompt_tokens[1]} tokens, outputs bimodal: {long} "
        f"long ({plan.long_tokens[0]}-{plan.long_tokens[1]} tokens), the rest short "
        f"({plan.short_tokens[0]}-{plan.short_tokens[1]}); EOS ignored. The same workload "
        "and router seed for both runs.",
        "",
        "| system | done | queueing delay mean (s) | P90 (s) | floor (s) "
        "| short requests' mean (s) "
        "| e2e mean (s) | tokens/s | moved queued / running | failed moves "
        "| plans moved/solved | adapter loads |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(result) for result in results),
        "",
        "Queueing delay: time to first token measured at the client from its send; it "
        "includes the prefill and first step (floor: the run's smallest), the rest is "
        "waiting. short requests': mean over the short-output requests only. "
        "tokens/s: output tokens over the run's makespan. Migration counters from the "
        "router's /metrics (adapter loads include preloading, on with migration).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests at 2/s, a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    from jlora.adapters.peft import make_demo_adapters
    from jlora.cli.common import model_config

    facts = machine_facts()
    workload = make_workload(plan, load_tokenizer(plan.model))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-dlora-migration-") as tmp:
        adapters, state = Path(tmp) / "adapters", Path(tmp) / "state"
        state.mkdir()
        make_demo_adapters(model_config(plan.model), adapters, n=plan.adapters, ranks=(plan.rank,))
        workers = start_workers(plan, adapters, state)
        try:
            addresses = [worker.groups[0] for worker in workers]
            warm_up(plan, workload, addresses)
            for system in SYSTEMS:
                results.append(measure(system, plan, workload, addresses, state))
                print(_row(results[-1]), file=sys.stderr, flush=True)
        finally:
            for worker in workers:
                worker.stop(timeout=30)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(args.out, "cpu-dlora-migration")
    table = render(facts, plan, workload.meta, results)
    (args.out / f"{stem}.md").write_text(table)
    write_report(args.out / f"{stem}.json", facts, plan, results, workload=workload.meta)
    print(table)


if __name__ == "__main__":
    main()
