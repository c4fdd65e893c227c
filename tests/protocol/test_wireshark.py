"""The Wireshark dissector protocol/wireshark/netdam.lua: tables in step with constants.py, and
(when tshark is installed) tshark's dissection of the fixtures, of malformed datagrams and of a
live capture of a real cluster equal to the codec's decoding."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdam.cluster.launch import start_cluster
from netdam.protocol import counters as C
from netdam.protocol import packet as codec
from netdam.protocol.constants import (
    CONTROL_OPCODES,
    ELEMENT_SIZE,
    FLAGS_V1_MASK,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    NETDAM_UDP_PORT,
    NUMPY_DTYPE,
    PROTOCOL_VERSION,
    REPLY_OPCODES,
    RIGHTS_ALL,
    SEGMENT_SIZE,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Rights,
    SegmentType,
    Status,
)
from netdam.protocol.elements import element_values
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.fixtures import FIXTURE_NAMES, load_fixture
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, u64_to_endpoint
from netdam.protocol.payloads import (
    Algo,
    CompletionPhases,
    pack_completion,
    pack_completion_phases,
    unpack_alloc,
    unpack_descriptor,
    unpack_region_info,
)
from netdam.protocol.tag import seal_control

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "protocol" / "wireshark" / "netdam.lua"
TSHARK = shutil.which("tshark")
#: A port no dissector claims: NetDAM there is found by the heuristic only (local clusters).
OTHER_PORT = 40001

needs_tshark = pytest.mark.skipif(
    TSHARK is None,
    reason="tshark is not installed (apt-get install -y tshark): only the Lua table drift test runs",
)

# ---------------------------------------------------------------------------------------------
# (1) The Lua value tables against constants.py: no tshark needed

_ENTRY = re.compile(r'^\s*\[(0x[0-9A-Fa-f]+|\d+)\]\s*=\s*(?:"([A-Za-z0-9_ -]+)"|(\d+)),\s*$')


def lua_table(text: str, name: str) -> dict[int, str | int]:
    """``local NAME = { [value] = "NAME", ... }`` of the Lua file; every line must be an entry."""
    match = re.search(rf"^local {name} = \{{\n(.*?)^\}}", text, re.M | re.S)
    if match is None:
        raise AssertionError(f"netdam.lua has no table `local {name} = {{`")
    table: dict[int, str | int] = {}
    for line in match.group(1).splitlines():
        entry = _ENTRY.match(line)
        if entry is None:
            raise AssertionError(f"netdam.lua table {name}: line {line!r} is not `[value] = ...,`")
        key = int(entry.group(1), 0)
        if key in table:
            raise AssertionError(f"netdam.lua table {name}: {key} listed twice")
        table[key] = entry.group(2) if entry.group(2) is not None else int(entry.group(3))
    return table


def lua_names(text: str, name: str) -> set[str]:
    """``local NAME = names{ "A", "B" }`` of the Lua file."""
    match = re.search(rf"^local {name} = names\{{([^}}]*)\}}", text, re.M)
    if match is None:
        raise AssertionError(f"netdam.lua has no set `local {name} = names{{...}}`")
    return set(re.findall(r'"([A-Z_0-9]+)"', match.group(1)))


def lua_scalar(text: str, name: str) -> int:
    match = re.search(rf"^local {name} = (0x[0-9A-Fa-f]+|\d+)\s*$", text, re.M)
    if match is None:
        raise AssertionError(f"netdam.lua has no constant `local {name} = <number>`")
    return int(match.group(1), 0)


def _members(kind: type[Enum]) -> dict[int, str | int]:
    return {int(m.value): str(m.name) for m in kind if int(m.value) or kind not in (Flags, Rights)}


def drift(text: str) -> list[str]:
    """Every difference between netdam.lua's tables and the Python constants, as messages."""
    problems = []

    def same(what: str, lua: object, python: object) -> None:
        if lua != python:
            problems.append(f"{what}: netdam.lua has {lua!r}, Python has {python!r}")

    for table, kind in (
        ("OPCODE", Opcode),
        ("STATUS", Status),
        ("DTYPE", DType),
        ("REDUCE_OP", ReduceOp),
        ("FLAGS", Flags),
        ("SEG_TYPE", SegmentType),
        ("RIGHTS", Rights),
        ("ALGO", Algo),
    ):
        same(table, lua_table(text, table), _members(kind))
    same(
        "ELEMENT_SIZE",
        lua_table(text, "ELEMENT_SIZE"),
        {int(k): v for k, v in ELEMENT_SIZE.items()},
    )
    same("COUNTER", lua_table(text, "COUNTER"), dict(C._SCALAR_NAMES))
    for name, value in (
        ("PROTOCOL_VERSION", PROTOCOL_VERSION),
        ("NETDAM_UDP_PORT", NETDAM_UDP_PORT),
        ("HEADER_SIZE", HEADER_SIZE),
        ("SEGMENT_SIZE", SEGMENT_SIZE),
        ("MAX_SEGMENTS", MAX_SEGMENTS),
        ("MAX_PAYLOAD_BYTES", MAX_PAYLOAD_BYTES),
        ("FLAGS_V1_MASK", FLAGS_V1_MASK),
        ("COUNTER_OPCODE_BASE", C.OPCODE_BASE),
        ("COUNTER_NACK_BASE", C.NACK_BASE),
        ("NODE_COUNTERS", C.NUM_COUNTERS),
    ):
        same(name, lua_scalar(text, name), value)
    for name, opcodes in (
        ("REPLY_OPCODES", REPLY_OPCODES),
        ("CONTROL_OPCODES", CONTROL_OPCODES),
        ("DATA_OPCODES", codec._DATA_OPCODES),
        ("COMBINE_OPCODES", codec._COMBINE_OPCODES),
        ("OPAQUE_OPCODES", codec._OPAQUE_OPCODES),
        ("EMPTY_OPCODES", codec._EMPTY_OPCODES),
        ("SR_OPCODES", codec._SR_OPCODES),
    ):
        same(name, lua_names(text, name), {op.name for op in opcodes})
    for name, table in (
        ("FIXED_PAYLOAD", codec._FIXED_PAYLOAD),
        ("FIXED_PAYLOAD_ALT", codec._FIXED_PAYLOAD_ALT),
    ):
        block = text.split(f"local {name} = {{\n", 1)[1].split("\n}", 1)[0]
        fixed = dict(re.findall(r"^\s+([A-Z_]+) = \{(\d+, \d+)\},$", block, re.M))
        same(name, fixed, {op.name: f"{a}, {b}" for op, (a, b) in table.items()})
    return problems


def test_lua_tables_match_constants() -> None:
    assert drift(LUA.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('[0x05] = "CHAIN_ADD",', '[0x15] = "CHAIN_ADD",'),  # a changed number
        ('    [23] = "TIMEOUT",\n', ""),  # a status missing
        ('[0x0020] = "TAGGED",', '[0x0020] = "TAGGED",\n    [0x0040] = "EXTRA",'),  # one too many
        ('[5] = "U64",', '[5] = "UINT64",'),  # a renamed dtype
        ("local MAX_PAYLOAD_BYTES = 8192", "local MAX_PAYLOAD_BYTES = 9000"),
        ('"ADD", "CHAIN_ADD" }', '"ADD" }'),  # an opcode class
        ("CAS = {8, 16},", "CAS = {8, 8},"),
    ],
)
def test_drift_check_catches_a_change(old: str, new: str) -> None:
    text = LUA.read_text(encoding="utf-8")
    assert old in text
    assert drift(text.replace(old, new)) != []


# ---------------------------------------------------------------------------------------------
# pcap files and tshark


def _ipv4_checksum(header: bytes) -> int:
    total = sum(int(word) for word in struct.unpack("!10H", header))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


@dataclass(frozen=True)
class Datagram:
    """One UDP datagram to write into a pcap (or read from one)."""

    data: bytes
    src: Endpoint
    dst: Endpoint


def ethernet_frame(d: Datagram) -> bytes:
    """Ethernet II / IPv4 / UDP (checksum 0: none) carrying *d*."""
    udp = struct.pack("!HHHH", d.src[1], d.dst[1], 8 + len(d.data), 0) + d.data
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(udp),
        1,
        0,
        64,
        17,
        0,
        socket.inet_aton(d.src[0]),
        socket.inet_aton(d.dst[0]),
    )
    ip = ip[:10] + struct.pack("!H", _ipv4_checksum(ip)) + ip[12:]
    return bytes(6) + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00" + ip + udp


def write_pcap(path: Path, datagrams: Sequence[Datagram]) -> None:
    """Classic pcap, link type Ethernet, one frame per datagram, one second apart."""
    with path.open("wb") as out:
        out.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for number, datagram in enumerate(datagrams):
            frame = ethernet_frame(datagram)
            out.write(struct.pack("<IIII", number, 0, len(frame), len(frame)) + frame)


def read_pcap_udp(path: Path) -> list[Datagram | None]:
    """UDP datagrams of a classic pcap (Ethernet or Linux cooked), None for other frames."""
    raw = path.read_bytes()
    magic, _, _, _, _, _, linktype = struct.unpack_from("<IHHiIII", raw, 0)
    assert magic == 0xA1B2C3D4, f"{path} is not a microsecond little-endian pcap"
    link_header = {1: 14, 113: 16}[linktype]
    frames: list[Datagram | None] = []
    offset = 24
    while offset < len(raw):
        _, _, caplen, wirelen = struct.unpack_from("<IIII", raw, offset)
        frame = raw[offset + 16 : offset + 16 + caplen]
        offset += 16 + caplen
        assert caplen == wirelen, "the capture cut a frame short"
        ip = frame[link_header:]
        if ip[0] >> 4 != 4 or ip[9] != 17:
            frames.append(None)
            continue
        udp = ip[(ip[0] & 0xF) * 4 :]
        sport, dport, length = struct.unpack_from("!HHH", udp, 0)
        frames.append(
            Datagram(
                udp[8:length],
                (socket.inet_ntoa(ip[12:16]), sport),
                (socket.inet_ntoa(ip[16:20]), dport),
            )
        )
    return frames


@pytest.fixture(scope="module")
def tshark_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for tshark: a private HOME and config dir, so a netdam.lua the user copied
    into ~/.local/lib/wireshark/plugins is not loaded twice, nor their preferences used."""
    if TSHARK is None:
        pytest.skip("tshark is not installed")
    home = tmp_path_factory.mktemp("wireshark-home")
    env = dict(os.environ, HOME=str(home), WIRESHARK_CONFIG_DIR=str(home / "config"))
    # Load the script once: as root, some distributions' init.lua skip user scripts
    # (run_user_scripts_when_superuser = false; Debian 12's sets true), and then no netdam
    # field exists. Skip there with the reason; anywhere else a failure to load is a bug.
    probe_pcap = home / "probe.pcap"
    write_pcap(probe_pcap, [Datagram(load_fixture("ping"), CLIENT, ("10.0.0.2", NETDAM_UDP_PORT))])
    probe = subprocess.run(
        [
            TSHARK,
            "-X",
            f"lua_script:{LUA}",
            "-r",
            str(probe_pcap),
            "-T",
            "fields",
            "-e",
            "netdam.opcode",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if probe.stdout.strip() != "0x09" and os.geteuid() == 0:
        pytest.skip(
            f"tshark did not run netdam.lua as root (its init.lua may set "
            f"run_user_scripts_when_superuser = false): {probe.stderr.strip()}"
        )
    assert probe.stdout.strip() == "0x09", probe.stderr
    return env


def tshark(env: dict[str, str], *args: str) -> str:
    """Run tshark with the dissector; fail on any Lua error; return stdout."""
    assert TSHARK is not None
    result = subprocess.run(
        [TSHARK, "-X", f"lua_script:{LUA}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    # As root tshark warns on stderr (`Running as user "root"...`): harmless. A Lua error
    # while loading goes to stderr, one while dissecting into the tree ("Lua Error").
    assert result.returncode == 0 and not re.search(r"Lua: Error|\.lua:\d+:", result.stderr), (
        result.stderr
    )
    assert "Lua Error" not in result.stdout, result.stdout[
        result.stdout.index("Lua Error") - 2000 :
    ]
    return result.stdout


#: Header fields, in wire order (SPEC.md 2.1): name in netdam.lua = the codec's name.
HEADER_FIELDS = (
    "version",
    "opcode",
    "flags",
    "seq",
    "client_id",
    "txn_id",
    "coll_id",
    "epoch",
    "rkey",
    "length",
    "addr",
    "aux_addr",
    "dtype",
    "reduce_op",
    "status",
    "credit",
    "seg_type",
    "segments_left",
    "seg_count",
    "reserved1",
    "ret_ip",
    "ret_port",
    "reserved2",
)
FLAG_FIELDS = tuple(f"flags.{str(f.name).lower()}" for f in Flags if f)
DESCRIPTOR_FIELDS = (
    "algo",
    "flags",
    "window",
    "rank",
    "count",
    "in_addr",
    "out_addr",
    "rkey",
    "root",
    "group",
    "host",
    "timeout_ms",
    "reserved",
)
INFO_FIELDS = ("version", "mtu", "memory", "max_payload", "max_segments", "rank", "world")
ALLOC_FIELDS = ("size", "credential", "stride", "ways", "rights", "flags", "label")
REGION_FIELDS = ("gaddr", "size", "credential", "rkey", "stride", "ways", "rights", "label")
PAYLOAD_FIELDS = (
    "payload",
    "seg.ip",
    "seg.port",
    "seg.reserved",
    "group.ip",
    "group.port",
    "error.status",
    "error.text",
    "register.rkey",
    "register.rights",
    "deregister.rkey",
    "atomic.addend",
    "atomic.compare",
    "atomic.swap",
    "atomic.old",
    "nack.text",
    "sparse.nnz",
    "sparse.index",
    "counter",
    "desc.group.ip",
    "desc.group.port",
    "desc.host.ip",
    "desc.host.port",
    *(f"alloc.{name}" for name in ALLOC_FIELDS),
    "pool.credential",
    *(f"region.{name}" for name in REGION_FIELDS),
    "region.way.node",
    "region.way.local",
    "region.way.size",
    *(f"rights.{str(r.name).lower()}" for r in Rights if r),
    *(f"data.{d.name.lower()}" for d in DType if d != DType.RAW),
    *(f"info.{name}" for name in INFO_FIELDS),
    *(f"desc.{name}" for name in DESCRIPTOR_FIELDS),
    "desc.tag_k0",
    "desc.tag_k1",
    "tag",
)
ALL_FIELDS = (*HEADER_FIELDS, *FLAG_FIELDS, *PAYLOAD_FIELDS)


def tshark_fields(env: dict[str, str], pcap: Path, *options: str) -> list[dict[str, list[str]]]:
    """Per frame: every netdam.* field of ALL_FIELDS (plus the Info column and UDP ports) as the
    list of its occurrences; *options* go to tshark first (``-o`` a preference)."""
    names = ("udp.srcport", "udp.dstport", "_ws.col.Info", *(f"netdam.{n}" for n in ALL_FIELDS))
    args = [
        *options,
        "-r",
        str(pcap),
        "-T",
        "fields",
        "-E",
        "occurrence=a",
        "-E",
        "aggregator=\x1f",
    ]
    for name in names:
        args += ["-e", name]
    rows = []
    for line in tshark(env, *args).splitlines():
        values = line.split("\t")
        assert len(values) == len(names), line
        rows.append(
            {
                n.removeprefix("netdam."): (v.split("\x1f") if v else [])
                for n, v in zip(names, values)
            }
        )
    return rows


def _num(value: str) -> int:
    return int(value, 0)


def _floats(values: list[str]) -> np.ndarray:
    return np.array([float(v) for v in values], dtype=np.float64)


def check_like_codec(row: dict[str, list[str]], packet: Packet) -> None:
    """tshark's fields of one frame equal the codec's decoding *packet*, field by field."""
    expected: dict[str, Any] = {
        "version": packet.version,
        "opcode": int(packet.opcode),
        "flags": int(packet.flags),
        "seq": packet.seq,
        "client_id": packet.client_id,
        "txn_id": packet.txn_id,
        "coll_id": packet.coll_id,
        "epoch": packet.epoch,
        "rkey": packet.rkey,
        "length": packet.length,
        "addr": packet.addr,
        "aux_addr": packet.aux_addr,
        "dtype": int(packet.dtype),
        "reduce_op": int(packet.reduce_op),
        "status": int(packet.status),
        "credit": packet.credit,
        "seg_type": int(packet.seg_type),
        "segments_left": packet.segments_left,
        "seg_count": len(packet.segments),
        "reserved1": 0,
        "ret_port": packet.ret[1],
        "reserved2": 0,
    }
    if packet.flags & Flags.TAGGED:
        expected["tag"] = packet.tag  # the trailer (SPEC.md 2.6), not part of the payload
    got = {name: _num(row[name][0]) for name in expected if len(row[name]) == 1}
    assert got == expected, (packet.opcode.name, row)
    assert row["ret_ip"] == [packet.ret[0]]
    for flag in Flags:
        if flag:
            assert row[f"flags.{str(flag.name).lower()}"] == [str(int(flag in packet.flags))]
    assert row["seg.ip"] == [ip for ip, _ in packet.segments]
    assert [_num(p) for p in row["seg.port"]] == [port for _, port in packet.segments]
    assert row["error.status"] == [] and row["error.text"] == []
    assert row["payload"] == ([packet.payload.hex()] if packet.payload else [])
    info = f"{packet.opcode.name} addr=0x{packet.addr:x} len={packet.length} status={packet.status.name}"
    assert row["_ws.col.Info"][0].startswith(info), row["_ws.col.Info"]
    check_payload(row, packet)


def check_payload(row: dict[str, list[str]], packet: Packet) -> None:
    """The payload's fields, where SPEC.md fixes their layout."""
    op, payload = packet.opcode, packet.payload
    u64 = [int(v) for v in np.frombuffer(payload, "<u8")] if len(payload) % 8 == 0 else []
    if op in (Opcode.JOIN, Opcode.LEAVE):
        ip, port = u64_to_endpoint(packet.addr)
        assert (row["group.ip"], [_num(p) for p in row["group.port"]]) == ([ip], [port])
    elif op == Opcode.INFO:
        info = struct.unpack("<IIQIIII", payload)
        assert [_num(row[f"info.{n}"][0]) for n in INFO_FIELDS] == list(info)
    elif op == Opcode.REGISTER:
        rkey, rights = struct.unpack("<II", payload)
        assert (_num(row["register.rkey"][0]), _num(row["register.rights"][0])) == (rkey, rights)
        for right in Rights:
            if right:
                assert row[f"rights.{str(right.name).lower()}"] == [str(int(bool(rights & right)))]
    elif op == Opcode.DEREGISTER:
        assert _num(row["deregister.rkey"][0]) == struct.unpack_from("<I", payload)[0]
    elif op == Opcode.FETCH_ADD:
        assert [_num(v) for v in row["atomic.addend"]] == u64
    elif op == Opcode.CAS:
        assert [_num(v) for v in row["atomic.compare"] + row["atomic.swap"]] == u64
    elif op == Opcode.ALLOC:
        alloc = unpack_alloc(payload)
        got = [_num(row[f"alloc.{n}"][0]) for n in ALLOC_FIELDS[:-1]]
        assert got == [
            alloc.size,
            alloc.credential,
            alloc.stride,
            alloc.ways,
            alloc.rights,
            alloc.flags,
        ]
        assert row["alloc.label"] == [alloc.label]
    elif op in (Opcode.FREE, Opcode.QUERY):
        assert [_num(v) for v in row["pool.credential"]] == u64
    elif op == Opcode.ACK and row["region.gaddr"]:
        region = unpack_region_info(payload)
        got = [_num(row[f"region.{n}"][0]) for n in REGION_FIELDS[:-1]]
        assert got == [
            region.gaddr,
            region.size,
            region.credential,
            region.rkey,
            region.stride,
            len(region.ways),
            region.rights,
        ]
        assert (region.gaddr, region.rkey) == (packet.addr, packet.rkey) and row[
            "region.label"
        ] == [region.label]
        ways = [(w.node, w.local, w.size) for w in region.ways]
        assert (
            list(
                zip(*([_num(v) for v in row[f"region.way.{n}"]] for n in ("node", "local", "size")))
            )
            == ways
        )
        assert row["counter"] == []
    elif op == Opcode.ACK and len(payload) == 8:
        assert [_num(v) for v in row["atomic.old"]] == u64
    elif op == Opcode.ACK and len(payload) > 16:
        assert [_num(v) for v in row["counter"]] == u64
    elif op == Opcode.NACK and payload:
        assert row["nack.text"] == [payload.decode()]
    elif op == Opcode.START_COLL:
        descriptor = astuple(unpack_descriptor(payload))
        got = [_num(row[f"desc.{name}"][0]) for name in DESCRIPTOR_FIELDS]
        assert got == list(descriptor[: len(DESCRIPTOR_FIELDS)])
        if len(payload) == 80:  # the tag key (SPEC.md 6.5)
            assert [_num(row[f"desc.tag_k{k}"][0]) for k in (0, 1)] == list(
                struct.unpack_from("<QQ", payload, 64)
            )
        group, host = u64_to_endpoint(descriptor[9]), u64_to_endpoint(descriptor[10])
        assert (row["desc.group.ip"][0], _num(row["desc.group.port"][0])) == group
        assert (row["desc.host.ip"][0], _num(row["desc.host.port"][0])) == host
    elif op in codec._DATA_OPCODES and packet.dtype != DType.RAW:
        column = row[f"data.{packet.dtype.name.lower()}"]
        if packet.flags & Flags.SPARSE:
            nnz = struct.unpack_from("<I", payload)[0]
            assert [_num(v) for v in row["sparse.nnz"]] == [nnz]
            indices = np.frombuffer(payload, "<u2", count=nnz, offset=8)
            assert [_num(v) for v in row["sparse.index"]] == indices.tolist()
            start = codec.sparse_payload_size(nnz, packet.dtype) - nnz * ELEMENT_SIZE[packet.dtype]
            values = element_values(payload, packet.dtype, count=nnz, offset=start)
        else:
            values = element_values(payload, packet.dtype)
        if packet.dtype in (DType.I32, DType.I64, DType.U64):
            assert [int(v) for v in column] == values.tolist()
        else:
            # tshark prints floats with 6 (f32, f16, bf16) or 15 (f64) significant digits.
            rtol = 1e-14 if packet.dtype == DType.F64 else 1e-5
            np.testing.assert_allclose(_floats(column), values.astype(np.float64), rtol=rtol)


# ---------------------------------------------------------------------------------------------
# (2) The fixtures, on port 7744 and on another port (heuristic)

CLIENT: Endpoint = ("10.0.0.100", 50000)


def fixture_datagrams() -> list[Datagram]:
    datagrams = []
    for name in FIXTURE_NAMES:
        data = load_fixture(name)
        datagrams.append(Datagram(data, CLIENT, ("10.0.0.2", NETDAM_UDP_PORT)))
        datagrams.append(Datagram(data, ("10.0.0.2", OTHER_PORT), ("10.0.0.3", OTHER_PORT + 1)))
    return datagrams


@pytest.fixture(scope="module")
def fixture_pcap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pcap") / "fixtures.pcap"
    write_pcap(path, fixture_datagrams())
    return path


@needs_tshark
def test_fixtures_dissect_like_the_codec(tshark_env: dict[str, str], fixture_pcap: Path) -> None:
    rows = tshark_fields(tshark_env, fixture_pcap)
    datagrams = fixture_datagrams()
    assert len(rows) == len(datagrams)
    for row, datagram in zip(rows, datagrams):
        assert row["opcode"], f"not dissected as NetDAM: {datagram}"
        check_like_codec(row, decode_packet(datagram.data))
    # Each fixture twice: on 7744 (port table) and on OTHER_PORT (heuristic), identically.
    on_port, heuristic = rows[0::2], rows[1::2]
    assert {_num(r["udp.dstport"][0]) for r in heuristic} == {OTHER_PORT + 1}
    strip = ("udp.srcport", "udp.dstport")
    assert [{k: v for k, v in r.items() if k not in strip} for r in on_port] == [
        {k: v for k, v in r.items() if k not in strip} for r in heuristic
    ]


@needs_tshark
def test_verbose_output_names_every_opcode_and_field(
    tshark_env: dict[str, str], fixture_pcap: Path, tmp_path: Path
) -> None:
    text = tshark(tshark_env, "-r", str(fixture_pcap), "-V")
    opcodes = [decode_packet(load_fixture(name)).opcode for name in FIXTURE_NAMES]
    for op in set(opcodes):  # each fixture twice (port table, heuristic)
        assert text.count(f"    Opcode: {op.name} (0x{op:02x})\n") == 2 * opcodes.count(op), op.name
    chain = text[text.index("NetDAM v1, CHAIN_ADD") :]
    for line in (
        "    Flags: 0x0001 (ACK_REQ)",
        "ACK_REQ: True",
        "    Collective id: 9",
        "    Aux address: 0x0000000000020000",
        "    Data type: F32 (1)",
        "    Reduce op: SUM (0)",
        "    Segments left: 2",
        "    Return segment: 10.0.0.1:7744",
        "Segment 0: 10.0.0.2:7744 (this hop)",
        "Segment 2: 10.0.0.4:7744 (last hop)",
        "[3] f32: 100",
    ):
        assert line in chain, line
    assert "All-gather group: 0x0000ef4d00011e40" in text and "Group IPv4: 239.77.0.1" in text
    assert "Region record (2 ways)" in text and "Tenant credential: 0x0123456789abcdef" in text
    assert (
        "Status: OUT_OF_BOUNDS (10)" in text
        and "[Expert Info (Note/Response): NACK OUT_OF_BOUNDS]" in text
    )
    # Installed as a plugin (the README's other way), `-G fields` lists every field by name.
    plugins = Path(tshark_env["HOME"]) / ".local" / "lib" / "wireshark" / "plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    shutil.copy(LUA, plugins / "netdam.lua")
    try:
        assert TSHARK is not None
        listing = subprocess.run(
            [TSHARK, "-G", "fields"], capture_output=True, text=True, env=tshark_env, timeout=60
        ).stdout
        heuristics = subprocess.run(
            [TSHARK, "-G", "heuristic-decodes"],
            capture_output=True,
            text=True,
            env=tshark_env,
            timeout=60,
        ).stdout
    finally:
        (plugins / "netdam.lua").unlink()
    registered = set(re.findall(r"^F\t[^\t]*\t(netdam\.[\w.]+)\t", listing, re.M))
    assert {f"netdam.{n}" for n in ALL_FIELDS} <= registered
    # Every literal field name of netdam.lua (the flag and rights bits are built in a loop).
    in_lua = set(
        re.findall(r'ProtoField\.\w+\("(netdam\.[\w.]*\w)",', LUA.read_text(encoding="utf-8"))
    )
    assert len(in_lua) > 80 and in_lua <= registered
    assert re.search(r"^udp\tnetdam\tT$", heuristics, re.M), heuristics


# ---------------------------------------------------------------------------------------------
# Malformed datagrams: the same verdict (status and message) as the codec


def _patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def _with_length(data: bytes, length: int) -> bytes:
    return _patch(data, 28, struct.pack("!I", length))


def _sparse(nnz: int, indices: list[int], values: bytes, reserved: int = 0, pad: int = 0) -> bytes:
    body = struct.pack(f"<II{len(indices)}H", nnz, reserved, *indices)
    padding = (-len(body)) % 8
    return (
        body + (bytes([pad]) + bytes(padding - 1) if padding and pad else bytes(padding)) + values
    )


def malformed_datagrams() -> list[tuple[str, bytes]]:
    read, write, add = load_fixture("read"), load_fixture("write"), load_fixture("add")
    chain, cas, ping = load_fixture("chain_add"), load_fixture("cas"), load_fixture("ping")
    info, register = load_fixture("info"), load_fixture("register")
    length = _with_length
    sparse = _patch(write, 2, b"\x00\x03")
    f32 = np.array([1.5, -2.0], "<f4").tobytes()
    nack = decode_packet(load_fixture("nack"))
    return [
        ("short", read[:10]),
        ("bad version", _patch(read, 0, b"\x02")),
        ("unknown opcode", _patch(read, 1, b"\x1f")),
        ("reserved byte 55", _patch(read, 55, b"\x01")),
        ("reserved bytes 62-63", _patch(read, 63, b"\x01")),
        ("undefined flag", _patch(read, 2, b"\x01\x00")),
        ("unknown dtype", _patch(read, 48, b"\x09")),
        ("unknown reduce op", _patch(read, 49, b"\x03")),
        ("unknown status", _patch(read, 50, b"\x63")),
        ("IPv6 segments", _patch(chain, 52, b"\x02")),
        ("unknown segment type", _patch(chain, 52, b"\x05")),
        ("too many segments", _patch(chain, 54, b"\x41")),
        ("segment type without segments", _patch(read, 52, b"\x01")),
        ("segments_left out of range", _patch(chain, 53, b"\x03")),
        ("SR list cut short", chain[:72]),
        ("segment reserved bytes", _patch(chain, 70, b"\x00\x01")),
        ("SR list on WRITE", _patch(chain, 1, b"\x03")),
        ("length over 8192", length(write, 9000)),
        ("ADD of raw bytes", _patch(add, 48, b"\x00")),
        ("CAS of f32", _patch(cas, 48, b"\x01")),
        ("READ with a payload", read + bytes(8)),
        ("READ of length 0", length(read, 0)),
        ("READ of 3 bytes of f32", length(read, 3)),
        ("WRITE length mismatch", length(write, 20)),
        ("WRITE of length 0", length(write, 0)),
        ("WRITE not a multiple", length(write[:-1], 15)),
        ("sparse ADD", _patch(add, 2, b"\x00\x03")),
        ("sparse length not a multiple", length(sparse[:64], 15) + _sparse(2, [0, 3], f32)),
        ("sparse prefix cut short", sparse[:64] + bytes(4)),
        ("sparse reserved word", sparse[:64] + _sparse(2, [0, 3], f32, reserved=1)),
        ("sparse nnz too large", sparse[:64] + _sparse(5, [0, 1, 2, 3, 4], f32 * 2 + f32[:4])),
        ("sparse wrong size", sparse[:64] + _sparse(2, [0, 3], f32 + bytes(4))),
        ("sparse padding", sparse[:64] + _sparse(2, [0, 3], f32, pad=1)),
        ("sparse indices decrease", sparse[:64] + _sparse(2, [3, 0], f32)),
        ("sparse index out of range", sparse[:64] + _sparse(2, [0, 4], f32)),
        ("INFO length mismatch", length(info, 31)),
        ("PING with a payload", ping + bytes(8)),
        ("REGISTER of length 16", length(register, 16)),
        # Valid ones, dissected field by field: sparse forms, a NACK with text, every dtype.
        ("valid sparse WRITE", sparse[:64] + _sparse(2, [0, 3], f32)),
        ("valid empty sparse WRITE", sparse[:64] + _sparse(0, [], b"")),
        ("valid NACK with text", encode_packet(replace(nack, length=7, payload=b"no room"))),
        *((f"valid {dtype.name} WRITE", encode_packet(_write_of(dtype))) for dtype in DType),
        ("valid sparse f16 ALL_WRITE", encode_packet(_sparse_f16_all_write())),
    ]


def _write_of(dtype: DType) -> Packet:
    """A WRITE of extreme values of *dtype* (RAW: bytes)."""
    if dtype == DType.RAW:
        payload = bytes(range(7))
    elif dtype in (DType.I32, DType.I64, DType.U64):
        info = np.iinfo(NUMPY_DTYPE[dtype])
        payload = np.array(
            [info.min, -1 if info.min else 1, info.max], NUMPY_DTYPE[dtype]
        ).tobytes()
    elif dtype == DType.BF16:
        # The smallest normal and subnormal, -0, 1/3 rounded, infinities, -2.5.
        payload = np.array(
            [0x0080, 0x0001, 0x8000, 0x3EAB, 0x7F80, 0xFF80, 0xC020], "<u2"
        ).tobytes()
    else:
        values = [np.finfo(NUMPY_DTYPE[dtype]).tiny, -0.0, 1 / 3, np.inf, -np.inf, -2.5]
        payload = np.array(values, NUMPY_DTYPE[dtype]).tobytes()
    return Packet(Opcode.WRITE, rkey=1, addr=0x100, dtype=dtype).with_payload(payload)


def _sparse_f16_all_write() -> Packet:
    values = np.array([1.5, -65504.0, 2.0**-24], "<f2").tobytes()
    return Packet(
        Opcode.ALL_WRITE,
        flags=Flags.SPARSE | Flags.MCAST,
        rkey=1,
        addr=0x200,
        dtype=DType.F16,
        length=64,
        payload=_sparse(3, [1, 7, 31], values),
    )


@needs_tshark
def test_malformed_datagrams_get_the_codecs_verdict(
    tshark_env: dict[str, str], tmp_path: Path
) -> None:
    cases = malformed_datagrams()
    datagrams = [Datagram(data, CLIENT, ("10.0.0.2", NETDAM_UDP_PORT)) for _, data in cases]
    # Not NetDAM on another port: the heuristic must leave them alone.
    strangers = [
        bytes(64),  # version 0
        b"\x01\x1f" + bytes(62),  # unknown opcode
        b"\x01\x01\x80\x00" + bytes(60),  # undefined flag
        b"\x01\x01" + bytes(52) + b"\x01" + bytes(9),  # an SR list without a segment type
        load_fixture("read")[:40],  # shorter than the header
    ]
    datagrams += [Datagram(d, CLIENT, ("10.0.0.2", OTHER_PORT)) for d in strangers]
    pcap = tmp_path / "malformed.pcap"
    write_pcap(pcap, datagrams)
    rows = tshark_fields(tshark_env, pcap)
    assert len(rows) == len(datagrams)
    for (label, data), row in zip(cases, rows):
        try:
            packet = decode_packet(data)
        except RemoteProtocolError as exc:
            assert row["error.status"] == [str(int(exc.status))], (label, row["error.text"])
            assert row["error.text"] == [str(exc)], label
            assert f"[{exc.status.name}: {exc}]" in row["_ws.col.Info"][0], label
        else:
            check_like_codec(row, packet)
    for row in rows[len(cases) :]:
        assert row["opcode"] == [] and row["error.status"] == [], row["_ws.col.Info"]
    # Expert info: each malformed datagram carries one error entry with the codec's message.
    text = tshark(tshark_env, "-r", str(pcap), "-V")
    for label, data in cases:
        try:
            decode_packet(data)
        except RemoteProtocolError as exc:
            assert f"Expert Info (Error/Malformed): {exc}]" in text, label


@needs_tshark
def test_the_largest_payload_preference_follows_an_emulation_mtu(
    tshark_env: dict[str, str], tmp_path: Path
) -> None:
    """SPEC.md 2.7: a 61440-byte WRITE is TOO_LARGE with the default preference (8192, MTU
    9000), as the codec says, and dissected whole with ``-o netdam.max_payload:61440``."""
    big = Packet(Opcode.WRITE, rkey=1, length=61440, payload=bytes(range(256)) * 240)
    data = encode_packet(big, max_payload=61440)
    pcap = tmp_path / "emulated.pcap"
    write_pcap(pcap, [Datagram(data, CLIENT, ("10.0.0.2", NETDAM_UDP_PORT))])
    with pytest.raises(RemoteProtocolError) as refused:
        decode_packet(data)
    (row,) = tshark_fields(tshark_env, pcap)
    assert row["error.text"] == [str(refused.value)]
    assert row["error.status"] == [str(int(Status.TOO_LARGE))]
    (row,) = tshark_fields(tshark_env, pcap, "-o", "netdam.max_payload:61440")
    assert row["error.status"] == [] and row["length"] == ["61440"]


# ---------------------------------------------------------------------------------------------
# (3) A capture of real traffic: a 2-node cluster on free ports (heuristic), live on lo


class Recorder:
    """A UDP client that remembers every datagram it sent and received."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(2.0)
        self.me: Endpoint = self.sock.getsockname()
        self.log: list[Datagram] = []
        self.txn = 0

    def ask(self, node: Endpoint, packet: Packet, seal_key: bytes = b"") -> Packet:
        """*packet* to *node* (sealed with its control tag under *seal_key* when given), and its answer."""
        self.txn += 1
        data = encode_packet(replace(packet, client_id=7, txn_id=self.txn))
        if seal_key:
            data = seal_control(seal_key, data)
        self.sock.sendto(data, node)
        self.log.append(Datagram(data, self.me, node))
        while True:
            reply, source = self.sock.recvfrom(65536)
            self.log.append(Datagram(reply, source, self.me))
            decoded = decode_packet(reply)
            if decoded.txn_id == self.txn:
                return decoded

    def close(self) -> None:
        self.sock.close()


def real_traffic(client: Recorder, nodes: list[Endpoint], admin_tag_key: bytes) -> None:
    """One of each kind of request (and so of reply), plus a two-hop CHAIN_ADD; the control
    opcodes sealed under the cluster's admin tag key (SPEC.md 2.6, "Control tags")."""
    rkey, base = 0xC0FFEE01, 0x1000
    f32 = np.array([0.5, 1.0, -3.25, 8.0], "<f4").tobytes()
    u64 = struct.Struct("<Q")
    assert client.ask(nodes[0], Packet(Opcode.PING)).opcode == Opcode.INFO
    for node in nodes:
        reply = client.ask(
            node,
            Packet(
                Opcode.REGISTER,
                addr=base,
                aux_addr=0x10000,
                length=8,
                payload=struct.pack("<II", rkey, int(RIGHTS_ALL)),
            ),
            seal_key=admin_tag_key,
        )
        assert (reply.opcode, reply.rkey) == (Opcode.ACK, rkey)
        client.ask(
            node,
            Packet(
                Opcode.WRITE, flags=Flags.ACK_REQ, rkey=rkey, addr=base, dtype=DType.F32
            ).with_payload(f32),
        )
    read = Packet(Opcode.READ, rkey=rkey, addr=base, length=16, dtype=DType.F32)
    assert client.ask(nodes[0], read).payload == f32
    client.ask(
        nodes[0],
        Packet(
            Opcode.ADD,
            flags=Flags.ACK_REQ,
            rkey=rkey,
            addr=base,
            dtype=DType.F32,
            reduce_op=ReduceOp.MAX,
        ).with_payload(f32),
    )
    atomic = Packet(Opcode.FETCH_ADD, rkey=rkey, addr=base + 0x100, dtype=DType.U64)
    client.ask(nodes[0], atomic.with_payload(u64.pack(5)))
    cas = replace(atomic, opcode=Opcode.CAS, length=8, payload=u64.pack(5) + u64.pack(99))
    assert client.ask(nodes[0], cas).payload == u64.pack(5)
    nack = client.ask(nodes[0], replace(read, addr=base + 0x10000))
    assert (nack.opcode, nack.status) == (Opcode.NACK, Status.OUT_OF_BOUNDS)
    chain = Packet(
        Opcode.CHAIN_ADD,
        flags=Flags.ACK_REQ,
        rkey=rkey,
        addr=base,
        aux_addr=base + 0x800,
        dtype=DType.F32,
        segments=tuple(nodes),
        segments_left=len(nodes) - 1,
    ).with_payload(f32)
    assert client.ask(nodes[0], chain).opcode == Opcode.ACK
    assert (
        len(client.ask(nodes[0], Packet(Opcode.COUNTERS), seal_key=admin_tag_key).payload) == 1024
    )


@dataclass
class LiveCapture:
    """A running ``tshark -i lo -w FILE -P``: it also prints each packet's UDP ports as it
    captures it."""

    lines: Path
    #: Why there is no live capture here (no capture rights...), or None.
    problem: str | None = None

    def ports(self) -> list[set[int]]:
        lines = self.lines.read_text().splitlines()
        return [{int(port) for port in line.split()} for line in lines if line.strip()]

    def wait(self, ready: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline, f"tshark: {what} within {timeout} s"
            time.sleep(0.05)


@contextmanager
def live_capture(ports: Sequence[int], pcap: Path, env: dict[str, str]) -> Iterator[LiveCapture]:
    """tshark capturing UDP of *ports* on lo into *pcap* (classic pcap) while the block runs."""
    assert TSHARK is not None
    lines, log = pcap.with_suffix(".txt"), pcap.with_suffix(".log")
    capture_filter = "udp and (" + " or ".join(f"port {port}" for port in ports) + ")"
    command = [
        TSHARK,
        "-i",
        "lo",
        "-f",
        capture_filter,
        "-F",
        "pcap",
        "-w",
        str(pcap),
        "-P",
        "-l",
        "-n",
        "-T",
        "fields",
        "-e",
        "udp.srcport",
        "-e",
        "udp.dstport",
    ]
    with lines.open("w") as stdout, log.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
    capture = LiveCapture(lines)
    try:
        deadline = time.monotonic() + 15.0
        while "Capturing on" not in log.read_text() and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if proc.poll() is not None or "Capturing on" not in log.read_text():
            capture.problem = f"tshark -i lo did not start: {log.read_text().strip()}"
        yield capture
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # tshark stops dumpcap and closes the file
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@needs_tshark
@pytest.mark.alone
def test_live_capture_of_a_real_cluster(tshark_env: dict[str, str], tmp_path: Path) -> None:
    pcap = tmp_path / "live.pcap"
    client = Recorder()
    # "Capturing on" comes before the capture filter is in place: beacons (to a socket of
    # ours, never read) go out until the capture shows one, so no NetDAM packet is missed.
    beacon = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    beacon.bind(("127.0.0.1", 0))
    beacon_port = beacon.getsockname()[1]
    try:
        with start_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
            nodes = cluster.endpoints
            assert all(port != NETDAM_UDP_PORT for _, port in nodes)  # so: the heuristic
            ports = [port for _, port in nodes]
            with live_capture([*ports, beacon_port], pcap, tshark_env) as capture:
                live = capture.problem is None
                if live:

                    def beacon_seen() -> bool:
                        beacon.sendto(b"beacon", ("127.0.0.1", beacon_port))
                        return bool(capture.ports())

                    capture.wait(beacon_seen, "no beacon captured")
                real_traffic(client, nodes, cluster.info.admin_tag_key)
                if live:  # everything the client saw, and the relayed CHAIN_ADD
                    want = len(client.log) + 1
                    capture.wait(
                        lambda: sum(bool(p & set(ports)) for p in capture.ports()) >= want,
                        f"fewer than {want} NetDAM packets",
                    )
    finally:
        client.close()
        beacon.close()
    problem = capture.problem
    if problem is not None:
        # No capture rights: the datagrams the client sent and received, written as a pcap.
        warnings.warn(
            f"live capture unavailable, using recorded datagrams: {problem}", stacklevel=1
        )
        write_pcap(pcap, client.log)
    frames = read_pcap_udp(pcap)
    # Heuristics first: the nodes' free ports may be ones Wireshark gives another protocol
    # (27960-27963 are Quake 3's; 328 UDP ports have a dissector in tshark 4.0), and a port's
    # dissector runs before any heuristic. A CI run drew 27962, and the PING went to Quake 3.
    rows = tshark_fields(tshark_env, pcap, "-o", "udp.try_heuristic_first:TRUE")
    assert len(rows) == len(frames) and None not in frames
    captured = []
    for row, frame in zip(rows, frames):
        assert frame is not None
        if frame.dst[1] == beacon_port:
            assert row["opcode"] == [], "a beacon dissected as NetDAM"
            continue
        captured.append(frame)
        assert row["opcode"], f"tshark did not recognise {frame}"
        check_like_codec(row, decode_packet(frame.data))
    missed = [
        (i, decode_packet(d.data).opcode.name)
        for i, d in enumerate(client.log)
        if d not in captured
    ]
    assert not missed, f"the capture missed datagrams (index in the client's log, opcode): {missed}"
    opcodes = {decode_packet(frame.data).opcode for frame in captured}
    assert opcodes >= {
        Opcode.PING,
        Opcode.INFO,
        Opcode.REGISTER,
        Opcode.ACK,
        Opcode.WRITE,
        Opcode.READ,
        Opcode.READ_RESP,
        Opcode.ADD,
        Opcode.FETCH_ADD,
        Opcode.CAS,
        Opcode.NACK,
        Opcode.CHAIN_ADD,
        Opcode.COUNTERS,
    }
    if problem is None:
        # Node-to-node traffic the client never sees: the relay's CHAIN_ADD to the last hop,
        # carrying the client as its return segment.
        relayed = [
            decode_packet(f.data) for f in captured if (f.src, f.dst) == (nodes[0], nodes[1])
        ]
        assert [(p.opcode, p.segments_left, p.ret) for p in relayed] == [
            (Opcode.CHAIN_ADD, 0, client.me)
        ]


# ---------------------------------------------------------------------------------------------
# (5) UDP-GSO super-frames: what a loopback capture holds for one GSO send


def gso_frames() -> list[tuple[bytes, int]]:
    """(super-frame payload, datagrams in it): equal sizes; a shorter last one; different
    opcodes of one size (a node batches any packets of one size to one destination)."""
    write = encode_packet(_write_of(DType.F32))
    chain = load_fixture("chain_add")
    ack = encode_packet(Packet(Opcode.ACK, client_id=7, txn_id=9))
    read_resp = encode_packet(
        Packet(Opcode.READ_RESP, client_id=7, txn_id=8, length=4, payload=b"abcd")
    )
    nack = encode_packet(
        Packet(Opcode.NACK, client_id=7, txn_id=10, status=Status.BUSY, length=4, payload=b"busy")
    )
    return [(chain * 3, 3), (write * 2 + ack, 3), (read_resp + nack + ack, 3)]


def test_decode_splits_gso_super_frames() -> None:
    from netdam.protocol.pcap import split_gso

    for payload, count in gso_frames():
        parts = split_gso(payload)
        assert len(parts) == count and b"".join(parts) == payload
        for part in parts:
            decode_packet(part)
    # A malformed datagram is not mistaken for a super-frame: it keeps its own error.
    bad = _with_length(load_fixture("chain_add"), 4096)
    assert split_gso(bad) == [bad]


@needs_tshark
def test_a_port_another_dissector_takes_is_netdam_with_heuristics_first(
    tshark_env: dict[str, str], tmp_path: Path
) -> None:
    """A local cluster's free port may be one Wireshark gives another protocol (27962 is Quake
    3's): with ``udp.try_heuristic_first`` the heuristic still finds NetDAM there, as the live
    capture test and protocol/wireshark/README.md rely on."""
    pcap = tmp_path / "quake.pcap"
    write_pcap(pcap, [Datagram(load_fixture("ping"), CLIENT, ("10.0.0.2", 27962))])
    (row,) = tshark_fields(tshark_env, pcap, "-o", "udp.try_heuristic_first:TRUE")
    assert row["opcode"] == ["0x09"] and row["_ws.col.Info"][0].startswith("PING")


@needs_tshark
def test_gso_super_frames_dissect_as_their_datagrams(
    tshark_env: dict[str, str], tmp_path: Path
) -> None:
    frames = gso_frames()
    pcap = tmp_path / "gso.pcap"
    write_pcap(pcap, [Datagram(payload, CLIENT, ("10.0.0.2", OTHER_PORT)) for payload, _ in frames])
    rows = tshark_fields(tshark_env, pcap)
    assert len(rows) == len(frames)
    for row, (_, count) in zip(rows, frames):
        assert len(row["opcode"]) == count, row["_ws.col.Info"]
        assert row["error.status"] == [], row["_ws.col.Info"]
        assert row["_ws.col.Info"][0].startswith(f"NetDAM GSO x{count}: ")
    # The port list preference (a cluster's ports) claims the port without the heuristic.
    out = tshark(
        tshark_env,
        "-o",
        f"netdam.ports:{OTHER_PORT - 1}-{OTHER_PORT}",
        "-r",
        str(pcap),
        "-T",
        "fields",
        "-e",
        "netdam.gso.size",
    )
    assert out.split() == [
        str(len(load_fixture("chain_add"))),
        str(len(encode_packet(_write_of(DType.F32)))),
        "68",
    ]


def test_completion_phases_dissect(tshark_env: dict[str, str], tmp_path: Path) -> None:
    """A collective's completion ACK (SPEC.md 4.1): its counters and its phases, by name."""
    phases = CompletionPhases(
        start_ns=123_456_789_000, chains_us=1500, chunks_us=1700, done_us=1900
    )
    ack = Packet(
        Opcode.ACK,
        client_id=9,
        txn_id=7,
        coll_id=1,
        epoch=3,
        aux_addr=1,
        payload=pack_completion(2, 1) + pack_completion_phases(phases),
        length=40,
    )
    pcap = tmp_path / "completion.pcap"
    write_pcap(pcap, [Datagram(encode_packet(ack), ("10.0.0.2", NETDAM_UDP_PORT), CLIENT)])
    out = tshark(
        tshark_env,
        "-r",
        str(pcap),
        "-T",
        "fields",
        "-E",
        "separator=,",
        *(
            a
            for f in (
                "chains_resent",
                "repair_reads",
                "start_ns",
                "chains_us",
                "chunks_us",
                "done_us",
            )
            for a in ("-e", f"netdam.coll.{f}")
        ),
    )
    assert out.strip() == "2,1,123456789000,1500,1700,1900"
