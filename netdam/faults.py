"""Seeded, replayable fault injection, applied by each receiver (BRIEF section 7).

Every decision is a hash of (seed, source, destination, packet id, attempt), so a run replays
exactly across processes whatever the arrival order. The packet id hashes the fields that name a
packet (opcode, seq, client, txn, collective, epoch, addresses, segments_left); the attempt counts
how often this receiver already saw that id from that source, so a retransmission gets a fresh
decision instead of being dropped forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from netdam.protocol.constants import HEADER_SIZE

# Salts separating the decision streams of one packet.
_SALT_DROP = 0x9E3779B97F4A7C15
_SALT_DUP = 0xBF58476D1CE4E5B9
_SALT_REORDER = 0x94D049BB133111EB
_SALT_DELAY = 0x2545F4914F6CDD1D


@njit(cache=True, nogil=True)
def _mix(x):  # type: ignore[no-untyped-def]
    """splitmix64 finaliser (Steele, Lea & Flood 2014): a cheap, well-mixed 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True, nogil=True)
def fault_hash(seed, src, dst, packet_id, attempt, salt):  # type: ignore[no-untyped-def]
    """Uniform draw in [0, 1) for one decision about one packet."""
    h = _mix(np.uint64(seed) ^ np.uint64(salt))
    h = _mix(h ^ np.uint64(src))
    h = _mix(h ^ np.uint64(dst))
    h = _mix(h ^ np.uint64(packet_id))
    h = _mix(h ^ np.uint64(attempt))
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True)
def packet_id(b, n):  # type: ignore[no-untyped-def]
    """Hash of the identifying header bytes (status, credit, flags and return segment excluded)."""
    if n < HEADER_SIZE:
        h = np.uint64(n)
        for k in range(n):
            h = _mix(h ^ np.uint64(b[k]))
        return h
    h = np.uint64(b[1])
    for k in range(4, 48):
        h = _mix(h ^ (np.uint64(b[k]) << np.uint64(8 * (k % 8))))
    return _mix(h ^ np.uint64(b[53]))


@dataclass(frozen=True)
class FaultSpec:
    """Probabilities of each fault per delivered datagram, and the seed that decides them."""

    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    #: Extra delay, seconds, applied to a `delay` fraction of packets (0 = none).
    delay_s: float = 0.0
    delay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("loss", "dup", "reorder", "delay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name} must be a probability between 0 and 1, got {value}")
        if self.delay_s < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {self.delay_s}")

    @property
    def active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder or (self.delay and self.delay_s))


@dataclass(frozen=True)
class FaultDecision:
    """What happens to one received datagram."""

    drop: bool
    copies: int
    reorder: bool
    delay_s: float


def decide(spec: FaultSpec, src: int, dst: int, pid: int, attempt: int) -> FaultDecision:
    """The fate of one datagram (pure: same arguments, same answer)."""
    if fault_hash(spec.seed, src, dst, pid, attempt, _SALT_DROP) < spec.loss:
        return FaultDecision(True, 0, False, 0.0)
    copies = 2 if fault_hash(spec.seed, src, dst, pid, attempt, _SALT_DUP) < spec.dup else 1
    reorder = fault_hash(spec.seed, src, dst, pid, attempt, _SALT_REORDER) < spec.reorder
    delayed = fault_hash(spec.seed, src, dst, pid, attempt, _SALT_DELAY) < spec.delay
    return FaultDecision(False, copies, reorder, spec.delay_s if delayed else 0.0)
