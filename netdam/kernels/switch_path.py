"""The switch's fast path: one numba call translates, rewrites and replicates a batch.

Per datagram (protocol/SPEC.md 11.3 is the contract):

1. ``datapath.check_packet`` (the node's structural checks, same order, same statuses);
2. replies, control opcodes and PING are *punted* to ``SwitchCore`` (Python);
3. ALL_WRITE with flag MCAST is replicated to the members of the group named by ``aux_addr``
   (``ip << 16 | port``, as JOIN names groups); ``addr`` and ``rkey`` stay node-local;
4. every other data opcode is a pool request: the global ``addr`` is looked up in the sorted
   region table (``np.searchsorted``), the rkey, rights, bounds, alignment and the stride
   boundary are checked (NO_ROUTE, BAD_RKEY, NO_RIGHTS, OUT_OF_BOUNDS, MISALIGNED, SPANS_NODES),
   and the packet is copied to the send queue with ``addr`` rewritten to the node-local address;
5. every forwarded copy gets the client's IP:port in the return segment (unless a cluster node
   sent it with a return segment already set), flag RELAYED, and a client id derived from the
   client's endpoint when the client left it 0. The switch keeps no per-request state.

Fault injection per link (port) and direction: seeded drop, duplicate, reorder, delay and "drop
the k-th packet of opcode X", decided by ``fault_hash.fault_hash`` (BRIEF section 7).

Like ``datapath``, nothing here checks its *arguments*: ``netdam.switch.core.SwitchCore`` owns
and sizes every array. Packet contents are untrusted.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels import signatures as S
from netdam.kernels.borrow import borrowed
from netdam.kernels.fault_hash import mix64, packet_id_of
from netdam.kernels.faults import decide_fate, fault_attempt, hold_datagram, release_into_batch
from netdam.kernels.guard import (
    G_FACTOR,
    G_LOCKOUT,
    check_guard,
    count_failure,
    is_locked_out,
    is_validated,
)
from netdam.kernels.state import FCLOCK_GEN, FCLOCK_NOW, FK_SEED, RxBatch, SwitchState, TxQueue
from netdam.kernels.tag import (
    CONTROL_TAG_FORGED,
    CONTROL_TAG_NO_KEY,
    TAG,
    is_control_op,
    is_tenant_request,
    open_control_tagged,
    open_tenant_tagged,
    seal_replies,
    tag_matches,
    tagged_length,
)
from netdam.kernels.wire import (
    DROP_SILENTLY,
    ESIZE,
    IS_REPLY,
    PUNT,
    PUNTED_OPS,
    check_packet,
    check_send_queue,
    copy_bytes,
    emit_nack,
    rd16,
    rd32,
    rd64,
    slot_payload,
    wr16,
    wr32,
    wr64,
)
from netdam.protocol import counters as C
from netdam.protocol.constants import Flags, Opcode, Rights, Status
from netdam.protocol.layout import (
    H_ADDR,
    H_AUX_ADDR,
    H_CLIENT_ID,
    H_DTYPE,
    H_FLAGS,
    H_LENGTH,
    H_OPCODE,
    H_RET_IP,
    H_RET_PORT,
    H_RKEY,
)

HDR = 64
_F_MCAST = int(Flags.MCAST)
F_SPARSE = int(Flags.SPARSE)
_F_RELAYED = int(Flags.RELAYED)
F_ACK_REQ = int(Flags.ACK_REQ)
R_READ = int(Rights.READ)
R_WRITE = int(Rights.WRITE)
R_ATOMIC = int(Rights.ATOMIC)
OP_READ = int(Opcode.READ)
OP_WRITE = int(Opcode.WRITE)
OP_ADD = int(Opcode.ADD)
OP_CHAIN_ADD = int(Opcode.CHAIN_ADD)
OP_UPDATE = int(Opcode.UPDATE)
OP_ALL_WRITE = int(Opcode.ALL_WRITE)
OP_FETCH_ADD = int(Opcode.FETCH_ADD)
_OP_CAS = int(Opcode.CAS)
_S_BAD_FIELD = int(Status.BAD_FIELD)
S_BAD_RKEY = int(Status.BAD_RKEY)
_S_NO_RIGHTS = int(Status.NO_RIGHTS)
_S_OUT_OF_BOUNDS = int(Status.OUT_OF_BOUNDS)
_S_MISALIGNED = int(Status.MISALIGNED)
_S_SPANS_NODES = int(Status.SPANS_NODES)
_S_NO_ROUTE = int(Status.NO_ROUTE)
S_TOO_LARGE = int(Status.TOO_LARGE)
S_UNAUTHORIZED = int(Status.UNAUTHORIZED)
#: Salt of the client-id hash (a client that left client_id 0 gets a stable id per endpoint).
_SALT_CLIENT = 0x5EC0DE5A17C11E47
#: Salt separating the transmit direction's attempt counts from the receive direction's.
_SALT_TX = 0x7A3B9C1D5E2F4A61

# ---- switch counters (``sw``): protocol/SPEC.md 11.7 "COUNTERS at the switch"
SW_FORWARDED = 0  # pool requests translated and forwarded to a node
SW_REPLICATED = 1  # multicast copies sent to group members
SW_IDS_FILLED = 2  # requests whose client id 0 the switch filled
SW_MAP_GENERATION = 3  # gauge: generation of the address map in use
SW_REGIONS = 4  # gauge
SW_GROUPS = 5  # gauge
SW_NODES = 6  # gauge
SW_KTH_DROPS = 7  # packets dropped by a "k-th packet of opcode X" rule
SW_LEN = 16

# ---- per-port counters (``port_ctr[port, k]``); port 0 = client side, port 1 + rank = node
P_RX_PACKETS = 0
P_RX_BYTES = 1
P_TX_PACKETS = 2  # queued for this port
P_TX_BYTES = 3
P_FAULT_DROPS_RX = 4
P_FAULT_DROPS_TX = 5
P_FAULT_DUPS = 6
P_FAULT_HELD = 7  # reordered or delayed
PORT_FIELDS = 8

# ---- per-region counters (``reg_ctr[region, k]``)
R_FORWARDED = 0
R_BYTES = 1  # operand bytes of forwarded requests
R_READS = 2
R_WRITES = 3  # WRITE, ADD, ALL_WRITE
R_ATOMICS = 4  # FETCH_ADD, CAS
R_NACKS = 5  # requests refused by the switch that named this region
R_SPANS = 6  # ... of which SPANS_NODES
REGION_FIELDS = 8

# ---- fault configuration ``fcfg[port, direction, k]`` (float64); direction 0 rx, 1 tx
F_ACTIVE, F_LOSS, F_DUP, F_REORDER, F_DELAY, F_DELAY_S, F_KTH_OP, F_KTH_K = range(8)
FAULT_FIELDS = 8
DIR_RX = 0
DIR_TX = 1
# ``fstate`` (int64): [rx faults configured, tx faults configured, held rx, held tx]
FS_RX_ACTIVE, FS_TX_ACTIVE, FS_HELD_RX, FS_HELD_TX = 0, 1, 2, 3
FSTATE_LEN = 4
# ``fclock`` (float64): [now seconds, batch generation] (state.FCLOCK_*)

# ``cfg`` (uint64): [vip endpoint, fan-out bound (largest group, at least 1)]
CFG_VIP, CFG_FANOUT = 0, 1
CFG_LEN = 4


@njit(cache=True, nogil=True)
def _port_of(node_sorted, node_port, ep):
    """Port of endpoint *ep*: 1 + rank for a cluster node, 0 for everything else (clients)."""
    i = np.searchsorted(node_sorted, ep)
    if i < node_sorted.shape[0] and node_sorted[i] == ep:
        return node_port[i]
    return 0


@njit(cache=True, nogil=True)
def _client_id_of(src):
    """A stable non-zero client id for endpoint *src* (same socket, same id: retries dedup)."""
    h = mix64(np.uint64(src) ^ np.uint64(_SALT_CLIENT)) & np.uint64(0xFFFFFFFF)
    if h == 0:
        h = np.uint64(1)
    return np.int64(h)


@njit(cache=True, nogil=True)
def _nack(b, src, node_sorted, node_port, status, port_ctr, tx, tx_n, counters):
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    tx_n = emit_nack(b, src, node_sorted, status, tx, tx_n, counters)
    port = _port_of(node_sorted, node_port, tx_dst[tx_n - 1])
    port_ctr[port, P_TX_PACKETS] += 1
    port_ctr[port, P_TX_BYTES] += tx_len[tx_n - 1]
    return tx_n


@njit(cache=True, nogil=True)
def _emit_copy(
    b, ln, src, from_node, dst, dst_port, port_ctr, sw, tx_buf, tx_off, tx_len, tx_dst, tx_n
):
    """Queue a copy of b[:ln] to *dst* with the return segment, RELAYED and client id written."""
    t = tx_buf[tx_off[tx_n] :]
    copy_bytes(t, 0, b, 0, ln)
    ret_set = rd32(b, H_RET_IP) != 0 or rd16(b, H_RET_PORT) != 0
    if not (from_node and ret_set):
        # A client's return segment is always replaced: replies never go to a third party.
        wr32(t, H_RET_IP, np.int64(src >> np.uint64(16)))
        wr16(t, H_RET_PORT, np.int64(src & np.uint64(0xFFFF)))
    wr16(t, H_FLAGS, rd16(b, H_FLAGS) | _F_RELAYED)
    if rd32(b, H_CLIENT_ID) == 0:
        wr32(t, H_CLIENT_ID, _client_id_of(src))
        sw[SW_IDS_FILLED] += 1
    tx_len[tx_n] = ln
    tx_off[tx_n + 1] = tx_off[tx_n] + ln
    tx_dst[tx_n] = dst
    port_ctr[dst_port, P_TX_PACKETS] += 1
    port_ctr[dst_port, P_TX_BYTES] += ln
    return tx_n + 1


@njit(cache=True, nogil=True)
def _switch_batch(rx, n, max_len, st, tx, tx_n, punt):
    """Translate/replicate datagrams rx[0:n] into the send queue from tx_n; (tx_n, n_punt)."""
    rx_buf, rx_off, rx_len, rx_src = rx
    cfg, nodes_ep, node_sorted, node_port = st.ports
    reg_tag = st.regions.tag
    grp_key, grp_first, grp_count, grp_member = st.groups
    counters, sw, port_ctr, reg_ctr = st.ctrs
    guard = st.guard
    tenant_ids, tenant_keys = st.tenants
    factor = guard.cfg[G_FACTOR]
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    max_pay = slot_payload(tx_slot)
    n_punt = 0
    cap = tx_len.shape[0]
    fanout = np.int64(cfg[CFG_FANOUT])
    open_src = np.uint64(0)  # the last client source found not locked out in this batch
    for i in range(n):
        ln = np.int64(rx_len[i])
        off = rx_off[i]
        src = rx_src[i]
        port = _port_of(node_sorted, node_port, src)
        from_node = port != 0
        counters[C.RX_PACKETS] += 1
        counters[C.RX_BYTES] += ln
        port_ctr[port, P_RX_PACKETS] += 1
        port_ctr[port, P_RX_BYTES] += ln
        if off < 0 or off + ln > rx_buf.shape[0] or ln > max_len:
            counters[C.DROP_OVERSIZE] += 1
            continue
        b = rx_buf[off : off + ln]
        if tx_n + fanout > cap or tx_off[tx_n] + fanout * tx_slot > tx_buf.shape[0]:
            counters[C.DROP_TX_FULL] += 1
            continue
        # A TAGGED datagram (SPEC.md 2.6) is checked without its trailer; a pool request to a
        # tagged region is taken when its tag verifies under the region's key (below), and is
        # forwarded sealed anew (the switch rewrites its address); any other is refused.
        full, full_ln = b, ln
        tagged = tagged_length(b, ln)
        if tagged < 0:
            counters[C.DROP_TRUNCATED] += 1
            continue
        was_tagged = tagged < ln
        if was_tagged:
            ln = tagged
            b = b[:ln]
        guarded = not from_node and guard.cfg[G_LOCKOUT] != 0.0
        # A locked-out source's TAGGED pool request is taken when its tag verifies (SPEC.md
        # 12.3): a guesser sharing (or forging) the address cannot lock out a key holder.
        locked_tagged = False
        if guarded and src != open_src:
            if is_locked_out(guard, src):
                if not was_tagged:
                    counters[C.DROP_LOCKOUT] += 1  # a right key too: the source is locked out
                    continue
                locked_tagged = True
            else:
                open_src = src  # not locked: stays so within this batch unless it fails a key
        status = check_packet(b, ln, max_pay)
        op = np.int64(b[H_OPCODE]) if ln > 1 else 0
        if status == DROP_SILENTLY:
            counters[C.DROP_TRUNCATED] += 1
            continue
        if status == PUNT:
            status = _S_BAD_FIELD  # v1 switches do not relay sparse payloads
        if status != 0 and locked_tagged:
            counters[C.DROP_LOCKOUT] += 1  # no tag was proven: a locked-out source gets nothing
            continue
        if status != 0:
            if op < 64 and IS_REPLY[op] == 1:
                counters[C.DROP_BAD_REPLY] += 1
                continue
            tx_n = _nack(b, src, node_sorted, node_port, status, port_ctr, tx, tx_n, counters)
            continue
        if was_tagged and is_control_op(op):
            # A control tag proves the cluster's admin tag key (SPEC.md 2.6, "Control tags"), or
            # a pool request's the key of the tenant its rkey names (11.9, "Tenant tags"):
            # punted, a locked-out source's too; the control plane checks it again and seals
            # its answers. A wrong one is dropped without an answer.
            if is_tenant_request(b, op):
                verdict = open_tenant_tagged(tenant_ids, tenant_keys, full, full_ln, counters)
            else:
                verdict, _ak0, _ak1 = open_control_tagged(guard.key, full, full_ln, counters)
            if verdict == CONTROL_TAG_FORGED:
                continue
            if verdict == CONTROL_TAG_NO_KEY:
                if locked_tagged:
                    counters[C.DROP_LOCKOUT] += 1
                    continue
                tx_n = _nack(
                    b, src, node_sorted, node_port, S_UNAUTHORIZED, port_ctr, tx, tx_n, counters
                )
                if guarded:
                    count_failure(guard, src, counters)
                    open_src = np.uint64(0)
                continue
            counters[C.OPCODE_BASE + op] += 1
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if was_tagged and (
            IS_REPLY[op] == 1
            or PUNTED_OPS[op] == 1
            or op == OP_CHAIN_ADD
            or rd16(b, H_FLAGS) & _F_MCAST
        ):
            # Tags here belong to pool requests; a collective's run between nodes.
            if locked_tagged:
                counters[C.DROP_LOCKOUT] += 1
                continue
            if IS_REPLY[op] == 1:
                counters[C.DROP_BAD_REPLY] += 1
                continue
            tx_n = _nack(b, src, node_sorted, node_port, _S_BAD_FIELD, port_ctr, tx, tx_n, counters)
            continue
        if locked_tagged and IS_REPLY[op] == 1:
            counters[C.DROP_LOCKOUT] += 1
            continue
        if rd16(b, H_FLAGS) & F_SPARSE:  # v1 switches do not relay sparse payloads (SPEC.md 11.3)
            tx_n = _nack(b, src, node_sorted, node_port, _S_BAD_FIELD, port_ctr, tx, tx_n, counters)
            continue
        counters[C.OPCODE_BASE + op] += 1
        if PUNTED_OPS[op] == 1:
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if op == OP_CHAIN_ADD or op == OP_UPDATE:
            # SR chains name their nodes themselves: send them to the first hop, not the VIP;
            # an optimizer's state sits on one node: UPDATEs go to it (SPEC.md 6.8).
            tx_n = _nack(b, src, node_sorted, node_port, _S_NO_ROUTE, port_ctr, tx, tx_n, counters)
            continue
        flags = rd16(b, H_FLAGS)
        if flags & _F_MCAST:
            if op != OP_ALL_WRITE:
                tx_n = _nack(
                    b, src, node_sorted, node_port, _S_BAD_FIELD, port_ctr, tx, tx_n, counters
                )
                continue
            group = rd64(b, H_AUX_ADDR)
            g = np.searchsorted(grp_key, group)
            if g >= grp_key.shape[0] or grp_key[g] != group:
                tx_n = _nack(
                    b, src, node_sorted, node_port, _S_NO_ROUTE, port_ctr, tx, tx_n, counters
                )
                continue
            first = grp_first[g]
            if (
                factor > 0.0
                and not from_node
                and rd16(b, H_FLAGS) & F_ACK_REQ
                and HDR * grp_count[g] > factor * ln
            ):
                counters[C.DROP_AMPLIFICATION] += 1  # one ACK per member back to an unproven source
                continue
            for k in range(grp_count[g]):
                member = grp_member[first + k]
                if member == src:
                    continue  # a sender never gets its own copy (IP multicast loopback off)
                mport = _port_of(node_sorted, node_port, member)
                tx_n = _emit_copy(
                    b,
                    ln,
                    src,
                    from_node,
                    member,
                    mport,
                    port_ctr,
                    sw,
                    tx_buf,
                    tx_off,
                    tx_len,
                    tx_dst,
                    tx_n,
                )
                sw[SW_REPLICATED] += 1
            continue
        # A pool request: global address -> (node, local address).
        addr = rd64(b, H_ADDR)
        length = rd32(b, H_LENGTH)
        dtype = np.int64(b[H_DTYPE])
        if op == OP_READ:
            need, align = R_READ, ESIZE[dtype]
        elif op == OP_FETCH_ADD or op == _OP_CAS:
            need, align = R_ATOMIC, 8
        else:
            need, align = R_WRITE, ESIZE[dtype]
        if op == OP_READ and HDR + length + (TAG if was_tagged else 0) > max_len:
            # The node's answer would not fit the MTU (the node answers the same): a 64-byte
            # NACK, no amplification, so before the token check (SPEC.md 5's order).
            if locked_tagged:
                counters[C.DROP_LOCKOUT] += 1
                continue
            tx_n = _nack(b, src, node_sorted, node_port, S_TOO_LARGE, port_ctr, tx, tx_n, counters)
            continue
        if op == OP_READ and factor > 0.0 and not from_node and HDR + length > factor * ln:
            # The node would answer the client with more than 3x the request: only for a client
            # that proved it receives at its address (the switch's token in aux_addr).
            if not is_validated(guard, src, rd64(b, H_AUX_ADDR)):
                counters[C.DROP_AMPLIFICATION] += 1
                continue
        status, r, node, local = _lookup(addr, length, rd32(b, H_RKEY), need, align, st.regions)
        # A tagged region takes only requests sealed under its key; a tag under any other rkey
        # proves nothing (BAD_RKEY, as at a node). A wrong tag is dropped without an answer.
        k0, k1, proven = np.uint64(0), np.uint64(0), False
        if r >= 0 and status != S_BAD_RKEY:
            k0, k1 = reg_tag[r, 0], reg_tag[r, 1]
            if (k0 | k1) == 0:
                if was_tagged:
                    status = S_BAD_RKEY
            elif not was_tagged:
                status = S_BAD_RKEY
            elif tag_matches(full, full_ln, k0, k1):
                proven = True
            else:
                counters[C.DROP_REGION_FORGED] += 1
                continue
        if locked_tagged and not proven:
            counters[C.DROP_LOCKOUT] += 1  # a tag that proves nothing: the lockout holds
            continue
        if status == S_BAD_RKEY and guarded:
            count_failure(guard, src, counters)
            open_src = np.uint64(0)  # may be locked out now: look its next datagram up again
        if status != 0:
            if r >= 0:
                reg_ctr[r, R_NACKS] += 1
                if status == _S_SPANS_NODES:
                    reg_ctr[r, R_SPANS] += 1
            t0 = tx_n
            tx_n = _nack(b, src, node_sorted, node_port, status, port_ctr, tx, tx_n, counters)
            if proven:
                seal_replies(tx_buf, tx_off, tx_len, t0, tx_n, k0, k1, 0, np.uint64(0))
            continue
        t0 = tx_n
        tx_n = _emit_copy(
            b,
            ln,
            src,
            from_node,
            nodes_ep[node],
            node + 1,
            port_ctr,
            sw,
            tx_buf,
            tx_off,
            tx_len,
            tx_dst,
            tx_n,
        )
        t = tx_buf[tx_off[t0] : tx_off[t0] + HDR]
        wr64(t, H_ADDR, local)
        if proven:
            # The address is covered: sealed anew under the region's key, which the node holds.
            seal_replies(tx_buf, tx_off, tx_len, t0, tx_n, k0, k1, 0, np.uint64(0))
            port_ctr[node + 1, P_TX_BYTES] += TAG
        sw[SW_FORWARDED] += 1
        reg_ctr[r, R_FORWARDED] += 1
        reg_ctr[r, R_BYTES] += length
        if op == OP_READ:
            reg_ctr[r, R_READS] += 1
        elif need == R_ATOMIC:
            reg_ctr[r, R_ATOMICS] += 1
        else:
            reg_ctr[r, R_WRITES] += 1
    return tx_n, n_punt


# ---------------------------------------------------------------- fault injection


@njit(cache=True, nogil=True)
def _link_decide(fcfg, port, direction, seed, a, b_ep, pid, attempt, op, kctr):
    """(drop, kth_drop, copies, held, release_delay) for one packet on one link direction: the
    link's k-th-packet drop first, then the shared engine (kernels/faults.py) on its row."""
    kth_k = np.int64(fcfg[port, direction, F_KTH_K])
    if op < 64:
        kctr[port, direction, op] += 1
        if (
            kth_k > 0
            and op == np.int64(fcfg[port, direction, F_KTH_OP])
            and kctr[port, direction, op] == kth_k
        ):
            return True, True, 0, False, 0.0
    if fcfg[port, direction, F_ACTIVE] == 0.0:
        return False, False, 1, False, 0.0
    drop, copies, held, delay = decide_fate(
        fcfg[port, direction, F_LOSS : F_DELAY_S + 1], seed, a, b_ep, pid, attempt
    )
    return drop, False, copies, held, delay


@njit(cache=True, nogil=True)
def _link_fate(b, ln, peer, direction, st):
    """The fate of datagram b[:ln] on the link to node endpoint *peer* in *direction* (DIR_RX:
    from it, DIR_TX: to it), counted per port: the copies to deliver now (0: dropped); a held
    copy (reordered or delayed) is kept in the hold table and not among them."""
    cfg, nodes_ep, node_sorted, node_port = st.ports
    counters, sw, port_ctr, reg_ctr = st.ctrs
    fcfg, fkeys, fclock, fstate, ftab_key, ftab_count, kctr, hold = st.faults
    rx = direction == DIR_RX
    vip = cfg[CFG_VIP]
    port = _port_of(node_sorted, node_port, peer)
    pid = packet_id_of(b, ln)
    salt = np.uint64(0) if rx else np.uint64(_SALT_TX)
    attempt = fault_attempt(ftab_key, ftab_count, mix64(peer ^ mix64(pid ^ salt)) | np.uint64(1))
    op = np.int64(b[H_OPCODE]) if ln > 1 else 64
    a, b_ep = (peer, vip) if rx else (vip, peer)
    drop, kth, copies, held, delay = _link_decide(
        fcfg, port, direction, fkeys[FK_SEED], a, b_ep, pid, attempt, op, kctr
    )
    if drop:
        counters[C.DROP_FAULT] += 1
        port_ctr[port, P_FAULT_DROPS_RX if rx else P_FAULT_DROPS_TX] += 1
        if kth:
            sw[SW_KTH_DROPS] += 1
        return 0
    if copies > 1:
        port_ctr[port, P_FAULT_DUPS] += 1
    if held and hold_datagram(
        b, ln, peer, direction, fclock[FCLOCK_NOW] + delay, np.int64(fclock[FCLOCK_GEN]), hold
    ):
        copies -= 1
        fstate[FS_HELD_RX if rx else FS_HELD_TX] += 1
        port_ctr[port, P_FAULT_HELD] += 1
    return copies


@njit(cache=True, nogil=True)
def _rx_faults(rx, n, st):
    """Receive direction: rewrite rx[0:n] in place; released held datagrams are copied after
    the batch's data. rx arrays need room for 2n + held entries."""
    rx_buf, rx_off, rx_len, rx_src = rx
    cfg, nodes_ep, node_sorted, node_port = st.ports
    counters, sw, port_ctr, reg_ctr = st.ctrs
    fcfg, fkeys, fclock, fstate, ftab_key, ftab_count, kctr, hold = st.faults
    hold_buf, hold_len, hold_ep, hold_dir, hold_time, hold_gen = hold
    now = fclock[FCLOCK_NOW]
    gen = np.int64(fclock[FCLOCK_GEN])
    m_cap = 2 * n + hold_len.shape[0]
    out_off = np.empty(m_cap, np.int64)
    out_len = np.empty(m_cap, np.int32)
    out_src = np.empty(m_cap, np.uint64)
    m = 0
    end = 0
    for i in range(n):
        off = rx_off[i]
        ln = np.int64(rx_len[i])
        src = rx_src[i]
        end = max(end, off + ln)
        copies = _link_fate(rx_buf[off : off + ln], ln, src, DIR_RX, st)
        for _ in range(copies):
            out_off[m] = off
            out_len[m] = ln
            out_src[m] = src
            m += 1
    if fstate[FS_HELD_RX] > 0:
        m, end, released = release_into_batch(
            rx_buf, end, out_off, out_len, out_src, m, hold, DIR_RX, gen, now
        )
        fstate[FS_HELD_RX] -= released
    m = min(m, rx_off.shape[0])
    rx_off[:m] = out_off[:m]
    rx_len[:m] = out_len[:m]
    rx_src[:m] = out_src[:m]
    return m


@njit(cache=True, nogil=True)
def _tx_faults(start, tx_n, st, tx):
    """Transmit direction: re-queue datagrams [start, tx_n) as the faults decide, then append
    held datagrams that are due. Returns the new tx_n."""
    cfg, nodes_ep, node_sorted, node_port = st.ports
    counters, sw, port_ctr, reg_ctr = st.ctrs
    fcfg, fkeys, fclock, fstate, ftab_key, ftab_count, kctr, hold = st.faults
    hold_buf, hold_len, hold_ep, hold_dir, hold_time, hold_gen = hold
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    now = fclock[FCLOCK_NOW]
    gen = np.int64(fclock[FCLOCK_GEN])
    count = tx_n - start
    base = tx_off[start]
    total = tx_off[tx_n] - base
    stage = np.empty(max(total, 1), np.uint8)
    copy_bytes(stage, 0, tx_buf, base, total)
    s_off = np.empty(max(count, 1), np.int64)
    s_len = np.empty(max(count, 1), np.int64)
    s_dst = np.empty(max(count, 1), np.uint64)
    for k in range(count):
        s_off[k] = tx_off[start + k] - base
        s_len[k] = tx_len[start + k]
        s_dst[k] = tx_dst[start + k]
    cap = tx_len.shape[0]
    q = start
    for k in range(count):
        ln = s_len[k]
        dst = s_dst[k]
        d = stage[s_off[k] : s_off[k] + ln]
        copies = _link_fate(d, ln, dst, DIR_TX, st)
        for _ in range(copies):
            if q >= cap or tx_off[q] + ln > tx_buf.shape[0]:
                counters[C.DROP_TX_FULL] += 1
                break
            tx_buf[tx_off[q] : tx_off[q] + ln] = d
            tx_len[q] = ln
            tx_dst[q] = dst
            tx_off[q + 1] = tx_off[q] + ln
            q += 1
    if fstate[FS_HELD_TX] > 0:
        for h in range(hold_len.shape[0]):
            ln = np.int64(hold_len[h])
            if ln == 0 or hold_dir[h] != DIR_TX or hold_gen[h] >= gen or hold_time[h] > now:
                continue
            if q >= cap or tx_off[q] + ln > tx_buf.shape[0]:
                break
            copy_bytes(tx_buf, tx_off[q], hold_buf[h], 0, ln)
            tx_len[q] = ln
            tx_dst[q] = hold_ep[h]
            tx_off[q + 1] = tx_off[q] + ln
            q += 1
            hold_len[h] = 0
            fstate[FS_HELD_TX] -= 1
    return q


def switch_round(
    rx: RxBatch, n: int, max_len: int, st: SwitchState, tx: TxQueue, tx_n: int, punt: np.ndarray
) -> tuple[int, int]:
    """Checked entry to the switch's datapath: receive faults, translation/replication,
    transmit faults for rx[0:n]; returns (tx_n, n_punt)."""
    if not 0 <= n <= min(rx.off.shape[0], rx.len.shape[0], rx.src.shape[0], punt.shape[0]):
        raise ValueError(f"batch of {n} does not fit its arrays")
    check_send_queue(tx, tx_n)
    check_guard(st.guard)
    tx_n, n_punt = switch_round_kernel(rx, n, max_len, st, tx, tx_n, punt)
    return int(tx_n), int(n_punt)


@njit(cache=True, nogil=True)
def switch_round_kernel(rx, n, max_len, st, tx, tx_n, punt):
    """Receive faults, translation/replication, transmit faults: one batch. (tx_n, n_punt).

    With receive faults configured (or datagrams held), the rx arrays need room for 2n + held
    entries and rx_buf room after the data for released copies."""
    # Borrowed for the call (netdam.kernels.borrow): no atomic reference counts below.
    rx, st, tx, punt = borrowed(rx), borrowed(st), borrowed(tx), borrowed(punt)
    fstate, fclock = st.faults.fstate, st.faults.fclock
    if fstate[FS_RX_ACTIVE] != 0 or fstate[FS_HELD_RX] > 0:
        n = _rx_faults(rx, n, st)
    start = tx_n
    tx_n, n_punt = _switch_batch(rx, n, max_len, st, tx, tx_n, punt)
    if fstate[FS_TX_ACTIVE] != 0 or fstate[FS_HELD_TX] > 0:
        tx_n = _tx_faults(start, tx_n, st, tx)
    fclock[FCLOCK_GEN] += 1.0
    return tx_n, n_punt


@njit(cache=True, nogil=True)
def _lookup(addr, length, rkey, need, align, regions):
    """(status, region, node, local) of a pool operand [addr, addr+length) under *rkey*.

    Checks in order: mapped (NO_ROUTE), rkey of that region (BAD_RKEY), rights (NO_RIGHTS),
    region end (OUT_OF_BOUNDS), alignment of the offset (MISALIGNED), stride boundary
    (SPANS_NODES). region is -1 when unmapped; node and local are -1 on any failure."""
    reg_base, reg_end, reg_rkey, reg_rights, reg_stride = (
        regions.base,
        regions.end,
        regions.rkey,
        regions.rights,
        regions.stride,
    )
    reg_ways, reg_way0, way_node, way_local = (
        regions.ways,
        regions.way0,
        regions.way_node,
        regions.way_local,
    )
    r = np.int64(np.searchsorted(reg_base, addr, side="right")) - 1
    if r < 0 or r >= reg_base.shape[0] or addr >= reg_end[r]:
        return _S_NO_ROUTE, np.int64(-1), np.int64(-1), np.int64(-1)
    status = 0
    offset = np.int64(addr - reg_base[r])
    stride = reg_stride[r]
    if np.int64(reg_rkey[r]) != rkey:
        status = S_BAD_RKEY
    elif (np.int64(reg_rights[r]) & need) != need:
        status = _S_NO_RIGHTS
    elif np.int64(reg_end[r] - addr) < length:
        status = _S_OUT_OF_BOUNDS
    elif offset % align != 0:
        status = _S_MISALIGNED
    elif stride > 0 and offset // stride != (offset + length - 1) // stride:
        status = _S_SPANS_NODES
    if status != 0:
        return status, r, np.int64(-1), np.int64(-1)
    w0 = reg_way0[r]
    if stride == 0:
        way = w0
        local = way_local[way] + offset
    else:
        stripe = offset // stride
        way = w0 + stripe % reg_ways[r]
        local = way_local[way] + (stripe // reg_ways[r]) * stride + offset % stride
    return 0, r, np.int64(way_node[way]), np.int64(local)


@njit(cache=True, nogil=True)
def translate_many(addrs, lengths, rkeys, needs, aligns, regions, out_status, out_node, out_local):
    """_lookup over arrays (tests hold it to the Python reference in netdam.switch.addrmap)."""
    for i in range(addrs.shape[0]):
        status, r, node, local = _lookup(
            addrs[i], lengths[i], rkeys[i], needs[i], aligns[i], regions
        )
        out_status[i] = status
        out_node[i] = node
        out_local[i] = local


# The explicit signature (kernels/signatures.py), compiled (or loaded from the cache) here, at
# the end of the module where every kernel it calls exists; no other signature compiles.
switch_round_kernel.compile(S.SWITCH_ROUND)
switch_round_kernel.disable_compile()
