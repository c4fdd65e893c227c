"""Waiting for a child process to start: as long as it works, never a fixed deadline.

A child that loads (or, on a first run, compiles) the kernels takes what the machine gives it:
seconds when quiet, minutes under load (a first quick start on a busy 2-core machine spent 77 s
compiling). A fixed deadline turned that into a failure (issue 23). So a start fails only when
the child has used no CPU for ``STALL_S`` (hung, or waiting for something that never comes) or
has exited, or after ``START_LIMIT_S`` whatever it does. Light on purpose (no numba): the
launcher imports it for commands that only read or stop clusters.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from netdam.protocol.errors import NetdamError

#: prctl(2) option: the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1

#: A start fails once the child has used no CPU for this long.
STALL_S = 30.0
#: ... and in any case after this long (a compile that spins for 30 minutes is a bug).
START_LIMIT_S = 1800.0


class StartStalled(NetdamError, TimeoutError):
    """A child stopped working before it said it was ready; the message names it."""


class CpuWatch:
    """When a process last used CPU (utime + stime of /proc/PID/stat), to tell a slow start
    from a hung one. Without /proc every process counts as busy."""

    def __init__(self, pid: int) -> None:
        self.path = Path(f"/proc/{pid}/stat")
        self.ticks = -1
        self.changed = time.monotonic()

    def idle_for(self, now: float) -> float:
        try:
            fields = self.path.read_text().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
        except (OSError, IndexError, ValueError):
            return 0.0
        if ticks != self.ticks:
            self.ticks, self.changed = ticks, now
        return now - self.changed


def stall_reason(watch: CpuWatch, started: float, now: float) -> str | None:
    """Why a start that has not finished should be given up now, or None to keep waiting."""
    if watch.idle_for(now) > STALL_S:
        return f"used no CPU for {STALL_S:.0f} s"
    if now - started > START_LIMIT_S:
        return f"still starting after {START_LIMIT_S:.0f} s"
    return None


def wait_while_working(pid: int, arrived: Callable[[float], bool], what: str) -> None:
    """Call ``arrived(seconds)`` (which waits up to *seconds* for the child's ready message, or
    its end, and says whether one came) until it says so; raise StartStalled naming *what*
    when the child stalls."""
    watch = CpuWatch(pid)
    started = time.monotonic()
    while not arrived(0.5):
        reason = stall_reason(watch, started, time.monotonic())
        if reason is not None:
            raise StartStalled(f"{what} (pid {pid}) {reason} before it was ready")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent dies (prctl PR_SET_PDEATHSIG): no orphans."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
