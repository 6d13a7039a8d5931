"""Writes a serving workload file (JSONL) for `bench.serve` to replay.

`python -m bench.workloads azure --trace code --duration 60 --out W.jsonl` (a window of
the Azure LLM inference trace) or `python -m bench.workloads poisson --rate 4
--num-requests 200 --out W.jsonl` (Poisson arrivals); adapters from a Zipf-popular pool
of demo adapters, prompts of exact lengths under `--tokenizer`. How each part is drawn,
and the file's format: `bench.lib.workloads`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections import Counter
from pathlib import Path

import numpy as np

from bench.lib.workloads import (
    DATA_DIR,
    DEFAULT_RANKS,
    TRACES,
    Workload,
    WorkloadError,
    azure_workload,
    demo_adapter_pool,
    load_tokenizer,
    poisson_workload,
)


def describe(workload: Workload) -> str:
    """A few lines: requests, rate, mean lengths, adapter shares."""
    requests = workload.requests
    if not requests:
        return f"{workload.meta.get('kind', 'workload')}: no requests"
    span = requests[-1].arrival_s - requests[0].arrival_s
    rate = (len(requests) - 1) / span if span > 0 else math.nan
    shares = Counter(request.adapter or "(base)" for request in requests).most_common(5)
    lines = [
        f"{workload.meta.get('kind', 'workload')}: {len(requests)} requests over {span:.1f} s "
        f"({rate:.2f} req/s)",
        f"mean prompt {np.mean([r.prompt_tokens for r in requests]):.1f} tokens, "
        f"mean output {np.mean([r.max_tokens for r in requests]):.1f} tokens",
        "adapters (top 5): "
        + ", ".join(f"{name} {count / len(requests):.1%}" for name, count in shares),
    ]
    return "\n".join(lines)


def _parse_pair(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(",")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH")
    return int(low), int(high)


def _parse_ranks(text: str) -> tuple[int, ...]:
    return tuple(int(rank) for rank in text.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.workloads", description=__doc__.split("\n")[0]
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, help="the workload file (JSONL)")
    common.add_argument(
        "--tokenizer",
        default="smollm2-135m",
        help="preset, .gguf file or tokenizer directory (default: %(default)s)",
    )
    common.add_argument("--adapters", type=int, default=4, help="demo adapters in the pool")
    common.add_argument("--ranks", type=_parse_ranks, default=DEFAULT_RANKS, help="cycling")
    common.add_argument("--zipf", dest="zipf_s", type=float, default=1.0, help="Zipf exponent")
    common.add_argument("--base-fraction", type=float, default=0.0, help="base-model share")
    common.add_argument("--seed", type=int, default=0)
    kinds = parser.add_subparsers(dest="kind", required=True)
    azure = kinds.add_parser("azure", parents=[common], help="a window of the Azure trace")
    azure.add_argument("--trace", choices=TRACES, default="code")
    azure.add_argument("--data-dir", type=Path, default=DATA_DIR)
    azure.add_argument("--start", dest="start_s", type=float, default=0.0, help="trace seconds")
    azure.add_argument("--duration", dest="duration_s", type=float, help="trace seconds")
    azure.add_argument("--rate-scale", type=float, default=1.0, help="time compression")
    azure.add_argument("--max-requests", type=int)
    azure.add_argument("--prompt-scale", type=float, default=1.0)
    azure.add_argument("--output-scale", type=float, default=1.0)
    azure.add_argument("--prompt-tokens", type=_parse_pair, default=(1, 1536), help="MIN,MAX")
    azure.add_argument("--output-tokens", type=_parse_pair, default=(1, 512), help="MIN,MAX")
    poisson = kinds.add_parser("poisson", parents=[common], help="Poisson arrivals")
    poisson.add_argument("--rate", dest="rate_per_s", type=float, required=True, help="per s")
    size = poisson.add_mutually_exclusive_group(required=True)
    size.add_argument("--duration", dest="duration_s", type=float, help="seconds of arrivals")
    size.add_argument("--num-requests", type=int)
    poisson.add_argument("--prompt-tokens", type=_parse_pair, default=(64, 512), help="LOW,HIGH")
    poisson.add_argument("--output-tokens", type=_parse_pair, default=(16, 256), help="LOW,HIGH")
    options = vars(parser.parse_args(argv))
    kind, out, tokenizer = options.pop("kind"), options.pop("out"), options.pop("tokenizer")
    generate = azure_workload if kind == "azure" else poisson_workload
    try:
        pool = demo_adapter_pool(options.pop("adapters"), options.pop("ranks"))
        workload = generate(adapters=pool, tokenizer=load_tokenizer(tokenizer), **options)
    except WorkloadError as err:
        parser.exit(2, f"error: {err}\n")
    workload = dataclasses.replace(workload, meta={**workload.meta, "tokenizer": tokenizer})
    print(describe(workload))
    print(f"written to {workload.save(out)}")


if __name__ == "__main__":
    main()
