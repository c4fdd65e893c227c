# SPDX-License-Identifier: Apache-2.0
# This file is part of netdam.

# scapy.contrib.description = NetDAM v1 (memory instructions over UDP)
# scapy.contrib.status = loads

"""Scapy layer of the NetDAM v1 wire protocol (protocol/SPEC.md), for inspection and tests.

Rules of this file:
1. Written the scapy way (models: ``scapy/contrib/roce.py`` and
   ``scapy/layers/inet6.py:IPv6ExtHdrSegmentRouting``): ``fields_desc`` is the SPEC.md header in
   wire order, reserved bytes included; counts and lengths left ``None`` are filled at build time.
2. A second opinion on ``netdam.protocol.packet``, never the datapath: it validates nothing, so
   it can build and show the malformed packets the codec refuses.
3. The only module of the project that imports scapy at module level; everything else imports
   this module lazily (scapy takes about a second to import).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from scapy.fields import (
    ByteEnumField,
    ByteField,
    ConditionalField,
    FieldLenField,
    FlagsField,
    IntField,
    IPField,
    LEIntField,
    LELongField,
    LEShortField,
    PacketListField,
    ShortField,
    StrFixedLenField,
    XIntField,
    XLEIntField,
    XLELongField,
    XLongField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, Padding, bind_bottom_up, bind_top_down

from netdam.protocol.constants import (
    ELEMENT_SIZE,
    NETDAM_UDP_PORT,
    NUMPY_DTYPE,
    POOL_OPCODES,
    PROTOCOL_VERSION,
    REPLY_OPCODES,
    TAG_SIZE,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    SegmentType,
    Status,
    enum_values,
)

# Enum maps for ByteEnumField, named exactly as the codec's enums so both print the same names.
_OPCODES = {int(m): m.name for m in Opcode}
_DTYPES = {int(m): m.name for m in DType}
_REDUCE_OPS = {int(m): m.name for m in ReduceOp}
_STATUSES = {int(m): m.name for m in Status}
_SEG_TYPES = {int(m): m.name for m in SegmentType}
# Flag bit -> name; FlagsField labels undefined bits "bit_N", which makes bad packets readable.
_FLAGS = {int(m): str(m.name) for m in Flags if m.value}

# Which request opcode a reply may answer (SPEC.md section 3); ACK and NACK answer any request.
_REPLY_FOR = {Opcode.READ_RESP: frozenset({Opcode.READ}), Opcode.INFO: frozenset({Opcode.PING})}

# Header offsets (SPEC.md 2.1) of the bytes post_build may fill.
_LENGTH_OFFSET = 28
_SEG_TYPE_OFFSET = 52


class NetDAMSegment(Packet):
    """One SR list entry (SPEC.md 2.2): the IPv4 address and UDP port of a hop."""

    name = "NetDAM SR segment"
    fields_desc = [
        IPField("ip", "0.0.0.0"),
        ShortField("port", NETDAM_UDP_PORT),
        ShortField("reserved", 0),
    ]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        # A segment is exactly 8 bytes: whatever follows is the next segment, not our payload.
        return b"", s

    def mysummary(self) -> str:
        return str(self.sprintf("%ip%:%port%"))


class NetDAM(Packet):
    """NetDAM v1 fixed header (64 bytes) and SR list; the payload that follows stays ``Raw``."""

    name = "NetDAM"
    fields_desc = [
        ByteField("version", PROTOCOL_VERSION),
        ByteEnumField("opcode", Opcode.PING, _OPCODES),
        FlagsField("flags", 0, 16, _FLAGS),
        IntField("seq", 0),
        IntField("client_id", 0),
        IntField("txn_id", 0),
        IntField("coll_id", 0),
        IntField("epoch", 0),
        XIntField("rkey", 0),
        # None: the payload size, filled in post_build (READ must set it: it has no payload).
        IntField("length", None),
        XLongField("addr", 0),
        XLongField("aux_addr", 0),
        ByteEnumField("dtype", DType.RAW, _DTYPES),
        ByteEnumField("reduce_op", ReduceOp.SUM, _REDUCE_OPS),
        ByteEnumField("status", Status.OK, _STATUSES),
        ByteField("credit", 0),
        # None: IPV4 when there are segments, else NONE, filled in post_build.
        ByteEnumField("seg_type", None, _SEG_TYPES),
        ByteField("segments_left", 0),
        FieldLenField("seg_count", None, count_of="segments", fmt="B"),
        ByteField("reserved1", 0),
        # Return segment: where replies go (0.0.0.0:0 = the UDP source).
        IPField("ret_ip", "0.0.0.0"),
        ShortField("ret_port", 0),
        ShortField("reserved2", 0),
        PacketListField("segments", [], NetDAMSegment, count_from=lambda pkt: pkt.seg_count),
    ]

    # Like IPv6ExtHdrSegmentRouting: fields left None are derived from the rest of the packet
    # here, so NetDAM(opcode="CHAIN_ADD", segments=[...]) / Raw(payload) builds a valid header.
    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.seg_type is None:
            seg_type = SegmentType.IPV4 if self.segments else SegmentType.NONE
            pkt = pkt[:_SEG_TYPE_OFFSET] + struct.pack("!B", seg_type) + pkt[_SEG_TYPE_OFFSET + 1 :]
        if self.length is None:
            # A TAGGED datagram's last 8 bytes are its tag, not payload (SPEC.md 2.6).
            size = len(pay) - (TAG_SIZE if int(self.flags or 0) & Flags.TAGGED else 0)
            pkt = pkt[:_LENGTH_OFFSET] + struct.pack("!I", size) + pkt[_LENGTH_OFFSET + 4 :]
        return pkt + pay

    # A TAGGED datagram ends with its 8-byte tag (SPEC.md 2.6): split off as padding, so the
    # payload above (Raw) is the operand alone; ``packet_tag`` reads it.
    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        if self.flags is not None and int(self.flags) & Flags.TAGGED and len(s) >= TAG_SIZE:
            return s[:-TAG_SIZE], s[-TAG_SIZE:]
        return s, b""

    # sr()/sr1() pairing: a reply echoes client_id, txn_id and seq of its request (SPEC.md 3).
    def hashret(self) -> bytes:
        return struct.pack("!III", self.client_id, self.txn_id, self.seq)

    def answers(self, other: Any) -> int:
        if not isinstance(other, NetDAM):
            return 0
        if self.opcode not in REPLY_OPCODES or other.opcode in REPLY_OPCODES:
            return 0  # replies are never answered (SPEC.md 3)
        allowed = _REPLY_FOR.get(Opcode(self.opcode))
        if allowed is not None and other.opcode not in allowed:
            return 0
        return int(
            (self.client_id, self.txn_id, self.seq) == (other.client_id, other.txn_id, other.seq)
        )

    def mysummary(self) -> str:
        text: str = self.sprintf("NetDAM %opcode% client=%client_id% txn=%txn_id% seq=%seq%")
        if self.opcode == Opcode.NACK:
            text += self.sprintf(" %status%")
        return text


# Requests go to port 7744 and replies come from it; build UDP()/NetDAM() as node-to-node
# traffic (both ports 7744), and dissect either direction.
bind_bottom_up(UDP, NetDAM, dport=NETDAM_UDP_PORT)
bind_bottom_up(UDP, NetDAM, sport=NETDAM_UDP_PORT)
bind_top_down(UDP, NetDAM, sport=NETDAM_UDP_PORT, dport=NETDAM_UDP_PORT)


def packet_tag(pkt: Any) -> int | None:
    """The tag of a TAGGED datagram (SPEC.md 2.6) as a u64, None when it carries none."""
    layer = pkt.getlayer(NetDAM)
    if layer is None:
        raise ValueError("packet has no NetDAM layer")
    if not int(layer.flags) & Flags.TAGGED:
        return None
    pad = layer.getlayer(Padding)
    if pad is None or len(bytes(pad.load)) < TAG_SIZE:
        raise ValueError("TAGGED datagram without its 8-byte tag")
    return int.from_bytes(bytes(pad.load)[:TAG_SIZE], "little")


def payload_elements(pkt: Any) -> np.ndarray[Any, Any]:
    """The payload after the header and SR list, as little-endian elements of the packet's dtype.

    *pkt* is a ``NetDAM`` layer or any packet containing one (``IP()/UDP()/NetDAM()/Raw()``).
    Sparse payloads (flag SPARSE) are returned as their raw elements, not expanded.
    """
    layer = pkt.getlayer(NetDAM)
    if layer is None:
        raise ValueError("packet has no NetDAM layer")
    data = bytes(layer.payload)
    if int(layer.flags) & Flags.TAGGED:
        data = data[:-TAG_SIZE]  # the tag (SPEC.md 2.6), which scapy keeps as Padding
    if layer.dtype not in enum_values(DType):
        raise ValueError(f"unknown dtype {layer.dtype}")
    dtype = DType(layer.dtype)
    size = ELEMENT_SIZE[dtype]
    if len(data) % size:
        raise ValueError(
            f"payload of {len(data)} bytes is not a multiple of the {dtype.name.lower()} "
            f"element size {size}"
        )
    # A copy: writable, and independent of the packet's bytes.
    elements: np.ndarray[Any, Any] = np.frombuffer(data, dtype=np.dtype(NUMPY_DTYPE[dtype])).copy()
    return elements


# ---------------------------------------------------------------- pool control payloads (SPEC 11.9)
# Little-endian like every fixed payload. Not bound above NetDAM (its payload stays Raw, as for
# every opcode); ``pool_payload`` dissects them on demand.


class NetDAMAlloc(Packet):
    """ALLOC request payload, 40 bytes."""

    name = "NetDAM ALLOC"
    fields_desc = [
        LELongField("size", 0),
        XLELongField("credential", 0),
        LEIntField("stride", 0),
        LEShortField("ways", 0),
        FlagsField("rights", 7, 8, ["READ", "WRITE", "ATOMIC"]),
        FlagsField("flags", 0, 8, ["TAGGED"]),
        StrFixedLenField("label", b"", 16),
    ]


class NetDAMCredential(Packet):
    """FREE and QUERY payload: the tenant credential."""

    name = "NetDAM credential"
    fields_desc = [XLELongField("credential", 0)]


class NetDAMRegionWay(Packet):
    name = "NetDAM region way"
    fields_desc = [
        LEIntField("node", 0),
        LEIntField("reserved", 0),
        XLELongField("local", 0),
        LELongField("size", 0),
    ]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


class NetDAMRegion(Packet):
    """The region record of ALLOC's, FREE's and QUERY's ACK (56 bytes + 24 per way, + the
    16-byte tag key of a tagged region)."""

    name = "NetDAM region"
    fields_desc = [
        XLELongField("gaddr", 0),
        LELongField("size", 0),
        XLELongField("credential", 0),
        XLEIntField("rkey", 0),
        LEIntField("stride", 0),
        FieldLenField("ways", None, count_of="way_list", fmt="<H"),
        FlagsField("rights", 7, 8, ["READ", "WRITE", "ATOMIC"]),
        FlagsField("flags", 0, 8, ["TAGGED"]),
        LEIntField("reserved", 0),
        StrFixedLenField("label", b"", 16),
        PacketListField("way_list", [], NetDAMRegionWay, count_from=lambda pkt: pkt.ways),
        ConditionalField(StrFixedLenField("tag_key", b"\0" * 16, 16), lambda pkt: pkt.flags & 1),
    ]


def pool_payload(pkt: Any, request: Any = None) -> Packet:
    """The pool-control payload of *pkt* dissected: NetDAMAlloc (ALLOC), NetDAMCredential (FREE,
    QUERY), or NetDAMRegion for an ACK (pass the *request* it answers when the ACK alone is
    ambiguous: any ACK with a payload of 56 + 24k bytes is taken for a region record)."""
    layer = pkt.getlayer(NetDAM)
    if layer is None:
        raise ValueError("packet has no NetDAM layer")
    data = bytes(layer.payload)
    if layer.opcode == Opcode.ALLOC:
        return NetDAMAlloc(data)
    if layer.opcode in (Opcode.FREE, Opcode.QUERY):
        return NetDAMCredential(data)
    answers_pool = request is None or request.getlayer(NetDAM).opcode in POOL_OPCODES
    if (
        layer.opcode == Opcode.ACK
        and answers_pool
        and len(data) >= 56
        and (len(data) - 56) % 24 in (0, 16)
    ):
        return NetDAMRegion(data)
    raise ValueError(f"{_OPCODES.get(layer.opcode, layer.opcode)} carries no pool-control payload")
