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
    #: Drop the kth_k-th packet (1-based) of opcode kth_opcode (0: off). Only the switch's links
    #: count packets per opcode (protocol/SPEC.md 11.6 "Fault injection"); nodes reject it.
    kth_opcode: int = 0
    kth_k: int = 0

    def __post_init__(self) -> None:
        for name in ("loss", "dup", "reorder", "delay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name} must be a probability between 0 and 1, got {value}")
        if self.delay_s < 0:
            raise ValueError(f"--delay-ms must be >= 0, got {self.delay_s * 1000:g}")
        if self.kth_k < 0 or not 0 <= self.kth_opcode < 64:
            raise ValueError("kth needs OPCODE@K with K >= 1, e.g. kth=FETCH_ADD@3")

    @property
    def random_active(self) -> bool:
        """Any probabilistic fault (what the hash decides)."""
        return bool(self.loss or self.dup or self.reorder or (self.delay and self.delay_s))

    @property
    def active(self) -> bool:
        return self.random_active or self.kth_k > 0


@dataclass(frozen=True)
class FaultDecision:
    """What happens to one received datagram."""

    drop: bool
    copies: int
    reorder: bool
    delay_s: float


def decide(spec: FaultSpec, src: int, dst: int, pid: int, attempt: int) -> FaultDecision:
    """The fate of one datagram (pure: same arguments, same answer)."""
    # Imported here (and in packet_id): the hash kernels load numba (~1 s), which a command
    # that only passes a FaultSpec on (`netdam up`, `down`) need not pay for.
    from netdam.kernels.fault_hash import fault_draws

    drop, dup, reorder_draw, delay = fault_draws(spec.seed, src, dst, pid, attempt)
    if drop < spec.loss:
        return FaultDecision(True, 0, False, 0.0)
    copies = 2 if dup < spec.dup else 1
    reorder = reorder_draw < spec.reorder
    delayed = delay < spec.delay
    return FaultDecision(False, copies, reorder, spec.delay_s if delayed else 0.0)


def packet_id(datagram: bytes | np.ndarray) -> int:
    """The id fault decisions use for *datagram* (see module docstring)."""
    from netdam.kernels.fault_hash import packet_id as kernel_packet_id  # see decide

    arr = np.frombuffer(datagram, np.uint8) if isinstance(datagram, bytes) else datagram
    return int(kernel_packet_id(arr))
