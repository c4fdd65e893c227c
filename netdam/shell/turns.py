"""The node processes of one machine tell each other how long their loops' passes run.

A NIC sharing its process with others reads its socket only in its turn, and its collective
timers cover HOST_TURNS_PER_RTO of its own process's longest recent passes (nic_host). But a
chain's ACK comes from a NIC in another process, whose passes may run far longer: at 128 NICs x
1 MiB a column chain's first datagram sat unread ~150 ms in the other process (its row still
reducing), past the sender's RTO, and was counted re-sent (2 runs of 20). So each process
publishes its longest recent pass in a small shared file beside the memory files, and its NICs'
timers cover the longest that any process of the cluster on this machine published.

A pass is published when it ends, but a datagram for a process in a long pass waits from the
pass's start: so each process also writes when its pass in progress began, and the others'
timers cover that pass's length so far (up to IN_PASS_STALE_S: a process in one pass for longer
is stopped or dead, and loss recovery must not wait on it).

The file: ``<shm_dir>/netdam-turns-<hash of the cluster's members>``, one row per rank of
(seconds, when, began), ``when`` and ``began`` (0 between passes) on CLOCK_MONOTONIC, which
every process of a machine shares; each process writes the row of its first NIC's rank. Who may
write it: the file must be a regular file of this user that nobody else may write, else it is
not used (one warning says why): another user could otherwise slow this cluster's loss recovery
by publishing long passes.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from netdam.protocol.packet import Endpoint

log = logging.getLogger(__name__)

_ROW = 3  # float64 (seconds, when, began)
#: A pass in progress for longer than this counts for nothing (seconds): its process is stopped
#: or dead (the longest live passes measured are 0.1-0.4 s, 128 NICs a process on 2 cores).
IN_PASS_STALE_S = 1.0


class TurnBoard:
    """This process's row of the machine's pass lengths, and everyone's longest."""

    def __init__(self, path: Path, rows: np.ndarray, mapping: mmap.mmap, row: int) -> None:
        self.path = path
        self._rows = rows
        self._map = mapping
        self._row = row

    @classmethod
    def open(
        cls, shm_dir: Path, members: tuple[Endpoint, ...], world_size: int, rank: int
    ) -> TurnBoard | None:
        """The board of the cluster *members* name, shared with this machine's other node
        processes; None (and a warning) when it cannot be shared safely."""
        if world_size < 1 or not 0 <= rank < world_size:
            return None
        digest = hashlib.sha256(repr(tuple(members)).encode()).hexdigest()[:16]
        path = shm_dir / f"netdam-turns-{digest}"
        size = world_size * _ROW * 8
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            log.warning("pass lengths not shared with other node processes: %s: %s", path, exc)
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
                log.warning(
                    "pass lengths not shared with other node processes: %s is not a file of "
                    "this user that only it may write (remove it)",
                    path,
                )
                return None
            if info.st_size < size:
                os.ftruncate(fd, size)  # every process of the cluster asks the same size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            log.warning("pass lengths not shared with other node processes: %s: %s", path, exc)
            return None
        finally:
            os.close(fd)
        rows = np.frombuffer(mapping, np.float64).reshape(world_size, _ROW)
        return cls(path, rows, mapping, rank)

    def begin(self, now: float) -> None:
        """This process's pass begins at *now* (time.monotonic())."""
        self._rows[self._row, 2] = now

    def publish(self, seconds: float, now: float) -> None:
        """This process's longest recent pass (seconds) as of *now*, its pass over."""
        self._rows[self._row] = (seconds, now, 0.0)

    def longest(self, now: float, half_life_s: float) -> float:
        """The longest pass any process published, each halved per *half_life_s* since, or
        the longest pass in progress so far (IN_PASS_STALE_S at most), if longer."""
        seconds, when, began = self._rows[:, 0], self._rows[:, 1], self._rows[:, 2]
        so_far = np.where(began > 0.0, now - began, 0.0)
        running = float(np.where(so_far < IN_PASS_STALE_S, so_far, 0.0).max())
        live = (when > 0.0) & (seconds > 0.0)
        if not live.any():
            return running
        age = np.maximum(now - when[live], 0.0)
        published = float((seconds[live] * 0.5 ** (age / half_life_s)).max())
        return max(running, published)

    def processes(self) -> int:
        """How many node processes of the cluster have published here (each writes the row of
        its first NIC's rank): those sharing this machine's cores with this one."""
        return max(int(np.count_nonzero(self._rows[:, 1] > 0.0)), 1)

    def close(self) -> None:
        """Unmap and remove the file (the other processes keep their mappings)."""
        del self._rows
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps at exit
        self.path.unlink(missing_ok=True)
