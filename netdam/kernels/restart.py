"""A collective's next epoch started in the datapath: the compiled START_COLL.

A training loop calls the same collective over and over: the same group, buffers and plan,
each call one epoch with its own keys (SPEC.md 4.1, "Keys"). The control plane's START_COLL
(``netdam.core.node``, in Python) decodes, validates and plans the first call; every later
call whose START_COLL asks exactly what the slot's last epoch asked, of the same source, only
needs a new epoch, key and tag key. ``restart_collective`` does that here, in the datapath's
batch, so no Python runs between the host's submit and its collective's first tick (~110 us of
the control plane per node per call before, plus its turn in the process).

Everything the control plane would check is checked again, or is unchanged since it checked
it: the control tag (the datapath verified it), a newer epoch, the same shape (every
descriptor field, the SR list, dtype, op and client), the buffers still inside one registered
region that grants READ and WRITE, the new key naming no key the node holds. Anything else,
or a slot whose row of control tags waiting for the replay memory is full (the control plane
empties it), is punted as before. A last epoch that ended in the same round still holds its key:
the restart removes it first, as the next round would.

The keys of ended collectives go here too (``drop_ended_keys``, every serve round), so a
repeated collective's whole life, start to completion and key removal, passes no Python.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.collective import (
    CFG_ALGO,
    CFG_CKEY,
    CFG_CKEY_RIGHTS,
    CFG_CLIENT,
    CFG_COUNT,
    CFG_DTYPE,
    CFG_EPOCH,
    CFG_EPOCH_BEFORE,
    CFG_FLAGS,
    CFG_GROUP,
    CFG_HOST,
    CFG_IN,
    CFG_OP,
    CFG_OPT_DESC,
    CFG_OUT,
    CFG_RANK,
    CFG_REQ_WINDOW,
    CFG_ROOT,
    CFG_SPAN_HI,
    CFG_SPAN_LO,
    CFG_STARTER,
    CFG_STATE,
    CFG_TAKEN,
    CFG_TAKEN_BASE,
    CFG_TIMEOUT_MS,
    CFG_WORLD,
    MAX_COLLECTIVES,
    SPARE_SLOT,
    STATE_RUNNING,
    TAKEN_SLOTS,
    begin_epoch,
    count_start,
    local_part,
    slot_of,
    slot_state,
)
from netdam.kernels.tag import TAG, seal_tag
from netdam.kernels.wire import (
    HDR,
    R_READ,
    R_WRITE,
    SEG,
    add_rkey,
    emit_ack,
    le16,
    le32,
    le64,
    rd16,
    rd32,
    remove_rkey,
    wr64,
)
from netdam.protocol.constants import FLAG_AWAIT_STARTED, Rights
from netdam.protocol.layout import (
    D_ALGO,
    D_COUNT,
    D_FLAGS,
    D_GROUP,
    D_HOST,
    D_IN_ADDR,
    D_OUT_ADDR,
    D_RANK,
    D_RESERVED,
    D_RKEY,
    D_ROOT,
    D_TAG_K0,
    D_TAG_K1,
    D_TIMEOUT_MS,
    D_WINDOW,
    H_AUX_ADDR,
    H_CLIENT_ID,
    H_COLL_ID,
    H_DTYPE,
    H_EPOCH,
    H_REDUCE_OP,
    H_SEG_COUNT,
    H_TXN_ID,
    SEG_IP,
    SEG_PORT,
    TAGGED_DESCRIPTOR_BYTES,
)

_R_MEMBERS = int(Rights.MEMBERS)
_RW = R_READ | R_WRITE
#: A restart (restart_collective's answer): not taken, the control plane's turn.
NOT_TAKEN = -1


@njit(cache=True, nogil=True)
def _same_shape(b, ln, src, cfg, ring):
    """START_COLL b[:ln] (trailer cut) asks of slot *cfg* exactly what its last epoch asked,
    from the same source, with a tag key (the descriptor's 80-byte form); keys aside."""
    world = cfg[CFG_WORLD]
    p = HDR + SEG * world
    if np.int64(b[H_SEG_COUNT]) != world or ln != p + TAGGED_DESCRIPTOR_BYTES:
        return False
    if (
        np.uint64(src) != np.uint64(cfg[CFG_STARTER])
        or rd32(b, H_CLIENT_ID) != cfg[CFG_CLIENT]
        or np.int64(b[H_DTYPE]) != cfg[CFG_DTYPE]
        or np.int64(b[H_REDUCE_OP]) != cfg[CFG_OP]
    ):
        return False
    for k in range(world):
        at = HDR + SEG * k
        endpoint = (np.uint64(rd32(b, at + SEG_IP)) << np.uint64(16)) | np.uint64(
            rd16(b, at + SEG_PORT)
        )
        if endpoint != ring[k]:
            return False
    host = le64(b, p + D_HOST)
    if host == 0:
        host = np.uint64(src)
    return (
        np.int64(b[p + D_ALGO]) == cfg[CFG_ALGO]
        and np.int64(b[p + D_FLAGS]) == cfg[CFG_FLAGS]
        and le16(b, p + D_WINDOW) == cfg[CFG_REQ_WINDOW]
        and le32(b, p + D_RANK) == cfg[CFG_RANK]
        and le64(b, p + D_COUNT) == np.uint64(cfg[CFG_COUNT])
        and le64(b, p + D_IN_ADDR) == np.uint64(cfg[CFG_IN])
        and le64(b, p + D_OUT_ADDR) == np.uint64(cfg[CFG_OUT])
        and le32(b, p + D_ROOT) == cfg[CFG_ROOT]
        and le64(b, p + D_GROUP) == np.uint64(cfg[CFG_GROUP])
        and host == np.uint64(cfg[CFG_HOST])
        and le32(b, p + D_TIMEOUT_MS) == cfg[CFG_TIMEOUT_MS]
        and le32(b, p + D_RESERVED) == 0
    )


@njit(cache=True, nogil=True)
def _owner_rights(regions, slots, lo, hi):
    """Rights of the registered region that holds all of [lo, hi) (-1: none). Collectives' keys
    (every slot's CFG_CKEY) are no registered region."""
    for i in range(regions.key.shape[0]):
        key = np.int64(regions.key[i])
        if key == 0:
            continue
        ours = False
        for s in range(MAX_COLLECTIVES):
            ours = ours or slots.cfg[s, CFG_CKEY] == key
        if ours:
            continue
        base, size = regions.base[i], regions.len[i]
        if base <= lo and hi <= base + size:
            return np.int64(regions.rights[i])
    return np.int64(-1)


@njit(cache=True, nogil=True)
def drop_ended_keys(regions, slots):
    """Remove the key of every collective that ended here from the rkey table: called at the
    start of each serve round, so a key outlives its collective by one round at most, as the
    control plane's release does (NodeCore.release_collective_key, which finds nothing left
    then); a restart of its slot drops it at once (restart_collective)."""
    for s in range(MAX_COLLECTIVES):
        if slots.cfg[s, CFG_STATE] != STATE_RUNNING:
            _drop_key(regions, slots.cfg[s])


@njit(cache=True, nogil=True)
def _drop_key(regions, cfg):
    """Remove the key of the ended collective of slot row *cfg*, if it still holds one."""
    if cfg[CFG_CKEY] != 0:
        remove_rkey(regions, cfg[CFG_CKEY])
        cfg[CFG_CKEY] = 0
        cfg[CFG_CKEY_RIGHTS] = 0


@njit(cache=True, nogil=True)
def restart_collective(b, ln, src, node, tx, tx_n, tag):
    """Start the next epoch of a collective from START_COLL b[:ln] (its control tag *tag*
    verified, the trailer cut) when its slot's last epoch ended here and it asks the same
    (module doc). Then the new key covers the buffers (members only), the slot runs, and the
    ACK (aux_addr 0, "running", sealed under the new tag key) is queued: returns the new tx_n.
    NOT_TAKEN: the control plane takes it, nothing changed."""
    mem, regions, members, window, slots, counters, trace = node
    s = slot_of(slots, rd32(b, H_COLL_ID))
    if s == SPARE_SLOT:
        return NOT_TAKEN
    cfg = slots.cfg[s]
    if (
        cfg[CFG_STATE] == STATE_RUNNING
        or cfg[CFG_TAKEN] >= TAKEN_SLOTS  # no room to keep its tag for the replay memory
        or cfg[CFG_OPT_DESC] != 0
        or cfg[CFG_FLAGS] & ~FLAG_AWAIT_STARTED != 0  # sparse or fused: set up in Python
    ):
        return NOT_TAKEN
    epoch = rd32(b, H_EPOCH)
    ahead = (epoch - cfg[CFG_EPOCH]) & 0xFFFFFFFF
    if ahead == 0 or ahead >= 0x80000000:
        return NOT_TAKEN  # a retry, or stale: the control plane answers
    if not _same_shape(b, ln, src, cfg, slots.ring[s]):
        return NOT_TAKEN
    p = HDR + SEG * cfg[CFG_WORLD]
    rkey = le32(b, p + D_RKEY)
    k0, k1 = le64(b, p + D_TAG_K0), le64(b, p + D_TAG_K1)
    if rkey == 0 or (k0 | k1) == 0:
        return NOT_TAKEN
    # The last epoch's key, when that epoch ended in this very round (drop_ended_keys runs at
    # the next): it goes now, as it would have then. Before, such a START_COLL went to the
    # control plane (1-3 calls in 51 under load; most of them with a node that polls).
    _drop_key(regions, cfg)
    rights = _owner_rights(regions, slots, cfg[CFG_SPAN_LO], cfg[CFG_SPAN_HI])
    if rights < 0 or (rights & _RW) != _RW:
        return NOT_TAKEN
    scope = (rights & _RW) | _R_MEMBERS
    span = cfg[CFG_SPAN_HI] - cfg[CFG_SPAN_LO]
    if not add_rkey(regions, rkey, cfg[CFG_SPAN_LO], span, scope):
        return NOT_TAKEN  # a key the node holds, or no room
    # Taken: nothing below refuses.
    before = cfg[CFG_EPOCH]
    begin_epoch(
        slot_state(slots, s),
        slots.cfg[SPARE_SLOT],
        epoch,
        rkey,
        rd32(b, H_TXN_ID),
        np.int64(k0),
        np.int64(k1),
    )
    cfg[CFG_EPOCH_BEFORE] = before
    cfg[CFG_CKEY] = rkey
    cfg[CFG_CKEY_RIGHTS] = scope
    cfg[CFG_TAKEN_BASE + cfg[CFG_TAKEN]] = np.int64(tag)
    cfg[CFG_TAKEN] += 1
    count_start(slots.cfg[SPARE_SLOT], cfg)
    local_part(slot_state(slots, s), mem)
    # The ACK echoes the request's header (aux_addr 0: running), sealed under its tag key.
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    tx_n = emit_ack(b, src, members, tx, tx_n)
    k = tx_n - 1
    t = tx_buf[tx_off[k] : tx_off[k] + HDR + TAG]
    wr64(t, H_AUX_ADDR, 0)
    tx_len[k] = seal_tag(t, HDR, k0, k1)
    tx_off[tx_n] = tx_off[k] + tx_len[k]
    return tx_n
