"""The NIC's trace: fixed-size binary records written into a ring in the compiled loop
(SPEC.md 6.7), so that a collective can be looked at hop by hop afterwards. The host reads the
ring with COUNTERS (``aux_addr`` = COUNTERS_TRACE) and turns it into a timeline
(netdam.tools.trace).

A record costs a few dozen byte stores; a ring with no rows records nothing (tracing off). The
serve loop records every datagram it takes and every one it sends, and the drops of each batch
by the counter that counted them; the collective engine records its block plan, its phases and
its retransmits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.wire import HDR, put_le16, put_le32, put_le64, rd16, rd32, rd64
from netdam.protocol.constants import TraceKind, TracePhase
from netdam.protocol.counters import DROP_INDICES
from netdam.protocol.layout import (
    H_ADDR,
    H_COLL_ID,
    H_EPOCH,
    H_FLAGS,
    H_OPCODE,
    H_SEG_COUNT,
    H_SEGMENTS_LEFT,
    H_SEQ,
    H_STATUS,
    TREC_ADDR,
    TREC_COLL_ID,
    TREC_EPOCH,
    TREC_FLAGS,
    TREC_KIND,
    TREC_LENGTH,
    TREC_OPCODE,
    TREC_PEER,
    TREC_RESERVED,
    TREC_SEG_COUNT,
    TREC_SEG_LEFT,
    TREC_SEQ,
    TREC_STATUS,
    TREC_T_NS,
)

K_RX, K_TX, K_DROP = int(TraceKind.RX), int(TraceKind.TX), int(TraceKind.DROP)
K_RETRANSMIT, K_PHASE, K_BLOCK = (
    int(TraceKind.RETRANSMIT),
    int(TraceKind.PHASE),
    int(TraceKind.BLOCK),
)
PH_START, PH_CHAINS, PH_CHUNKS = (
    int(TracePhase.START),
    int(TracePhase.CHAINS),
    int(TracePhase.CHUNKS),
)
PH_DONE, PH_COMPLETE, PH_FAILED = (
    int(TracePhase.DONE),
    int(TracePhase.COMPLETE),
    int(TracePhase.FAILED),
)

#: The drop counters a DROP record may name, as an array the kernels index.
DROPS = np.array(DROP_INDICES, np.int64)
N_DROPS = len(DROP_INDICES)


@njit(cache=True, nogil=True)
def note(trace, t_ns, kind, opcode, status, seg_left, length, peer, coll, epoch, seq, addr):
    """Write one record (nothing when the ring has no rows)."""
    if trace.rec.shape[0] != 0:
        _write(trace, t_ns, kind, opcode, status, seg_left, length, peer, coll, epoch, seq, addr)


@njit(cache=True, nogil=True)
def _write(trace, t_ns, kind, opcode, status, seg_left, length, peer, coll, epoch, seq, addr):
    """The next record of a ring that has rows, its seg_count and flags 0; returns its row."""
    k = trace.cursor[0]
    r = trace.rec[k % trace.rec.shape[0]]
    put_le64(r, TREC_T_NS, np.uint64(t_ns))
    r[TREC_KIND] = np.uint8(kind)
    r[TREC_OPCODE] = np.uint8(opcode)
    r[TREC_STATUS] = np.uint8(status)
    r[TREC_SEG_LEFT] = np.uint8(seg_left)
    put_le32(r, TREC_LENGTH, np.int64(length) & 0xFFFFFFFF)
    put_le64(r, TREC_PEER, np.uint64(peer))
    put_le32(r, TREC_COLL_ID, np.int64(coll) & 0xFFFFFFFF)
    put_le32(r, TREC_EPOCH, np.int64(epoch) & 0xFFFFFFFF)
    put_le32(r, TREC_SEQ, np.int64(seq) & 0xFFFFFFFF)
    r[TREC_SEG_COUNT] = 0
    r[TREC_RESERVED] = 0
    put_le16(r, TREC_FLAGS, 0)
    put_le64(r, TREC_ADDR, np.uint64(addr))
    trace.cursor[0] = k + 1
    return r


@njit(cache=True, nogil=True)
def note_datagram(trace, t_ns, kind, b, ln, peer):
    """A datagram taken (RX) or sent (TX): its header's ids, or its length alone when it is
    shorter than a header."""
    if trace.rec.shape[0] == 0:
        return
    if ln < HDR:
        _write(trace, t_ns, kind, b[H_OPCODE] if ln > H_OPCODE else 0, 0, 0, ln, peer, 0, 0, 0, 0)
        return
    r = _write(
        trace,
        t_ns,
        kind,
        b[H_OPCODE],
        b[H_STATUS],
        b[H_SEGMENTS_LEFT],
        ln,
        peer,
        rd32(b, H_COLL_ID),
        rd32(b, H_EPOCH),
        rd32(b, H_SEQ),
        rd64(b, H_ADDR),
    )
    r[TREC_SEG_COUNT] = b[H_SEG_COUNT]
    put_le16(r, TREC_FLAGS, rd16(b, H_FLAGS))


@njit(cache=True, nogil=True)
def drop_marks(trace, counters, marks):
    """Remember the drop counters before a batch (*marks*: N_DROPS words)."""
    if trace.rec.shape[0] == 0:
        return
    for k in range(N_DROPS):
        marks[k] = counters[DROPS[k]]


@njit(cache=True, nogil=True)
def note_drops(trace, t_ns, counters, marks):
    """One DROP record per drop counter that moved since *marks*: which one, and by how much."""
    if trace.rec.shape[0] == 0:
        return
    for k in range(N_DROPS):
        moved = counters[DROPS[k]] - marks[k]
        if moved != 0:
            note(trace, t_ns, K_DROP, 0, DROPS[k], 0, moved, 0, 0, 0, 0, 0)
