"""The collective engine in the NIC, compiled: the layout of its state arrays, its clock, and
its per-packet side, in one module.

The clock, ``_coll_tick``, runs every serve round (and on every fabric step in tests). It
originates chain heads within the credit window, re-sends chains whose ACK is late, multicasts
(or fans out) the chunks of this node's block as soon as the chain stores them, READs missing
all-gather chunks from their owner when progress stalls, and reports completion to the host.
The per-packet side (``chain_add_hop``: combine in flight and store at the last hop; ``all_write``;
``coll_reply``: ACK capture, BUSY, repair READ answers, DONE and bitmap messages) is called by
``datapath.process_batch_kernel``, which only dispatches. ``netdam.core.collective`` owns the arrays.

``cfg`` (int64) indices are the ``CFG_*`` constants; ``fcfg`` (float64) the ``F_*`` ones.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba import njit

from netdam.kernels.borrow import borrowed
from netdam.kernels.combine import combine_bytes
from netdam.kernels.faults import fits_held, hold_datagram, take_held
from netdam.kernels.optim import fused_apply
from netdam.kernels.state import CollSlots, CollState, NodeState, TraceRing, TxQueue
from netdam.kernels.tag import seal_tag, tag_matches
from netdam.kernels.trace import (
    K_BLOCK,
    K_PHASE,
    K_RETRANSMIT,
    PH_CHAINS,
    PH_CHUNKS,
    PH_COMPLETE,
    PH_DONE,
    PH_FAILED,
    PH_START,
    note,
)
from netdam.kernels.wire import (
    ESIZE,
    F_ACK_REQ,
    F_SPARSE,
    HDR,
    IS_CONTROL,
    OP_ACK,
    OP_ALL_WRITE,
    OP_CHAIN_ADD,
    OP_NACK,
    OP_READ,
    OP_READ_RESP,
    PHASE_NOT_STARTED,
    PHASE_RUNNING,
    PHASE_STALE,
    R_READ,
    R_WRITE,
    S_BUSY,
    S_NOT_MEMBER,
    S_TOO_LARGE,
    SEG,
    check_access,
    copy_bytes,
    emit_ack,
    emit_nack,
    encode_payload,
    is_member,
    put_le32,
    put_le64,
    rd16,
    rd32,
    rd64,
    reply_dst,
    scratch_slot,
    sparse_expand,
    wr16,
    wr32,
    wr64,
)
from netdam.protocol import counters as C
from netdam.protocol.constants import FLAG_AWAIT_STARTED, Flags, Status
from netdam.protocol.layout import (
    COMPLETION_BYTES,
    COMPLETION_FAILURE_BYTES,
    CPL_CHAINS_RESENT,
    CPL_CHAINS_US,
    CPL_CHUNKS_US,
    CPL_DONE_US,
    CPL_FIRST_MISSING,
    CPL_LAST_MISSING,
    CPL_REPAIR_READS,
    CPL_RESERVED,
    CPL_START_NS,
    H_ADDR,
    H_AUX_ADDR,
    H_CLIENT_ID,
    H_COLL_ID,
    H_DTYPE,
    H_EPOCH,
    H_FLAGS,
    H_LENGTH,
    H_OPCODE,
    H_REDUCE_OP,
    H_RET_IP,
    H_RET_PORT,
    H_RKEY,
    H_SEG_COUNT,
    H_SEG_TYPE,
    H_SEGMENTS_LEFT,
    H_SEQ,
    H_STATUS,
    H_TXN_ID,
    H_VERSION,
    SEG_IP,
    SEG_PORT,
    SEG_RESERVED,
    TRACE_RECORD_BYTES,
)
from netdam.protocol.payloads import NO_PHASE_US, Algo

# ---------------------------------------------------------------- layout of the engine's state arrays


class EngineState(IntEnum):
    """What cfg[CFG_STATE] holds: where this node's collective is."""

    IDLE = 0  # no collective since the node started
    RUNNING = 1
    DONE = 2  # ended with every chunk here and every member's DONE in
    FAILED = 3  # ended by a fatal NACK or the watchdog


# The kernels compare plain ints (numba freezes module-level ints at compile time).
STATE_IDLE = int(EngineState.IDLE)
STATE_RUNNING = int(EngineState.RUNNING)
STATE_DONE = int(EngineState.DONE)
STATE_FAILED = int(EngineState.FAILED)

# cfg indices
_S_BAD_FIELD = int(Status.BAD_FIELD)

CFG_STATE = 0  # an EngineState
CFG_COLL = 1
CFG_EPOCH = 2
CFG_RANK = 3
CFG_WORLD = 4
CFG_ALGO = 5
CFG_DTYPE = 6
CFG_OP = 7
CFG_COUNT = 8
CFG_IN = 9
CFG_OUT = 10
CFG_RKEY = 11
CFG_WINDOW = 12
CFG_PER_PACKET = 13
CFG_CHUNKS = 14
CFG_GROUP = 15  # multicast group endpoint, 0: fan out by unicast
CFG_HOST = 16  # where the completion goes
CFG_SLOT = 17  # completed-chunk guard slot
CFG_ORIG_BLOCK = 18  # block whose chains this node starts, -1: none
CFG_OWN_BLOCK = 19  # block this node stores and spreads, -1: none
CFG_NEXT_SEND = 20
CFG_INFLIGHT = 21
CFG_ACKED = 22
CFG_LOW_UNACKED = 23
CFG_AG_NEXT = 24
CFG_RETRANSMITS = 25
CFG_READS = 26
CFG_FATAL = 27  # status of a fatal NACK (0: none)
CFG_CLIENT = 28
CFG_TXN = 29
CFG_NEEDED = 30  # chunks this node must hold (done bits) to finish
CFG_DONE_COUNT = 31  # chunks whose done bit is set on this node
CFG_PEERS_DONE = 32  # bit r: rank r said DONE for this epoch (this node's own bit included)
CFG_PREV_ASK = 33  # bit r: rank r asked for this node's DONE of the previous epoch
CFG_CUR_ASK = 34  # bit r: rank r still asks for this node's DONE of the finished epoch
CFG_SPARSE = 35  # descriptor flags bit 0: sparse payloads and the non-zero bitmap round
CFG_BM_GOT = 36  # bit r: rank r's non-zero bitmap arrived (own bit included)
CFG_BM_HAS = 37  # bit r: rank r answered: it holds this node's bitmap (own bit included)
CFG_BM_ASK = 38  # bit r: rank r sent its bitmap as a request: answer with ours
CFG_BM_APPLIED = 39  # 1 once chunks zero everywhere were skipped
# Chains this node refused with BUSY because its host had not started that collective yet:
# once it starts, it tells each refused originator to ask again now (RESUME), so a start skew
# between hosts costs one message, not a backoff timer. Kept across START_COLL (set up zeroes
# the rest of cfg).
CFG_REFUSED_COLL = 40
CFG_REFUSED_EPOCH = 41
CFG_REFUSED_N = 42
# The previous collective's key (kept across START_COLL, like the refusals): a member still on
# that epoch sends its DONE under it, and this node answers such a DONE under it too.
CFG_PREV_RKEY = 43
# Tag keys (SPEC.md 2.6): the current collective's 128-bit key as SipHash's (k0, k1), u64 bit
# patterns in int64, both 0 for an untagged (v1) collective; and the previous epoch's, kept
# across START_COLL with that epoch, so its late DONEs are checked and answered under it.
CFG_TAG_K0 = 44
CFG_TAG_K1 = 45
CFG_PREV_TAG_K0 = 46
CFG_PREV_TAG_K1 = 47
CFG_PREV_EPOCH = 48
# Members that RESUMEd after dropping this node's all-gather as early (bit r: rank r), and the
# next chunk of this node's block to send them again (zeroed at every START_COLL).
CFG_AG_RESEND = 49
CFG_AG_RESEND_NEXT = 50
CFG_REFUSED_BASE = 51  # REFUSED_SLOTS originator endpoints (u64 as int64) follow
#: Originators a node remembers refusing (or whose all-gather it dropped as early): every
#: member of the longest chain (protocol/constants.py MAX_SEGMENTS), so a start skew costs no
#: member a timer.
REFUSED_SLOTS = 64
CFG_REFUSED_END = CFG_REFUSED_BASE + REFUSED_SLOTS
# Fused reduce and update (descriptor flags bit 1, SPEC.md 4.1): the address of this node's
# optimizer descriptor and the step its block takes (0: not fused; a step is at least 1).
CFG_OPT_DESC = CFG_REFUSED_END
CFG_OPT_STEP = CFG_REFUSED_END + 1
# A gather sent by multicast (all-gather, broadcast): bit r, rank r has started it (its STARTED
# came, or it was remembered before this node started); the own bit once ours went out.
CFG_STARTED = CFG_REFUSED_END + 2
# What the START_COLL asked beyond the words above (descriptor root, window, watchdog and
# flags), and who sent it (its UDP source): a START_COLL of the next epoch that asks the same
# of the same source starts here in the datapath (restart_collective).
CFG_ROOT = CFG_REFUSED_END + 3
CFG_REQ_WINDOW = CFG_REFUSED_END + 4
CFG_TIMEOUT_MS = CFG_REFUSED_END + 5
CFG_FLAGS = CFG_REFUSED_END + 6
CFG_STARTER = CFG_REFUSED_END + 7  # u64 endpoint as int64
# The epoch of this coll_id started here before the current one (-1: none), and which start
# set the slot up: the node's count of starts so far, kept in the spare row's word (the slot
# whose collective ended longest ago is reused first).
CFG_EPOCH_BEFORE = CFG_REFUSED_END + 8
CFG_START_NO = CFG_REFUSED_END + 9
# The bytes a collective's key covers here, [lo, hi): its buffers (and a fused update's
# optimizer state), the same every epoch of one shape; and the key installed over them in the
# node's rkey table now (0: none, the collective ended and its key went) with its rights.
CFG_SPAN_LO = CFG_REFUSED_END + 10
CFG_SPAN_HI = CFG_REFUSED_END + 11
CFG_CKEY = CFG_REFUSED_END + 12
CFG_CKEY_RIGHTS = CFG_REFUSED_END + 13
# The START_COLLs the datapath started keep their control tags here until the control plane
# adds them to its replay memory (SPEC.md 2.6 "Control tags"): CFG_TAKEN of them, oldest first
# from CFG_TAKEN_BASE. A slot whose row is full starts its next epoch in the control plane,
# which empties it (the control plane runs for a NIC only when something asks it to).
CFG_TAKEN = CFG_REFUSED_END + 14
TAKEN_SLOTS = 16
CFG_TAKEN_BASE = CFG_REFUSED_END + 15
# Members whose STARTED asked for ours (txn_id 0: a chained collective that awaits them lacked
# this node's; bit r, rank r), answered by the next tick.
CFG_STARTED_ASK = CFG_TAKEN_BASE + TAKEN_SLOTS
CFG_LEN = CFG_STARTED_ASK + 1

#: aux_addr of an ACK that says "this member holds everything of the epoch" (DONE).
AUX_DONE = 2
#: aux_addr of an ACK carrying a member's per-chunk non-zero bitmap (sparse mode, SPEC 4.1).
AUX_BITMAP = 3
#: aux_addr of an ACK that says "I have started: ask again the chains I answered BUSY, and send
#: again the all-gather I dropped as early" (RESUME).
AUX_RESUME = 4
#: aux_addr of an ACK a member multicasts to the group when its host starts a gather: "I have
#: started: spread to me" (STARTED, SPEC.md 4.1 "All-gather").
AUX_STARTED = 5

# Sparse mode keeps two more per-chunk tables at the end of the ``done`` array (no new kernel
# arguments): the OR of all members' bitmaps, one byte per chunk, at NZ_BASE + c, and this
# node's own bitmap, packed LSB first, at BM_BASE.
MAX_CHUNKS = 1 << 17
NZ_BASE = MAX_CHUNKS
BM_BASE = 2 * MAX_CHUNKS
DONE_LEN = 2 * MAX_CHUNKS + MAX_CHUNKS // 8

# fcfg indices
F_START = 0
F_RTO = 1
F_SRTT = 2
F_RTTVAR = 3
F_LAST_PROGRESS = 4
F_LAST_COUNT = 5
F_NOW = 6
F_DEADLINE = 7  # watchdog: the collective fails after this long without any progress
F_BASE_RTO = 8  # RTO without backoff: paces all-gather repair
F_LAST_ADVANCE = 9  # last time a chunk completed or a chain was ACKed
F_LAST_DONE_SENT = 10  # last time this node sent its DONE
F_BM_SENT = 11  # last time this node sent its bitmap requests (sparse mode)
# When this node's phases ended (the engine's clock; -1: not yet), reported in the completion
# (SPEC.md 4.1) so a host can see where a collective's time went.
F_T_CHAINS = 12  # every chain this node started was ACKed (its share of the reduce-scatter)
F_T_CHUNKS = 13  # every chunk this node needs is here (the all-gather, for this node)
F_T_DONE = 14  # every member's DONE is here: the collective is complete
#: The longest recent wait between two turns of this NIC in the process hosting it (seconds;
#: 0 for a NIC alone in its process): written by the host loop (netdam/shell/nic_host.py),
#: it raises the timers' floor (_rto_bounds).
F_HOST_TURN = 15
F_STARTED_ASKED = 16  # last time this node asked the members it lacks for their STARTED
# The tick before this node last passed on another originator's chain (a hop, not its last):
# the collective moves here, though nothing of this node's own completes (_chain_late).
F_LAST_PASSED = 17
F_LEN = 18

#: Collectives one NIC holds at once (SPEC.md 4.1), one slot each: a START_COLL while every
#: slot runs is answered NACK BUSY. 4: two jobs with two groups each, or DDP's buckets of one
#: group behind another group's calls; each slot's state is ~1.7 MB, touched only when used.
MAX_COLLECTIVES = 4
#: The row after the slots: it never runs, and stands for every collective no slot holds (so
#: its datagrams are answered as "not started here"); it keeps the BUSY refusals of the newest
#: such collective, which its slot takes over when its host starts it (_send_resumes).
SPARE_SLOT = MAX_COLLECTIVES
#: The least credit window a collective keeps while it shares the node with others (the
#: engine's own least window, netdam.core.collective.MIN_WINDOW).
SHARED_WINDOW_MIN = 4
SLOT_ROWS = MAX_COLLECTIVES + 1

# algorithms (START_COLL descriptor byte 0; the wire's values, protocol/payloads.py)
ALGO_ALL_REDUCE = int(Algo.ALL_REDUCE)
ALGO_REDUCE_SCATTER = int(Algo.REDUCE_SCATTER)
ALGO_ALL_GATHER = int(Algo.ALL_GATHER)
ALGO_BROADCAST = int(Algo.BROADCAST)


# ---------------------------------------------------------------- the clock
RTO_MIN_S = 0.02  # loopback emulation: 2 cores, many processes: ms-scale scheduling jitter
# At most 100 ms: a chain of N hops gets through a lossy fabric with probability (1-p)^N per
# try, so the watchdog (2.5 s by default) must hold many tries. At 30% loss on 4 nodes a 250 ms
# cap failed 3 of 10 live 1 MiB runs (TIMEOUT) and 12 of 80 on the in-memory fabric; 100 ms
# failed none, with fewer retransmits and half the time. Clean runs re-send nothing either way
# (4 x 64 MiB, 8 x 16 MiB, 8 x 64 MiB: docs/PERFORMANCE.md).
RTO_MAX_S = 0.1
#: ...and at least this many turns of the process hosting the NIC, at most twice that. A NIC
#: that shares its process reads its socket only in its turn, after the others' (up to 0.1-0.4 s
#: a turn with 64-128 NICs a process on 2 cores, measured with a log of the host loop), which a
#: card never waits: a chain's round trip spans a few turns (its hops, the ACK, the sender's
#: next turn), and timers shorter than that re-sent chains and READ chunks that were on their
#: way (128 NICs x 1 MiB: 81-200 re-sends per 3 calls).
HOST_TURNS_PER_RTO = 4
#: The watchdog waits at least this many RTO floors without progress (_rto_bounds): a timer
#: fires after one floor (two with backoff) and its answer comes within a turn or two. A 0.6 s
#: stop of a process hosting 8 NICs raised their floor to 2.4 s, and a 2.5 s watchdog failed
#: a torus that one re-ask would have finished (16 NICs, 1 element, SIGSTOP 0.5-0.8 s).
WATCHDOG_MIN_RTOS = 3
#: Re-ask a hop that answered BUSY after this long (seconds).
BUSY_RETRY_S = 0.0005
#: ``acked`` of a chain asked again after BUSY and not answered yet (0: in flight, 1: ACKed,
#: 2: answered BUSY). Until it is answered it stays a probe of a hop that said it had not
#: started: asked again after an RTO, but no retransmission. A hop busy with its own collective
#: in another process can take longer than this node's RTO to read it (128 NICs x 1 MiB: 15-40
#: such "re-sends" in the first call of 1 run in 5, each a column chain whose partner's row
#: was still reducing).
ACKED_PROBE = 3
#: All-gather repair starts after this long without progress (or one base RTO, whichever is
#: longer), and is paced so. At two RTOs, a member that lacked the last chunk at 30% loss READ it
#: every 0.2 s, half of those round trips failed, and its peers' 2.5 s watchdog fired while they
#: waited for its DONE (1 of 30 seeded fabric runs; none at one RTO, tests/core/test_host_core.py).
REPAIR_MIN_S = 0.1
#: A gather READs a block it has heard nothing of (no chunk, no DONE from its owner) only after
#: this many repair periods without progress: its owner may simply not have started yet.
REPAIR_GATHER_STALLS = 4
#: A gather that announces its start (STARTED) fails on its watchdog only after this many
#: watchdog periods without progress while a member has not said it started: that member is
#: late, not dead (a torus's row all-gather waits for its slowest column, SPEC.md 4.2). The
#: first call of a fresh 256-NIC cluster on 2 cores spread its members' starts over ~2.3 s,
#: and 2 runs in 8 failed on the 2.5 s default. A member that never starts is still named.
START_SKEW_STALLS = 4

# Header flags the engine sets (the wire's values, protocol/constants.py).
_F_MCAST = int(Flags.MCAST)
_F_RETRY = int(Flags.RETRY)


@njit(cache=True, nogil=True)
def _header(t, opcode, flags, seq, cfg, length, addr, aux, segs):
    """Write a v1 header for this collective into t (segs: SR entries that follow)."""
    t[:HDR] = 0
    t[H_VERSION] = 1
    t[H_OPCODE] = opcode
    wr16(t, H_FLAGS, flags)
    wr32(t, H_SEQ, seq)
    wr32(t, H_COLL_ID, cfg[CFG_COLL])
    wr32(t, H_EPOCH, cfg[CFG_EPOCH])
    wr32(t, H_RKEY, cfg[CFG_RKEY])
    wr32(t, H_LENGTH, length)
    wr64(t, H_ADDR, addr)
    wr64(t, H_AUX_ADDR, aux)
    t[H_DTYPE] = cfg[CFG_DTYPE]
    t[H_REDUCE_OP] = cfg[CFG_OP]
    if segs > 0:
        t[H_SEG_TYPE] = 1
        t[H_SEGMENTS_LEFT] = segs - 1
        t[H_SEG_COUNT] = segs


@njit(cache=True, nogil=True)
def _room(tx, tx_n):
    """Room for one more datagram in the send queue."""
    return _room_for(tx, tx_n, 1)


@njit(cache=True, nogil=True)
def _room_for(tx, tx_n, k):
    """Room for *k* more datagrams in the send queue."""
    tx_buf, tx_off, tx_len, _tx_dst, slot = tx
    return tx_n + k < tx_len.shape[0] and tx_off[tx_n] + k * slot <= tx_buf.shape[0]


@njit(cache=True, nogil=True)
def _commit(cfg, tx, tx_n, length, dst):
    """Queue the datagram built at the tail, sealed (SPEC.md 2.6) when this node holds the tag
    key of its collective and epoch: every datagram the engine sends goes through here."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    t = tx_buf[tx_off[tx_n] :]
    k0, k1 = _coll_tag_key(cfg, rd32(t, H_COLL_ID), rd32(t, H_EPOCH))
    if k0 | k1:
        length = seal_tag(t, length, k0, k1)
    tx_len[tx_n] = length
    tx_dst[tx_n] = dst
    tx_off[tx_n + 1] = tx_off[tx_n] + length
    return tx_n + 1


@njit(cache=True, nogil=True)
def _coll_tag_key(co_cfg, coll, epoch):
    """(k0, k1): the tag key of collective (coll, epoch) on this node, its current epoch's or
    the previous one's; (0, 0) when it holds none (untagged, or not started here)."""
    zero = np.uint64(0)
    if coll == 0 or coll != co_cfg[CFG_COLL] or co_cfg[CFG_STATE] == STATE_IDLE:
        return zero, zero
    if epoch == co_cfg[CFG_EPOCH]:
        return np.uint64(co_cfg[CFG_TAG_K0]), np.uint64(co_cfg[CFG_TAG_K1])
    if epoch == co_cfg[CFG_PREV_EPOCH]:
        return np.uint64(co_cfg[CFG_PREV_TAG_K0]), np.uint64(co_cfg[CFG_PREV_TAG_K1])
    return zero, zero


@njit(cache=True, nogil=True)
def needs_tag(slots, b):
    """An untagged datagram that names a tagged collective held here (its coll_id and epoch,
    or its rkey, in any slot) is not that collective's: dropped as forged. Only NACK BUSY may
    come untagged: a hop that has not started the collective holds no key to tag it with, and
    a forged BUSY only delays a chain by one retry. Control opcodes (START_COLL among them)
    answer to the admin key instead."""
    op = np.int64(b[H_OPCODE])
    if (op == OP_NACK and b[H_STATUS] == S_BUSY) or op >= 64 or IS_CONTROL[op] == 1:
        return False
    coll, epoch = rd32(b, H_COLL_ID), rd32(b, H_EPOCH)
    co_cfg = slots.cfg[slot_of(slots, coll)]
    k0, k1 = _coll_tag_key(co_cfg, coll, epoch)
    if k0 | k1:
        return True
    if coll != 0 and coll_phase(co_cfg, coll, epoch) == PHASE_STALE:
        return False  # an earlier epoch's: dropped as stale, never executed (4.1)
    rkey = rd32(b, H_RKEY)
    if rkey == 0:
        return False
    for s in range(MAX_COLLECTIVES):
        if _tagged_key_of(slots.cfg[s], rkey):
            return True
    return False


@njit(cache=True, nogil=True)
def _tagged_key_of(co_cfg, rkey):
    """*rkey* is the key of a tagged collective in this slot, of its current or previous epoch."""
    if (
        rkey == co_cfg[CFG_RKEY]
        and co_cfg[CFG_STATE] != STATE_IDLE
        and (co_cfg[CFG_TAG_K0] | co_cfg[CFG_TAG_K1]) != 0
    ):
        return True
    return (
        rkey == co_cfg[CFG_PREV_RKEY] and (co_cfg[CFG_PREV_TAG_K0] | co_cfg[CFG_PREV_TAG_K1]) != 0
    )


@njit(cache=True, nogil=True)
def open_tagged(co_cfg, b, ln, counters):
    """Check the tag of datagram b[:ln] (TAGGED set). Returns (verdict, k0, k1): verdict 1 and
    the key when the tag is right (the caller strips it and seals what it answers); 2 for an
    early datagram of a collective not started here, which holds no key yet: stripped and
    handled as any early one (BUSY or dropped, never executed); 0 dropped and counted (early,
    stale, or forged: a tag that does not verify)."""
    coll, epoch = rd32(b, H_COLL_ID), rd32(b, H_EPOCH)
    k0, k1 = _coll_tag_key(co_cfg, coll, epoch)
    if k0 | k1:
        if tag_matches(b, ln, k0, k1):
            return 1, k0, k1
        counters[C.DROP_COLL_FORGED] += 1
        return 0, k0, k1
    if coll == 0:
        # The datapath sends coll_id 0 to region tags (tag.open_region_tagged); should one
        # come here, it is no collective's, and forged.
        counters[C.DROP_COLL_FORGED] += 1
        return 0, k0, k1
    phase = coll_phase(co_cfg, coll, epoch)
    if phase == PHASE_NOT_STARTED:
        op = b[H_OPCODE]
        if op == OP_CHAIN_ADD or op == OP_ALL_WRITE or op == OP_READ:
            return 2, k0, k1
        if op == OP_ACK and (rd64(b, H_AUX_ADDR) == AUX_STARTED or rd64(b, H_AUX_ADDR) == AUX_DONE):
            return 2, k0, k1  # its sender remembered unchecked (coll_reply), as an early chunk's
        counters[C.DROP_COLL_EARLY] += 1
        return 0, k0, k1
    counters[C.DROP_STALE_EPOCH if phase == PHASE_STALE else C.DROP_COLL_FORGED] += 1
    return 0, k0, k1


@njit(cache=True, nogil=True)
def _block_of(cfg, cb, c):
    """Block of chunk c (empty blocks own no chunk: the last block starting at or before c)."""
    return np.searchsorted(cb[: cfg[CFG_WORLD] + 1], c, side="right") - 1


@njit(cache=True, nogil=True)
def _chunk(cfg, bounds, cb, c):
    """(block, first element, elements) of chunk c."""
    j = _block_of(cfg, cb, c)
    first = bounds[j] + (c - cb[j]) * cfg[CFG_PER_PACKET]
    return j, first, min(cfg[CFG_PER_PACKET], bounds[j + 1] - first)


@njit(cache=True, nogil=True)
def _gather_acks(cfg):
    """Whether this collective's all-gather acknowledges its chains (SPEC.md 4.1): a dense
    all-reduce's owner spreads each chunk it stored to every member, the chain's originator
    among them, so the chain's first send needs no ACK of its own (one datagram in five of a
    large all-reduce's was such an ACK)."""
    return cfg[CFG_ALGO] == ALGO_ALL_REDUCE and cfg[CFG_SPARSE] == 0


@njit(cache=True, nogil=True)
def _chain_acked(cfg, acked, c):
    """Chain c of this node arrived at its owner (its ACK, or the owner's ALL_WRITE of the
    chunk): its credit comes back, once."""
    if acked[c] != 1:
        acked[c] = 1
        cfg[CFG_ACKED] += 1
        cfg[CFG_INFLIGHT] -= 1


@njit(cache=True, nogil=True)
def _send_chain(cfg, ring, bounds, cb, c, retry, mem, tx, tx_n, first=False):
    """CHAIN_ADD for chunk c: this node's elements, SR list over the ring up to the owner.
    Its *first* send in a collective whose all-gather acknowledges chains asks no ACK
    (_gather_acks); a re-send or a probe does."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    j, elem, count = _chunk(cfg, bounds, cb, c)
    esize = ESIZE[cfg[CFG_DTYPE]]
    world = cfg[CFG_WORLD]
    rank = cfg[CFG_RANK]
    hops = world - 1
    nbytes = count * esize
    t = tx_buf[tx_off[tx_n] :]
    flags = (0 if first and _gather_acks(cfg) else F_ACK_REQ) | (_F_RETRY if retry else 0)
    src_addr = cfg[CFG_IN] + elem * esize
    _header(t, OP_CHAIN_ADD, flags, c, cfg, nbytes, src_addr, cfg[CFG_OUT] + elem * esize, hops)
    for h in range(hops):
        ep = ring[(rank + 1 + h) % world]
        o = HDR + SEG * h
        wr32(t, o + SEG_IP, np.int64(ep >> np.uint64(16)))
        wr16(t, o + SEG_PORT, np.int64(ep & np.uint64(0xFFFF)))
        wr16(t, o + SEG_RESERVED, 0)
    p = HDR + SEG * hops
    if cfg[CFG_SPARSE] != 0:
        size, sparse = encode_payload(
            t, np.int64(p), mem, np.int64(src_addr), np.int64(nbytes), esize
        )
        if sparse:
            wr16(t, H_FLAGS, flags | F_SPARSE)
        return _commit(cfg, tx, tx_n, p + size, ring[(rank + 1) % world])
    copy_bytes(t, p, mem, src_addr, nbytes)
    return _commit(cfg, tx, tx_n, p + nbytes, ring[(rank + 1) % world])


@njit(cache=True, nogil=True)
def _send_gather(cfg, ring, bounds, cb, c, dst, mem, tx, tx_n):
    """ALL_WRITE of chunk c of this node's output to dst (a group or one member)."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    j, first, count = _chunk(cfg, bounds, cb, c)
    esize = ESIZE[cfg[CFG_DTYPE]]
    nbytes = count * esize
    addr = cfg[CFG_OUT] + first * esize
    t = tx_buf[tx_off[tx_n] :]
    flags = _F_MCAST if cfg[CFG_GROUP] != 0 else 0
    _header(t, OP_ALL_WRITE, flags, c, cfg, nbytes, addr, 0, 0)
    if cfg[CFG_SPARSE] != 0:
        size, sparse = encode_payload(
            t, np.int64(HDR), mem, np.int64(addr), np.int64(nbytes), esize
        )
        if sparse:
            wr16(t, H_FLAGS, flags | F_SPARSE)
        return _commit(cfg, tx, tx_n, HDR + size, dst)
    copy_bytes(t, HDR, mem, addr, nbytes)
    return _commit(cfg, tx, tx_n, HDR + nbytes, dst)


@njit(cache=True, nogil=True)
def _send_read(cfg, ring, bounds, cb, c, tx, tx_n):
    """READ of chunk c's reduced data from its owner (all-gather repair)."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    j, first, count = _chunk(cfg, bounds, cb, c)
    esize = ESIZE[cfg[CFG_DTYPE]]
    addr = cfg[CFG_OUT] + first * esize
    t = tx_buf[tx_off[tx_n] :]
    _header(t, OP_READ, 0, c, cfg, count * esize, addr, 0, 0)
    return _commit(cfg, tx, tx_n, HDR, ring[j])


@njit(cache=True, nogil=True)
def _notify(cfg, fcfg, status, done, cb, tx, tx_n):
    """Tell the host the collective ended: ACK (or NACK with *status*) echoing its START_COLL ids,
    aux_addr = 1. Payload, u64 LE each: retransmits and repair READs (ACK), or the first and last
    chunk still missing here (NACK), so the host can name what it waited for. An ACK adds the
    phases (SPEC.md 4.1): u64 engine clock at the start (ns), u32 microseconds from the start to
    the end of each phase (chains ACKed, chunks here, DONEs here), u32 0."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    t = tx_buf[tx_off[tx_n] :]
    length = COMPLETION_BYTES if status == 0 else COMPLETION_FAILURE_BYTES
    _header(t, OP_ACK if status == 0 else OP_NACK, 0, 0, cfg, length, 0, 1, 0)
    wr32(t, H_RKEY, 0)  # no key in a reply to the host
    wr32(t, H_CLIENT_ID, cfg[CFG_CLIENT])
    wr32(t, H_TXN_ID, cfg[CFG_TXN])
    t[H_STATUS] = status
    first = np.int64(-1)
    last = np.int64(-1)
    if status == 0:
        first = cfg[CFG_RETRANSMITS]
        last = cfg[CFG_READS]
    else:
        # The chunks this node needs: a reduce-scatter's own block only (the others' never
        # come here, and naming one sent its host looking for the wrong member).
        lo, hi = 0, cfg[CFG_CHUNKS]
        own = cfg[CFG_OWN_BLOCK]
        if cfg[CFG_ALGO] == ALGO_REDUCE_SCATTER and own >= 0:
            lo, hi = cb[own], cb[own + 1]
        for c in range(lo, hi):
            if done[c] == 0:
                if first < 0:
                    first = c
                last = c
        if first < 0:
            # Every chunk is here: the members whose DONE has not come, so the host can name
            # whom this node waited for (bit r: group rank r).
            last = (
                _all_ranks(cfg[CFG_WORLD]) & ~cfg[CFG_PEERS_DONE] & ~(np.int64(1) << cfg[CFG_RANK])
            )
    o_first = HDR + (CPL_CHAINS_RESENT if status == 0 else CPL_FIRST_MISSING)
    o_last = HDR + (CPL_REPAIR_READS if status == 0 else CPL_LAST_MISSING)
    for k in range(8):
        t[o_first + k] = np.uint8((first >> (8 * k)) & 0xFF)
        t[o_last + k] = np.uint8((last >> (8 * k)) & 0xFF)
    if status != 0:
        return _commit(cfg, tx, tx_n, HDR + COMPLETION_FAILURE_BYTES, np.uint64(cfg[CFG_HOST]))
    put_le64(t, HDR + CPL_START_NS, np.uint64(max(fcfg[F_START], 0.0) * 1e9))
    put_le32(t, HDR + CPL_CHAINS_US, _phase_us(fcfg, F_T_CHAINS))
    put_le32(t, HDR + CPL_CHUNKS_US, _phase_us(fcfg, F_T_CHUNKS))
    put_le32(t, HDR + CPL_DONE_US, _phase_us(fcfg, F_T_DONE))
    put_le32(t, HDR + CPL_RESERVED, 0)
    return _commit(cfg, tx, tx_n, HDR + COMPLETION_BYTES, np.uint64(cfg[CFG_HOST]))


@njit(cache=True, nogil=True)
def _phase_us(fcfg, slot):
    """Microseconds from the collective's start to the end of the phase in *slot*, saturated
    to u32; NO_PHASE_US when it never ended."""
    if fcfg[slot] < 0.0 or fcfg[F_START] < 0.0:
        return np.int64(NO_PHASE_US)
    return np.int64(min(max((fcfg[slot] - fcfg[F_START]) * 1e6, 0.0), NO_PHASE_US - 1))


def coll_tick(
    now: float,
    slots: CollSlots,
    mem: np.ndarray,
    counters: np.ndarray,
    trace: TraceRing,
    tx: TxQueue,
    tx_n: int,
    first: int = 0,
) -> int:
    """Checked entry to the engine's clock: advance every slot's collective at *now*, slot
    *first* first; returns tx_n."""
    if not 0 <= tx_n < tx.len.shape[0]:
        raise ValueError(f"send queue tail {tx_n} outside its {tx.len.shape[0]} slots")
    if slots.cfg.shape[0] != SLOT_ROWS or slots.cfg.shape[1] < CFG_LEN or slots.f.shape[1] < F_LEN:
        raise ValueError("collective slot arrays do not match their layout")
    if trace.rec.ndim != 2 or (trace.rec.shape[0] and trace.rec.shape[1] != TRACE_RECORD_BYTES):
        raise ValueError("trace ring rows do not match the trace record")
    return int(coll_ticks(now, slots, mem, counters, trace, tx, tx_n, first % MAX_COLLECTIVES))


@njit(cache=True, nogil=True)
def slot_state(slots, s):
    """Slot *s* as one collective's CollState: row views, nothing copied."""
    return CollState(
        slots.cfg[s],
        slots.done[s],
        slots.acked[s],
        slots.f[s],
        slots.ring[s],
        slots.bounds[s],
        slots.cb[s],
        slots.sent[s],
        slots.tries[s],
        slots.agsent[s],
    )


@njit(cache=True, nogil=True)
def slot_of(slots, coll):
    """The slot holding collective *coll* (running, or its last epoch here ended in it), else
    SPARE_SLOT. netdam.core.collective gives one coll_id at most one slot."""
    if coll != 0:
        for s in range(MAX_COLLECTIVES):
            if slots.cfg[s, CFG_COLL] == coll and slots.cfg[s, CFG_STATE] != STATE_IDLE:
                return s
    return SPARE_SLOT


@njit(cache=True, nogil=True)
def for_collective(node, coll):
    """*node* as the per-packet code sees it: the slot of collective *coll* in place of the slots."""
    mem, regions, members, window, slots, counters, trace = node
    return NodeState(
        mem, regions, members, window, slot_state(slots, slot_of(slots, coll)), counters, trace
    )


@njit(cache=True, nogil=True)
def _needs_clock(cfg):
    """A slot's clock must run: its collective runs, or a member waits for a repeated DONE."""
    return cfg[CFG_STATE] == STATE_RUNNING or cfg[CFG_PREV_ASK] != 0 or cfg[CFG_CUR_ASK] != 0


@njit(cache=True, nogil=True)
def any_slot(slots, running_only):
    """Some slot runs a collective (*running_only*), or needs its clock."""
    for s in range(MAX_COLLECTIVES):
        cfg = slots.cfg[s]
        if cfg[CFG_STATE] == STATE_RUNNING or (not running_only and _needs_clock(cfg)):
            return True
    return False


@njit(cache=True, nogil=True)
def running_slots(slots):
    """How many of the slots run a collective."""
    count = 0
    for s in range(MAX_COLLECTIVES):
        count += slots.cfg[s, CFG_STATE] == STATE_RUNNING
    return count


@njit(cache=True, nogil=True)
def coll_ticks(now, slots, mem, counters, trace, tx, tx_n, first):
    """The clock of every slot that needs it, slot *first* first: callers turn *first* round,
    so no collective always sends first into a send queue that may fill (a fair share each).
    Running collectives share the credit window: each keeps 1/k of its window in flight while
    k run here, so the hops' queues stay as deep as one collective's, and a small collective
    beside a large one waits behind half as much (measured: SPEC.md 4.1, docs/PERFORMANCE.md)."""
    # Borrowed for the call (netdam.kernels.borrow): no atomic reference counts below.
    slots, mem, counters, trace, tx = (
        borrowed(slots),
        borrowed(mem),
        borrowed(counters),
        borrowed(trace),
        borrowed(tx),
    )
    running = running_slots(slots)
    for k in range(MAX_COLLECTIVES):
        s = (first + k) % MAX_COLLECTIVES
        if _needs_clock(slots.cfg[s]):
            tx_n = _coll_tick(
                now, slot_state(slots, s), mem, counters, trace, tx, tx_n, max(running, 1)
            )
    return tx_n


@njit(cache=True, nogil=True)
def _coll_tick(now, coll, mem, counters, trace, tx, tx_n, share):
    """Advance the running collective at time *now* (seconds), one of *share* running here
    (its window divided among them); returns the new tx_n."""
    cfg, done, acked, fcfg, ring, bounds, cb, sent, tries, agsent = coll
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    if cfg[CFG_PREV_ASK] != 0 or cfg[CFG_CUR_ASK] != 0:
        tx_n = _answer_previous(cfg, ring, tx, tx_n)
    if cfg[CFG_STATE] != STATE_RUNNING:
        return tx_n
    # The tick before this one: a receive round ran since, so a chain overdue then and still
    # unanswered after it is late (_chain_late), whatever kept this process off its core since.
    heard_at = fcfg[F_NOW] if fcfg[F_NOW] > 0.0 else now
    fcfg[F_NOW] = now
    if fcfg[F_START] < 0.0:  # first tick after START_COLL: the clock starts now
        fcfg[F_START] = now
        fcfg[F_LAST_PROGRESS] = now
        fcfg[F_LAST_ADVANCE] = now
        _trace_start(trace, now, cfg, cb)
        if _announces_start(cfg):
            cfg[CFG_STARTED] |= _refused_ranks(cfg, ring)  # they started before this node did
        tx_n = _send_resumes(cfg, tx, tx_n)
    me_bit = np.int64(1) << cfg[CFG_RANK]
    world = cfg[CFG_WORLD]
    if _announces_start(cfg) and cfg[CFG_STARTED] & me_bit == 0:
        # To the group, or (no group: a torus's column) to each other member in one go.
        if _room_for(tx, tx_n, 1 if cfg[CFG_GROUP] != 0 else world):
            tx_n = _send_started(cfg, ring, tx, tx_n, _all_ranks(world) & ~me_bit, 1)
            cfg[CFG_STARTED] |= me_bit
    if cfg[CFG_STARTED_ASK] != 0 and _room_for(tx, tx_n, world):
        # Members that lacked ours asked for it (their STARTED with txn_id 0): to each alone.
        tx_n = _send_started(cfg, ring, tx, tx_n, cfg[CFG_STARTED_ASK], 1)
        cfg[CFG_STARTED_ASK] = 0
    window = max(cfg[CFG_WINDOW] // share, SHARED_WINDOW_MIN)
    # DONEs, (sparse mode) arriving bitmaps and members' STARTEDs are progress too (each term
    # only grows within an epoch, so the sum changes exactly when one does)
    advance = (
        cfg[CFG_DONE_COUNT]
        + cfg[CFG_ACKED]
        + cfg[CFG_PEERS_DONE]
        + cfg[CFG_BM_GOT]
        + _members_in(cfg[CFG_STARTED])
    )
    if advance != fcfg[F_LAST_COUNT]:
        fcfg[F_LAST_COUNT] = advance
        fcfg[F_LAST_PROGRESS] = now
        fcfg[F_LAST_ADVANCE] = now
    deadline = fcfg[F_DEADLINE]
    if (
        _announces_start(cfg)
        and not _awaits_started(cfg)
        and cfg[CFG_STARTED] != _all_ranks(cfg[CFG_WORLD])
    ):
        # A member has not started: late, not dead (above). A chained collective whose chains
        # await STARTEDs keeps one period, as when its chains waited at a member not started
        # (each STARTED that comes is progress): a member that died before starting is named
        # as soon as it was then.
        deadline *= START_SKEW_STALLS
    # ...and outlasts the timers: a NIC whose RTO covers long turns of its process (a host
    # stall raised it, _rto_bounds) re-asks what it lacks at least once before it gives up.
    deadline = max(deadline, WATCHDOG_MIN_RTOS * _rto_bounds(fcfg)[0])
    if cfg[CFG_FATAL] != 0 or now - fcfg[F_LAST_ADVANCE] > deadline:
        cfg[CFG_STATE] = STATE_FAILED
        if _room(tx, tx_n):
            status = cfg[CFG_FATAL] if cfg[CFG_FATAL] != 0 else 23  # TIMEOUT: the watchdog fired
            _trace_phase(trace, now, cfg, PH_FAILED, status)
            tx_n = _notify(cfg, fcfg, status, done, cb, tx, tx_n)
        return tx_n
    ob = cfg[CFG_ORIG_BLOCK]
    base_rto = fcfg[F_BASE_RTO] if fcfg[F_BASE_RTO] > 0.0 else fcfg[F_RTO]
    # Every member's STARTED came (or a RESUME, or it was remembered before this node started);
    # past one repair period without, a STARTED may have been lost.
    members_started = cfg[CFG_STARTED] == _all_ranks(world)
    repair_s = max(base_rto, REPAIR_MIN_S)
    waited_out = now - fcfg[F_START] > repair_s
    if (
        _awaits_started(cfg)
        and not members_started
        and now - max(fcfg[F_START], fcfg[F_STARTED_ASKED]) > repair_s
        and _room_for(tx, tx_n, world)
    ):
        # Ask each member whose STARTED has not come for it, once a repair period: one that
        # runs answers with its own; one that has not started remembers us and RESUMEs us
        # when it does (which counts as its STARTED). So a lost STARTED costs a repair period
        # and a late member none, and no chain goes before every member is known to run.
        tx_n = _send_started(cfg, ring, tx, tx_n, _all_ranks(world) & ~cfg[CFG_STARTED], 0)
        fcfg[F_STARTED_ASKED] = now
    # 0. Sparse mode: first the round of per-chunk non-zero bitmaps; nothing else moves before
    #    every member's bitmap is here, then chunks zero everywhere are skipped.
    if cfg[CFG_SPARSE] != 0 and cfg[CFG_BM_APPLIED] == 0:
        tx_n = _bitmap_round(cfg, fcfg, ring, now, mem, done, tx, tx_n)
        if cfg[CFG_BM_GOT] != (np.int64(1) << cfg[CFG_WORLD]) - 1:
            return tx_n
        _skip_zero_chunks(cfg, bounds, cb, acked, agsent, mem, done)
    elif cfg[CFG_SPARSE] != 0 and cfg[CFG_BM_ASK] != 0:
        tx_n = _bitmap_round(cfg, fcfg, ring, now, mem, done, tx, tx_n)
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
        newest_at, newest = _newest_acked(cfg, acked, sent)
        for c in range(cfg[CFG_LOW_UNACKED], cfg[CFG_NEXT_SEND]):
            if acked[c] == 2:
                busy = True
            if acked[c] == 2 and now - sent[c] > BUSY_RETRY_S * (1 << min(tries[c], 6)):
                # A hop answered BUSY (its host has not started the collective yet): ask
                # again, backing off (0.5 ms doubling to 32 ms). Flow control: neither a
                # retransmit nor an RTT sample (tries > 1 keeps Karn's rule off it).
                if not _room(tx, tx_n):
                    return tx_n
                tx_n = _send_chain(cfg, ring, bounds, cb, c, False, mem, tx, tx_n)
                acked[c] = ACKED_PROBE
                sent[c] = now
                tries[c] = min(tries[c] + 1, 250)
            elif acked[c] == ACKED_PROBE and now - sent[c] > fcfg[F_RTO]:
                # The probe or its answer is late: ask again, as flow control (the hop's guard
                # answers a copy that already ran with its ACK again).
                if not _room(tx, tx_n):
                    return tx_n
                tx_n = _send_chain(cfg, ring, bounds, cb, c, False, mem, tx, tx_n)
                sent[c] = now
                tries[c] = min(tries[c] + 1, 250)
            elif acked[c] == 0 and _chain_late(
                fcfg, sent, c, now, heard_at, newest_at, newest, cfg[CFG_RETRANSMITS] > 0
            ):
                if not _room(tx, tx_n):
                    return tx_n
                tx_n = _send_chain(cfg, ring, bounds, cb, c, True, mem, tx, tx_n)
                sent[c] = now
                tries[c] = min(tries[c] + 1, 255)
                cfg[CFG_RETRANSMITS] += 1
                counters[C.RETRANSMITS] += 1
                _trace_resend(trace, now, cfg, OP_CHAIN_ADD, c)
                backoff = True
        if backoff:
            fcfg[F_RTO] = min(fcfg[F_RTO] * 2.0, _rto_bounds(fcfg)[1])
        # While a hop says BUSY, no new chain starts: only the waiting ones probe. Chains that
        # await the members' STARTEDs start when the last came (see the asks above).
        limit = window
        if _awaits_started(cfg) and not members_started:
            limit = 0
        while not busy and cfg[CFG_INFLIGHT] < limit and cfg[CFG_NEXT_SEND] < cb[ob + 1]:
            c = cfg[CFG_NEXT_SEND]
            if acked[c] == 1:  # skipped (zero everywhere): no chain
                cfg[CFG_NEXT_SEND] = c + 1
                continue
            if not _room(tx, tx_n):
                return tx_n
            tx_n = _send_chain(cfg, ring, bounds, cb, c, False, mem, tx, tx_n, True)
            sent[c] = now
            tries[c] = 1
            cfg[CFG_NEXT_SEND] = c + 1
            cfg[CFG_INFLIGHT] += 1
    # 2. Spread this node's completed chunks (all-reduce, all-gather, broadcast).
    own = cfg[CFG_OWN_BLOCK]
    # A chain ACK proves every other node started (each one on the path would have answered
    # BUSY): only then is the all-gather sent, so no member drops it as early.
    # (Sparse mode: every member's bitmap arrived, so every member has started.) So does an
    # all-reduce's chunk of this node's own block stored here, and a hop sooner than this
    # node's chain's ACK: its chain came around the whole ring, through every member (one not
    # started answers BUSY, or holds it until it starts). A node that starts no chain and
    # stores none (an empty block: fewer elements than members) has no such proof and relies
    # on RESUME and repair.
    proven = (
        cfg[CFG_ACKED] > 0
        or cfg[CFG_SPARSE] != 0
        or (
            cfg[CFG_ALGO] == ALGO_ALL_REDUCE
            and own >= 0
            and cb[own + 1] > cb[own]
            and done[cb[own]] != 0
        )
    )
    started_everywhere = ob < 0 or cb[ob + 1] == cb[ob] or proven
    if _awaits_started(cfg):
        # The members' STARTEDs are the proof, for a node with no chain of its own too: one
        # READing before they came asked a member not started yet (1 element over 4, the
        # last member 0.3 s late: 2 repair READs at each of two members, all answered BUSY).
        started_everywhere = proven or members_started
    elif _announces_start(cfg):
        # A gather has no chain to prove its members started: their STARTEDs do. Spread to
        # the group before the last one came, a member drops it as early and RESUMEs, and the
        # block goes again to it by unicast (a torus's row all-gather at 256 NICs: ~28 of
        # each NIC's ~130 chunks). A STARTED lost costs one repair period, then that path.
        started_everywhere = members_started or waited_out
    if own >= 0 and cfg[CFG_ALGO] != 1 and started_everywhere:
        # Stored chunks go as they are stored, past a chunk not stored yet (lost on its way
        # here, or late): each is its chain's ACK, and the chains after a lost one, ACKed,
        # tell their originator at once that it was lost (_chain_late). AG_NEXT is the first
        # chunk not spread yet; nothing past _spread_end has been.
        budget = window
        c = cfg[CFG_AG_NEXT]
        first_unsent = -1
        end = _spread_end(cfg, cb, own)
        while c < end and budget > 0:
            if done[c] == 0:
                if first_unsent < 0:
                    first_unsent = c
                c += 1
                continue
            if agsent[c] == 0:
                if cfg[CFG_GROUP] != 0:
                    if not _room(tx, tx_n):
                        return tx_n
                    tx_n = _send_gather(
                        cfg, ring, bounds, cb, c, np.uint64(cfg[CFG_GROUP]), mem, tx, tx_n
                    )
                else:
                    for k in range(1, cfg[CFG_WORLD]):
                        if not _room(tx, tx_n):
                            return tx_n
                        member = ring[(cfg[CFG_RANK] + k) % cfg[CFG_WORLD]]
                        tx_n = _send_gather(cfg, ring, bounds, cb, c, member, mem, tx, tx_n)
                agsent[c] = 1
                budget -= 1
            c += 1
        cfg[CFG_AG_NEXT] = first_unsent if first_unsent >= 0 else c
    # 2b. Members that started after this node spread chunks to them dropped those as early and
    # said so (RESUME): the chunks spread so far go to them again, by unicast, at once (not
    # after a repair timer: a start skew costs one message, as for chains).
    if own >= 0 and cfg[CFG_AG_RESEND] != 0:
        budget = window
        c = max(cfg[CFG_AG_RESEND_NEXT], cb[own])
        end = _spread_end(cfg, cb, own)
        while c < end and budget > 0:
            if agsent[c] == 1:
                for r in range(cfg[CFG_WORLD]):
                    if (cfg[CFG_AG_RESEND] >> r) & 1:
                        if not _room(tx, tx_n):
                            cfg[CFG_AG_RESEND_NEXT] = c
                            return tx_n
                        tx_n = _send_gather(cfg, ring, bounds, cb, c, ring[r], mem, tx, tx_n)
                budget -= 1
            c += 1
        cfg[CFG_AG_RESEND_NEXT] = c
        if c >= end:
            cfg[CFG_AG_RESEND] = 0
    # 3. Repair: no progress for an RTO while chunks are missing -> READ them from their owners.
    # Repair is paced by the RTO without backoff: chain backoff says nothing about READs. Not
    # while a member may not have started (no chain of this node ACKed yet): its chunks cannot
    # be anywhere, and a stall then is start skew (a torus's steps, SPEC.md 4.2), not loss.
    # (Backing off a chunk whose owner answered BUSY made 30% loss fail a run: the owner got
    # it a moment later, and its reader waited out its backoff into the watchdog.)
    if cfg[CFG_ALGO] != 1 and started_everywhere and now - fcfg[F_LAST_PROGRESS] > repair_s:
        budget = window
        gather = cfg[CFG_ALGO] == ALGO_ALL_GATHER or cfg[CFG_ALGO] == ALGO_BROADCAST
        # A gather has no chain to prove its owners started: a block none of whose chunks came
        # and whose owner has not said DONE may be an owner that has not started (a torus's
        # all-gather waits for its slowest column, SPEC.md 4.2), READ only after a long stall.
        long_stall = now - fcfg[F_LAST_ADVANCE] > REPAIR_GATHER_STALLS * repair_s
        heard_block = -1
        heard = False
        for c in range(cfg[CFG_CHUNKS]):
            if budget == 0:
                break
            j = _block_of(cfg, cb, c)
            if j == own or done[c] != 0:
                continue
            if gather and not long_stall:
                if j != heard_block:
                    heard_block = j
                    heard = (cfg[CFG_PEERS_DONE] >> j) & 1 != 0 or done[cb[j] : cb[j + 1]].any()
                if not heard:
                    continue
            if now - sent[c] < base_rto:
                continue
            if not _room(tx, tx_n):
                return tx_n
            tx_n = _send_read(cfg, ring, bounds, cb, c, tx, tx_n)
            sent[c] = now
            cfg[CFG_READS] += 1
            counters[C.RETRANSMITS] += 1
            _trace_resend(trace, now, cfg, OP_READ, c)
            budget -= 1
        fcfg[F_LAST_PROGRESS] = now  # one repair round per RTO
    # 4. Ready when every needed chunk is here and every chain this node started was ACKed.
    #    Then DONE goes to every member (again every base RTO until all answered); the host
    #    hears of completion only when every member is ready, so no node moves to the next
    #    epoch while another may still READ from it.
    world = cfg[CFG_WORLD]
    me = np.int64(1) << cfg[CFG_RANK]
    chains_done = ob < 0 or cfg[CFG_ACKED] >= cb[ob + 1] - cb[ob]
    if chains_done and fcfg[F_T_CHAINS] < 0.0:
        fcfg[F_T_CHAINS] = now
    if cfg[CFG_DONE_COUNT] >= cfg[CFG_NEEDED] and fcfg[F_T_CHUNKS] < 0.0:
        fcfg[F_T_CHUNKS] = now
    if chains_done and cfg[CFG_DONE_COUNT] >= cfg[CFG_NEEDED]:
        first = cfg[CFG_PEERS_DONE] & me == 0
        if first and cfg[CFG_GROUP] != 0 and world > 2:
            # The first round in one multicast to the collective's group (its members joined
            # it): one send where unicast takes world - 1. As an answer (txn_id 1), so no member
            # replies to it; one whose DONE is lost here is asked again by the re-send rounds.
            if not _room(tx, tx_n):
                return tx_n
            cfg[CFG_PEERS_DONE] |= me
            fcfg[F_LAST_DONE_SENT] = now
            tx_n = _send_done(cfg, cfg[CFG_EPOCH], np.uint64(cfg[CFG_GROUP]), True, tx, tx_n)
        elif first or now - fcfg[F_LAST_DONE_SENT] > base_rto:
            if first and not _room_for(tx, tx_n, world):
                return tx_n  # the first round of DONEs goes out whole
            cfg[CFG_PEERS_DONE] |= me
            fcfg[F_LAST_DONE_SENT] = now
            for k in range(1, world):
                peer = (cfg[CFG_RANK] + k) % world
                have_theirs = (cfg[CFG_PEERS_DONE] >> peer) & 1
                if have_theirs and not first:
                    continue  # re-sends only ask the members still silent
                if not _room(tx, tx_n):
                    return tx_n
                # A member whose DONE is already here asked for ours while this node was not
                # ready: it gets ours now as the answer, packet-driven, not after its RTO.
                tx_n = _send_done(cfg, cfg[CFG_EPOCH], ring[peer], have_theirs != 0, tx, tx_n)
        all_ranks = _all_ranks(world)
        if cfg[CFG_PEERS_DONE] == all_ranks and _room(tx, tx_n):
            cfg[CFG_STATE] = STATE_DONE
            fcfg[F_T_DONE] = now
            _trace_phase(trace, fcfg[F_T_CHAINS], cfg, PH_CHAINS, 0)
            _trace_phase(trace, fcfg[F_T_CHUNKS], cfg, PH_CHUNKS, 0)
            _trace_phase(trace, now, cfg, PH_DONE, 0)
            tx_n = _notify(cfg, fcfg, 0, done, cb, tx, tx_n)
            _trace_phase(trace, now, cfg, PH_COMPLETE, 0)
    return tx_n


@njit(cache=True, nogil=True)
def _trace_start(trace, now, cfg, cb):
    """The collective's clock starts here: a START record, then its plan (each block's first
    chunk and chunks), which a trace reader needs to place chunks in blocks."""
    if trace.rec.shape[0] == 0:
        return
    t_ns = np.int64(now * 1e9)
    _trace_phase(trace, now, cfg, PH_START, 0)
    for b in range(cfg[CFG_WORLD]):
        note(
            trace,
            t_ns,
            K_BLOCK,
            0,
            0,
            0,
            cb[b + 1] - cb[b],
            0,
            cfg[CFG_COLL],
            cfg[CFG_EPOCH],
            b,
            cb[b],
        )


@njit(cache=True, nogil=True)
def _trace_phase(trace, t, cfg, phase, status):
    """A PHASE record: *phase* of this collective ended at *t* (s); a failure's *status* in
    its addr."""
    t_ns = np.int64(max(t, 0.0) * 1e9)
    note(trace, t_ns, K_PHASE, 0, phase, 0, 0, 0, cfg[CFG_COLL], cfg[CFG_EPOCH], 0, status)


@njit(cache=True, nogil=True)
def _trace_resend(trace, now, cfg, opcode, c):
    """A RETRANSMIT record: chunk *c* went again (a chain, or a repair READ)."""
    t_ns = np.int64(now * 1e9)
    note(trace, t_ns, K_RETRANSMIT, opcode, 0, 0, 0, 0, cfg[CFG_COLL], cfg[CFG_EPOCH], c, 0)


@njit(cache=True, nogil=True)
def _answer_previous(cfg, ring, tx, tx_n):
    """Repeat this node's DONE to members that ask for it: of the previous epoch, or of the
    current one once finished (they lost it while this node finished)."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    for peer in range(cfg[CFG_WORLD]):
        bit = np.int64(1) << peer
        if cfg[CFG_PREV_ASK] & bit and _room(tx, tx_n):
            tx_n = _send_done(cfg, (cfg[CFG_EPOCH] - 1) & 0xFFFFFFFF, ring[peer], True, tx, tx_n)
            cfg[CFG_PREV_ASK] &= ~bit
        if cfg[CFG_CUR_ASK] & bit and _room(tx, tx_n):
            tx_n = _send_done(cfg, cfg[CFG_EPOCH], ring[peer], True, tx, tx_n)
            cfg[CFG_CUR_ASK] &= ~bit
    return tx_n


@njit(cache=True, nogil=True)
def _send_done(cfg, epoch, dst, answer, tx, tx_n):
    """DONE: an ACK with aux_addr = AUX_DONE, seq = this node's rank, txn_id 0 for a DONE that
    asks the member to answer with its own once ready, 1 for such an answer (never answered:
    no ping-pong between finished nodes)."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    t = tx_buf[tx_off[tx_n] :]
    _header(t, OP_ACK, 0, cfg[CFG_RANK], cfg, 0, 0, AUX_DONE, 0)
    wr32(t, H_TXN_ID, 1 if answer else 0)
    wr32(t, H_EPOCH, epoch)
    if epoch != cfg[CFG_EPOCH]:
        wr32(t, H_RKEY, cfg[CFG_PREV_RKEY])  # that epoch's key, which its members check
    return _commit(cfg, tx, tx_n, HDR, dst)


@njit(cache=True, nogil=True)
def _send_resumes(cfg, tx, tx_n):
    """RESUME to every originator this node answered BUSY for this very collective and epoch
    before its host started it: an ACK with aux_addr = AUX_RESUME, seq = this node's rank,
    txn_id 0, no payload. Records of any other collective or epoch are stale: forgotten."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    n = cfg[CFG_REFUSED_N]
    if cfg[CFG_REFUSED_COLL] == cfg[CFG_COLL] and cfg[CFG_REFUSED_EPOCH] == cfg[CFG_EPOCH]:
        for k in range(n):
            if not _room(tx, tx_n):
                break  # the originator's BUSY backoff asks again anyway
            t = tx_buf[tx_off[tx_n] :]
            _header(t, OP_ACK, 0, cfg[CFG_RANK], cfg, 0, 0, AUX_RESUME, 0)
            tx_n = _commit(cfg, tx, tx_n, HDR, np.uint64(cfg[CFG_REFUSED_BASE + k]))
    cfg[CFG_REFUSED_N] = 0
    return tx_n


@njit(cache=True, nogil=True)
def _announces_start(cfg):
    """Each member multicasts STARTED when its host starts this collective: a dense gather
    over a group of more than two, which has no chain to prove its members started (an owner
    spreads once every member's came), and a chained one whose chains await them
    (_awaits_started)."""
    algo = cfg[CFG_ALGO]
    return (
        (algo == ALGO_ALL_GATHER or algo == ALGO_BROADCAST)
        and cfg[CFG_GROUP] != 0
        and cfg[CFG_WORLD] > 2
        and cfg[CFG_SPARSE] == 0
    ) or _awaits_started(cfg)


@njit(cache=True, nogil=True)
def _awaits_started(cfg):
    """A chained collective (all-reduce, reduce-scatter) whose originators start their chains
    once every member's STARTED came (descriptor flags bit 2, SPEC.md 4.1 "STARTED"), not at
    once: its members' starts are spread wider than a node holds early chains (5 ms), and an
    early chain past that is answered BUSY. Dense only: sparse mode's round of bitmaps proves
    the same. Without a group (a torus's column) the STARTEDs go by unicast, one to each
    member."""
    algo = cfg[CFG_ALGO]
    return (
        (algo == ALGO_ALL_REDUCE or algo == ALGO_REDUCE_SCATTER)
        and cfg[CFG_FLAGS] & FLAG_AWAIT_STARTED != 0
        and cfg[CFG_WORLD] > 1
        and cfg[CFG_SPARSE] == 0
    )


@njit(cache=True, nogil=True)
def _send_started(cfg, ring, tx, tx_n, to, txn):
    """STARTED to the members of rank bit set *to*: an ACK with aux_addr = AUX_STARTED, seq =
    this node's rank, no payload, under the collective's key; *txn* 1 an answer (nobody
    replies), 0 a question (a member that runs the collective answers with its own). To every
    other member of a collective with a group by one multicast send, else to each by unicast
    (a torus's column has no group). The caller made room for one per member."""
    world = cfg[CFG_WORLD]
    me = cfg[CFG_RANK]
    if cfg[CFG_GROUP] != 0 and to == _all_ranks(world) & ~(np.int64(1) << me):
        return _started_to(cfg, tx, tx_n, txn, np.uint64(cfg[CFG_GROUP]))  # one send for all
    for k in range(world):
        if k != me and to & (np.int64(1) << k) != 0:
            tx_n = _started_to(cfg, tx, tx_n, txn, np.uint64(ring[k]))
    return tx_n


@njit(cache=True, nogil=True)
def _started_to(cfg, tx, tx_n, txn, dst):
    tx_buf, tx_off, _, _, _ = tx
    t = tx_buf[tx_off[tx_n] :]
    _header(t, OP_ACK, 0, cfg[CFG_RANK], cfg, 0, 0, AUX_STARTED, 0)
    wr32(t, H_TXN_ID, txn)
    return _commit(cfg, tx, tx_n, HDR, dst)


@njit(cache=True, nogil=True)
def _refused_ranks(cfg, ring):
    """Bits of the ranks among the originators remembered for this very collective and epoch
    before it started here (a BUSY, an early all-gather chunk, an early STARTED): each of them
    had started it."""
    bits = np.int64(0)
    if cfg[CFG_REFUSED_COLL] == cfg[CFG_COLL] and cfg[CFG_REFUSED_EPOCH] == cfg[CFG_EPOCH]:
        for k in range(cfg[CFG_REFUSED_N]):
            originator = np.uint64(cfg[CFG_REFUSED_BASE + k])
            for r in range(cfg[CFG_WORLD]):
                if ring[r] == originator:
                    bits |= np.int64(1) << r
    return bits


@njit(cache=True, nogil=True)
def _note_refusal(co_cfg, coll, epoch, originator, displace=True):
    """Remember an originator answered BUSY for (coll, epoch), for _send_resumes. Only the
    newest (coll, epoch) refused is kept; past REFUSED_SLOTS originators the rest wait for
    their backoff timer. *displace* False (a held chain's originator, whose chain is on its
    way and only its timer gains): noted only where no other (coll, epoch) is remembered, so
    it never makes a node forget a refused originator that has nothing in flight and waits
    for its RESUME (a BUSY chain, a dropped all-gather chunk)."""
    if co_cfg[CFG_REFUSED_COLL] != coll or co_cfg[CFG_REFUSED_EPOCH] != epoch:
        if not displace and co_cfg[CFG_REFUSED_N] != 0:
            return
        co_cfg[CFG_REFUSED_COLL] = coll
        co_cfg[CFG_REFUSED_EPOCH] = epoch
        co_cfg[CFG_REFUSED_N] = 0
    n = co_cfg[CFG_REFUSED_N]
    value = np.int64(originator)
    for k in range(n):
        if co_cfg[CFG_REFUSED_BASE + k] == value:
            return
    if n < REFUSED_SLOTS:
        co_cfg[CFG_REFUSED_BASE + n] = value
        co_cfg[CFG_REFUSED_N] = n + 1


@njit(cache=True, nogil=True)
def _members_in(bits):
    """How many ranks the rank bit set *bits* holds (a count, not the set: the watchdog's
    progress sum is kept in a float, which holds a 64-bit set inexactly)."""
    count = 0
    while bits != 0:
        bits &= bits - 1
        count += 1
    return count


@njit(cache=True, nogil=True)
def _all_ranks(world):
    """The rank bit set of a world of *world* (<= 64) members. Not (1 << world) - 1: a shift by
    64 is undefined in LLVM (x86 takes the count mod 64: 1 << 64 == 1), which made it 0 at 64
    members, and a 64-node collective waited for its DONEs until the watchdog fired."""
    return np.int64(-1) if world >= 64 else (np.int64(1) << world) - 1


@njit(cache=True, nogil=True)
def _rtt_sample(fcfg, sample):
    """RFC 6298 smoothing; RTO clamped to _rto_bounds."""
    if fcfg[F_SRTT] == 0.0:
        fcfg[F_SRTT] = sample
        fcfg[F_RTTVAR] = sample / 2.0
    else:
        fcfg[F_RTTVAR] = 0.75 * fcfg[F_RTTVAR] + 0.25 * abs(fcfg[F_SRTT] - sample)
        fcfg[F_SRTT] = 0.875 * fcfg[F_SRTT] + 0.125 * sample
    floor, ceiling = _rto_bounds(fcfg)
    fcfg[F_RTO] = min(max(fcfg[F_SRTT] + 4.0 * fcfg[F_RTTVAR], floor), ceiling)
    fcfg[F_BASE_RTO] = fcfg[F_RTO]


#: A chain goes again at the latest this many RTOs after it left, even while the collective
#: moves (_chain_late): until this node has lost one, a lost last chain has no later chain to
#: be ACKed. Without a cap, or with the timers held by progress after losses too, 4 x 1 MiB at
#: 30% loss took 2.9 s (median of 10 seeds) against 2.6 s. Not 2: a hop that takes a datagram a
#: millisecond answers chains ~0.2 s after they left (tests/core/test_collectives.py).
LATE_CAP_RTOS = 3
#: How far past the first chunk not spread yet an owner looks for stored ones to spread:
#: twice the largest credit window (core.collective.MAX_WINDOW, 128), since its block's one
#: originator has at most a window of chains in flight past a lost one.
SPREAD_AHEAD = 256


@njit(cache=True, nogil=True)
def _spread_end(cfg, cb, own):
    """Past the last chunk of block *own* this owner may have spread (see SPREAD_AHEAD)."""
    return min(cb[own + 1], cfg[CFG_AG_NEXT] + SPREAD_AHEAD)


@njit(cache=True, nogil=True)
def _spread_any(cfg, cb, own, agsent):
    """Whether this owner spread any chunk of its block *own* yet."""
    if cfg[CFG_AG_NEXT] > cb[own]:
        return True
    for c in range(cb[own], _spread_end(cfg, cb, own)):
        if agsent[c] == 1:
            return True
    return False


@njit(cache=True, nogil=True)
def _newest_acked(cfg, acked, sent):
    """(sent time, chunk) of the chain in this node's window sent last among those ACKed, in
    the order (time, chunk) (a tick sends its chains in chunk order at one time); (-1, -1):
    none."""
    newest_at = -1.0
    newest = -1
    for c in range(cfg[CFG_LOW_UNACKED], cfg[CFG_NEXT_SEND]):
        if acked[c] == 1 and sent[c] >= newest_at:
            newest_at = sent[c]
            newest = c
    return newest_at, newest


@njit(cache=True, nogil=True)
def _chain_late(fcfg, sent, c, now, heard_at, newest_at, newest, lossy):
    """Whether chain c, unanswered, is lost and goes again: sent an RTO ago and either

    - a chain this node sent after it is ACKed (it took the same hops, in order: RFC 8985's
      RACK, with the RTO as its reordering window; owners spread stored chunks past a gap for
      this, section 2 of _coll_tick), or
    - the collective moved nowhere here for an RTO (a chain ACKed, a chunk stored, a DONE or
      STARTED in: F_LAST_ADVANCE; a chain passed on: F_LAST_PASSED), as of the tick before
      this one, a receive round ago (the tick runs before each round's receive: a process
      kept off its core reads its socket before it judges), or
    - it left LATE_CAP_RTOS RTOs ago: a lost last chain (no later one to be ACKed) waits no
      longer while the rest of the collective moves, or
    - this node already lost a chain of this collective (*lossy*): its path loses datagrams,
      and a chain late past its RTO is then more likely lost than queued, so each keeps its
      own timer, as every chain did before. Held by progress after losses too, 4 x 1 MiB at
      30% loss, 15% duplication and reordering took 2.50 s against 2.17 s (medians of 10
      seeds); with this, 2.28 against 2.35.

    So the timer restarts on progress, as TCP's does on an ACK (RFC 6298, 5.3), rather than
    running from each chain's send: a window's chains queued behind a busy hop's backlog are
    answered one after another, later than an RTO after they left, and were all re-sent for
    nothing (tests/core/test_collectives.py, a hop that takes a datagram a millisecond: 134-229
    chains per node, and the re-sends deepened the backlog)."""
    if now - sent[c] <= fcfg[F_RTO]:
        return False
    if sent[c] < newest_at or (sent[c] == newest_at and c < newest):
        return True
    if lossy:
        return True
    base_rto = fcfg[F_BASE_RTO] if fcfg[F_BASE_RTO] > 0.0 else fcfg[F_RTO]
    if now - sent[c] > LATE_CAP_RTOS * base_rto:
        return True
    moved = max(fcfg[F_LAST_ADVANCE], fcfg[F_LAST_PASSED])
    return heard_at - max(sent[c], moved) > fcfg[F_RTO]


@njit(cache=True, nogil=True)
def _rto_bounds(fcfg):
    """(floor, ceiling) of the RTO: [RTO_MIN_S, RTO_MAX_S], raised to cover the host's turns."""
    floor = max(RTO_MIN_S, HOST_TURNS_PER_RTO * fcfg[F_HOST_TURN])
    return floor, max(RTO_MAX_S, 2.0 * floor)


@njit(cache=True, nogil=True)
def _bitmap_round(cfg, fcfg, ring, now, mem, done, tx, tx_n):
    """Sparse mode's first round (SPEC.md 4.1): answer members that sent their bitmap as a
    request; send ours as a request to members not known to hold it, at once and again every
    base RTO (a member not started yet drops it; its own request, once it starts, is answered)."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    world = cfg[CFG_WORLD]
    for peer in range(world):
        bit = np.int64(1) << peer
        if cfg[CFG_BM_ASK] & bit and _room(tx, tx_n):
            tx_n = _send_bitmap(cfg, 1, ring[peer], done, tx, tx_n)
            cfg[CFG_BM_ASK] &= ~bit
    all_ranks = _all_ranks(world)
    base_rto = fcfg[F_BASE_RTO] if fcfg[F_BASE_RTO] > 0.0 else fcfg[F_RTO]
    if cfg[CFG_BM_HAS] != all_ranks and (
        fcfg[F_BM_SENT] == 0.0 or now - fcfg[F_BM_SENT] > base_rto
    ):
        fcfg[F_BM_SENT] = now
        for peer in range(world):
            if (cfg[CFG_BM_HAS] >> peer) & 1:
                continue
            if not _room(tx, tx_n):
                return tx_n
            tx_n = _send_bitmap(cfg, 0, ring[peer], done, tx, tx_n)
    return tx_n


@njit(cache=True, nogil=True)
def _send_bitmap(cfg, answer, dst, done, tx, tx_n):
    """This node's non-zero bitmap: an ACK with aux_addr = AUX_BITMAP, seq = rank, txn_id 0
    (request: answer me) or 1 (answer), payload ceil(chunks / 8) bytes, bit c = chunk c."""
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    nbytes = (cfg[CFG_CHUNKS] + 7) // 8
    t = tx_buf[tx_off[tx_n] :]
    _header(t, OP_ACK, 0, cfg[CFG_RANK], cfg, nbytes, 0, AUX_BITMAP, 0)
    wr32(t, H_TXN_ID, answer)
    copy_bytes(t, HDR, done, BM_BASE, nbytes)
    return _commit(cfg, tx, tx_n, HDR + nbytes, dst)


@njit(cache=True, nogil=True)
def _skip_zero_chunks(cfg, bounds, cb, acked, agsent, mem, done):
    """Every bitmap is in: a chunk zero in every member's input is zero in the result (SUM, MIN
    and MAX of +0 are +0). Write it here, count it done and ACKed, never chain or gather it."""
    cfg[CFG_BM_APPLIED] = 1
    esize = ESIZE[cfg[CFG_DTYPE]]
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


# ---------------------------------------------------------------- per-packet: what the datapath hands the engine


@njit(cache=True, nogil=True)
def coll_phase(co_cfg, coll, epoch):
    """RUNNING when (coll, epoch) is this node's current collective (running or finished),
    STALE for an earlier epoch of it, NOT_STARTED otherwise (the host has not started it here
    yet: its input may not be staged, so nothing of it may be read or written)."""
    if co_cfg[CFG_STATE] != STATE_IDLE and coll == co_cfg[CFG_COLL]:
        behind = (co_cfg[CFG_EPOCH] - epoch) & 0xFFFFFFFF
        if behind == 0:
            return PHASE_RUNNING
        if behind < 0x80000000:
            return PHASE_STALE
    return PHASE_NOT_STARTED


# ---------------------------------------------------------------- setting an epoch up

#: Watchdog: a collective fails after this long without progress (START_COLL may say less).
DEFAULT_TIMEOUT_MS = 10_000
#: RTO before the first ACK sample (RFC 6298 says 1 s for the Internet). 50 ms: every timer of a
#: collective runs on it until then, and ranks that start a few ms apart otherwise waited 200 ms
#: (measured: 2 nodes, 20 KiB, 2-50 ms skew: ~205 ms extra at 0.2 s, ~55 ms at 0.05 s).
INITIAL_RTO_S = 0.05
#: ...plus this much per hop of a chain past 25: before the first sample the RTO must cover a
#: whole chain, and on 2 cores each hop waits its turn (64 NICs x 1 MiB, all of it in the first
#: window: 656-710 chains re-sent at 50 ms).
RTO_PER_HOP_S = 0.002

#: The words of a slot's cfg that say what its collective is (the START_COLL's shape and who
#: sent it): an epoch set up over the last one keeps them (begin_epoch), the rest starts anew.
SHAPE_WORDS = np.array(
    [
        CFG_COLL,
        CFG_RANK,
        CFG_WORLD,
        CFG_ALGO,
        CFG_DTYPE,
        CFG_OP,
        CFG_COUNT,
        CFG_IN,
        CFG_OUT,
        CFG_WINDOW,
        CFG_PER_PACKET,
        CFG_CHUNKS,
        CFG_GROUP,
        CFG_HOST,
        CFG_CLIENT,
        CFG_ROOT,
        CFG_REQ_WINDOW,
        CFG_TIMEOUT_MS,
        CFG_FLAGS,
        CFG_STARTER,
        CFG_SPAN_LO,
        CFG_SPAN_HI,
        CFG_CKEY,
        CFG_CKEY_RIGHTS,
    ],
    np.int64,
)


@njit(cache=True, nogil=True)
def initial_rto(world):
    """The RTO before the first ACK sample of a collective over *world* members."""
    return max(INITIAL_RTO_S, RTO_PER_HOP_S * (world - 1))


@njit(cache=True, nogil=True)
def begin_epoch(coll, spare, epoch, rkey, txn, k0, k1):
    """Set slot *coll* up for epoch *epoch* of the collective its shape words (SHAPE_WORDS, its
    ring, bounds and chunk bounds) describe, under *rkey* and the tag key (k0, k1): every
    per-chunk table and clock word anew; kept across epochs, the previous epoch's key, tags and
    the members asking for its DONE, and the chains refused before this start (the spare row's
    too, *spare*: its RESUMEs go out at the first tick). Ends RUNNING. The one setup of an
    epoch: the control plane's START_COLL (netdam.core.collective) and the datapath's
    (restart_collective) both end here."""
    cfg, done, acked, fcfg, ring, bounds, cb, sent, tries, agsent = coll
    n_chunks = cfg[CFG_CHUNKS]
    acked[:n_chunks] = 0
    tries[:n_chunks] = 0
    agsent[:n_chunks] = 0
    done[:n_chunks] = 0
    done[NZ_BASE : NZ_BASE + n_chunks] = 0
    sent[:n_chunks] = 0.0
    # A member may still ask for this node's DONE of the epoch that just ends; its late DONEs
    # carry its rkey and its tags.
    kept = cfg.copy()
    cfg[:] = 0
    for i in SHAPE_WORDS:
        cfg[i] = kept[i]
    cfg[CFG_REFUSED_COLL : CFG_REFUSED_N + 1] = kept[CFG_REFUSED_COLL : CFG_REFUSED_N + 1]
    cfg[CFG_REFUSED_BASE:CFG_REFUSED_END] = kept[CFG_REFUSED_BASE:CFG_REFUSED_END]
    cfg[CFG_PREV_ASK] = kept[CFG_PREV_ASK] | kept[CFG_CUR_ASK]
    cfg[CFG_PREV_RKEY] = kept[CFG_RKEY]
    cfg[CFG_PREV_EPOCH] = kept[CFG_EPOCH]
    cfg[CFG_PREV_TAG_K0] = kept[CFG_TAG_K0]
    cfg[CFG_PREV_TAG_K1] = kept[CFG_TAG_K1]
    cfg[CFG_TAG_K0] = k0
    cfg[CFG_TAG_K1] = k1
    cfg[CFG_EPOCH] = epoch
    cfg[CFG_RKEY] = rkey
    cfg[CFG_TXN] = txn
    world, rank, algo = cfg[CFG_WORLD], cfg[CFG_RANK], cfg[CFG_ALGO]
    reduces = algo == ALGO_ALL_REDUCE or algo == ALGO_REDUCE_SCATTER
    cfg[CFG_ORIG_BLOCK] = (rank - 1 + world) % world if reduces and world > 1 else -1
    cfg[CFG_OWN_BLOCK] = rank if algo != ALGO_BROADCAST or rank == cfg[CFG_ROOT] else -1
    first = cb[cfg[CFG_ORIG_BLOCK]] if cfg[CFG_ORIG_BLOCK] >= 0 else 0
    cfg[CFG_NEXT_SEND] = first
    cfg[CFG_LOW_UNACKED] = first
    cfg[CFG_AG_NEXT] = cb[rank] if cfg[CFG_OWN_BLOCK] >= 0 else 0
    cfg[CFG_NEEDED] = cb[rank + 1] - cb[rank] if algo == ALGO_REDUCE_SCATTER else n_chunks
    host_turn = fcfg[F_HOST_TURN]
    fcfg[:] = 0.0
    fcfg[F_HOST_TURN] = host_turn
    rto = max(initial_rto(world), HOST_TURNS_PER_RTO * host_turn)
    fcfg[F_RTO] = rto
    fcfg[F_BASE_RTO] = rto
    fcfg[F_START] = -1.0  # the first tick stamps the start
    fcfg[F_T_CHAINS : F_T_DONE + 1] = -1.0  # phases not ended yet
    timeout_ms = cfg[CFG_TIMEOUT_MS] if cfg[CFG_TIMEOUT_MS] > 0 else DEFAULT_TIMEOUT_MS
    fcfg[F_DEADLINE] = timeout_ms / 1000.0  # longest stall
    fcfg[F_LAST_COUNT] = -1.0
    _take_refusals(spare, cfg)
    cfg[CFG_STATE] = STATE_RUNNING


@njit(cache=True, nogil=True)
def count_start(spare, cfg):
    """Number the start that set slot *cfg* up (the spare row counts them)."""
    spare[CFG_START_NO] += 1
    cfg[CFG_START_NO] = spare[CFG_START_NO]


@njit(cache=True, nogil=True)
def _take_refusals(spare, cfg):
    """Move the spare row's BUSY refusals of the collective *cfg* names into *cfg*: its chains
    refused before any slot held it are told to come again (RESUME) by its first tick."""
    if spare[CFG_REFUSED_COLL] == cfg[CFG_COLL] and spare[CFG_REFUSED_EPOCH] == cfg[CFG_EPOCH]:
        cfg[CFG_REFUSED_COLL : CFG_REFUSED_N + 1] = spare[CFG_REFUSED_COLL : CFG_REFUSED_N + 1]
        cfg[CFG_REFUSED_BASE:CFG_REFUSED_END] = spare[CFG_REFUSED_BASE:CFG_REFUSED_END]
        spare[CFG_REFUSED_N] = 0


@njit(cache=True, nogil=True)
def local_part(coll, mem):
    """What needs no network, after begin_epoch: this node's own block of an all-gather, a
    broadcast root's buffer, a lone rank's whole buffer, copied from input to output and
    marked done. Returns the output address the copy went to (-1: none), for a lone rank's
    fused update (its own gradient steps it, netdam.core.collective)."""
    cfg, done, acked, fcfg, ring, bounds, cb, sent, tries, agsent = coll
    algo, world, rank = cfg[CFG_ALGO], cfg[CFG_WORLD], cfg[CFG_RANK]
    if not (algo == ALGO_ALL_GATHER or algo == ALGO_BROADCAST or world == 1):
        return -1
    if algo == ALGO_BROADCAST and rank != cfg[CFG_ROOT]:
        return -1
    esize = ESIZE[cfg[CFG_DTYPE]]
    src = cfg[CFG_IN]
    if algo == ALGO_ALL_GATHER:
        dst = cfg[CFG_OUT] + bounds[rank] * esize
        nbytes = (bounds[rank + 1] - bounds[rank]) * esize
        first, last = cb[rank], cb[rank + 1]
    else:
        dst = cfg[CFG_OUT]
        nbytes = cfg[CFG_COUNT] * esize
        first, last = 0, cfg[CFG_CHUNKS]
    if src != dst:
        mem[dst : dst + nbytes] = mem[src : src + nbytes].copy()
    done[first:last] = 1
    cfg[CFG_DONE_COUNT] = last - first
    return dst


def _check_slot(coll: CollState, spare: np.ndarray) -> None:
    """What begin_epoch and local_part take on trust of a slot (numba checks no bounds)."""
    cfg = coll.cfg
    if cfg.shape[0] < CFG_LEN or spare.shape[0] < CFG_LEN or coll.f.shape[0] < F_LEN:
        raise ValueError("collective slot rows do not match their layout")
    world, rank, chunks = int(cfg[CFG_WORLD]), int(cfg[CFG_RANK]), int(cfg[CFG_CHUNKS])
    if not 1 <= world <= coll.ring.shape[0] or min(coll.bounds.size, coll.cb.size) < world + 1:
        raise ValueError(f"a slot of {world} members has no room for its ring and plan")
    if not 0 <= rank < world or not 0 <= cfg[CFG_ROOT] < world:
        raise ValueError(f"rank {rank} or root {cfg[CFG_ROOT]} outside {world} members")
    per_chunk = min(coll.acked.size, coll.tries.size, coll.agsent.size, coll.sent.size)
    if not 0 <= chunks <= per_chunk or NZ_BASE + chunks > coll.done.size:
        raise ValueError(f"{chunks} chunks outside the slot's per-chunk tables")
    if not 0 <= cfg[CFG_DTYPE] < ESIZE.shape[0]:
        raise ValueError(f"dtype {cfg[CFG_DTYPE]} unknown")


def set_up_epoch(
    coll: CollState, spare: np.ndarray, epoch: int, rkey: int, txn: int, tag_key: bytes
) -> None:
    """Checked entry to begin_epoch: slot *coll*, its shape words and plan written, starts
    epoch *epoch* under *rkey* and *tag_key* (16 bytes; b"": untagged)."""
    _check_slot(coll, spare)
    k0, k1 = np.frombuffer(tag_key or bytes(16), "<i8")
    begin_epoch(coll, spare, np.int64(epoch), np.int64(rkey), np.int64(txn), k0, k1)


def copy_local_part(coll: CollState, spare: np.ndarray, mem: np.ndarray) -> int:
    """Checked entry to local_part (its input and output inside node memory *mem*): returns
    where the copy went (-1: none)."""
    _check_slot(coll, spare)
    cfg = coll.cfg
    esize, rank = int(ESIZE[cfg[CFG_DTYPE]]), int(cfg[CFG_RANK])
    in_bytes = int(cfg[CFG_COUNT]) * esize
    if cfg[CFG_ALGO] == ALGO_ALL_GATHER:
        in_bytes = int(coll.bounds[rank + 1] - coll.bounds[rank]) * esize
    for addr, nbytes in (
        (int(cfg[CFG_IN]), in_bytes),
        (int(cfg[CFG_OUT]), int(cfg[CFG_COUNT]) * esize),
    ):
        if not 0 <= addr <= mem.size - nbytes:
            raise ValueError(f"buffer at {addr} of {nbytes} bytes outside node memory")
    return int(local_part(coll, mem))


def number_start(spare: np.ndarray, cfg: np.ndarray) -> None:
    """Checked entry to count_start: the start that set slot *cfg* up gets the next number."""
    if min(spare.shape[0], cfg.shape[0]) < CFG_LEN:
        raise ValueError("collective slot rows do not match their layout")
    count_start(spare, cfg)


#: HoldTable.tag of a chain datagram held until its collective starts here (fault injection's
#: holds are tag 0; a node's fault hold table keeps both, netdam.shell.node_process).
HOLD_EARLY = 1
#: How long a chain that reached this node before its host's START_COLL is held (then answered
#: BUSY, as it was at once before): the ranks of a small collective start within ~0.1-0.5 ms of
#: each other, and a held chain must be answered well inside its originator's first RTO
#: (RTO_MIN_S, 20 ms), so it never goes out again while held.
EARLY_HOLD_S = 0.005
#: At most this many early chains held at once per NIC (the rest answered BUSY at once): two
#: credit windows (core.collective.DEFAULT_WINDOW, 32), a late node's predecessor's own chains
#: and those it forwards, and a quarter of a fault hold table (fault injection holds its own
#: datagrams in the same table). At 16, 4 NICs x 1 MiB (the demo) were answered BUSY 64-96
#: times a call and 64 NICs x 1 MiB 330-610 times; at 64, 0-3 and 40-120 (5 and 3 runs), for
#: ~0.2 MiB more resident per NIC (64 NICs: 720 -> 733 MiB in all).
EARLY_SLOTS = 64


@njit(cache=True, nogil=True)
def hold_early_chains(rx, n, area, members, slots, hold, now):
    """Hold aside the CHAIN_ADD datagrams of rx[0:n] that members sent for a collective not
    started here (the chain waits here instead of a NACK BUSY, a RESUME and its re-send: three
    datagrams and two wake-ups on the critical path of a small collective; SPEC.md 4.1,
    "Early chains"), as many as *hold* has room for; the rest go on as before. Then append to
    the batch, copied after its data (at *area* at least), every held chain whose collective
    has started (or moved on) here, and every one held past EARLY_HOLD_S, which the datapath
    answers BUSY as it would have at once. Nothing is checked or executed here: a held
    datagram meets every check of the datapath when it comes back (its tag under the key its
    START_COLL brought). Returns the batch's new count and how many chains stay held."""
    rx_buf, rx_off, rx_len, rx_src = rx
    held_now = early_count(hold)
    m = 0
    end = area
    for i in range(n):
        off, ln, src = rx_off[i], np.int64(rx_len[i]), rx_src[i]
        b = rx_buf[off : off + ln]
        if (
            held_now < EARLY_SLOTS
            and ln >= HDR
            and b[H_OPCODE] == OP_CHAIN_ADD
            and is_member(members, src)
        ):
            coll, epoch = rd32(b, H_COLL_ID), rd32(b, H_EPOCH)
            row = slots.cfg[slot_of(slots, coll)]
            if (
                coll != 0
                and coll_phase(row, coll, epoch) == PHASE_NOT_STARTED
                and hold_datagram(b, ln, src, HOLD_EARLY, now, 0, hold)
            ):
                # Its originator hears RESUME when this node starts, as one refused BUSY does,
                # and restarts the timers of its chains in flight: a chain held at several late
                # hops in turn outlasts its RTO, and was re-sent for nothing (a torus's column
                # steps at 256 NICs, whose members start ~250-470 ms apart; SPEC.md 4.1).
                _note_refusal(row, coll, epoch, reply_dst(b, src, members), False)
                held_now += 1
                continue
        end = max(end, off + ln)
        rx_off[m], rx_len[m], rx_src[m] = off, ln, src
        m += 1
    for h in range(hold.len.shape[0]):
        ln = np.int64(hold.len[h])
        if ln == 0 or hold.tag[h] != HOLD_EARLY:
            continue
        held = hold.buf[h]
        coll, epoch = rd32(held, H_COLL_ID), rd32(held, H_EPOCH)
        waiting = coll_phase(slots.cfg[slot_of(slots, coll)], coll, epoch) == PHASE_NOT_STARTED
        if waiting and now - hold.time[h] <= EARLY_HOLD_S:
            continue
        if not fits_held(rx_buf, end, rx_off, m, ln):
            break  # the next round takes the rest
        m, end = take_held(rx_buf, end, rx_off, rx_len, rx_src, m, hold, h)
        held_now -= 1
    return m, held_now


@njit(cache=True, nogil=True)
def early_count(hold):
    """Chains held until their collective starts here (the NIC's clock runs while any is)."""
    count = 0
    for h in range(hold.len.shape[0]):
        if hold.len[h] != 0 and hold.tag[h] == HOLD_EARLY:
            count += 1
    return count


@njit(cache=True, nogil=True)
def coll_ended(co_cfg, coll, epoch):
    """(coll, epoch) is this node's collective and it has ended (done or failed). Every member
    then holds every chunk and every chain was ACKed (DONE, section 4.1), so a datagram of it is
    a late duplicate: dropped before the rkey check, since the collective's key is gone."""
    return co_cfg[CFG_STATE] >= STATE_DONE and coll_phase(co_cfg, coll, epoch) == PHASE_RUNNING


@njit(cache=True, nogil=True)
def all_write(b, ln, src, node, tx, tx_n):
    """Multicast write: idempotent, so no duplicate window; ACK only when asked. Inside a
    collective (coll_id != 0) it is the all-gather: written once per chunk, and only after the
    host started the collective here (before that the output may still be staged over)."""
    mem, regions, members, window, coll, counters, _trace = node
    co_cfg, co_done, co_acked, cb = coll.cfg, coll.done, coll.acked, coll.cb
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    length = rd32(b, H_LENGTH)
    addr = rd64(b, H_ADDR)
    esize = ESIZE[np.int64(b[H_DTYPE])]
    coll = rd32(b, H_COLL_ID)
    if coll != 0 and coll_phase(co_cfg, coll, rd32(b, H_EPOCH)) == PHASE_NOT_STARTED:
        counters[C.DROP_COLL_EARLY] += 1  # before the rkey check: it may not be registered yet
        if is_member(members, src):
            # Its sender hears RESUME once this node starts, and sends it again then (else READ
            # repair fetches it).
            _note_refusal(co_cfg, coll, rd32(b, H_EPOCH), src)
        return tx_n
    if coll != 0 and coll_ended(co_cfg, coll, rd32(b, H_EPOCH)):
        counters[C.DROP_STALE_EPOCH] += 1
        return tx_n
    status = check_access(
        regions, rd32(b, H_RKEY), addr, length, R_WRITE, esize, is_member(members, src)
    )
    if status != 0:
        return emit_nack(b, src, members, status, tx, tx_n, counters)
    if coll != 0:
        seq = rd32(b, H_SEQ)
        phase = coll_phase(co_cfg, coll, rd32(b, H_EPOCH))
        if phase != PHASE_RUNNING or seq >= co_cfg[CFG_CHUNKS]:
            counters[C.DROP_STALE_EPOCH if phase == PHASE_STALE else C.DROP_COLL_EARLY] += 1
            return tx_n  # an early one is fetched again by READ repair once started
        if co_done[seq] != 0:
            counters[C.DUP_SILENT] += 1
            return tx_n
        co_done[seq] = 1
        co_cfg[CFG_DONE_COUNT] += 1
        ob = co_cfg[CFG_ORIG_BLOCK]
        if _gather_acks(co_cfg) and ob >= 0 and cb[ob] <= seq < cb[ob + 1]:
            _chain_acked(co_cfg, co_acked, seq)  # its owner stored this node's chain
    a = np.int64(addr)
    if rd16(b, H_FLAGS) & F_SPARSE:
        sparse_expand(mem, a, b, np.int64(HDR), np.int64(length), esize)  # the rest zeroed
    else:
        copy_bytes(mem, a, b, HDR, length)
    if rd16(b, H_FLAGS) & F_ACK_REQ:
        return emit_ack(b, src, members, tx, tx_n)
    return tx_n


@njit(cache=True, nogil=True)
def chain_add_hop(b, ln, src, node, tx, tx_n):
    """Combine local memory into the payload; forward to the next segment or, at the last hop,
    store at aux_addr (once per (coll_id, epoch, seq)) and ACK the originator."""
    mem, regions, members, window, slot, counters, _trace = node
    co_cfg, co_done = slot.cfg, slot.done
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    length = rd32(b, H_LENGTH)
    addr = rd64(b, H_ADDR)
    store_addr = rd64(b, H_AUX_ADDR)
    dtype = np.int64(b[H_DTYPE])
    op = np.int64(b[H_REDUCE_OP])
    esize = ESIZE[dtype]
    rkey = rd32(b, H_RKEY)
    left = np.int64(b[H_SEGMENTS_LEFT])
    count = np.int64(b[H_SEG_COUNT])
    coll = rd32(b, H_COLL_ID)
    if coll != 0 and coll_phase(co_cfg, coll, rd32(b, H_EPOCH)) == PHASE_NOT_STARTED:
        # This node's host has not started the collective (nor, maybe, registered its key):
        # BUSY, before the rkey check, so the sender backs off instead of failing; RESUME
        # tells it when to ask again.
        if is_member(members, src):
            _note_refusal(co_cfg, coll, rd32(b, H_EPOCH), reply_dst(b, src, members))
        return emit_nack(b, src, members, S_BUSY, tx, tx_n, counters)
    if coll != 0 and coll_ended(co_cfg, coll, rd32(b, H_EPOCH)):
        counters[C.DROP_STALE_EPOCH] += 1
        return tx_n
    # Read rights at every hop: the partial sum discloses this node's operand to the next hop.
    member = is_member(members, src)
    status = check_access(regions, rkey, addr, length, R_READ, esize, member)
    if status == 0 and left == 0:
        status = check_access(regions, rkey, store_addr, length, R_WRITE, esize, member)
    nxt = np.uint64(0)
    if status == 0 and left > 0:
        o = HDR + SEG * (count - left)
        nxt = np.uint64((rd32(b, o + SEG_IP) << 16) | rd16(b, o + SEG_PORT))
        if not is_member(members, nxt):
            status = S_NOT_MEMBER  # nodes relay only inside their cluster
    seq = rd32(b, H_SEQ)
    guarded = False
    if status == 0 and coll != 0:
        phase = coll_phase(co_cfg, coll, rd32(b, H_EPOCH))
        if phase == PHASE_STALE:
            counters[C.DROP_STALE_EPOCH] += 1
            return tx_n
        if phase == PHASE_NOT_STARTED:
            status = S_BUSY  # this node has not started that collective: retry later
        elif seq >= co_cfg[CFG_CHUNKS]:
            status = S_TOO_LARGE
        else:
            guarded = True
            if left == 0 and co_cfg[CFG_OPT_STEP] != 0:
                status = _fused_chunk_status(slot, seq, store_addr, length)
            elif left > 0:
                slot.f[F_LAST_PASSED] = slot.f[F_NOW]
    if status != 0:
        return emit_nack(b, src, members, status, tx, tx_n, counters)
    payload_off = HDR + SEG * count
    a = np.int64(addr)
    sparse_in = (rd16(b, H_FLAGS) & F_SPARSE) != 0
    sparse_mode = guarded and co_cfg[CFG_SPARSE] != 0
    if left > 0:
        t = tx_buf[tx_off[tx_n] :]
        for k in range(payload_off):
            t[k] = b[k]
        t[H_SEGMENTS_LEFT] = left - 1
        if (rd32(b, H_RET_IP) == 0 and rd16(b, H_RET_PORT) == 0) or not is_member(members, src):
            # First relay of a chain: record the originator so the last hop can ACK it. A
            # return segment written by a non-member is replaced: replies never go to a third party.
            wr32(t, H_RET_IP, np.int64(src >> np.uint64(16)))
            wr16(t, H_RET_PORT, np.int64(src & np.uint64(0xFFFF)))
        nbytes = np.int64(length)
        if sparse_in or sparse_mode:
            # Dense running value in a scratch (the next send slot when free), combined there,
            # then re-encoded into the forwarded packet: sparse when it pays, else dense.
            x = scratch_slot(tx, tx_n)
            if sparse_in:
                sparse_expand(x, np.int64(0), b, np.int64(payload_off), nbytes, esize)
            else:
                copy_bytes(x, 0, b, payload_off, length)
            combine_bytes(x, np.int64(0), x, np.int64(0), mem, a, nbytes, dtype, op)
            nbytes, sparse_out = encode_payload(
                t, np.int64(payload_off), x, np.int64(0), nbytes, esize
            )
            flags = rd16(b, H_FLAGS) & ~F_SPARSE
            wr16(t, H_FLAGS, flags | (F_SPARSE if sparse_out else 0))
        else:
            combine_bytes(
                t, np.int64(payload_off), b, np.int64(payload_off), mem, a, nbytes, dtype, op
            )
        counters[C.BYTES_COMBINED] += length
        counters[C.FORWARDED] += 1
        tx_len[tx_n] = payload_off + nbytes
        tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
        tx_dst[tx_n] = nxt
        return tx_n + 1
    if guarded and co_done[seq] != 0:
        counters[C.CHAIN_REACKS] += 1  # already stored: re-ACK, never add twice
    else:
        # Combine into the free send slot, then store: the store range may overlap the operand
        # (in-place all-reduce), and the combine kernel may not alias its output with `b`.
        s = np.int64(store_addr)
        scratch = tx_buf[tx_off[tx_n] :]
        if sparse_in:
            sparse_expand(scratch, np.int64(HDR), b, np.int64(payload_off), np.int64(length), esize)
            combine_bytes(
                scratch, np.int64(HDR), scratch, np.int64(HDR), mem, a, np.int64(length), dtype, op
            )
        else:
            combine_bytes(
                scratch,
                np.int64(HDR),
                b,
                np.int64(payload_off),
                mem,
                a,
                np.int64(length),
                dtype,
                op,
            )
        if guarded and co_cfg[CFG_OPT_STEP] != 0:
            # Fused reduce and update: the block's owner steps its optimizer with the reduced
            # gradient and stores (and later multicasts) the new weights in its place.
            _, first, n = _chunk(co_cfg, slot.bounds, slot.cb, seq)
            fused_apply(
                mem,
                co_cfg[CFG_OPT_DESC],
                first - slot.bounds[co_cfg[CFG_RANK]],
                n,
                co_cfg[CFG_OPT_STEP],
                scratch,
                np.int64(HDR),
                dtype,
            )
        copy_bytes(mem, s, scratch, HDR, length)
        counters[C.BYTES_COMBINED] += length
        counters[C.STORED] += 1
        if guarded:
            co_done[seq] = 1
            co_cfg[CFG_DONE_COUNT] += 1
    if rd16(b, H_FLAGS) & F_ACK_REQ:
        return emit_ack(b, src, members, tx, tx_n)
    return tx_n


@njit(cache=True, nogil=True)
def _fused_chunk_status(slot, seq, store_addr, length):
    """A fused collective's chain ending here must be chunk *seq* of this node's own block,
    stored where the plan puts it: its store steps the optimizer on exactly those elements,
    so a chain naming any other range is refused (BAD_FIELD), whatever the rights allow."""
    co_cfg = slot.cfg
    j, first, n = _chunk(co_cfg, slot.bounds, slot.cb, seq)
    esize = ESIZE[co_cfg[CFG_DTYPE]]
    if (
        j != co_cfg[CFG_RANK]
        or store_addr != np.uint64(co_cfg[CFG_OUT] + first * esize)
        or length != n * esize
    ):
        return _S_BAD_FIELD
    return 0


@njit(cache=True, nogil=True)
def _coll_done_msg(b, src, co_cfg):
    """A member's DONE: for this epoch, note it; for the previous epoch (that member may have
    lost this node's DONE while this node moved on), ask the engine to repeat it."""
    world = co_cfg[CFG_WORLD]
    rank = rd32(b, H_SEQ)  # DONE carries the sender's rank in seq
    if co_cfg[CFG_STATE] == STATE_IDLE or rank >= world:
        return True
    epoch = rd32(b, H_EPOCH)
    asks = rd32(b, H_TXN_ID) == 0  # txn_id 1 marks an answer, which is never answered
    if epoch == co_cfg[CFG_EPOCH]:
        co_cfg[CFG_PEERS_DONE] |= np.int64(1) << rank
        ready = (co_cfg[CFG_PEERS_DONE] >> co_cfg[CFG_RANK]) & 1
        if asks and (co_cfg[CFG_STATE] != STATE_RUNNING or ready):
            # This node is ready (or finished): answer at once, so a member that started late
            # need not wait a retransmission timeout for the DONE it missed.
            co_cfg[CFG_CUR_ASK] |= np.int64(1) << rank
    elif asks and ((co_cfg[CFG_EPOCH] - epoch) & 0xFFFFFFFF) == 1:
        co_cfg[CFG_PREV_ASK] |= np.int64(1) << rank
    return True


@njit(cache=True, nogil=True)
def _resume_asks_done(b, co_cfg):
    """A member's RESUME of this node's collective and epoch: it started after this node's
    datagrams reached it and dropped them as early, this node's DONE among them if this node
    was ready by then. So a ready (or finished) node answers it with its DONE at the next
    tick, as it answers a DONE question, where the member would otherwise ask only after its
    RTO (which covers turns of its process: a host stall had raised it past the watchdog)."""
    rank = rd32(b, H_SEQ)
    if (
        rd32(b, H_COLL_ID) != co_cfg[CFG_COLL]
        or rd32(b, H_EPOCH) != co_cfg[CFG_EPOCH]
        or rank >= co_cfg[CFG_WORLD]
    ):
        return
    state = co_cfg[CFG_STATE]
    ready = (co_cfg[CFG_PEERS_DONE] >> co_cfg[CFG_RANK]) & 1
    if state == STATE_DONE or (state == STATE_RUNNING and ready):
        co_cfg[CFG_CUR_ASK] |= np.int64(1) << rank


@njit(cache=True, nogil=True)
def _coll_bitmap_msg(b, ln, co_cfg, co_done, counters):
    """A member's per-chunk non-zero bitmap (sparse mode, SPEC.md 4.1): OR it in once; a request
    (txn_id 0) is answered with ours by the next tick, an answer (txn_id 1) proves the member
    holds ours. Dropped unless this node runs that very collective and epoch."""
    rank = rd32(b, H_SEQ)
    nbytes = rd32(b, H_LENGTH)
    chunks = co_cfg[CFG_CHUNKS]
    if (
        co_cfg[CFG_STATE] != STATE_RUNNING
        or co_cfg[CFG_SPARSE] == 0
        or rd32(b, H_COLL_ID) != co_cfg[CFG_COLL]
        or rd32(b, H_EPOCH) != co_cfg[CFG_EPOCH]
        or rank >= co_cfg[CFG_WORLD]
        or nbytes != (chunks + 7) // 8
    ):
        counters[C.DROP_COLL_EARLY] += 1
        return
    bit = np.int64(1) << rank
    if co_cfg[CFG_BM_GOT] & bit == 0:
        for c in range(chunks):
            if (b[HDR + (c >> 3)] >> (c & 7)) & 1:
                co_done[NZ_BASE + c] = 1
        co_cfg[CFG_BM_GOT] |= bit
    if rd32(b, H_TXN_ID) == 1:
        co_cfg[CFG_BM_HAS] |= bit
    else:
        co_cfg[CFG_BM_ASK] |= bit


@njit(cache=True, nogil=True)
def coll_reply(b, ln, src, op, node):
    """Replies of the running collective, handled here so no reply costs Python: chain ACKs
    free the originator's window, NACKs BUSY are retried by the timer (others fail the
    collective), READ_RESPs of repair READs fill the missing chunk. False: not ours, punt."""
    mem, regions, members, window, coll, counters, _trace = node
    co_cfg, co_done, co_acked = coll.cfg, coll.done, coll.acked
    if not is_member(members, src):
        return False
    if (
        op == OP_ACK
        and (rd64(b, H_AUX_ADDR) == AUX_STARTED or rd64(b, H_AUX_ADDR) == AUX_DONE)
        and coll_phase(co_cfg, rd32(b, H_COLL_ID), rd32(b, H_EPOCH)) == PHASE_NOT_STARTED
    ):
        # A member started (or, ready at once, finished its part of) a collective this node
        # has not: remembered as an early chunk's sender is, before any key check (the key is
        # not known here yet), and RESUMEd when this node starts. A STARTED then counts; a
        # DONE is dropped, and the RESUME asks for it again (_resume_asks_done). A forged one
        # only costs a RESUME to a member's address, or lets this node spread before that
        # member started, which then drops it and RESUMEs: the path without STARTEDs.
        # A DONE never displaces another collective's refused originators: without the
        # RESUME, this member asks for it after its RTO, as before.
        done = rd64(b, H_AUX_ADDR) == AUX_DONE
        if done:
            counters[C.DROP_COLL_EARLY] += 1
        _note_refusal(co_cfg, rd32(b, H_COLL_ID), rd32(b, H_EPOCH), src, not done)
        return True
    if rd32(b, H_COLL_ID) == co_cfg[CFG_COLL] and co_cfg[CFG_STATE] != STATE_IDLE:
        # Replies and DONEs of this collective carry its key (chain ACKs and NACKs echo the
        # CHAIN_ADD's; DONE, RESUME and bitmaps are sent under it): a datagram forged with a
        # member's source but without the key aborts, completes or fills nothing.
        epoch = rd32(b, H_EPOCH)
        key = co_cfg[CFG_RKEY] if epoch == co_cfg[CFG_EPOCH] else co_cfg[CFG_PREV_RKEY]
        if rd32(b, H_RKEY) != key:
            counters[C.DROP_COLL_FORGED] += 1
            return True
    if op == OP_ACK and rd64(b, H_AUX_ADDR) == AUX_DONE and rd32(b, H_COLL_ID) == co_cfg[CFG_COLL]:
        return _coll_done_msg(b, src, co_cfg)
    if op == OP_ACK and rd64(b, H_AUX_ADDR) == AUX_BITMAP:
        _coll_bitmap_msg(b, ln, co_cfg, co_done, counters)
        return True
    if op == OP_ACK and rd64(b, H_AUX_ADDR) == AUX_RESUME:
        _resume_asks_done(b, co_cfg)
    if (
        co_cfg[CFG_STATE] != STATE_RUNNING
        or coll_phase(co_cfg, rd32(b, H_COLL_ID), rd32(b, H_EPOCH)) != PHASE_RUNNING
    ):
        # RESUME or STARTED of another collective or epoch: consumed
        return op == OP_ACK and (
            rd64(b, H_AUX_ADDR) == AUX_RESUME or rd64(b, H_AUX_ADDR) == AUX_STARTED
        )
    if op == OP_ACK and rd64(b, H_AUX_ADDR) == AUX_STARTED:
        rank = rd32(b, H_SEQ)
        if rank < co_cfg[CFG_WORLD]:
            co_cfg[CFG_STARTED] |= np.int64(1) << rank
            if rd32(b, H_TXN_ID) == 0:  # it lacks ours: the next tick answers
                co_cfg[CFG_STARTED_ASK] |= np.int64(1) << rank
        return True
    if op == OP_ACK and rd64(b, H_AUX_ADDR) == AUX_RESUME:
        # A hop that answered BUSY has started: the chains waiting on it go again at the next
        # tick instead of after their backoff.
        # Those in flight were held at that hop until it started (an early chain): their
        # timers start again from the last tick, so one held at several late hops in turn is
        # not taken for lost while the hops it waits at keep starting.
        for c in range(co_cfg[CFG_LOW_UNACKED], co_cfg[CFG_NEXT_SEND]):
            if co_acked[c] == 2:
                coll.sent[c] = -1.0
            elif co_acked[c] == 0:
                coll.sent[c] = max(coll.sent[c], coll.f[F_NOW])
        # A member that dropped this node's all-gather as early gets what was spread so far
        # again (the tick sends it, from the block's first chunk).
        rank = rd32(b, H_SEQ)
        if rank < co_cfg[CFG_WORLD]:
            co_cfg[CFG_STARTED] |= np.int64(1) << rank  # a RESUME says it started, too
        own = co_cfg[CFG_OWN_BLOCK]
        if own >= 0 and rank < co_cfg[CFG_WORLD] and _spread_any(co_cfg, coll.cb, own, coll.agsent):
            co_cfg[CFG_AG_RESEND] |= np.int64(1) << rank
            co_cfg[CFG_AG_RESEND_NEXT] = coll.cb[own]
        return True
    seq = rd32(b, H_SEQ)
    if seq >= co_cfg[CFG_CHUNKS]:
        return False
    if op == OP_ACK:
        _chain_acked(co_cfg, co_acked, seq)
        return True
    if op == OP_NACK:
        status = np.int64(b[H_STATUS])
        if co_acked[seq] == 1:
            return True  # a late answer to a chain already ACKed (a spurious resend): nothing to do
        if status == S_BUSY:
            if co_acked[seq] == 0 or co_acked[seq] == ACKED_PROBE:
                co_acked[seq] = 2  # a hop has not started yet: flow control, not loss
        elif co_cfg[CFG_FATAL] == 0:
            co_cfg[CFG_FATAL] = status
        return True
    if op == OP_READ_RESP:
        length = rd32(b, H_LENGTH)
        addr = rd64(b, H_ADDR)
        esize = ESIZE[np.int64(b[H_DTYPE])]
        # The answer lands in this node's memory: this node's rights on that range apply.
        if check_access(regions, rd32(b, H_RKEY), addr, length, R_WRITE, esize, True) != 0:
            return True
        if co_done[seq] == 0:
            a = np.int64(addr)
            copy_bytes(mem, a, b, HDR, length)
            co_done[seq] = 1
            co_cfg[CFG_DONE_COUNT] += 1
        return True
    return False
