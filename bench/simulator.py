"""Cluster simulator: the papers' 60-instance scheduling study (Toppings §7.4, CaraServe
§7.5) with the router's own policies.

Run: `python -m bench.simulator [--rates 80,120,160] [--policies rank-aware,random]
[--instances 60] [--duration-s 600] [--profile perf.json] [--json rows.json]`; the
markdown table and the plots go to `--out-dir` (bench/results/). The papers ran 340
req/s of the MAF trace; here an A10 instance (32 ms a decode step, 211-token answers)
starts to miss the SLO under most-idle past 2 req/s, so the default rates are 80-180.

A request's life:

1. Arrival. The Azure LLM inference trace 2023 (`conv.csv`) gives arrival times,
   rescaled to the cluster rate (the hour repeats if 10 minutes need more requests),
   and output lengths. Its prompts (1,155 tokens on average) are scaled to a mean of
   `--prompt-mean` tokens, 70 by default: the papers' study uses LMSYS-Chat-1M's
   lengths (Toppings §7.1), about 70 prompt and 215 output tokens on average (its
   paper's Table 1, as we recall it; the trace's outputs average 211). `--prompt-mean
   0` keeps the trace's prompts: an arrival's prefill (430 ms, 13 decode steps) then
   stalls its instance's batch long before the batch is large enough for rank padding
   (0.23 ms per request at rank 64) to matter, and rank-aware ties with most-idle
   (measured: 99.5/99.4% at 10 req/s, 94.5/94.6% at 20, 88/87% at 30). Prompt + output
   fit Llama-2's 4,096 tokens. A request's rank is uniform over 8/16/32/64 (the ranks
   Toppings §5 profiles; "four different LoRA ranks", §7.4), its adapter one of that
   rank's `--adapters / 4`, Zipf-popular; seeded.
2. Routing. Each instance's `router.policies.WorkerStats` (its running batch's ranks,
   its queue as `QueuedRequest`s, free slots, resident adapters) goes to
   `policy.choose(RouteRequest(...), stats)`, the policy `router.app.build_policy` makes
   for `jlora router --policy NAME`, with its default SLO; dLoRA's policy is
   shortest-pending (its dispatcher; dLoRA's migration between replicas is not
   modelled). avg_resp_len and adapter_load_ms are the workload's means.
3. Adapter load. A missing adapter is copied to the device, one copy at a time per
   instance, from the moment its request is routed: rank·1.5 MiB (Llama-2-7B's q, k, v;
   Toppings §2.3: "approximately 100 MiB" at rank 64) over `--link-gbps`. The copy does
   not stall the GPU; only its requests' prefill waits. `adapter_slots` adapters fit,
   the least recently routed unused one is evicted (none in use: the set overflows).
4. Iterations: continuous batching as in LightLLM and vLLM (CaraServe §2.3, Fig. 2: an
   arrival's prefill blocks the running batch's decoding). An instance that is idle or
   ends an iteration starts, at once, a prefill of the queued requests whose adapters
   are loaded (oldest first, up to its free slots and `max_prefill_tokens`, at least
   one; PrePerf(ranks, prompts) ms; each gets its first token at the end and joins the
   batch), else a decode step of the batch (DecPerf(ranks) ms, a token each), else it
   waits. At one time, iterations and loads end, then arrivals are routed, then idle
   instances start in instance order: deterministic. 64 slots: paged KV holds 11-13k
   tokens on an A10 beside the weights and 32 adapters, 60-75 requests of this
   workload's mean occupancy (prompt + half the output).
5. Metrics. TTFT = first token - arrival. TPT = (last token - first token) / (tokens
   - 1): the decode phase, with the stalls other requests' prefills cause (none for a
   single-token output). Toppings §7.1 also counts the prefill's token; we leave the
   request's own prefill and queueing to TTFT, since the SLO Algorithm 1 enforces is a
   decode iteration (DecPerf <= SLO). SLO = 1.5 x the no-LoRA time per token = 1.5 x
   DecPerf(no adapter) = 1.5 β (Eq. 2's decode time without LoRA at any batch size,
   build_policy's default). SLO attainment: the share of requests with TPT <= SLO.

Performance models (`paper_profile`; `--profile` reads a `jlora profile` JSON instead):
Llama-2-7B on an A10, CaraServe Table 2's GPU for 7B. Decode: Toppings §2.3, Fig. 6
(CaraServe Fig. 5) measure 24 requests of rank 32 at 34.8 ms and 16 of rank 64 at 35.8
ms under BGMV (35.3, 35.9 under MBGMV); BGMV α = 0.0036 ms per request·rank, β = 32.07
ms match both after rounding and the paper's conclusion (tests/test_router_policies.py),
MBGMV α = 0.6/256, β = 33.5. Prefill: Toppings §7.3 prefills 64 tokens in 61 ms, 256 in
126 ms: γ = 65/192 ms per token, β = 61 - 64γ; no rank term is given, so α = 0.

Speed: DecPerf is recomputed only when a batch changes, a WorkerStats only when its
instance changes; a request ends at a decode step count (a heap per instance), so a
step costs O(1) plus its completions. (policy, rate) runs go to a process pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.lib.cluster import (
    LINK_GBPS,
    InstanceConfig,
    Request,
    RunResult,
    WorkloadSpec,
    load_ms_per_rank,
    make_workload,
    simulate,
)
from bench.lib.report import dated_stem
from bench.lib.workloads import DATA_DIR
from router.app import SLO_TIMES_BASE, build_policy
from router.perf_model import PerfModel, PerfProfile
from router.policies import POLICIES, Policy

PAPER_POLICIES = ("rank-aware", "shortest-pending", "most-idle", "first-fit", "random")
DEFAULT_RATES = (80.0, 100.0, 120.0, 140.0, 160.0, 180.0)


def paper_profile(kind: str = "bgmv") -> PerfProfile:
    """Llama-2-7B on an A10 from the papers' numbers (see the module docstring)."""
    decode = {
        "bgmv": PerfModel("bgmv", alpha=0.0036, beta=32.07),
        "mbgmv": PerfModel("mbgmv", alpha=0.6 / 256, beta=33.5),
    }[kind]
    gamma = (126.0 - 61.0) / (256 - 64)
    prefill = PerfModel(decode.kind, alpha=0.0, beta=61.0 - 64 * gamma, gamma=gamma)
    return PerfProfile(prefill, decode, device="A10 (papers)", base_model="llama2-7b")


# -- policies, metrics, sweep ---------------------------------------------------------


def slo_ms(profile: PerfProfile) -> float:
    """The TPT SLO: 1.5 x the decode iteration without adapters (build_policy's default)."""
    return SLO_TIMES_BASE * profile.decode.predict([0])


def make_policy(
    name: str, profile: PerfProfile, requests: Sequence[Request], config: InstanceConfig, seed: int
) -> Policy:
    """The router's policy `name` (router.app.build_policy), given the workload's mean
    output length as avg_resp_len and its mean adapter load time as adapter_load_ms."""
    return build_policy(
        name,
        profile=profile,
        avg_resp_len=float(np.mean([r.output_tokens for r in requests])),
        adapter_load_ms=float(np.mean([config.load_ms(r.rank) for r in requests])),
        seed=seed,
    )


def summarize(policy: str, rate: float, result: RunResult, slo: float) -> dict[str, float | str]:
    """The JSON row: SLO attainment over the requests with a TPT, mean and p99 TPT (ms)."""
    tpt = result.tpt_ms[~np.isnan(result.tpt_ms)]
    return {
        "policy": policy,
        "rate": rate,
        "slo_attainment": float(np.mean(tpt <= slo)),
        "mean_tpt_ms": float(np.mean(tpt)),
        "p99_tpt_ms": float(np.percentile(tpt, 99)),
    }


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A sweep's fixed settings; `workload.rate` is replaced by each run's rate."""

    workload: WorkloadSpec
    profile: PerfProfile
    instances: int = 60
    config: InstanceConfig = InstanceConfig()


@dataclasses.dataclass(frozen=True)
class Run:
    row: dict[str, float | str]
    tpt_ms: np.ndarray
    ttft_ms: np.ndarray
    wall_s: float


def run_one(scenario: Scenario, policy_name: str, rate: float) -> Run:
    """One (policy, rate) point of the sweep."""
    start = time.perf_counter()
    requests = make_workload(dataclasses.replace(scenario.workload, rate=rate))
    policy = make_policy(
        policy_name, scenario.profile, requests, scenario.config, scenario.workload.seed
    )
    if type(policy) is not POLICIES[policy_name]:
        raise TypeError(f"{policy_name}: build_policy made a {type(policy).__name__}")
    result = simulate(
        requests, policy, instances=scenario.instances, profile=scenario.profile,
        config=scenario.config,
    )  # fmt: skip
    row = summarize(policy_name, rate, result, slo_ms(scenario.profile))
    return Run(row, result.tpt_ms, result.ttft_ms, time.perf_counter() - start)


def _run_star(args: tuple[Scenario, str, float]) -> Run:
    return run_one(*args)


def sweep(
    scenario: Scenario, policies: Sequence[str], rates: Sequence[float], processes: int
) -> list[Run]:
    """Every (policy, rate) run, on `processes` processes, in (rate, policy) order."""
    jobs = [(scenario, policy, rate) for rate in rates for policy in policies]
    if processes <= 1 or len(jobs) == 1:
        runs = [_run_star(job) for job in jobs]
    else:
        with multiprocessing.Pool(min(processes, len(jobs))) as pool:
            runs = pool.map(_run_star, jobs[::-1], chunksize=1)[::-1]  # high rates first
    return runs


# -- report ---------------------------------------------------------------------------


def markdown(scenario: Scenario, runs: Sequence[Run], wall_s: float) -> str:
    slo = slo_ms(scenario.profile)
    spec, config = scenario.workload, scenario.config
    prompts = (
        f"prompts scaled to a mean of {spec.prompt_mean:g} tokens"
        if spec.prompt_mean > 0
        else "its own prompts"
    )
    lines = [
        f"# Cluster simulator: {scenario.instances} instances, {spec.duration_s:g} s of "
        f"the Azure {spec.trace} trace",
        "",
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; {prompts}; "
        f"profile {scenario.profile.device or '?'} / {scenario.profile.base_model or '?'}, "
        f"decode {scenario.profile.decode.kind} α={scenario.profile.decode.alpha:g} "
        f"β={scenario.profile.decode.beta:g} ms, prefill γ={scenario.profile.prefill.gamma:.4g} "
        f"ms/token β={scenario.profile.prefill.beta:.4g} ms; max batch {config.max_batch}, "
        f"{config.adapter_slots} adapter slots, {config.load_ms_per_rank:.3f} ms per rank "
        f"to load; {spec.adapters} adapters, Zipf {spec.zipf:g}, ranks "
        f"{'/'.join(map(str, spec.ranks))}; seed {spec.seed}. SLO: TPT <= {slo:.2f} ms "
        f"(1.5 x no-LoRA decode). Sweep wall time {wall_s:.1f} s. Last column: how much "
        "lower rank-aware's mean TPT is (the papers' \"speeds up the average TPT by\").",
        "",
        "| rate (req/s) | policy | SLO attainment | mean TPT (ms) | p99 TPT (ms) "
        "| mean TTFT (ms) | p99 TTFT (ms) | run (s) | rank-aware's TPT lower by |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rank_aware = {run.row["rate"]: float(run.row["mean_tpt_ms"]) for run in runs
                  if run.row["policy"] == "rank-aware"}  # fmt: skip
    for run in runs:
        row = run.row
        mean_tpt = float(row["mean_tpt_ms"])
        ours = rank_aware.get(row["rate"])
        lower = (
            "" if ours is None or row["policy"] == "rank-aware" else f"{1 - ours / mean_tpt:.1%}"
        )
        lines.append(
            f"| {row['rate']:g} | {row['policy']} | {float(row['slo_attainment']):.2%} "
            f"| {mean_tpt:.2f} | {row['p99_tpt_ms']:.2f} "
            f"| {np.mean(run.ttft_ms):.0f} | {np.percentile(run.ttft_ms, 99):.0f} "
            f"| {run.wall_s:.1f} | {lower} |"
        )
    return "\n".join(lines) + "\n"


def plot(
    scenario: Scenario, runs: Sequence[Run], out_dir: Path, stem: str, cdf_rate: float
) -> list[Path]:
    """SLO attainment against rate (one line per policy) and the TPT CDF at `cdf_rate`."""
    from bench.lib.plots import cdf_plot, plt  # matplotlib only when plotting

    slo = slo_ms(scenario.profile)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for policy in dict.fromkeys(str(run.row["policy"]) for run in runs):
        points = [(run.row["rate"], run.row["slo_attainment"]) for run in runs
                  if run.row["policy"] == policy]  # fmt: skip
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ax.set_xlabel("cluster request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(f"{scenario.instances} instances, SLO = TPT <= {slo:.1f} ms")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    slo_path = out_dir / f"{stem}-slo-attainment.png"
    fig.savefig(slo_path)
    plt.close(fig)
    series = {str(run.row["policy"]): run.tpt_ms[~np.isnan(run.tpt_ms)]
              for run in runs if run.row["rate"] == cdf_rate}  # fmt: skip
    cdf_path = cdf_plot(
        out_dir / f"{stem}-tpt-cdf-{cdf_rate:g}rps.png", series,
        xlabel="time per output token (ms)",
        title=f"TPT at {cdf_rate:g} req/s, {scenario.instances} instances",
        vline=slo, vline_label=f"SLO {slo:.1f} ms",
    )  # fmt: skip
    return [slo_path, cdf_path]


def _cdf_rate(runs: Sequence[Run], rates: Sequence[float]) -> float:
    """The highest rate at which rank-aware attains 99% (the papers' figure), else the
    middle rate of the sweep."""
    good = [
        float(run.row["rate"])
        for run in runs
        if run.row["policy"] == "rank-aware" and float(run.row["slo_attainment"]) >= 0.99
    ]
    return float(max(good)) if good else sorted(rates)[len(rates) // 2]


def _floats(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        type=_floats,
        default=list(DEFAULT_RATES),
        help="cluster request rates, req/s, comma-separated",
    )
    parser.add_argument(
        "--policies",
        default=",".join(PAPER_POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)}",
    )
    parser.add_argument("--instances", type=int, default=60)
    parser.add_argument("--duration-s", type=float, default=600.0, help="seconds of trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", choices=("conv", "code"), default="conv")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--adapters", type=int, default=WorkloadSpec.adapters)
    parser.add_argument("--zipf", type=float, default=WorkloadSpec.zipf)
    parser.add_argument(
        "--prompt-mean",
        type=float,
        default=WorkloadSpec.prompt_mean,
        help="scale the trace's prompts to this mean (0: keep them)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="a `jlora profile` JSON (default: the papers' Llama-2-7B on A10 numbers)",
    )
    parser.add_argument(
        "--kernel",
        choices=("bgmv", "mbgmv"),
        default="bgmv",
        help="the papers' decode model to use without --profile",
    )
    parser.add_argument("--max-batch", type=int, default=InstanceConfig.max_batch)
    parser.add_argument("--adapter-slots", type=int, default=InstanceConfig.adapter_slots)
    parser.add_argument(
        "--link-gbps", type=float, default=LINK_GBPS, help="host-to-device GB/s for adapter copies"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--cdf-rate",
        type=float,
        help="the TPT CDF's rate (default: the highest rate at which rank-aware attains 99%%)",
    )
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)  # fmt: skip

    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies or not args.rates:
        parser.error(f"--policies {args.policies!r} / --rates: unknown policies {unknown}")
    profile = PerfProfile.load(args.profile) if args.profile else paper_profile(args.kernel)
    scenario = Scenario(
        workload=WorkloadSpec(
            rate=args.rates[0], duration_s=args.duration_s, trace=args.trace,
            adapters=args.adapters, zipf=args.zipf, seed=args.seed, data_dir=args.data_dir,
            prompt_mean=args.prompt_mean,
        ),
        profile=profile,
        instances=args.instances,
        config=InstanceConfig(max_batch=args.max_batch, adapter_slots=args.adapter_slots,
                              load_ms_per_rank=load_ms_per_rank(args.link_gbps)),
    )  # fmt: skip
    start = time.perf_counter()
    runs = sweep(scenario, policies, args.rates, args.processes)
    wall_s = time.perf_counter() - start
    table = markdown(scenario, runs, wall_s)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(args.out_dir, "simulator")
    (args.out_dir / f"{stem}.md").write_text(table)
    if args.json:
        args.json.write_text(json.dumps([run.row for run in runs], indent=2) + "\n")
    if not args.no_plots:
        cdf_rate = args.cdf_rate if args.cdf_rate is not None else _cdf_rate(runs, args.rates)
        for path in plot(scenario, runs, args.out_dir, stem, cdf_rate):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
