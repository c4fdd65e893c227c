"""The collective engine's clock: what a NIC does between packets during a collective.

``_coll_tick`` runs every serve round (and on every fabric step in tests). It originates chain
heads within the credit window, re-sends chains whose ACK is late, multicasts (or fans out)
the chunks of this node's block as soon as the chain stores them, READs missing all-gather
chunks from their owner when progress stalls, and reports completion to the host. The per
packet side (ACK capture, stores, all-gather writes, READ repair replies) is in
``datapath._process_batch``; both share the arrays below. ``netdam.core.collective`` owns them.

``cfg`` (int64) indices are the ``CFG_*`` constants; ``fcfg`` (float64) the ``F_*`` ones.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.coll_layout import (
    AUX_BITMAP,
    AUX_DONE,
    BM_BASE,
    CFG_ACKED,
    CFG_AG_NEXT,
    CFG_ALGO,
    CFG_BM_APPLIED,
    CFG_BM_ASK,
    CFG_BM_GOT,
    CFG_BM_HAS,
    CFG_CHUNKS,
    CFG_CLIENT,
    CFG_COLL,
    CFG_CUR_ASK,
    CFG_DONE_COUNT,
    CFG_DTYPE,
    CFG_EPOCH,
    CFG_FATAL,
    CFG_GROUP,
    CFG_HOST,
    CFG_IN,
    CFG_INFLIGHT,
    CFG_LEN,
    CFG_LOW_UNACKED,
    CFG_NEEDED,
    CFG_NEXT_SEND,
    CFG_OP,
    CFG_ORIG_BLOCK,
    CFG_OUT,
    CFG_OWN_BLOCK,
    CFG_PEERS_DONE,
    CFG_PER_PACKET,
    CFG_PREV_ASK,
    CFG_RANK,
    CFG_READS,
    CFG_RETRANSMITS,
    CFG_RKEY,
    CFG_SPARSE,
    CFG_STATE,
    CFG_TXN,
    CFG_WINDOW,
    CFG_WORLD,
    F_BASE_RTO,
    F_BM_SENT,
    F_DEADLINE,
    F_LAST_ADVANCE,
    F_LAST_COUNT,
    F_LAST_DONE_SENT,
    F_LAST_PROGRESS,
    F_LEN,
    F_NOW,
    F_RTO,
    F_RTTVAR,
    F_SRTT,
    F_START,
    NZ_BASE,
)  # fmt: skip
from netdam.kernels.datapath import _F_SPARSE, _SLOT, _encode_payload, _wr16, _wr32
from netdam.kernels.state import CollState, TxQueue
from netdam.protocol import counters as C

RTO_MIN_S = 0.02  # loopback emulation: 2 cores, many processes: ms-scale scheduling jitter
RTO_MAX_S = 0.25  # several retries fit in the 2 s default watchdog
#: Re-ask a hop that answered BUSY after this long (seconds).
BUSY_RETRY_S = 0.0005
#: All-gather repair starts after this long without progress (or 4 RTOs, whichever is longer).
REPAIR_MIN_S = 0.1

_OP_READ = 0x01
_OP_CHAIN_ADD = 0x05
_OP_ALL_WRITE = 0x06
_OP_ACK = 0x0B
_OP_NACK = 0x0C
_F_ACK_REQ = 0x0001
_F_MCAST = 0x0004
_F_RETRY = 0x0010
_ESIZE = np.array([1, 4, 2, 4, 8, 8, 8], dtype=np.int64)


@njit(cache=True, nogil=True)
def _header(t, opcode, flags, seq, cfg, length, addr, aux, segs):  # type: ignore[no-untyped-def]
    """Write a v1 header for this collective into t (segs: SR entries that follow)."""
    t[:64] = 0
    t[0] = 1
    t[1] = opcode
    _wr16(t, 2, flags)
    _wr32(t, 4, seq)
    _wr32(t, 16, cfg[CFG_COLL])
    _wr32(t, 20, cfg[CFG_EPOCH])
    _wr32(t, 24, cfg[CFG_RKEY])
    _wr32(t, 28, length)
    _wr32(t, 32, np.int64(addr >> 32))
    _wr32(t, 36, addr & 0xFFFFFFFF)
    _wr32(t, 40, np.int64(aux >> 32))
    _wr32(t, 44, aux & 0xFFFFFFFF)
    t[48] = cfg[CFG_DTYPE]
    t[49] = cfg[CFG_OP]
    if segs > 0:
        t[52] = 1
        t[53] = segs - 1
        t[54] = segs


@njit(cache=True, nogil=True)
def _room(tx_buf, tx_off, tx_len, tx_n):  # type: ignore[no-untyped-def]
    return tx_n + 1 < tx_len.shape[0] and tx_off[tx_n] + _SLOT <= tx_buf.shape[0]


@njit(cache=True, nogil=True)
def _commit(tx_off, tx_len, tx_dst, tx_n, length, dst):  # type: ignore[no-untyped-def]
    tx_len[tx_n] = length
    tx_dst[tx_n] = dst
    tx_off[tx_n + 1] = tx_off[tx_n] + length
    return tx_n + 1


@njit(cache=True, nogil=True)
def _block_of(cfg, cb, c):  # type: ignore[no-untyped-def]
    """Block of chunk c (empty blocks own no chunk: the last block starting at or before c)."""
    return np.searchsorted(cb[: cfg[CFG_WORLD] + 1], c, side="right") - 1


@njit(cache=True, nogil=True)
def _chunk(cfg, bounds, cb, c):  # type: ignore[no-untyped-def]
    """(block, first element, elements) of chunk c."""
    j = _block_of(cfg, cb, c)
    first = bounds[j] + (c - cb[j]) * cfg[CFG_PER_PACKET]
    return j, first, min(cfg[CFG_PER_PACKET], bounds[j + 1] - first)


@njit(cache=True, nogil=True)
def _send_chain(cfg, ring, bounds, cb, c, retry, mem, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """CHAIN_ADD for chunk c: this node's elements, SR list over the ring up to the owner."""
    j, first, count = _chunk(cfg, bounds, cb, c)
    esize = _ESIZE[cfg[CFG_DTYPE]]
    world = cfg[CFG_WORLD]
    rank = cfg[CFG_RANK]
    hops = world - 1
    nbytes = count * esize
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    flags = _F_ACK_REQ | (_F_RETRY if retry else 0)
    src_addr = cfg[CFG_IN] + first * esize
    _header(t, _OP_CHAIN_ADD, flags, c, cfg, nbytes, src_addr, cfg[CFG_OUT] + first * esize, hops)
    for h in range(hops):
        ep = ring[(rank + 1 + h) % world]
        o = 64 + 8 * h
        _wr32(t, o, np.int64(ep >> np.uint64(16)))
        _wr16(t, o + 4, np.int64(ep & np.uint64(0xFFFF)))
        t[o + 6] = 0
        t[o + 7] = 0
    p = 64 + 8 * hops
    if cfg[CFG_SPARSE] != 0:
        size, sparse = _encode_payload(t, np.int64(p), mem, np.int64(src_addr), np.int64(nbytes), esize)
        if sparse:
            _wr16(t, 2, flags | _F_SPARSE)
        return _commit(tx_off, tx_len, tx_dst, tx_n, p + size, ring[(rank + 1) % world])
    t[p : p + nbytes] = mem[src_addr : src_addr + nbytes]
    return _commit(tx_off, tx_len, tx_dst, tx_n, p + nbytes, ring[(rank + 1) % world])


@njit(cache=True, nogil=True)
def _send_gather(cfg, ring, bounds, cb, c, dst, mem, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """ALL_WRITE of chunk c of this node's output to dst (a group or one member)."""
    j, first, count = _chunk(cfg, bounds, cb, c)
    esize = _ESIZE[cfg[CFG_DTYPE]]
    nbytes = count * esize
    addr = cfg[CFG_OUT] + first * esize
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    flags = _F_MCAST if cfg[CFG_GROUP] != 0 else 0
    _header(t, _OP_ALL_WRITE, flags, c, cfg, nbytes, addr, 0, 0)
    if cfg[CFG_SPARSE] != 0:
        size, sparse = _encode_payload(t, np.int64(64), mem, np.int64(addr), np.int64(nbytes), esize)
        if sparse:
            _wr16(t, 2, flags | _F_SPARSE)
        return _commit(tx_off, tx_len, tx_dst, tx_n, 64 + size, dst)
    t[64 : 64 + nbytes] = mem[addr : addr + nbytes]
    return _commit(tx_off, tx_len, tx_dst, tx_n, 64 + nbytes, dst)


@njit(cache=True, nogil=True)
def _send_read(cfg, ring, bounds, cb, c, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """READ of chunk c's reduced data from its owner (all-gather repair)."""
    j, first, count = _chunk(cfg, bounds, cb, c)
    esize = _ESIZE[cfg[CFG_DTYPE]]
    addr = cfg[CFG_OUT] + first * esize
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _header(t, _OP_READ, 0, c, cfg, count * esize, addr, 0, 0)
    return _commit(tx_off, tx_len, tx_dst, tx_n, 64, ring[j])


@njit(cache=True, nogil=True)
def _notify(cfg, status, done, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """Tell the host the collective ended: ACK (or NACK with *status*) echoing its START_COLL ids,
    aux_addr = 1. Payload, u64 LE each: retransmits and repair READs (ACK), or the first and last
    chunk still missing here (NACK), so the host can name what it waited for."""
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _header(t, _OP_ACK if status == 0 else _OP_NACK, 0, 0, cfg, 16, 0, 1, 0)
    t[24:28] = 0  # no key in a reply to the host
    _wr32(t, 8, cfg[CFG_CLIENT])
    _wr32(t, 12, cfg[CFG_TXN])
    t[50] = status
    first = np.int64(-1)
    last = np.int64(-1)
    if status == 0:
        first = cfg[CFG_RETRANSMITS]
        last = cfg[CFG_READS]
    else:
        for c in range(cfg[CFG_CHUNKS]):
            if done[c] == 0:
                if first < 0:
                    first = c
                last = c
    for k in range(8):
        t[64 + k] = np.uint8((first >> (8 * k)) & 0xFF)
        t[72 + k] = np.uint8((last >> (8 * k)) & 0xFF)
    return _commit(tx_off, tx_len, tx_dst, tx_n, 80, np.uint64(cfg[CFG_HOST]))


def coll_tick(now: float, coll: CollState, mem: np.ndarray, counters: np.ndarray, tx: TxQueue,
              tx_n: int) -> int:  # fmt: skip
    """Checked entry to the engine's clock: advance the collective at *now*; returns tx_n."""
    if not 0 <= tx_n < tx.len.shape[0]:
        raise ValueError(f"send queue tail {tx_n} outside its {tx.len.shape[0]} slots")
    if coll.cfg.shape[0] < CFG_LEN or coll.f.shape[0] < F_LEN:
        raise ValueError("collective state arrays are shorter than their layout")
    return int(_coll_tick(now, coll, mem, counters, tx, tx_n))


@njit(cache=True, nogil=True)
def _coll_tick(now, coll, mem, counters, tx, tx_n):  # type: ignore[no-untyped-def]
    """Advance the running collective at time *now* (seconds); returns the new tx_n."""
    cfg, done, acked, fcfg, ring, bounds, cb, sent, tries, agsent = coll
    tx_buf, tx_off, tx_len, tx_dst = tx
    if cfg[CFG_PREV_ASK] != 0 or cfg[CFG_CUR_ASK] != 0:
        tx_n = _answer_previous(cfg, ring, tx_buf, tx_off, tx_len, tx_dst, tx_n)
    if cfg[CFG_STATE] != 1:
        return tx_n
    fcfg[F_NOW] = now
    if fcfg[F_START] < 0.0:  # first tick after START_COLL: the clock starts now
        fcfg[F_START] = now
        fcfg[F_LAST_PROGRESS] = now
        fcfg[F_LAST_ADVANCE] = now
    window = cfg[CFG_WINDOW]
    # DONEs and (sparse mode) arriving bitmaps are progress too
    advance = cfg[CFG_DONE_COUNT] + cfg[CFG_ACKED] + cfg[CFG_PEERS_DONE] + cfg[CFG_BM_GOT]
    if advance != fcfg[F_LAST_COUNT]:
        fcfg[F_LAST_COUNT] = advance
        fcfg[F_LAST_PROGRESS] = now
        fcfg[F_LAST_ADVANCE] = now
    if cfg[CFG_FATAL] != 0 or now - fcfg[F_LAST_ADVANCE] > fcfg[F_DEADLINE]:
        cfg[CFG_STATE] = 3
        if _room(tx_buf, tx_off, tx_len, tx_n):
            status = cfg[CFG_FATAL] if cfg[CFG_FATAL] != 0 else 23  # TIMEOUT: the watchdog fired
            tx_n = _notify(cfg, status, done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
        return tx_n
    ob = cfg[CFG_ORIG_BLOCK]
    # 0. Sparse mode: first the round of per-chunk non-zero bitmaps; nothing else moves before
    #    every member's bitmap is here, then chunks zero everywhere are skipped.
    if cfg[CFG_SPARSE] != 0 and cfg[CFG_BM_APPLIED] == 0:
        tx_n = _bitmap_round(cfg, fcfg, ring, now, mem, done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
        if cfg[CFG_BM_GOT] != (np.int64(1) << cfg[CFG_WORLD]) - 1:
            return tx_n
        _skip_zero_chunks(cfg, bounds, cb, acked, agsent, mem, done)
    elif cfg[CFG_SPARSE] != 0 and cfg[CFG_BM_ASK] != 0:
        tx_n = _bitmap_round(cfg, fcfg, ring, now, mem, done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
    # 1. Chains this node starts: ACKed ones leave the window, late ones go again.
    if ob >= 0:
        c = cfg[CFG_LOW_UNACKED]
        while c < cfg[CFG_NEXT_SEND] and acked[c] == 1:
            if tries[c] == 1:  # Karn: only first transmissions give RTT samples
                _rtt_sample(fcfg, now - sent[c])
            c += 1
        cfg[CFG_LOW_UNACKED] = c
        backoff = False
        busy = False
        for c in range(cfg[CFG_LOW_UNACKED], cfg[CFG_NEXT_SEND]):
            if acked[c] == 2:
                busy = True
            if acked[c] == 2 and now - sent[c] > BUSY_RETRY_S * (1 << min(tries[c], 6)):
                # A hop answered BUSY (its host has not started the collective yet): ask
                # again, backing off (0.5 ms doubling to 32 ms). Flow control: neither a
                # retransmit nor an RTT sample (tries > 1 keeps Karn's rule off it).
                if not _room(tx_buf, tx_off, tx_len, tx_n):
                    return tx_n
                tx_n = _send_chain(cfg, ring, bounds, cb, c, False, mem, tx_buf, tx_off, tx_len, tx_dst, tx_n)
                acked[c] = 0
                sent[c] = now
                tries[c] = min(tries[c] + 1, 250)
            elif acked[c] == 0 and now - sent[c] > fcfg[F_RTO]:
                if not _room(tx_buf, tx_off, tx_len, tx_n):
                    return tx_n
                tx_n = _send_chain(cfg, ring, bounds, cb, c, True, mem, tx_buf, tx_off, tx_len, tx_dst, tx_n)
                sent[c] = now
                tries[c] = min(tries[c] + 1, 255)
                cfg[CFG_RETRANSMITS] += 1
                counters[C.RETRANSMITS] += 1
                backoff = True
        if backoff:
            fcfg[F_RTO] = min(fcfg[F_RTO] * 2.0, RTO_MAX_S)
        # While a hop says BUSY, no new chain starts: only the waiting ones probe.
        while not busy and cfg[CFG_INFLIGHT] < window and cfg[CFG_NEXT_SEND] < cb[ob + 1]:
            c = cfg[CFG_NEXT_SEND]
            if acked[c] == 1:  # skipped (zero everywhere): no chain
                cfg[CFG_NEXT_SEND] = c + 1
                continue
            if not _room(tx_buf, tx_off, tx_len, tx_n):
                return tx_n
            tx_n = _send_chain(cfg, ring, bounds, cb, c, False, mem, tx_buf, tx_off, tx_len, tx_dst, tx_n)
            sent[c] = now
            tries[c] = 1
            cfg[CFG_NEXT_SEND] = c + 1
            cfg[CFG_INFLIGHT] += 1
    # 2. Spread this node's completed chunks (all-reduce, all-gather, broadcast).
    own = cfg[CFG_OWN_BLOCK]
    # A chain ACK proves every other node started (each one on the path would have answered
    # BUSY): only then is the all-gather sent, so no member drops it as early.
    # (Sparse mode: every member's bitmap arrived, so every member has started.)
    started_everywhere = ob < 0 or cfg[CFG_ACKED] > 0 or cfg[CFG_SPARSE] != 0
    if own >= 0 and cfg[CFG_ALGO] != 1 and started_everywhere:
        budget = window
        c = cfg[CFG_AG_NEXT]
        while c < cb[own + 1] and budget > 0:
            if done[c] == 0:
                break  # in order: the next chunk is not stored yet
            if agsent[c] == 0:
                if cfg[CFG_GROUP] != 0:
                    if not _room(tx_buf, tx_off, tx_len, tx_n):
                        return tx_n
                    tx_n = _send_gather(cfg, ring, bounds, cb, c, np.uint64(cfg[CFG_GROUP]), mem,
                                        tx_buf, tx_off, tx_len, tx_dst, tx_n)  # fmt: skip
                else:
                    for k in range(1, cfg[CFG_WORLD]):
                        if not _room(tx_buf, tx_off, tx_len, tx_n):
                            return tx_n
                        member = ring[(cfg[CFG_RANK] + k) % cfg[CFG_WORLD]]
                        tx_n = _send_gather(cfg, ring, bounds, cb, c, member, mem,
                                            tx_buf, tx_off, tx_len, tx_dst, tx_n)  # fmt: skip
                agsent[c] = 1
                budget -= 1
            c += 1
        cfg[CFG_AG_NEXT] = c
    # 3. Repair: no progress for an RTO while chunks are missing -> READ them from their owners.
    # Repair is paced by the RTO without backoff: chain backoff says nothing about READs.
    base_rto = fcfg[F_BASE_RTO] if fcfg[F_BASE_RTO] > 0.0 else fcfg[F_RTO]
    if cfg[CFG_ALGO] != 1 and now - fcfg[F_LAST_PROGRESS] > max(2.0 * base_rto, REPAIR_MIN_S):
        budget = window
        for c in range(cfg[CFG_CHUNKS]):
            if budget == 0:
                break
            j = _block_of(cfg, cb, c)
            if j == own or done[c] != 0 or now - sent[c] < base_rto:
                continue
            if not _room(tx_buf, tx_off, tx_len, tx_n):
                return tx_n
            tx_n = _send_read(cfg, ring, bounds, cb, c, tx_buf, tx_off, tx_len, tx_dst, tx_n)
            sent[c] = now
            cfg[CFG_READS] += 1
            counters[C.RETRANSMITS] += 1
            budget -= 1
        fcfg[F_LAST_PROGRESS] = now  # one repair round per RTO
    # 4. Ready when every needed chunk is here and every chain this node started was ACKed.
    #    Then DONE goes to every member (again every base RTO until all answered); the host
    #    hears of completion only when every member is ready, so no node moves to the next
    #    epoch while another may still READ from it.
    world = cfg[CFG_WORLD]
    me = np.int64(1) << cfg[CFG_RANK]
    chains_done = ob < 0 or cfg[CFG_ACKED] >= cb[ob + 1] - cb[ob]
    if chains_done and cfg[CFG_DONE_COUNT] >= cfg[CFG_NEEDED]:
        if cfg[CFG_PEERS_DONE] & me == 0 or now - fcfg[F_LAST_DONE_SENT] > base_rto:
            cfg[CFG_PEERS_DONE] |= me
            fcfg[F_LAST_DONE_SENT] = now
            for k in range(1, world):
                peer = (cfg[CFG_RANK] + k) % world
                if (cfg[CFG_PEERS_DONE] >> peer) & 1:
                    continue
                if not _room(tx_buf, tx_off, tx_len, tx_n):
                    return tx_n
                tx_n = _send_done(cfg, cfg[CFG_EPOCH], ring[peer], False, tx_buf, tx_off, tx_len, tx_dst, tx_n)
        all_ranks = (np.int64(1) << world) - 1
        if cfg[CFG_PEERS_DONE] == all_ranks and _room(tx_buf, tx_off, tx_len, tx_n):
            cfg[CFG_STATE] = 2
            tx_n = _notify(cfg, 0, done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
    return tx_n


@njit(cache=True, nogil=True)
def _answer_previous(cfg, ring, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """Repeat this node's DONE to members that ask for it: of the previous epoch, or of the
    current one once finished (they lost it while this node finished)."""
    for peer in range(cfg[CFG_WORLD]):
        bit = np.int64(1) << peer
        if cfg[CFG_PREV_ASK] & bit and _room(tx_buf, tx_off, tx_len, tx_n):
            tx_n = _send_done(cfg, (cfg[CFG_EPOCH] - 1) & 0xFFFFFFFF, ring[peer], True, tx_buf, tx_off, tx_len, tx_dst, tx_n)
            cfg[CFG_PREV_ASK] &= ~bit
        if cfg[CFG_CUR_ASK] & bit and _room(tx_buf, tx_off, tx_len, tx_n):
            tx_n = _send_done(cfg, cfg[CFG_EPOCH], ring[peer], True, tx_buf, tx_off, tx_len, tx_dst, tx_n)
            cfg[CFG_CUR_ASK] &= ~bit
    return tx_n


@njit(cache=True, nogil=True)
def _send_done(cfg, epoch, dst, answer, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """DONE: an ACK with aux_addr = AUX_DONE, seq = this node's rank, txn_id 0 for a DONE that
    asks the member to answer with its own once ready, 1 for such an answer (never answered:
    no ping-pong between finished nodes)."""
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _header(t, _OP_ACK, 0, cfg[CFG_RANK], cfg, 0, 0, AUX_DONE, 0)
    _wr32(t, 12, 1 if answer else 0)
    _wr32(t, 20, epoch)
    return _commit(tx_off, tx_len, tx_dst, tx_n, 64, dst)


@njit(cache=True, nogil=True)
def _rtt_sample(fcfg, sample):  # type: ignore[no-untyped-def]
    """RFC 6298 smoothing; RTO clamped to [RTO_MIN_S, RTO_MAX_S]."""
    if fcfg[F_SRTT] == 0.0:
        fcfg[F_SRTT] = sample
        fcfg[F_RTTVAR] = sample / 2.0
    else:
        fcfg[F_RTTVAR] = 0.75 * fcfg[F_RTTVAR] + 0.25 * abs(fcfg[F_SRTT] - sample)
        fcfg[F_SRTT] = 0.875 * fcfg[F_SRTT] + 0.125 * sample
    fcfg[F_RTO] = min(max(fcfg[F_SRTT] + 4.0 * fcfg[F_RTTVAR], RTO_MIN_S), RTO_MAX_S)
    fcfg[F_BASE_RTO] = fcfg[F_RTO]


@njit(cache=True, nogil=True)
def _bitmap_round(cfg, fcfg, ring, now, mem, done, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """Sparse mode's first round (SPEC.md 4.1): answer members that sent their bitmap as a
    request; send ours as a request to members not known to hold it, at once and again every
    base RTO (a member not started yet drops it; its own request, once it starts, is answered)."""
    world = cfg[CFG_WORLD]
    for peer in range(world):
        bit = np.int64(1) << peer
        if cfg[CFG_BM_ASK] & bit and _room(tx_buf, tx_off, tx_len, tx_n):
            tx_n = _send_bitmap(cfg, 1, ring[peer], done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
            cfg[CFG_BM_ASK] &= ~bit
    all_ranks = (np.int64(1) << world) - 1
    base_rto = fcfg[F_BASE_RTO] if fcfg[F_BASE_RTO] > 0.0 else fcfg[F_RTO]
    if cfg[CFG_BM_HAS] != all_ranks and (fcfg[F_BM_SENT] == 0.0 or now - fcfg[F_BM_SENT] > base_rto):
        fcfg[F_BM_SENT] = now
        for peer in range(world):
            if (cfg[CFG_BM_HAS] >> peer) & 1:
                continue
            if not _room(tx_buf, tx_off, tx_len, tx_n):
                return tx_n
            tx_n = _send_bitmap(cfg, 0, ring[peer], done, tx_buf, tx_off, tx_len, tx_dst, tx_n)
    return tx_n


@njit(cache=True, nogil=True)
def _send_bitmap(cfg, answer, dst, done, tx_buf, tx_off, tx_len, tx_dst, tx_n):  # type: ignore[no-untyped-def]
    """This node's non-zero bitmap: an ACK with aux_addr = AUX_BITMAP, seq = rank, txn_id 0
    (request: answer me) or 1 (answer), payload ceil(chunks / 8) bytes, bit c = chunk c."""
    nbytes = (cfg[CFG_CHUNKS] + 7) // 8
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _header(t, _OP_ACK, 0, cfg[CFG_RANK], cfg, nbytes, 0, AUX_BITMAP, 0)
    _wr32(t, 12, answer)
    t[64 : 64 + nbytes] = done[BM_BASE : BM_BASE + nbytes]
    return _commit(tx_off, tx_len, tx_dst, tx_n, 64 + nbytes, dst)


@njit(cache=True, nogil=True)
def _skip_zero_chunks(cfg, bounds, cb, acked, agsent, mem, done):  # type: ignore[no-untyped-def]
    """Every bitmap is in: a chunk zero in every member's input is zero in the result (SUM, MIN
    and MAX of +0 are +0). Write it here, count it done and ACKed, never chain or gather it."""
    cfg[CFG_BM_APPLIED] = 1
    esize = _ESIZE[cfg[CFG_DTYPE]]
    ob = cfg[CFG_ORIG_BLOCK]
    own = cfg[CFG_OWN_BLOCK]
    needs_all = cfg[CFG_ALGO] != 1  # reduce-scatter: only this node's block
    for c in range(cfg[CFG_CHUNKS]):
        if done[NZ_BASE + c] != 0:
            continue
        j, first, count = _chunk(cfg, bounds, cb, c)
        if ob >= 0 and j == ob and acked[c] == 0:
            acked[c] = 1
            cfg[CFG_ACKED] += 1
        agsent[c] = 1
        if (needs_all or j == own) and done[c] == 0:
            o = cfg[CFG_OUT] + first * esize
            mem[o : o + count * esize] = 0
            done[c] = 1
            cfg[CFG_DONE_COUNT] += 1
