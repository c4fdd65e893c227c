"""Shared fixtures (helpers live in tests/helpers.py), and how the suite shares two cores.

The README runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile``) but for the
tests marked ``alone`` (they assert a deadline or that a clean run re-sends nothing, or capture
the loopback interface, which carries every worker's traffic), then those in one process. On
workers the controller compiles (or finds cached) every kernel before it starts them, and each
worker forks its clusters from itself. Run on workers among the others, an ``alone`` test runs
with no test of the other worker beside it (the room's locks below); the README keeps them out
of the workers because waiting for that cost more than running them after (docs/PERFORMANCE.md,
"The alone tests after the others").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Bytecode is cached (in __pycache__, which git ignores) even when PYTHONDONTWRITEBYTECODE is
# set, as it is on this project's machines: without the cache every pytest process rewrote the
# asserts of every test module again (`pytest --collect-only` took 14.5 s here, 7.9 s with the
# cache), and every process a test starts compiled netdam's sources again.
# Before any import below: netdam's own modules are cached too.
sys.dont_write_bytecode = False

from netdam.cluster.launch import compile_kernels_aside  # noqa: E402

# Before anything below imports (so compiles, on a cold cache) the node's kernels: the engine's
# clock and the switch's kernels compile on the other core meanwhile (launch.ASIDE_CLOCK).
compile_kernels_aside()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import Cluster, VipWire, make_cluster  # noqa: E402

#: The folder holding the two lock files of the workers' turns (set by the controller).
ROOM_ENV = "NETDAM_TEST_ROOM"


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        # xdist's workers ignore SIGINT, and an ignored signal stays ignored across exec: the
        # commands the tests interrupt (`netdam up`, `ping`) would not see Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return
    if (getattr(config.option, "numprocesses", None) or 0) > 0:
        # The controller: every kernel compiled or found before the workers start, so two
        # workers never compile the same kernels at once (each then loads them in ~2 s).
        from netdam.cluster.launch import warm_node_kernels, warm_switch_kernels

        warm_node_kernels()
        warm_switch_kernels()
        os.environ[ROOM_ENV] = tempfile.mkdtemp(prefix="netdam-tests-")


@contextlib.contextmanager
def _turn(room: Path, alone: bool) -> Iterator[None]:
    """Hold the room shared (any test) or exclusive (an ``alone`` test). A test waiting to be
    alone holds the gate, so the other worker's next tests queue behind it instead of keeping
    the room shared for ever (a writer-preferring lock from two flocks)."""
    with open(room / "gate", "a") as gate, open(room / "room", "a") as hall:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(hall, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(hall, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    room = os.environ.get(ROOM_ENV)
    if room is None or not _is_worker(item.config):
        return (yield)
    with _turn(Path(room), item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture
def cluster() -> Cluster:
    return make_cluster()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(189212)


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels() -> None:
    """Compile (or load) the node's kernels once, in this process, before tests start node
    processes: otherwise several processes compile the same kernels at once on 2 cores."""
    from netdam.cluster.launch import fork_node_processes

    # The suite starts clusters one after the other: it loads the node's kernels once, here,
    # and forks its node processes from itself (netdam.cluster.forked) instead of paying
    # ~1.5 s of CPU per started `netdam node` process. `netdam up` in a subprocess, detached
    # clusters and the tests that read a node's command line still start real ones.
    fork_node_processes()


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VipWire]:
    """A running pool (2 nodes of 1 MiB and a switch) and a bare UDP client of its VIP, per module."""
    from netdam.cluster.launch import start_pool_cluster

    cluster, switch = start_pool_cluster(
        2, memory=1 << 20, cluster_path=tmp_path_factory.mktemp("pool") / "c.toml"
    )
    w = VipWire(cluster, switch)
    try:
        yield w
    finally:
        w.close()
        switch.stop()
        cluster.stop()
