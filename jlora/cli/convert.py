"""`jlora convert`: write an orbax checkpoint from a GGUF file, an HF directory or a preset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jlora.cli.common import UsageError, add_model_args, load_model_reporting, resolve_dtype


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert", help="write an orbax checkpoint", description=__doc__.splitlines()[0]
    )
    add_model_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="the new checkpoint directory")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():  # before JAX is imported
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    if args.out.exists() and any(args.out.iterdir()):
        raise UsageError(f"--out {args.out}: directory exists and is not empty")
    dtype = resolve_dtype(args.dtype)

    from jlora.model.checkpoint import save_checkpoint

    loaded = load_model_reporting(args.model, args.dtype)
    print(f"writing {args.out}", file=sys.stderr)
    save_checkpoint(args.out, loaded.config, loaded.params, loaded.tokenizer, loaded.source)
    print(f"wrote {args.out} ({loaded.config.name}, {dtype}) from {loaded.source}", file=sys.stderr)
    return 0
