"""Node memory as a file mapped into the node and into host processes (the CXL/PCIe stand-in).

In NetDAM the host reaches NIC memory by load/store. Here a node's memory is a file (by default
under /dev/shm) that the node maps with mmap; a host process on the same machine maps the same
file as a numpy array (``attach``). We do not use multiprocessing.shared_memory: before Python
3.13 its resource tracker unlinks the segment when any attaching process exits (BRIEF s3).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_SHM_DIR = Path("/dev/shm")


@dataclass
class NodeMemory:
    """A node's memory file, mapped; ``array`` is the node's view of it."""

    path: Path
    size: int
    array: np.ndarray
    _map: mmap.mmap

    def close(self, unlink: bool = True) -> None:
        """Unmap; remove the file unless another process is meant to keep it."""
        del self.array
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps at exit
        if unlink:
            remove_memory_file(self.path)


def remove_memory_file(path: Path) -> None:
    """A node's memory file and the arena lock files hosts made beside it (every job's,
    api.arena_lock_path): the arenas die with the memory. A host still holding a lock keeps
    its open file; nobody can take an arena of memory that is gone."""
    path.unlink(missing_ok=True)
    for lock in path.parent.glob(f"{path.name}.arena.*lock"):
        lock.unlink(missing_ok=True)


def create_memory(directory: Path, name: str, size: int) -> NodeMemory:
    """Create (or truncate) ``directory/name`` of *size* bytes, zero-filled, and map it.

    Checks free space first: a sparse file on a full tmpfs would SIGBUS the node on first touch.
    """
    if size <= 0:
        raise ValueError(f"--memory must be positive, got {size}")
    if not directory.is_dir():
        raise ValueError(
            f"memory directory {directory} does not exist: create it or pass --shm-dir"
        )
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if free < size:
        raise ValueError(
            f"not enough space for {size} bytes of node memory in {directory} ({free} bytes free): "
            "lower --memory or pass --shm-dir pointing to a larger directory"
        )
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # reserve now: fail here, not with SIGBUS later
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise ValueError(
            f"cannot allocate {size} bytes of node memory in {directory}: {exc.strerror}; "
            "lower --memory or pass --shm-dir"
        ) from None
    os.close(fd)
    return NodeMemory(path, size, np.frombuffer(mapping, dtype=np.uint8), mapping)


def attach(path: str | os.PathLike[str], dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """Map a running node's memory file into this process (host load/store).

    Returns a writable numpy array backed by the file; writes are visible to the node and to
    every other attached process at once. Not atomic with packet atomics (SPEC.md section 7).
    Detach by dropping every reference to the array.
    """
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(
            f"node memory file {target} not found: is the node running? (see the cluster file)"
        )
    return np.memmap(target, dtype=dtype, mode="r+")


def prefault(*owners: object, skip: tuple[np.ndarray, ...] = ()) -> int:
    """Touch every page of every numpy array held (as an attribute) by *owners*, keeping the
    values, so a process's fixed-size queues and tables are resident from the start: its memory
    use is then flat under any load (`netdam flood` measures RssAnon), instead of creeping up
    as traffic first writes pages np.zeros left unmapped. Arrays in *skip* (the node's memory:
    a shared file, not the process's own) are left alone. Returns the bytes touched."""
    touched = 0
    for owner in owners:
        for value in vars(owner).values():
            if (
                not isinstance(value, np.ndarray)
                or value.nbytes == 0
                or any(value is s for s in skip)
            ):
                continue
            if not value.flags.c_contiguous or not value.flags.writeable:
                continue
            flat = value.reshape(-1).view(np.uint8)
            flat[::4096] = flat[::4096].copy()  # one write per page; the same bytes
            touched += value.nbytes
    return touched
