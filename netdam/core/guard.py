"""The source guard's settings (SPEC.md 12), written into the kernels' ``Guard`` arrays.

Off in a bare core (tests drive cores with synthetic clocks and deliberate failures); node and
switch processes switch it on unless started with ``--no-guard``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from netdam.kernels.guard import (
    G_ADMIN_K0,
    G_ADMIN_K1,
    G_BURST,
    G_FACTOR,
    G_FORGET,
    G_LOCKOUT,
    G_RATE,
    G_T0,
    G_TMAX,
    new_guard,
)
from netdam.kernels.state import Guard
from netdam.protocol.constants import (
    AMPLIFICATION_FACTOR,
    LOCKOUT_BURST,
    LOCKOUT_FIRST_S,
    LOCKOUT_FORGET_S,
    LOCKOUT_MAX_S,
    LOCKOUT_RATE_PER_S,
)


@dataclass(frozen=True)
class GuardConfig:
    """Lockout of key guessers and the anti-amplification limit (0 factor: off)."""

    lockout: bool = False
    burst: int = LOCKOUT_BURST
    rate_per_s: float = LOCKOUT_RATE_PER_S
    first_s: float = LOCKOUT_FIRST_S
    max_s: float = LOCKOUT_MAX_S
    forget_s: float = LOCKOUT_FORGET_S
    amplification_factor: float = 0.0

    @classmethod
    def on(cls) -> GuardConfig:
        """The defaults of node and switch processes: both defences on."""
        return cls(lockout=True, amplification_factor=float(AMPLIFICATION_FACTOR))

    def build(self) -> Guard:
        """Fresh guard arrays with this configuration and a new secret token key."""
        if self.burst < 1 or self.rate_per_s < 0 or not 0 < self.first_s <= self.max_s:
            raise ValueError("lockout needs burst >= 1, rate >= 0 and 0 < first <= max seconds")
        guard = new_guard()
        guard.cfg[G_LOCKOUT] = 1.0 if self.lockout else 0.0
        guard.cfg[G_BURST] = float(self.burst)
        guard.cfg[G_RATE] = self.rate_per_s
        guard.cfg[G_T0] = self.first_s
        guard.cfg[G_TMAX] = self.max_s
        guard.cfg[G_FORGET] = self.forget_s
        guard.cfg[G_FACTOR] = self.amplification_factor
        set_token_key(guard, secrets.token_bytes(16))
        return guard


def _words(key: bytes) -> np.ndarray:
    if len(key) != 16:
        raise ValueError(f"a 128-bit key is 16 bytes, not {len(key)}")
    return np.frombuffer(key, "<u8").astype(np.uint64)


def set_token_key(guard: Guard, key: bytes) -> None:
    """The 16-byte SipHash key of the address-validation tokens (SPEC.md 12.4)."""
    guard.key[0:2] = _words(key)


def set_admin_tag_key(guard: Guard, key: bytes) -> None:
    """The cluster's 16-byte admin tag key (SPEC.md 2.6, "Control tags"): the kernels take a
    TAGGED control datagram, a locked-out source's too, when its tag verifies under it. b""
    clears it (no control tags: the admin key in ``rkey`` authorises, as in v1)."""
    guard.key[G_ADMIN_K0 : G_ADMIN_K1 + 1] = _words(key) if key else 0
