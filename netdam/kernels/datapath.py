"""The node's fast path: one numba call validates and executes a whole batch of datagrams.

Rules of this file:
1. The checks in ``_check_packet`` mirror ``netdam.protocol.packet.decode_packet`` step for step
   and in the same order, so both give the same status for the same bytes (tests/test_datapath.py
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

from netdam.kernels.coll_layout import (
    AUX_BITMAP,
    AUX_DONE,
    CFG_ACKED,
    CFG_BM_ASK,
    CFG_BM_GOT,
    CFG_BM_HAS,
    CFG_CHUNKS,
    CFG_COLL,
    CFG_CUR_ASK,
    CFG_DONE_COUNT,
    CFG_EPOCH,
    CFG_FATAL,
    CFG_INFLIGHT,
    CFG_PEERS_DONE,
    CFG_PREV_ASK,
    CFG_RANK,
    CFG_SPARSE,
    CFG_STATE,
    CFG_WORLD,
    NZ_BASE,
)
from netdam.kernels.combine import _combine_bytes
from netdam.kernels.fault_hash import _mix
from netdam.kernels.state import DupWindow, NodeState, RxBatch, TxQueue
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DUP_REPLY_BYTES,
    DUP_WINDOW,
    FLAGS_V1_MASK,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    REPLY_OPCODES,
    SEGMENT_SIZE,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)

# numba freezes module-level ints and arrays at compile time: plain copies of the wire constants.
_HDR = HEADER_SIZE
_SEG = SEGMENT_SIZE
_MAXSEG = MAX_SEGMENTS
_MAXPAY = MAX_PAYLOAD_BYTES
_FLAGS_MASK = FLAGS_V1_MASK
_F_ACK_REQ = int(Flags.ACK_REQ)
_F_SPARSE = int(Flags.SPARSE)
_F_KEEP_IN_REPLY = int(Flags.RELAYED | Flags.MCAST)
_R_READ = int(Rights.READ)
_R_WRITE = int(Rights.WRITE)
_R_ATOMIC = int(Rights.ATOMIC)
_U64 = int(DType.U64)
_MAX_STATUS = max(int(s) for s in Status)
_W = DUP_WINDOW
_REPLY_MAX = DUP_REPLY_BYTES
#: Room one outgoing datagram may need: header, full SR list, largest payload.
_SLOT = HEADER_SIZE + MAX_SEGMENTS * SEGMENT_SIZE + MAX_PAYLOAD_BYTES

#: Verdict of _check_packet for a datagram too short to answer: count and drop.
DROP_SILENTLY = 255
#: Verdict for a well-formed packet the control plane must handle.
PUNT = 254

# Opcode kinds, indexed by opcode value (0..63); 0 = unknown.
_K_READ, _K_DATA, _K_OPAQUE, _K_EMPTY, _K_FIXED = 1, 2, 3, 4, 5
_KIND = np.zeros(64, dtype=np.int64)
_FIXED_LENGTH = np.zeros(64, dtype=np.int64)
_FIXED_SIZE = np.zeros(64, dtype=np.int64)
_IS_REPLY = np.zeros(64, dtype=np.int64)
_IS_CONTROL = np.zeros(64, dtype=np.int64)
_TAKES_SR = np.zeros(64, dtype=np.int64)
_COMBINES = np.zeros(64, dtype=np.int64)
_ATOMIC = np.zeros(64, dtype=np.int64)
_PUNTED_OPS = np.zeros(64, dtype=np.int64)
for _op in (Opcode.READ,):
    _KIND[_op] = _K_READ
for _op in (Opcode.WRITE, Opcode.ADD, Opcode.CHAIN_ADD, Opcode.ALL_WRITE, Opcode.READ_RESP):
    _KIND[_op] = _K_DATA
for _op in (Opcode.INFO, Opcode.ACK, Opcode.NACK, Opcode.START_COLL):
    _KIND[_op] = _K_OPAQUE
for _op in (Opcode.PING, Opcode.JOIN, Opcode.LEAVE, Opcode.COUNTERS):
    _KIND[_op] = _K_EMPTY
for _op, (_len, _size) in {
    Opcode.FETCH_ADD: (8, 8),
    Opcode.CAS: (8, 16),
    Opcode.REGISTER: (8, 8),
    Opcode.DEREGISTER: (8, 8),
}.items():
    _KIND[_op], _FIXED_LENGTH[_op], _FIXED_SIZE[_op] = _K_FIXED, _len, _size
for _op in REPLY_OPCODES:
    _IS_REPLY[_op] = 1
    _PUNTED_OPS[_op] = 1
for _op in (
    Opcode.REGISTER,
    Opcode.DEREGISTER,
    Opcode.JOIN,
    Opcode.LEAVE,
    Opcode.START_COLL,
    Opcode.COUNTERS,
):
    _IS_CONTROL[_op] = 1
    _PUNTED_OPS[_op] = 1
_PUNTED_OPS[Opcode.PING] = 1
_TAKES_SR[Opcode.CHAIN_ADD] = _TAKES_SR[Opcode.START_COLL] = 1
_COMBINES[Opcode.ADD] = _COMBINES[Opcode.CHAIN_ADD] = 1
_ATOMIC[Opcode.FETCH_ADD] = _ATOMIC[Opcode.CAS] = 1
_ESIZE = np.array([1, 4, 2, 4, 8, 8, 8], dtype=np.int64)  # by DType value

_OP_READ = int(Opcode.READ)
_OP_READ_RESP = int(Opcode.READ_RESP)
_OP_WRITE = int(Opcode.WRITE)
_OP_ADD = int(Opcode.ADD)
_OP_CHAIN_ADD = int(Opcode.CHAIN_ADD)
_OP_ALL_WRITE = int(Opcode.ALL_WRITE)
_OP_FETCH_ADD = int(Opcode.FETCH_ADD)
_OP_CAS = int(Opcode.CAS)
_OP_ACK = int(Opcode.ACK)
_OP_NACK = int(Opcode.NACK)

_S_BAD_VERSION = int(Status.BAD_VERSION)
_S_BAD_OPCODE = int(Status.BAD_OPCODE)
_S_TRUNCATED = int(Status.TRUNCATED)
_S_BAD_LENGTH = int(Status.BAD_LENGTH)
_S_BAD_DTYPE = int(Status.BAD_DTYPE)
_S_BAD_OP = int(Status.BAD_OP)
_S_BAD_SEGMENT = int(Status.BAD_SEGMENT)
_S_BAD_RKEY = int(Status.BAD_RKEY)
_S_NO_RIGHTS = int(Status.NO_RIGHTS)
_S_OUT_OF_BOUNDS = int(Status.OUT_OF_BOUNDS)
_S_MISALIGNED = int(Status.MISALIGNED)
_S_TOO_LARGE = int(Status.TOO_LARGE)
_S_STALE = int(Status.STALE)
_S_NOT_MEMBER = int(Status.NOT_MEMBER)
_S_BAD_FIELD = int(Status.BAD_FIELD)
_S_BUSY = int(Status.BUSY)

# Where a collective packet stands on this node (see _coll_phase).
_PHASE_RUNNING, _PHASE_STALE, _PHASE_NOT_STARTED = 0, 1, 2

# Duplicate-window verdicts.
_WIN_NEW, _WIN_DUP, _WIN_STALE, _WIN_OFF = 0, 1, 2, 3


# ---------------------------------------------------------------- byte access (network order)


@njit(cache=True, nogil=True)
def _rd16(b, o):  # type: ignore[no-untyped-def]
    return (np.int64(b[o]) << 8) | np.int64(b[o + 1])


@njit(cache=True, nogil=True)
def _rd32(b, o):  # type: ignore[no-untyped-def]
    return (_rd16(b, o) << 16) | _rd16(b, o + 2)


@njit(cache=True, nogil=True)
def _rd64(b, o):  # type: ignore[no-untyped-def]
    return (np.uint64(_rd32(b, o)) << np.uint64(32)) | np.uint64(_rd32(b, o + 4))


@njit(cache=True, nogil=True)
def _wr8(b, o, v):  # type: ignore[no-untyped-def]
    b[o] = np.uint8(v & 0xFF)


@njit(cache=True, nogil=True)
def _wr16(b, o, v):  # type: ignore[no-untyped-def]
    b[o] = np.uint8((v >> 8) & 0xFF)
    b[o + 1] = np.uint8(v & 0xFF)


@njit(cache=True, nogil=True)
def _wr32(b, o, v):  # type: ignore[no-untyped-def]
    _wr16(b, o, (v >> 16) & 0xFFFF)
    _wr16(b, o + 2, v & 0xFFFF)


@njit(cache=True, nogil=True)
def _le64(b, o):  # type: ignore[no-untyped-def]
    value = np.uint64(0)
    for k in range(8):
        value |= np.uint64(b[o + k]) << np.uint64(8 * k)
    return value


@njit(cache=True, nogil=True)
def _put_le64(b, o, v):  # type: ignore[no-untyped-def]
    for k in range(8):
        b[o + k] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))


# ---------------------------------------------------------------- validation (mirrors the codec)


@njit(cache=True, nogil=True)
def _check_packet(b, n):  # type: ignore[no-untyped-def]
    """Status of datagram b[:n]: 0 to execute, PUNT, DROP_SILENTLY, or the NACK status."""
    if n < _HDR:
        return DROP_SILENTLY
    if b[0] != 1:
        return _S_BAD_VERSION
    op = np.int64(b[1])
    if op >= 64 or _KIND[op] == 0:
        return _S_BAD_OPCODE
    if b[55] != 0 or b[62] != 0 or b[63] != 0:
        return _S_BAD_FIELD
    flags = _rd16(b, 2)
    if flags & ~_FLAGS_MASK:
        return _S_BAD_FIELD
    dtype = np.int64(b[48])
    if dtype > 6:
        return _S_BAD_DTYPE
    if b[49] > 2:
        return _S_BAD_OP
    if b[50] > _MAX_STATUS:
        return _S_BAD_FIELD
    status = _check_segments(b, n)
    if status != 0:
        return status
    return _check_fields(b, n, op, flags, dtype)


@njit(cache=True, nogil=True)
def _check_segments(b, n):  # type: ignore[no-untyped-def]
    seg_type = np.int64(b[52])
    left = np.int64(b[53])
    count = np.int64(b[54])
    if seg_type > 1 or count > _MAXSEG:
        return _S_BAD_SEGMENT
    if (seg_type == 0) != (count == 0):
        return _S_BAD_SEGMENT
    if left >= max(count, 1):
        return _S_BAD_SEGMENT
    if (n - _HDR) // _SEG < count:
        return _S_TRUNCATED
    for i in range(count):
        if b[_HDR + _SEG * i + 6] != 0 or b[_HDR + _SEG * i + 7] != 0:
            return _S_BAD_SEGMENT
    return 0


@njit(cache=True, nogil=True)
def _check_fields(b, n, op, flags, dtype):  # type: ignore[no-untyped-def]
    count = np.int64(b[54])
    length = _rd32(b, 28)
    size = n - _HDR - _SEG * count
    esize = _ESIZE[dtype]
    if count > 0 and _TAKES_SR[op] == 0:
        return _S_BAD_SEGMENT
    if length > _MAXPAY and _IS_CONTROL[op] == 0:
        return _S_TOO_LARGE
    if _COMBINES[op] == 1 and dtype == 0:
        return _S_BAD_DTYPE
    if _ATOMIC[op] == 1 and dtype != _U64:
        return _S_BAD_DTYPE
    if flags & _F_SPARSE and op != _OP_CHAIN_ADD and op != _OP_ALL_WRITE and op != _OP_WRITE:
        return _S_BAD_FIELD  # no sparse form (SPEC.md 2.5)
    kind = _KIND[op]
    if kind == _K_READ:
        if size != 0 or length == 0 or length % esize != 0:
            return _S_BAD_LENGTH
    elif kind == _K_DATA:
        if flags & _F_SPARSE:
            if length == 0 or length % esize != 0:
                return _S_BAD_LENGTH
            return _check_sparse(b, n - size, size, length, esize)
        if length == 0 or length != size or length % esize != 0:
            return _S_BAD_LENGTH
    elif kind == _K_OPAQUE:
        if length != size:
            return _S_BAD_LENGTH
    elif kind == _K_EMPTY:
        if length != 0 or size != 0:
            return _S_BAD_LENGTH
    elif length != _FIXED_LENGTH[op] or size != _FIXED_SIZE[op]:
        return _S_BAD_LENGTH
    return 0


@njit(cache=True, nogil=True)
def _le32(b, o):  # type: ignore[no-untyped-def]
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8) | (np.int64(b[o + 2]) << 16) | (np.int64(b[o + 3]) << 24)


@njit(cache=True, nogil=True)
def _sparse_size(nnz, esize):  # type: ignore[no-untyped-def]
    return 8 + (2 * nnz + 7) // 8 * 8 + nnz * esize


@njit(cache=True, nogil=True)
def _check_sparse(b, p, size, length, esize):  # type: ignore[no-untyped-def]
    """Mirrors protocol.packet.check_sparse_payload on the payload b[p : p + size]."""
    if size < 8:
        return _S_TRUNCATED
    if _le32(b, p + 4) != 0:
        return _S_BAD_FIELD
    nnz = _le32(b, p)
    elements = length // esize
    if nnz > elements:
        return _S_BAD_LENGTH
    if size != _sparse_size(nnz, esize):
        return _S_BAD_LENGTH
    for k in range(p + 8 + 2 * nnz, p + 8 + (2 * nnz + 7) // 8 * 8):
        if b[k] != 0:
            return _S_BAD_FIELD
    prev = np.int64(-1)
    for k in range(nnz):
        index = np.int64(b[p + 8 + 2 * k]) | (np.int64(b[p + 9 + 2 * k]) << 8)
        if index <= prev:
            return _S_BAD_FIELD
        prev = index
    if nnz > 0 and prev >= elements:
        return _S_BAD_FIELD
    return 0


# ---------------------------------------------------------------- sparse payloads (SPEC.md 2.5)


@njit(cache=True, nogil=True)
def _nnz_typed(w):  # type: ignore[no-untyped-def]
    n = 0
    for i in range(w.shape[0]):
        if w[i] != 0:
            n += 1
    return n


@njit(cache=True, nogil=True)
def _encode_typed(w, idx, vals):  # type: ignore[no-untyped-def]
    k = 0
    for i in range(w.shape[0]):
        if w[i] != 0:
            idx[k] = i
            vals[k] = w[i]
            k += 1


@njit(cache=True, nogil=True)
def _expand_typed(w, idx, vals):  # type: ignore[no-untyped-def]
    w[:] = 0
    for k in range(idx.shape[0]):
        w[idx[k]] = vals[k]


@njit(cache=True, nogil=True)
def _count_nonzero(src, off, nbytes, esize):  # type: ignore[no-untyped-def]
    """Elements of src[off : off + nbytes] whose bits are not all zero (-0.0 counts)."""
    s = src[off : off + nbytes]
    if esize == 2:
        return _nnz_typed(s.view(np.uint16))
    if esize == 4:
        return _nnz_typed(s.view(np.uint32))
    if esize == 8:
        return _nnz_typed(s.view(np.uint64))
    return _nnz_typed(s)


@njit(cache=True, nogil=True)
def _sparse_pays(nnz, nbytes, esize):  # type: ignore[no-untyped-def]
    """The re-encode rule: sparse when under half the elements are non-zero and it is shorter."""
    return nnz * 2 < nbytes // esize and _sparse_size(nnz, esize) < nbytes


@njit(cache=True, nogil=True)
def _sparse_encode(dst, d_off, src, s_off, nbytes, esize, nnz):  # type: ignore[no-untyped-def]
    """Write the sparse form of dense src[s_off : s_off + nbytes] (nnz non-zero elements) at
    dst[d_off:] (must not overlap src); returns its size in bytes. Little-endian host."""
    pad = (2 * nnz + 7) // 8 * 8
    for k in range(4):
        dst[d_off + k] = np.uint8((nnz >> (8 * k)) & 0xFF)
        dst[d_off + 4 + k] = 0
    for k in range(2 * nnz, pad):
        dst[d_off + 8 + k] = 0
    idx = dst[d_off + 8 : d_off + 8 + 2 * nnz].view(np.uint16)
    v = d_off + 8 + pad
    s = src[s_off : s_off + nbytes]
    vals = dst[v : v + nnz * esize]
    if esize == 2:
        _encode_typed(s.view(np.uint16), idx, vals.view(np.uint16))
    elif esize == 4:
        _encode_typed(s.view(np.uint32), idx, vals.view(np.uint32))
    elif esize == 8:
        _encode_typed(s.view(np.uint64), idx, vals.view(np.uint64))
    else:
        _encode_typed(s, idx, vals)
    return 8 + pad + nnz * esize


@njit(cache=True, nogil=True)
def _sparse_expand(dst, d_off, b, p, nbytes, esize):  # type: ignore[no-untyped-def]
    """Dense form of the (validated) sparse payload at b[p:] into dst[d_off : d_off + nbytes]:
    listed elements get their value, all others all-zero bits."""
    nnz = _le32(b, p)
    idx = b[p + 8 : p + 8 + 2 * nnz].view(np.uint16)
    v = p + 8 + (2 * nnz + 7) // 8 * 8
    vals = b[v : v + nnz * esize]
    w = dst[d_off : d_off + nbytes]
    if esize == 2:
        _expand_typed(w.view(np.uint16), idx, vals.view(np.uint16))
    elif esize == 4:
        _expand_typed(w.view(np.uint32), idx, vals.view(np.uint32))
    elif esize == 8:
        _expand_typed(w.view(np.uint64), idx, vals.view(np.uint64))
    else:
        _expand_typed(w, idx, vals)


@njit(cache=True, nogil=True)
def _encode_payload(dst, d_off, src, s_off, nbytes, esize):  # type: ignore[no-untyped-def]
    """Dense src range into dst[d_off:] as sparse (when it pays) or dense; (bytes, sparse?)."""
    nnz = _count_nonzero(src, s_off, nbytes, esize)
    if _sparse_pays(nnz, nbytes, esize):
        return _sparse_encode(dst, d_off, src, s_off, nbytes, esize, nnz), True
    for k in range(nbytes):
        dst[d_off + k] = src[s_off + k]
    return nbytes, False


# ---------------------------------------------------------------- rights, members, window


@njit(cache=True, nogil=True)
def _find_rkey(rk_key, rkey):  # type: ignore[no-untyped-def]
    """Slot of *rkey* in the open-addressed table, or -1. Key 0 never matches (empty slot)."""
    if rkey == 0:
        return -1
    mask = rk_key.shape[0] - 1
    slot = (rkey * 2654435761) & mask  # Knuth multiplicative hash spreads sequential keys
    for _ in range(rk_key.shape[0]):
        key = rk_key[slot]
        if key == rkey:
            return slot
        if key == 0:
            return -1
        slot = (slot + 1) & mask
    return -1


@njit(cache=True, nogil=True)
def _check_access(rk_key, rk_base, rk_len, rk_rights, rkey, addr, nbytes, need, align):  # type: ignore[no-untyped-def]
    """0 when *rkey* grants *need* on [addr, addr+nbytes) with *align*-aligned addr, else status."""
    slot = _find_rkey(rk_key, rkey)
    if slot < 0:
        return _S_BAD_RKEY
    if (rk_rights[slot] & need) != need:
        return _S_NO_RIGHTS
    base = rk_base[slot]
    # addr is u64 on the wire: compare without overflow (addr - base could wrap).
    if addr < np.uint64(base) or addr - np.uint64(base) > np.uint64(rk_len[slot]):
        return _S_OUT_OF_BOUNDS
    if np.int64(addr - np.uint64(base)) + nbytes > rk_len[slot]:
        return _S_OUT_OF_BOUNDS
    if np.int64(addr % np.uint64(align)) != 0:
        return _S_MISALIGNED
    return 0


@njit(cache=True, nogil=True)
def _is_member(members, endpoint):  # type: ignore[no-untyped-def]
    i = np.searchsorted(members, endpoint)
    return i < members.shape[0] and members[i] == endpoint


@njit(cache=True, nogil=True)
def _reply_dst(b, src, members):  # type: ignore[no-untyped-def]
    """Where replies go: the return segment when a cluster member (switch, chain hop) wrote it,
    else the UDP source. A client cannot aim replies at a third party (SPEC.md "Rights")."""
    ret = np.uint64((_rd32(b, 56) << 16) | _rd16(b, 60))
    if ret != 0 and _is_member(members, src):
        return ret
    return src


#: Ways of the set-associative client table: clients whose keys share a set evict each other
#: only when more than this many retry at once (a direct-mapped table evicted on any collision,
#: and a hashed client id collides mod 256 for 8 clients about one time in ten).
_WAYS = 4


@njit(cache=True, nogil=True)
def _requester_key(client, requester):  # type: ignore[no-untyped-def]
    """Window key of a request: the client id bound to where its reply goes (the return segment
    from a member, else the UDP source), so nobody can replay into or poison another requester's
    history by borrowing its client id: the cached reply would go to the victim, not to them."""
    k = _mix(np.uint64(client) ^ _mix(np.uint64(requester) ^ np.uint64(0x5851F42D4C957F2D)))
    if k == 0:
        k = np.uint64(1)
    return k


@njit(cache=True, nogil=True)
def _window_check(cl_id, cl_hi, cl_used, w_txn, w_state, client, requester, txn, stamp):  # type: ignore[no-untyped-def]
    """At-most-once window (SPEC.md "Memory semantics"): NEW, DUP or STALE for (client, txn).

    Slots are keyed by (client id, requester) and set-associative (_WAYS per set); a new
    requester takes a free way of its set, else evicts the least recently used one (*stamp*,
    > 0, grows with every received packet). Client id 0 opts out (every request executes).
    """
    if client == 0:
        return _WIN_OFF, 0, 0
    key = _requester_key(client, requester)
    first = np.int64(key % np.uint64(cl_id.shape[0] // _WAYS)) * _WAYS
    c = -1
    for j in range(first, first + _WAYS):
        if cl_used[j] != 0 and cl_id[j] == key:
            c = j
            break
    w = txn % _W
    if c < 0:
        c = first
        for j in range(first, first + _WAYS):
            if cl_used[j] < cl_used[c]:
                c = j  # a free way (0) or the least recently used
        cl_used[c] = stamp
        cl_id[c] = key
        cl_hi[c] = txn
        w_state[c, :] = 0
        return _WIN_NEW, c, w
    cl_used[c] = stamp
    hi = np.int64(cl_hi[c])
    # Serial-number arithmetic (RFC 1982) on u32 transaction ids: behind by `back`.
    back = (hi - txn) & 0xFFFFFFFF
    if back < 0x80000000:
        if back >= _W:
            return _WIN_STALE, c, w
        if w_state[c, w] != 0 and w_txn[c, w] == txn:
            return _WIN_DUP, c, w
        return _WIN_NEW, c, w
    ahead = (txn - hi) & 0xFFFFFFFF
    if ahead >= _W:
        w_state[c, :] = 0
    else:
        for j in range(1, ahead + 1):
            w_state[c, (hi + j) % _W] = 0
    cl_hi[c] = txn
    return _WIN_NEW, c, w


@njit(cache=True, nogil=True)
def _window_record(w_txn, w_state, w_len, w_reply, c, w, txn, reply, reply_len):  # type: ignore[no-untyped-def]
    """Remember that (client slot c, txn) executed and what it answered (reply_len 0: nothing)."""
    w_txn[c, w] = txn
    w_state[c, w] = 1
    w_len[c, w] = reply_len
    for k in range(reply_len):
        w_reply[c, w, k] = reply[k]


@njit(cache=True, nogil=True)
def _coll_phase(co_cfg, coll, epoch):  # type: ignore[no-untyped-def]
    """RUNNING when (coll, epoch) is this node's current collective (running or finished),
    STALE for an earlier epoch of it, NOT_STARTED otherwise (the host has not started it here
    yet: its input may not be staged, so nothing of it may be read or written)."""
    if co_cfg[CFG_STATE] != 0 and coll == co_cfg[CFG_COLL]:
        behind = (co_cfg[CFG_EPOCH] - epoch) & 0xFFFFFFFF
        if behind == 0:
            return _PHASE_RUNNING
        if behind < 0x80000000:
            return _PHASE_STALE
    return _PHASE_NOT_STARTED


# ---------------------------------------------------------------- output helpers


@njit(cache=True, nogil=True)
def _reply_header(t, b, opcode, status, length, credit):  # type: ignore[no-untyped-def]
    """Write a reply header into t from request header b: ids echoed, SR list dropped."""
    for k in range(_HDR):
        t[k] = b[k]
    # A reply is always a valid v1 header, even when it NACKs an invalid one: fields that
    # failed validation are not echoed (SPEC.md section 3).
    t[0] = 1
    t[1] = opcode
    if t[48] > 6:
        t[48] = 0
    if t[49] > 2:
        t[49] = 0
    t[55] = 0
    t[62] = 0
    t[63] = 0
    _wr16(t, 2, _rd16(b, 2) & _F_KEEP_IN_REPLY)
    _wr32(t, 28, length)
    t[50] = status
    t[51] = credit
    t[52] = 0
    t[53] = 0
    t[54] = 0


@njit(cache=True, nogil=True)
def _credit(tx_n, cap):  # type: ignore[no-untyped-def]
    """Congestion byte of replies: send-queue occupancy scaled to 0..255 (SPEC.md "credit")."""
    return min(255, (tx_n * 255) // cap)


@njit(cache=True, nogil=True)
def _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters):  # type: ignore[no-untyped-def]
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _reply_header(t, b, _OP_NACK, status, 0, _credit(tx_n, tx_len.shape[0]))
    tx_len[tx_n] = _HDR
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = _reply_dst(b, src, members)
    counters[C.NACK_BASE + status] += 1
    return tx_n + 1


# ---------------------------------------------------------------- the batch kernel


def process_batch(rx: RxBatch, n: int, max_len: int, node: NodeState, tx: TxQueue, tx_n: int,
                  punt: np.ndarray) -> tuple[int, int]:  # fmt: skip
    """Checked entry to the datapath (numba checks no bounds): execute rx[0:n] against *node*,
    append answers to *tx* from *tx_n*; returns (tx_n, n_punt), punted indices in *punt*."""
    if not 0 <= n <= min(rx.off.shape[0], rx.len.shape[0], rx.src.shape[0], punt.shape[0]):
        raise ValueError(f"batch of {n} does not fit its arrays")
    if not 0 <= tx_n < tx.len.shape[0] or tx.off.shape[0] != tx.len.shape[0] + 1:
        raise ValueError(f"send queue tail {tx_n} outside its {tx.len.shape[0]} slots")
    if node.mem.dtype != np.uint8 or node.counters.shape[0] < C.NUM_COUNTERS:
        raise ValueError("node state: memory must be uint8 and counters full size")
    tx_n, n_punt = _process_batch(rx, n, max_len, node, tx, tx_n, punt)
    return int(tx_n), int(n_punt)


@njit(cache=True, nogil=True)
def _process_batch(rx, n, max_len, node, tx, tx_n, punt):  # type: ignore[no-untyped-def]
    """Execute datagrams rx_buf[rx_off[i] : rx_off[i] + rx_len[i]] for i < n; append replies and
    forwards to the send queue from tx_n (packet k at tx_buf[tx_off[k] : tx_off[k] + tx_len[k]],
    packed back to back so runs to one destination can leave as one GSO send; tx_off[tx_n] is
    the next free byte). Returns (tx_n, n_punt)."""
    rx_buf, rx_off, rx_len, rx_src = rx
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    _co_cfg, _co_done, _co_acked = coll.cfg, coll.done, coll.acked
    cl_id, cl_hi, cl_used, w_txn, w_state, w_len, w_reply = window
    tx_buf, tx_off, tx_len, tx_dst = tx
    n_punt = 0
    cap = tx_len.shape[0]
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
        if tx_n >= cap or tx_off[tx_n] + _SLOT > tx_buf.shape[0]:
            counters[C.DROP_TX_FULL] += 1
            continue
        status = _check_packet(b, ln)
        op = np.int64(b[1]) if ln > 1 else 0
        if status == DROP_SILENTLY:
            counters[C.DROP_TRUNCATED] += 1
            continue
        if status == 0 and _IS_REPLY[op] == 1 and _rd32(b, 16) != 0:
            counters[C.OPCODE_BASE + op] += 1
            if _coll_reply(b, ln, src, op, node):
                continue  # consumed by the collective engine, in the datapath
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if status == PUNT or (status == 0 and _PUNTED_OPS[op] == 1):
            if status == 0:
                counters[C.OPCODE_BASE + op] += 1
            punt[n_punt] = i
            n_punt += 1
            counters[C.PUNTED] += 1
            continue
        if status != 0:
            if op < 64 and _IS_REPLY[op] == 1:
                counters[C.DROP_BAD_REPLY] += 1  # never answer a reply: no NACK storms
                continue
            tx_n = _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
            continue
        counters[C.OPCODE_BASE + op] += 1
        if op == _OP_CHAIN_ADD:
            tx_n = _chain_add(b, ln, src, node, tx, tx_n)
        elif op == _OP_READ:
            tx_n = _read(b, src, node, tx, tx_n, max_len)
        elif op == _OP_ALL_WRITE:
            tx_n = _all_write(b, ln, src, node, tx, tx_n)
        else:
            tx_n = _mutate(b, ln, src, op, node, tx, tx_n)
    return tx_n, n_punt


@njit(cache=True, nogil=True)
def _read(b, src, node, tx, tx_n, max_len):  # type: ignore[no-untyped-def]
    """READ; a collective's repair READ (coll_id != 0) is served only once the chunk is final.
    A READ whose reply would not fit this node's MTU (*max_len*) is TOO_LARGE: the kernel would
    refuse to send it (EMSGSIZE) and the client would only see a timeout."""
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    co_cfg, co_done, _co_acked = coll.cfg, coll.done, coll.acked
    tx_buf, tx_off, tx_len, tx_dst = tx
    length = _rd32(b, 28)
    if _HDR + length > max_len:
        return _emit_nack(b, src, members, _S_TOO_LARGE, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    addr = _rd64(b, 32)
    esize = _ESIZE[np.int64(b[48])]
    coll = _rd32(b, 16)
    if coll != 0 and _coll_phase(co_cfg, coll, _rd32(b, 20)) == _PHASE_NOT_STARTED:
        # Before the rkey check: the host may not have registered the group's key here yet.
        return _emit_nack(b, src, members, _S_BUSY, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    status = _check_access(
        rk_key, rk_base, rk_len, rk_rights, _rd32(b, 24), addr, length, _R_READ, esize
    )
    if status == 0 and coll != 0:
        seq = _rd32(b, 4)
        phase = _coll_phase(co_cfg, coll, _rd32(b, 20))
        if phase == _PHASE_STALE:
            counters[C.DROP_STALE_EPOCH] += 1
            return tx_n
        if phase == _PHASE_NOT_STARTED or seq >= co_cfg[CFG_CHUNKS] or co_done[seq] == 0:
            status = _S_BUSY  # not reduced here yet: the reader asks again later
    if status != 0:
        return _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    _reply_header(t, b, _OP_READ_RESP, 0, length, _credit(tx_n, tx_len.shape[0]))
    a = np.int64(addr)
    t[_HDR : _HDR + length] = mem[a : a + length]
    tx_len[tx_n] = _HDR + length
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = _reply_dst(b, src, members)
    return tx_n + 1


@njit(cache=True, nogil=True)
def _all_write(b, ln, src, node, tx, tx_n):  # type: ignore[no-untyped-def]
    """Multicast write: idempotent, so no duplicate window; ACK only when asked. Inside a
    collective (coll_id != 0) it is the all-gather: written once per chunk, and only after the
    host started the collective here (before that the output may still be staged over)."""
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    co_cfg, co_done, _co_acked = coll.cfg, coll.done, coll.acked
    tx_buf, tx_off, tx_len, tx_dst = tx
    length = _rd32(b, 28)
    addr = _rd64(b, 32)
    esize = _ESIZE[np.int64(b[48])]
    coll = _rd32(b, 16)
    if coll != 0 and _coll_phase(co_cfg, coll, _rd32(b, 20)) == _PHASE_NOT_STARTED:
        counters[C.DROP_COLL_EARLY] += 1  # before the rkey check: it may not be registered yet
        return tx_n  # fetched again by READ repair once started
    status = _check_access(
        rk_key, rk_base, rk_len, rk_rights, _rd32(b, 24), addr, length, _R_WRITE, esize
    )
    if status != 0:
        return _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    if coll != 0:
        seq = _rd32(b, 4)
        phase = _coll_phase(co_cfg, coll, _rd32(b, 20))
        if phase != _PHASE_RUNNING or seq >= co_cfg[CFG_CHUNKS]:
            counters[C.DROP_STALE_EPOCH if phase == _PHASE_STALE else C.DROP_COLL_EARLY] += 1
            return tx_n  # an early one is fetched again by READ repair once started
        if co_done[seq] != 0:
            counters[C.DUP_SILENT] += 1
            return tx_n
        co_done[seq] = 1
        co_cfg[CFG_DONE_COUNT] += 1
    a = np.int64(addr)
    if _rd16(b, 2) & _F_SPARSE:
        _sparse_expand(mem, a, b, np.int64(_HDR), np.int64(length), esize)  # the rest zeroed
    else:
        mem[a : a + length] = b[_HDR : _HDR + length]
    if _rd16(b, 2) & _F_ACK_REQ:
        t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
        _reply_header(t, b, _OP_ACK, 0, 0, _credit(tx_n, tx_len.shape[0]))
        tx_len[tx_n] = _HDR
        tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
        tx_dst[tx_n] = _reply_dst(b, src, members)
        return tx_n + 1
    return tx_n


@njit(cache=True, nogil=True)
def _mutate(b, ln, src, op, node, tx, tx_n):  # type: ignore[no-untyped-def]
    """WRITE, ADD, FETCH_ADD, CAS: at most once per (client id, txn id)."""
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    cl_id, cl_hi, cl_used, w_txn, w_state, w_len, w_reply = window
    tx_buf, tx_off, tx_len, tx_dst = tx
    length = _rd32(b, 28)
    addr = _rd64(b, 32)
    dtype = np.int64(b[48])
    if op == _OP_WRITE:
        need, align = _R_WRITE, _ESIZE[dtype]
    elif op == _OP_ADD:
        need, align = _R_WRITE, _ESIZE[dtype]
    else:
        need, align = _R_ATOMIC, 8
    status = _check_access(
        rk_key, rk_base, rk_len, rk_rights, _rd32(b, 24), addr, length, need, align
    )
    if status != 0:
        return _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    client = _rd32(b, 8)
    txn = _rd32(b, 12)
    dst = _reply_dst(b, src, members)
    stamp = np.int64(counters[C.RX_PACKETS]) + 1
    verdict, c, w = _window_check(cl_id, cl_hi, cl_used, w_txn, w_state, client, dst, txn, stamp)
    if verdict == _WIN_STALE:
        return _emit_nack(b, src, members, _S_STALE, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    if verdict == _WIN_DUP:
        reply_len = np.int64(w_len[c, w])
        if reply_len == 0:
            counters[C.DUP_SILENT] += 1
            return tx_n
        counters[C.DUP_REPLAYS] += 1
        t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
        t[:reply_len] = w_reply[c, w, :reply_len]
        tx_len[tx_n] = reply_len
        tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
        tx_dst[tx_n] = dst
        return tx_n + 1
    a = np.int64(addr)
    t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
    reply_len = 0
    if op == _OP_WRITE or op == _OP_ADD:
        if op == _OP_WRITE:
            if _rd16(b, 2) & _F_SPARSE:
                _sparse_expand(mem, a, b, np.int64(_HDR), np.int64(length), _ESIZE[dtype])
            else:
                mem[a : a + length] = b[_HDR : _HDR + length]
        else:
            _combine_bytes(
                mem, a, mem, a, b, np.int64(_HDR), np.int64(length), dtype, np.int64(b[49])
            )
            counters[C.BYTES_COMBINED] += length
        if _rd16(b, 2) & _F_ACK_REQ:
            _reply_header(t, b, _OP_ACK, 0, 0, _credit(tx_n, tx_len.shape[0]))
            reply_len = _HDR
    else:
        old = _le64(mem, a)
        if op == _OP_FETCH_ADD:
            _put_le64(mem, a, old + _le64(b, _HDR))  # u64 wraps, as the hardware adder would
        elif old == _le64(b, _HDR):
            _put_le64(mem, a, _le64(b, _HDR + 8))
        _reply_header(t, b, _OP_ACK, 0, 8, _credit(tx_n, tx_len.shape[0]))
        _put_le64(t, _HDR, old)
        reply_len = _HDR + 8
    if verdict == _WIN_NEW:
        _window_record(w_txn, w_state, w_len, w_reply, c, w, txn, t, reply_len)
    if reply_len == 0:
        return tx_n
    tx_len[tx_n] = reply_len
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = dst
    return tx_n + 1


@njit(cache=True, nogil=True)
def _scratch(tx_buf, tx_off, tx_n):  # type: ignore[no-untyped-def]
    """A dense payload's worth of scratch: the send slot after the current one when the queue
    has it, else a fresh array (rare: a nearly full queue)."""
    start = tx_off[tx_n] + _SLOT
    if start + _MAXPAY <= tx_buf.shape[0]:
        return tx_buf[start : start + _MAXPAY]
    return np.zeros(_MAXPAY, np.uint8)


@njit(cache=True, nogil=True)
def _chain_add(b, ln, src, node, tx, tx_n):  # type: ignore[no-untyped-def]
    """Combine local memory into the payload; forward to the next segment or, at the last hop,
    store at aux_addr (once per (coll_id, epoch, seq)) and ACK the originator."""
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    co_cfg, co_done, _co_acked = coll.cfg, coll.done, coll.acked
    tx_buf, tx_off, tx_len, tx_dst = tx
    length = _rd32(b, 28)
    addr = _rd64(b, 32)
    store_addr = _rd64(b, 40)
    dtype = np.int64(b[48])
    op = np.int64(b[49])
    esize = _ESIZE[dtype]
    rkey = _rd32(b, 24)
    left = np.int64(b[53])
    count = np.int64(b[54])
    coll = _rd32(b, 16)
    if coll != 0 and _coll_phase(co_cfg, coll, _rd32(b, 20)) == _PHASE_NOT_STARTED:
        # This node's host has not started the collective (nor, maybe, registered its key):
        # BUSY, before the rkey check, so the sender backs off instead of failing.
        return _emit_nack(b, src, members, _S_BUSY, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    # Read rights at every hop: the partial sum discloses this node's operand to the next hop.
    status = _check_access(rk_key, rk_base, rk_len, rk_rights, rkey, addr, length, _R_READ, esize)
    if status == 0 and left == 0:
        status = _check_access(
            rk_key, rk_base, rk_len, rk_rights, rkey, store_addr, length, _R_WRITE, esize
        )
    nxt = np.uint64(0)
    if status == 0 and left > 0:
        o = _HDR + _SEG * (count - left)
        nxt = np.uint64((_rd32(b, o) << 16) | _rd16(b, o + 4))
        if not _is_member(members, nxt):
            status = _S_NOT_MEMBER  # nodes relay only inside their cluster
    seq = _rd32(b, 4)
    guarded = False
    if status == 0 and coll != 0:
        phase = _coll_phase(co_cfg, coll, _rd32(b, 20))
        if phase == _PHASE_STALE:
            counters[C.DROP_STALE_EPOCH] += 1
            return tx_n
        if phase == _PHASE_NOT_STARTED:
            status = _S_BUSY  # this node has not started that collective: retry later
        elif seq >= co_cfg[CFG_CHUNKS]:
            status = _S_TOO_LARGE
        else:
            guarded = True
    if status != 0:
        return _emit_nack(b, src, members, status, tx_buf, tx_off, tx_len, tx_dst, tx_n, counters)
    payload_off = _HDR + _SEG * count
    a = np.int64(addr)
    sparse_in = (_rd16(b, 2) & _F_SPARSE) != 0
    sparse_mode = guarded and co_cfg[CFG_SPARSE] != 0
    if left > 0:
        t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
        for k in range(payload_off):
            t[k] = b[k]
        t[53] = left - 1
        if (_rd32(b, 56) == 0 and _rd16(b, 60) == 0) or not _is_member(members, src):
            # First relay of a chain: record the originator so the last hop can ACK it. A
            # return segment written by a non-member is replaced: replies never go to a third party.
            _wr32(t, 56, np.int64(src >> np.uint64(16)))
            _wr16(t, 60, np.int64(src & np.uint64(0xFFFF)))
        nbytes = np.int64(length)
        if sparse_in or sparse_mode:
            # Dense running value in a scratch (the next send slot when free), combined there,
            # then re-encoded into the forwarded packet: sparse when it pays, else dense.
            x = _scratch(tx_buf, tx_off, tx_n)
            if sparse_in:
                _sparse_expand(x, np.int64(0), b, np.int64(payload_off), nbytes, esize)
            else:
                x[:length] = b[payload_off : payload_off + length]
            _combine_bytes(x, np.int64(0), x, np.int64(0), mem, a, nbytes, dtype, op)
            nbytes, sparse_out = _encode_payload(t, np.int64(payload_off), x, np.int64(0), nbytes, esize)
            flags = _rd16(b, 2) & ~_F_SPARSE
            _wr16(t, 2, flags | (_F_SPARSE if sparse_out else 0))
        else:
            _combine_bytes(
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
        scratch = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
        if sparse_in:
            _sparse_expand(scratch, np.int64(_HDR), b, np.int64(payload_off), np.int64(length), esize)
            _combine_bytes(
                scratch, np.int64(_HDR), scratch, np.int64(_HDR), mem, a, np.int64(length), dtype, op
            )
        else:
            _combine_bytes(
                scratch, np.int64(_HDR), b, np.int64(payload_off), mem, a, np.int64(length), dtype, op
            )
        mem[s : s + length] = scratch[_HDR : _HDR + length]
        counters[C.BYTES_COMBINED] += length
        counters[C.STORED] += 1
        if guarded:
            co_done[seq] = 1
            co_cfg[CFG_DONE_COUNT] += 1
    if _rd16(b, 2) & _F_ACK_REQ:
        t = tx_buf[tx_off[tx_n] : tx_off[tx_n] + _SLOT]
        _reply_header(t, b, _OP_ACK, 0, 0, _credit(tx_n, tx_len.shape[0]))
        tx_len[tx_n] = _HDR
        tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
        tx_dst[tx_n] = _reply_dst(b, src, members)
        return tx_n + 1
    return tx_n


@njit(cache=True, nogil=True)
def _coll_done_msg(b, src, co_cfg):  # type: ignore[no-untyped-def]
    """A member's DONE: for this epoch, note it; for the previous epoch (that member may have
    lost this node's DONE while this node moved on), ask the engine to repeat it."""
    world = co_cfg[CFG_WORLD]
    rank = _rd32(b, 4)  # DONE carries the sender's rank in seq
    if co_cfg[CFG_STATE] == 0 or rank >= world:
        return True
    epoch = _rd32(b, 20)
    asks = _rd32(b, 12) == 0  # txn_id 1 marks an answer, which is never answered
    if epoch == co_cfg[CFG_EPOCH]:
        co_cfg[CFG_PEERS_DONE] |= np.int64(1) << rank
        ready = (co_cfg[CFG_PEERS_DONE] >> co_cfg[CFG_RANK]) & 1
        if asks and (co_cfg[CFG_STATE] != 1 or ready):
            # This node is ready (or finished): answer at once, so a member that started late
            # need not wait a retransmission timeout for the DONE it missed.
            co_cfg[CFG_CUR_ASK] |= np.int64(1) << rank
    elif asks and ((co_cfg[CFG_EPOCH] - epoch) & 0xFFFFFFFF) == 1:
        co_cfg[CFG_PREV_ASK] |= np.int64(1) << rank
    return True


@njit(cache=True, nogil=True)
def _coll_bitmap_msg(b, ln, co_cfg, co_done, counters):  # type: ignore[no-untyped-def]
    """A member's per-chunk non-zero bitmap (sparse mode, SPEC.md 4.1): OR it in once; a request
    (txn_id 0) is answered with ours by the next tick, an answer (txn_id 1) proves the member
    holds ours. Dropped unless this node runs that very collective and epoch."""
    rank = _rd32(b, 4)
    nbytes = _rd32(b, 28)
    chunks = co_cfg[CFG_CHUNKS]
    if (
        co_cfg[CFG_STATE] != 1
        or co_cfg[CFG_SPARSE] == 0
        or _rd32(b, 16) != co_cfg[CFG_COLL]
        or _rd32(b, 20) != co_cfg[CFG_EPOCH]
        or rank >= co_cfg[CFG_WORLD]
        or nbytes != (chunks + 7) // 8
    ):
        counters[C.DROP_COLL_EARLY] += 1
        return
    bit = np.int64(1) << rank
    if co_cfg[CFG_BM_GOT] & bit == 0:
        for c in range(chunks):
            if (b[_HDR + (c >> 3)] >> (c & 7)) & 1:
                co_done[NZ_BASE + c] = 1
        co_cfg[CFG_BM_GOT] |= bit
    if _rd32(b, 12) == 1:
        co_cfg[CFG_BM_HAS] |= bit
    else:
        co_cfg[CFG_BM_ASK] |= bit


@njit(cache=True, nogil=True)
def _coll_reply(b, ln, src, op, node):  # type: ignore[no-untyped-def]
    """Replies of the running collective, handled here so no reply costs Python: chain ACKs
    free the originator's window, NACKs BUSY are retried by the timer (others fail the
    collective), READ_RESPs of repair READs fill the missing chunk. False: not ours, punt."""
    mem, regions, members, window, coll, counters = node
    rk_key, rk_base, rk_len, rk_rights = regions
    co_cfg, co_done, co_acked = coll.cfg, coll.done, coll.acked
    if not _is_member(members, src):
        return False
    if op == _OP_ACK and _rd64(b, 40) == AUX_DONE and _rd32(b, 16) == co_cfg[CFG_COLL]:
        return _coll_done_msg(b, src, co_cfg)
    if op == _OP_ACK and _rd64(b, 40) == AUX_BITMAP:
        _coll_bitmap_msg(b, ln, co_cfg, co_done, counters)
        return True
    if co_cfg[CFG_STATE] != 1 or _coll_phase(co_cfg, _rd32(b, 16), _rd32(b, 20)) != _PHASE_RUNNING:
        return False
    seq = _rd32(b, 4)
    if seq >= co_cfg[CFG_CHUNKS]:
        return False
    if op == _OP_ACK:
        if co_acked[seq] != 1:
            co_acked[seq] = 1
            co_cfg[CFG_ACKED] += 1
            co_cfg[CFG_INFLIGHT] -= 1
        return True
    if op == _OP_NACK:
        status = np.int64(b[50])
        if status == _S_BUSY:
            if co_acked[seq] == 0:
                co_acked[seq] = 2  # a hop has not started yet: flow control, not loss
        elif co_cfg[CFG_FATAL] == 0:
            co_cfg[CFG_FATAL] = status
        return True
    if op == _OP_READ_RESP:
        length = _rd32(b, 28)
        addr = _rd64(b, 32)
        esize = _ESIZE[np.int64(b[48])]
        # The answer lands in this node's memory: this node's rights on that range apply.
        if _check_access(rk_key, rk_base, rk_len, rk_rights, _rd32(b, 24), addr, length, _R_WRITE, esize) != 0:
            return True
        if co_done[seq] == 0:
            a = np.int64(addr)
            mem[a : a + length] = b[_HDR : _HDR + length]
            co_done[seq] = 1
            co_cfg[CFG_DONE_COUNT] += 1
        return True
    return False


@njit(cache=True, nogil=True)
def _drain(tx_buf, tx_off, tx_len, tx_dst, start, count, out_buf, out_off, out_len, out_dst):  # type: ignore[no-untyped-def]
    """Copy queued datagrams start.. into the caller's batch, back to back, while they fit.
    Returns how many were copied."""
    pos = 0
    limit = min(count, out_len.shape[0])
    for k in range(limit):
        ln = tx_len[start + k]
        if pos + ln > out_buf.shape[0]:
            return k
        src = tx_off[start + k]
        out_buf[pos : pos + ln] = tx_buf[src : src + ln]
        out_off[k] = pos
        out_len[k] = ln
        out_dst[k] = tx_dst[start + k]
        pos += ln
    return limit


def drain(tx: TxQueue, start: int, count: int, out: TxQueue) -> int:
    """Copy queued datagrams [start, start + count) into *out*'s arrays, as many as fit; returns how many."""
    if not 0 <= start <= start + count <= tx.len.shape[0]:
        raise ValueError(f"drain [{start}, {start + count}) outside the queue's {tx.len.shape[0]} slots")
    return int(_drain(tx.buf, tx.off, tx.len, tx.dst, start, count, out.buf, out.off, out.len, out.dst))


def window_check(window: DupWindow, client: int, requester: int, txn: int, stamp: int) -> tuple[int, int, int]:
    """The duplicate window's verdict for (client, requester, txn): (0 new | 1 duplicate | 2 stale,
    client slot, window slot)."""
    verdict, c, w = _window_check(window.cl_id, window.cl_hi, window.cl_used, window.txn, window.state,
                                  client, requester, txn, stamp)  # fmt: skip
    return int(verdict), int(c), int(w)


def window_record(window: DupWindow, c: int, w: int, txn: int, reply: np.ndarray) -> None:
    """Remember *reply* for (client slot c, window slot w) so a retry gets it again."""
    if not (0 <= c < window.txn.shape[0] and 0 <= w < window.txn.shape[1]):
        raise ValueError(f"window slot ({c}, {w}) outside the window")
    if reply.shape[0] > window.reply.shape[2]:
        raise ValueError(f"reply of {reply.shape[0]} bytes longer than the window keeps")
    _window_record(window.txn, window.state, window.len, window.reply, c, w, txn, reply, reply.shape[0])
