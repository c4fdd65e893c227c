"""Ethernet, IPv4, UDP and NetDAM framing arithmetic (no hardware parameters in here).

Every number is a byte count fixed by a standard or by our wire format:
IEEE 802.3 framing (BRIEF section 4 table), RFC 791/768 headers, and the NetDAM v1 header
(protocol/SPEC.md, being written by the lead; duplicated here on purpose so this module does
not import netdam.protocol).
"""

from __future__ import annotations

import math

# IEEE 802.3 per-frame costs (BRIEF section 4, "Ethernet per-frame overhead").
PREAMBLE_SFD_BYTES = 8
IFG_BYTES = 12
FCS_BYTES = 4
ETH_HEADER_BYTES = 14
MIN_FRAME_BYTES = 64  # IEEE 802.3 minimum frame, FCS included; shorter frames are padded
# RFC 791 / RFC 768 fixed headers (no IP options).
IPV4_HEADER_BYTES = 20
UDP_HEADER_BYTES = 8
IP_UDP_BYTES = IPV4_HEADER_BYTES + UDP_HEADER_BYTES  # 28: "UDP payload <= MTU - 28" (BRIEF 7)
# Bytes around the UDP payload in an L2 frame: 14 + 20 + 8 + 4 = 46 (design notes 2.3).
FRAME_OVERHEAD_BYTES = ETH_HEADER_BYTES + IP_UDP_BYTES + FCS_BYTES
WIRE_EXTRA_BYTES = PREAMBLE_SFD_BYTES + IFG_BYTES  # 20 B of line time that carry no frame

# NetDAM v1 wire format: protocol/SPEC.md.
NETDAM_HEADER_BYTES = 64  # fixed header of every NetDAM packet (protocol/SPEC.md)
SR_SEGMENT_BYTES = 8  # one segment-routing list entry (protocol/SPEC.md)
MAX_NETDAM_PAYLOAD_BYTES = 8192  # 2048 f32 per packet (protocol/SPEC.md; BRIEF section 4)
DEFAULT_MTU = 9000  # "a 9000-byte frame means IP MTU 9000" (BRIEF section 7)

# RoCEv2 per-packet transport headers (design notes 2.3, from B16): BTH 12 + ICRC 4 on every
# packet; RETH 16 only on the first packet of a WRITE/READ request, AETH 4 on read responses.
ROCE_BTH_BYTES = 12
ROCE_RETH_BYTES = 16
ROCE_AETH_BYTES = 4
ROCE_ICRC_BYTES = 4


def frame_bytes(udp_payload: int) -> int:
    """L2 frame bytes (FCS included, padded to 64 B) that carry *udp_payload* bytes of UDP."""
    if udp_payload < 0:
        raise ValueError(f"UDP payload must be >= 0 bytes, got {udp_payload}")
    return max(MIN_FRAME_BYTES, udp_payload + FRAME_OVERHEAD_BYTES)


def udp_payload_for_frame(frame: int) -> int:
    """UDP payload bytes carried by an L2 frame of *frame* bytes (FCS included, >= 64)."""
    if frame < MIN_FRAME_BYTES:
        raise ValueError(f"an Ethernet frame is at least {MIN_FRAME_BYTES} B, got {frame}")
    return frame - FRAME_OVERHEAD_BYTES


def wire_bytes(frame: int) -> int:
    """Line bytes one frame occupies: the frame plus preamble/SFD and inter-frame gap."""
    return frame + WIRE_EXTRA_BYTES


def ip_packet_bytes(udp_payload: int) -> int:
    """IPv4 packet bytes for *udp_payload* bytes of UDP payload."""
    return udp_payload + IP_UDP_BYTES


def serialization_seconds(nbytes: int, link_gbps: float) -> float:
    """Seconds to clock *nbytes* line bytes onto a *link_gbps* (10^9 bit/s) link."""
    return nbytes * 8.0 / (link_gbps * 1e9)


def packets_per_second(frame: int, link_gbps: float) -> float:
    """Line-rate frames per second for back-to-back frames of *frame* bytes."""
    return 1.0 / serialization_seconds(wire_bytes(frame), link_gbps)


def netdam_udp_payload(data_bytes: int, sr_segments: int = 0) -> int:
    """UDP payload of a NetDAM packet: 64 B header + 8 B per SR segment + data."""
    return NETDAM_HEADER_BYTES + SR_SEGMENT_BYTES * sr_segments + data_bytes


def max_data_bytes(mtu: int = DEFAULT_MTU, sr_segments: int = 0, element_bytes: int = 1) -> int:
    """Largest whole-element data payload of one NetDAM packet (BRIEF section 7 formula).

    floor((MTU - 28 - header - SR list) / element) elements, capped at the 8192-byte
    protocol maximum; returned in bytes.
    """
    room = mtu - IP_UDP_BYTES - NETDAM_HEADER_BYTES - SR_SEGMENT_BYTES * sr_segments
    cap = min(room, MAX_NETDAM_PAYLOAD_BYTES)
    if cap < element_bytes:
        raise ValueError(
            f"MTU {mtu} leaves {room} B for data with {sr_segments} SR segments: "
            "raise --mtu or shorten the segment list"
        )
    return (cap // element_bytes) * element_bytes


def payload_goodput_gbps(payload_bytes: int, ip_packet: int, link_gbps: float) -> float:
    """Gb/s of *payload_bytes* per packet when every packet is an *ip_packet*-byte IP packet.

    Example (design notes 2.3): 8192 B of f32 in a 9000 B IP packet at 100G -> 90.6 Gb/s.
    """
    frame = ip_packet + ETH_HEADER_BYTES + FCS_BYTES
    return payload_bytes * 8.0 * packets_per_second(frame, link_gbps) / 1e9


def beats(nbytes: int, bus_bytes: int) -> int:
    """Clock beats a bus *bus_bytes* wide needs for *nbytes* (at least one)."""
    return max(1, math.ceil(nbytes / bus_bytes))


def roce_frame_bytes(data_bytes: int, extra_header_bytes: int = 0) -> int:
    """L2 frame of one RoCEv2 packet: Eth/IP/UDP + BTH + extra (RETH/AETH) + data + ICRC + FCS."""
    udp_payload = ROCE_BTH_BYTES + extra_header_bytes + data_bytes + ROCE_ICRC_BYTES
    return frame_bytes(udp_payload)
