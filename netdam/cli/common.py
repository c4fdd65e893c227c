"""Conventions shared by every subcommand (BRIEF section 7): exit codes (netdam.outcome), JSON
output, size flags."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from netdam import progress
from netdam.outcome import CommandError as CommandError  # re-exported: every command raises it
from netdam.outcome import ExitCode as ExitCode
from netdam.units import parse_size, parse_size_range

if TYPE_CHECKING:
    #: What ``add_subparsers`` returns, as every subcommand module's ``register`` takes it: of
    #: any parser class (the CLI makes NetdamArgumentParser ones; typeshed's generic is
    #: invariant in it, and it is no generic at run time).
    Subparsers: TypeAlias = argparse._SubParsersAction[Any]
else:
    Subparsers = argparse._SubParsersAction


def _clean(value: Any) -> Any:
    """Replace NaN/inf floats by None: JSON output never carries NaN (BRIEF section 7)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _clean(value.item())
    return value


def dumps_json(obj: dict[str, Any], *, one_line: bool = False) -> str:
    """Serialize one result object with the project's JSON rules (*one_line*: for a stream of
    objects, one per line)."""
    return json.dumps(_clean(obj), indent=None if one_line else 2, sort_keys=False, allow_nan=False)


def emit(obj: dict[str, Any], as_json: bool, text: str | None = None) -> None:
    """Print the result: exactly one JSON object on stdout with --json, else *text* (or key: value)."""

    progress.finish()  # the result never lands on a half-drawn progress line
    if as_json:
        sys.stdout.write(dumps_json(obj) + "\n")
        return
    if text is not None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    for key, value in _clean(obj).items():
        sys.stdout.write(
            f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}\n"
        )


#: Libraries whose loggers stay at WARNING whatever -v says: at DEBUG numba alone writes tens of
#: megabytes of bytecode and SSA dumps per compile, drowning netdam's own lines.
QUIET_LOGGERS = ("numba", "llvmlite", "scapy", "matplotlib", "PIL", "asyncio")


def configure_logging(verbose: int) -> None:
    """The one logging set-up of every netdam process (the CLI, node and switch processes):
    -v INFO, -vv DEBUG for netdam's loggers (the root logger, which the launcher also reads to
    pass -v on to the processes it starts), WARNING for the QUIET_LOGGERS libraries."""
    logging.basicConfig(
        level=logging.WARNING - 10 * min(verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def size_arg(text: str) -> int:
    """argparse type for a byte-valued flag: a size of at least one byte."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give at least 1 byte, e.g. 4KiB")
    return value


def port_arg(text: str) -> int:
    """argparse type for a UDP port, 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid port {text!r}: give an integer 1..65535"
        ) from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range: give 1..65535")
    return value


def readable_file(text: str) -> Path:
    """argparse type for a file the command reads: it exists, is a regular file, and is readable."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file: check the path")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text} is not readable: check its permissions")
    return path


def cluster_file(text: str) -> Path:
    """argparse type for ``--cluster FILE`` of a command that talks to a running cluster."""
    try:
        return readable_file(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or start a cluster with `netdam up`") from None


def new_or_file(text: str) -> Path:
    """argparse type for a path a command reads when present, else creates: never a directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file path")
    return path


#: Bytes a probe writes to show an output directory takes data: more than any cluster file or
#: credential, and enough that a full file system refuses it (an empty file may still fit).
OUTPUT_PROBE_BYTES = 64 << 10


def check_writable_output(path: Path, option: str, *, room: int = OUTPUT_PROBE_BYTES) -> None:
    """Refuse (exit 2, one line) an output path the command could not write, before any work:
    its directory is missing, not a directory, read-only, not ours to write or full.

    os.access alone is not enough: root passes every mode check yet still fails on a read-only
    or full file system, so the directory gets a real probe write of *room* bytes."""
    if path.is_dir():
        raise CommandError(f"{option} {path} is a directory: give a file path", ExitCode.USAGE)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        # The nearest ancestor that exists says which: a missing directory, or a file in the way.
        existing = next(p for p in (parent, *parent.parents) if p.exists())
        if not existing.is_dir():
            raise CommandError(
                f"{option} {path}: {existing} is not a directory: give a path in a directory",
                ExitCode.USAGE,
            )
        raise CommandError(
            f"{option} {path}: directory {parent} does not exist: create it (mkdir -p {parent}) "
            "or give another path",
            ExitCode.USAGE,
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise CommandError(
            f"{option} {path} exists and is not writable: fix its permissions or give another path",
            ExitCode.USAGE,
        )
    probe = parent / f".{path.name}.{os.getpid()}.probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if os.write(fd, bytes(room)) < room:  # a short write: the file system filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise CommandError(
            f"{option} {path}: {_why_unwritable(parent, exc)}", ExitCode.USAGE
        ) from None


def _why_unwritable(directory: Path, exc: OSError) -> str:
    """What a failed probe write in *directory* means, and what to do about it."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            fs = os.statvfs(directory)
            free = f" ({fs.f_bavail * fs.f_frsize} B free)"
        except OSError:
            free = ""
        return f"{directory} is full{free}: free some space there or give a path on another file system"
    if exc.errno == errno.EROFS:
        return f"{directory} is on a read-only file system: give a path in a writable directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"directory {directory} is not writable (permission denied): give a path in a writable directory"
    return f"cannot write in {directory} ({exc.strerror}): give a path in a writable directory"


def writable_output(option: str) -> Callable[[str], Path]:
    """argparse type for an output file checked with check_writable_output at parse time."""

    def parse(text: str) -> Path:
        path = Path(text)
        try:
            check_writable_output(path, option)
        except CommandError as exc:
            # argparse prefixes "argument OPTION:" itself.
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option} ")) from None
        return path

    return parse


def size_range_arg(text: str) -> list[int]:
    """argparse type for a size or an ``A..B`` range of powers of two."""
    try:
        return parse_size_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Whether the command line being parsed asked for --json (set by netdam.cli.main.main).
JSON_REQUESTED = [False]


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """argparse type for an integer in [low, high] (counts: repeats, warm-ups)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid count {text!r}: give an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {low}..{high}")
        return value

    return parse


def bounded_seconds(low: float, high: float, *, low_inclusive: bool) -> Callable[[str], float]:
    """argparse type for a finite number of seconds in (low, high] or [low, high]."""
    return _bounded_quantity(low, high, low_inclusive, unit="s", noun="seconds", symbol="seconds")


def bounded_milliseconds(low: float, high: float, *, low_inclusive: bool) -> Callable[[str], float]:
    """argparse type for a finite number of milliseconds in (low, high] or [low, high]."""
    return _bounded_quantity(low, high, low_inclusive, unit="ms", noun="milliseconds", symbol="ms")


def _bounded_quantity(
    low: float, high: float, low_inclusive: bool, *, unit: str, noun: str, symbol: str
) -> Callable[[str], float]:
    low_text = f"{low:g} <= {symbol}" if low_inclusive else f"{low:g} < {symbol}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {noun} {text!r}: give a number") from None
        above_low = value >= low if low_inclusive else value > low
        if not math.isfinite(value) or not above_low or value > high:
            raise argparse.ArgumentTypeError(
                f"{text} {unit} is out of range: give {low_text} <= {high:g}"
            )
        return value

    return parse


class NetdamArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that honours ``--json`` for usage errors too (exit 2, one JSON object)."""

    def error(self, message: str) -> NoReturn:
        # One line naming the problem and the fix (the usage block would bury it); the full
        # usage is one --help away.
        line = f"{self.prog}: {message} (see `{self.prog} --help`)"
        if JSON_REQUESTED[0]:
            sys.stdout.write(dumps_json({"ok": False, "error": line}) + "\n")
        self.exit(ExitCode.USAGE, f"error: {line}\n")
