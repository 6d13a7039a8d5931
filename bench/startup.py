"""Start-up: from `jlora generate` to its first token, cold and with a warm compile cache.

Run: `python -m bench.startup [--quick]` (`make bench-startup`; about 5 minutes on two
cores, `--quick` about 2). Writes `bench/results/<date>-cpu-startup.md` and `.json`.

1. The command itself, as a user runs it: `jlora generate --prompt P` (SmolLM2, greedy,
   the default 256 max tokens; the chat model ends its answer well before), in a fresh
   process each time. Time to the first byte on stdout (the first token's text) and to
   the exit; "cold" starts with an empty XLA compilation cache (`JLORA_COMPILATION_CACHE`
   pointing at a new directory), "warm" reuses the cache the cold run filled.
2. Where the time goes, and what compiling ahead would cost: a child process per run
   does what the command does through the engine API (import, load the model, build the
   engine, warm up, generate a batch of `prompts` chat prompts) and times each phase,
   once with the ahead-of-time warm-up a server uses (`warmup(prompt_lengths,
   max_length)`: every prefill bucket the prompts need with its cached-prefix variant,
   the packed prefills, every decode bucket up to prompt + max_tokens) and once with
   the on-demand warm-up `jlora generate` now uses (`warmup(on_demand=True)`: each shape
   compiled when a step first meets it). Both cold and warm, alternating; the greedy
   tokens must be the same.
3. Two loading costs the command no longer pays, measured here in-process: the `gguf`
   package's dequantization of the model's tensors against jlora's own
   (`jlora.model.gguf.dequantize`, bit-identical), and importing the CPU workers'
   Numba kernels (`cpu_offload`), which the engine now imports only in the lora modes
   that use them.

Medians of `repeats` runs; the table records the 1-minute load average (other
processes on a shared 2-core machine skew every figure, less so the ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUPS = ("ahead", "on-demand")
PHASES = ("import", "load", "engine", "warmup", "first_token", "done")
PROMPTS = (
    "Tell me a joke about computers.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    repeats: int = 3
    prompts: int = 4  # in the batch of part 2
    max_tokens: int = 256  # the command's default
    model: str = "smollm2-135m"


QUICK = dataclasses.replace(Plan(), repeats=1, prompts=2)


# -- 1. the command ----------------------------------------------------------------------


def time_command(cache: Path, plan: Plan) -> dict[str, float]:
    """One `jlora generate --prompt`: seconds to its first stdout byte and to its exit."""
    env = {**os.environ, "JLORA_COMPILATION_CACHE": str(cache)}
    command = [
        sys.executable,
        "-m",
        "jlora.cli.main",
        "generate",
        "--model",
        plan.model,
        "--prompt",
        PROMPTS[0],
        "--max-tokens",
        str(plan.max_tokens),
    ]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first = process.stdout.read(1)
    first_s = time.perf_counter() - start
    _, err = process.communicate()
    if process.returncode != 0 or not first:
        raise RuntimeError(f"jlora generate failed ({process.returncode}): {err.decode()[-2000:]}")
    return {"first_token_s": first_s, "exit_s": time.perf_counter() - start}


# -- 2. the phases, in a child process ------------------------------------------------------


def child(warmup: str, cache: str, plan: Plan) -> dict[str, Any]:
    """What `jlora generate --prompts-file` does, phase by phase (seconds since this
    function began; the interpreter's own start is not counted)."""
    start = time.perf_counter()
    marks: dict[str, float] = {}
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from configs import EngineConfig
    from jlora.device.llama_engine import build_engine
    from jlora.engine.api import Request, SamplingParams
    from jlora.model.loading import load_model

    marks["import"] = time.perf_counter() - start
    loaded = load_model(plan.model)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    marks["load"] = time.perf_counter() - start
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=tokenizer,
        engine_config=EngineConfig(max_slots=plan.prompts),
    )
    marks["engine"] = time.perf_counter() - start
    sampling = SamplingParams(max_tokens=plan.max_tokens)
    requests = [
        Request(
            str(i),
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
                )
            ),
            sampling,
        )
        for i in range(plan.prompts)
    ]
    for request in requests:
        engine.add_request(request)
    lengths = [len(r.prompt_ids) for r in requests]
    if warmup == "ahead":
        engine.warmup(prompt_lengths=lengths, max_length=max(lengths) + plan.max_tokens)
    else:
        engine.warmup(prompt_lengths=lengths, on_demand=True)
    marks["warmup"] = time.perf_counter() - start
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for event in engine.step():
            assert event.error is None, event.error
            tokens[event.request_id].append(event.token_id)
            marks.setdefault("first_token", time.perf_counter() - start)
    marks["done"] = time.perf_counter() - start
    compiles = engine.device.steps.num_compiles  # type: ignore[attr-defined]
    engine.close()
    return {"marks": marks, "compiles": compiles, "tokens": tokens}


def time_child(warmup: str, cache: Path, plan: Plan) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.startup",
        "--child",
        warmup,
        str(cache),
        json.dumps(dataclasses.asdict(plan)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child {warmup} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# -- 3. loading costs ---------------------------------------------------------------------


def loading_costs(plan: Plan) -> dict[str, float]:
    """Medians: dequantizing every tensor of the model's GGUF with the gguf package and
    with ours (asserting equal values), and importing `cpu_offload` in a fresh process
    beyond what importing the engine costs."""
    import gguf
    import numpy as np

    from configs.model import load_preset
    from jlora.model.gguf import dequantize
    from jlora.model.gguf_format import read_gguf

    _, tensors = read_gguf(load_preset(plan.model).weights.resolve_path())
    package, ours = [], []
    for _ in range(plan.repeats):
        start = time.perf_counter()
        expected = {
            n: gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.ggml_type))
            for n, t in tensors.items()
        }
        package.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = {}
        for name, t in tensors.items():
            type_name = gguf.GGMLQuantizationType(t.ggml_type).name
            values = dequantize(t.data, type_name)
            got[name] = values if values is not None else expected[name]
        ours.append(time.perf_counter() - start)
        for name, values in got.items():
            np.testing.assert_array_equal(values.reshape(-1), expected[name].reshape(-1))

    def import_s(modules: str) -> float:
        code = f"import time; s = time.perf_counter(); import {modules}; "
        code += "print(time.perf_counter() - s)"
        command = [sys.executable, "-c", code]
        runs = [
            subprocess.run(command, capture_output=True, text=True, check=True).stdout
            for _ in range(plan.repeats)
        ]
        return statistics.median(float(out) for out in runs)

    engine = import_s("jlora.device.llama_engine")
    with_workers = import_s("jlora.device.llama_engine, cpu_offload")
    return {
        "dequantize_gguf_package_s": statistics.median(package),
        "dequantize_jlora_s": statistics.median(ours),
        "import_engine_s": engine,
        "import_cpu_offload_extra_s": with_workers - engine,
    }


# -- the run ------------------------------------------------------------------------------


def measure(plan: Plan) -> dict[str, Any]:
    command: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    phases: dict[str, list[dict[str, Any]]] = {
        f"{w} {c}": [] for w in WARMUPS for c in ("cold", "warm")
    }
    with tempfile.TemporaryDirectory(prefix="jlora-startup-") as scratch:
        for repeat in range(plan.repeats):
            cache = Path(scratch) / f"command-{repeat}"
            command["cold"].append(time_command(cache, plan))
            command["warm"].append(time_command(cache, plan))
            for warmup in WARMUPS:  # alternating, so drift in the load touches both
                cache = Path(scratch) / f"{warmup}-{repeat}"
                phases[f"{warmup} cold"].append(time_child(warmup, cache, plan))
                phases[f"{warmup} warm"].append(time_child(warmup, cache, plan))
    return {"command": command, "phases": phases, "loading": loading_costs(plan)}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def render(facts: dict, plan: Plan, result: dict[str, Any]) -> str:
    from bench.lib import report  # not at the top: a child times its own imports of jax

    command, phases, loading = result["command"], result["phases"], result["loading"]
    lines = [
        f"{report.cpu_header(facts, plan.model)} | medians of {plan.repeats}",
        "",
        f"## `jlora generate --prompt` (max {plan.max_tokens} tokens)",
        "",
        "| compile cache | first token (s) | exit (s) |",
        "|---|---:|---:|",
    ]
    for state, runs in command.items():
        lines.append(
            f"| {state} | {_median(runs, 'first_token_s'):.2f} | {_median(runs, 'exit_s'):.2f} |"
        )
    lines += [
        "",
        f"## Phases of a batch of {plan.prompts} chat prompts, warm-up ahead or on demand",
        "",
        "Seconds since the start of the child's imports, at the end of each phase.",
        "",
        "| warm-up | cache | import | load | engine | warm-up | first token | done | compiles "
        "| same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    reference = phases["ahead cold"][0]["tokens"]
    for name, runs in phases.items():
        warmup, state = name.split(" ")
        marks = [run["marks"] for run in runs]
        cells = " | ".join(f"{_median(marks, key):.2f}" for key in PHASES)
        same = all(run["tokens"] == reference for run in runs)
        lines.append(
            f"| {warmup} | {state} | {cells} | {runs[0]['compiles']} | {'yes' if same else 'NO'} |"
        )
    for state in ("cold", "warm"):
        ahead = _median([r["marks"] for r in phases[f"ahead {state}"]], "first_token")
        lazy = _median([r["marks"] for r in phases[f"on-demand {state}"]], "first_token")
        lines.append(
            f"\n{state}: first token after {lazy:.2f} s on demand against "
            f"{ahead:.2f} s ahead ({ahead / lazy:.2f}x sooner)."
        )
    engine = loading["import_engine_s"]
    lines += [
        "",
        "## Loading costs cut",
        "",
        "| what | before (s) | now (s) |",
        "|---|---:|---:|",
        f"| dequantize the GGUF's tensors | {loading['dequantize_gguf_package_s']:.2f} "
        f"(gguf package) | {loading['dequantize_jlora_s']:.2f} (jlora) |",
        f"| import the engine | {engine + loading['import_cpu_offload_extra_s']:.2f} "
        f"(with `cpu_offload`) | {engine:.2f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, two prompts")
    parser.add_argument(
        "--child", nargs=3, metavar=("WARMUP", "CACHE", "PLAN"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        warmup, cache, plan_json = args.child
        print(json.dumps(child(warmup, cache, Plan(**json.loads(plan_json)))))
        return
    from bench.lib import report

    plan = QUICK if args.quick else Plan()
    facts = report.machine_facts()
    result = measure(plan)
    facts["load_avg_1min_end"] = os.getloadavg()[0]
    text = render(facts, plan, result)
    print(text)
    for runs in result["phases"].values():
        for run in runs:
            del run["tokens"]
    report.save_cpu_results("startup", "Start-up of `jlora generate`", text, facts, plan, [result])


if __name__ == "__main__":
    sys.exit(main())
