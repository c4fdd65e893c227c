"""The one fault engine: decide, hold, release (BRIEF section 7), used by the node's receive
side (``apply_faults``, here) and the switch's links (``switch_path._rx_faults``/``_tx_faults``);
the in-memory fabric draws the same numbers through ``fault_hash.fault_draws``.

Receive-side fault injection for node processes is applied to each batch before the datapath.

Every decision is ``fault_hash(seed, src, self, packet id, attempt)`` (netdam.core.faults), the
same function the in-memory fabric uses, so seeded runs replay across processes. ``attempt``
counts how often this receiver saw that (src, packet id): a small open-addressed table; when
its probe limit is hit the oldest-probed slot is reused, which can reset a count (documented in
README "Limits"). Reordered and delayed datagrams are copied aside and released later, after
the datagrams of a later batch.

``cfg`` (float64): [active, loss, dup, reorder, delay, delay_s, now_s, generation]
``keys`` (uint64): [seed, this node's endpoint]
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.fault_hash import (
    SALT_DELAY,
    SALT_DROP,
    SALT_DUP,
    SALT_REORDER,
    fault_hash,
    mix64,
    packet_id_of,
)
from netdam.kernels.state import FC_DELAY_S, FC_GEN, FC_LOSS, FC_NOW, FK_ME, FK_SEED
from netdam.kernels.wire import copy_bytes
from netdam.protocol import counters as C

_PROBES = 8


@njit(cache=True, nogil=True)
def fault_attempt(table_key, table_count, key):
    """Times *key* was seen before; records one more sighting."""
    mask = table_key.shape[0] - 1
    start = np.int64(key & np.uint64(mask))
    slot = start
    for _ in range(_PROBES):
        if table_key[slot] == key:
            count = table_count[slot]
            table_count[slot] = count + 1
            return count
        if table_key[slot] == 0:
            table_key[slot] = key
            table_count[slot] = 1
            return 0
        slot = (slot + 1) & mask
    # Probe limit: evict a slot of the window chosen by the key's own hash bits (Fibonacci
    # hashing), where the next lookup finds it, and carry its count on. Writing past the window
    # made every retry of a key "attempt 0" again (dropped for ever); restarting the count made
    # two retried keys that evict each other see attempt 0 on every sighting. With the count
    # carried on, every sighting of a slot gets a new attempt number, so a retry always draws a
    # fresh decision (attempt numbers then depend on the table's history: still seeded).
    victim = (start + np.int64((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(61))) & mask
    count = table_count[victim]
    table_key[victim] = key
    table_count[victim] = count + 1
    return count


#: Indices of the rates vector decide_fate takes (a node's cfg[FC_LOSS:], a switch link's row
#: [F_LOSS:]): drop, duplicate, reorder and delay probabilities, then the delay in seconds.
P_LOSS, P_DUP, P_REORDER, P_DELAY, P_DELAY_S = range(5)


@njit(cache=True, nogil=True)
def decide_fate(probs, seed, a, b, pid, attempt):
    """The fate of one datagram from *a* to *b*: (drop, copies, held, delay_s). *probs* is
    (loss, dup, reorder, delay, delay_s); reorder holds the datagram to the next batch, delay
    holds it delay_s longer. The same draws as core.faults.decide (fault_draws)."""
    if fault_hash(seed, a, b, pid, attempt, np.uint64(SALT_DROP)) < probs[P_LOSS]:
        return True, 0, False, 0.0
    copies = 2 if fault_hash(seed, a, b, pid, attempt, np.uint64(SALT_DUP)) < probs[P_DUP] else 1
    held = False
    delay = 0.0
    if fault_hash(seed, a, b, pid, attempt, np.uint64(SALT_REORDER)) < probs[P_REORDER]:
        held = True
    if fault_hash(seed, a, b, pid, attempt, np.uint64(SALT_DELAY)) < probs[P_DELAY]:
        held = True
        delay = probs[P_DELAY_S]
    return False, copies, held, delay


@njit(cache=True, nogil=True)
def hold_datagram(data, ln, ep, tag, release, gen, hold):
    """Copy a datagram aside until *release* (and at least the next batch, *gen*). False when
    the table is full (the datagram then goes on at once)."""
    if ln > hold.buf.shape[1]:
        return False
    for h in range(hold.len.shape[0]):
        if hold.len[h] == 0:
            copy_bytes(hold.buf[h], 0, data, 0, ln)
            hold.len[h] = ln
            hold.ep[h] = ep
            hold.tag[h] = tag
            hold.time[h] = release
            hold.gen[h] = gen
            return True
    return False


@njit(cache=True, nogil=True)
def release_into_batch(rx_buf, end, out_off, out_len, out_src, m, hold, tag, gen, now):
    """Append the held datagrams of *tag* that are due (held in an earlier batch, time come) to
    a receive batch, copied after its data at *end*. Returns (m, end, released)."""
    released = 0
    for h in range(hold.len.shape[0]):
        ln = np.int64(hold.len[h])
        if ln == 0 or hold.tag[h] != tag or hold.gen[h] >= gen or hold.time[h] > now:
            continue
        if not fits_held(rx_buf, end, out_off, m, ln):
            break
        m, end = take_held(rx_buf, end, out_off, out_len, out_src, m, hold, h)
        released += 1
    return m, end, released


@njit(cache=True, nogil=True)
def fits_held(rx_buf, end, out_off, m, ln):
    """A held datagram of *ln* bytes fits the batch: in rx_buf from *end*, and as entry *m*."""
    return end + ln <= rx_buf.shape[0] and m < out_off.shape[0]


@njit(cache=True, nogil=True)
def take_held(rx_buf, end, out_off, out_len, out_src, m, hold, h):
    """Move held datagram *h* into the batch as entry *m*, copied to rx_buf[end:] (fits_held
    said it fits), and free its place. Returns (m, end) after it."""
    ln = np.int64(hold.len[h])
    copy_bytes(rx_buf, end, hold.buf[h], 0, ln)
    out_off[m] = end
    out_len[m] = ln
    out_src[m] = hold.ep[h]
    hold.len[h] = 0
    return m + 1, end + ln


@njit(cache=True, nogil=True)
def apply_faults(rx, n, faults, counters):
    """Rewrite rx[0:n] in place as the faults decide; returns the new count (rx arrays must
    have room for 2n + held entries, rx_buf room after the data for released copies)."""
    rx_buf, rx_off, rx_len, rx_src = rx
    cfg, keys, table_key, table_count, hold = faults
    hold_len = hold.len
    seed = keys[FK_SEED]
    me = keys[FK_ME]
    out_off = np.empty(2 * n + hold_len.shape[0], np.int64)
    out_len = np.empty(2 * n + hold_len.shape[0], np.int32)
    out_src = np.empty(2 * n + hold_len.shape[0], np.uint64)
    m = 0
    end = 0
    for i in range(n):
        off = rx_off[i]
        ln = np.int64(rx_len[i])
        src = rx_src[i]
        end = max(end, off + ln)
        pid = packet_id_of(rx_buf[off : off + ln], ln)
        attempt = fault_attempt(table_key, table_count, mix64(src ^ mix64(pid)) | np.uint64(1))
        drop, copies, held, delay = decide_fate(
            cfg[FC_LOSS : FC_DELAY_S + 1], seed, src, me, pid, attempt
        )
        if drop:
            counters[C.DROP_FAULT] += 1
            continue
        if held and hold_datagram(
            rx_buf[off : off + ln], ln, src, 0, cfg[FC_NOW] + delay, np.int64(cfg[FC_GEN]), hold
        ):
            copies -= 1  # one copy waits aside; a duplicate still goes now
        for _ in range(copies):
            out_off[m] = off
            out_len[m] = ln
            out_src[m] = src
            m += 1
    # Release held datagrams whose time has come and that were held in an earlier batch.
    m, end, _ = release_into_batch(
        rx_buf, end, out_off, out_len, out_src, m, hold, 0, np.int64(cfg[FC_GEN]), cfg[FC_NOW]
    )
    m = min(m, rx_off.shape[0])
    rx_off[:m] = out_off[:m]
    rx_len[:m] = out_len[:m]
    rx_src[:m] = out_src[:m]
    return m
