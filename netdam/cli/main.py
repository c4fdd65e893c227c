"""The ``netdam`` command: one subcommand per module, each registering its own parser.

Every subcommand module exposes ``register(subparsers)``; the parser it adds sets ``func``
(``func(args) -> int``, the exit code). Conventions live in ``netdam.cli.common``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from netdam.cli import common as cliutil
from netdam.cli.common import CommandError, ExitCode, NetdamArgumentParser, emit

# Subcommand modules, in the order `netdam --help` lists them.
_COMMAND_MODULES = (
    "netdam.cli.demo",
    "netdam.cli.cluster",
    "netdam.cli.allreduce",
    "netdam.cli.decode",
    "netdam.cli.model",
    "netdam.cli.bench",
    "netdam.cli.pool",
    "netdam.cli.fuzz",
    "netdam.cli.soak",
    "netdam.cli.flood",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the full parser (used by main and by tests that check every --help)."""
    parser = NetdamArgumentParser(
        prog="netdam",
        description="Emulator of a NetDAM-style SmartNIC: memory behind the network port that "
        "executes instructions carried in UDP packets.",
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=NetdamArgumentParser
    )
    subparsers.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netdam`` console script; returns the exit code."""
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    cliutil.JSON_REQUESTED[0] = "--json" in arguments
    args = parser.parse_args(arguments)
    try:
        code: int = args.func(args)
    except CommandError as exc:
        if getattr(args, "json", False):
            emit({"ok": False, "error": str(exc)}, True)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        return int(ExitCode.RUN_FAILED)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
