"""The life of a node or switch process, shared by both shells: stop flag and signals, dying
with the parent, start-up and the ready line, the serve buffers, the management port.

``netdam/shell/node_process.py`` and ``switch/process.py`` each bring their core and compiled
serve loop; everything else about being a process lives here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import logging
import os
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

from netdam.core.sendqueue import SLOT_BYTES, SendQueue
from netdam.kernels.udp_io import MAX_MSGS, RUN_BYTES, SEND_SCRATCH_WORDS_PER_MSG, STATE_LEN
from netdam.protocol import counters as C
from netdam.protocol.packet import Endpoint, u64_to_endpoint
from netdam.shell.startup import (
    die_with_parent,
    restore_pages,
    restore_scheduling,
    use_scheduling,
    use_small_pages,
)
from netdam.shell.udp import granted_buffers

#: prctl(2) option: signal to deliver when the parent dies.

log = logging.getLogger("netdam.process")


def record_socket_buffers(sock: socket.socket, counters: np.ndarray) -> None:
    """The receive and send buffers the kernel granted, as gauges in the counters."""
    counters[C.RCVBUF_BYTES], counters[C.SNDBUF_BYTES] = granted_buffers(sock)


def serve_buffers(
    round_datagrams: int, recv_runs: int, hold_slots: int, slot: int = SLOT_BYTES
) -> tuple[np.ndarray, ...]:
    """What a process's compiled serve loop receives into and sends with: the receive buffer
    (GRO runs land in *recv_runs* slots of 64 KiB; datagrams released by fault injection are
    copied after them, *slot* bytes each: constants.slot_bytes of the MTU), per-datagram offsets, lengths, sources and punt indices, the I/O state
    and the sendmmsg scratch."""
    extra = 2 * round_datagrams + hold_slots
    return (
        np.zeros(recv_runs * RUN_BYTES + hold_slots * slot, np.uint8),
        np.zeros(extra, np.int64),
        np.zeros(extra, np.int32),
        np.zeros(extra, np.uint64),
        np.zeros(extra, np.int32),
        np.zeros(STATE_LEN, np.int64),
        np.zeros(MAX_MSGS * SEND_SCRATCH_WORDS_PER_MSG, np.int64),
    )


class ManagedCore(Protocol):
    """What the management port needs of a core (NodeCore, SwitchCore)."""

    sendq: SendQueue

    def receive_datagram(self, data: bytes, src: Endpoint, now: float) -> None: ...


def serve_management_port(sock: socket.socket, core: ManagedCore) -> None:
    """Requests on a process's management port (stats, ping, control): the same core, the same
    checks. The control plane's answers go back through that port, which may fragment (a
    switch's COUNTERS outgrow a 1500-byte datagram); the datapath's (a READ) leave with the
    next flush of the data socket."""
    for _ in range(64):
        try:
            data, src = sock.recvfrom(65536)
        except BlockingIOError:
            return
        with core.sendq.capture() as replies:
            core.receive_datagram(data, (src[0], src[1]), time.monotonic())
        for reply, dst in replies:
            with contextlib.suppress(OSError):  # an unreachable operator loses its reply only
                sock.sendto(reply, u64_to_endpoint(dst))


#: Set by SIGTERM/SIGINT from the very start of serve_main, so a signal that arrives while the
#: process is still warming up also ends in a clean close (memory file removed), not a default kill.
_STOP_REQUESTED = [False]


def stop_requested() -> bool:
    """Whether SIGTERM/SIGINT (or request_stop) asked this process to stop."""
    return _STOP_REQUESTED[0]


def request_stop(signum: int = 0, frame: object = None) -> None:
    """Ask the serve loop to stop (also the SIGTERM/SIGINT handler)."""
    _STOP_REQUESTED[0] = True


class ServedProcess(Protocol):
    """What serve_main needs of a node or switch process."""

    def warm_up(self) -> None: ...

    def run(self) -> None: ...

    def close(self) -> None: ...


P = TypeVar("P", bound=ServedProcess)


def serve_main(
    create: Callable[[], P],
    ready_line: Callable[[P], str],
    with_parent: bool,
    scheduling: str | None = None,
) -> int:
    """The life of a node or switch process: stop handlers first, optionally die with the
    parent, create (exit 2 with the message on ValueError), warm up, announce, serve; under
    *scheduling* (netdam.shell.startup.SCHEDULING; None: as it is), which a node served inside
    another program (a test) gives back when it ends."""
    before = use_scheduling(scheduling) if scheduling is not None else None
    pages = use_small_pages()  # before the NICs' tables are allocated (startup.use_small_pages)
    try:
        return _serve_main(create, ready_line, with_parent)
    finally:
        restore_pages(pages)
        restore_scheduling(before)


def _serve_main(create: Callable[[], P], ready_line: Callable[[P], str], with_parent: bool) -> int:
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # A crash inside a compiled kernel (numba checks no bounds) kills the process without a
    # Python traceback; this prints the Python stack that called it to stderr instead (when
    # stderr is a file: run in-process under a capturing test harness it is not).
    with contextlib.suppress(io.UnsupportedOperation, ValueError):
        faulthandler.enable()
    if with_parent:
        die_with_parent()
    log.info("starting (pid %d)", os.getpid())
    try:
        proc = create()
    except ValueError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        started = time.monotonic()
        proc.warm_up()
        log.info("kernels loaded in %.2f s", time.monotonic() - started)
    except BaseException:
        log.exception("start-up failed")
        proc.close()
        raise
    if _STOP_REQUESTED[0]:
        log.info("stopped before serving")
        proc.close()
        return 0
    # Everything loaded so far (numba's compiled kernels, their type caches, the modules) lives
    # as long as the process: out of the collector's sight. Each control-plane datagram makes
    # short-lived objects, and every collection that walked those ~10^5 long-lived objects cost
    # a third of a node's CPU per management request (a PING: 213 us of node CPU, 34% in the
    # collector; gc.freeze, Python docs "gc" module).
    gc.collect()
    gc.freeze()
    line = ready_line(proc)
    log.info("%s", line)
    print(line, flush=True)
    try:
        proc.run()
    except BaseException:
        log.exception("serving failed")
        raise
    log.info("stopped")
    remove_empty_log()
    return 0


def remove_empty_log() -> None:
    """Remove this process's log file when it is still empty at a clean exit: its launcher
    removes it when it stops the cluster, but a launcher that was killed (`netdam up` under
    SIGKILL, whose nodes stop with it) never does, and each such run left two empty
    ``netdam-*.log`` files in the temporary directory. Only the file stderr is (the same inode),
    only a regular ``.log`` file there, only when empty: a log that says something stays."""
    try:
        name = os.readlink("/proc/self/fd/2")
        held = os.fstat(2)
        path = os.path.realpath(name)
        found = os.stat(path)
    except OSError:
        return  # no /proc, stderr is no file, or it is gone
    if (
        stat.S_ISREG(held.st_mode)
        and (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino)
        and held.st_size == 0
        and path.endswith(".log")
        and os.path.dirname(path) == os.path.realpath(tempfile.gettempdir())
    ):
        with contextlib.suppress(OSError):
            os.unlink(path)


class ServeLoop:
    """The serve loop both processes run: compiled calls until SIGTERM/SIGINT or ``stop``.

    Subclasses provide ``serve_once(timeout_ms)`` and ``close()``; ``idle_wait_ms`` bounds how
    long one call waits for traffic, so the stop flag is checked at least that often."""

    idle_wait_ms = 20
    stop = False

    def serve_once(self, timeout_ms: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def run(self, handle_signals: bool = True) -> None:
        """Serve until SIGTERM/SIGINT (or the parent's death, when asked) or ``stop``."""
        if handle_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        try:
            while not self.stop and not stop_requested():
                self.serve_once(self.idle_wait_ms)
        finally:
            self.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop = True
        request_stop()
