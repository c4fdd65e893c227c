"""``netdam decode``: show the fields of NetDAM datagrams given as hex or read from a pcap file.

Decoding goes through the codec (``netdam.protocol.packet.decode_packet``), so a malformed
datagram reports exactly the error and NACK status a node would answer with; ``--scapy`` adds the
scapy layer's dissection as a second opinion. scapy is imported only when needed (pcap or
``--scapy``): it costs about a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from netdam.cli.cluster import mtu_arg
from netdam.cli.common import ExitCode, cluster_file, dumps_json
from netdam.cluster.clusterfile import load_cluster, load_switch_entry
from netdam.protocol.constants import (
    DEFAULT_MTU,
    ELEMENT_SIZE,
    NETDAM_UDP_PORT,
    DType,
    Flags,
    Opcode,
    largest_payload,
)
from netdam.protocol.elements import element_values
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.packet import Packet, decode_packet, u64_to_endpoint
from netdam.protocol.payloads import INFO, SPARSE_PREFIX, unpack_key_rights, unpack_register
from netdam.protocol.pcap import Datagram, Input, PcapError, read_pcap

#: Payload elements listed in --json output; larger payloads give only the hex.
JSON_MAX_ELEMENTS = 256
#: Text output shows this many payload bytes and elements, then "...".
TEXT_MAX_BYTES = 32
TEXT_MAX_ELEMENTS = 16


class UsageProblem(NetdamError):
    """Input the command cannot read: exit 2 with a message that names the fix."""


def register(subparsers: Any) -> None:
    """Add ``netdam decode`` to the ``netdam`` command."""
    parser = subparsers.add_parser(
        "decode",
        help="decode NetDAM datagrams from hex or a pcap file",
        description="Decode NetDAM datagrams (protocol/SPEC.md): one given as hex (argument, "
        "--hex-file, or '-' for stdin; whitespace and '#' comment lines allowed) or every UDP "
        "datagram to or from the NetDAM port in a pcap file; a pcap's text output ends with a "
        "summary (frames read, datagrams by opcode, other frames skipped, malformed), --json "
        "gives it as 'summary'. Exit 0 when all decode, 1 when one "
        "is malformed (the error is the one a node reports), 2 on unreadable input.",
    )
    parser.add_argument(
        "hex", nargs="*", metavar="HEX", help="datagram bytes as hex, or '-' to read stdin"
    )
    parser.add_argument("--hex-file", metavar="FILE", help="read the hex from FILE ('-' for stdin)")
    parser.add_argument("--pcap", metavar="FILE", help="decode the NetDAM datagrams of a pcap file")
    ports = parser.add_mutually_exclusive_group()
    ports.add_argument(
        "--port",
        type=port_list,
        default=None,
        metavar="N[,M,A-B]",
        help=f"with --pcap: the NetDAM UDP ports (default {NETDAM_UDP_PORT})",
    )
    ports.add_argument(
        "--cluster",
        type=cluster_file,
        default=None,
        metavar="FILE",
        help="with --pcap: the ports of this cluster (nodes, control ports, switch VIP) and its "
        "multicast groups",
    )
    parser.add_argument(
        "--scapy", action="store_true", help="also show the scapy layer's dissection"
    )
    parser.add_argument(
        "--mtu",
        type=mtu_arg,
        default=None,
        help=f"the MTU the datagrams were sent at (default: --cluster's, else {DEFAULT_MTU}): a "
        "payload over its largest is TOO_LARGE (protocol/SPEC.md 2.7; 61440 at 65000)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``netdam decode``; returns the exit code."""
    try:
        given = _read_input(args)
    except UsageProblem as exc:
        return _fail({"ok": False, "error": str(exc)}, args.json, ExitCode.USAGE)
    datagrams = given.datagrams
    if not datagrams:
        ports = ",".join(str(p) for p in sorted(_ports(args)))
        message = (
            f"no UDP datagrams to or from port {ports} in {args.pcap}; pick the ports with "
            "--port or --cluster"
        )
        return _fail({"ok": False, "error": message}, args.json, ExitCode.CHECK_FAILED)
    try:
        largest = largest_payload(_mtu(args))
    except UsageProblem as exc:
        return _fail({"ok": False, "error": str(exc)}, args.json, ExitCode.USAGE)
    results = [_decode_one(d, args.scapy, largest) for d in datagrams]
    failed = [r for r in results if not r["ok"]]
    report: dict[str, Any] = {"ok": not failed}
    if failed:
        # The first failure names the error, as a single-datagram failure would.
        report.update(error=failed[0]["error"], status=failed[0]["status"])
    report["summary"] = tally(given, results)
    report["packets"] = results
    if args.json:
        for result in results:
            # Long payloads: the hex says it all; a list of 4096 numbers helps nobody.
            if len(result.get("elements", ())) > JSON_MAX_ELEMENTS:
                del result["elements"]
        sys.stdout.write(dumps_json(report) + "\n")
    else:
        sys.stdout.write(_render_text(results))
        if given.pcap:  # a single hex datagram needs no count; a capture of thousands does
            sys.stdout.write("\n" + summary_text(report["summary"]) + "\n")
        for result in failed:
            where = f"frame {result['frame']}{_segment(result)}: " if "frame" in result else ""
            print(f"error: {where}{result['error']} (status {result['status']})", file=sys.stderr)
    return int(ExitCode.CHECK_FAILED if failed else ExitCode.OK)


def tally(given: Input, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts that end the output: frames read, NetDAM datagrams by opcode (in opcode
    order), frames skipped as other traffic, datagrams that did not decode."""
    by_opcode = {op.name: 0 for op in Opcode}
    for result in results:
        if result["ok"]:
            by_opcode[result["opcode"]] += 1
    return {
        "frames": given.frames,
        "datagrams": len(results),
        "by_opcode": {name: n for name, n in by_opcode.items() if n},
        "skipped_frames": given.skipped,
        "malformed": sum(1 for r in results if not r["ok"]),
    }


def summary_text(counts: dict[str, Any]) -> str:
    """The summary block of the text output (one line per kind of count)."""
    opcodes = ", ".join(f"{name} {n}" for name, n in counts["by_opcode"].items()) or "none"
    return "\n".join(
        [
            f"summary: {counts['frames']} frames read, {counts['datagrams']} NetDAM datagrams, "
            f"{counts['skipped_frames']} other frames skipped, {counts['malformed']} malformed",
            f"  by opcode: {opcodes}",
        ]
    )


def _segment(result: dict[str, Any]) -> str:
    """' (GSO datagram k)' for a datagram split out of a super-frame."""
    return f" (GSO datagram {result['gso_segment']})" if "gso_segment" in result else ""


def _fail(obj: dict[str, Any], as_json: bool, code: ExitCode) -> int:
    if as_json:
        sys.stdout.write(dumps_json(obj) + "\n")
    else:
        print(f"error: {obj['error']}", file=sys.stderr)
    return int(code)


# ---------------------------------------------------------------------------------------------
# Input


def _read_input(args: argparse.Namespace) -> Input:
    sources = [
        name
        for name, given in (("HEX", args.hex), ("--hex-file", args.hex_file), ("--pcap", args.pcap))
        if given
    ]
    if len(sources) != 1:
        what = "no input" if not sources else f"{' and '.join(sources)} together"
        raise UsageProblem(
            f"{what}: give exactly one of HEX (or '-' for stdin), --hex-file FILE, --pcap FILE"
        )
    for flag in ("port", "cluster"):
        if getattr(args, flag) is not None and not args.pcap:
            raise UsageProblem(f"--{flag} applies to --pcap input only; drop it or add --pcap FILE")
    if args.pcap:
        try:
            return read_pcap(args.pcap, _ports(args), multicast=args.cluster is not None)
        except PcapError as exc:
            raise UsageProblem(str(exc)) from None
    if args.hex_file:
        return Input([Datagram(parse_hex(_read_text(args.hex_file), args.hex_file))])
    if args.hex == ["-"]:
        return Input([Datagram(parse_hex(sys.stdin.read(), "stdin"))])
    return Input([Datagram(parse_hex(" ".join(args.hex), "the HEX argument"))])


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageProblem(
            f"hex file {path} not found; give an existing file or '-' for stdin"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageProblem(
            f"cannot read hex file {path} ({exc}); give a text file of hex digits"
        ) from None


def parse_hex(text: str, where: str) -> bytes:
    """Bytes of a hex dump: '#' comment lines and whitespace ignored, an optional 0x prefix."""
    digits = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#"):
            continue
        for word in line.split():
            word = word[2:] if word[:2].lower() == "0x" else word
            bad = next((c for c in word if c not in "0123456789abcdefABCDEF"), None)
            if bad is not None:
                raise UsageProblem(
                    f"{where}, line {number}: {bad!r} is not a hex digit; give bytes as hex "
                    "digits (comment lines start with '#')"
                )
            digits.append(word)
    joined = "".join(digits)
    if not joined:
        raise UsageProblem(f"{where} holds no hex digits; give the datagram's bytes as hex")
    if len(joined) % 2:
        raise UsageProblem(
            f"{where} has an odd number of hex digits ({len(joined)}); give two digits per byte"
        )
    return bytes.fromhex(joined)


def port_list(text: str) -> set[int]:
    """argparse type for ``N[,M,A-B...]``: UDP ports."""
    ports: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid port list {text!r}: write N, N,M or A-B"
            ) from None
        if not 1 <= first <= last <= 65535:
            raise argparse.ArgumentTypeError(f"invalid ports {part!r}: give ports 1..65535, A <= B")
        ports.update(range(first, last + 1))
    return ports


def cluster_ports(path: Path) -> set[int]:
    """The UDP ports a cluster's traffic uses: every node's data and control port, the switch's
    VIP and control port (multicast groups are matched by address, 239.77.0.0/16)."""

    info = load_cluster(path)
    ports = {n.port for n in info.nodes} | {n.control_port for n in info.nodes if n.control_port}
    switch = load_switch_entry(path)
    if switch is not None:
        ports |= {switch.vip[1]} | ({switch.control_port} if switch.control_port else set())
    return ports


def _ports(args: argparse.Namespace) -> set[int]:
    if args.cluster is not None:
        try:
            return cluster_ports(args.cluster)
        except ValueError as exc:
            raise UsageProblem(str(exc)) from None
    return set(args.port) if args.port else {NETDAM_UDP_PORT}


# ---------------------------------------------------------------------------------------------
# Decoding


def _mtu(args: argparse.Namespace) -> int:
    """The MTU the datagrams were sent at: --mtu, else the cluster file's, else the default."""
    if args.mtu is not None:
        return int(args.mtu)
    if args.cluster is not None:
        try:
            return int(load_cluster(args.cluster).mtu)
        except ValueError as exc:
            raise UsageProblem(str(exc)) from None
    return int(DEFAULT_MTU)


def _decode_one(datagram: Datagram, with_scapy: bool, max_payload: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if datagram.frame is not None:
        result.update(frame=datagram.frame, src=datagram.src, dst=datagram.dst)
        if datagram.segment is not None:
            result["gso_segment"] = datagram.segment
    result["size"] = len(datagram.data)
    try:
        packet = decode_packet(datagram.data, max_payload)
    except RemoteProtocolError as exc:
        result.update(ok=False, error=str(exc), status=exc.status.name, hex=datagram.data.hex())
    else:
        result["ok"] = True
        result.update(packet_fields(packet))
    if with_scapy:
        # Lenient by design: scapy shows even what the codec refuses.
        from netdam.protocol.scapy_layer import NetDAM

        try:
            result["scapy"] = NetDAM(datagram.data).show2(dump=True)
        except Exception as exc:  # scapy raises struct.error, IndexError... on short input
            result["scapy"] = f"scapy cannot dissect these {len(datagram.data)} bytes ({exc})"
    return result


def packet_fields(packet: Packet) -> dict[str, Any]:
    """Every field of *packet* in wire order, enums as names, plus the decoded payload."""
    fields: dict[str, Any] = {
        "version": packet.version,
        "opcode": packet.opcode.name,
        "flags": [str(f.name) for f in Flags if f and f in packet.flags],
        "seq": packet.seq,
        "client_id": packet.client_id,
        "txn_id": packet.txn_id,
        "coll_id": packet.coll_id,
        "epoch": packet.epoch,
        "rkey": packet.rkey,
        "length": packet.length,
        "addr": packet.addr,
        "aux_addr": packet.aux_addr,
        "dtype": packet.dtype.name,
        "reduce_op": packet.reduce_op.name,
        "status": packet.status.name,
        "credit": packet.credit,
        "seg_type": packet.seg_type.name,
        "segments_left": packet.segments_left,
        "seg_count": len(packet.segments),
        "segments": [f"{ip}:{port}" for ip, port in packet.segments],
        "ret": f"{packet.ret[0]}:{packet.ret[1]}",
        "payload": packet.payload.hex(),
    }
    if packet.flags & Flags.TAGGED:
        fields["tag"] = f"0x{packet.tag:016x}"  # the trailer (SPEC.md 2.6)
    fields.update(_payload_meaning(packet))
    return fields


def _payload_meaning(packet: Packet) -> dict[str, Any]:
    """What the payload says, where SPEC.md fixes its layout."""
    opcode, payload = packet.opcode, packet.payload
    if opcode in (Opcode.JOIN, Opcode.LEAVE):
        ip, port = u64_to_endpoint(packet.addr)  # SPEC.md 3: addr = ip << 16 | port
        return {"group": f"{ip}:{port}"}
    if opcode == Opcode.INFO and len(payload) == INFO.size:
        names = ("version", "mtu", "memory_bytes", "max_payload", "max_segments", "rank", "world")
        return {"info": dict(zip(names, INFO.unpack(payload)))}
    if opcode == Opcode.REGISTER:
        rkey, rights, tag_key = unpack_register(payload)
        return {"requested_rkey": rkey, "rights": rights, "tagged": bool(tag_key)}
    if opcode == Opcode.DEREGISTER:
        return {"remove_rkey": unpack_key_rights(payload)[0]}
    if packet.flags & Flags.SPARSE and packet.dtype != DType.RAW:
        return {"sparse": _sparse(packet)}
    size = ELEMENT_SIZE[packet.dtype]
    if payload and packet.dtype != DType.RAW and len(payload) % size == 0:
        return {"elements": element_values(payload, packet.dtype).tolist()}
    return {}


def _sparse(packet: Packet) -> dict[str, Any]:
    # The codec has already validated the layout (SPEC.md 2.5).
    nnz = SPARSE_PREFIX.unpack_from(packet.payload)[0]
    indices = np.frombuffer(packet.payload, dtype="<u2", count=nnz, offset=SPARSE_PREFIX.size)
    start = SPARSE_PREFIX.size + (2 * nnz + 7) // 8 * 8
    values = element_values(packet.payload, packet.dtype, count=nnz, offset=start)
    return {"nnz": nnz, "indices": indices.tolist(), "values": values.tolist()}


# ---------------------------------------------------------------------------------------------
# Text output

_HEX_FIELDS = frozenset({"rkey", "addr", "aux_addr", "requested_rkey", "remove_rkey", "rights"})


def _render_text(results: list[dict[str, Any]]) -> str:
    blocks = []
    for result in results:
        lines = []
        if "frame" in result:
            lines.append(
                f"# frame {result['frame']}{_segment(result)}: {result['src']} > {result['dst']}"
            )
        lines += _text_lines(result)
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _text_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"size: {result['size']} bytes"]
    if not result["ok"]:
        lines += [
            f"error: {result['error']}",
            f"status: {result['status']}",
            f"hex: {_short_hex(bytes.fromhex(result['hex']))}",
        ]
    else:
        for name, value in result.items():
            if name in ("frame", "src", "dst", "size", "ok", "scapy", "gso_segment"):
                continue
            lines.append(f"{name}: {_text_value(name, value)}")
    if "scapy" in result:
        lines += ["scapy:", result["scapy"].rstrip("\n")]
    return lines


def _text_value(name: str, value: Any) -> str:
    if name == "opcode":
        return f"{value} (0x{Opcode[value]:02x})"
    if name == "flags":
        return "|".join(value) if value else "0"
    if name in _HEX_FIELDS:
        return f"0x{value:x}"
    if name == "segments":
        return ", ".join(value) if value else "none"
    if name == "payload":
        return _short_hex(bytes.fromhex(value)) if value else "none"
    if name in ("elements", "indices", "values"):
        shown = ", ".join(repr(v) for v in value[:TEXT_MAX_ELEMENTS])
        more = f", ... ({len(value)} elements)" if len(value) > TEXT_MAX_ELEMENTS else ""
        return f"[{shown}{more}]"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text_value(k, v)}" for k, v in value.items())
    return str(value)


def _short_hex(data: bytes) -> str:
    if len(data) <= TEXT_MAX_BYTES:
        return data.hex(" ")
    return f"{data[:TEXT_MAX_BYTES].hex(' ')} ... ({len(data)} bytes)"
