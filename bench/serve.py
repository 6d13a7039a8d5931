"""Replays a workload file against a running server, open-loop, and measures it.

`python -m bench.serve --workload W.jsonl --target http://127.0.0.1:8000` (any
OpenAI-compatible server: jlora's router, vLLM, ...) or `--target grpc://127.0.0.1:50050`
(jlora.v1, a router or a worker); the workload from `python -m bench.workloads`. How a
replay runs and what it measures: `bench.lib.harness`.

Writes `{"target", "system", "workload" (its meta), "machine", "summary", "requests"}`
as JSON (default: under bench/out/) and prints the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

from bench.lib.harness import DEFAULT_TIMEOUT_S, RequestFailed, format_summary, run, summarize
from bench.lib.processes import ROOT
from bench.lib.report import machine_facts
from bench.lib.workloads import Workload

OUT_DIR = ROOT / "bench" / "out"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workload", type=Path, required=True, help="a bench.workloads file")
    parser.add_argument("--target", required=True, help="http://host:port or grpc://host:port")
    parser.add_argument("--system", default="jlora", help="a label for the results")
    parser.add_argument(
        "--base-model",
        help="the base model's id (default: from GET /v1/models; gRPC: the empty adapter)",
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a request may take (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, help="the raw JSON (default: under bench/out/)")
    parser.add_argument(
        "--word-ids",
        action="store_true",
        help="gRPC: send prompts as token ids (one per word; workloads made with "
        "--tokenizer words, for a model without a tokenizer)",
    )
    args = parser.parse_args(argv)
    try:
        workload = Workload.load(args.workload)
        records = run(
            workload,
            args.target,
            base_model=args.base_model,
            api_key=args.api_key,
            progress=not args.no_progress,
            timeout_s=args.timeout,
            word_ids=args.word_ids,
        )
    except (ValueError, RequestFailed, OSError) as err:
        parser.exit(2, f"error: {err}\n")
    summary = summarize(records)
    print(format_summary(summary, label=f"{args.system} @ {args.target}"))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or OUT_DIR / f"serve-{args.system}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "target": args.target,
        "system": args.system,
        "workload": workload.meta,
        "machine": machine_facts(),
        "summary": summary,
        "requests": [dataclasses.asdict(record) for record in records],
    }
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
