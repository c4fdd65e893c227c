"""A trace turned into the replay's deliveries (netdam.tools.replay), on records written by hand:
which datagram a NACK BUSY refused. (Real runs: tests/host/test_trace.py.)"""

from __future__ import annotations

from typing import Any

from netdam.fpga_model.collectives import default_params
from netdam.protocol.constants import Opcode, Status, TraceKind, TracePhase
from netdam.protocol.trace import TRACE_DTYPE
from netdam.tools.replay import replay_trace

ND, _ = default_params(100.0)
COLL, EPOCH = 77, 1
#: Three NICs' endpoints (the conversion only compares them) and the chunk's address.
A, B, C = 1001, 1002, 1003
CHUNK_ADDR, SEQ = 1 << 20, 2


def _trace(rows: dict[int, list[dict[str, int]]]) -> dict[str, Any]:
    """A trace file's ``netdam`` section holding *rows* (endpoint -> records)."""
    nics = []
    for endpoint, records in rows.items():
        columns: dict[str, list[int]] = {name: [] for name in TRACE_DTYPE.names or ()}
        for record in records:
            full = {"coll_id": COLL, "epoch": EPOCH, **record}
            for name in columns:
                columns[name].append(full.get(name, 0))
        nics.append({"endpoint": endpoint, "records": columns})
    return {"traceEvents": [], "netdam": {"nics": nics}}


def _phase(t: int, phase: TracePhase) -> dict[str, int]:
    return {"t_ns": t, "kind": TraceKind.PHASE, "status": phase}


def _hop(t: int, kind: TraceKind, peer: int, seg_left: int) -> dict[str, int]:
    return {
        "t_ns": t,
        "kind": kind,
        "peer": peer,
        "opcode": Opcode.CHAIN_ADD,
        "seq": SEQ,
        "addr": CHUNK_ADDR,
        "seg_count": 2,
        "seg_left": seg_left,
        "length": 8192 + 64,
    }


def _chain_ack(t: int, kind: TraceKind, peer: int) -> dict[str, int]:
    """The chain's ACK, from its last hop to its first (it names the chunk's address)."""
    return {
        "t_ns": t,
        "kind": kind,
        "peer": peer,
        "opcode": Opcode.ACK,
        "seq": SEQ,
        "addr": CHUNK_ADDR,
    }


def test_a_busy_nack_refuses_its_chunk_not_a_member_message_of_the_same_seq() -> None:
    """B has not started when A's chain reaches it, and NACKs it BUSY; before the NACK reaches
    A (milliseconds on a loaded machine), C's RESUME reaches B. A RESUME's seq is its sender's
    rank, here the chunk's seq too. The refusal is the chunk's: its first attempt did nothing
    and the one after it is its first without skew, no re-send (CI once counted one)."""
    nack = {"opcode": Opcode.NACK, "status": Status.BUSY, "seq": SEQ, "addr": CHUNK_ADDR}
    resume = {"opcode": Opcode.ACK, "seq": SEQ, "addr": 0}
    trace = _trace(
        {
            A: [
                _phase(0, TracePhase.START),
                _hop(10_000, TraceKind.TX, B, 1),
                {"t_ns": 900_000, "kind": TraceKind.RX, "peer": B, **nack},
                _hop(1_000_000, TraceKind.TX, B, 1),  # asked again after the NACK
                _chain_ack(1_300_000, TraceKind.RX, C),
                _phase(1_300_001, TracePhase.CHAINS),
                _phase(1_400_000, TracePhase.COMPLETE),
            ],
            B: [
                _hop(20_000, TraceKind.RX, A, 1),  # refused: B has not started
                {"t_ns": 21_000, "kind": TraceKind.TX, "peer": A, **nack},
                {"t_ns": 500_000, "kind": TraceKind.RX, "peer": C, **resume},
                _phase(950_000, TracePhase.START),
                _hop(1_100_000, TraceKind.RX, A, 1),
                _hop(1_100_500, TraceKind.TX, C, 0),
                _phase(1_400_000, TracePhase.COMPLETE),
            ],
            C: [
                _phase(5_000, TracePhase.START),
                {"t_ns": 6_000, "kind": TraceKind.TX, "peer": B, **resume},
                _hop(1_200_000, TraceKind.RX, B, 0),
                _chain_ack(1_200_500, TraceKind.TX, A),
                _phase(1_200_501, TracePhase.CHUNKS),
                _phase(1_400_000, TracePhase.COMPLETE),
            ],
        }
    )
    [call] = replay_trace(trace, ND)
    assert call.no_skew.retries == 0
    assert call.replayed.retries == 1  # with the skew, A did send its chunk twice
    # Without skew: the chunk's two hops, C's ACK back, and the RESUME's answer-less trip gone.
    assert call.no_skew.deliveries == 3
