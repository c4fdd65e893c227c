"""How a run ends (BRIEF section 7): the exit codes every command uses and the error that
carries one. The CLI prints them; the engines in ``tools/`` that the CLI drives raise them."""

from __future__ import annotations

from enum import IntEnum

from netdam.protocol.errors import NetdamError


class ExitCode(IntEnum):
    """Process exit codes every command uses."""

    OK = 0
    CHECK_FAILED = 1  # wrong result or failed check
    USAGE = 2  # usage error
    RUN_FAILED = 3  # timeout, dead node, unreachable peer
    INTERRUPTED = 130  # SIGINT (128 + 2), as shells report it


class CommandError(NetdamError):
    """A failure a command reports as ``error`` in its output, with the exit code to use."""

    def __init__(self, message: str, code: ExitCode = ExitCode.RUN_FAILED) -> None:
        super().__init__(message)
        self.code = code
