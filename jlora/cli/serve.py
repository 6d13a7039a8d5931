"""`jlora serve`: one worker, an engine in one JAX process behind the jlora.v1 gRPC API.

1. Load the model, build the engine (`--lora-mode`, `--max-loras`, ...), register the
   adapters given by `--adapter NAME=PATH` or vLLM's `--lora-modules NAME=PATH ...`,
   every adapter directory under `--adapters-dir` and every entry of the shared
   `--registry` (each checked against the registry's sha256 on the bytes loaded), and
   compile every step shape (warm-up; with `--warmup on-demand`, each shape when a
   request first needs it). An adapter named on the command line that cannot be served
   stops the start (exit 2), as in vLLM; one found in `--adapters-dir` or the registry
   that cannot (corrupt, truncated, a file linking out of the directory, a changed
   sha256) is left out with a warning naming it and why, and the rest are served (the
   router answers requests for it with the reason).
2. Serve (`jlora.server.serve`) and say on stderr where it listens (and write the
   port to `--port-file`, which is how `jlora up` finds a worker started on port 0).
3. On SIGTERM or SIGINT, stop taking requests, let the running ones finish (up to
   `--grace` seconds), then close the engine (CPU workers, shared memory).

A worker may span several JAX processes (`--coordinator HOST:PORT --num-processes N
--process-id I`, one mesh over all their devices, jlora/device/multiprocess.py):
process 0 serves, the others follow its steps and print nothing but their logs. If a
process goes away the worker reports NOT_SERVING and exits (status 3).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from jlora.cli.common import (
    UsageError,
    add_api_key_arg,
    add_cache_args,
    add_chat_args,
    add_log_format_arg,
    add_lora_engine_args,
    add_model_args,
    add_served_model_name_arg,
    add_sharding_args,
    add_warmup_arg,
    cache_config,
    chat_template,
    load_model_reporting,
    lora_engine_config,
    resolve_dtype,
    served_model_name,
    sharding_config,
    tool_call_parser,
)

log = logging.getLogger(__name__)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="serve the model over gRPC (one worker)", description=__doc__.splitlines()[0]
    )
    add_model_args(parser)
    add_served_model_name_arg(parser)
    add_chat_args(parser)
    add_sharding_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    add_api_key_arg(parser)
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free one)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics here")
    parser.add_argument("--port-file", type=Path, help="write the bound gRPC port here")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting, at most")
    parser.add_argument("--grace", type=float, default=30.0, help="drain time on SIGTERM (s)")
    add_log_format_arg(parser)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-seq-len", type=int, default=2048)
    engine.add_argument("--max-slots", type=int, default=8, help="decode batch size")
    add_cache_args(engine)
    add_warmup_arg(engine)
    lora = parser.add_argument_group("adapters")
    add_adapter_args(lora)
    lora.add_argument(
        "--adapters-dir",
        type=Path,
        metavar="DIR",
        help="register every adapter directory in DIR; RegisterAdapter paths must stay in it",
    )
    lora.add_argument(
        "--registry",
        type=Path,
        metavar="FILE",
        help="the router's adapter registry (SQLite): serve its adapters, paths relative "
        "to --adapters-dir, refusing any whose sha256 differs",
    )
    lora.add_argument("--max-lora-rank", type=int, default=64)
    add_lora_engine_args(lora)
    group = parser.add_argument_group("a worker over several processes")
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed (its followers connect to PORT+1)",
    )
    group.add_argument("--num-processes", type=int, default=1, help="processes in the worker")
    group.add_argument("--process-id", type=int, default=0, help="this one's index (0 serves)")
    parser.set_defaults(run=run)


LOST_EXIT = 3  # a process of the worker went away


def _process_group(args: argparse.Namespace) -> bool:
    """Whether this worker spans several processes (after checking the flags)."""
    count, index = args.num_processes, args.process_id
    if count < 1 or not 0 <= index < count:
        raise UsageError(
            f"--num-processes {count} --process-id {index}: need 0 <= process id < processes"
        )
    if count == 1:
        return False
    if not args.coordinator:
        raise UsageError(f"--num-processes {count}: needs --coordinator HOST:PORT")
    if not args.coordinator.rpartition(":")[2].isdigit():
        raise UsageError(f"--coordinator {args.coordinator!r}: expected HOST:PORT")
    if args.lora_mode in ("cpu-assist", "auto"):
        raise UsageError(
            f"--lora-mode {args.lora_mode}: CPU assistance is not offered across processes "
            "(use ondemand or cached)"
        )
    return True


def add_adapter_args(group: argparse._ArgumentGroup) -> None:
    """--adapter NAME=PATH and vLLM's --lora-modules (read back with `given_adapters`)."""
    group.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a PEFT adapter directory under NAME (repeatable)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="vLLM's form: adapters as NAME=PATH or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )


def given_adapters(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, path) of every `--adapter` and `--lora-modules` item, in order."""
    given = [("--adapter", item) for item in args.adapter]
    given += [("--lora-modules", item) for item in args.lora_modules]
    pairs = []
    for flag, item in given:
        if flag == "--lora-modules" and item.lstrip().startswith("{"):
            try:
                module = json.loads(item)
            except json.JSONDecodeError as err:
                raise UsageError(f"{flag} {item!r}: not valid JSON ({err.msg})") from None
            unknown = sorted(set(module) - {"name", "path", "base_model_name"})
            name, path = module.get("name"), module.get("path")
            if unknown or not isinstance(name, str) or not isinstance(path, str):
                raise UsageError(
                    f"{flag} {item!r}: expected a JSON object with string name and path "
                    "(and optionally base_model_name)"
                )
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise UsageError(f"{flag} {item!r}: expected NAME=PATH")
        pairs.append((name, path))
    return pairs


def adapters_to_register(
    pairs: list[tuple[str, str]],
    adapters_dir: Path | None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Path]:
    """NAME -> PEFT directory, from the subdirectories of `--adapters-dir` holding an
    adapter_config.json (named after the directory, through the path guard: one that
    leads out of the directory is left out, and why goes to `skipped`), then the
    adapters given by name (as given)."""
    from jlora.contract.adapters import CONFIG_FILE, resolve_adapter_dir
    from jlora.contract.errors import RequestError

    found: dict[str, Path] = {}
    if adapters_dir is not None:
        if not adapters_dir.is_dir():
            raise UsageError(f"--adapters-dir {adapters_dir}: not a directory")
        for directory in sorted(adapters_dir.iterdir()):
            if not (directory / CONFIG_FILE).is_file():
                continue
            try:
                found[directory.name] = resolve_adapter_dir(directory.name, adapters_dir)
            except RequestError as err:
                if skipped is not None:
                    skipped[directory.name] = err.message
    for name, path in pairs:
        found[name] = Path(path).expanduser()
        if skipped is not None:
            skipped.pop(name, None)
    return found


def _registry_entries(
    registry: Path | None,
    adapters_dir: Path | None,
    adapters: dict[str, Path],
    skipped: dict[str, str],
) -> dict[str, str]:
    """Add the registry's adapters to `adapters` (one whose path the guard refuses goes
    to `skipped`); returns name -> registered sha256."""
    if registry is None:
        return {}
    from jlora.contract.adapters import resolve_adapter_dir
    from jlora.contract.errors import RequestError
    from jlora.contract.registry import Registry

    if adapters_dir is None:
        raise UsageError("--registry needs --adapters-dir (registry paths are relative to it)")
    if not registry.is_file():
        raise UsageError(f"--registry {registry}: no such file")
    try:
        with Registry(registry) as opened:
            entries = opened.list()
    except RequestError as err:
        raise UsageError(f"--registry {registry}: {err.message}") from None
    for entry in entries:
        try:
            adapters[entry.name] = resolve_adapter_dir(entry.path, adapters_dir)
        except RequestError as err:
            adapters.pop(entry.name, None)
            skipped[entry.name] = err.message
    return {entry.name: entry.sha256 for entry in entries}


def _register_adapters(
    engine,
    adapters: dict[str, Path],
    expected: dict[str, str],
    *,
    required: set[str],
    skipped: dict[str, str],
) -> int:
    """Register `adapters` (each checked against its `expected` sha256) and return how
    many are; one that cannot be served stops the start if it is `required` (named on
    the command line), else is left out with a warning, as are those in `skipped`."""
    from jlora.contract.errors import RequestError

    registered = 0
    for name, path in adapters.items():
        try:
            engine.register_adapter(name, path, expect_sha256=expected.get(name))
            registered += 1
        except RequestError as err:
            if name in required:
                raise
            skipped[name] = err.message
    for name, why in skipped.items():
        log.warning("adapter %r is not served: %s", name, why)
    return registered


def run(args: argparse.Namespace) -> int:
    # The flags first, before JAX and the engine are imported: a bad one fails at once.
    several = _process_group(args)
    on_demand = args.warmup == "on-demand"
    for flag, value, low in (
        ("--max-seq-len", args.max_seq_len, 16),
        ("--max-slots", args.max_slots, 1),
        ("--max-loras", args.max_loras, 1),
        ("--max-queue", args.max_queue, 0),
    ):
        if value is not None and value < low:
            raise UsageError(f"{flag} {value}: must be at least {low}")
    given = given_adapters(args)
    skipped: dict[str, str] = {}  # adapter -> why it is not served
    adapters = adapters_to_register(given, args.adapters_dir, skipped)
    expected = _registry_entries(args.registry, args.adapters_dir, adapters, skipped)
    sharding = sharding_config(args)
    template = chat_template(args)
    if args.port and args.process_id == 0:  # before minutes of loading and compiling
        from jlora.contract.grpc_server import bind_failure

        if why := bind_failure(args.host, args.port):
            raise UsageError(f"--port {args.port}: cannot listen on {args.host}:{args.port}: {why}")
    if several:  # before anything else touches jax
        from jlora.device.multiprocess import Leader, follow, join

        join(args.coordinator, args.num_processes, args.process_id)

    from configs import EngineConfig
    from jlora.contract.auth import resolve_api_key
    from jlora.device.llama_engine import LlamaEngine
    from jlora.engine.api import SamplingParams
    from jlora.engine.device_api import DeviceEngine
    from jlora.engine.orchestrator import Orchestrator
    from jlora.server import serve

    loaded = load_model_reporting(args.model, args.dtype, sharding)
    if template is not None:
        if loaded.tokenizer is None:
            raise UsageError(f"--chat-template: {args.model} has no tokenizer to use it with")
        loaded.tokenizer.chat_template = template
    max_seq_len = min(args.max_seq_len, loaded.config.max_context)
    config = EngineConfig(
        dtype=resolve_dtype(args.dtype),
        max_slots=args.max_slots,
        max_seq_len=max_seq_len - max_seq_len % 16,
        max_loras=args.max_loras or 8,
        max_lora_rank=args.max_lora_rank,
        sharding=sharding,
        layer_loop=args.layer_loop,
        decode_attention=args.decode_attention,
        **lora_engine_config(args),
        **cache_config(args),
    )
    local = LlamaEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=config,
    )
    if several and args.process_id > 0:
        try:
            local.warmup(on_demand=on_demand)
            return follow(local, args.coordinator, args.process_id)
        finally:
            local.close()
    device: DeviceEngine = local
    servers: list = []  # the server, once it runs: a lost process fails it
    if several:
        device = Leader.accept(
            local, args.coordinator, args.num_processes, lambda why: _lost(why, servers, device)
        )
    engine = Orchestrator(device)
    try:
        required = {name for name, _ in given}
        registered = _register_adapters(
            engine, adapters, expected, required=required, skipped=skipped
        )
        if not on_demand:
            print("jlora serve: compiling...", file=sys.stderr, flush=True)
        engine.warmup(on_demand=on_demand)
        server = serve(
            engine,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            tokenizer=loaded.tokenizer,
            model_name=served_model_name(args),
            sampling_defaults=SamplingParams(**loaded.generation),
            tool_call_parser=tool_call_parser(args),
            max_queue=args.max_queue,
            adapters_dir=args.adapters_dir,
            api_key=resolve_api_key(args.api_key),
        )
        servers.append(server)
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
        served = f"{registered} adapters" + (
            f", {len(skipped)} left out: {', '.join(sorted(skipped))}" if skipped else ""
        )
        print(
            f"jlora serve: listening on {server.address} ({served}{metrics})",
            file=sys.stderr,
            flush=True,
        )
        if args.port_file is not None:
            args.port_file.write_text(f"{server.port}\n")
        server.stop_on_signals(args.grace)
        server.wait()
        return 1 if server.error is not None else 0
    finally:
        engine.close()


def _lost(reason: str, servers: list, device) -> None:
    """A process of the worker went away: no step can finish (one may be waiting on it
    already), so report NOT_SERVING, give the shared memory back and exit."""
    import os
    import time

    print(f"jlora serve: {reason}; this worker stops", file=sys.stderr, flush=True)
    for server in servers:
        server.fail(RuntimeError(reason))
    time.sleep(1.0)  # the health change and the streams' errors reach the clients
    device.close()
    os._exit(LOST_EXIT)
