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


def add_sharding_args(parser: argparse.ArgumentParser) -> None:
    """--sharding, --lora-sharding (read back with `sharding_config`)."""
    from configs.sharding import LORA_SHARDINGS

    group = parser.add_argument_group("sharding")
    group.add_argument(
        "--sharding",
        metavar="NAME_OR_PATH",
        help="device mesh and placement rules: a preset (tp1, tp2, tp3, tp4, tp8: tensor "
        "parallel over that many devices) or a YAML file like configs/sharding/tp2.yaml "
        "(default: one device)",
    )
    group.add_argument(
        "--lora-sharding",
        choices=LORA_SHARDINGS,
        help="how adapters are split: follow-base (like their base weights, no extra "
        "collective; the presets' default) or fully-sharded (1/tp of every adapter weight "
        "per device, one small collective per projection)",
    )


def sharding_config(args: argparse.Namespace):
    """The ShardingConfig `add_sharding_args` asked for (None: one device)."""
    from configs.sharding import DEFAULT_SHARDING, load_sharding

    if args.sharding is None and args.lora_sharding is None:
        return None
    return load_sharding(args.sharding or DEFAULT_SHARDING).with_lora_sharding(args.lora_sharding)


def sharding_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass `add_sharding_args`' values on to a child `jlora serve`."""
    flags = ["--sharding", args.sharding] if args.sharding else []
    return flags + (["--lora-sharding", args.lora_sharding] if args.lora_sharding else [])


def add_api_key_arg(group: argparse._ActionsContainer) -> None:
    """--api-key (read back with `jlora.contract.auth.resolve_api_key`)."""
    group.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' of every client (default: $JLORA_API_KEY; "
        "health checks stay open)",
    )


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"


def add_lora_engine_args(group: argparse._ArgumentGroup) -> None:
    """How an engine serves adapters: --lora-mode, --lora-backend, --max-loras,
    --emulated-link-gbps, --cpu-workers, --merge (read back with `lora_engine_config`)."""
    from configs.engine import LORA_BACKENDS, LORA_MODES

    group.add_argument(
        "--lora-mode",
        choices=LORA_MODES,
        default="ondemand",
        help="ondemand: load an adapter when a request needs it, prefill once it has "
        "landed (default); cached: load all before serving; cpu-assist: prefill at once, "
        "the LoRA of layers still in flight on CPU workers; auto: a cost model picks "
        "cpu-assist or waiting per request",
    )
    group.add_argument(
        "--lora-backend",
        choices=LORA_BACKENDS,
        default="reference",
        help="batched-LoRA kernels: plain jnp (default), BGMV (stacked slots) or MBGMV "
        "(a page pool); the Pallas ones run compiled on a GPU, interpreted elsewhere",
    )
    group.add_argument("--max-loras", type=int, help="device adapter slots")
    group.add_argument(
        "--emulated-link-gbps",
        type=float,
        default=0.0,
        metavar="G",
        help="throttle adapter transfers to G GB/s (a CPU-only machine has no real "
        "host-to-device link; off by default)",
    )
    group.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        help="CPU LoRA worker processes for cpu-assist/auto (default: one per core, less one)",
    )
    group.add_argument(
        "--merge",
        choices=("never", "auto", "always"),
        default="never",
        help="merged inference (dLoRA): never (default: every adapter's LoRA computed "
        "beside the base weights), auto (merge the dominant adapter into the base weights "
        "when that is faster, with credits so no adapter starves), always (one adapter at "
        "a time, merged)",
    )


def lora_engine_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of `add_lora_engine_args` (max_loras is the caller's)."""
    return {
        "lora_mode": args.lora_mode,
        "lora_backend": args.lora_backend,
        "emulated_link_gbps": args.emulated_link_gbps,
        "cpu_workers": args.cpu_workers,
        "merge": args.merge,
    }


def model_config(spec: str):
    """The base model's shapes (a ModelConfig): a preset's config loads no weights;
    anything else is loaded (GGUF, Hugging Face directory, orbax checkpoint)."""
    from configs.model import list_presets, load_preset

    if spec in list_presets():
        return load_preset(spec).config
    from jlora.model.loading import load_model

    return load_model(spec).config
