"""Tags of a collective's datagrams, in the compiled path (SPEC.md 2.6).

A tagged collective's members hold its 128-bit tag key (from the START_COLL descriptor, which
only the members' hosts derive, from the cluster's group key). Every datagram of it carries,
after the payload, SipHash-2-4 under that key of its fixed header (but for what relays rewrite:
segments_left and the return segment) and its SR list. So a datagram
from a member's address is taken as the collective's only when its sender holds the key: a key
seen on the wire (the 32-bit rkey of the header) or a forged source no longer suffices. The tag
covers the header (sequence, epoch, length, addresses, status) and the route, not the payload:
its cost is one SipHash of 64 + 8 x hops bytes per datagram whatever the payload, and what that
leaves open is in SPEC.md 12.1. protocol/tag.py is the plain-Python reference.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from netdam.kernels.dispatch import TypedEntry
from netdam.kernels.guard import G_ADMIN_K0, G_ADMIN_K1, sip_absorb, sip_finish, sip_init
from netdam.kernels.wire import OP_CHAIN_ADD, find_rkey, rd16, rd32, wr16
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    CONTROL_FIRST,
    CONTROL_LAST,
    HEADER_SIZE,
    POOL_FIRST,
    SEGMENT_SIZE,
    TAG_SIZE,
    Flags,
)
from netdam.protocol.layout import (
    H_FLAGS,
    H_OPCODE,
    H_RET_IP,
    H_RKEY,
    H_SEG_COUNT,
    H_SEGMENTS_LEFT,
    HEADER,
)

F_TAGGED = int(Flags.TAGGED)
HDR = HEADER_SIZE
SEG = SEGMENT_SIZE
TAG = TAG_SIZE
# What a relay rewrites is not covered (SPEC.md 2.6): segments_left (its byte of the header's
# 7th word, zeroed) and the return segment with reserved2 (the 8th word, all of it), so a hop
# forwards a CHAIN_ADD under its originator's tag. protocol/tag.py declares the same.
_WORD_SEGMENTS_LEFT = H_SEGMENTS_LEFT // 8 * 8
_KEEP_WORD_SEGMENTS_LEFT = np.uint64(~(0xFF << (8 * (H_SEGMENTS_LEFT % 8))) & 0xFFFFFFFFFFFFFFFF)
_WORD_RET = H_RET_IP // 8 * 8
assert H_RET_IP % 8 == 0 and _WORD_RET == HDR - 8


@intrinsic
def _load_u64(typingctx, buf, at):
    """The little-endian u64 at buf[at : at + 8] of a uint8 array, in one unaligned load (the
    caller has checked the bounds; x86 and ARM are little-endian, asserted below)."""
    sig = types.uint64(buf, types.int64)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        byte = builder.gep(array.data, [args[1]])
        return builder.load(builder.bitcast(byte, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


assert sys.byteorder == "little", "the tag kernel loads little-endian words directly"


@njit(cache=True, nogil=True)
def _siphash_masked(k0, k1, b, n):
    """SipHash-2-4 of b[:n] (n >= 64) with the header's last two words masked as the tag input
    says (segments_left, return segment: see above), its 0-7 tail bytes in the last block: a
    tag over the header and SR list (n a multiple of 8), or a control tag over the whole
    datagram (SPEC.md 2.6, "Control tags")."""
    v0, v1, v2, v3 = sip_init(k0, k1)
    whole = n - n % 8
    for i in range(0, whole, 8):
        m = _load_u64(b, np.int64(i))
        if i == _WORD_SEGMENTS_LEFT:
            m &= _KEEP_WORD_SEGMENTS_LEFT
        elif i == _WORD_RET:
            m = np.uint64(0)
        v0, v1, v2, v3 = sip_absorb(v0, v1, v2, v3, m)
    last = np.uint64(n & 0xFF) << np.uint64(56)
    for j in range(n - whole):
        last |= np.uint64(b[whole + j]) << np.uint64(8 * j)
    return sip_finish(v0, v1, v2, v3, last)


@njit(cache=True, nogil=True)
def _control_tag_ok(b, ln, k0, k1):
    """Datagram b[:ln] (trailer included) ends with its control tag under (k0, k1)."""
    return ln >= HDR + TAG and tag_trailer(b, ln) == _siphash_masked(k0, k1, b, ln - TAG)


@njit(cache=True, nogil=True)
def seal_control_tag(t, n, k0, k1):
    """Set TAGGED in datagram t[:n] and append its control tag; returns the new length."""
    wr16(t, H_FLAGS, rd16(t, H_FLAGS) | F_TAGGED)
    return _put_tag(t, n, _siphash_masked(k0, k1, t, n))


#: Verdicts of open_control_tagged: the tag is right (punt it: the control plane acts as the
#: admin); no admin tag key here (answered UNAUTHORIZED); dropped (a wrong tag).
CONTROL_TAG_OK, CONTROL_TAG_NO_KEY, CONTROL_TAG_FORGED = 1, 4, 0


@njit(cache=True, nogil=True)
def is_control_op(op):
    return CONTROL_FIRST <= op <= CONTROL_LAST


@njit(cache=True, nogil=True)
def open_control_tagged(guard_key, b, ln, counters):
    """Check the control tag of TAGGED datagram b[:ln] (a control opcode) under the admin tag
    key in the guard's key words. Returns (verdict, k0, k1): CONTROL_TAG_OK and the key;
    CONTROL_TAG_NO_KEY when this process has none (the caller answers UNAUTHORIZED);
    CONTROL_TAG_FORGED, counted: dropped without an answer."""
    k0, k1 = guard_key[G_ADMIN_K0], guard_key[G_ADMIN_K1]
    if (k0 | k1) == 0:
        return CONTROL_TAG_NO_KEY, k0, k1
    if _control_tag_ok(b, ln, k0, k1):
        return CONTROL_TAG_OK, k0, k1
    counters[C.DROP_CONTROL_FORGED] += 1
    return CONTROL_TAG_FORGED, k0, k1


@njit(cache=True, nogil=True)
def is_tenant_request(b, op):
    """A TAGGED ALLOC, FREE or QUERY whose rkey is non-zero names a tenant by its id: its
    control tag is under that tenant's tag key (SPEC.md 11.9, "Tenant tags"), not the admin's."""
    return POOL_FIRST <= op <= CONTROL_LAST and rd32(b, H_RKEY) != 0


@njit(cache=True, nogil=True)
def open_tenant_tagged(ids, keys, b, ln, counters):
    """Check the control tag of TAGGED pool request b[:ln] under the tag key of the tenant its
    rkey names (ids sorted, keys in their order). Returns CONTROL_TAG_OK; CONTROL_TAG_NO_KEY
    when no tenant has that id (the caller answers UNAUTHORIZED, a failed authentication);
    CONTROL_TAG_FORGED, counted: dropped without an answer."""
    tenant = np.uint32(rd32(b, H_RKEY))
    i = np.searchsorted(ids, tenant)
    if i >= ids.shape[0] or ids[i] != tenant:
        return CONTROL_TAG_NO_KEY
    if _control_tag_ok(b, ln, keys[i, 0], keys[i, 1]):
        return CONTROL_TAG_OK
    counters[C.DROP_CONTROL_FORGED] += 1
    return CONTROL_TAG_FORGED


@njit(cache=True, nogil=True)
def _tag_of(b, k0, k1):
    """The tag of datagram b: over its fixed header and SR list."""
    return _siphash_masked(k0, k1, b, HDR + SEG * np.int64(b[H_SEG_COUNT]))


@njit(cache=True, nogil=True)
def seal_tag(t, n, k0, k1):
    """Set TAGGED in datagram t[:n] and append its tag; returns the new length. The caller
    left TAG bytes of room (every send slot has them)."""
    wr16(t, H_FLAGS, rd16(t, H_FLAGS) | F_TAGGED)
    return _put_tag(t, n, _tag_of(t, k0, k1))


@njit(cache=True, nogil=True)
def _put_tag(t, n, tag):
    """Write *tag* after datagram t[:n] (little-endian); returns the new length."""
    for k in range(TAG):
        t[n + k] = np.uint8((tag >> np.uint64(8 * k)) & np.uint64(0xFF))
    return n + TAG


@njit(cache=True, nogil=True)
def tagged_length(b, n):
    """The length of datagram b[:n] without its trailer: n when it is not TAGGED, n - TAG when
    it is, -1 when it is TAGGED but shorter than header, SR list and tag (dropped and counted
    as truncated, before any other check)."""
    if n < HDR or (rd16(b, H_FLAGS) & F_TAGGED) == 0:
        return n
    if n < HDR + SEG * np.int64(b[H_SEG_COUNT]) + TAG:
        return -1
    return n - TAG


@njit(cache=True, nogil=True)
def tag_trailer(b, n):
    """The tag datagram b[:n] ends with (n includes it)."""
    return _load_u64(b, np.int64(n - TAG))


@njit(cache=True, nogil=True)
def tag_matches(b, n, k0, k1):
    """Datagram b[:n] (trailer included) ends with its tag under (k0, k1)."""
    if n < HDR + SEG * np.int64(b[H_SEG_COUNT]) + TAG:
        return False
    return tag_trailer(b, n) == _tag_of(b, k0, k1)


@njit(cache=True, nogil=True)
def seal_replies(tx_buf, tx_off, tx_len, first, last, k0, k1, flags_in, tag_in):
    """Seal the datagrams queued at first..last-1 (what the datapath answered or forwarded for
    one tagged datagram with flags *flags_in* and tag *tag_in*: one as a rule), each moved right
    to make room for the tags before it. A forwarded CHAIN_ADD with the same flags keeps the tag
    it came with (a hop rewrites only what the tag does not cover). False (nothing sealed) when
    the queue lacks the room."""
    if last == first:
        return True
    grow = (last - first) * TAG
    if tx_off[last] + grow > tx_buf.shape[0]:
        return False
    for k in range(last - 1, first - 1, -1):
        shift = (k - first) * TAG
        o, n = tx_off[k], tx_len[k]
        if shift:
            for i in range(n - 1, -1, -1):
                tx_buf[o + shift + i] = tx_buf[o + i]
            tx_off[k] = o + shift
        t = tx_buf[o + shift : o + shift + n + TAG]
        if t[H_OPCODE] == OP_CHAIN_ADD and rd16(t, H_FLAGS) == flags_in:
            tx_len[k] = _put_tag(t, n, tag_in)
        else:
            tx_len[k] = seal_tag(t, n, k0, k1)
    tx_off[last] = tx_off[last - 1] + tx_len[last - 1]
    return True


#: Verdicts of open_region_tagged: the tag is right (strip it, seal the answers); no tagged
#: region answers to the rkey (answered BAD_RKEY, never executed); dropped (a wrong tag).
REGION_TAG_OK, REGION_TAG_NO_REGION, REGION_TAG_FORGED = 1, 3, 0


@njit(cache=True, nogil=True)
def region_key(regions, rkey):
    """(k0, k1) of the region *rkey* names: zeros when it names none or an untagged one."""
    slot = find_rkey(regions.key, rkey)
    if slot < 0:
        return np.uint64(0), np.uint64(0)
    return regions.tag[slot, 0], regions.tag[slot, 1]


@njit(cache=True, nogil=True)
def open_region_tagged(regions, b, ln, counters):
    """Check the tag of datagram b[:ln] (TAGGED, no collective) under the key of the region its
    rkey names (SPEC.md 2.6, "Region tags"). Returns (verdict, k0, k1): REGION_TAG_OK and the
    key; REGION_TAG_NO_REGION when the rkey names no tagged region (the caller answers
    BAD_RKEY, which proves nothing and executes nothing); REGION_TAG_FORGED, counted: a tag
    that does not verify, dropped without an answer."""
    k0, k1 = region_key(regions, rd32(b, H_RKEY))
    if (k0 | k1) == 0:
        return REGION_TAG_NO_REGION, k0, k1
    if tag_matches(b, ln, k0, k1):
        return REGION_TAG_OK, k0, k1
    counters[C.DROP_REGION_FORGED] += 1
    return REGION_TAG_FORGED, k0, k1


def seal(datagram: np.ndarray, n: int, key: bytes) -> int:
    """Seal datagram[:n] in place under the 16-byte *key*; returns its new length."""
    if len(key) != 16 or datagram.dtype != np.uint8 or n < HDR or n + TAG > datagram.shape[0]:
        raise ValueError("seal: a uint8 datagram with room for the tag and a 16-byte key")
    if HDR + SEG * int(datagram[H_SEG_COUNT]) > n:
        raise ValueError("seal: the datagram is shorter than its SR list")
    k0, k1 = np.frombuffer(key, "<u8")
    return int(seal_tag(datagram, np.int64(n), k0, k1))


def seal_control_bytes(key: bytes, datagram: bytes) -> bytes:
    """*datagram* (a control request or the answer to one) sealed with its control tag under
    the 16-byte admin tag *key* (SPEC.md 2.6, "Control tags"), compiled."""
    if len(key) != 16 or len(datagram) < HDR:
        raise ValueError("seal_control_bytes: a datagram of at least a header and a 16-byte key")
    buf = np.empty(len(datagram) + TAG, np.uint8)
    buf[: len(datagram)] = np.frombuffer(datagram, np.uint8)
    k0, k1 = np.frombuffer(key, "<u8")
    return bytes(buf[: seal_control_tag(buf, np.int64(len(datagram)), k0, k1)].tobytes())


def verify_control_bytes(key: bytes, datagram: bytes) -> bool:
    """*datagram* (trailer included) is TAGGED and ends with its control tag under *key*."""
    if len(key) != 16:
        raise ValueError("verify_control_bytes: a 16-byte key")
    n = len(datagram)
    if n < HDR + TAG or not HEADER.read(datagram, "flags") & F_TAGGED:
        return False
    k0, k1 = np.frombuffer(key, "<u8")
    return bool(_control_tag_ok(np.frombuffer(datagram, np.uint8), np.int64(n), k0, k1))


def tag_ok(datagram: np.ndarray, key: bytes) -> bool:
    """The datagram (trailer included) carries its tag under the 16-byte *key*."""
    if len(key) != 16 or datagram.dtype != np.uint8 or datagram.shape[0] < HDR:
        raise ValueError("tag_ok: a uint8 datagram of at least a header and a 16-byte key")
    k0, k1 = np.frombuffer(key, "<u8")
    return bool(tag_matches(datagram, np.int64(datagram.shape[0]), k0, k1))


def seal_bytes(key: bytes, datagram: bytes) -> bytes:
    """*datagram* sealed under the 16-byte *key* (TAGGED set, tag appended), compiled: what
    protocol.tag.seal computes in plain Python, ~50 times faster."""
    buf = np.zeros(len(datagram) + TAG, np.uint8)
    buf[: len(datagram)] = np.frombuffer(datagram, np.uint8)
    return buf[: seal(buf, len(datagram), key)].tobytes()


def verify_bytes(key: bytes, datagram: bytes) -> bool:
    """*datagram* (trailer included) carries its tag under the 16-byte *key*, compiled (a host
    checks each completion so: the kernel is entered past the dispatcher, its arguments always
    of the same types)."""
    if len(key) != 16:
        raise ValueError("verify_bytes: a 16-byte key")
    if len(datagram) < HDR:
        return False
    k0, k1 = np.frombuffer(key, "<u8")
    return bool(_VERIFY_BYTES(np.frombuffer(datagram, np.uint8), len(datagram), k0, k1))


_VERIFY_BYTES = TypedEntry(tag_matches)
