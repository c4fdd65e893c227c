"""The node's fast path: one numba call validates and executes a whole batch of datagrams.

It dispatches: packet bytes, checks, access rules and ACK/NACK emitters are in ``wire.py``, the
collective's per-packet code in ``collective.py``; READ, WRITE, ADD and the atomics (with the
duplicate window) are executed here.

Rules of this file:
1. The checks in ``wire.check_packet`` mirror ``netdam.protocol.packet.decode_packet`` step for step
   and in the same order, so both give the same status for the same bytes (tests/kernels/test_datapath.py
   holds them to it on random and mutated packets).
2. Nothing here validates its *arguments*: ``netdam.core.node.NodeCore`` owns the arrays, sizes them
   and checks them once. Packet contents are untrusted and every address is checked against the
   rkey's region (which registration checked against memory) before any access.
3. Control opcodes and replies addressed to this node are *punted*: their batch index goes to
   ``punt`` and the control plane handles them in Python. They are rare by design.
4. Sparse payloads (SPEC.md 2.5) of CHAIN_ADD, ALL_WRITE and WRITE are validated (as
   ``check_sparse_payload``) and executed here: decoded to dense (missing elements all-zero
   bits), so every result is bitwise the dense one. A chain hop re-encodes after its combine.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels import optim
from netdam.kernels import signatures as S
from netdam.kernels.borrow import borrowed
from netdam.kernels.collective import (
    CFG_CHUNKS,
    all_write,
    chain_add_hop,
    coll_ended,
    coll_phase,
    coll_reply,
    for_collective,
    needs_tag,
    open_tagged,
    slot_of,
)
from netdam.kernels.combine import combine_bytes
from netdam.kernels.fault_hash import mix64
from netdam.kernels.guard import (
    G_FACTOR,
    G_LOCKOUT,
    G_NOW,
    account,
    check_guard,
    is_locked_out,
    is_validated,
)
from netdam.kernels.restart import NOT_TAKEN, restart_collective
from netdam.kernels.state import DupWindow, Guard, NodeState, RxBatch, TxQueue
from netdam.kernels.tag import (
    CONTROL_TAG_NO_KEY,
    CONTROL_TAG_OK,
    F_TAGGED,
    REGION_TAG_NO_REGION,
    REGION_TAG_OK,
    TAG,
    is_control_op,
    open_control_tagged,
    open_region_tagged,
    region_key,
    seal_replies,
    tag_trailer,
    tagged_length,
)
from netdam.kernels.wire import (
    DROP_SILENTLY,
    ESIZE,
    F_ACK_REQ,
    F_SPARSE,
    HDR,
    IS_REPLY,
    OP_ACK,
    OP_ADD,
    OP_ALL_WRITE,
    OP_CHAIN_ADD,
    OP_FETCH_ADD,
    OP_READ,
    OP_READ_RESP,
    OP_START_COLL,
    OP_UPDATE,
    OP_WRITE,
    PHASE_NOT_STARTED,
    PHASE_STALE,
    PUNT,
    PUNTED_OPS,
    R_ATOMIC,
    R_READ,
    R_WRITE,
    S_BAD_RKEY,
    S_BUSY,
    S_STALE,
    S_TOO_LARGE,
    S_UNAUTHORIZED,
    W,
    check_access,
    check_packet,
    check_send_queue,
    copy_bytes,
    credit_of,
    emit_nack,
    is_member,
    le64,
    put_le64,
    rd16,
    rd32,
    rd64,
    reply_dst,
    reply_header,
    slot_payload,
    sparse_expand,
)
from netdam.protocol import counters as C
from netdam.protocol.layout import (
    CAS_COMPARE,
    CAS_SWAP,
    FA_ADDEND,
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
    H_RKEY,
    H_SEQ,
    H_TXN_ID,
)

# Duplicate-window verdicts.
_WIN_NEW, _WIN_DUP, _WIN_STALE, _WIN_OFF, _WIN_BUSY = 0, 1, 2, 3, 4
WIN_NEW, WIN_DUP, WIN_STALE, WIN_OFF, WIN_BUSY = _WIN_NEW, _WIN_DUP, _WIN_STALE, _WIN_OFF, _WIN_BUSY


#: Ways of the set-associative client table: clients whose keys share a set evict each other
#: only when more than this many retry at once (a direct-mapped table evicted on any collision,
#: and a hashed client id collides mod 256 for 8 clients about one time in ten).
_WAYS = 4
#: Microseconds a client's entry is kept from clients of other rkeys after its last request:
#: longer than any retry schedule of the shipped clients (20 x 50 ms, SPEC.md 7).
_HOLD_US = 2_000_000


@njit(cache=True, nogil=True)
def _requester_key(client, requester, rkey):
    """Window key of a request: the client id bound to where its reply goes (the return segment
    from a member, else the UDP source) and to the rkey that authorised it. Nobody can replay
    into or poison another client's history: without the victim's rkey a forged datagram lands
    in an entry of its own, and with the victim's address but not its reply the cached answer
    goes to the victim."""
    k = mix64(
        np.uint64(client)
        ^ mix64(np.uint64(requester) ^ mix64(np.uint64(rkey) ^ np.uint64(0x5851F42D4C957F2D)))
    )
    if k == 0:
        k = np.uint64(1)
    return k


@njit(cache=True, nogil=True)
def _window_check(window, client, requester, rkey, txn, stamp):
    """At-most-once window (SPEC.md "Memory semantics"): NEW, DUP, STALE or BUSY for (client,
    requester, rkey, txn); *stamp* is the time in microseconds (> 0).

    Slots are set-associative (_WAYS per set). A new client takes, in this order: a free way;
    the least recently used way idle for _HOLD_US; the least recently used way of its own rkey.
    Else BUSY (nothing executes; the client asks again): an entry its client may still retry
    into is never taken by a client of another rkey. Client id 0 opts out (every request
    executes).
    """
    cl_id, cl_key, cl_hi, cl_used, w_txn, w_state = (
        window.cl_id,
        window.cl_key,
        window.cl_hi,
        window.cl_used,
        window.txn,
        window.state,
    )
    if client == 0:
        return _WIN_OFF, 0, 0
    key = _requester_key(client, requester, rkey)
    first = np.int64(key % np.uint64(cl_id.shape[0] // _WAYS)) * _WAYS
    c = -1
    for j in range(first, first + _WAYS):
        if cl_used[j] != 0 and cl_id[j] == key:
            c = j
            break
    w = txn % W
    if c < 0:
        free, own, idle = -1, -1, -1
        for j in range(first, first + _WAYS):
            if cl_used[j] == 0:
                if free < 0:
                    free = j
            elif cl_key[j] == rkey:
                if own < 0 or cl_used[j] < cl_used[own]:
                    own = j
            elif stamp - cl_used[j] >= _HOLD_US and (idle < 0 or cl_used[j] < cl_used[idle]):
                idle = j
        if free >= 0:
            c = free
        elif idle >= 0:
            c = idle
        elif own >= 0:
            c = own
        else:
            return _WIN_BUSY, 0, 0
        cl_used[c] = stamp
        cl_id[c] = key
        cl_key[c] = rkey
        cl_hi[c] = txn
        w_state[c, :] = 0
        return _WIN_NEW, c, w
    cl_used[c] = stamp
    hi = np.int64(cl_hi[c])
    # Serial-number arithmetic (RFC 1982) on u32 transaction ids: behind by `back`.
    back = (hi - txn) & 0xFFFFFFFF
    if back < 0x80000000:
        if back >= W:
            return _WIN_STALE, c, w
        if w_state[c, w] != 0 and w_txn[c, w] == txn:
            return _WIN_DUP, c, w
        return _WIN_NEW, c, w
    ahead = (txn - hi) & 0xFFFFFFFF
    if ahead >= W:
        w_state[c, :] = 0
    else:
        for j in range(1, ahead + 1):
            w_state[c, (hi + j) % W] = 0
    cl_hi[c] = txn
    return _WIN_NEW, c, w


@njit(cache=True, nogil=True)
def _window_record(w_txn, w_state, w_len, w_reply, c, w, txn, reply, reply_len):
    """Remember that (client slot c, txn) executed and what it answered (reply_len 0: nothing)."""
    w_txn[c, w] = txn
    w_state[c, w] = 1
    w_len[c, w] = reply_len
    for k in range(reply_len):
        w_reply[c, w, k] = reply[k]


def process_batch(
    rx: RxBatch,
    n: int,
    max_len: int,
    node: NodeState,
    guard: Guard,
    tx: TxQueue,
    tx_n: int,
    punt: np.ndarray,
) -> tuple[int, int]:
    """Checked entry to the datapath (numba checks no bounds): execute rx[0:n] against *node*,
    append answers to *tx* from *tx_n*; returns (tx_n, n_punt), punted indices in *punt*."""
    if not 0 <= n <= min(rx.off.shape[0], rx.len.shape[0], rx.src.shape[0], punt.shape[0]):
        raise ValueError(f"batch of {n} does not fit its arrays")
    check_send_queue(tx, tx_n)
    if node.mem.dtype != np.uint8 or node.counters.shape[0] < C.NUM_COUNTERS:
        raise ValueError("node state: memory must be uint8 and counters full size")
    check_guard(guard)
    tx_n, n_punt = process_batch_kernel(rx, n, max_len, node, guard, tx, tx_n, punt)
    return int(tx_n), int(n_punt)


@njit(cache=True, nogil=True)
def process_batch_kernel(rx, n, max_len, node, guard, tx, tx_n, punt):
    """Execute datagrams rx_buf[rx_off[i] : rx_off[i] + rx_len[i]] for i < n; append replies and
    forwards to the send queue from tx_n (packet k at tx_buf[tx_off[k] : tx_off[k] + tx_len[k]],
    packed back to back so runs to one destination can leave as one GSO send; tx_off[tx_n] is
    the next free byte). Returns (tx_n, n_punt)."""
    # Borrowed for the call (netdam.kernels.borrow): no atomic reference counts below.
    rx, node, guard, tx, punt = (
        borrowed(rx),
        borrowed(node),
        borrowed(guard),
        borrowed(tx),
        borrowed(punt),
    )
    rx_buf, rx_off, rx_len, rx_src = rx
    members, counters = node.members, node.counters
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    max_pay = slot_payload(tx_slot)
    n_punt = 0
    cap = tx_len.shape[0]
    # The guard's verdict on the last source seen (GRO runs come from one source): a source that
    # was not locked stays unlocked within a batch (one clock reading) unless it fails a key.
    open_src, open_guarded = np.uint64(0), False
    # The duplicate window's clock, microseconds (never 0: 0 marks a free slot).
    stamp = np.int64(guard.cfg[G_NOW] * 1e6) + 1
    for i in range(n):
        ln = np.int64(rx_len[i])
        off = rx_off[i]
        src = rx_src[i]
        counters[C.RX_PACKETS] += 1
        counters[C.RX_BYTES] += ln
        if off < 0 or off + ln > rx_buf.shape[0] or ln > max_len:
            counters[C.DROP_OVERSIZE] += 1  # over the MTU, or truncated by the receive buffer
            continue
        b = rx_buf[off : off + ln]
        if tx_n >= cap or tx_off[tx_n] + tx_slot > tx_buf.shape[0]:
            counters[C.DROP_TX_FULL] += 1
            continue
        guarded = False
        # A locked-out source's TAGGED datagram is taken when its tag verifies (SPEC.md 12.3):
        # a tag proves its sender holds the key, so a guesser sharing the address (or forging
        # it) cannot lock that sender out.
        locked_tagged = False
        if guard.cfg[G_LOCKOUT] != 0.0:
            if src == open_src:
                guarded = open_guarded  # as the last datagram of this source in the batch
            else:
                guarded = not is_member(members, src)
                if guarded and is_locked_out(guard, src):
                    if ln < HDR or (rd16(b, H_FLAGS) & F_TAGGED) == 0:
                        counters[C.DROP_LOCKOUT] += 1  # a right key too: the source is locked out
                        continue
                    locked_tagged = True
                else:
                    open_src, open_guarded = src, guarded
        first = tx_n
        # Datagrams of a tagged collective or a tagged region carry tags (SPEC.md 2.6): checked,
        # and the trailer cut off, before anything else reads the datagram; what it brings back
        # is sealed under the same key below.
        sealed, k0, k1 = 0, np.uint64(0), np.uint64(0)
        tagged = tagged_length(b, ln)
        if tagged < 0:
            counters[C.DROP_TRUNCATED] += 1
            continue
        flags_in, tag_in = 0, np.uint64(0)
        if tagged < ln:
            if is_control_op(np.int64(b[H_OPCODE])):
                # A control tag proves the admin tag key (SPEC.md 2.6, "Control tags"): punted,
                # where the control plane checks it again and seals what it answers.
                sealed, k0, k1 = open_control_tagged(guard.key, b, ln, counters)
            elif rd32(b, H_COLL_ID) == 0:
                sealed, k0, k1 = open_region_tagged(node.regions, b, ln, counters)
            else:
                coll_cfg = node.coll.cfg[slot_of(node.coll, rd32(b, H_COLL_ID))]
                sealed, k0, k1 = open_tagged(coll_cfg, b, ln, counters)
            if sealed == 0:
                continue
            flags_in, tag_in = rd16(b, H_FLAGS), tag_trailer(b, ln)
            ln = tagged
            b = b[:ln]
        elif ln >= HDR and is_member(members, src) and needs_tag(node.coll, b):
            # From a member's address but untagged: forged (a non-member's is refused by the
            # members-only checks further on, with its NACK, as in v1).
            counters[C.DROP_COLL_FORGED] += 1
            continue
        if locked_tagged and sealed != REGION_TAG_OK:
            counters[C.DROP_LOCKOUT] += 1  # a tag that proves nothing: the lockout holds
            continue
        status = check_packet(b, ln, max_pay)
        op = np.int64(b[H_OPCODE]) if ln > 1 else 0
        if status == DROP_SILENTLY:
            counters[C.DROP_TRUNCATED] += 1
            continue
        if sealed == CONTROL_TAG_NO_KEY:
            # A control tag where no admin tag key is set: it proves nothing.
            if status == 0 or status == PUNT:
                status = S_UNAUTHORIZED
        elif sealed == REGION_TAG_NO_REGION:
            # TAGGED under no tagged region's rkey: a wrong key, never executed nor punted.
            if status == 0 or status == PUNT:
                status = S_BAD_RKEY
        elif status == 0 and sealed == 0 and IS_REPLY[op] == 0 and PUNTED_OPS[op] == 0:
            rk0, rk1 = region_key(node.regions, rd32(b, H_RKEY))
            if rk0 | rk1:
                status = S_BAD_RKEY  # a tagged region takes nothing without its tag
        if status == 0 and IS_REPLY[op] == 1 and rd32(b, H_COLL_ID) != 0:
            counters[C.OPCODE_BASE + op] += 1
            if coll_reply(b, ln, src, op, for_collective(node, rd32(b, H_COLL_ID))):
                continue  # consumed by the collective engine, in the datapath
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if status == PUNT or (status == 0 and PUNTED_OPS[op] == 1):
            if status == 0:
                counters[C.OPCODE_BASE + op] += 1
                if op == OP_START_COLL and sealed == CONTROL_TAG_OK:
                    # A collective's next epoch starts here, without the control plane.
                    started = restart_collective(b, ln, src, node, tx, tx_n, tag_in)
                    if started != NOT_TAKEN:
                        tx_n = started
                        continue
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if status != 0:
            if op < 64 and IS_REPLY[op] == 1:
                counters[C.DROP_BAD_REPLY] += 1  # never answer a reply: no NACK storms
                continue
            tx_n = emit_nack(b, src, members, status, tx, tx_n, counters)
        else:
            counters[C.OPCODE_BASE + op] += 1
            if op == OP_CHAIN_ADD:
                tx_n = chain_add_hop(b, ln, src, for_collective(node, rd32(b, H_COLL_ID)), tx, tx_n)
            elif op == OP_READ:
                # A sealed answer carries its tag too: it must fit the MTU with it.
                tx_n = _read(
                    b,
                    src,
                    for_collective(node, rd32(b, H_COLL_ID)),
                    guard,
                    tx,
                    tx_n,
                    max_len - TAG if sealed == 1 else max_len,
                )
            elif op == OP_ALL_WRITE:
                tx_n = all_write(b, ln, src, for_collective(node, rd32(b, H_COLL_ID)), tx, tx_n)
            else:
                tx_n = _mutate(b, ln, src, op, node, tx, tx_n, stamp)
        if sealed == 1 and not seal_replies(
            tx_buf, tx_off, tx_len, first, tx_n, k0, k1, flags_in, tag_in
        ):
            counters[C.DROP_TX_FULL] += tx_n - first
            tx_n = first
        if guarded and tx_n > first:
            # Failed authentications are the NACKs BAD_RKEY/UNAUTHORIZED just queued for src;
            # one may have locked it out, so its next datagram is looked up again.
            if account(guard, src, tx_buf, tx_off, tx_dst, first, tx_n, counters) > 0:
                open_src = np.uint64(0)
    return tx_n, n_punt


@njit(cache=True, nogil=True)
def _read(b, src, node, guard, tx, tx_n, max_len):
    """READ; a collective's repair READ (coll_id != 0) is served only once the chunk is final.
    A READ whose reply would not fit this node's MTU (*max_len*) is TOO_LARGE: the kernel would
    refuse to send it (EMSGSIZE) and the client would only see a timeout."""
    mem, regions, members, window, coll, counters, _trace = node
    co_cfg, co_done, _co_acked = coll.cfg, coll.done, coll.acked
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    length = rd32(b, H_LENGTH)
    if HDR + length > max_len:
        return emit_nack(b, src, members, S_TOO_LARGE, tx, tx_n, counters)
    factor = guard.cfg[G_FACTOR]
    if factor > 0.0 and HDR + length > factor * HDR and not is_member(members, src):
        # More than 3x the request back to an address that has not proven it receives there
        # (no token in aux_addr): a reflection amplifier. Dropped, before any other check.
        if not is_validated(guard, src, rd64(b, H_AUX_ADDR)):
            counters[C.DROP_AMPLIFICATION] += 1
            return tx_n
    addr = rd64(b, H_ADDR)
    esize = ESIZE[np.int64(b[H_DTYPE])]
    coll = rd32(b, H_COLL_ID)
    if coll != 0 and coll_phase(co_cfg, coll, rd32(b, H_EPOCH)) == PHASE_NOT_STARTED:
        # Before the rkey check: the host may not have registered the group's key here yet.
        return emit_nack(b, src, members, S_BUSY, tx, tx_n, counters)
    if coll != 0 and coll_ended(co_cfg, coll, rd32(b, H_EPOCH)):
        counters[C.DROP_STALE_EPOCH] += 1
        return tx_n
    status = check_access(
        regions, rd32(b, H_RKEY), addr, length, R_READ, esize, is_member(members, src)
    )
    if status == 0 and coll != 0:
        seq = rd32(b, H_SEQ)
        phase = coll_phase(co_cfg, coll, rd32(b, H_EPOCH))
        if phase == PHASE_STALE:
            counters[C.DROP_STALE_EPOCH] += 1
            return tx_n
        if phase == PHASE_NOT_STARTED or seq >= co_cfg[CFG_CHUNKS] or co_done[seq] == 0:
            status = S_BUSY  # not reduced here yet: the reader asks again later
    if status != 0:
        return emit_nack(b, src, members, status, tx, tx_n, counters)
    t = tx_buf[tx_off[tx_n] :]
    reply_header(t, b, OP_READ_RESP, 0, length, credit_of(tx_n, tx_len.shape[0]))
    a = np.int64(addr)
    copy_bytes(t, HDR, mem, a, length)
    tx_len[tx_n] = HDR + length
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = reply_dst(b, src, members)
    return tx_n + 1


@njit(cache=True, nogil=True)
def _mutate(b, ln, src, op, node, tx, tx_n, stamp):
    """WRITE, ADD, FETCH_ADD, CAS, UPDATE: at most once per (client id, reply address, rkey,
    txn id); *stamp* is the batch's time in microseconds (the window's clock). An UPDATE is
    also applied at most once per step and chunk, whatever its txn id (optim.update_check)."""
    mem, regions, members, window, coll, counters, _trace = node
    w_txn, w_state, w_len, w_reply = window.txn, window.state, window.len, window.reply
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    length = rd32(b, H_LENGTH)
    addr = rd64(b, H_ADDR)
    dtype = np.int64(b[H_DTYPE])
    verdict_step = optim.APPLY
    if op == OP_UPDATE:
        status, verdict_step = optim.update_check(mem, regions, b, is_member(members, src))
    else:
        if op == OP_WRITE or op == OP_ADD:
            need, align = R_WRITE, ESIZE[dtype]
        else:
            need, align = R_ATOMIC, 8
        status = check_access(
            regions, rd32(b, H_RKEY), addr, length, need, align, is_member(members, src)
        )
    if status != 0:
        return emit_nack(b, src, members, status, tx, tx_n, counters)
    client = rd32(b, H_CLIENT_ID)
    txn = rd32(b, H_TXN_ID)
    dst = reply_dst(b, src, members)
    verdict, c, w = _window_check(window, client, dst, rd32(b, H_RKEY), txn, stamp)
    if verdict == _WIN_STALE:
        return emit_nack(b, src, members, S_STALE, tx, tx_n, counters)
    if verdict == _WIN_BUSY:
        return emit_nack(b, src, members, S_BUSY, tx, tx_n, counters)
    if verdict == _WIN_DUP:
        reply_len = np.int64(w_len[c, w])
        if reply_len == 0:
            counters[C.DUP_SILENT] += 1
            return tx_n
        counters[C.DUP_REPLAYS] += 1
        t = tx_buf[tx_off[tx_n] :]
        copy_bytes(t, 0, w_reply[c, w], 0, reply_len)
        tx_len[tx_n] = reply_len
        tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
        tx_dst[tx_n] = dst
        return tx_n + 1
    a = np.int64(addr)
    t = tx_buf[tx_off[tx_n] :]
    reply_len = 0
    if op == OP_WRITE or op == OP_ADD:
        if op == OP_WRITE:
            if rd16(b, H_FLAGS) & F_SPARSE:
                sparse_expand(mem, a, b, np.int64(HDR), np.int64(length), ESIZE[dtype])
            else:
                copy_bytes(mem, a, b, HDR, length)
        else:
            combine_bytes(
                mem, a, mem, a, b, np.int64(HDR), np.int64(length), dtype, np.int64(b[H_REDUCE_OP])
            )
            counters[C.BYTES_COMBINED] += length
        if rd16(b, H_FLAGS) & F_ACK_REQ:
            reply_header(t, b, OP_ACK, 0, 0, credit_of(tx_n, tx_len.shape[0]))
            reply_len = HDR
    elif op == OP_UPDATE:
        if verdict_step == optim.APPLY:
            optim.update_apply(mem, b)
        else:
            counters[C.DUP_REPLAYS] += 1  # the chunk is at this step already: answered only
        reply_header(t, b, OP_ACK, 0, 0, credit_of(tx_n, tx_len.shape[0]))
        reply_len = HDR  # every UPDATE is answered, as an atomic is
    else:
        old = le64(mem, a)
        if op == OP_FETCH_ADD:
            put_le64(
                mem, a, old + le64(b, HDR + FA_ADDEND)
            )  # u64 wraps, as the hardware adder would
        elif old == le64(b, HDR + CAS_COMPARE):
            put_le64(mem, a, le64(b, HDR + CAS_SWAP))
        reply_header(t, b, OP_ACK, 0, 8, credit_of(tx_n, tx_len.shape[0]))
        put_le64(t, HDR + FA_ADDEND, old)  # the old value, where FETCH_ADD's addend was
        reply_len = HDR + 8
    if verdict == _WIN_NEW:
        _window_record(w_txn, w_state, w_len, w_reply, c, w, txn, t, reply_len)
    if reply_len == 0:
        return tx_n
    tx_len[tx_n] = reply_len
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = dst
    return tx_n + 1


@njit(cache=True, nogil=True)
def _drain(tx_buf, tx_off, tx_len, tx_dst, start, count, out_buf, out_off, out_len, out_dst):
    """Copy queued datagrams start.. into the caller's batch, back to back, while they fit.
    Returns how many were copied."""
    pos = 0
    limit = min(count, out_len.shape[0])
    for k in range(limit):
        ln = tx_len[start + k]
        if pos + ln > out_buf.shape[0]:
            return k
        src = tx_off[start + k]
        copy_bytes(out_buf, pos, tx_buf, src, ln)
        out_off[k] = pos
        out_len[k] = ln
        out_dst[k] = tx_dst[start + k]
        pos += ln
    return limit


def drain(tx: TxQueue, start: int, count: int, out: TxQueue) -> int:
    """Copy queued datagrams [start, start + count) into *out*'s arrays, as many as fit; returns how many."""
    if not 0 <= start <= start + count <= tx.len.shape[0]:
        raise ValueError(
            f"drain [{start}, {start + count}) outside the queue's {tx.len.shape[0]} slots"
        )
    return int(
        _drain(tx.buf, tx.off, tx.len, tx.dst, start, count, out.buf, out.off, out.len, out.dst)
    )


def window_check(
    window: DupWindow, client: int, requester: int, rkey: int, txn: int, stamp: int
) -> tuple[int, int, int]:
    """The duplicate window's verdict for (client, requester, rkey, txn) at *stamp* (us, > 0):
    (WIN_NEW | WIN_DUP | WIN_STALE | WIN_OFF | WIN_BUSY, client slot, window slot)."""
    if stamp <= 0:
        raise ValueError(f"window stamp {stamp} must be > 0 (0 marks a free slot)")
    # Plain ints whatever the caller holds (a numpy u64 source, a Python int): one specialization,
    # compiled before the node says it is ready (netdam.core.rehearsal), never a new one later.
    verdict, c, w = _window_check(
        window, int(client), int(requester), int(rkey), int(txn), int(stamp)
    )
    return int(verdict), int(c), int(w)


def window_record(window: DupWindow, c: int, w: int, txn: int, reply: np.ndarray) -> None:
    """Remember *reply* for (client slot c, window slot w) so a retry gets it again."""
    if not (0 <= c < window.txn.shape[0] and 0 <= w < window.txn.shape[1]):
        raise ValueError(f"window slot ({c}, {w}) outside the window")
    if reply.shape[0] > window.reply.shape[2]:
        raise ValueError(f"reply of {reply.shape[0]} bytes longer than the window keeps")
    _window_record(
        window.txn,
        window.state,
        window.len,
        window.reply,
        int(c),
        int(w),
        int(txn),
        reply,
        reply.shape[0],
    )


# The explicit signature (kernels/signatures.py), compiled (or loaded from the cache) here, at
# the end of the module where every kernel it calls exists; no other signature compiles.
process_batch_kernel.compile(S.PROCESS_BATCH)
process_batch_kernel.disable_compile()
