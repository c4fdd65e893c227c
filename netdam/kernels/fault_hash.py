"""Hash kernels of fault injection: pure functions of their arguments, so decisions replay."""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.protocol.constants import HEADER_SIZE
from netdam.protocol.layout import H_DTYPE, H_OPCODE, H_SEGMENTS_LEFT, H_SEQ

# Salts separating the decision streams of one packet.
SALT_DROP = 0x9E3779B97F4A7C15
SALT_DUP = 0xBF58476D1CE4E5B9
SALT_REORDER = 0x94D049BB133111EB
SALT_DELAY = 0x2545F4914F6CDD1D


@njit("uint64(uint64)", cache=True, nogil=True)
def mix64(x):
    """splitmix64 finaliser (Steele, Lea & Flood 2014): a cheap, well-mixed 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit("float64(uint64, uint64, uint64, uint64, uint64, uint64)", cache=True, nogil=True)
def fault_hash(seed, src, dst, packet_id, attempt, salt):
    """Uniform draw in [0, 1) for one decision about one packet."""
    h = mix64(np.uint64(seed) ^ np.uint64(salt))
    h = mix64(h ^ np.uint64(src))
    h = mix64(h ^ np.uint64(dst))
    h = mix64(h ^ np.uint64(packet_id))
    h = mix64(h ^ np.uint64(attempt))
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True)
def packet_id_of(b, n):
    """Hash of the identifying header bytes (status, credit, flags and return segment excluded)."""
    if n < HEADER_SIZE:
        h = np.uint64(n)
        for k in range(n):
            h = mix64(h ^ np.uint64(b[k]))
        return h
    h = np.uint64(b[H_OPCODE])
    for k in range(H_SEQ, H_DTYPE):  # seq .. aux_addr
        h = mix64(h ^ (np.uint64(b[k]) << np.uint64(8 * (k % 8))))
    return mix64(h ^ np.uint64(b[H_SEGMENTS_LEFT]))


def fault_draws(
    seed: int, src: int, dst: int, pid: int, attempt: int
) -> tuple[float, float, float, float]:
    """The four uniform draws in [0, 1) that decide drop, duplicate, reorder and delay for one
    datagram: the same numbers the node and switch kernels draw."""
    key = [np.uint64(v & 0xFFFFFFFFFFFFFFFF) for v in (seed, src, dst, pid, attempt)]
    return tuple(
        float(fault_hash(*key, np.uint64(salt)))  # type: ignore[return-value]  # a tuple of exactly four floats, which mypy types as tuple[float, ...]
        for salt in (SALT_DROP, SALT_DUP, SALT_REORDER, SALT_DELAY)
    )


def packet_id(datagram: np.ndarray) -> int:
    """The id fault decisions use for *datagram* (a 1-D uint8 array)."""
    if datagram.dtype != np.uint8 or datagram.ndim != 1:
        raise ValueError("packet_id needs a 1-D uint8 array")
    return int(packet_id_of(datagram, datagram.shape[0]))
