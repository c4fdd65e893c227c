"""The bytes of a NetDAM datagram as the kernels see them: field readers and writers, the
checks (in decode_packet's order), access rules, ACK/NACK emitters, the sparse codec and the
opcode tables every kernel dispatches on. Fields are read and written at the offsets
protocol/layout.py names (H_SEQ, SEG_PORT, SP_NNZ ...): numba compiles them as constants."""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.state import Regions, TxQueue
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DATA_OPCODES,
    DUP_REPLY_BYTES,
    DUP_WINDOW,
    ELEMENT_SIZE,
    FLAGS_V1_MASK,
    HEADER_SIZE,
    MAX_MTU,
    MAX_SEGMENTS,
    MIN_MTU,
    POOL_OPCODES,
    REPLY_OPCODES,
    SEGMENT_SIZE,
    SLOT_OVERHEAD_BYTES,
    UPDATE_DTYPES,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
    slot_bytes,
)
from netdam.protocol.layout import (
    H_CREDIT,
    H_DTYPE,
    H_FLAGS,
    H_LENGTH,
    H_OPCODE,
    H_REDUCE_OP,
    H_RESERVED1,
    H_RESERVED2,
    H_RET_IP,
    H_RET_PORT,
    H_SEG_COUNT,
    H_SEG_TYPE,
    H_SEGMENTS_LEFT,
    H_STATUS,
    H_VERSION,
    SEG_RESERVED,
    SP_INDICES,
    SP_NNZ,
    SP_RESERVED,
)

# numba freezes module-level ints and arrays at compile time: plain copies of the wire constants.
HDR = HEADER_SIZE


SEG = SEGMENT_SIZE


_MAXSEG = MAX_SEGMENTS


_FLAGS_MASK = FLAGS_V1_MASK


F_ACK_REQ = int(Flags.ACK_REQ)


F_SPARSE = int(Flags.SPARSE)


_F_KEEP_IN_REPLY = int(Flags.RELAYED | Flags.MCAST)


R_READ = int(Rights.READ)


R_WRITE = int(Rights.WRITE)


R_ATOMIC = int(Rights.ATOMIC)
_R_MEMBERS = int(Rights.MEMBERS)


_U64 = int(DType.U64)


_MAX_STATUS = max(int(s) for s in Status)
#: Highest dtype code a node knows (SPEC.md 2.4); a higher one is BAD_DTYPE.
_MAX_DTYPE = max(int(d) for d in DType)


W = DUP_WINDOW


_REPLY_MAX = DUP_REPLY_BYTES


@njit(cache=True, nogil=True)
def slot_payload(slot):
    """The largest payload of a core whose send slot is *slot* bytes (constants.largest_payload
    of its MTU): what check_packet lets a data opcode carry."""
    return slot - SLOT_OVERHEAD_BYTES


#: Verdict of check_packet for a datagram too short to answer: count and drop.
DROP_SILENTLY = 255


#: Verdict for a well-formed packet the control plane must handle.
PUNT = 254


# Opcode kinds, indexed by opcode value (0..63); 0 = unknown.
_K_READ, _K_DATA, _K_OPAQUE, _K_EMPTY, _K_FIXED = 1, 2, 3, 4, 5


_KIND = np.zeros(64, dtype=np.int64)


_FIXED_LENGTH = np.zeros(64, dtype=np.int64)


_FIXED_SIZE = np.zeros(64, dtype=np.int64)


#: A second length (= payload size) a fixed payload may have, 0: none. REGISTER with a region's
#: tag key (SPEC.md 6.1); protocol/packet.py's _FIXED_PAYLOAD_ALT declares the same.
_FIXED_ALT = np.zeros(64, dtype=np.int64)
_FIXED_ALT[Opcode.REGISTER] = 24


IS_REPLY = np.zeros(64, dtype=np.int64)


IS_CONTROL = np.zeros(64, dtype=np.int64)


_TAKES_SR = np.zeros(64, dtype=np.int64)


_COMBINES = np.zeros(64, dtype=np.int64)


_ATOMIC = np.zeros(64, dtype=np.int64)


PUNTED_OPS = np.zeros(64, dtype=np.int64)


for _op in (Opcode.READ,):
    _KIND[_op] = _K_READ


for _op in DATA_OPCODES:
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
    Opcode.ALLOC: (40, 40),
    Opcode.FREE: (8, 8),
    Opcode.QUERY: (8, 8),
}.items():
    _KIND[_op], _FIXED_LENGTH[_op], _FIXED_SIZE[_op] = _K_FIXED, _len, _size


for _op in REPLY_OPCODES:
    IS_REPLY[_op] = 1
    PUNTED_OPS[_op] = 1


for _op in (
    Opcode.REGISTER,
    Opcode.DEREGISTER,
    Opcode.JOIN,
    Opcode.LEAVE,
    Opcode.START_COLL,
    Opcode.COUNTERS,
):
    IS_CONTROL[_op] = 1
    PUNTED_OPS[_op] = 1


PUNTED_OPS[Opcode.PING] = 1


for _op in POOL_OPCODES:  # the switch's controller serves them; a node NACKs them BAD_FIELD
    PUNTED_OPS[_op] = 1


_TAKES_SR[Opcode.CHAIN_ADD] = _TAKES_SR[Opcode.START_COLL] = 1


_COMBINES[Opcode.ADD] = _COMBINES[Opcode.CHAIN_ADD] = 1


_ATOMIC[Opcode.FETCH_ADD] = _ATOMIC[Opcode.CAS] = 1


#: The dtypes an UPDATE's gradient may have (protocol/constants.py UPDATE_DTYPES), by value.
_GRADIENT_DTYPE = np.zeros(len(DType), dtype=np.int64)
for _dtype in UPDATE_DTYPES:
    _GRADIENT_DTYPE[_dtype] = 1


ESIZE = np.array(
    [ELEMENT_SIZE[DType(code)] for code in range(len(DType))], dtype=np.int64
)  # by DType value


OP_READ = int(Opcode.READ)


OP_READ_RESP = int(Opcode.READ_RESP)


OP_WRITE = int(Opcode.WRITE)


OP_ADD = int(Opcode.ADD)


OP_CHAIN_ADD = int(Opcode.CHAIN_ADD)


OP_ALL_WRITE = int(Opcode.ALL_WRITE)


OP_FETCH_ADD = int(Opcode.FETCH_ADD)


OP_UPDATE = int(Opcode.UPDATE)


_OP_CAS = int(Opcode.CAS)


OP_ACK = int(Opcode.ACK)


OP_NACK = int(Opcode.NACK)
OP_START_COLL = int(Opcode.START_COLL)


_S_BAD_VERSION = int(Status.BAD_VERSION)


_S_BAD_OPCODE = int(Status.BAD_OPCODE)


_S_TRUNCATED = int(Status.TRUNCATED)


_S_BAD_LENGTH = int(Status.BAD_LENGTH)


_S_BAD_DTYPE = int(Status.BAD_DTYPE)


_S_BAD_OP = int(Status.BAD_OP)


_S_BAD_SEGMENT = int(Status.BAD_SEGMENT)


S_BAD_RKEY = int(Status.BAD_RKEY)


_S_NO_RIGHTS = int(Status.NO_RIGHTS)


_S_OUT_OF_BOUNDS = int(Status.OUT_OF_BOUNDS)


_S_MISALIGNED = int(Status.MISALIGNED)


S_TOO_LARGE = int(Status.TOO_LARGE)


S_STALE = int(Status.STALE)


S_NOT_MEMBER = int(Status.NOT_MEMBER)


_S_BAD_FIELD = int(Status.BAD_FIELD)


S_BUSY = int(Status.BUSY)
S_UNAUTHORIZED = int(Status.UNAUTHORIZED)


# Where a collective packet stands on this node (see coll_phase).
PHASE_RUNNING, PHASE_STALE, PHASE_NOT_STARTED = 0, 1, 2


@njit(cache=True, nogil=True)
def copy_bytes(dst, dst_off, src, src_off, n):
    """dst[dst_off : dst_off + n] = src[src_off : src_off + n] for byte arrays that do not
    overlap (or where dst starts before src). Every payload copy goes through here: numba's
    slice assignment checks for overlap and copies through a temporary, ~2.6 us per 8 KiB on
    the reference machine, where this loop, which LLVM vectorizes, takes ~0.1 us (measured
    with both in one njit loop over 100k copies). Views first: indexing ``dst[dst_off + k]``
    directly keeps numba's negative-index wraparound in the loop, which stops LLVM from
    vectorizing it (6.3 us per 8 KiB). Never writes past either view, whatever *n* says."""
    d = dst[dst_off : dst_off + n]
    s = src[src_off : src_off + n]
    for k in range(min(d.shape[0], s.shape[0])):
        d[k] = s[k]


@njit(cache=True, nogil=True)
def rd16(b, o):
    return (np.int64(b[o]) << 8) | np.int64(b[o + 1])


@njit(cache=True, nogil=True)
def rd32(b, o):
    return (rd16(b, o) << 16) | rd16(b, o + 2)


@njit(cache=True, nogil=True)
def rd64(b, o):
    return (np.uint64(rd32(b, o)) << np.uint64(32)) | np.uint64(rd32(b, o + 4))


@njit(cache=True, nogil=True)
def wr64(b, o, v):
    w = np.uint64(v)
    wr32(b, o, np.int64(w >> np.uint64(32)))
    wr32(b, o + 4, np.int64(w & np.uint64(0xFFFFFFFF)))


@njit(cache=True, nogil=True)
def _wr8(b, o, v):
    b[o] = np.uint8(v & 0xFF)


@njit(cache=True, nogil=True)
def wr16(b, o, v):
    b[o] = np.uint8((v >> 8) & 0xFF)
    b[o + 1] = np.uint8(v & 0xFF)


@njit(cache=True, nogil=True)
def wr32(b, o, v):
    wr16(b, o, (v >> 16) & 0xFFFF)
    wr16(b, o + 2, v & 0xFFFF)


@njit(cache=True, nogil=True)
def le16(b, o):
    """The little-endian u16 at b[o] (descriptors and sparse payloads; headers are big-endian)."""
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8)


@njit(cache=True, nogil=True)
def le32(b, o):
    """The little-endian u32 at b[o]."""
    return (
        np.int64(b[o])
        | (np.int64(b[o + 1]) << 8)
        | (np.int64(b[o + 2]) << 16)
        | (np.int64(b[o + 3]) << 24)
    )


@njit(cache=True, nogil=True)
def le64(b, o):
    value = np.uint64(0)
    for k in range(8):
        value |= np.uint64(b[o + k]) << np.uint64(8 * k)
    return value


@njit(cache=True, nogil=True)
def put_le64(b, o, v):
    for k in range(8):
        b[o + k] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))


@njit(cache=True, nogil=True)
def put_le16(b, o, v):
    for k in range(2):
        b[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


@njit(cache=True, nogil=True)
def put_le32(b, o, v):
    for k in range(4):
        b[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


@njit(cache=True, nogil=True)
def check_packet(b, n, max_pay):
    """Status of datagram b[:n]: 0 to execute, PUNT, DROP_SILENTLY, or the NACK status. A data
    opcode's ``length`` is at most *max_pay*, the core's largest payload (slot_payload)."""
    if n < HDR:
        return DROP_SILENTLY
    if b[H_VERSION] != 1:
        return _S_BAD_VERSION
    op = np.int64(b[H_OPCODE])
    if op >= 64 or _KIND[op] == 0:
        return _S_BAD_OPCODE
    if b[H_RESERVED1] != 0 or rd16(b, H_RESERVED2) != 0:
        return _S_BAD_FIELD
    flags = rd16(b, H_FLAGS)
    if flags & ~_FLAGS_MASK:
        return _S_BAD_FIELD
    dtype = np.int64(b[H_DTYPE])
    if dtype > _MAX_DTYPE:
        return _S_BAD_DTYPE
    if b[H_REDUCE_OP] > 2:
        return _S_BAD_OP
    if b[H_STATUS] > _MAX_STATUS:
        return _S_BAD_FIELD
    status = _check_segments(b, n)
    if status != 0:
        return status
    return _check_fields(b, n, op, flags, dtype, max_pay)


@njit(cache=True, nogil=True)
def _check_segments(b, n):
    seg_type = np.int64(b[H_SEG_TYPE])
    left = np.int64(b[H_SEGMENTS_LEFT])
    count = np.int64(b[H_SEG_COUNT])
    if seg_type > 1 or count > _MAXSEG:
        return _S_BAD_SEGMENT
    if (seg_type == 0) != (count == 0):
        return _S_BAD_SEGMENT
    if left >= max(count, 1):
        return _S_BAD_SEGMENT
    if (n - HDR) // SEG < count:
        return _S_TRUNCATED
    for i in range(count):
        if rd16(b, HDR + SEG * i + SEG_RESERVED) != 0:
            return _S_BAD_SEGMENT
    return 0


@njit(cache=True, nogil=True)
def _check_fields(b, n, op, flags, dtype, max_pay):
    count = np.int64(b[H_SEG_COUNT])
    length = rd32(b, H_LENGTH)
    size = n - HDR - SEG * count
    esize = ESIZE[dtype]
    if count > 0 and _TAKES_SR[op] == 0:
        return _S_BAD_SEGMENT
    if length > max_pay and IS_CONTROL[op] == 0:
        return S_TOO_LARGE
    if _COMBINES[op] == 1 and dtype == 0:
        return _S_BAD_DTYPE
    if _ATOMIC[op] == 1 and dtype != _U64:
        return _S_BAD_DTYPE
    if op == OP_UPDATE and _GRADIENT_DTYPE[dtype] == 0:
        return _S_BAD_DTYPE
    if flags & F_SPARSE and op != OP_CHAIN_ADD and op != OP_ALL_WRITE and op != OP_WRITE:
        return _S_BAD_FIELD  # no sparse form (SPEC.md 2.5)
    kind = _KIND[op]
    if kind == _K_READ:
        if size != 0 or length == 0 or length % esize != 0:
            return _S_BAD_LENGTH
    elif kind == _K_DATA:
        if flags & F_SPARSE:
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
        if _FIXED_ALT[op] == 0 or length != _FIXED_ALT[op] or size != _FIXED_ALT[op]:
            return _S_BAD_LENGTH
    return 0


@njit(cache=True, nogil=True)
def _sparse_size(nnz, esize):
    return SP_INDICES + (2 * nnz + 7) // 8 * 8 + nnz * esize


@njit(cache=True, nogil=True)
def _check_sparse(b, p, size, length, esize):
    """Mirrors protocol.packet.check_sparse_payload on the payload b[p : p + size]."""
    if size < SP_INDICES:
        return _S_TRUNCATED
    if le32(b, p + SP_RESERVED) != 0:
        return _S_BAD_FIELD
    nnz = le32(b, p + SP_NNZ)
    elements = length // esize
    if nnz > elements:
        return _S_BAD_LENGTH
    if size != _sparse_size(nnz, esize):
        return _S_BAD_LENGTH
    for k in range(p + SP_INDICES + 2 * nnz, p + SP_INDICES + (2 * nnz + 7) // 8 * 8):
        if b[k] != 0:
            return _S_BAD_FIELD
    prev = np.int64(-1)
    for k in range(nnz):
        index = le16(b, p + SP_INDICES + 2 * k)
        if index <= prev:
            return _S_BAD_FIELD
        prev = index
    if nnz > 0 and prev >= elements:
        return _S_BAD_FIELD
    return 0


@njit(cache=True, nogil=True)
def _nnz_typed(w):
    n = 0
    for i in range(w.shape[0]):
        if w[i] != 0:
            n += 1
    return n


@njit(cache=True, nogil=True)
def _encode_typed(w, idx, vals):
    k = 0
    for i in range(w.shape[0]):
        if w[i] != 0:
            idx[k] = i
            vals[k] = w[i]
            k += 1


@njit(cache=True, nogil=True)
def _expand_typed(w, idx, vals):
    w[:] = 0
    for k in range(idx.shape[0]):
        w[idx[k]] = vals[k]


@njit(cache=True, nogil=True)
def _count_nonzero(src, off, nbytes, esize):
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
def _sparse_pays(nnz, nbytes, esize):
    """The re-encode rule: sparse when under half the elements are non-zero and it is shorter."""
    return nnz * 2 < nbytes // esize and _sparse_size(nnz, esize) < nbytes


@njit(cache=True, nogil=True)
def _sparse_encode(dst, d_off, src, s_off, nbytes, esize, nnz):
    """Write the sparse form of dense src[s_off : s_off + nbytes] (nnz non-zero elements) at
    dst[d_off:] (must not overlap src); returns its size in bytes. Little-endian host."""
    pad = (2 * nnz + 7) // 8 * 8
    for k in range(4):
        dst[d_off + SP_NNZ + k] = np.uint8((nnz >> (8 * k)) & 0xFF)
        dst[d_off + SP_RESERVED + k] = 0
    for k in range(2 * nnz, pad):
        dst[d_off + SP_INDICES + k] = 0
    idx = dst[d_off + SP_INDICES : d_off + SP_INDICES + 2 * nnz].view(np.uint16)
    v = d_off + SP_INDICES + pad
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
    return SP_INDICES + pad + nnz * esize


@njit(cache=True, nogil=True)
def sparse_expand(dst, d_off, b, p, nbytes, esize):
    """Dense form of the (validated) sparse payload at b[p:] into dst[d_off : d_off + nbytes]:
    listed elements get their value, all others all-zero bits."""
    nnz = le32(b, p + SP_NNZ)
    idx = b[p + SP_INDICES : p + SP_INDICES + 2 * nnz].view(np.uint16)
    v = p + SP_INDICES + (2 * nnz + 7) // 8 * 8
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
def encode_payload(dst, d_off, src, s_off, nbytes, esize):
    """Dense src range into dst[d_off:] as sparse (when it pays) or dense; (bytes, sparse?)."""
    nnz = _count_nonzero(src, s_off, nbytes, esize)
    if _sparse_pays(nnz, nbytes, esize):
        return _sparse_encode(dst, d_off, src, s_off, nbytes, esize, nnz), True
    for k in range(nbytes):
        dst[d_off + k] = src[s_off + k]
    return nbytes, False


@njit(cache=True, nogil=True)
def find_rkey(rk_key, rkey):
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
def _home(rk_key, rkey):
    """The entry an rkey's probe sequence starts at (find_rkey's hash)."""
    return (np.int64(rkey) * 2654435761) & (rk_key.shape[0] - 1)


@njit(cache=True, nogil=True)
def add_rkey(regions, rkey, base, size, rights):
    """Insert *rkey* over [base, base+size) with *rights* (no tag key) into the table, which
    must not hold it; False (nothing changed) when it does, or when the table is full."""
    rk_key = regions.key
    mask = rk_key.shape[0] - 1
    entry = _home(rk_key, rkey)
    for _ in range(rk_key.shape[0]):
        key = np.int64(rk_key[entry])
        if key == rkey:
            return False
        if key == 0:
            rk_key[entry] = rkey
            regions.base[entry] = base
            regions.len[entry] = size
            regions.rights[entry] = rights
            regions.tag[entry, 0] = 0
            regions.tag[entry, 1] = 0
            return True
        entry = (entry + 1) & mask
    return False


@njit(cache=True, nogil=True)
def remove_rkey(regions, rkey):
    """Delete *rkey* from the table, keeping every other key's probe sequence whole: each
    entry after the hole that may move into it does (backward-shift deletion, Knuth 6.4
    Algorithm R). False when the table does not hold it."""
    rk_key = regions.key
    mask = rk_key.shape[0] - 1
    hole = find_rkey(rk_key, rkey)
    if hole < 0:
        return False
    entry = hole
    while True:
        rk_key[hole] = 0
        while True:
            entry = (entry + 1) & mask
            key = np.int64(rk_key[entry])
            if key == 0:
                return True
            home = _home(rk_key, key)
            # The entry stays when its home lies cyclically in (hole, entry].
            if hole <= entry:
                stays = hole < home <= entry
            else:
                stays = home > hole or home <= entry
            if not stays:
                break
        rk_key[hole] = rk_key[entry]
        regions.base[hole] = regions.base[entry]
        regions.len[hole] = regions.len[entry]
        regions.rights[hole] = regions.rights[entry]
        regions.tag[hole, 0] = regions.tag[entry, 0]
        regions.tag[hole, 1] = regions.tag[entry, 1]
        hole = entry


@njit(cache=True, nogil=True)
def check_access(regions, rkey, addr, nbytes, need, align, member):
    """0 when *rkey* grants *need* on [addr, addr+nbytes) with *align*-aligned addr, else status.
    A members-only key (a collective's) names nothing for a datagram from a non-member."""
    rk_key, rk_base, rk_len, rk_rights = regions.key, regions.base, regions.len, regions.rights
    slot = find_rkey(rk_key, rkey)
    if slot < 0 or (rk_rights[slot] & _R_MEMBERS and not member):
        return S_BAD_RKEY
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
def is_member(members, endpoint):
    i = np.searchsorted(members, endpoint)
    return i < members.shape[0] and members[i] == endpoint


@njit(cache=True, nogil=True)
def reply_dst(b, src, members):
    """Where replies go: the return segment when a cluster member (switch, chain hop) wrote it,
    else the UDP source. A client cannot aim replies at a third party (SPEC.md "Rights")."""
    ret = np.uint64((rd32(b, H_RET_IP) << 16) | rd16(b, H_RET_PORT))
    if ret != 0 and is_member(members, src):
        return ret
    return src


@njit(cache=True, nogil=True)
def reply_header(t, b, opcode, status, length, credit):
    """Write a reply header into t from request header b: ids echoed, SR list dropped."""
    for k in range(HDR):
        t[k] = b[k]
    # A reply is always a valid v1 header, even when it NACKs an invalid one: fields that
    # failed validation are not echoed (SPEC.md section 3).
    t[H_VERSION] = 1
    t[H_OPCODE] = opcode
    if t[H_DTYPE] > _MAX_DTYPE:
        t[H_DTYPE] = 0
    if t[H_REDUCE_OP] > 2:
        t[H_REDUCE_OP] = 0
    t[H_RESERVED1] = 0
    wr16(t, H_RESERVED2, 0)
    wr16(t, H_FLAGS, rd16(b, H_FLAGS) & _F_KEEP_IN_REPLY)
    wr32(t, H_LENGTH, length)
    t[H_STATUS] = status
    t[H_CREDIT] = credit
    t[H_SEG_TYPE] = 0
    t[H_SEGMENTS_LEFT] = 0
    t[H_SEG_COUNT] = 0


@njit(cache=True, nogil=True)
def credit_of(tx_n, cap):
    """Congestion byte of replies: send-queue occupancy scaled to 0..255 (SPEC.md "credit")."""
    return min(255, (tx_n * 255) // cap)


@njit(cache=True, nogil=True)
def _emit_reply(b, src, members, opcode, status, tx, tx_n):
    """Queue a header-only reply to request *b* (its ids, the credit, its return segment when a
    member sent it); returns the new tx_n. The one ACK/NACK emitter of the datapaths."""
    tx_buf, tx_off, tx_len, tx_dst, _slot = tx
    t = tx_buf[tx_off[tx_n] :]
    reply_header(t, b, opcode, status, 0, credit_of(tx_n, tx_len.shape[0]))
    tx_len[tx_n] = HDR
    tx_off[tx_n + 1] = tx_off[tx_n] + tx_len[tx_n]
    tx_dst[tx_n] = reply_dst(b, src, members)
    return tx_n + 1


@njit(cache=True, nogil=True)
def emit_ack(b, src, members, tx, tx_n):
    return _emit_reply(b, src, members, OP_ACK, 0, tx, tx_n)


@njit(cache=True, nogil=True)
def emit_nack(b, src, members, status, tx, tx_n, counters):
    counters[C.NACK_BASE + status] += 1
    return _emit_reply(b, src, members, OP_NACK, status, tx, tx_n)


@njit(cache=True, nogil=True)
def scratch_slot(tx, tx_n):
    """A dense payload's worth of scratch: the send slot after the current one when the queue
    has it, else a fresh array (rare: a nearly full queue)."""
    tx_buf, tx_off, _tx_len, _tx_dst, slot = tx
    start = tx_off[tx_n] + slot
    pay = slot_payload(slot)
    if start + pay <= tx_buf.shape[0]:
        return tx_buf[start : start + pay]
    return np.zeros(pay, np.uint8)


# ---------------------------------------------------------------- checked entries (Python)


def check_send_queue(tx: TxQueue, tx_n: int) -> None:
    """The send queue a checked entry hands its kernel: its tail inside, one more offset than
    lengths, and a slot some MTU gives (the kernels read the largest payload from it)."""
    if not 0 <= tx_n < tx.len.shape[0] or tx.off.shape[0] != tx.len.shape[0] + 1:
        raise ValueError(f"send queue tail {tx_n} outside its {tx.len.shape[0]} slots")
    if not slot_bytes(MIN_MTU) <= tx.slot <= slot_bytes(MAX_MTU):
        raise ValueError(f"send slot of {tx.slot} bytes: no MTU gives it (constants.slot_bytes)")


def _check_regions(regions: Regions) -> None:
    slots = regions.key.shape[0]
    if slots == 0 or slots & (slots - 1):
        raise ValueError(f"rkey table of {slots} slots: a power of two is needed (the hash mask)")
    for name, column in zip(Regions._fields[1:], regions[1:], strict=True):
        if column.shape[0] != slots:
            raise ValueError(f"rkey table column {name} has {column.shape[0]} rows, not {slots}")
    if regions.tag.ndim != 2 or regions.tag.shape[1] != 2:
        raise ValueError(f"rkey table tag column of shape {regions.tag.shape}, not ({slots}, 2)")


def install_rkey(
    regions: Regions, rkey: int, span: tuple[int, int, int], tag_key: bytes = b""
) -> None:
    """Checked entry to add_rkey: *rkey* over span (base, size, rights), with its 16-byte tag
    key (b"": untagged). Raises when the table holds the key already or is full."""
    _check_regions(regions)
    base, size, rights = span
    if not 0 < rkey <= 0xFFFFFFFF or base < 0 or size < 0 or not 0 <= rights <= 0xFF:
        raise ValueError(f"rkey {rkey:#x} over ({base}, {size}) rights {rights:#x}: out of range")
    if len(tag_key) not in (0, 16):
        raise ValueError(f"tag key of {len(tag_key)} bytes, not 16")
    if not add_rkey(regions, np.int64(rkey), np.int64(base), np.int64(size), np.int64(rights)):
        raise ValueError(f"rkey {rkey:#x}: already in the table, or the table is full")
    if tag_key:
        regions.tag[find_rkey(regions.key, np.int64(rkey))] = np.frombuffer(tag_key, "<u8")


def uninstall_rkey(regions: Regions, rkey: int) -> bool:
    """Checked entry to remove_rkey: False when the table does not hold *rkey*."""
    _check_regions(regions)
    if not 0 <= rkey <= 0xFFFFFFFF:
        raise ValueError(f"rkey {rkey:#x} out of range")
    return bool(remove_rkey(regions, np.int64(rkey)))
