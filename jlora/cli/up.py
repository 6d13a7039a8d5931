"""`jlora up`: a router and N local workers, the whole service on one machine.

1. Adapters: those given (`--adapter NAME=PATH`, vLLM's `--lora-modules NAME=PATH ...`,
   `--adapters-dir DIR`), else demo adapters (random weights, ranks 8/16/32) written
   once under `--state-dir`.
2. N workers: `jlora serve` processes on free ports, each registering every adapter;
   their logs go to this process's stderr (`--log-format` applies to theirs too), their
   Prometheus metrics to a port of each one's own (free when `jlora up` starts; kept
   across restarts, as its gRPC port is). With `--processes-per-worker P`, a worker is
   P processes forming one mesh (`jax.distributed`; process 0 serves). They are
   supervised (supervisor.py): one that exits is restarted on its port, after a backoff,
   with the registry's adapters; and they die with this process, even a SIGKILLed one.
3. The router (`router.app.start_router`) in this process, in front of them: gRPC on
   `--port`, OpenAI-compatible HTTP on `--http-port`, the registry in `--state-dir`.
   Its /metrics (on the HTTP port) is the one scrape target of the whole service: the
   router's metrics, then every worker's (`vllm:*` and `jlora_*`) labelled
   {worker="host:port"} (router/metrics.py). Where it listens is printed on stderr
   once every worker is warm. `--migration on`
   (off by default) makes it move requests and adapters off overloaded workers (dLoRA;
   the same flags as `jlora router`).
4. SIGTERM or SIGINT: the router drains, then the workers (SIGTERM: each finishes its
   running requests), then this process exits. SIGKILL: each worker gets SIGTERM from
   the kernel (its parent-death signal) and stops the same way.

With `--api-key` (or $JLORA_API_KEY) the router and the workers require the key; the
workers get it through their environment, never on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
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
    cache_flags,
    chat_flags,
    chat_template,
    model_config,
    served_model_name,
    sharding_flags,
)
from jlora.cli.router import add_migration_args, migration_config
from jlora.cli.serve import adapters_to_register, add_adapter_args, given_adapters
from jlora.cli.supervisor import Supervisor

DEMO_RANKS = (8, 16, 32)
# The line `run` prints once the router listens, for programs that start `jlora up`:
# the router's gRPC address, its OpenAI base URL, and the workers' addresses.
LISTENING = re.compile(
    r"router gRPC on ([\d.]+:\d+), OpenAI-compatible HTTP on (\S+/v1) .*workers: ([^)]*)\)"
)
START_TIMEOUT_S = 900.0  # a cold worker compiles every step shape first


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "up", help="start a router and N local workers", description=__doc__.splitlines()[0]
    )
    add_model_args(parser)
    add_served_model_name_arg(parser)
    add_chat_args(parser)
    add_sharding_args(parser)
    parser.add_argument("--workers", type=int, default=1, help="local workers (default 1)")
    parser.add_argument(
        "--processes-per-worker",
        type=int,
        default=1,
        metavar="P",
        help="JAX processes per worker, one mesh over their devices (default 1)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    add_api_key_arg(parser)
    parser.add_argument("--port", type=int, default=50050, help="the router's gRPC port")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP")
    parser.add_argument("--policy", default="most-idle", help="routing policy")
    parser.add_argument("--profile", type=Path, help="`jlora profile` JSON (rank-aware)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path.home() / ".cache" / "jlora" / "up",
        help="the registry and the demo adapters (default: %(default)s)",
    )
    parser.add_argument("--grace", type=float, default=30.0, help="drain time on SIGTERM (s)")
    add_log_format_arg(parser)
    add_migration_args(parser)  # the router's --migration (dLoRA), off by default
    engine = parser.add_argument_group("workers")
    engine.add_argument("--max-seq-len", type=int, default=2048)
    engine.add_argument("--max-slots", type=int, default=8)
    engine.add_argument("--max-lora-rank", type=int, default=64)
    add_cache_args(engine)
    add_warmup_arg(engine)
    add_adapter_args(engine)
    engine.add_argument("--adapters-dir", type=Path, metavar="DIR")
    add_lora_engine_args(engine)
    parser.set_defaults(run=run)


def _demo_adapters(model: str, state_dir: Path) -> Path:
    """The demo adapters' directory, written on first use."""
    from jlora.adapters.peft import make_demo_adapters

    directory = state_dir / "demo-adapters" / Path(model).name
    if not any(directory.glob("*/adapter_config.json")):
        directory.mkdir(parents=True, exist_ok=True)
        make_demo_adapters(model_config(model), directory, n=len(DEMO_RANKS), ranks=DEMO_RANKS)
    return directory


def _worker_command(
    args: argparse.Namespace,
    adapters_dir: Path | None,
    port: int,
    metrics_port: int | None = None,
) -> list[str]:
    """A worker's `jlora serve` command line, asked again at each (re)start: the registry
    exists after the router's first start, with the adapters registered through it.
    `metrics_port`: where it serves /metrics (None: nowhere)."""
    command = [
        sys.executable, "-m", "jlora.cli.main", *(["-v"] if args.verbose else []), "serve",
        "--model", args.model, "--dtype", args.dtype, "--host", args.host,
        "--port", str(port), "--log-format", args.log_format,
        "--grace", str(args.grace),
        "--max-seq-len", str(args.max_seq_len), "--max-slots", str(args.max_slots),
        "--max-lora-rank", str(args.max_lora_rank), "--lora-mode", args.lora_mode,
        "--lora-backend", args.lora_backend, "--lora-pool", args.lora_pool,
        "--cpu-workers", str(args.cpu_workers),
        "--cpu-lora", args.cpu_lora,
        "--emulated-link-gbps", str(args.emulated_link_gbps), "--merge", args.merge,
        "--warmup", args.warmup,
    ]  # fmt: skip
    command += sharding_flags(args) + cache_flags(args) + chat_flags(args)
    command += ["--served-model-name", served_model_name(args)]
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port)]
    if args.max_loras is not None:
        command += ["--max-loras", str(args.max_loras)]
    if adapters_dir is not None:
        command += ["--adapters-dir", str(adapters_dir)]
        registry = args.state_dir / "registry.sqlite"
        if registry.is_file():  # adapters registered through the router last time
            command += ["--registry", str(registry)]
    for name, path in given_adapters(args):
        command += ["--adapter", f"{name}={path}"]
    return command


def _process_group(port_file: str, count: int) -> list[list[str]]:
    """The extra flags of a worker's `count` processes (none for one): a coordinator on
    two free ports (jax.distributed's, and the leader's for its followers), and the
    port file for process 0 alone."""
    if count == 1:
        return [["--port-file", port_file]]
    coordinator = f"127.0.0.1:{_free_port_pair()}"
    group = ["--coordinator", coordinator, "--num-processes", str(count)]
    return [
        [
            *group,
            "--process-id",
            str(index),
            *(["--port-file", port_file] if not index else []),
        ]
        for index in range(count)
    ]


def _free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` now."""
    import socket

    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free now."""
    import socket

    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise UsageError("no two consecutive free ports for a worker's coordinator")


def run(args: argparse.Namespace) -> int:
    from jlora.contract.auth import API_KEY_ENV, resolve_api_key
    from jlora.contract.grpc_server import bind_failure
    from router.app import start_router

    for flag, value in (
        ("--workers", args.workers),
        ("--processes-per-worker", args.processes_per_worker),
    ):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    given = given_adapters(args)
    adapters_dir = args.adapters_dir
    if not given and adapters_dir is None:
        adapters_dir = _demo_adapters(args.model, args.state_dir)
    names = sorted(adapters_to_register(given, adapters_dir))
    chat_template(args)  # one that cannot be read stops the start before any worker
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        # Before any worker starts (they compile for seconds to minutes): the router's
        # own ports must be free, or the whole start would fail only at its end.
        if port and (why := bind_failure(args.host, port)):
            raise OSError(f"{flag}: cannot listen on {args.host}:{port}: {why}")
    migration = migration_config(args)
    api_key = resolve_api_key(args.api_key)
    env = {**os.environ, API_KEY_ENV: api_key or ""}
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    metrics_ports = _free_ports(args.host, args.workers)

    def launch(index: int, port: int, port_file: str) -> list[list[str]]:
        command = _worker_command(args, adapters_dir, port, metrics_ports[index])
        return [
            [*command, *flags] for flags in _process_group(port_file, args.processes_per_worker)
        ]

    supervisor = Supervisor(launch, args.workers, env=env, host=args.host)
    try:
        print(
            f"jlora up: starting {args.workers} worker(s) of {args.model} "
            f"(adapters: {', '.join(names) or 'none'})...",
            file=sys.stderr,
            flush=True,
        )
        ports = supervisor.start(START_TIMEOUT_S)
        args.state_dir.mkdir(parents=True, exist_ok=True)
        addresses = [f"{args.host}:{port}" for port in ports]
        router = start_router(
            addresses,
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            policy=args.policy,
            profile=args.profile,
            registry=args.state_dir / "registry.sqlite",
            adapters_dir=adapters_dir,
            model_name=served_model_name(args),
            api_key=api_key,
            migration=migration,
            worker_metrics={
                address: f"http://{args.host}:{metrics_port}/metrics"
                for address, metrics_port in zip(addresses, metrics_ports, strict=True)
            },
        )
        print(
            f"jlora up: router gRPC on {args.host}:{router.port}, OpenAI-compatible HTTP "
            f"on http://{args.host}:{router.http_port}/v1 (models: "
            f"{', '.join([served_model_name(args), *names])}; workers: "
            f"{', '.join(addresses)}); metrics on http://{args.host}:{router.http_port}"
            "/metrics (the workers' included); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):
            supervisor.tick()
        router.stop(args.grace)
    finally:
        supervisor.stop(args.grace)
    return 0
