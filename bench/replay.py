"""Offline replay of the Azure code trace: jlora's generated tokens/s against
transformers + PEFT serving the same mixed-adapter requests.

Run: `python -m bench.replay [--quick]` (`make bench-replay`; about 10 minutes on two
cores, `--quick` about 4). Writes `bench/results/<date>-cpu-replay.md` and `.json`.

Workload (`bench.lib.workloads.azure_workload`): the first `requests` requests of the code
trace, every one queued at once (an offline batch, as vLLM's throughput benchmark: the
arrival times are dropped), prompts = the trace's lengths x `prompt_scale` clipped to
`prompt_tokens`, outputs = its lengths clipped to `output_tokens` (scaled to fit a
2-core CPU), English prompts synthesised to those token counts; `adapters` demo
adapters of ranks `ranks` with Zipf(1) popularity and 10% base-model requests; greedy,
EOS ignored, so every request generates exactly its max_tokens. Every system gets the
same prompt token ids.

Systems, one after another in this process (the command in a child):

- `jlora` (engine): the orchestrator `jlora generate` builds for these prompts (every
  adapter on the device, `max_slots` decode rows), warmed up ahead; timed from queuing
  every request to the last token.
- `jlora generate` (command): the same requests as a `--prompts-file` JSONL through the
  command, `--output jsonl`; the process's wall time, its start-up included (its XLA
  compilation cache filled by one untimed run first).
- `hf-peft`: transformers + PEFT (`bench.baselines.hf_engine.HfEngine`), the requests in
  order in static batches of `hf_batch`, each a mixed-adapter batch (`adapter_names`),
  after its warm-up; timed over all batches.

Reported: generated tokens/s and the ratio to hf-peft, and how many requests' greedy
texts equal hf-peft's. The 1-minute load average is recorded: other processes on a
shared machine slow both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import report
from bench.lib.workloads import Workload, azure_workload, demo_adapter_pool, load_tokenizer
from configs import EngineConfig, load_preset

BASELINE = "hf-peft"


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    requests: int = 32
    prompt_scale: float = 0.1  # the code trace's prompts are ~2,000 tokens
    prompt_tokens: tuple[int, int] = (32, 384)
    output_tokens: tuple[int, int] = (8, 128)
    adapters: int = 8
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    base_fraction: float = 0.1
    max_slots: int = 32
    hf_batch: int = 8
    seed: int = 0


QUICK = dataclasses.replace(Plan(), requests=12, max_slots=12)


def make_workload(plan: Plan) -> Workload:
    return azure_workload(
        trace="code",
        max_requests=plan.requests,
        prompt_scale=plan.prompt_scale,
        prompt_tokens=plan.prompt_tokens,
        output_tokens=plan.output_tokens,
        adapters=demo_adapter_pool(plan.adapters, plan.ranks),
        base_fraction=plan.base_fraction,
        seed=plan.seed,
        tokenizer=load_tokenizer(plan.model),
    )


# -- the systems -------------------------------------------------------------------------


def run_jlora(plan: Plan, workload: Workload, adapters: Path) -> dict[str, Any]:
    """The engine in this process: (seconds, texts by request id)."""
    from jlora.device.llama_engine import build_engine
    from jlora.engine.api import Request, SamplingParams
    from jlora.model.loading import load_model

    loaded = load_model(plan.model)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=tokenizer,
        engine_config=EngineConfig(
            max_slots=plan.max_slots,
            max_loras=plan.adapters,
            max_lora_rank=max(plan.ranks),
        ),
    )
    try:
        for name in sorted({r.adapter for r in workload.requests if r.adapter}):
            engine.register_adapter(name, adapters / name)
        requests = [
            Request(
                r.id,
                tokenizer.encode(r.prompt),
                SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                adapter=r.adapter,
            )
            for r in workload.requests
        ]
        engine.warmup()
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        generated = 0
        while engine.has_unfinished:
            for event in engine.step():
                assert event.error is None, event.error
                texts[event.request_id].append(event.text)
                generated += 1
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return {
        "seconds": seconds,
        "generated": generated,
        "texts": {k: "".join(v) for k, v in texts.items()},
    }


def write_prompts_file(workload: Workload, path: Path) -> None:
    lines = [
        json.dumps(
            {
                "prompt": r.prompt,
                "adapter": r.adapter,
                "max_tokens": r.max_tokens,
                "ignore_eos": True,
            }
        )
        for r in workload.requests
    ]
    path.write_text("\n".join(lines) + "\n")


def run_command(plan: Plan, prompts: Path, adapters: Path, cache: Path) -> dict[str, Any]:
    """`jlora generate --prompts-file`: its wall time and texts (in file order)."""
    command = [
        sys.executable,
        "-m",
        "jlora.cli.main",
        "generate",
        "--model",
        plan.model,
        "--prompts-file",
        str(prompts),
        "--adapters-dir",
        str(adapters),
        "--max-slots",
        str(plan.max_slots),
        "--output",
        "jsonl",
    ]
    env = {**os.environ, "JLORA_COMPILATION_CACHE": str(cache)}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"jlora generate failed: {done.stderr[-2000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return {
        "seconds": seconds,
        "generated": sum(len(line["token_ids"]) for line in lines),
        "texts": [line["text"] for line in lines],
    }


def run_hf(plan: Plan, workload: Workload, adapters: Path) -> dict[str, Any]:
    """transformers + PEFT, static mixed-adapter batches of `hf_batch`, in order."""
    from bench.baselines.hf_engine import BASE_ROW, DTYPES, HfEngine, Job
    from jlora.model.gguf import GGUFFile
    from jlora.tokenizer import Tokenizer  # the same prompt ids as jlora's

    gguf_path = load_preset(plan.model).weights.resolve_path()
    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(gguf_path).fields)
    names = sorted({r.adapter for r in workload.requests if r.adapter})
    hf = HfEngine(gguf_path, {name: adapters / name for name in names}, DTYPES["float32"])
    hf.warm_up()
    jobs = [
        Job(
            hf.peft_names[r.adapter] if r.adapter else BASE_ROW,
            tokenizer.encode(r.prompt),
            r.max_tokens,
            ignore_eos=True,
        )
        for r in workload.requests
    ]
    texts: dict[int, list[str]] = {id(job): [] for job in jobs}
    generated = 0

    def deliver(chunks) -> None:
        nonlocal generated
        for job, chunk in chunks:
            texts[id(job)].append(chunk.text)
            generated += 1

    start = time.perf_counter()
    for first in range(0, len(jobs), plan.hf_batch):
        hf.run_batch(jobs[first : first + plan.hf_batch], deliver)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "generated": generated,
        "texts": {
            r.id: "".join(texts[id(job)]) for r, job in zip(workload.requests, jobs, strict=True)
        },
    }


# -- the run ------------------------------------------------------------------------------


def measure(plan: Plan) -> dict[str, Any]:
    from jlora.adapters.peft import make_demo_adapters

    workload = make_workload(plan)
    with tempfile.TemporaryDirectory(prefix="jlora-replay-") as scratch:
        adapters = Path(scratch) / "adapters"
        make_demo_adapters(
            load_preset(plan.model).config, adapters, n=plan.adapters, ranks=plan.ranks
        )
        prompts = Path(scratch) / "prompts.jsonl"
        write_prompts_file(workload, prompts)
        cache = Path(scratch) / "xla"
        run_command(plan, prompts, adapters, cache)  # fills the compilation cache
        command = run_command(plan, prompts, adapters, cache)
        engine = run_jlora(plan, workload, adapters)
        hf = run_hf(plan, workload, adapters)
    ids = [r.id for r in workload.requests]
    command["texts"] = dict(zip(ids, command["texts"], strict=True))
    return {
        "workload": workload.meta,
        "prompt_tokens": sum(r.prompt_tokens for r in workload.requests),
        "systems": {"jlora": engine, "jlora generate": command, BASELINE: hf},
    }


def render(facts: dict, plan: Plan, result: dict[str, Any]) -> str:
    systems = result["systems"]
    baseline = systems[BASELINE]
    base_rate = baseline["generated"] / baseline["seconds"]
    lines = [
        report.cpu_header(facts, plan.model),
        "",
        f"{plan.requests} requests of the Azure code trace queued at once "
        f"({result['prompt_tokens']} prompt tokens), {plan.adapters} adapters of ranks "
        f"{plan.ranks} and "
        f"{plan.base_fraction:.0%} base-model requests; jlora: {plan.max_slots} decode rows; "
        f"hf-peft: static batches of {plan.hf_batch}.",
        "",
        "| system | seconds | generated tokens | tokens/s | x hf-peft | same text as hf-peft |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in systems.items():
        rate = run["generated"] / run["seconds"]
        same = sum(run["texts"][k] == text for k, text in baseline["texts"].items())
        lines.append(
            f"| {name} | {run['seconds']:.1f} | {run['generated']} | {rate:.1f} | "
            f"{rate / base_rate:.2f}x | {same}/{len(baseline['texts'])} |"
        )
    lines += [
        "",
        "`jlora generate` counts its whole process: imports, loading the model, start-up "
        "and compiling (from a warm compilation cache).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 requests")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    facts = report.machine_facts()
    result = measure(plan)
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    text = render(facts, plan, result)
    print(text)
    title = "Offline Azure-trace replay: jlora vs transformers + PEFT"
    for run in result["systems"].values():
        del run["texts"]
    report.save_cpu_results("replay", title, text, facts, plan, [result])


if __name__ == "__main__":
    sys.exit(main())
