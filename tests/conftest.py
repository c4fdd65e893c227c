"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

from netdam.cluster.launch import compile_kernels_aside

# Before anything below imports (so compiles, on a cold cache) the node's kernels: the engine's
# clock and the switch's kernels compile on the other core meanwhile (launch.ASIDE_CLOCK).
compile_kernels_aside()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import Cluster, VipWire, make_cluster  # noqa: E402


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
