"""`jlora router`: the front door in front of workers: the jlora.v1 gRPC API and the
OpenAI-compatible HTTP API, with a routing policy, health checks and an adapter registry.

    jlora router --workers 10.0.0.1:50051,10.0.0.2:50051 --policy rank-aware \\
        --profile perf.json --adapters-dir /srv/adapters

Policies (`--policy`): most-idle (default), first-fit, random, and the two that read a
performance profile, rank-aware (the papers' Algorithm 1) and shortest-pending (dLoRA);
those need `--profile FILE`, the JSON file `jlora profile` fits on the workers' hardware.
Adapters registered through the router are validated inside `--adapters-dir`, recorded
in the `--registry` SQLite file and registered on every worker, by their path relative
to that directory: start the workers with the same `--adapters-dir`.

Migration (`--migration on`, off by default: routing is then as before): dLoRA's
request-adapter co-migration. Every `--migration-period` seconds the router checks its
workers; when one is overloaded (free KV at or below `--migration-kv-free` of its blocks,
or a request waiting `--migration-queue-delay` seconds for its first token) while another
is not, it solves the co-migration problem over the `--migration-top-k` busiest and idlest
workers and moves requests it forwards (queued first, then running) to other workers,
loading their adapters there first; each stream goes on without a gap. `--preload on`
(default: as --migration) also loads adapters ahead of demand, by their request rates.

SIGTERM or SIGINT drains: new requests are refused, those in flight get `--drain-grace`
seconds. Where it listens is printed on stderr. This module needs no jax (also runnable
as `python -m jlora.cli.router`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jlora.cli.common import UsageError, add_api_key_arg, add_log_format_arg, configure_logging

if TYPE_CHECKING:
    from router.migrator import MigrationConfig


def default_registry() -> Path:
    """$JLORA_STATE_DIR/registry.sqlite, else under $XDG_STATE_HOME (~/.local/state)/jlora."""
    state = os.environ.get("JLORA_STATE_DIR")
    if not state:
        xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(
            os.path.expanduser("~"), ".local", "state"
        )
        state = os.path.join(xdg, "jlora")
    return Path(state) / "registry.sqlite"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "router",
        help="route requests to workers (gRPC + OpenAI HTTP)",
        description=__doc__.splitlines()[0],
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from router.http_body import HttpLimits
    from router.policies import POLICIES

    limits = HttpLimits()
    parser.add_argument(
        "--workers",
        required=True,
        metavar="HOST:PORT,...",
        help="the workers' gRPC addresses, comma-separated",
    )
    listen = parser.add_argument_group("listening")
    listen.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    add_api_key_arg(listen)
    listen.add_argument("--port", type=int, default=50050, help="gRPC port (0: a free one)")
    listen.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI HTTP, /metrics, /health (0: free)"
    )
    listen.add_argument(
        "--http-max-body-mb",
        type=float,
        default=limits.max_body_bytes / 2**20,
        metavar="MIB",
        help="largest HTTP request body, in MiB (more: 413; default %(default)g)",
    )
    listen.add_argument(
        "--http-body-timeout",
        type=float,
        default=limits.body_timeout,
        metavar="SECONDS",
        help="time for a request body to arrive after its headers (then 408, closed; "
        "default %(default)g)",
    )
    listen.add_argument(
        "--http-idle-timeout",
        type=float,
        default=limits.idle_timeout,
        metavar="SECONDS",
        help="an HTTP connection without a whole request head is closed after it "
        "(default %(default)g)",
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument("--policy", choices=list(POLICIES), default="most-idle")
    routing.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="performance profile (`jlora profile`), required by rank-aware and shortest-pending",
    )
    routing.add_argument(
        "--slo-ms",
        type=float,
        help="rank-aware: decode-time SLO in ms (default: 1.5 x the profile's time without "
        "adapters)",
    )
    routing.add_argument(
        "--avg-resp-len",
        type=float,
        default=128.0,
        help="rank-aware, shortest-pending: average response length in tokens (default 128)",
    )
    routing.add_argument(
        "--adapter-load-ms",
        type=float,
        default=0.0,
        help="shortest-pending: time to load an adapter that is not on the device",
    )
    routing.add_argument("--seed", type=int, default=0, help="random: the generator's seed")
    routing.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait in the router for a worker with room (more: 429)",
    )
    routing.add_argument(
        "--request-timeout",
        type=float,
        metavar="SECONDS",
        help="deadline of an HTTP request (gRPC callers set their own)",
    )
    add_migration_args(parser)
    adapters = parser.add_argument_group("adapters")
    adapters.add_argument(
        "--registry",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"the adapter registry, SQLite (default: {default_registry()})",
    )
    adapters.add_argument(
        "--adapters-dir",
        type=Path,
        metavar="DIR",
        help="adapter paths resolve inside it and may not leave it (needed to register)",
    )
    adapters.add_argument(
        "--served-model-name",
        "--model-name",
        dest="model_name",
        metavar="NAME",
        help="the base model's id in the APIs (default: the one the workers report)",
    )
    add_log_format_arg(parser)
    parser.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish",
    )


def add_migration_args(parser: argparse.ArgumentParser) -> None:
    """The migration flags (`jlora router`, `jlora up`); `migration_config` reads them."""
    group = parser.add_argument_group("migration (dLoRA)")
    group.add_argument(
        "--migration",
        choices=("on", "off"),
        default="off",
        help="move requests and their adapters off overloaded workers (default: off)",
    )
    group.add_argument(
        "--preload",
        choices=("on", "off"),
        default=None,
        help="load adapters onto workers ahead of demand, by their request rates "
        "(default: as --migration)",
    )
    group.add_argument(
        "--migration-period",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="between two checks of the workers' load (default %(default)g)",
    )
    group.add_argument(
        "--migration-kv-free",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="a worker with this fraction of its KV blocks free, or less, is overloaded "
        "(default %(default)g)",
    )
    group.add_argument(
        "--migration-queue-delay",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="a worker where a request has waited this long for its first token is "
        "overloaded (default %(default)g)",
    )
    group.add_argument(
        "--migration-top-k",
        type=int,
        default=2,
        metavar="K",
        help="the K busiest and K idlest workers take part in one plan (default %(default)d)",
    )


def migration_config(args: argparse.Namespace) -> MigrationConfig | None:
    """The migrator's settings from the flags; None when both --migration and --preload
    are off; UsageError naming a bad flag."""
    from router.migrator import MigrationConfig

    migrate = args.migration == "on"
    preload = (args.preload or args.migration) == "on"
    if not (migrate or preload):
        return None
    try:
        return MigrationConfig(
            migrate=migrate,
            preload=preload,
            period=args.migration_period,
            kv_free_threshold=args.migration_kv_free,
            queue_delay_threshold=args.migration_queue_delay,
            top_k=args.migration_top_k,
        )
    except ValueError as err:
        flags = {
            "period": "--migration-period",
            "kv_free_threshold": "--migration-kv-free",
            "queue_delay_threshold": "--migration-queue-delay",
            "top_k": "--migration-top-k",
        }
        message = str(err)
        for field, flag in flags.items():
            message = message.replace(f"MigrationConfig.{field}", flag)
        raise UsageError(message) from None


def run(args: argparse.Namespace) -> int:
    from jlora.contract.auth import resolve_api_key
    from jlora.contract.registry import RegistryError
    from router.app import start_router
    from router.http_body import MAX_BODY_BYTES, HttpLimits
    from router.perf_model import ProfileError
    from router.policies import PolicyError

    for flag, value in (("--port", args.port), ("--http-port", args.http_port)):
        if not 0 <= value < 65536:
            raise UsageError(f"{flag} {value}: must be a port number (0 picks a free one)")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue {args.max_queue}: must be >= 0")
    for flag, value in (
        ("--http-max-body-mb", args.http_max_body_mb),
        ("--http-body-timeout", args.http_body_timeout),
        ("--http-idle-timeout", args.http_idle_timeout),
    ):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} {value}: must be a positive number")
    if args.http_max_body_mb * 2**20 > MAX_BODY_BYTES:
        raise UsageError(
            f"--http-max-body-mb {args.http_max_body_mb:g}: must be at most "
            f"{MAX_BODY_BYTES / 2**20:g} (a forwarded request must fit a gRPC message)"
        )
    if args.adapters_dir is not None and not args.adapters_dir.is_dir():
        raise UsageError(f"--adapters-dir {args.adapters_dir}: no such directory")
    if args.profile is not None and not args.profile.is_file():
        raise UsageError(f"--profile {args.profile}: no such file")
    migration = migration_config(args)
    try:
        handle = start_router(
            args.workers,
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            policy=args.policy,
            profile=args.profile,
            slo_ms=args.slo_ms,
            avg_resp_len=args.avg_resp_len,
            adapter_load_ms=args.adapter_load_ms,
            seed=args.seed,
            registry=args.registry or default_registry(),
            adapters_dir=args.adapters_dir,
            model_name=args.model_name,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            api_key=resolve_api_key(args.api_key),
            http_limits=HttpLimits(
                max_body_bytes=max(1, int(args.http_max_body_mb * 2**20)),
                body_timeout=args.http_body_timeout,
                idle_timeout=args.http_idle_timeout,
            ),
            migration=migration,
        )
    except (PolicyError, ProfileError) as err:
        raise UsageError(str(err)) from None
    except RegistryError as err:
        raise UsageError(err.message) from None
    except ValueError as err:  # a bad --workers address
        raise UsageError(f"--{err}") from None
    down = [f"{w.address} ({w.reason})" for w in handle.workers if not w.up]
    print(
        f"jlora router: gRPC on {handle.address}, OpenAI HTTP on "
        f"http://{args.host}:{handle.http_port}/v1 (/metrics, /health), policy {args.policy}, "
        f"migration {args.migration}, "
        f"{len(handle.workers) - len(down)}/{len(handle.workers)} workers up"
        + (f"; down: {', '.join(down)}" if down else ""),
        file=sys.stderr,
        flush=True,
    )
    handle.stop_on_signals(grace=args.drain_grace)
    handle.wait()
    print("jlora router: drained and stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jlora.cli.router ...`: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="jlora router", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(verbose=args.verbose, log_format=args.log_format)
    try:
        return run(args)
    except (UsageError, OSError) as err:
        print(f"jlora: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
