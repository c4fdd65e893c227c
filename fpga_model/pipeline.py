"""Per-packet stage specifications of a NIC pipeline, shared by the analytic and the DES model.

A stage is described by what one packet costs it, never by what a stream achieves:

- ``latency_s``: time from the packet starting the stage to leaving it;
- ``ii_s`` (initiation interval): time the stage's server is busy before it can start the
  next packet (serialization time, bus beats, memory bandwidth share);
- ``max_inflight``: packets that may be between start and exit at once (memory reads in
  flight); 0 means "as many as the pipeline is deep", ceil(latency / ii), which never
  limits the rate but bounds what a stalled stage can hold. Packets leave in start order;
- ``jitter_s``/``jitter_max_s``: random extra latency (memory refresh, page misses).

The analytic model composes these with closed forms (sum of latencies, slowest stage); the
discrete-event model (des.py) pushes packets through them one event at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import wire
from .params import NetdamParams, NicParams, RoceParams

NETDAM_OPS = ("read", "write", "add", "add-store")
ROCE_OPS = ("read", "write", "add")


@dataclass(frozen=True)
class Stage:
    """What one packet costs one pipeline stage."""

    name: str
    latency_s: float
    ii_s: float
    max_inflight: int = 0
    jitter_s: float = 0.0
    jitter_max_s: float = 0.0
    capacity: int = 32
    clock_hz: float | None = None
    note: str = ""

    @property
    def slots(self) -> int:
        """Packets the stage can hold between start and exit."""
        if self.max_inflight > 0:
            return self.max_inflight
        if self.ii_s <= 0:
            return 1
        return max(1, math.ceil(self.latency_s / self.ii_s - 1e-9))


@dataclass(frozen=True)
class PacketShape:
    """Sizes of the packet entering the node and of the packet it sends back or forward."""

    op: str
    data_bytes: int
    request_udp_bytes: int
    response_udp_bytes: int

    @property
    def request_frame_bytes(self) -> int:
        return wire.frame_bytes(self.request_udp_bytes)

    @property
    def response_frame_bytes(self) -> int:
        return wire.frame_bytes(self.response_udp_bytes)


def netdam_shape(op: str, data_bytes: int, sr_segments: int = 0) -> PacketShape:
    """Packet sizes of one NetDAM instruction moving *data_bytes* of data (protocol/SPEC.md).

    READ: a header-only request, READ_RESP = header + data. WRITE: header + SR + data in,
    a header-only ACK back. ADD (chain hop): the packet is forwarded at the same size.
    ADD-STORE (last hop): adds, stores, and answers with a header-only ACK.
    """
    hdr = wire.netdam_udp_payload(0, sr_segments)
    full = wire.netdam_udp_payload(data_bytes, sr_segments)
    ack = wire.NETDAM_HEADER_BYTES
    shapes = {
        "read": (hdr, wire.NETDAM_HEADER_BYTES + data_bytes),
        "write": (full, ack),
        "add": (full, full),
        "add-store": (full, ack),
    }
    if op not in shapes:
        raise ValueError(f"unknown NetDAM op {op!r}; choose one of {', '.join(NETDAM_OPS)}")
    req, resp = shapes[op]
    return PacketShape(op, data_bytes, req, resp)


def roce_shape(op: str, data_bytes: int) -> PacketShape:
    """Packet sizes of one single-packet RoCEv2 operation at the responder (design notes 2.3)."""
    bth = wire.ROCE_BTH_BYTES + wire.ROCE_ICRC_BYTES
    shapes = {
        "read": (bth + wire.ROCE_RETH_BYTES, bth + wire.ROCE_AETH_BYTES + data_bytes),
        "write": (bth + wire.ROCE_RETH_BYTES + data_bytes, bth + wire.ROCE_AETH_BYTES),
        # A ring step: the chunk arrives as a SEND, is reduced by the CPU and sent on.
        "add": (bth + data_bytes, bth + data_bytes),
    }
    if op not in shapes:
        raise ValueError(f"unknown RoCE op {op!r}; choose one of {', '.join(ROCE_OPS)}")
    req, resp = shapes[op]
    return PacketShape(op, data_bytes, req, resp)


def _wire_stage(name: str, udp_bytes: int, link_gbps: float, capacity: int) -> Stage:
    line = wire.wire_bytes(wire.frame_bytes(udp_bytes))
    t = wire.serialization_seconds(line, link_gbps)
    return Stage(name, t, t, capacity=capacity, note=f"{line} B on the wire at {link_gbps:g} Gb/s")


def netdam_stages(p: NetdamParams, shape: PacketShape, dtype_bytes: int = 4) -> list[Stage]:
    """Stages one NetDAM instruction goes through, first bit in to last bit out."""
    clk = p.clock_hz
    cap = p.rx_buffer_packets
    n = shape.data_bytes
    # The MAC strips the FCS on receive (PG203 ctl_rx_delete_fcs); the user bus sees the rest.
    req_bus = shape.request_frame_bytes - wire.FCS_BYTES
    resp_bus = shape.response_frame_bytes - wire.FCS_BYTES
    mem_bw = p.mem_bytes_per_s
    stream = wire.beats(n, p.bus_bytes) / clk if n else 0.0
    access = max(n, p.mem_access_bytes)
    stages = [
        _wire_stage("wire_in", shape.request_udp_bytes, p.link_gbps, cap),
        Stage(
            "mac_phy_rx",
            p.mac_phy_rx_s,
            wire.beats(req_bus, p.mac_bus_bytes) / p.mac_clock_hz,
            capacity=cap,
            clock_hz=p.mac_clock_hz,
            note="GT + RS-FEC + PCS/MAC receive",
        ),
        Stage(
            "parse",
            p.parse_cycles / clk,
            wire.beats(req_bus, p.bus_bytes) / clk,
            capacity=cap,
            clock_hz=clk,
            note="clock crossing, header parse, bounds/key check",
        ),
    ]
    reads = shape.op in ("read", "add", "add-store")
    stores = shape.op in ("write", "add-store")
    if reads or stores:
        # One memory port serves the packet's reads and stores: its bandwidth share counts both.
        traffic = access * (int(reads) + int(stores))
        latency = p.mem_latency_s + stream if reads else 0.0
        stages.append(
            Stage(
                "memory",
                latency,
                traffic / mem_bw,
                max_inflight=p.mem_max_outstanding,
                jitter_s=p.mem_jitter_s if reads else 0.0,
                jitter_max_s=p.mem_jitter_max_s if reads else 0.0,
                capacity=cap,
                clock_hz=clk,
                note=f"{p.mem_kind} read of {n} B" if reads else f"{p.mem_kind} write bandwidth",
            )
        )
    if shape.op in ("add", "add-store"):
        lanes_bytes = p.bus_bytes  # SIMD adders as wide as the datapath (16 f32 at 512 bit)
        stages.append(
            Stage(
                "alu",
                p.alu_latency_cycles / clk,
                wire.beats(n, lanes_bytes) / clk,
                capacity=cap,
                clock_hz=clk,
                note=f"{p.bus_bytes // dtype_bytes} lanes, adder latency "
                f"{p.alu_latency_cycles} cycles",
            )
        )
    if stores:
        stages.append(
            Stage(
                "store",
                stream + p.mem_latency_s,
                stream if stream else 1.0 / clk,
                max_inflight=p.mem_max_outstanding,
                capacity=cap,
                clock_hz=clk,
                note="write to memory, ACK after the write response",
            )
        )
    stages += [
        Stage(
            "reply",
            p.reply_cycles / clk,
            wire.beats(resp_bus, p.bus_bytes) / clk,
            capacity=cap,
            clock_hz=clk,
            note="header rewrite, checksum, clock crossing",
        ),
        Stage(
            "mac_phy_tx",
            p.mac_phy_tx_s,
            wire.beats(resp_bus, p.mac_bus_bytes) / p.mac_clock_hz,
            capacity=cap,
            clock_hz=p.mac_clock_hz,
            note="PCS/MAC + RS-FEC + GT transmit",
        ),
        _wire_stage("wire_out", shape.response_udp_bytes, p.link_gbps, cap),
    ]
    return stages


def roce_stages(p: RoceParams, shape: PacketShape) -> list[Stage]:
    """Stages one RoCE operation goes through at the responding host, wire to wire."""
    cap = p.rx_buffer_packets
    n = shape.data_bytes
    nic_ii = 1.0 / (p.nic_max_mpps * 1e6)
    pcie_ii = max(n, 16) / p.pcie_bytes_per_s
    stages = [
        _wire_stage("wire_in", shape.request_udp_bytes, p.link_gbps, cap),
        Stage(
            "mac_phy_rx",
            p.nic_side_s,
            nic_ii,
            capacity=cap,
            note="ConnectX MAC/PHY + RX pipeline (fitted lump)",
        ),
    ]
    if shape.op == "read":
        stages.append(
            Stage(
                "memory",
                p.pcie_read_s(n),
                pcie_ii,
                max_inflight=p.pcie_max_outstanding,
                capacity=cap,
                note=f"PCIe Gen{p.pcie_gen} DMA read of {n} B from host memory",
            )
        )
    elif shape.op == "write":
        stages.append(
            Stage(
                "store",
                p.pcie_half_rtt_s + pcie_ii,
                pcie_ii,
                capacity=cap,
                note=f"PCIe Gen{p.pcie_gen} posted DMA write into host memory",
            )
        )
    else:  # add: DMA in, one core reduces, DMA back out (a host ring step)
        stages += [
            Stage(
                "store",
                p.pcie_half_rtt_s + pcie_ii,
                pcie_ii,
                capacity=cap,
                note="DMA write of the received chunk",
            ),
            Stage(
                "alu",
                n / p.cpu_reduce_bytes_per_s + p.pcie_half_rtt_s,
                n / p.cpu_reduce_bytes_per_s,
                capacity=cap,
                note="one core reduces the chunk (completion seen by polling)",
            ),
            Stage(
                "memory",
                p.pcie_half_rtt_s + p.pcie_read_s(n),
                pcie_ii,
                max_inflight=p.pcie_max_outstanding,
                capacity=cap,
                note="doorbell, then DMA read of the result to send it on",
            ),
        ]
    stages += [
        Stage(
            "reply",
            p.nic_side_s,
            nic_ii,
            capacity=cap,
            note="ConnectX TX pipeline + MAC/PHY (fitted lump)",
        ),
        _wire_stage("wire_out", shape.response_udp_bytes, p.link_gbps, cap),
    ]
    return stages


def stages_for(
    p: NicParams, op: str, data_bytes: int, sr_segments: int = 0, dtype_bytes: int = 4
) -> list[Stage]:
    """Stages for *op* on either kind of system."""
    if isinstance(p, NetdamParams):
        return netdam_stages(p, netdam_shape(op, data_bytes, sr_segments), dtype_bytes)
    return roce_stages(p, roce_shape(op, data_bytes))


def shape_for(p: NicParams, op: str, data_bytes: int, sr_segments: int = 0) -> PacketShape:
    """Packet shape of *op* on either kind of system."""
    if isinstance(p, NetdamParams):
        return netdam_shape(op, data_bytes, sr_segments)
    return roce_shape(op, data_bytes)
