"""Lazy KV allocation with preemption next to up-front reservation, at a fixed pool size.

Run: `python -m bench.kv_allocation [--quick]` (`make bench-kv-allocation`; about 4
minutes on two cores, `--quick` about 2). Writes
`bench/results/<date>-cpu-kv-allocation.md` and `.json`.

Setup (one process): SmolLM2 in fp32, base model, `max_slots` decode rows, a device
pool of `pool_blocks` KV blocks (16 tokens each), the fastlibra cache policy (a
preempted request's full blocks stay cached, so its recomputation is mostly a cache
hit). The requests are the first `requests` of the Azure conversation trace, all
queued at once (an offline batch, as vLLM's throughput benchmark): the trace's prompt
lengths scaled by `prompt_scale` and its output lengths, each clipped to fit a
512-token context, random token ids, greedy decoding with EOS ignored, so each request
generates exactly its `max_tokens`. (The code trace's answers, 13 tokens at the median,
barely grow a sequence: it is the conversations' that show the difference.)

Two engines run the same requests in turn, one per `EngineConfig.kv_allocation`:

- `upfront`: a request is admitted with the blocks of its whole sequence (prompt +
  max_tokens), so it is never preempted;
- `lazy` (vLLM's): admitted with its prompt's blocks, growing a block at a time; when
  the pool runs out, the newest request is preempted and recomputed later.

Reported per allocation: the decode rows in use per step (mean and peak: the
concurrency the pool allows), preemptions, the prompt tokens admitted (each prompt
once, plus prompt and generated tokens again for each preemption, cache hits
included), generated tokens per second over the whole batch, and whether every
request's greedy tokens equal those of the up-front run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from bench.lib import report
from bench.lib.workloads import read_trace
from configs import EngineConfig
from jlora.device.llama_engine import build_engine
from jlora.engine.api import Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel, load_model

ALLOCATIONS = ("upfront", "lazy")


@dataclasses.dataclass(frozen=True)
class Plan:
    requests: int = 32
    pool_blocks: int = 96
    max_slots: int = 16
    max_seq_len: int = 512
    prompt_scale: float = 0.25  # of the trace's prompt lengths
    prompt_tokens: tuple[int, int] = (16, 320)
    output_tokens: tuple[int, int] = (8, 192)  # the trace's output lengths, clipped
    seed: int = 0


QUICK = dataclasses.replace(Plan(), requests=16, pool_blocks=64, max_slots=8)


@dataclasses.dataclass(frozen=True)
class Run:
    allocation: str
    seconds: float
    generated: int
    mean_rows: float
    peak_rows: int
    preemptions: int
    prompt_tokens: int  # prefilled, recomputation included
    tokens: dict[str, list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds


def make_requests(plan: Plan, vocab: int) -> list[tuple[str, list[int], int]]:
    """(id, prompt ids, max_tokens) of the trace's first `plan.requests` requests."""
    rows = read_trace("conv")
    rng = np.random.default_rng(plan.seed)
    count = plan.requests
    prompts = np.clip(np.rint(rows.context_tokens[:count] * plan.prompt_scale), *plan.prompt_tokens)
    outputs = np.clip(rows.generated_tokens[:count], *plan.output_tokens)
    return [
        (f"r{i}", rng.integers(100, vocab, int(p)).tolist(), int(o))
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def smollm2_engine(loaded: LoadedModel, plan: Plan, allocation: str) -> Orchestrator:
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(
            max_slots=plan.max_slots,
            max_seq_len=plan.max_seq_len,
            kv_cache_tokens=plan.pool_blocks * 16,
            kv_allocation=allocation,
        ),
    )
    engine.warmup()
    return engine


def measure(engine: Orchestrator, requests) -> Run:
    """Queue every request, step until all are done (then close the engine)."""
    try:
        for name, prompt, max_tokens in requests:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(Request(name, prompt, sampling))
        tokens: dict[str, list[int]] = {name: [] for name, _, _ in requests}
        rows: list[int] = []
        start = time.perf_counter()
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                tokens[event.request_id].append(event.token_id)
            rows.append(engine.num_running)
        seconds = time.perf_counter() - start
        stats = engine.stats()
        return Run(
            allocation=engine.config.kv_allocation,
            seconds=seconds,
            generated=sum(len(t) for t in tokens.values()),
            mean_rows=float(np.mean(rows)),
            peak_rows=max(rows),
            preemptions=stats.preemptions,
            prompt_tokens=stats.cache.prompt_tokens if stats.cache else 0,
            tokens=tokens,
        )
    finally:
        engine.close()


def render(facts: dict, plan: Plan, runs: list[Run], requests) -> str:
    reference = runs[0].tokens
    prompt_total = sum(len(prompt) for _, prompt, _ in requests)
    lines = [
        report.cpu_header(facts, "SmolLM2-135M"),
        "",
        f"{plan.requests} requests of the Azure conversation trace queued at once (prompts "
        f"{prompt_total} tokens in all, {sum(m for _, _, m in requests)} to generate), "
        f"{plan.max_slots} decode rows, a pool of {plan.pool_blocks} KV blocks of 16 tokens.",
        "",
        "| allocation | rows mean | rows peak | preemptions | prompt tokens admitted | "
        "tokens/s | same tokens |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        same = sum(r.tokens[name] == reference[name] for name in reference)
        lines.append(
            f"| {r.allocation} | {r.mean_rows:.1f} | {r.peak_rows} | {r.preemptions} | "
            f"{r.prompt_tokens} | {r.tokens_per_s:.1f} | {same}/{len(reference)} |"
        )
    upfront, lazy = runs
    lines += [
        "",
        f"lazy / upfront: {lazy.mean_rows / upfront.mean_rows:.2f}x the rows in use, "
        f"{lazy.tokens_per_s / upfront.tokens_per_s:.2f}x the generated tokens/s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, smaller pool")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    facts = report.machine_facts()
    loaded = load_model("smollm2-135m")
    requests = make_requests(plan, loaded.config.vocab_size)
    runs = [measure(smollm2_engine(loaded, plan, a), requests) for a in ALLOCATIONS]
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    text = render(facts, plan, runs, requests)
    print(text)
    title = "Lazy KV allocation with preemption vs up-front reservation"
    rows = [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in runs]
    report.save_cpu_results("kv-allocation", title, text, facts, plan, rows)


if __name__ == "__main__":
    sys.exit(main())
