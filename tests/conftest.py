"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

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
    from netdam.cluster.launch import warm_node_kernels

    warm_node_kernels()
