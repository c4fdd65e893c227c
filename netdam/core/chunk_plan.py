"""How a collective cuts a buffer into blocks, shared by the host API and the engine.

The host (``netdam.api``) and every node's engine (``netdam.core.collective``) must agree on which
elements each rank owns without talking; both compute it here from the descriptor's fields.
"""

from __future__ import annotations

import numpy as np

from netdam.protocol.constants import HEADER_SIZE, IP_UDP_OVERHEAD, SEGMENT_SIZE
from netdam.protocol.payloads import DESCRIPTOR, Algo


def block_bounds(algo: int, count: int, world: int, root: int) -> np.ndarray:
    """Element bounds of the N blocks (N+1 entries)."""
    if algo == Algo.BROADCAST:
        return np.array([0 if j <= root else count for j in range(world + 1)], np.int64)
    return np.array([j * count // world for j in range(world + 1)], np.int64)


def min_mtu(world: int) -> int:
    """Smallest IP MTU at which a collective over *world* nodes can start: the START_COLL packet
    carries the fixed header, an SR list naming every member and the 64-byte descriptor (SPEC
    6.5); chunks then carry at least one 8-byte element behind an SR list one shorter."""
    return int(IP_UDP_OVERHEAD + HEADER_SIZE + SEGMENT_SIZE * world + DESCRIPTOR.size)
