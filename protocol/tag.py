"""The tag of a TAGGED datagram (SPEC.md 2.6), in plain Python: the reference the compiled
datapath (netdam/kernels/tag.py) is tested against, and what hosts use to check the few tagged
datagrams they receive (a collective's completion).

A tag is SipHash-2-4 (Aumasson and Bernstein, "SipHash: a fast short-input PRF", 2012) under a
collective's 128-bit tag key, over the datagram's fixed header (TAGGED set; the fields relays
rewrite taken as zero) and SR list, and travels as 8 bytes little-endian after the payload.
Sans-I/O: bytes in, bytes out.
"""

from __future__ import annotations

import struct

from netdam.protocol.constants import (
    CONTROL_FIRST,
    CONTROL_LAST,
    HEADER_SIZE,
    SEGMENT_SIZE,
    TAG_SIZE,
    Flags,
)
from netdam.protocol.layout import HEADER

_MASK = (1 << 64) - 1
#: Header fields the tag does not cover: what a hop rewrites when it forwards a CHAIN_ADD
#: (segments_left, the return segment), and reserved2 beside them, so that a relay keeps the
#: originator's tag (netdam/kernels/tag.py masks the same bytes).
NOT_COVERED = ("segments_left", "ret_ip", "ret_port", "reserved2")
#: Where the tag input ends: the fixed header plus seg_count SR entries.
_SEG_COUNT = HEADER.at("seg_count")
_FLAGS = HEADER.span("flags")


def _rounds(v0: int, v1: int, v2: int, v3: int, count: int) -> tuple[int, int, int, int]:
    """*count* SipRounds, the rotations written out (a host checks a tag per collective call
    in Python: this is about 1.4x faster than one function call per rotation)."""
    m = _MASK
    for _ in range(count):
        v0 = (v0 + v1) & m
        v1 = (((v1 << 13) | (v1 >> 51)) & m) ^ v0
        v0 = ((v0 << 32) | (v0 >> 32)) & m
        v2 = (v2 + v3) & m
        v3 = (((v3 << 16) | (v3 >> 48)) & m) ^ v2
        v0 = (v0 + v3) & m
        v3 = (((v3 << 21) | (v3 >> 43)) & m) ^ v0
        v2 = (v2 + v1) & m
        v1 = (((v1 << 17) | (v1 >> 47)) & m) ^ v2
        v2 = ((v2 << 32) | (v2 >> 32)) & m
    return v0, v1, v2, v3


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 of *data* under the 16-byte *key* (the paper's byte order: k0 and k1 are the
    key's two little-endian halves, the output a little-endian u64)."""
    if len(key) != 16:
        raise ValueError(f"a SipHash key is 16 bytes, not {len(key)}")
    k0, k1 = struct.unpack("<QQ", key)
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573
    whole = len(data) - len(data) % 8
    words = list(struct.unpack_from(f"<{whole // 8}Q", data))
    words.append(((len(data) & 0xFF) << 56) | int.from_bytes(data[whole:], "little"))
    for m in words:
        v3 ^= m
        v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 2)
        v0 ^= m
    v2 ^= 0xFF
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 4)
    return int(v0 ^ v1 ^ v2 ^ v3)


def tag_input_size(datagram: bytes | bytearray | memoryview) -> int:
    """Bytes the tag covers: the fixed header and the SR list (seg_count entries)."""
    segments: int = datagram[_SEG_COUNT]
    return int(HEADER_SIZE + SEGMENT_SIZE * segments)


def tag_input(datagram: bytes | bytearray | memoryview) -> bytes:
    """What the tag covers: the fixed header and the SR list, with the fields relays rewrite
    (``NOT_COVERED``) taken as zero."""
    return control_tag_input(datagram[: tag_input_size(datagram)])


def control_tag_input(body: bytes | bytearray | memoryview) -> bytes:
    """What a control tag covers (SPEC.md 2.6, "Control tags"): the whole datagram *body* (no
    trailer), header, SR list and payload, with the same fields taken as zero."""
    covered = bytearray(body)
    for name in NOT_COVERED:
        covered[HEADER.span(name)] = bytes(HEADER[name].width)
    return bytes(covered)


def is_control(opcode: int) -> bool:
    """Opcodes whose tag is a control tag, under the admin tag key: 0x20-0x28."""
    return bool(CONTROL_FIRST <= opcode <= CONTROL_LAST)


def seal_control(key: bytes, datagram: bytes) -> bytes:
    """*datagram* (without a trailer) with TAGGED set and its control tag under the admin tag
    *key* appended: a control request, or the answer to one."""
    out = _flagged(datagram)
    return out + siphash24(key, control_tag_input(out)).to_bytes(TAG_SIZE, "little")


def verify_control(key: bytes, datagram: bytes | bytearray | memoryview) -> bool:
    """True when *datagram* is TAGGED and ends with its control tag under *key*."""
    if (
        len(datagram) < HEADER_SIZE + TAG_SIZE
        or not int.from_bytes(datagram[_FLAGS], "big") & Flags.TAGGED
    ):
        return False
    body = datagram[:-TAG_SIZE]
    return int.from_bytes(datagram[-TAG_SIZE:], "little") == siphash24(key, control_tag_input(body))


def tag_of(key: bytes, datagram: bytes | bytearray | memoryview) -> int:
    """The tag of *datagram* (with or without its trailer) under *key*."""
    return siphash24(key, tag_input(datagram))


def seal(key: bytes, datagram: bytes) -> bytes:
    """*datagram* (without a trailer) with the TAGGED flag set and its tag appended."""
    out = _flagged(datagram)
    return out + tag_of(key, out).to_bytes(TAG_SIZE, "little")


def _flagged(datagram: bytes) -> bytes:
    """*datagram* with the TAGGED flag set."""
    out = bytearray(datagram)
    out[_FLAGS] = (int.from_bytes(out[_FLAGS], "big") | Flags.TAGGED).to_bytes(2, "big")
    return bytes(out)


def verify(key: bytes, datagram: bytes | bytearray | memoryview) -> bool:
    """True when *datagram* is TAGGED and its trailer is its tag under *key*."""
    if len(datagram) < HEADER_SIZE + TAG_SIZE:
        return False
    if not int.from_bytes(datagram[_FLAGS], "big") & Flags.TAGGED:
        return False
    if len(datagram) < tag_input_size(datagram) + TAG_SIZE:
        return False
    return int.from_bytes(datagram[-TAG_SIZE:], "little") == tag_of(key, datagram)
