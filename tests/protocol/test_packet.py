"""Codec: round trips, exact layout, and every error path with its exact message and status."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
from helpers import start_coll_packet, valid_packets
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam.protocol.constants import (
    HEADER_SIZE,
    MAX_EMULATED_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    DType,
    Flags,
    Opcode,
    Status,
    largest_payload,
    max_elements,
    max_payload,
    slot_bytes,
)
from netdam.protocol.errors import LocalProtocolError, RemoteProtocolError
from netdam.protocol.packet import (
    Packet,
    StartCollTemplate,
    decode_packet,
    encode_packet,
    endpoint_to_u64,
    reply_to,
    sparse_payload_size,
    u64_to_endpoint,
)

F32X4 = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def chain(**kw: object) -> Packet:
    base = dict(
        opcode=Opcode.CHAIN_ADD,
        flags=Flags.ACK_REQ,
        seq=7,
        client_id=3,
        txn_id=9,
        coll_id=11,
        epoch=2,
        rkey=0xABCD,
        addr=4096,
        aux_addr=8192,
        dtype=DType.F32,
        segments=(("127.0.0.1", 7745), ("127.0.0.1", 7746)),
        segments_left=1,
        length=16,
        payload=F32X4,
    )
    base.update(kw)
    return Packet(**base)


def test_header_layout_offsets() -> None:
    data = encode_packet(chain(ret=("10.1.2.3", 0x1234)))
    assert data[0] == 1 and data[1] == Opcode.CHAIN_ADD
    assert data[2:4] == b"\x00\x01"
    assert struct.unpack("!IIIIII", data[4:28]) == (7, 3, 9, 11, 2, 0xABCD)
    assert struct.unpack("!I", data[28:32]) == (16,)
    assert struct.unpack("!QQ", data[32:48]) == (4096, 8192)
    assert list(data[48:56]) == [DType.F32, 0, 0, 0, 1, 1, 2, 0]
    assert data[56:62] == bytes([10, 1, 2, 3, 0x12, 0x34])
    assert data[64:72] == bytes([127, 0, 0, 1, 0x1E, 0x41, 0, 0])
    assert data[HEADER_SIZE + 16 :] == F32X4
    assert len(data) == HEADER_SIZE + 16 + 16


def test_round_trip_chain() -> None:
    packet = chain()
    assert decode_packet(encode_packet(packet)) == packet


def test_payload_capacity_at_mtu_9000() -> None:
    assert max_elements(9000, DType.F32) == 2048
    assert max_elements(9000, DType.F16) == 4096
    assert max_elements(9000, DType.F64) == 1024
    assert max_elements(9000, DType.F32, segments=MAX_SEGMENTS) == 2048
    assert max_elements(1500, DType.F32, segments=3) == (1500 - 28 - 64 - 24) // 4
    big = chain(
        segments=tuple(("127.0.0.1", 8000 + i) for i in range(MAX_SEGMENTS)),
        segments_left=MAX_SEGMENTS - 1,
        length=8192,
        payload=bytes(8192),
    )
    assert len(encode_packet(big)) == 64 + 8 * 64 + 8192 <= 8972


def test_the_largest_payload_follows_the_mtu() -> None:
    """SPEC.md 2.7: 8192 up to MTU 12899, then whole 4 KiB units of what a full SR list and a
    tag leave; every datagram with the largest payload fits its MTU; the default MTU's send
    slot is unchanged (8776). The codec holds a datagram to the largest payload it is given."""
    assert [largest_payload(m) for m in (1500, 9000, 12899, 12900, 16000, 65000, 65535)] == [
        8192,
        8192,
        8192,
        12288,
        12288,
        61440,
        61440,
    ]
    assert MAX_EMULATED_PAYLOAD_BYTES == 61440 and slot_bytes(9000) == 8776
    assert max_elements(65000, DType.F32, segments=3) == 15360
    assert max_payload(65000) == max_payload(65000, tagged=True) == 61440
    last = 0
    for mtu in range(9000, 65536, 7):
        p = largest_payload(mtu)
        assert p >= last and p % 4096 == 0
        assert 64 + 8 * MAX_SEGMENTS + p + 8 <= mtu - 28, mtu
        last = p
    big = chain(
        segments=tuple(("127.0.0.1", 8000 + i) for i in range(MAX_SEGMENTS)),
        segments_left=MAX_SEGMENTS - 1,
        length=61440,
        payload=bytes(61440),
    )
    data = encode_packet(big, max_payload=61440)
    assert decode_packet(data, max_payload=61440) == big
    with pytest.raises(LocalProtocolError, match="exceeds the maximum payload of 8192 bytes"):
        encode_packet(big)
    with pytest.raises(RemoteProtocolError, match="exceeds the maximum payload of 8192 bytes"):
        decode_packet(data)


def test_endpoint_packing() -> None:
    assert endpoint_to_u64(("127.0.0.1", 7744)) == (0x7F000001 << 16) | 7744
    assert u64_to_endpoint(endpoint_to_u64(("10.0.0.9", 1))) == ("10.0.0.9", 1)


def test_reply_drops_sr_list_and_keeps_ids() -> None:
    reply = reply_to(chain(), Opcode.NACK, Status.NO_RIGHTS)
    assert reply.segments == () and reply.segments_left == 0 and reply.length == 0
    assert (reply.client_id, reply.txn_id, reply.seq, reply.coll_id) == (3, 9, 7, 11)
    assert decode_packet(encode_packet(reply)).status == Status.NO_RIGHTS


def _raw(packet: Packet, patch: dict[int, int] | None = None, cut: int | None = None) -> bytes:
    data = bytearray(encode_packet(packet))
    for offset, value in (patch or {}).items():
        data[offset] = value
    return bytes(data[:cut] if cut is not None else data)


MALFORMED = [
    (
        _raw(chain(), cut=37),
        Status.TRUNCATED,
        "packet truncated: 37 bytes, the fixed header needs 64",
    ),
    (_raw(chain(), {0: 2}), Status.BAD_VERSION, "unsupported version 2 (this node speaks 1)"),
    (_raw(chain(), {1: 0x7F}), Status.BAD_OPCODE, "unknown opcode 0x7f"),
    (_raw(chain(), {1: 0x1F}), Status.BAD_OPCODE, "unknown opcode 0x1f"),
    (_raw(chain(), {55: 1}), Status.BAD_FIELD, "reserved header bytes 55 and 62-63 must be zero"),
    (_raw(chain(), {63: 1}), Status.BAD_FIELD, "reserved header bytes 55 and 62-63 must be zero"),
    (_raw(chain(), {2: 0x01}), Status.BAD_FIELD, "undefined flag bits 0x0100 set"),
    (_raw(chain(), {48: 8}), Status.BAD_DTYPE, "unknown dtype 8"),
    (_raw(chain(), {49: 3}), Status.BAD_OP, "unknown reduce op 3"),
    (_raw(chain(), {50: 99}), Status.BAD_FIELD, "unknown status 99"),
    (_raw(chain(), {52: 2}), Status.BAD_SEGMENT, "segment type 2 (IPv6) is reserved in v1"),
    (_raw(chain(), {52: 9}), Status.BAD_SEGMENT, "unknown segment type 9"),
    (_raw(chain(), {54: 65}), Status.BAD_SEGMENT, "SR list has 65 segments, the maximum is 64"),
    (
        _raw(chain(), {52: 0}),
        Status.BAD_SEGMENT,
        "segment type 0 does not match a list of 2 segments",
    ),
    (_raw(chain(), {53: 2}), Status.BAD_SEGMENT, "segments_left 2 out of range for 2 segments"),
    (_raw(chain(), {54: 9}), Status.TRUNCATED, "SR list truncated (4 of 9 segments)"),
    (_raw(chain(), cut=70), Status.TRUNCATED, "SR list truncated (0 of 2 segments)"),
    (_raw(chain(), {71: 1}), Status.BAD_SEGMENT, "segment 0 has non-zero reserved bytes"),
    (
        _raw(chain(), cut=90),
        Status.BAD_LENGTH,
        "CHAIN_ADD length field says 16 bytes but the payload has 10",
    ),
    (
        _raw(chain(), {48: 0}),
        Status.BAD_DTYPE,
        "CHAIN_ADD cannot combine raw bytes; give an element dtype",
    ),
    (
        encode_packet(Packet(Opcode.READ, length=16)) + b"xx",
        Status.BAD_LENGTH,
        "READ carries no payload but 2 bytes follow the header",
    ),
]


@pytest.mark.parametrize("data,status,message", MALFORMED)
def test_malformed_exact_errors(data: bytes, status: Status, message: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_packet(data)
    assert str(info.value) == message
    assert info.value.status == status


def _decode_error(packet_bytes: bytes) -> tuple[Status, str]:
    with pytest.raises(RemoteProtocolError) as info:
        decode_packet(packet_bytes)
    return info.value.status, str(info.value)


def _header_only(opcode: Opcode, **kw: object) -> bytes:
    """Encode a header with arbitrary fields, bypassing the encoder's checks."""
    packet = Packet(opcode=opcode, **kw)
    from netdam.protocol import packet as codec

    original = codec._check_encodable
    codec._check_encodable = lambda p, max_payload=0: None
    try:
        return encode_packet(packet)
    finally:
        codec._check_encodable = original


def test_opcode_field_rules() -> None:
    cases = [
        (
            _header_only(Opcode.WRITE, segments=(("1.2.3.4", 5),)),
            Status.BAD_SEGMENT,
            "WRITE does not take an SR list",
        ),
        (
            _header_only(Opcode.READ, length=9000),
            Status.TOO_LARGE,
            "length 9000 exceeds the maximum payload of 8192 bytes",
        ),
        (
            _header_only(Opcode.FETCH_ADD, length=8, payload=bytes(8)),
            Status.BAD_DTYPE,
            "FETCH_ADD operates on u64 only",
        ),
        (_header_only(Opcode.READ), Status.BAD_LENGTH, "READ of length 0"),
        (
            _header_only(Opcode.READ, length=6, dtype=DType.F32),
            Status.BAD_LENGTH,
            "length 6 is not a multiple of the f32 element size 4",
        ),
        (_header_only(Opcode.WRITE), Status.BAD_LENGTH, "WRITE of length 0"),
        (
            _header_only(Opcode.ACK, length=8),
            Status.BAD_LENGTH,
            "ACK length field says 8 bytes but the payload has 0",
        ),
        (
            _header_only(Opcode.PING, length=1, payload=b"x"),
            Status.BAD_LENGTH,
            "PING carries no payload (length 1, 1 bytes follow)",
        ),
        (
            _header_only(Opcode.CAS, dtype=DType.U64, length=8, payload=bytes(8)),
            Status.BAD_LENGTH,
            "CAS needs length 8 and a payload of 16 bytes (got length 8, 8 bytes)",
        ),
        (
            _header_only(
                Opcode.ADD, flags=Flags.SPARSE, dtype=DType.F32, length=8, payload=bytes(8)
            ),
            Status.BAD_FIELD,
            "ADD has no sparse form",
        ),
    ]
    for data, status, message in cases:
        assert _decode_error(data) == (status, message)


def test_sparse_payload_rules() -> None:
    def sparse(nnz: int, indices: list[int], values: int, length: int = 64) -> bytes:
        body = struct.pack("<II", nnz, 0) + struct.pack(f"<{len(indices)}H", *indices)
        body += bytes((-len(body)) % 8) + bytes(4 * values)
        return _header_only(
            Opcode.WRITE, flags=Flags.SPARSE, dtype=DType.F32, length=length, payload=body
        )

    good = decode_packet(sparse(2, [1, 5], 2))
    assert len(good.payload) == sparse_payload_size(2, DType.F32) == 8 + 8 + 8
    assert _decode_error(sparse(2, [5, 1], 2)) == (
        Status.BAD_FIELD,
        "sparse indices must increase strictly and stay below 16",
    )
    assert _decode_error(sparse(2, [1, 16], 2)) == (
        Status.BAD_FIELD,
        "sparse indices must increase strictly and stay below 16",
    )
    assert _decode_error(sparse(17, [], 0)) == (
        Status.BAD_LENGTH,
        "sparse nnz 17 exceeds the 16 elements of length 64",
    )
    assert _decode_error(sparse(3, [1, 2], 2)) == (
        Status.BAD_LENGTH,
        "sparse payload of 3 entries must be 28 bytes, got 24",
    )
    truncated = _header_only(
        Opcode.WRITE, flags=Flags.SPARSE, dtype=DType.F32, length=64, payload=b"\x01"
    )
    assert _decode_error(truncated) == (
        Status.TRUNCATED,
        "sparse payload shorter than its 8-byte prefix",
    )


def test_encoder_refuses_what_decoder_would() -> None:
    with pytest.raises(LocalProtocolError, match="exceeds the maximum payload"):
        encode_packet(Packet(Opcode.WRITE, length=9000, payload=bytes(9000)))
    with pytest.raises(LocalProtocolError, match="SR list has 65 segments"):
        encode_packet(chain(segments=tuple(("1.1.1.1", i) for i in range(65))))


def test_truncation_at_every_offset_raises_protocol_error_only() -> None:
    data = encode_packet(chain())
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode_packet(data[:cut])


@settings(max_examples=300, deadline=None)
@given(valid_packets())
def test_hypothesis_round_trip(packet: Packet) -> None:
    data = encode_packet(packet)
    assert decode_packet(data) == packet
    assert encode_packet(decode_packet(data)) == data


@settings(max_examples=300, deadline=None)
@given(valid_packets(), st.integers(0, 700), st.integers(0, 255))
def test_hypothesis_mutations_never_escape(packet: Packet, offset: int, value: int) -> None:
    """Any single-byte mutation decodes or raises RemoteProtocolError: nothing else."""
    data = bytearray(encode_packet(packet))
    data[offset % len(data)] = value
    try:
        decode_packet(bytes(data))
    except RemoteProtocolError as exc:
        assert isinstance(exc.status, Status) and exc.status != Status.OK


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(min_size=16, max_size=16).filter(any),
)
def test_a_start_coll_template_moved_equals_the_start_coll_built_whole(
    epoch: int, txn_id: int, rkey: int, tag_key: bytes
) -> None:
    """StartCollTemplate.moved gives the Packet and the bytes that building the START_COLL
    with those fields and encode_packet give, whatever the template was built with."""
    template = StartCollTemplate.of(start_coll_packet(1, 2, 3, b"\x01" * 16))
    packet, encoded = template.moved(epoch, txn_id, rkey, tag_key)
    whole = start_coll_packet(epoch, txn_id, rkey, tag_key)
    assert packet == whole
    assert encoded == encode_packet(whole)
    assert decode_packet(encoded) == whole
    assert template.prototype == start_coll_packet(1, 2, 3, b"\x01" * 16)  # left as it was


def test_a_start_coll_template_refuses_what_encode_packet_would() -> None:
    """Only an untagged START_COLL with a tag key in its descriptor makes a template, and a
    field out of its width or a bad tag key is refused as encode_packet refuses it."""
    good = start_coll_packet(1, 2, 3, b"\x01" * 16)
    with pytest.raises(LocalProtocolError, match="START_COLL template"):
        StartCollTemplate.of(replace(good, opcode=Opcode.READ))
    with pytest.raises(LocalProtocolError, match="START_COLL template"):
        StartCollTemplate.of(replace(good, flags=Flags.TAGGED))
    short = good.payload[:-16]
    with pytest.raises(LocalProtocolError, match="START_COLL template"):
        StartCollTemplate.of(replace(good, payload=short, length=len(short)))
    template = StartCollTemplate.of(good)
    with pytest.raises(LocalProtocolError, match="cannot encode packet") as err:
        template.moved(2**32, 0, 3, b"\x01" * 16)
    assert err.value.status == Status.BAD_FIELD
    with pytest.raises(LocalProtocolError, match="cannot encode packet"):
        template.moved(1, 0, 2**32, b"\x01" * 16)
    for bad in (b"\x00" * 16, b"\x01" * 15, b"\x01" * 17):
        with pytest.raises(LocalProtocolError, match="a tag key is 16 bytes"):
            template.moved(1, 0, 3, bad)
