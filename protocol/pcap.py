"""NetDAM datagrams out of a capture: pcap/pcapng frames to UDP payloads, and a loopback UDP-GSO
super-frame back into the datagrams it carried (the split that ``netdam capture``'s output needs
when it is read again). ``netdam decode --pcap`` reads captures through this; scapy is imported
only when a file is read.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from netdam.protocol.constants import HEADER_SIZE, MULTICAST_PREFIX, SEGMENT_SIZE, Opcode
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.layout import H_OPCODE, H_SEG_COUNT, H_VERSION, HEADER
from netdam.protocol.packet import decode_packet


class PcapError(NetdamError):
    """A capture file that cannot be read (missing, not pcap): the message names the fix."""


@dataclass
class Datagram:
    """One UDP payload to decode, with where it came from."""

    data: bytes
    #: For pcap input: frame number (1-based, as Wireshark counts) and endpoints.
    frame: int | None = None
    src: str | None = None
    dst: str | None = None
    #: Datagram k (1-based) of a UDP-GSO super-frame that held several (None: a frame of one).
    segment: int | None = None


@dataclass
class Input:
    """What the input held: the datagrams to decode and, for a pcap, how many frames it had."""

    datagrams: list[Datagram]
    #: Frames read (a pcap's frames; hex input counts as one).
    frames: int = 1
    #: Frames that carried no datagram to or from the NetDAM ports (other traffic, no UDP).
    skipped: int = 0
    pcap: bool = False


def split_gso(data: bytes) -> list[bytes]:
    """The datagrams of one captured UDP payload.

    On loopback a capture sees a UDP-GSO send (udp(7) ``UDP_SEGMENT``) before segmentation: one
    frame whose UDP payload is several datagrams of ``gso_size`` bytes laid back to back, the
    last one possibly shorter. The header does not carry gso_size, so it is found from the
    datagrams: the first datagram's size when its payload is dense (header + SR list +
    ``length``), else the smallest size at which the first datagram decodes cleanly; a size is
    taken only if every boundary it implies starts a header (version, known opcode: one GSO send
    may carry different packets of one size, e.g. a READ_RESP then an ACK). A payload that is one datagram (or no such size fits) comes
    back whole, so a truly malformed datagram still reports its own error."""
    try:
        decode_packet(data)
        return [data]
    except RemoteProtocolError:
        pass
    if len(data) < 2 * HEADER_SIZE:
        return [data]
    seg_count, length = data[H_SEG_COUNT], HEADER.read(data, "length")
    dense = HEADER_SIZE + SEGMENT_SIZE * seg_count + length
    candidates = [dense] + [s for s in range(HEADER_SIZE, len(data)) if _header_at(data, s)]
    for size in candidates:
        if not HEADER_SIZE <= size < len(data) or not _splits(data, size):
            continue
        return [data[i : i + size] for i in range(0, len(data), size)]
    return [data]


def _header_at(data: bytes, offset: int) -> bool:
    """Whether a v1 header with a known opcode could start at *offset* (a node's GSO send may
    batch different packets of one size to one destination: a READ_RESP, then an ACK)."""
    return (
        data[offset + H_VERSION] == data[H_VERSION]
        and offset + H_OPCODE < len(data)
        and data[offset + H_OPCODE] in _OPCODES
    )


_OPCODES = frozenset(int(op) for op in Opcode)


def _splits(data: bytes, size: int) -> bool:
    if not all(_header_at(data, i) for i in range(size, len(data), size)):
        return False
    try:
        decode_packet(data[:size])
    except RemoteProtocolError:
        return False
    return True


def _in_groups(address: str) -> bool:

    try:
        return ipaddress.ip_address(address) in ipaddress.ip_network(MULTICAST_PREFIX)
    except ValueError:
        return False


def read_pcap(path: str, ports: set[int], multicast: bool = False) -> Input:
    """The NetDAM datagrams of a pcap or pcapng file: UDP to or from *ports* (and, with
    *multicast*, to the NetDAM multicast groups), each GSO super-frame split (``split_gso``)."""
    # scapy is slow to import (about a second) and only needed to read a file.
    from scapy.error import Scapy_Exception
    from scapy.layers.inet import UDP
    from scapy.utils import rdpcap

    if not Path(path).is_file():
        raise PcapError(f"pcap file {path} not found; give an existing capture file")
    try:
        frames = rdpcap(path)
    except (Scapy_Exception, OSError, EOFError) as exc:
        raise PcapError(f"cannot read {path} as pcap ({exc}); give a pcap or pcapng file") from None
    datagrams = []
    skipped = 0
    for number, frame in enumerate(frames, start=1):
        udp = frame.getlayer(UDP)
        if udp is None:
            skipped += 1
            continue
        ip = udp.underlayer
        group = multicast and _in_groups(str(getattr(ip, "dst", "")))
        if udp.sport not in ports and udp.dport not in ports and not group:
            skipped += 1
            continue
        # `original` is the exact bytes scapy dissected (UDP already cut Ethernet padding);
        # rebuilding with bytes() could normalize a malformed datagram.
        payload = udp.payload
        data = payload.original if payload.original is not None else bytes(payload)
        src = f"{getattr(ip, 'src', '?')}:{udp.sport}"
        dst = f"{getattr(ip, 'dst', '?')}:{udp.dport}"
        parts = split_gso(bytes(data))
        for k, part in enumerate(parts, start=1):
            datagrams.append(
                Datagram(
                    part, frame=number, src=src, dst=dst, segment=k if len(parts) > 1 else None
                )
            )
    return Input(datagrams, frames=len(frames), skipped=skipped, pcap=True)
