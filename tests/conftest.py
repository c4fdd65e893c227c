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
