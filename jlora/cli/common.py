"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

from configs.model import DEFAULT_MODEL
from jlora.adapters.peft import AdapterError, canonical_targets

# --pool-size units: decimal (SI) and binary (IEC) multiples of a byte, any case.
SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


class UsageError(Exception):
    """Bad input from the user: printed as `jlora: error: ...`, exit status 2."""


# -- the log ---------------------------------------------------------------------------

LOG_FORMATS = ("text", "json")
TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# At INFO whatever the level of the rest: a worker's line per request and its throughput
# line (jlora/server/logs.py), as vLLM prints them by default.
TRAFFIC_LOGGERS = ("jlora.server.logs",)


def add_log_format_arg(parser: argparse._ActionsContainer) -> None:
    """--log-format (read back by `configure_logging`)."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LOG_FORMATS[0],
        help="text (default) or json: each log line one JSON object, with time, level, "
        "logger, message and the line's own fields as keys (a finished request's id, "
        "adapter, tokens, times and finish reason)",
    )


def configure_logging(*, verbose: bool, log_format: str = "text") -> None:
    """Every command's log, on stderr: WARNING and above (INFO with -v), and the
    traffic lines at INFO always; text lines, or JSON ones (`JsonFormatter`, which also
    takes Python's warnings in). Like `logging.basicConfig`, it leaves a root logger that
    has handlers already (a test's) as it is, but for the traffic loggers' level."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format={log_format!r} not in {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_LOG_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
    for name in TRAFFIC_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    if log_format == "json":
        logging.captureWarnings(True)


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: time (ISO 8601, UTC, milliseconds), level, logger,
    message, then the record's own fields (the `extra` of the logging call), and a
    traceback as `exception`. A value JSON has no form for is written as its str()."""

    _RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {
            "time": when.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._RECORD_FIELDS:
                line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


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


def add_chat_args(parser: argparse._ActionsContainer) -> None:
    """--chat-template and --tool-call-parser (read back with `chat_template`,
    `tool_call_parser` and `chat_flags`), as vLLM's."""
    from jlora.contract.tool_calls import FORMATS

    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (e.g. one of "
        "configs/chat_templates/, which show tools)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "none", *FORMATS],
        default="auto",
        help="how the model writes tool calls, for tool_choice 'auto' (default: the format "
        "the chat template asks for, if it is one of these)",
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text (None: the model's own)."""
    if args.chat_template is None:
        return None
    try:
        return args.chat_template.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--chat-template {args.chat_template}: cannot read it ({err})") from None


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The format `serve()` reports (None: the chat template's)."""
    return {"auto": None, "none": ""}.get(args.tool_call_parser, args.tool_call_parser)


def chat_flags(args: argparse.Namespace) -> list[str]:
    """The flags `add_chat_args` reads, for a worker's command line."""
    flags = ["--tool-call-parser", args.tool_call_parser]
    if args.chat_template is not None:
        flags += ["--chat-template", str(args.chat_template.resolve())]
    return flags


def add_served_model_name_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the base model's id in the APIs (default: --model as given, as vLLM's)",
    )


def served_model_name(args: argparse.Namespace) -> str:
    """The base model's id: --served-model-name, else --model as the user gave it."""
    return args.served_model_name or args.model


def add_sharding_args(parser: argparse.ArgumentParser) -> None:
    """--sharding, --lora-sharding (read back with `sharding_config`), --layer-loop and
    --decode-attention (the EngineConfig fields of their names)."""
    from configs.engine import DECODE_ATTENTIONS, LAYER_LOOPS
    from configs.sharding import LORA_SHARDINGS

    group = parser.add_argument_group("sharding, layer loop and attention")
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
    group.add_argument(
        "--layer-loop",
        choices=LAYER_LOOPS,
        default=LAYER_LOOPS[0],
        help="how a compiled step walks the layers: scan (compiled once for every layer), "
        "unrolled (each layer's code of its own: no copy of its weights out of the stack, "
        "longer compiles) or auto (default: unrolled on a GPU, scan elsewhere)",
    )
    group.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTIONS,
        default=DECODE_ATTENTIONS[0],
        help="a decode step's attention: xla (default: XLA's gather and products) or "
        "pallas (one Triton kernel over each row's blocks; interpreted off a GPU)",
    )


def sharding_config(args: argparse.Namespace):
    """The ShardingConfig `add_sharding_args` asked for (None: one device)."""
    from configs.sharding import DEFAULT_SHARDING, load_sharding

    if args.sharding is None and args.lora_sharding is None:
        return None
    return load_sharding(args.sharding or DEFAULT_SHARDING).with_lora_sharding(args.lora_sharding)


def sharding_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass `add_sharding_args`' values on to a child `jlora serve`."""
    flags = ["--layer-loop", args.layer_loop, "--decode-attention", args.decode_attention]
    flags += ["--sharding", args.sharding] if args.sharding else []
    return flags + (["--lora-sharding", args.lora_sharding] if args.lora_sharding else [])


WARMUPS = ("ahead", "on-demand")


def add_warmup_arg(group: argparse._ActionsContainer) -> None:
    """--warmup: when a server compiles its step shapes."""
    group.add_argument(
        "--warmup",
        choices=WARMUPS,
        default=WARMUPS[0],
        help="ahead: compile every step shape before listening, so no request waits for "
        "a compile (the default); on-demand: listen at once and compile each shape when a "
        "request first needs it (a quick start for trying the server; that request waits)",
    )


def add_api_key_arg(group: argparse._ActionsContainer) -> None:
    """--api-key (read back with `jlora.contract.auth.resolve_api_key`)."""
    group.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' of every client (default: $JLORA_API_KEY; "
        "health checks stay open)",
    )


def names_from(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of some of `choices`, in the order given;
    an unknown name is refused with the choices listed."""

    def names(text: str) -> tuple[str, ...]:
        given = tuple(text.split(","))
        if unknown := sorted(set(given) - set(choices)):
            raise argparse.ArgumentTypeError(f"{unknown} not in {list(choices)}")
        return given

    return names


def target_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated projections (PEFT's names or their short forms),
    in the canonical order (`canonical_targets`)."""
    try:
        return canonical_targets(text.split(","))
    except AdapterError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"


def add_lora_engine_args(group: argparse._ArgumentGroup) -> None:
    """How an engine serves adapters: --lora-mode, --lora-backend, --lora-pool,
    --max-loras, --emulated-link-gbps, --cpu-workers, --cpu-lora, --merge (read back
    with `lora_engine_config`)."""
    from configs.engine import CPU_LORA, LORA_BACKENDS, LORA_MODES, LORA_POOLS

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
    group.add_argument(
        "--lora-pool",
        choices=LORA_POOLS,
        default=LORA_POOLS[0],
        help="where the reference and mbgmv backends keep adapters on one device: kv "
        "(default: in the KV cache's pages, one pool for both, each adapter the pages of "
        "its rank) or slots (their own slots of --max-lora-rank beside the cache; bgmv "
        "always keeps these)",
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
        help="CPU LoRA workers for cpu-assist/auto, besides the engine's thread (default: "
        "one per core, less one)",
    )
    group.add_argument(
        "--cpu-lora",
        choices=CPU_LORA,
        default=CPU_LORA[0],
        help="where the CPU LoRA products run: processes (worker processes over shared "
        "memory), threads (of the engine's process), auto (default: threads where the "
        "device is the CPU, processes beside an accelerator)",
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
        "lora_pool": args.lora_pool,
        "emulated_link_gbps": args.emulated_link_gbps,
        "cpu_workers": args.cpu_workers,
        "cpu_lora": args.cpu_lora,
        "merge": args.merge,
    }


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """A --pool-size value: EngineConfig's pool_bytes, or its pool_fraction (one is 0)."""

    pool_bytes: int = 0
    pool_fraction: float = 0.0

    def __str__(self) -> str:
        """The flag's value that parses back to this one."""
        return str(self.pool_bytes) if self.pool_bytes else repr(self.pool_fraction)


def parse_pool_size(text: str) -> PoolSize:
    """--pool-size: bytes with an optional unit (`536870912`, `512MiB`, `2GiB`, `1.5GB`),
    or a fraction of the device memory free after the weights (`0.8`: a number below 1
    without a unit); ArgumentTypeError otherwise (argparse names the flag)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    units = ", ".join(SIZE_UNITS)
    scales = {name.lower(): scale for name, scale in SIZE_UNITS.items()}
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected bytes with an optional unit (512MiB, 2GiB, 1.5GB) or a "
            "fraction of the free device memory below 1 (0.8)"
        )
    number, unit = Fraction(match[1]), match[2].lower()
    if unit and unit not in scales:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown unit {match[2]!r} ({units})")
    if not unit and 0 < number < 1:
        return PoolSize(pool_fraction=float(number))
    if not unit and number.denominator != 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a fraction of the device memory must be below 1; a size in bytes "
            f"is a whole number or takes a unit ({units})"
        )
    size = int(number * scales[unit or "b"])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the pool needs at least one byte")
    return PoolSize(pool_bytes=size)


def _prefill_budget(text: str) -> int:
    from configs.engine import EngineConfig

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < EngineConfig.block_size:
        raise argparse.ArgumentTypeError(
            f"{value}: must be at least {EngineConfig.block_size} (one KV block; a chunk is "
            "whole blocks)"
        )
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 0 (0: no host pool)")
    return value


def add_cache_args(group: argparse._ActionsContainer) -> None:
    """How an engine shares device memory, keeps history KV and spreads prefills over
    steps: --cache-policy, --kv-allocation, --pool-size, --host-pool-mib,
    --prefill-token-budget (read back with `cache_config`, passed on to a child `jlora
    serve` with `cache_flags`)."""
    from configs.engine import CACHE_POLICIES, KV_ALLOCATIONS, EngineConfig

    group.add_argument(
        "--cache-policy",
        choices=CACHE_POLICIES,
        default=CACHE_POLICIES[0],
        help="fastlibra (default): FastLibra's unified pool of KV blocks and adapters, a "
        "prefix cache keyed by adapter, a cost-model swapper to host memory; lru: vLLM's "
        "static share of the pool for adapters, an LRU prefix cache swapped out to host "
        "memory; none: S-LoRA's unified pool with no history KV (a request's blocks are "
        "freed when it ends)",
    )
    group.add_argument(
        "--kv-allocation",
        choices=KV_ALLOCATIONS,
        default=KV_ALLOCATIONS[0],
        help="lazy (default): a request takes KV blocks as it grows, and when the pool runs "
        "out the newest is preempted and recomputed later; upfront: the blocks of its whole "
        "sequence (prompt + max tokens) at admission, never preempted",
    )
    group.add_argument(
        "--pool-size",
        type=parse_pool_size,
        metavar="SIZE",
        help="the device pool for KV blocks and adapters: bytes (512MiB, 2GiB, 1.5GB) or a "
        "fraction of the device memory free after the weights (0.8; devices that report "
        "their memory only); default: the KV blocks of --max-slots full sequences",
    )
    group.add_argument(
        "--host-pool-mib",
        type=_non_negative,
        default=EngineConfig.host_pool_mib,
        metavar="N",
        help="host memory for swapped-out KV, in MiB (0: evicted KV is dropped; "
        "default: %(default)s)",
    )
    group.add_argument(
        "--prefill-token-budget",
        type=_prefill_budget,
        default=EngineConfig.prefill_token_budget,
        metavar="N",
        help="prompt tokens prefilled per step beside the decode step; a longer prompt is "
        "prefilled in chunks over several steps, so running streams never wait for more "
        "than one budget's prefill (vLLM's chunked prefill; default: %(default)s)",
    )


def cache_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of `add_cache_args`."""
    size: PoolSize = args.pool_size or PoolSize()
    return {
        "cache_policy": args.cache_policy,
        "kv_allocation": args.kv_allocation,
        "pool_bytes": size.pool_bytes,
        "pool_fraction": size.pool_fraction,
        "host_pool_mib": args.host_pool_mib,
        "prefill_token_budget": args.prefill_token_budget,
    }


def cache_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass `add_cache_args`' values on to a child `jlora serve`."""
    flags = ["--cache-policy", args.cache_policy, "--kv-allocation", args.kv_allocation]
    flags += ["--host-pool-mib", str(args.host_pool_mib)]
    flags += ["--prefill-token-budget", str(args.prefill_token_budget)]
    return flags + (["--pool-size", str(args.pool_size)] if args.pool_size else [])


def model_config(spec: str):
    """The base model's shapes (a ModelConfig): a preset's config loads no weights;
    anything else is loaded (GGUF, Hugging Face directory, orbax checkpoint)."""
    from configs.model import list_presets, load_preset

    if spec in list_presets():
        return load_preset(spec).config
    from jlora.model.loading import load_model

    return load_model(spec).config


def load_model_reporting(spec: str, dtype: str, sharding=None):
    """`load_model`, with a progress bar of the tensors read on stderr (a GGUF or Hugging
    Face file's; a preset's random weights or an orbax checkpoint read none)."""
    import sys

    from tqdm import tqdm

    from jlora.model.loading import load_model

    bar: tqdm | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(desc=f"loading {spec}", total=total, unit="tensor", file=sys.stderr)
        bar.update(done - bar.n)

    try:
        return load_model(spec, resolve_dtype(dtype), progress, sharding)
    finally:
        if bar is not None:
            bar.close()
