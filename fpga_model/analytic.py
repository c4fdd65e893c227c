"""Analytical model: closed-form latency and throughput of the stage pipeline (pipeline.py).

- Latency of an uncontended packet = sum of stage latencies (first bit in to last bit out).
- Throughput = the slowest stage, where a stage sustains min(1 / ii, max_inflight / latency)
  packets per second (Little's law for the pipelined stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import wire
from .params import NetdamParams, NicParams, RoceParams
from .pipeline import PacketShape, Stage, netdam_stages, roce_stages, shape_for, stages_for


def stage_rate_pps(stage: Stage) -> float:
    """Packets per second one stage sustains on its own."""
    rate = 1.0 / stage.ii_s if stage.ii_s > 0 else float("inf")
    if stage.latency_s > 0:
        rate = min(rate, stage.slots / stage.latency_s)
    return rate


def pipeline_latency_s(stages: list[Stage]) -> float:
    """Latency of one packet through an empty pipeline."""
    return sum(s.latency_s for s in stages)


def pipeline_rate(stages: list[Stage]) -> tuple[float, str]:
    """(packets per second, name of the bottleneck stage) of a saturated pipeline."""
    slowest = min(stages, key=stage_rate_pps)
    return stage_rate_pps(slowest), slowest.name


@dataclass(frozen=True)
class OpBreakdown:
    """Latency of one instruction, stage by stage."""

    system: str
    params_name: str
    shape: PacketShape
    stages: tuple[Stage, ...]

    @property
    def seconds(self) -> float:
        return pipeline_latency_s(list(self.stages))

    def as_dict(self) -> dict[str, object]:
        """JSON-ready description (seconds everywhere, cycles beside their clock)."""
        return {
            "system": self.system,
            "params": self.params_name,
            "op": self.shape.op,
            "bytes": self.shape.data_bytes,
            "seconds": self.seconds,
            "request_frame_bytes": self.shape.request_frame_bytes,
            "response_frame_bytes": self.shape.response_frame_bytes,
            "breakdown": {s.name: s.latency_s for s in self.stages},
            "stages": [
                {
                    "name": s.name,
                    "seconds": s.latency_s,
                    "cycles": None if s.clock_hz is None else round(s.latency_s * s.clock_hz, 2),
                    "clock_hz": s.clock_hz,
                    "note": s.note,
                }
                for s in self.stages
            ],
        }


def op_breakdown(
    p: NicParams, op: str, data_bytes: int, sr_segments: int = 0, dtype_bytes: int = 4
) -> OpBreakdown:
    """Latency breakdown of one instruction moving *data_bytes* (one packet)."""
    limit = (
        wire.max_data_bytes(p.mtu, sr_segments) if isinstance(p, NetdamParams) else p.roce_mtu_bytes
    )
    if data_bytes < 0 or data_bytes > limit:
        raise ValueError(f"one {p.kind} packet carries 0..{limit} data bytes, got {data_bytes}")
    return OpBreakdown(
        p.kind,
        p.name,
        shape_for(p, op, data_bytes, sr_segments),
        tuple(stages_for(p, op, data_bytes, sr_segments, dtype_bytes)),
    )


@dataclass(frozen=True)
class LineRate:
    """Throughput of a stream of equal packets through one node."""

    link_gbps: float
    op: str
    udp_payload_bytes: int
    frame_bytes: int
    wire_bytes: int
    data_bytes: int
    pps: float
    bottleneck: str
    stage_mpps: dict[str, float]

    @property
    def goodput_gbps(self) -> float:
        """UDP payload bits per second of the data-carrying direction, in 10^9 bit/s."""
        return self.udp_payload_bytes * 8.0 * self.pps / 1e9

    @property
    def data_gbps(self) -> float:
        """Bits per second of instruction data (after the NetDAM header), in 10^9 bit/s."""
        return self.data_bytes * 8.0 * self.pps / 1e9

    def as_dict(self) -> dict[str, object]:
        return {
            "link_gbps": self.link_gbps,
            "op": self.op,
            "udp_payload_bytes": self.udp_payload_bytes,
            "frame_bytes": self.frame_bytes,
            "wire_bytes": self.wire_bytes,
            "data_bytes": self.data_bytes,
            "mpps": self.pps / 1e6,
            "goodput_gbps": self.goodput_gbps,
            "data_gbps": self.data_gbps,
            "bottleneck": self.bottleneck,
            "stage_mpps": self.stage_mpps,
        }


def data_bytes_for_payload(p: NicParams, udp_payload: int, dtype_bytes: int = 4) -> int:
    """Whole elements of data a packet of *udp_payload* UDP bytes carries after its headers."""
    header = (
        wire.NETDAM_HEADER_BYTES
        if isinstance(p, NetdamParams)
        else wire.ROCE_BTH_BYTES + wire.ROCE_ICRC_BYTES
    )
    cap = wire.MAX_NETDAM_PAYLOAD_BYTES if isinstance(p, NetdamParams) else p.roce_mtu_bytes
    room = min(max(0, udp_payload - header), cap)
    return (room // dtype_bytes) * dtype_bytes


def line_rate_shape(
    p: NicParams, udp_payload: int, op: str = "add", dtype_bytes: int = 4
) -> PacketShape:
    """Packet sizes of a stream whose data-carrying packets have *udp_payload* UDP bytes.

    *udp_payload* sizes the request for add/write and the response for read; the other
    direction is a header-only packet. Packets too small for a NetDAM header are the
    "signal" packets of B11 (64 B frames): the answer is as small, and the memory sees one
    minimum access.
    """
    data = data_bytes_for_payload(p, udp_payload, dtype_bytes)
    header = (
        wire.NETDAM_HEADER_BYTES
        if isinstance(p, NetdamParams)
        else wire.ROCE_BTH_BYTES + wire.ROCE_ICRC_BYTES + wire.ROCE_AETH_BYTES
    )
    small = min(header, udp_payload)
    sizes = {
        "add": (udp_payload, udp_payload),
        "add-store": (udp_payload, small),
        "write": (udp_payload, small),
        "read": (small, udp_payload),
    }
    if op not in sizes:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(sizes)}")
    req, resp = sizes[op]
    return PacketShape(op, data, req, resp)


def line_rate_stages(
    p: NicParams, udp_payload: int, op: str = "add", dtype_bytes: int = 4
) -> list[Stage]:
    """Stages a stream of *udp_payload*-byte packets goes through (see line_rate_shape)."""
    shape = line_rate_shape(p, udp_payload, op, dtype_bytes)
    if isinstance(p, NetdamParams):
        return netdam_stages(p, shape, dtype_bytes)
    return roce_stages(p, shape)


def line_rate(p: NicParams, udp_payload: int, op: str = "add", dtype_bytes: int = 4) -> LineRate:
    """Packets/s and goodput of a saturated stream of *udp_payload*-byte packets."""
    if udp_payload < 0 or udp_payload > p.mtu - wire.IP_UDP_BYTES:
        raise ValueError(
            f"UDP payload must be 0..{p.mtu - wire.IP_UDP_BYTES} B at MTU {p.mtu}, got "
            f"{udp_payload} (raise --mtu for bigger packets)"
        )
    if isinstance(p, RoceParams):
        biggest = (
            p.roce_mtu_bytes + wire.ROCE_BTH_BYTES + wire.ROCE_RETH_BYTES + wire.ROCE_ICRC_BYTES
        )
        if udp_payload > biggest:
            raise ValueError(
                f"a RoCE packet carries at most {biggest} UDP bytes (path MTU "
                f"{p.roce_mtu_bytes} B), got {udp_payload}"
            )
    stages = line_rate_stages(p, udp_payload, op, dtype_bytes)
    data = data_bytes_for_payload(p, udp_payload, dtype_bytes)
    pps, bottleneck = pipeline_rate(stages)
    frame = wire.frame_bytes(udp_payload)
    return LineRate(
        link_gbps=p.link_gbps,
        op=op,
        udp_payload_bytes=udp_payload,
        frame_bytes=frame,
        wire_bytes=wire.wire_bytes(frame),
        data_bytes=data,
        pps=pps,
        bottleneck=bottleneck,
        stage_mpps={s.name: stage_rate_pps(s) / 1e6 for s in stages},
    )


def fit_netdam_mem_latency(
    p: NetdamParams, target_s: float = 618e-9, data_bytes: int = 128
) -> float:
    """Memory latency that makes a READ of *data_bytes* take *target_s* wire to wire.

    This is how ``mem_latency_s`` of the DRAM presets was fitted to the authors' 618 ns
    READ of 32 f32 (B9); every other stage stays as sourced/assumed.
    """
    others = op_breakdown(p, "read", data_bytes).seconds - p.mem_latency_s
    return target_s - others


def roce_one_way_s(p: RoceParams, data_bytes: int = 32, switched: bool = False) -> float:
    """One-way latency of a small RDMA WRITE/SEND, host memory to host memory.

    Doorbell over PCIe (half a DMA round trip), sender NIC side, wire, receiver NIC side,
    DMA write into host memory (another half round trip); plus cable and optional switch.
    """
    frame = wire.roce_frame_bytes(data_bytes, wire.ROCE_RETH_BYTES)
    t = 2 * p.pcie_half_rtt_s + 2 * p.nic_side_s + p.propagation_s
    t += wire.serialization_seconds(wire.wire_bytes(frame), p.link_gbps)
    return t + (p.switch_latency_s if switched else 0.0)


def fit_roce_nic_side(p: RoceParams, one_way_s: float = 0.82e-6, data_bytes: int = 32) -> float:
    """NIC-side latency that makes the small-message one-way latency *one_way_s*.

    How ``nic_side_s`` of the RoCE presets was fitted: IB verbs one-way latency of 32 B on
    ConnectX-4, ~0.82 us (BRIEF section 4, "published thesis tables"), back to back.
    """
    rest = roce_one_way_s(p, data_bytes) - 2 * p.nic_side_s
    return (one_way_s - rest) / 2.0


def describe_system(p: NicParams) -> str:
    """One line naming the system a parameter set describes."""
    if isinstance(p, RoceParams):
        return f"RoCE host {p.name}: {p.link_gbps:g} Gb/s, PCIe Gen{p.pcie_gen} x16"
    return (
        f"NetDAM {p.name}: {p.link_gbps:g} Gb/s, {p.bus_bytes * 8}-bit @ "
        f"{p.clock_hz / 1e6:g} MHz, {p.mem_kind}"
    )


def fit_roce_sw_message(
    p: RoceParams, mpi_one_way_s: float = 1.67e-6, data_bytes: int = 1
) -> float:
    """Software per message that makes an MPI one-way latency of *mpi_one_way_s*.

    How ``sw_message_s`` of the RoCE presets was fitted: ``osu_latency`` of 1 B between two
    hosts (one rank each) on a 100 Gb/s RoCE v2 cluster network, Open MPI 5.0.8 over UCX,
    1.67 us (OCI HPC tutorials, "OSU Micro-Benchmarks: BM.Optimized3.36"): the MPI latency
    less the verbs one-way latency through one switch that the rest of the model gives.
    """
    return mpi_one_way_s - roce_one_way_s(p, data_bytes, switched=True)
