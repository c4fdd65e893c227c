"""Node processes forked from a launcher that has the node's kernels loaded.

A node process spends ~1.5 s of CPU before it serves, nearly all of it importing numba and
loading the cached kernels. A launcher that starts cluster after cluster (the test suite, a
benchmark sweep) and has loaded the kernels itself (``warm_node_kernels``) can instead fork:
the child shares the loaded code copy-on-write and serves its NICs within milliseconds. It runs
the same NicHost as ``netdam node --nic ...``; only its birth differs. A forked node dies with
its launcher (``PR_SET_PDEATHSIG``), so detached clusters never use it (they start ``netdam
node`` processes), and its stdout, stderr and key come as a started process's do: the ready
lines on a pipe, stderr into the node's log, the admin key in the config (never in argv).

``ForkedProcess`` offers the calls the launcher makes of a ``subprocess.Popen`` (pid, stdout,
poll, wait, returncode, send_signal, kill): the child is ours, so waitpid gives its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from netdam.shell.node_process import NodeProcessConfig
    from netdam.switch.process import SwitchProcessConfig

#: prctl(2): set the calling thread's name (/proc/PID/comm), what `is_node_process` also reads.
PR_SET_NAME = 15


class ForkedProcess:
    """A forked node process, seen through the subprocess.Popen calls the launcher makes."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked node {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_node_process(
    configs: list[NodeProcessConfig], log: Path, verbose: int = 0
) -> ForkedProcess:
    """Fork a child that hosts the NICs *configs* (netdam.shell.nic_host), its ready lines on
    the returned process's stdout, its stderr in *log*."""
    # Imported here: the launcher that forks has loaded the kernels already (the point of it).
    from netdam.shell.nic_host import main

    return fork_process(lambda: main(configs), log, verbose, b"netdam-node")


def fork_switch_process(config: SwitchProcessConfig, log: Path, verbose: int = 0) -> ForkedProcess:
    """As fork_node_process, for the pool switch of a local cluster."""
    # Imported here: the launcher that forks has loaded the switch's kernels already.
    from netdam.switch.process import main

    return fork_process(lambda: main(config), log, verbose, b"netdam-switch")


def fork_process(run: Callable[[], int], log: Path, verbose: int, name: bytes) -> ForkedProcess:
    """Fork a child that runs *run* (a process's main) and exits with its code; its stdout is
    the returned process's, its stderr goes to *log*, /proc/PID/comm says *name*."""
    read_end, write_end = os.pipe()
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            code = _child(run, read_end, write_end, log_fd, verbose, name)
        except BaseException:  # reported in the node's log, as a started node's traceback would be
            with contextlib.suppress(Exception):
                os.write(2, traceback.format_exc().encode(errors="replace"))
        finally:
            os._exit(code)
    os.close(write_end)
    os.close(log_fd)
    return ForkedProcess(pid, os.fdopen(read_end, "rb", buffering=0))


def _child(
    run: Callable[[], int], read_end: int, write_end: int, log_fd: int, verbose: int, name: bytes
) -> int:
    """The forked process: its own stdout, stderr, name and signal handlers, then *run*."""
    # Everything the launcher allocated stays untouched here: frozen, never collected (a
    # collected socket object of the launcher's would close a descriptor number this node may
    # have reused for one of its own sockets).
    gc.freeze()
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(log_fd, 2)
    os.close(write_end)
    os.close(log_fd)
    os.setpgid(0, 0)  # a Ctrl-C at the launcher's terminal reaches the launcher, which stops us
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    root = logging.getLogger()
    root.handlers = [logging.StreamHandler(sys.stderr)]
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    return run()
