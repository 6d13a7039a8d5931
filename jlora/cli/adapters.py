"""`jlora adapters`: make demo LoRA adapters and inspect PEFT adapter directories.

`make-demo` writes random (non-zero) adapters for a base model's shapes, for benchmarks
and demos; `inspect` prints an adapter's hyper-parameters, size and sha256, and with
`--model` validates it fully against that base model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from configs.model import DEFAULT_MODEL
from jlora.adapters.peft import load_peft_adapter, make_demo_adapters
from jlora.cli.common import model_config, target_list
from jlora.contract.peft import AdapterError, check_ranks, inspect_adapter
from jlora.model.lora.targets import TARGETS


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "adapters", help="make demo adapters, inspect adapters", description=__doc__.splitlines()[0]
    )
    actions = parser.add_subparsers(dest="action", required=True)

    make = actions.add_parser(
        "make-demo", help="write random LoRA adapters in PEFT format for a base model"
    )
    make.add_argument("--out", type=Path, required=True, help="directory to write them into")
    make.add_argument("--n", type=int, required=True, help="number of adapters")
    make.add_argument(
        "--ranks",
        type=_ranks,
        required=True,
        metavar="R,R,...",
        help="comma-separated ranks, cycled over the adapters (e.g. 8,16,32,64)",
    )
    make.add_argument(
        "--targets",
        type=target_list,
        default=TARGETS,
        metavar="T,T,...",
        help=f"comma-separated target projections (default: {','.join(TARGETS)})",
    )
    make.add_argument("--seed", type=int, default=0)
    make.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="PATH_OR_PRESET",
        help=f"the base model whose shapes the adapters fit (default: {DEFAULT_MODEL})",
    )
    make.set_defaults(run=run_make_demo)

    inspect = actions.add_parser("inspect", help="print an adapter's rank, targets, size, hash")
    inspect.add_argument("path", type=Path, help="a PEFT adapter directory")
    inspect.add_argument(
        "--model",
        metavar="PATH_OR_PRESET",
        help="also validate every tensor against this base model",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(run=run_inspect)


def run_make_demo(args: argparse.Namespace) -> int:
    paths = make_demo_adapters(
        model_config(args.model),
        args.out,
        n=args.n,
        ranks=args.ranks,
        targets=args.targets,
        seed=args.seed,
        base_model=args.model,
    )
    for path in paths:
        print(path)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    if args.model is None:
        spec, num_layers = inspect_adapter(args.path)
    else:
        loaded = load_peft_adapter(args.path, model_config(args.model))
        spec, num_layers = loaded.adapter, loaded.num_layers
    fields = {
        "path": spec.path,
        "rank": spec.rank,
        "alpha": spec.alpha,
        "scaling": spec.scaling,
        "use_rslora": spec.use_rslora,
        "targets": list(spec.targets),
        "base_model": spec.base_model,
        "num_layers": num_layers,
        "size_bytes": spec.size_bytes,
        "sha256": spec.sha256,
    }
    if args.json:
        print(json.dumps(fields | ({"compatible_with": args.model} if args.model else {})))
        return 0
    fields["targets"] = ",".join(spec.targets)
    fields["size_bytes"] = f"{spec.size_bytes} ({spec.size_bytes / 2**20:.2f} MiB)"
    for key, value in fields.items():
        print(f"{key}: {value}")
    if args.model is not None:
        print(f"compatible with {args.model}")
    return 0


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    try:
        return check_ranks(ranks)
    except AdapterError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
