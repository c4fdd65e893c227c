"""Codec of NetDAM v1 datagrams: ``encode_packet(Packet) -> bytes``, ``decode_packet(bytes)``.

Rules of this file:
1. The byte layout is protocol/SPEC.md section "Header", declared once in layout.py; the struct
   formats below derive from that table, as do the named offsets the numba datapath reads
   with (netdam/kernels/wire.py; tests hold the two to the same verdicts).
2. Every malformed input raises RemoteProtocolError with the status a node NACKs with and an
   exact message that the tests assert. Structural checks live here; checks that need node state
   (rkeys, bounds, alignment) live in the node.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple, TypeVar

from netdam.protocol.constants import (
    CONTROL_OPCODES,
    DATA_OPCODES,
    ELEMENT_SIZE,
    FLAGS_V1_MASK,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    PROTOCOL_VERSION,
    SEGMENT_SIZE,
    TAG_SIZE,
    UPDATE_DTYPES,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    SegmentType,
    Status,
    enum_values,
)
from netdam.protocol.errors import LocalProtocolError, RemoteProtocolError
from netdam.protocol.layout import DESCRIPTOR, DESCRIPTOR_BYTES, H_CLIENT_ID, HEADER, SEGMENT
from netdam.protocol.layout import DESCRIPTOR_TAG_KEY as _DESCRIPTOR_TAG_KEY
from netdam.protocol.layout import SPARSE_PREFIX as _SPARSE_PREFIX_LAYOUT

#: The fixed header, network byte order, built from the table in layout.py (SPEC.md 2.1).
HEADER_STRUCT: struct.Struct = HEADER.struct
#: client_id and txn_id, adjacent in the header: what a client matches a reply by without
#: decoding it (SPEC.md 2.1).
REPLY_IDS: struct.Struct = HEADER.part("client_id", "txn_id")
REPLY_IDS_OFFSET = H_CLIENT_ID
#: One SR segment: IPv4, port, reserved.
SEGMENT_STRUCT: struct.Struct = SEGMENT.struct

#: Flag bits as plain ints for the codec's tests: `flags & Flags.TAGGED` on an int builds an
#: IntFlag member (~0.7 us, several per datagram a host sends or reads; `& _TAGGED` ~0.03 us).
_TAGGED = int(Flags.TAGGED)
_SPARSE = int(Flags.SPARSE)

Endpoint = tuple[str, int]
NO_ENDPOINT: Endpoint = ("0.0.0.0", 0)

# Opcodes whose payload is `length` bytes of data elements (dense) or a sparse encoding.
_DATA_OPCODES = DATA_OPCODES
# Opcodes that combine elements: RAW is meaningless for them.
_COMBINE_OPCODES = frozenset({Opcode.ADD, Opcode.CHAIN_ADD})
# Opcodes whose payload is exactly `length` bytes of opaque content.
_OPAQUE_OPCODES = frozenset({Opcode.INFO, Opcode.ACK, Opcode.NACK, Opcode.START_COLL})
# Opcodes that carry no payload and length 0.
_EMPTY_OPCODES = frozenset({Opcode.PING, Opcode.JOIN, Opcode.LEAVE, Opcode.COUNTERS})
# Fixed payload sizes (length field, payload bytes).
_FIXED_PAYLOAD = {
    Opcode.FETCH_ADD: (8, 8),  # addend, u64 LE
    Opcode.CAS: (8, 16),  # compare, swap: u64 LE each
    Opcode.REGISTER: (8, 8),  # requested rkey u32 LE, rights u32 LE
    Opcode.DEREGISTER: (8, 8),  # rkey u32 LE, reserved u32
    Opcode.ALLOC: (40, 40),  # size, credential, stride, ways, rights, label (SPEC.md 11.9)
    Opcode.FREE: (8, 8),  # tenant credential, u64 LE
    Opcode.QUERY: (8, 8),  # tenant credential, u64 LE
}
# A second size some fixed payloads may have: REGISTER with a region's tag key (SPEC.md 6.1).
_FIXED_PAYLOAD_ALT = {Opcode.REGISTER: (24, 24)}
# Only SR-routed opcodes may carry an SR list.
_SR_OPCODES = frozenset({Opcode.CHAIN_ADD, Opcode.START_COLL})
# Names for messages, looked up by value so a plain int opcode needs no enum (~1 us each).
_OPCODE_NAMES = {int(code): code.name for code in Opcode}


@dataclass(frozen=True)
class Packet:
    """One NetDAM datagram, fields named as in SPEC.md."""

    opcode: Opcode
    flags: Flags = Flags.NONE
    seq: int = 0
    client_id: int = 0
    txn_id: int = 0
    coll_id: int = 0
    epoch: int = 0
    rkey: int = 0
    length: int = 0
    addr: int = 0
    aux_addr: int = 0
    dtype: DType = DType.RAW
    reduce_op: ReduceOp = ReduceOp.SUM
    status: Status = Status.OK
    credit: int = 0
    segments_left: int = 0
    segments: tuple[Endpoint, ...] = ()
    ret: Endpoint = NO_ENDPOINT
    payload: bytes = field(default=b"", repr=False)
    version: int = PROTOCOL_VERSION
    #: The trailer of a TAGGED datagram (SPEC.md 2.6), as read; protocol.tag.seal writes it.
    tag: int = 0

    @property
    def seg_type(self) -> SegmentType:
        """IPV4 when the packet carries an SR list, else NONE."""
        return SegmentType.IPV4 if self.segments else SegmentType.NONE

    def with_payload(self, payload: bytes) -> Packet:
        """Copy with *payload* and a matching length field."""
        return replace(self, payload=payload, length=len(payload))


# Cached: a cluster has a handful of addresses, and every control packet converts them (the
# ipaddress parse costs ~8 us, a third of a START_COLL's handling). Errors are never cached.
@lru_cache(maxsize=1024)
def ip_to_int(ip: str) -> int:
    """Dotted IPv4 -> u32."""
    return int(ipaddress.IPv4Address(ip))


@lru_cache(maxsize=1024)
def int_to_ip(value: int) -> str:
    """u32 -> dotted IPv4."""
    return str(ipaddress.IPv4Address(value))


def endpoint_to_u64(endpoint: Endpoint) -> int:
    """Pack an (IPv4, port) pair as ``ip << 16 | port``: the form the datapath uses (SPEC.md)."""
    return (ip_to_int(endpoint[0]) << 16) | endpoint[1]


def u64_to_endpoint(value: int) -> Endpoint:
    """Inverse of endpoint_to_u64."""
    return int_to_ip((value >> 16) & 0xFFFFFFFF), value & 0xFFFF


def encode_packet(packet: Packet, max_payload: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Serialize *packet*; raises LocalProtocolError when SPEC.md forbids it. *max_payload*: the
    receiver's largest payload (constants.largest_payload of its MTU; SPEC.md 2.7)."""
    _check_encodable(packet, max_payload)
    try:
        return _pack(packet)
    except (struct.error, ValueError) as exc:  # a field out of its width, a bad IPv4 string
        raise LocalProtocolError(Status.BAD_FIELD, f"cannot encode packet: {exc}") from None


def _pack(packet: Packet) -> bytes:
    ret_ip, ret_port = packet.ret
    header = HEADER_STRUCT.pack(
        packet.version,
        packet.opcode,
        packet.flags,
        packet.seq,
        packet.client_id,
        packet.txn_id,
        packet.coll_id,
        packet.epoch,
        packet.rkey,
        packet.length,
        packet.addr,
        packet.aux_addr,
        packet.dtype,
        packet.reduce_op,
        packet.status,
        packet.credit,
        packet.seg_type,
        packet.segments_left,
        len(packet.segments),
        0,
        ip_to_int(ret_ip),
        ret_port,
        0,
    )
    segments = b"".join(SEGMENT_STRUCT.pack(ip_to_int(ip), port, 0) for ip, port in packet.segments)
    trailer = packet.tag.to_bytes(TAG_SIZE, "little") if int(packet.flags) & _TAGGED else b""
    return header + segments + packet.payload + trailer


@dataclass(frozen=True)
class StartCollTemplate:
    """A START_COLL encoded once for the calls of a repeated collective, which differ only in
    the header's ``epoch`` and ``txn_id`` and the descriptor's ``rkey`` and tag key (SPEC.md
    6.5): ``moved`` writes those into a copy of the bytes. Building the Packet and running
    encode_packet for every call cost ~15 us of each rank's issue (docs/PERFORMANCE.md, "A
    START_COLL written into its last bytes"); the result is the same, field for field and byte
    for byte."""

    prototype: Packet
    encoded: bytes
    payload_at: int

    @classmethod
    def of(cls, packet: Packet) -> StartCollTemplate:
        """The template of *packet*: an untagged START_COLL whose descriptor carries a tag key
        (SPEC.md 6.5 "Tag key"), checked as encode_packet checks it."""
        if (
            packet.opcode != Opcode.START_COLL
            or len(packet.payload) != DESCRIPTOR_BYTES + _DESCRIPTOR_TAG_KEY.size
            or int(packet.flags) & _TAGGED
        ):
            raise LocalProtocolError(
                Status.BAD_FIELD,
                "a START_COLL template is an untagged START_COLL whose descriptor has a tag key",
            )
        encoded = encode_packet(packet)
        return cls(packet, encoded, len(encoded) - len(packet.payload))

    def moved(self, epoch: int, txn_id: int, rkey: int, tag_key: bytes) -> tuple[Packet, bytes]:
        """The START_COLL with these fields, and its encoding (encode_packet's bytes)."""
        if len(tag_key) != _DESCRIPTOR_TAG_KEY.size or not any(tag_key):
            raise LocalProtocolError(
                Status.BAD_FIELD, f"a tag key is {_DESCRIPTOR_TAG_KEY.size} bytes, not all zero"
            )
        data = bytearray(self.encoded)
        try:
            HEADER.write(data, "epoch", epoch)
            HEADER.write(data, "txn_id", txn_id)
            DESCRIPTOR.write(data, "rkey", rkey, base=self.payload_at)
        except struct.error as exc:  # a field out of its width
            raise LocalProtocolError(Status.BAD_FIELD, f"cannot encode packet: {exc}") from None
        key_at = self.payload_at + DESCRIPTOR_BYTES
        data[key_at : key_at + len(tag_key)] = tag_key
        encoded = bytes(data)
        return self.packet_with(epoch, txn_id, encoded[self.payload_at :]), encoded

    def packet_with(self, epoch: int, txn_id: int, payload: bytes) -> Packet:
        """The prototype with a call's epoch, txn_id and descriptor (*payload*, its fields
        written already: moved's, or a compiled writer's of the same bytes)."""
        return _copied(self.prototype, {"epoch": epoch, "txn_id": txn_id, "payload": payload})


def _copied(packet: Packet, fields: dict[str, object]) -> Packet:
    """*packet* with *fields* replaced, their values already checked: dataclasses.replace runs
    the frozen dataclass's ``__init__`` again, one ``object.__setattr__`` per field (~5 us for
    a Packet here); this copies its attribute dict (~1 us)."""
    copy = object.__new__(Packet)
    copy.__dict__.update(packet.__dict__)
    copy.__dict__.update(fields)
    return copy


def _check_encodable(packet: Packet, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
    """Round-trip guarantee: whatever encode_packet writes, decode_packet accepts."""
    if packet.version != PROTOCOL_VERSION:
        raise LocalProtocolError(
            Status.BAD_VERSION,
            f"cannot encode version {packet.version}; this codec speaks {PROTOCOL_VERSION}",
        )
    if len(packet.segments) > MAX_SEGMENTS:
        raise LocalProtocolError(
            Status.BAD_SEGMENT,
            f"SR list has {len(packet.segments)} segments, the maximum is {MAX_SEGMENTS}",
        )
    if packet.segments_left >= max(len(packet.segments), 1):
        raise LocalProtocolError(
            Status.BAD_SEGMENT,
            f"segments_left {packet.segments_left} out of range for {len(packet.segments)} segments",
        )
    try:
        check_fields(packet, max_payload)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(exc.status, str(exc)) from None


class Answer(NamedTuple):
    """What a host reads of a node's ACK or NACK to its request (SPEC.md 3): matched by
    client_id and txn_id, then its opcode, status, aux_addr (what the answer says) and payload."""

    opcode: int
    status: int
    client_id: int
    txn_id: int
    aux_addr: int
    payload: bytes


def read_answer(data: bytes | bytearray | memoryview) -> Answer | None:
    """*data* as an Answer, or None when it is no well-formed ACK or NACK: decode_packet's rules
    (the same helpers), read without building a Packet, which cost ~27 us of each of the two
    answers a host reads per collective. Not read, so not checked: dtype and reduce_op, which
    mean nothing in an answer."""
    if len(data) < HEADER_SIZE:
        return None
    head = HEADER.unpack(data)
    if head.opcode not in _ANSWERS:
        return None
    view = memoryview(data)
    try:
        _check_words(head.version, head.opcode, head.flags, head.reserved1, head.reserved2)
        _enum(Status, head.status, Status.BAD_FIELD, "status")
        _pull_segments(view, head.seg_type, head.segments_left, head.seg_count)
        start = HEADER_SIZE + SEGMENT_SIZE * head.seg_count
        end, _ = _payload_end(view, head.flags, start)
        payload = bytes(view[start:end])
        # DType.RAW stands for the unread dtype: no rule of an ACK or NACK looks at it.
        _check_shape(head.opcode, head.flags, head.length, payload, DType.RAW, head.seg_count > 0)
    except RemoteProtocolError:
        return None
    return Answer(head.opcode, head.status, head.client_id, head.txn_id, head.aux_addr, payload)


_ANSWERS = frozenset({int(Opcode.ACK), int(Opcode.NACK)})
_STATUSES = frozenset(enum_values(Status))


def decode_packet(
    data: bytes | bytearray | memoryview, max_payload: int = MAX_PAYLOAD_BYTES
) -> Packet:
    """Parse one datagram; raises RemoteProtocolError (with its NACK status) when malformed.
    *max_payload*: the largest payload this end takes (largest_payload of its MTU; SPEC.md 2.7)."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise RemoteProtocolError(
            Status.TRUNCATED,
            f"packet truncated: {len(view)} bytes, the fixed header needs {HEADER_SIZE}",
        )
    head = HEADER.unpack(view)
    _check_words(head.version, head.opcode, head.flags, head.reserved1, head.reserved2)
    dtype_enum = _enum(DType, head.dtype, Status.BAD_DTYPE, "dtype")
    op_enum = _enum(ReduceOp, head.reduce_op, Status.BAD_OP, "reduce op")
    status_enum = _enum(Status, head.status, Status.BAD_FIELD, "status")
    segments = _pull_segments(view, head.seg_type, head.segments_left, head.seg_count)
    offset = HEADER_SIZE + SEGMENT_SIZE * head.seg_count
    end, tag = _payload_end(view, head.flags, offset)
    packet = Packet(
        opcode=Opcode(head.opcode),
        flags=Flags(head.flags),
        seq=head.seq,
        client_id=head.client_id,
        txn_id=head.txn_id,
        coll_id=head.coll_id,
        epoch=head.epoch,
        rkey=head.rkey,
        length=head.length,
        addr=head.addr,
        aux_addr=head.aux_addr,
        dtype=dtype_enum,
        reduce_op=op_enum,
        status=status_enum,
        credit=head.credit,
        segments_left=head.segments_left,
        segments=segments,
        ret=(int_to_ip(head.ret_ip), head.ret_port),
        payload=bytes(view[offset:end]),
        tag=tag,
    )
    check_fields(packet, max_payload)
    return packet


def _check_words(version: int, opcode: int, flags: int, reserved1: int, reserved2: int) -> None:
    """The fixed header's own rules, read before any field is taken as an enum."""
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            Status.BAD_VERSION,
            f"unsupported version {version} (this node speaks {PROTOCOL_VERSION})",
        )
    if opcode not in enum_values(Opcode):
        raise RemoteProtocolError(Status.BAD_OPCODE, f"unknown opcode 0x{opcode:02x}")
    if reserved1 or reserved2:
        raise RemoteProtocolError(
            Status.BAD_FIELD, "reserved header bytes 55 and 62-63 must be zero"
        )
    if flags & ~FLAGS_V1_MASK:
        raise RemoteProtocolError(
            Status.BAD_FIELD, f"undefined flag bits 0x{flags & ~FLAGS_V1_MASK:04x} set"
        )


def _payload_end(view: memoryview, flags: int, start: int) -> tuple[int, int]:
    """Where the payload that begins at *start* ends, and the tag that follows it (0 untagged)."""
    end = len(view)
    if not int(flags) & _TAGGED:
        return end, 0
    if end < start + TAG_SIZE:
        raise RemoteProtocolError(
            Status.TRUNCATED, f"TAGGED datagram without its {TAG_SIZE}-byte tag"
        )
    return end - TAG_SIZE, int.from_bytes(view[end - TAG_SIZE :], "little")


_E = TypeVar("_E", DType, ReduceOp, Status)


def _enum(kind: type[_E], value: int, status: Status, what: str) -> _E:
    if value not in enum_values(kind):
        raise RemoteProtocolError(status, f"unknown {what} {value}")
    return kind(value)


def _pull_segments(
    view: memoryview, seg_type: int, segments_left: int, seg_count: int
) -> tuple[Endpoint, ...]:
    """Parse the SR list that follows the fixed header."""
    if seg_type == SegmentType.IPV6:
        raise RemoteProtocolError(Status.BAD_SEGMENT, "segment type 2 (IPv6) is reserved in v1")
    if seg_type not in (SegmentType.NONE, SegmentType.IPV4):
        raise RemoteProtocolError(Status.BAD_SEGMENT, f"unknown segment type {seg_type}")
    if seg_count > MAX_SEGMENTS:
        raise RemoteProtocolError(
            Status.BAD_SEGMENT, f"SR list has {seg_count} segments, the maximum is {MAX_SEGMENTS}"
        )
    if (seg_type == SegmentType.NONE) != (seg_count == 0):
        raise RemoteProtocolError(
            Status.BAD_SEGMENT,
            f"segment type {seg_type} does not match a list of {seg_count} segments",
        )
    if segments_left >= max(seg_count, 1):
        raise RemoteProtocolError(
            Status.BAD_SEGMENT,
            f"segments_left {segments_left} out of range for {seg_count} segments",
        )
    available = (len(view) - HEADER_SIZE) // SEGMENT_SIZE
    if available < seg_count:
        raise RemoteProtocolError(
            Status.TRUNCATED, f"SR list truncated ({available} of {seg_count} segments)"
        )
    if seg_count == 0:
        return ()
    return _parse_segments(bytes(view[HEADER_SIZE : HEADER_SIZE + SEGMENT_SIZE * seg_count]))


# Cached by the list's bytes: a group's START_COLLs (and their retries) carry the same SR list
# call after call, and parsing 64 segments costs ~40 us of a START_COLL's ~150 (measured with
# 64 members). Errors are never cached.
@lru_cache(maxsize=256)
def _parse_segments(raw: bytes) -> tuple[Endpoint, ...]:
    segments = []
    for index in range(len(raw) // SEGMENT_SIZE):
        ip, port, reserved = SEGMENT_STRUCT.unpack_from(raw, SEGMENT_SIZE * index)
        if reserved:
            raise RemoteProtocolError(
                Status.BAD_SEGMENT, f"segment {index} has non-zero reserved bytes"
            )
        segments.append((int_to_ip(ip), port))
    return tuple(segments)


#: Opcodes with a sparse form (SPEC.md 2.5); SPARSE on any other is BAD_FIELD.
_SPARSE_OPCODES = frozenset({Opcode.CHAIN_ADD, Opcode.ALL_WRITE, Opcode.WRITE})


def check_fields(packet: Packet, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
    """Structural rules per opcode (SPEC.md "Opcodes"): lengths (at most *max_payload*, the
    largest payload at the receiver's MTU, SPEC.md 2.7), dtypes, SR use."""
    _check_shape(
        packet.opcode,
        packet.flags,
        packet.length,
        packet.payload,
        packet.dtype,
        bool(packet.segments),
        max_payload,
    )


def _check_shape(
    opcode: int,
    flags: int,
    length: int,
    payload: bytes,
    dtype: DType,
    routed: bool,
    max_payload: int = MAX_PAYLOAD_BYTES,
) -> None:
    """check_fields on the fields themselves, so read_answer applies it without a Packet. The
    opcode may be a plain int: its name is looked up only for an error's message."""
    size = len(payload)
    name = _OPCODE_NAMES.get(opcode, "?")
    if routed and opcode not in _SR_OPCODES:
        raise RemoteProtocolError(Status.BAD_SEGMENT, f"{name} does not take an SR list")
    if length > max_payload and opcode not in CONTROL_OPCODES:
        raise RemoteProtocolError(
            Status.TOO_LARGE, f"length {length} exceeds the maximum payload of {max_payload} bytes"
        )
    if opcode in _COMBINE_OPCODES and dtype == DType.RAW:
        raise RemoteProtocolError(
            Status.BAD_DTYPE, f"{name} cannot combine raw bytes; give an element dtype"
        )
    if opcode in (Opcode.FETCH_ADD, Opcode.CAS) and dtype != DType.U64:
        raise RemoteProtocolError(Status.BAD_DTYPE, f"{name} operates on u64 only")
    if opcode == Opcode.UPDATE and dtype not in UPDATE_DTYPES:
        raise RemoteProtocolError(
            Status.BAD_DTYPE, f"an UPDATE's gradient is f32, f16 or bf16, not {dtype.name}"
        )
    if int(flags) & _SPARSE and opcode not in _SPARSE_OPCODES:
        raise RemoteProtocolError(Status.BAD_FIELD, f"{name} has no sparse form")
    if opcode == Opcode.READ:
        _check_read(length, size, dtype)
    elif opcode in _DATA_OPCODES:
        _check_data(name, flags, length, payload, dtype)
    elif opcode in _OPAQUE_OPCODES:
        _expect_payload(name, length, size)
    elif opcode in _EMPTY_OPCODES:
        if length or size:
            raise RemoteProtocolError(
                Status.BAD_LENGTH,
                f"{name} carries no payload (length {length}, {size} bytes follow)",
            )
    else:
        want_length, want_size = _FIXED_PAYLOAD[opcode]
        if (length, size) == _FIXED_PAYLOAD_ALT.get(opcode):
            return
        if length != want_length or size != want_size:
            raise RemoteProtocolError(
                Status.BAD_LENGTH,
                f"{name} needs length {want_length} and a payload of {want_size} bytes "
                f"(got length {length}, {size} bytes)",
            )


def _check_read(length: int, size: int, dtype: DType) -> None:
    if size:
        raise RemoteProtocolError(
            Status.BAD_LENGTH, f"READ carries no payload but {size} bytes follow the header"
        )
    if length == 0:
        raise RemoteProtocolError(Status.BAD_LENGTH, "READ of length 0")
    _check_multiple(length, dtype)


def _check_data(name: str, flags: int, length: int, payload: bytes, dtype: DType) -> None:
    if length == 0:
        raise RemoteProtocolError(Status.BAD_LENGTH, f"{name} of length 0")
    if int(flags) & _SPARSE:  # only _SPARSE_OPCODES get here (check_fields)
        _check_multiple(length, dtype)
        check_sparse_payload(payload, length, dtype)
        return
    _expect_payload(name, length, len(payload))
    _check_multiple(length, dtype)


def _expect_payload(name: str, length: int, size: int) -> None:
    if length != size:
        raise RemoteProtocolError(
            Status.BAD_LENGTH, f"{name} length field says {length} bytes but the payload has {size}"
        )


def _check_multiple(length: int, dtype: DType) -> None:
    element = ELEMENT_SIZE[dtype]
    if length % element:
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"length {length} is not a multiple of the {dtype.name.lower()} element size {element}",
        )


SPARSE_PREFIX: struct.Struct = _SPARSE_PREFIX_LAYOUT.struct


def sparse_payload_size(nnz: int, dtype: DType) -> int:
    """Bytes of a sparse payload with *nnz* entries: prefix, u16 indices padded to 8, values."""
    indices = (2 * nnz + 7) // 8 * 8
    return int(SPARSE_PREFIX.size + indices + nnz * ELEMENT_SIZE[dtype])


def check_sparse_payload(payload: bytes, length: int, dtype: DType) -> None:
    """SPEC.md "Sparse payload": u32 nnz, u32 reserved, nnz u16 indices (strictly increasing,
    below length/element size), zero padding to 8, nnz values."""
    if len(payload) < SPARSE_PREFIX.size:
        raise RemoteProtocolError(Status.TRUNCATED, "sparse payload shorter than its 8-byte prefix")
    nnz, reserved = SPARSE_PREFIX.unpack_from(payload, 0)
    if reserved:
        raise RemoteProtocolError(Status.BAD_FIELD, "sparse prefix reserved word must be zero")
    elements = length // ELEMENT_SIZE[dtype]
    if nnz > elements:
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"sparse nnz {nnz} exceeds the {elements} elements of length {length}",
        )
    if len(payload) != sparse_payload_size(nnz, dtype):
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"sparse payload of {nnz} entries must be {sparse_payload_size(nnz, dtype)} bytes, got {len(payload)}",
        )
    indices = struct.unpack_from(f"<{nnz}H", payload, SPARSE_PREFIX.size)
    pad_start = SPARSE_PREFIX.size + 2 * nnz
    if any(payload[pad_start : sparse_payload_size(nnz, dtype) - nnz * ELEMENT_SIZE[dtype]]):
        raise RemoteProtocolError(Status.BAD_FIELD, "sparse index padding must be zero")
    if any(b <= a for a, b in zip(indices, indices[1:])) or (indices and indices[-1] >= elements):
        raise RemoteProtocolError(
            Status.BAD_FIELD, f"sparse indices must increase strictly and stay below {elements}"
        )


def with_retry_flag(data: bytes) -> bytes:
    """Encoded datagram *data* with flag RETRY set (a client's retransmission, SPEC.md 2.3)."""
    out = bytearray(data)
    HEADER.write(out, "flags", HEADER.read(out, "flags") | Flags.RETRY)
    return bytes(out)


def reply_to(
    request: Packet,
    opcode: Opcode,
    status: Status = Status.OK,
    payload: bytes = b"",
    *,
    rkey: int | None = None,
    addr: int | None = None,
    aux_addr: int | None = None,
) -> Packet:
    """A reply: echoes ids, addresses and the return segment, drops the SR list (SPEC.md);
    *rkey*, *addr* and *aux_addr*, when given, instead of the request's (one copy of the
    request, where a copy per changed field cost a START_COLL's answer ~5 us each)."""
    return replace(
        request,
        opcode=opcode,
        flags=request.flags & (Flags.RELAYED | Flags.MCAST),
        status=status,
        segments=(),
        segments_left=0,
        length=len(payload),
        payload=payload,
        rkey=request.rkey if rkey is None else rkey,
        addr=request.addr if addr is None else addr,
        aux_addr=request.aux_addr if aux_addr is None else aux_addr,
    )
