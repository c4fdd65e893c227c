"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import Cluster, make_cluster


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
    from netdam.nodeproc import NodeProcess, NodeProcessConfig

    proc = NodeProcess(NodeProcessConfig(bind=("127.0.0.1", 0), memory_bytes=1 << 16, name=f"warm-{os.getpid()}"))
    try:
        proc.warm_up()
        proc.core.handle_timer(0.0)
    finally:
        proc.close()
