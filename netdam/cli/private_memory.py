"""Whether a private cluster's run fits this machine, checked before any node starts.

``netdam allreduce`` and ``netdam bench allreduce`` start clusters of their own whose node
memory lives in /dev/shm (a tmpfs: RAM), and keep copies of every rank's buffer in their own
memory. A run past the machine's memory is not refused by anything: the kernel's OOM killer
ends it mid-way, with a bare "Killed" (the bench once was, at 4 x 256 MiB), and may take other
processes with it. So the size is checked against /dev/shm's free space and the kernel's
estimate of available memory, and a run that does not fit gets one line naming the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from netdam.outcome import CommandError, ExitCode
from netdam.units import format_size

#: Copies of a rank's buffer a run keeps in its own memory besides node memory: the rank's
#: input, the buffer reduced, and the numpy reference's share (netdam.tools.allreduce; the
#: bench's Gloo and MPI ranks hold as many). At 8 x 256 MiB the bench took ~12 GiB of the
#: machine's memory at its peak against the 14 GiB this counts.
HOST_COPIES_PER_RANK = 3
#: proc(5): the kernel's estimate of memory available to new work, without swapping.
MEMINFO = Path("/proc/meminfo")


def memory_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes; None where the file does not say (not Linux, or < 3.14)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def shm_free(directory: Path) -> int | None:
    """Free bytes of the file system holding node memory; None when it cannot be read (the
    node names a missing directory itself)."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def largest_fitting(fits: Callable[[int], bool], below: int) -> int:
    """The largest power of two under *below* bytes for which *fits* holds (0: none): a --size
    to suggest that certainly works."""
    size = 1 << max(below.bit_length() - 1, 0)
    while size >= 1 and not (size < below and fits(size)):
        size >>= 1
    return size


def check_private_memory(
    nodes: int, nbytes: int, *, free: int | None = None, available: int | None = None
) -> None:
    """Refuse (CommandError, usage) a private cluster of *nodes* reducing *nbytes* per rank
    that /dev/shm cannot hold, or that with the run's host copies outgrows the memory
    available. *free* and *available* default to this machine's."""
    # Imported here: numba's start-up cost only for a run (these modules load the launcher).
    from netdam.shell.shm import DEFAULT_SHM_DIR
    from netdam.tools.allreduce import private_node_memory

    free = shm_free(DEFAULT_SHM_DIR) if free is None else free
    available = memory_available() if available is None else available

    def ram(count: int, size: int) -> int:
        return count * (private_node_memory(size) + HOST_COPIES_PER_RANK * size)

    def fits(count: int, size: int) -> bool:
        shm_ok = free is None or count * private_node_memory(size) <= free
        return shm_ok and (available is None or ram(count, size) <= available)

    if fits(nodes, nbytes):
        return
    smaller = largest_fitting(lambda size: fits(nodes, size), nbytes)
    fewer = next((k for k in range(nodes - 1, 1, -1) if fits(k, nbytes)), None)
    steps = [f"give --size {format_size(smaller)} or less"] if smaller else []
    if fewer is not None:
        steps.append(f"--nodes {fewer}")
    gib = float(1 << 30)
    if free is not None and nodes * private_node_memory(nbytes) > free:
        steps.append(f"free space in {DEFAULT_SHM_DIR}")
        raise CommandError(
            f"{format_size(nbytes)} per rank needs {private_node_memory(nbytes) / gib:.1f} GiB of "
            f"node memory on each of {nodes} nodes, but {DEFAULT_SHM_DIR} (where node memory "
            f"lives) has {free / gib:.1f} GiB free: {', or '.join(steps)}",
            ExitCode.USAGE,
        )
    assert available is not None  # the memory check is the one that failed
    steps.append("stop what holds the machine's memory")
    raise CommandError(
        f"{format_size(nbytes)} per rank on {nodes} nodes needs ~{ram(nodes, nbytes) / gib:.1f} GiB of "
        f"memory (node memory and {HOST_COPIES_PER_RANK} host copies of each rank's buffer), "
        f"but the machine has {available / gib:.1f} GiB available: {', or '.join(steps)}",
        ExitCode.USAGE,
    )
