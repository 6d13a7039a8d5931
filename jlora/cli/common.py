"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from configs.model import DEFAULT_MODEL


class UsageError(Exception):
    """Bad input from the user: printed as `jlora: error: ...`, exit status 2."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="PATH_OR_PRESET",
        help="a preset name, a .gguf file, a Hugging Face directory or a "
        f"`jlora convert` checkpoint (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="serving dtype (auto: float32 on CPU, bfloat16 on GPU)",
    )


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"
