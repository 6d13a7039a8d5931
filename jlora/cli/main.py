"""`jlora` entry point: parse the command line, dispatch to a subcommand.

Generated text goes to stdout; logs and errors go to stderr. A bad argument or
input exits with status 2 and a message that names it.
"""

from __future__ import annotations

import argparse
import os
import sys

from jlora.cli import adapters, convert, generate, profile, router, serve, up
from jlora.cli.common import UsageError, configure_logging
from jlora.contract.lifetime import die_with_parent


def _configure_runtime(args: argparse.Namespace) -> None:
    # --log-format: serve, up and router have it.
    configure_logging(verbose=args.verbose, log_format=getattr(args, "log_format", "text"))
    if args.command in ("router", "up"):  # no JAX in this process: the router runs anywhere
        return
    # Compiled executables persist across runs (XLA's own cache, keyed by program). Set
    # for JAX to read when it is imported: a bad flag fails before that (0.4 s sooner).
    cache_dir = os.environ.get(
        "JLORA_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jlora", "xla")
    )
    if cache_dir:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"


def _usage_errors() -> tuple[type[Exception], ...]:
    """The errors that are bad input (exit status 2). WeightsError's module loads JAX and
    Flax (0.7 s): a run that has not imported it cannot have raised it, so it is looked
    up, not imported, and a bad flag fails at once."""
    from configs import ConfigError
    from jlora.tokenizer import TokenizerError

    weights = sys.modules.get("jlora.model.weights")
    loaded = (weights.WeightsError,) if weights is not None else ()
    return (UsageError, ConfigError, TokenizerError, OSError, *loaded)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jlora", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(commands)
    serve.add_parser(commands)
    profile.add_parser(commands)
    up.add_parser(commands)
    router.add_parser(commands)
    convert.add_parser(commands)
    adapters.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # a worker `jlora up` started does not outlive it
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_runtime(args)
    from jlora.contract.errors import Code, RequestError

    try:
        return args.run(args)
    except RequestError as err:  # bad input, unless the fault is the server's own
        print(f"jlora: error: {err.message}", file=sys.stderr)
        return 1 if err.code == Code.INTERNAL else 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if not isinstance(err, _usage_errors()):
            raise
        print(f"jlora: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
