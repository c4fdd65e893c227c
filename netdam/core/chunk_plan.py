"""How a collective cuts a buffer into blocks, shared by the host API and the engine.

The host (``netdam.api``) and every node's engine (``netdam.core.collective``) must agree on which
elements each rank owns without talking; both compute it here from the descriptor's fields.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from netdam.protocol.constants import HEADER_SIZE, IP_UDP_OVERHEAD, SEGMENT_SIZE
from netdam.protocol.payloads import DESCRIPTOR, Algo


# Both plans are cached and read-only: a group's calls repeat them (a START_COLL over 64 members
# spent ~15 us of its ~150 building them).
@lru_cache(maxsize=256)
def block_bounds(algo: int, count: int, world: int, root: int) -> np.ndarray:
    """Element bounds of the N blocks (N+1 entries, read-only)."""
    if algo == Algo.BROADCAST:
        bounds = np.array([0 if j <= root else count for j in range(world + 1)], np.int64)
    else:
        bounds = np.array([j * count // world for j in range(world + 1)], np.int64)
    bounds.setflags(write=False)
    return bounds


@lru_cache(maxsize=256)
def chunk_bounds(algo: int, count: int, world: int, root: int, per_packet: int) -> np.ndarray:
    """Chunk bounds of the N blocks at *per_packet* elements a chunk (N+1 entries, read-only):
    block j's chunks are seq ``cb[j]`` up to ``cb[j + 1]``, the last one ``cb[N] - 1``."""
    sizes = np.diff(block_bounds(algo, count, world, root))
    cb = np.concatenate(([0], np.cumsum((sizes + per_packet - 1) // per_packet))).astype(np.int64)
    cb.setflags(write=False)
    return cb


def min_mtu(world: int) -> int:
    """Smallest IP MTU at which a collective over *world* nodes can start: the START_COLL packet
    carries the fixed header, an SR list naming every member and the 64-byte descriptor (SPEC
    6.5); chunks then carry at least one 8-byte element behind an SR list one shorter."""
    return int(IP_UDP_OVERHEAD + HEADER_SIZE + SEGMENT_SIZE * world + DESCRIPTOR.size)
