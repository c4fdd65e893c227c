"""Waiting for a child process to start: as long as it works, never a fixed deadline.

A child that loads (or, on a first run, compiles) the kernels takes what the machine gives it:
seconds when quiet, minutes under load (a first quick start on a busy 2-core machine spent 77 s
compiling). A fixed deadline turned that into a failure (issue 23). So a start fails only when
the child has used no CPU for ``STALL_S`` (hung, or waiting for something that never comes) or
has exited, or after ``START_LIMIT_S`` whatever it does. Light on purpose (no numba): the
launcher imports it for commands that only read or stop clusters.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from netdam.protocol.errors import NetdamError

#: The cores this process may run on (its affinity, else the machine's): what polling instead
#: of sleeping is weighed against, in node processes (nic_host) and in hosts (api).
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

#: prctl(2) option: the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1

#: Linux scheduling policies a node process may run under (``netdam node --scheduling``).
#: "batch" (SCHED_BATCH, sched(7)): the process is never woken into preempting the task that
#: woke it. A NIC is woken by its host's datagram; on real hardware it has its own silicon,
#: here it shares the cores, and woken as an ordinary task it preempted the host in the middle
#: of issuing the next rank's START_COLL (a loopback sendto() took ~90 us of the host's wall
#: time). Measured on 2 cores, medians of 1,000 calls, normal -> batch: 4 nodes x 4 KiB
#: 1.45-1.58 -> 1.29-1.31 ms (p90 2.45-2.51 -> 1.39-1.40), 8 x 4 KiB 2.49-3.14 -> 2.24-2.28
#: ms, 4 x 1 MiB 3.07-4.11 -> 2.72-2.81 ms; 64 NICs x 1 MiB 60.1-60.6 -> 62.9-64.8 ms
#: (docs/PERFORMANCE.md). "normal": the default policy (SCHED_OTHER).
SCHEDULING = ("batch", "normal")


def use_scheduling(policy: str) -> int | None:
    """Run this thread (and the threads it starts later, and children it forks) under
    *policy*, one of SCHEDULING; returns the policy it ran under before (for restore_scheduling;
    None: nothing was changed). Moving between SCHED_OTHER and SCHED_BATCH needs no privilege;
    where the system has no such policy (not Linux) or refuses, the process says so in one line
    and goes on as it was."""
    if policy not in SCHEDULING:
        raise ValueError(f"scheduling {policy!r}: one of {', '.join(SCHEDULING)}")
    try:
        before = os.sched_getscheduler(0)
        wanted = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
        if before != wanted:
            os.sched_setscheduler(0, wanted, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        print(
            f"netdam: scheduling {policy} not applied ({exc}): running under the policy as it was",
            file=sys.stderr,
        )
        return None
    return before


def restore_scheduling(before: int | None) -> None:
    """Put back the policy use_scheduling returned (a node served inside another program, a
    test's, leaves that program as it found it)."""
    if before is not None:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, before, os.sched_param(0))


def use_small_pages() -> bool | None:
    """Stop numpy asking Linux for transparent huge pages for the arrays this process allocates
    from now on; returns numpy's setting before (for restore_pages; None: this numpy has no such
    switch, nothing changed).

    numpy advises MADV_HUGEPAGE on every array of 4 MiB or more, so where THP is "madvise" (as on
    this project's machine) or "always" the first touch of such an array makes a 2 MiB page
    resident. A NIC's large tables are touched sparsely: the duplicate window's replies (8 MiB:
    a few slots per client), the send queue (8.6 MiB: as deep as it ever got), the chunk tables
    (5 MiB: as many chunks as a collective had). With 64 NICs in one process each grew by ~1.6 MB
    per all-reduce of 1 MiB, most of it huge pages of the window; with 4 KiB pages a table costs
    what is used of it (docs/PERFORMANCE.md). NIC memory itself is a mapped file, not affected."""
    switch = _hugepage_switch()
    return None if switch is None else bool(switch(False))


def restore_pages(before: bool | None) -> None:
    """Put back numpy's huge-page setting that use_small_pages returned (a node served inside
    another program, a test's, leaves it as it found it)."""
    switch = _hugepage_switch()
    if before and switch is not None:
        switch(True)


def _hugepage_switch() -> Callable[[bool], bool] | None:
    """numpy's own switch of its huge-page advice (NUMPY_MADVISE_HUGEPAGE=0 does the same, but
    only before numpy is imported, and a forked node process has it imported), or None."""
    try:
        from numpy._core import multiarray  # numpy 2's name of the module
    except ImportError:
        from numpy.core import multiarray  # type: ignore[no-redef]  # numpy 1's name of it
    switch: Callable[[bool], bool] | None = getattr(multiarray, "_set_madvise_hugepage", None)
    return switch


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
