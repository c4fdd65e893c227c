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

from netdam.kernels.guard import _sip_absorb, _sip_final, _sip_init
from netdam.kernels.wire import _rd16, _wr16
from netdam.protocol.constants import HEADER_SIZE, SEGMENT_SIZE, TAG_SIZE, Flags
from netdam.protocol.layout import H_FLAGS, H_RET_IP, H_SEG_COUNT, H_SEGMENTS_LEFT

_F_TAGGED = int(Flags.TAGGED)
_HDR = HEADER_SIZE
_SEG = SEGMENT_SIZE
TAG = TAG_SIZE
# What a relay rewrites is not covered (SPEC.md 2.6): segments_left (its byte of the header's
# 7th word, zeroed) and the return segment with reserved2 (the 8th word, all of it), so a hop
# forwards a CHAIN_ADD under its originator's tag. protocol/tag.py declares the same.
_WORD_SEGMENTS_LEFT = H_SEGMENTS_LEFT // 8 * 8
_KEEP_WORD_SEGMENTS_LEFT = np.uint64(~(0xFF << (8 * (H_SEGMENTS_LEFT % 8))) & 0xFFFFFFFFFFFFFFFF)
_WORD_RET = H_RET_IP // 8 * 8
assert H_RET_IP % 8 == 0 and _WORD_RET == _HDR - 8


@intrinsic
def _load_u64(typingctx, buf, at):  # type: ignore[no-untyped-def]
    """The little-endian u64 at buf[at : at + 8] of a uint8 array, in one unaligned load (the
    caller has checked the bounds; x86 and ARM are little-endian, asserted below)."""
    sig = types.uint64(buf, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, args[0])
        byte = builder.gep(array.data, [args[1]])
        return builder.load(builder.bitcast(byte, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


assert sys.byteorder == "little", "the tag kernel loads little-endian words directly"


@njit(cache=True, nogil=True)
def _siphash_tag_input(k0, k1, b, n):  # type: ignore[no-untyped-def]
    """SipHash-2-4 of b[:n], n a multiple of 8 and at least 64, with the header's last two
    words masked as the tag input says (segments_left, return segment: see above)."""
    v0, v1, v2, v3 = _sip_init(k0, k1)
    for i in range(0, n, 8):
        m = _load_u64(b, np.int64(i))
        if i == _WORD_SEGMENTS_LEFT:
            m &= _KEEP_WORD_SEGMENTS_LEFT
        elif i == _WORD_RET:
            m = np.uint64(0)
        v0, v1, v2, v3 = _sip_absorb(v0, v1, v2, v3, m)
    return _sip_final(v0, v1, v2, v3, n)


@njit(cache=True, nogil=True)
def _tag_of(b, k0, k1):  # type: ignore[no-untyped-def]
    """The tag of datagram b: over its fixed header and SR list."""
    return _siphash_tag_input(k0, k1, b, _HDR + _SEG * np.int64(b[H_SEG_COUNT]))


@njit(cache=True, nogil=True)
def _seal(t, n, k0, k1):  # type: ignore[no-untyped-def]
    """Set TAGGED in datagram t[:n] and append its tag; returns the new length. The caller
    left TAG bytes of room (every send slot has them)."""
    _wr16(t, H_FLAGS, _rd16(t, H_FLAGS) | _F_TAGGED)
    return _put_tag(t, n, _tag_of(t, k0, k1))


@njit(cache=True, nogil=True)
def _put_tag(t, n, tag):  # type: ignore[no-untyped-def]
    """Write *tag* after datagram t[:n] (little-endian); returns the new length."""
    for k in range(TAG):
        t[n + k] = np.uint8((tag >> np.uint64(8 * k)) & np.uint64(0xFF))
    return n + TAG


@njit(cache=True, nogil=True)
def _tagged_length(b, n):  # type: ignore[no-untyped-def]
    """The length of datagram b[:n] without its trailer: n when it is not TAGGED, n - TAG when
    it is, -1 when it is TAGGED but shorter than header, SR list and tag (dropped and counted
    as truncated, before any other check)."""
    if n < _HDR or (_rd16(b, H_FLAGS) & _F_TAGGED) == 0:
        return n
    if n < _HDR + _SEG * np.int64(b[H_SEG_COUNT]) + TAG:
        return -1
    return n - TAG


@njit(cache=True, nogil=True)
def _trailer(b, n):  # type: ignore[no-untyped-def]
    """The tag datagram b[:n] ends with (n includes it)."""
    return _load_u64(b, np.int64(n - TAG))


@njit(cache=True, nogil=True)
def _tag_ok(b, n, k0, k1):  # type: ignore[no-untyped-def]
    """Datagram b[:n] (trailer included) ends with its tag under (k0, k1)."""
    if n < _HDR + _SEG * np.int64(b[H_SEG_COUNT]) + TAG:
        return False
    return _trailer(b, n) == _tag_of(b, k0, k1)


def seal(datagram: np.ndarray, n: int, key: bytes) -> int:
    """Seal datagram[:n] in place under the 16-byte *key*; returns its new length."""
    if len(key) != 16 or datagram.dtype != np.uint8 or n < _HDR or n + TAG > datagram.shape[0]:
        raise ValueError("seal: a uint8 datagram with room for the tag and a 16-byte key")
    if _HDR + _SEG * int(datagram[H_SEG_COUNT]) > n:
        raise ValueError("seal: the datagram is shorter than its SR list")
    k0, k1 = np.frombuffer(key, "<u8")
    return int(_seal(datagram, np.int64(n), k0, k1))


def tag_ok(datagram: np.ndarray, key: bytes) -> bool:
    """The datagram (trailer included) carries its tag under the 16-byte *key*."""
    if len(key) != 16 or datagram.dtype != np.uint8 or datagram.shape[0] < _HDR:
        raise ValueError("tag_ok: a uint8 datagram of at least a header and a 16-byte key")
    k0, k1 = np.frombuffer(key, "<u8")
    return bool(_tag_ok(datagram, np.int64(datagram.shape[0]), k0, k1))
