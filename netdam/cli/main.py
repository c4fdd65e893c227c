"""The ``netdam`` command: one subcommand per module, each registering its own parser.

Every subcommand module exposes ``register(subparsers)``; the parser it adds sets ``func``
(``func(args) -> int``, the exit code). Conventions live in ``netdam.cli.common``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

import netdam
from netdam import progress
from netdam.cli import common as cliutil
from netdam.cli.common import CommandError, ExitCode, NetdamArgumentParser, emit

# Subcommand modules, in the order `netdam --help` lists them.
_COMMAND_MODULES = (
    "netdam.cli.demo",
    "netdam.cli.cluster",
    "netdam.cli.allreduce",
    "netdam.cli.decode",
    "netdam.cli.capture",
    "netdam.cli.model",
    "netdam.cli.bench",
    "netdam.cli.pool",
    "netdam.cli.fuzz",
    "netdam.cli.isolation",
    "netdam.cli.top",
    "netdam.cli.trace",
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
    parser.add_argument("--version", action="version", version=f"netdam {netdam.__version__}")
    _add_common_flags(parser)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for sub in _subparsers(parser):
        _add_common_flags(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every (nested) subcommand parser below *parser*."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in dict.fromkeys(action.choices.values()):
                found.append(sub)
                found.extend(_subparsers(sub))
    return found


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    """-q and -v on every subcommand (and before it): SUPPRESS keeps a subcommand's default from
    overwriting a value given before the subcommand."""
    taken = parser._option_string_actions  # noqa: SLF001 (argparse offers no public lookup)
    if "-q" not in taken:
        parser.add_argument(
            "-q",
            "--quiet",
            action="store_true",
            default=argparse.SUPPRESS,
            help="no progress or notes on stderr (errors still print)",
        )
    if "-v" not in taken:
        parser.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=argparse.SUPPRESS,
            help="log more of netdam's own lines, -vv debug (libraries stay at warnings); "
            "node and switch processes log to their log files",
        )


def _report(message: str, code: int, as_json: bool) -> int:
    """The one error path: one line on stderr, and under --json one JSON object on stdout."""
    progress.finish()
    if as_json:
        emit({"ok": False, "error": message}, True)
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netdam`` console script; returns the exit code.

    Exit codes (BRIEF section 7): 0 ok, 1 wrong result, 2 usage (argparse types check values at
    parse time), 3 the run failed, 130 interrupted. Every error is one line on stderr; under
    --json stdout holds exactly one JSON object with ``error``. An unexpected exception is a bug:
    one line naming it (exit 3), the traceback only with -vv."""
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in arguments
    cliutil.JSON_REQUESTED[0] = as_json
    try:
        args = parser.parse_args(arguments)
    except KeyboardInterrupt:
        return _report("interrupted", ExitCode.INTERRUPTED, as_json)
    verbose = int(getattr(args, "verbose", 0) or 0)
    progress.configure(quiet=bool(getattr(args, "quiet", False)), json_output=as_json)
    cliutil.configure_logging(verbose)
    # One progress line per command (stderr, terminals only, after a second): the library names
    # its phases through progress.status(). Processes that serve until stopped draw none.
    line = progress.Progress(f"netdam {args.command}", delay=1.0)
    if args.command in ("node", "switch"):
        line = contextlib.nullcontext()  # type: ignore[assignment]  # either context manager; only `with` is used
    try:
        with line:
            code: int = args.func(args)
    except CommandError as exc:
        return _report(str(exc), int(exc.code), as_json)
    except KeyboardInterrupt:
        return _report(
            "interrupted (Ctrl-C): stopped what this command started", ExitCode.INTERRUPTED, as_json
        )
    except BrokenPipeError:
        # stdout closed early (`netdam ... | head`): the reader has what it wanted. Point stdout
        # at /dev/null so the interpreter's final flush does not raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    except Exception as exc:
        if verbose >= 2:
            traceback.print_exc()
        # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
        from netdam.cluster.launch import ClusterStartError

        if isinstance(exc, ClusterStartError):
            return _report(str(exc), ExitCode.RUN_FAILED, as_json)
        where = (
            "" if verbose >= 2 else " (run again with -vv for the traceback, and please report it)"
        )
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _report(f"{type(exc).__name__}: {first}{where}", ExitCode.RUN_FAILED, as_json)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
