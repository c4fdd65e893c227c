"""The source guard of nodes and the switch (SPEC.md 12): key-guessing lockout and address
validation against reflection, in the compiled datapath.

**Lockout.** Failed authentications (a NACK BAD_RKEY or UNAUTHORIZED sent to a source that is
not a cluster member) draw from a token bucket per source IPv4 address (every port of it):
``burst`` failures at once, refilled at ``rate`` per second. An address that overdraws is locked
out: every datagram from it, a right key included, is counted (``drop_lockout``) and dropped,
for ``t0 * 2^(k-1)`` seconds (at most ``tmax``), where k counts the lockouts in the address's
*set* (below) since that set was last quiet for ``forget`` seconds. The table is fixed: ``SETS``
sets of ``WAYS`` addresses, the set chosen by a keyed hash of the address. A failing address
takes a free way, else evicts the least recently failed address that is not locked out; when
all 8 are locked out the whole set is locked (every address of that set not in the table is
dropped) for the same growing back-off: eviction never frees a locked-out address.

**Address validation** (QUIC, RFC 9000 section 8). The INFO that answers a PING carries in
``aux_addr`` a token: SipHash-2-4 of the PING's source endpoint under this process's 128-bit
secret. Only a client that receives at that address learns it. A READ from a non-member whose
answer would exceed ``factor`` (3) times the request's bytes is executed only when its
``aux_addr`` holds that token; else it is dropped and counted (``drop_amplification``). Every
other opcode answers a datagram with at most 3 times its bytes by construction.

Cluster members (the node list, the VIP) are pre-validated and never locked out. Like the rest
of the datapath, nothing here checks its arguments; the cores size every array.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.fault_hash import mix64
from netdam.kernels.state import Guard
from netdam.kernels.wire import OP_NACK
from netdam.protocol import counters as C
from netdam.protocol.constants import LOCKOUT_SETS, WAYS_PER_ADDRESS, Status
from netdam.protocol.layout import H_OPCODE, H_STATUS

#: Sets and ways of the source table (8192 entries).
SETS = LOCKOUT_SETS
WAYS = WAYS_PER_ADDRESS
#: ``cfg`` words (float64).
G_NOW, G_LOCKOUT, G_BURST, G_RATE, G_T0, G_TMAX, G_FORGET, G_FACTOR = range(8)
G_CFG_LEN = 8
#: ``key`` words: the address-validation token's SipHash key (0, 1), then the admin tag key of
#: control datagrams (2, 3; zeros: none, SPEC.md 2.6 "Control tags").
GUARD_KEY_WORDS = 4
G_ADMIN_K0, G_ADMIN_K1 = 2, 3
S_BAD_RKEY = int(Status.BAD_RKEY)
S_UNAUTHORIZED = int(Status.UNAUTHORIZED)
_SALT_SET = 0x2545F4914F6CDD1D


def new_guard(sets: int = SETS) -> Guard:
    """Empty guard arrays, everything off (the owner writes ``cfg`` and the key)."""
    n = sets * WAYS
    return Guard(
        np.zeros(G_CFG_LEN, np.float64),
        np.zeros(GUARD_KEY_WORDS, np.uint64),
        np.zeros(n, np.uint64),
        np.zeros(n, np.float64),
        np.zeros(n, np.float64),
        np.zeros(n, np.float64),
        np.zeros(sets, np.float64),
        np.zeros(sets, np.int64),
        np.zeros(sets, np.float64),
    )


# ---------------------------------------------------------------- SipHash-2-4 of one u64


@njit(cache=True, nogil=True)
def _rotl(x, b):
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


@njit(cache=True, nogil=True)
def _sipround(v0, v1, v2, v3):
    v0 += v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16) ^ v2
    v0 += v3
    v3 = _rotl(v3, 21) ^ v0
    v2 += v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(cache=True, nogil=True)
def sip_init(k0, k1):
    """SipHash's state for the key (k0, k1)."""
    return (
        k0 ^ np.uint64(0x736F6D6570736575),
        k1 ^ np.uint64(0x646F72616E646F6D),
        k0 ^ np.uint64(0x6C7967656E657261),
        k1 ^ np.uint64(0x7465646279746573),
    )


@njit(cache=True, nogil=True)
def sip_absorb(v0, v1, v2, v3, m):
    """SipHash-2-4's compression of one message word m."""
    v3 ^= m
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ m, v1, v2, v3


@njit(cache=True, nogil=True)
def _sip_final(v0, v1, v2, v3, nbytes):
    """The last block of a message of *nbytes*, a multiple of 8 (its length byte alone), and
    SipHash-2-4's finalization: the 64-bit output."""
    return sip_finish(v0, v1, v2, v3, np.uint64(nbytes & 0xFF) << np.uint64(56))


@njit(cache=True, nogil=True)
def sip_finish(v0, v1, v2, v3, last):
    """SipHash-2-4's last block *last* (the message's 0-7 tail bytes, little-endian, under its
    length mod 256 in the top byte) and its finalization: the 64-bit output."""
    v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, last)
    v2 ^= np.uint64(0xFF)
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@njit(cache=True, nogil=True)
def _siphash_u64(k0, k1, m):
    """SipHash-2-4 (Aumasson, Bernstein 2012) of the 8 bytes of *m* (little-endian) under the
    key (k0, k1): a keyed PRF, so tokens of other addresses cannot be derived from one's own."""
    v0, v1, v2, v3 = sip_init(k0, k1)
    v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, m)
    return _sip_final(v0, v1, v2, v3, 8)


@njit(cache=True, nogil=True)
def _token(key, src):
    """The address-validation token of endpoint *src* (never 0: 0 means "no token")."""
    t = _siphash_u64(key[0], key[1], np.uint64(src))
    if t == 0:
        t = np.uint64(1)
    return t


@njit(cache=True, nogil=True)
def is_validated(g, src, token):
    return token != 0 and token == _token(g.key, src)


# ---------------------------------------------------------------- lockout


@njit(cache=True, nogil=True)
def _set_of(g, src):
    ip = np.uint64(src) >> np.uint64(16)
    return np.int64(mix64(ip ^ np.uint64(_SALT_SET) ^ g.key[0]) % np.uint64(g.set_until.shape[0]))


@njit(cache=True, nogil=True)
def is_locked_out(g, src):
    """Whether datagrams from *src* (not a member) are dropped now: its entry is locked, or it
    has none and its set is locked."""
    now = g.cfg[G_NOW]
    ip = np.uint64(src) >> np.uint64(16)
    s = _set_of(g, src)
    base = s * WAYS
    for j in range(base, base + WAYS):
        if g.ep[j] == ip:
            return g.until[j] > now
    return g.set_until[s] > now


@njit(cache=True, nogil=True)
def _backoff(g, s, now):
    """The next lockout of set *s*: t0 doubled per lockout since the set was quiet for forget."""
    if now - g.set_last[s] > g.cfg[G_FORGET]:
        g.set_strikes[s] = 0
    g.set_strikes[s] += 1
    k = min(g.set_strikes[s] - 1, 40)
    duration = min(g.cfg[G_T0] * (2.0**k), g.cfg[G_TMAX])
    g.set_last[s] = now + duration  # forget counts from the end of the last lockout
    return duration


@njit(cache=True, nogil=True)
def count_failure(g, src, counters):
    """One failed authentication by *src*: draw a token, lock the source out when overdrawn."""
    now = g.cfg[G_NOW]
    counters[C.AUTH_FAILURES] += 1
    ip = np.uint64(src) >> np.uint64(16)
    s = _set_of(g, src)
    base = s * WAYS
    slot = -1
    for j in range(base, base + WAYS):
        if g.ep[j] == ip:
            slot = j
            break
    if slot < 0:
        for j in range(
            base, base + WAYS
        ):  # a free way, else the least recently failed unlocked one
            if g.ep[j] == 0:
                slot = j
                break
            if g.until[j] <= now and (slot < 0 or g.seen[j] < g.seen[slot]):
                slot = j
        if slot < 0:  # every way locked: the address (or its set) is under attack
            if g.set_until[s] <= now:
                g.set_until[s] = now + _backoff(g, s, now)
                counters[C.LOCKOUTS] += 1
            return
        g.ep[slot] = ip
        g.tokens[slot] = g.cfg[G_BURST]
        g.seen[slot] = now
        g.until[slot] = 0.0
    g.tokens[slot] = min(g.cfg[G_BURST], g.tokens[slot] + (now - g.seen[slot]) * g.cfg[G_RATE])
    g.seen[slot] = now
    g.tokens[slot] -= 1.0
    if g.tokens[slot] < 0.0:
        g.until[slot] = now + _backoff(g, s, now)
        g.tokens[slot] = g.cfg[G_BURST]
        counters[C.LOCKOUTS] += 1


@njit(cache=True, nogil=True)
def account(g, src, tx_buf, tx_off, tx_dst, first, last, counters):
    """After a datagram from *src* (not a member) was handled: the replies queued in
    [first, last) that NACK it BAD_RKEY or UNAUTHORIZED are failed authentications. Returns
    how many."""
    failed = 0
    for k in range(first, last):
        o = tx_off[k]
        if tx_dst[k] == src and tx_buf[o + H_OPCODE] == OP_NACK:
            st = tx_buf[o + H_STATUS]
            if st == S_BAD_RKEY or st == S_UNAUTHORIZED:
                count_failure(g, src, counters)
                failed += 1
    return failed


# ---------------------------------------------------------------- checked entries (Python)


def check_guard(g: Guard) -> None:
    """What the kernels take on trust: the cfg words, a four-word key, one table entry per way of
    every set, and the per-entry and per-set arrays of equal length."""
    entries = g.set_until.shape[0] * WAYS
    if (
        g.cfg.shape[0] < G_CFG_LEN
        or g.key.shape[0] != GUARD_KEY_WORDS
        or not g.ep.shape[0] == g.tokens.shape[0] == g.seen.shape[0] == g.until.shape[0] == entries
        or not g.set_until.shape[0] == g.set_strikes.shape[0] == g.set_last.shape[0]
    ):
        raise ValueError("guard arrays of inconsistent sizes (make them with new_guard)")


def address_token(g: Guard, endpoint: int) -> int:
    """The token INFO carries for *endpoint* (ip << 16 | port)."""
    if g.key.shape[0] != GUARD_KEY_WORDS:
        raise ValueError(f"guard key must be {GUARD_KEY_WORDS} u64 words")
    return int(_token(g.key, np.uint64(endpoint)))


def record_failure(g: Guard, endpoint: int, counters: np.ndarray) -> None:
    """A failed authentication seen by the control plane (UNAUTHORIZED from Python)."""
    if g.cfg[G_LOCKOUT] == 0.0:
        return
    check_guard(g)
    if counters.shape[0] < C.NUM_COUNTERS:
        raise ValueError("counters array of the wrong size")
    count_failure(g, np.uint64(endpoint), counters)


def is_locked(g: Guard, endpoint: int) -> bool:
    """Whether *endpoint*'s datagrams are dropped now (tests, stats)."""
    if g.cfg[G_LOCKOUT] == 0.0:
        return False
    return bool(is_locked_out(g, np.uint64(endpoint)))


def siphash_u64(k0: int, k1: int, message: int) -> int:
    """SipHash-2-4 of one little-endian u64 (for tests against the reference vectors)."""
    return int(_siphash_u64(np.uint64(k0), np.uint64(k1), np.uint64(message)))
