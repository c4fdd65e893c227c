"""Golden fixtures (protocol/fixtures/*.hex): decode -> expected fields -> encode gives the same bytes.

The expected values below are written by hand from SPEC.md, not taken from generate.py, so a codec
change that moves a field fails here even when the generator agrees with the codec.
"""

from __future__ import annotations

import re
import struct
from importlib import resources
from typing import Any

import pytest

from netdam.protocol.constants import DType, Flags, Opcode, ReduceOp, SegmentType, Status
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.fixtures import FIXTURE_NAMES, generate, load_fixture, parse_hex_dump
from netdam.protocol.packet import decode_packet, encode_packet
from netdam.protocol.tag import verify, verify_control

RKEY = 0x1234_5678
ADMIN = 0x05EC_12E7
HOPS = (("10.0.0.2", 7744), ("10.0.0.3", 7744), ("10.0.0.4", 7744))
RING = (("10.0.0.1", 7744), *HOPS)
GROUP_ADDR = (0xEF4D_0001 << 16) | 7744  # 239.77.0.1:7744 as ip << 16 | port
CREDENTIAL = 0x0123_4567_89AB_CDEF


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


EXPECTED: dict[str, dict[str, Any]] = {
    "read": dict(
        opcode=Opcode.READ,
        client_id=7,
        txn_id=101,
        rkey=RKEY,
        length=16,
        addr=0x1000,
        dtype=DType.F32,
        payload=b"",
    ),
    "read_resp": dict(
        opcode=Opcode.READ_RESP,
        txn_id=101,
        credit=3,
        length=16,
        addr=0x1000,
        payload=f32(1.5, -2.0, 0.25, 1024.0),
    ),
    "write": dict(
        opcode=Opcode.WRITE,
        flags=Flags.ACK_REQ,
        txn_id=102,
        addr=0x2000,
        length=16,
        payload=f32(0.5, 1.0, -3.25, 8.0),
    ),
    "add": dict(
        opcode=Opcode.ADD,
        flags=Flags.ACK_REQ | Flags.RETRY,
        txn_id=103,
        addr=0x2010,
        reduce_op=ReduceOp.MAX,
        payload=f32(7.0, -7.0, 0.0, 3.5),
    ),
    "chain_add": dict(
        opcode=Opcode.CHAIN_ADD,
        flags=Flags.ACK_REQ,
        seq=3,
        txn_id=104,
        coll_id=9,
        epoch=2,
        addr=0x1_0000,
        aux_addr=0x2_0000,
        dtype=DType.F32,
        reduce_op=ReduceOp.SUM,
        segments=HOPS,
        segments_left=2,
        seg_type=SegmentType.IPV4,
        ret=("10.0.0.1", 7744),
        payload=f32(0.125, -1.5, 2.75, 100.0),
    ),
    "all_write": dict(
        opcode=Opcode.ALL_WRITE,
        flags=Flags.MCAST,
        seq=5,
        txn_id=105,
        coll_id=9,
        epoch=2,
        addr=0x3_0000,
        dtype=DType.F16,
        length=8,
        payload=bytes.fromhex("003c00b8ff7b0004"),
    ),  # 1, -0.5, 65504, 2**-14
    "fetch_add": dict(
        opcode=Opcode.FETCH_ADD,
        txn_id=106,
        addr=0x4_0008,
        dtype=DType.U64,
        length=8,
        payload=(5).to_bytes(8, "little"),
    ),
    "cas": dict(
        opcode=Opcode.CAS,
        txn_id=107,
        addr=0x4_0010,
        dtype=DType.U64,
        length=8,
        payload=bytes(8) + (0xDEADBEEF).to_bytes(8, "little"),
    ),
    "ping": dict(opcode=Opcode.PING, client_id=7, txn_id=108, length=0, payload=b""),
    "info": dict(
        opcode=Opcode.INFO,
        txn_id=108,
        length=32,
        payload=struct.pack("<IIQIIII", 1, 9000, 1 << 30, 8192, 64, 2, 4),
    ),
    "ack": dict(
        opcode=Opcode.ACK,
        txn_id=106,
        credit=1,
        addr=0x4_0008,
        dtype=DType.U64,
        status=Status.OK,
        payload=(41).to_bytes(8, "little"),
    ),
    "nack": dict(
        opcode=Opcode.NACK,
        txn_id=109,
        addr=0xF_FFF0,
        status=Status.OUT_OF_BOUNDS,
        length=0,
        payload=b"",
    ),
    "update": dict(
        opcode=Opcode.UPDATE,
        client_id=7,
        txn_id=120,
        epoch=3,
        rkey=RKEY,
        addr=0x5_0000,
        aux_addr=1024,
        dtype=DType.BF16,
        length=8,
        payload=struct.pack("<4H", 0x3F80, 0xC000, 0x3E80, 0x0000),  # 1.0, -2.0, 0.25, 0.0
    ),
    "register": dict(
        opcode=Opcode.REGISTER,
        rkey=ADMIN,
        txn_id=110,
        addr=0x10_0000,
        aux_addr=0x10_0000,
        length=8,
        payload=struct.pack("<II", 0xC0FFEE01, 3),
    ),
    "deregister": dict(
        opcode=Opcode.DEREGISTER,
        rkey=ADMIN,
        txn_id=111,
        length=8,
        payload=struct.pack("<II", 0xC0FFEE01, 0),
    ),
    "join": dict(opcode=Opcode.JOIN, rkey=ADMIN, txn_id=112, addr=GROUP_ADDR, length=0),
    "leave": dict(opcode=Opcode.LEAVE, rkey=ADMIN, txn_id=113, addr=GROUP_ADDR, length=0),
    "start_coll": dict(
        opcode=Opcode.START_COLL,
        rkey=ADMIN,
        txn_id=114,
        coll_id=10,
        epoch=1,
        addr=0,
        aux_addr=0,
        dtype=DType.F32,
        segments=RING,
        segments_left=0,
        length=64,
        payload=struct.pack(
            "<BBHIQQQIIQQII",
            0,
            0,
            0,
            0,
            1 << 20,
            0x10000,
            0x10000,
            0x5EED0001,
            0,
            (0xEF4D0001 << 16) | 7744,
            0,
            10_000,
            0,
        ),
    ),
    "counters": dict(opcode=Opcode.COUNTERS, rkey=ADMIN, txn_id=115, length=0, payload=b""),
    # SPEC.md 11.9: size, credential (u64 LE), stride (u32), ways (u16), rights (u8), reserved, label.
    "alloc": dict(
        opcode=Opcode.ALLOC,
        rkey=ADMIN,
        txn_id=116,
        length=40,
        addr=0,
        payload=struct.pack("<QQIHBB16s", 65536, 0, 8192, 2, 7, 0, b"demo"),
    ),
    "alloc_ack": dict(
        opcode=Opcode.ACK,
        rkey=0x5A17C0DE,
        txn_id=116,
        length=104,
        addr=1 << 32,
        payload=struct.pack(
            "<QQQIIHBBI16s", 1 << 32, 65536, CREDENTIAL, 0x5A17C0DE, 8192, 2, 7, 0, 0, b"demo"
        )
        + struct.pack("<IIQQ", 0, 0, 0x10000, 32768)
        + struct.pack("<IIQQ", 1, 0, 0x10000, 32768),
    ),
    "free": dict(
        opcode=Opcode.FREE,
        rkey=0,
        txn_id=117,
        length=8,
        addr=1 << 32,
        payload=CREDENTIAL.to_bytes(8, "little"),
    ),
    "query": dict(
        opcode=Opcode.QUERY,
        rkey=0,
        txn_id=118,
        length=8,
        addr=1 << 32,
        payload=CREDENTIAL.to_bytes(8, "little"),
    ),
    "all_write_tagged": dict(
        opcode=Opcode.ALL_WRITE,
        flags=Flags.MCAST | Flags.TAGGED,
        seq=5,
        txn_id=105,
        coll_id=9,
        epoch=2,
        rkey=RKEY,
        addr=0x3_0000,
        dtype=DType.F16,
        length=8,
        tag=0xFA019AE1FE937BCA,
    ),
    "read_tagged": dict(
        opcode=Opcode.READ,
        flags=Flags.TAGGED,
        client_id=7,
        txn_id=101,
        rkey=RKEY,
        length=16,
        addr=0x1000,
        dtype=DType.F32,
        payload=b"",
        tag=0x344F9D27B315EA12,
    ),
    "register_sealed": dict(
        opcode=Opcode.REGISTER,
        flags=Flags.TAGGED,
        client_id=7,
        txn_id=110,
        rkey=0,
        length=8,
        addr=0x10_0000,
        aux_addr=0x10_0000,
        payload=struct.pack("<II", 0xC0FFEE01, 3),
        tag=0xD8F2554DD655B550,
    ),
}


def test_the_sealed_register_carries_its_control_tag() -> None:
    """Worked example 10.25 checks out with the plain-Python control tag (SPEC.md 2.6)."""
    data = load_fixture("register_sealed")
    assert verify_control(bytes(range(16)), data) and not verify(bytes(range(16)), data)


def test_every_opcode_has_a_fixture() -> None:
    assert tuple(EXPECTED) == FIXTURE_NAMES
    opcodes = {decode_packet(load_fixture(name)).opcode for name in FIXTURE_NAMES}
    assert opcodes == set(Opcode)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_decodes_to_expected_fields(name: str) -> None:
    data = load_fixture(name)
    packet = decode_packet(data)
    for field, value in EXPECTED[name].items():
        assert getattr(packet, field) == value, field
    assert packet.version == 1
    # Only CHAIN_ADD and START_COLL carry an SR list (SPEC.md 2.2).
    if packet.segments:
        assert packet.opcode in (Opcode.CHAIN_ADD, Opcode.START_COLL)
    # The payload starts at 64 + 8 * seg_count (SPEC.md 2); a tag follows it (2.6).
    tag = 8 if packet.flags & Flags.TAGGED else 0
    assert len(data) == 64 + 8 * len(packet.segments) + len(packet.payload) + tag


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_reencodes_to_identical_bytes(name: str) -> None:
    data = load_fixture(name)
    assert encode_packet(decode_packet(data)) == data


def test_committed_fixtures_match_the_generator() -> None:
    fixtures = generate.build_fixtures()
    for name in FIXTURE_NAMES:
        assert encode_packet(fixtures[name].packet) == load_fixture(name), name
    # Comments included: a stale field list in a .hex file fails too.
    assert generate.main(["--check"]) == 0


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_truncation_raises_remote_protocol_error(name: str) -> None:
    data = load_fixture(name)
    for cut in range(len(data)):
        # pytest.raises fails on any other exception type: only RemoteProtocolError may escape.
        with pytest.raises(RemoteProtocolError):
            decode_packet(data[:cut])


@pytest.mark.parametrize(
    ("name", "cut", "status", "message"),
    [
        ("ping", 0, Status.TRUNCATED, "packet truncated: 0 bytes, the fixed header needs 64"),
        ("ping", 63, Status.TRUNCATED, "packet truncated: 63 bytes, the fixed header needs 64"),
        ("chain_add", 64, Status.TRUNCATED, "SR list truncated (0 of 3 segments)"),
        ("chain_add", 87, Status.TRUNCATED, "SR list truncated (2 of 3 segments)"),
        ("start_coll", 95, Status.TRUNCATED, "SR list truncated (3 of 4 segments)"),
        # A payload cut short disagrees with `length`: BAD_LENGTH, as the codec decides.
        (
            "chain_add",
            88,
            Status.BAD_LENGTH,
            "CHAIN_ADD length field says 16 bytes but the payload has 0",
        ),
        ("write", 79, Status.BAD_LENGTH, "WRITE length field says 16 bytes but the payload has 15"),
        ("info", 70, Status.BAD_LENGTH, "INFO length field says 32 bytes but the payload has 6"),
        (
            "fetch_add",
            71,
            Status.BAD_LENGTH,
            "FETCH_ADD needs length 8 and a payload of 8 bytes (got length 8, 7 bytes)",
        ),
        (
            "cas",
            72,
            Status.BAD_LENGTH,
            "CAS needs length 8 and a payload of 16 bytes (got length 8, 8 bytes)",
        ),
    ],
)
def test_truncation_messages(name: str, cut: int, status: Status, message: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_packet(load_fixture(name)[:cut])
    assert info.value.status == status
    assert str(info.value) == message


def test_parse_hex_dump_skips_comments_and_whitespace() -> None:
    text = "# title\n  # indented comment\n01 02  03\n0405\n\n"
    assert parse_hex_dump(text) == b"\x01\x02\x03\x04\x05"


def test_fixture_files_follow_the_format() -> None:
    folder = resources.files("netdam.protocol.fixtures")
    for name in FIXTURE_NAMES:
        lines = folder.joinpath(f"{name}.hex").read_text(encoding="ascii").splitlines()
        assert lines[0].startswith(f"# {decode_packet(load_fixture(name)).opcode.name}: ")
        dump = [line for line in lines if not line.startswith("#")]
        assert all(
            re.fullmatch(r"[0-9a-f]{2}( [0-9a-f]{2})*(  [0-9a-f]{2}( [0-9a-f]{2})*)?", d)
            for d in dump
        )
        assert all(len(bytes.fromhex(d)) == 16 for d in dump[:-1])


def test_load_fixture_unknown_name() -> None:
    with pytest.raises(KeyError, match="no fixture 'nope'"):
        load_fixture("nope")


def test_spec_examples_are_the_fixture_bytes() -> None:
    spec = resources.files("netdam.protocol").joinpath("SPEC.md").read_text(encoding="utf-8")
    section = spec.split("## 10. Worked examples", 1)[1]
    blocks = re.findall(
        r"^### 10\.\d+ (\w+) \(`(\w+)\.hex`.*?\n```\n(.*?)```", section, re.S | re.M
    )
    assert [name for _, name, _ in blocks] == list(FIXTURE_NAMES)
    for opcode, name, dump in blocks:
        assert bytes.fromhex(dump) == load_fixture(name), name
        assert decode_packet(load_fixture(name)).opcode.name == opcode
