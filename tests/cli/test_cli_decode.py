"""``netdam decode``: hex (argument, file, stdin) and pcap input, text and --json output, exit codes.

The parser is built locally around ``netdam.cli.decode.register`` so these tests do not depend on
the other subcommand modules ``netdam.cli.main`` lists.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

import netdam.cli.decode
from netdam.cli.common import NetdamArgumentParser
from netdam.protocol.constants import Opcode
from netdam.protocol.fixtures import FIXTURE_NAMES, load_fixture
from netdam.protocol.packet import Packet, encode_packet

CHAIN_ADD_HEX = load_fixture("chain_add").hex()


def run(argv: list[str]) -> int:
    parser = NetdamArgumentParser(prog="netdam")
    subparsers = parser.add_subparsers(dest="command", parser_class=NetdamArgumentParser)
    netdam.cli.decode.register(subparsers)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = run([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)  # exactly one JSON object, nothing else on stdout


def test_decode_is_listed_in_the_netdam_command() -> None:
    import netdam.cli.main

    assert "netdam.cli.decode" in netdam.cli.main._COMMAND_MODULES


def test_hex_argument_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["decode", CHAIN_ADD_HEX]) == 0
    lines = capsys.readouterr().out.splitlines()
    for expected in (
        "size: 104 bytes",
        "opcode: CHAIN_ADD (0x05)",
        "flags: ACK_REQ",
        "rkey: 0x12345678",
        "aux_addr: 0x20000",
        "dtype: F32",
        "seg_type: IPV4",
        "segments_left: 2",
        "segments: 10.0.0.2:7744, 10.0.0.3:7744, 10.0.0.4:7744",
        "ret: 10.0.0.1:7744",
        "elements: [0.125, -1.5, 2.75, 100.0]",
    ):
        assert expected in lines


def test_a_payload_over_the_mtus_largest_is_too_large_and_mtu_65000_takes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SPEC.md 2.7: a 61440-byte WRITE is malformed at the default MTU, well formed at 65000."""
    big = Packet(Opcode.WRITE, rkey=1, length=61440, payload=bytes(61440))
    data = encode_packet(big, max_payload=61440).hex()
    code, result = run_json(["decode", data], capsys)
    assert code == 1 and "exceeds the maximum payload of 8192 bytes" in result["error"]
    code, result = run_json(["decode", data, "--mtu", "65000"], capsys)
    assert code == 0 and result["packets"][0]["length"] == 61440


def test_hex_argument_may_be_split_into_words(capsys: pytest.CaptureFixture[str]) -> None:
    words = load_fixture("ping").hex(" ").split()
    assert run(["decode", *words]) == 0
    assert "opcode: PING (0x09)" in capsys.readouterr().out


def test_hex_file_with_comments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ack.hex"
    path.write_text("# an ACK\n  # indented comment\n" + load_fixture("ack").hex(" ") + "\n\n")
    code, result = run_json(["decode", "--hex-file", str(path)], capsys)
    assert code == 0
    assert result["packets"][0]["opcode"] == "ACK"
    assert result["packets"][0]["elements"] == [41]


@pytest.mark.parametrize("argv", [["decode", "-"], ["decode", "--hex-file", "-"]])
def test_stdin(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("# INFO\n" + load_fixture("info").hex()))
    code, result = run_json(argv, capsys)
    assert code == 0
    info = result["packets"][0]["info"]
    assert info == {
        "version": 1,
        "mtu": 9000,
        "memory_bytes": 1 << 30,
        "max_payload": 8192,
        "max_segments": 64,
        "rank": 2,
        "world": 4,
    }


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run_json(["decode", CHAIN_ADD_HEX], capsys)
    assert code == 0
    assert list(result) == ["ok", "summary", "packets"] and result["ok"] is True
    assert result["summary"] == {
        "frames": 1,
        "datagrams": 1,
        "by_opcode": {"CHAIN_ADD": 1},
        "skipped_frames": 0,
        "malformed": 0,
    }
    (packet,) = result["packets"]
    assert packet == {
        "size": 104,
        "ok": True,
        "version": 1,
        "opcode": "CHAIN_ADD",
        "flags": ["ACK_REQ"],
        "seq": 3,
        "client_id": 7,
        "txn_id": 104,
        "coll_id": 9,
        "epoch": 2,
        "rkey": 0x12345678,
        "length": 16,
        "addr": 0x10000,
        "aux_addr": 0x20000,
        "dtype": "F32",
        "reduce_op": "SUM",
        "status": "OK",
        "credit": 0,
        "seg_type": "IPV4",
        "segments_left": 2,
        "seg_count": 3,
        "segments": ["10.0.0.2:7744", "10.0.0.3:7744", "10.0.0.4:7744"],
        "ret": "10.0.0.1:7744",
        "payload": "0000003e0000c0bf00003040 0000c842".replace(" ", ""),
        "elements": [0.125, -1.5, 2.75, 100.0],
    }


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_decodes(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run_json(["decode", load_fixture(name).hex()], capsys)
    assert code == 0
    # A fixture is named after its opcode, but for an ACK that answers another request and the
    # tagged example, whose tag is shown.
    named = {
        "alloc_ack": "ACK",
        "all_write_tagged": "ALL_WRITE",
        "read_tagged": "READ",
        "register_sealed": "REGISTER",
    }
    assert result["packets"][0]["opcode"] == named.get(name, name.upper())
    if name == "all_write_tagged":
        assert result["packets"][0]["tag"] == "0xfa019ae1fe937bca"
    if name == "read_tagged":
        assert result["packets"][0]["tag"] == "0x344f9d27b315ea12"
    if name == "register_sealed":
        assert result["packets"][0]["tag"] == "0xd8f2554dd655b550"


def test_special_payloads(capsys: pytest.CaptureFixture[str]) -> None:
    _, result = run_json(["decode", load_fixture("join").hex()], capsys)
    assert result["packets"][0]["group"] == "239.77.0.1:7744"
    _, result = run_json(["decode", load_fixture("register").hex()], capsys)
    assert (result["packets"][0]["requested_rkey"], result["packets"][0]["rights"]) == (
        0xC0FFEE01,
        3,
    )
    _, result = run_json(["decode", load_fixture("all_write").hex()], capsys)
    assert result["packets"][0]["elements"] == [1.0, -0.5, 65504.0, 2.0**-14]


def test_long_payload_is_truncated_in_text(capsys: pytest.CaptureFixture[str]) -> None:
    header = bytearray(load_fixture("write")[:64])
    header[28:32] = (4096).to_bytes(4, "big")  # 1024 f32
    assert run(["decode", (bytes(header) + bytes(4096)).hex()]) == 0
    out = capsys.readouterr().out
    assert "... (4096 bytes)" in out
    assert "... (1024 elements)]" in out


@pytest.mark.parametrize(
    ("data", "error", "status"),
    [
        (load_fixture("chain_add")[:70], "SR list truncated (0 of 3 segments)", "TRUNCATED"),
        (
            load_fixture("ping")[:10],
            "packet truncated: 10 bytes, the fixed header needs 64",
            "TRUNCATED",
        ),
        (
            b"\x02" + load_fixture("ping")[1:],
            "unsupported version 2 (this node speaks 1)",
            "BAD_VERSION",
        ),
        (
            load_fixture("write")[:-1],
            "WRITE length field says 16 bytes but the payload has 15",
            "BAD_LENGTH",
        ),
    ],
)
def test_malformed_exits_1_with_the_codec_error(
    data: bytes, error: str, status: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = run_json(["decode", data.hex()], capsys)
    assert code == 1
    assert (result["ok"], result["error"], result["status"]) == (False, error, status)
    assert run(["decode", data.hex()]) == 1
    assert f"error: {error} (status {status})" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["decode"],
            "no input: give exactly one of HEX (or '-' for stdin), --hex-file FILE, --pcap FILE",
        ),
        (
            ["decode", "01zz"],
            "the HEX argument, line 1: 'z' is not a hex digit; give bytes as hex digits (comment lines start with '#')",
        ),
        (
            ["decode", "010"],
            "the HEX argument has an odd number of hex digits (3); give two digits per byte",
        ),
        (
            ["decode", "--hex-file", "/nonexistent/x.hex"],
            "hex file /nonexistent/x.hex not found; give an existing file or '-' for stdin",
        ),
        (
            ["decode", "--pcap", "/nonexistent/x.pcap"],
            "pcap file /nonexistent/x.pcap not found; give an existing capture file",
        ),
        (
            ["decode", "00", "--pcap", "x.pcap"],
            "HEX and --pcap together: give exactly one of HEX (or '-' for stdin), --hex-file FILE, --pcap FILE",
        ),
        (
            ["decode", "00", "--port", "9"],
            "--port applies to --pcap input only; drop it or add --pcap FILE",
        ),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = run_json(argv, capsys)
    assert code == 2
    assert result == {"ok": False, "error": error}
    assert run(argv) == 2
    assert capsys.readouterr().err == f"error: {error}\n"


def test_unknown_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["decode", "--no-such-flag"])
    assert info.value.code == 2


def test_not_a_pcap_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.pcap"
    path.write_text("hello")
    code, result = run_json(["decode", "--pcap", str(path)], capsys)
    assert code == 2
    assert result["error"].startswith(f"cannot read {path} as pcap (")


def _write_pcap(path: Path, port: int = 7744) -> None:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw
    from scapy.utils import wrpcap

    frames = [
        Ether()
        / IP(src="10.0.0.100", dst="10.0.0.1")
        / UDP(sport=50000, dport=port)
        / Raw(load_fixture("read")),
        Ether() / IP(src="10.0.0.9", dst="10.0.0.8") / UDP(sport=53, dport=53) / Raw(b"dns"),
        Ether()
        / IP(src="10.0.0.1", dst="10.0.0.100")
        / UDP(sport=port, dport=50000)
        / Raw(load_fixture("read_resp")),
    ]
    wrpcap(str(path), frames)


def test_pcap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("scapy")
    path = tmp_path / "capture.pcap"
    _write_pcap(path)
    code, result = run_json(["decode", "--pcap", str(path)], capsys)
    assert code == 0
    request, reply = result["packets"]
    assert (request["frame"], request["src"], request["dst"], request["opcode"]) == (
        1,
        "10.0.0.100:50000",
        "10.0.0.1:7744",
        "READ",
    )
    assert (reply["frame"], reply["opcode"], reply["elements"]) == (
        3,
        "READ_RESP",
        [1.5, -2.0, 0.25, 1024.0],
    )
    assert run(["decode", "--pcap", str(path)]) == 0
    assert "# frame 3: 10.0.0.1:7744 > 10.0.0.100:50000" in capsys.readouterr().out


def test_pcap_other_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("scapy")
    path = tmp_path / "capture.pcap"
    _write_pcap(path, port=9999)
    code, result = run_json(["decode", "--pcap", str(path)], capsys)
    assert code == 1
    assert (
        result["error"]
        == f"no UDP datagrams to or from port 7744 in {path}; pick the ports with --port or --cluster"
    )
    code, result = run_json(["decode", "--pcap", str(path), "--port", "9999"], capsys)
    assert code == 0
    assert [p["opcode"] for p in result["packets"]] == ["READ", "READ_RESP"]
    code, result = run_json(["decode", "--pcap", str(path), "--port", "7744,9990-9999"], capsys)
    assert code == 0 and len(result["packets"]) == 2


def test_pcap_with_a_malformed_datagram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("scapy")
    from scapy.layers.inet import IP, UDP
    from scapy.packet import Raw
    from scapy.utils import wrpcap

    path = tmp_path / "bad.pcap"
    wrpcap(
        str(path),
        [
            IP() / UDP(sport=1, dport=7744) / Raw(load_fixture("ping")),
            IP() / UDP(sport=1, dport=7744) / Raw(load_fixture("chain_add")[:80]),
        ],
    )
    code, result = run_json(["decode", "--pcap", str(path)], capsys)
    assert code == 1
    assert (result["ok"], result["error"], result["status"]) == (
        False,
        "SR list truncated (2 of 3 segments)",
        "TRUNCATED",
    )
    assert [p["ok"] for p in result["packets"]] == [True, False]


def test_pcap_summary_counts_frames_opcodes_skips_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A capture's text output ends with the counts (a real one runs to thousands of lines);
    --json carries the same counts as 'summary'."""
    pytest.importorskip("scapy")
    from scapy.layers.inet import ICMP, IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw
    from scapy.utils import wrpcap

    path = tmp_path / "mixed.pcap"
    netdam = [
        load_fixture("read"),
        load_fixture("read_resp"),
        load_fixture("read"),
        load_fixture("ping"),
        load_fixture("chain_add")[:80],
    ]
    frames = [Ether() / IP() / UDP(sport=50000, dport=7744) / Raw(d) for d in netdam]
    frames += [Ether() / IP() / UDP(sport=53, dport=53) / Raw(b"dns"), Ether() / IP() / ICMP()]
    wrpcap(str(path), frames)
    expected = {
        "frames": 7,
        "datagrams": 5,
        "by_opcode": {"READ": 2, "READ_RESP": 1, "PING": 1},
        "skipped_frames": 2,
        "malformed": 1,
    }
    code, result = run_json(["decode", "--pcap", str(path)], capsys)
    assert code == 1 and result["summary"] == expected
    assert run(["decode", "--pcap", str(path)]) == 1
    tail = capsys.readouterr().out.rstrip("\n").splitlines()[-2:]
    assert tail == [
        "summary: 7 frames read, 5 NetDAM datagrams, 2 other frames skipped, 1 malformed",
        "  by opcode: READ 2, READ_RESP 1, PING 1",
    ]


def test_scapy_view(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("scapy")
    assert run(["decode", CHAIN_ADD_HEX, "--scapy"]) == 0
    out = capsys.readouterr().out
    assert "###[ NetDAM ]###" in out and "###[ NetDAM SR segment ]###" in out
    # scapy still dissects what the codec refuses; too short for it as well, it says so.
    code, result = run_json(["decode", load_fixture("chain_add")[:80].hex(), "--scapy"], capsys)
    assert code == 1 and "opcode    = CHAIN_ADD" in result["packets"][0]["scapy"]
    code, result = run_json(["decode", "0105", "--scapy"], capsys)
    assert code == 1 and result["packets"][0]["scapy"].startswith(
        "scapy cannot dissect these 2 bytes"
    )


def test_long_payload_has_no_element_list_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    header = bytearray(load_fixture("write")[:64])
    header[28:32] = (4096).to_bytes(4, "big")
    code, result = run_json(["decode", (bytes(header) + bytes(4096)).hex()], capsys)
    assert code == 0
    assert "elements" not in result["packets"][0]
    assert result["packets"][0]["payload"] == "00" * 4096


def test_sparse_payload_is_expanded(capsys: pytest.CaptureFixture[str]) -> None:
    import struct

    from netdam.protocol.constants import DType, Flags, Opcode
    from netdam.protocol.packet import Packet, encode_packet

    # SPEC.md 2.5: nnz 2, indices 1 and 3 padded to 8 bytes, then the f32 values.
    payload = (
        struct.pack("<II", 2, 0)
        + struct.pack("<2H", 1, 3)
        + bytes(4)
        + struct.pack("<2f", 2.5, -1.0)
    )
    packet = Packet(Opcode.WRITE, flags=Flags.SPARSE, length=16, dtype=DType.F32, payload=payload)
    code, result = run_json(["decode", encode_packet(packet).hex()], capsys)
    assert code == 0
    assert result["packets"][0]["sparse"] == {"nnz": 2, "indices": [1, 3], "values": [2.5, -1.0]}
    assert run(["decode", encode_packet(packet).hex()]) == 0
    assert "sparse: nnz 2, indices [1, 3], values [2.5, -1.0]" in capsys.readouterr().out
