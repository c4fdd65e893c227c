"""The in-memory fabric and seeded fault injection: replayable, and the window makes retries safe."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import CLIENT, RKEY, make_cluster

from netdam.core.faults import FaultSpec, decide, packet_id
from netdam.protocol.constants import DType, Opcode
from netdam.protocol.packet import Packet, decode_packet, encode_packet


def test_decisions_are_pure_functions_of_their_inputs() -> None:
    spec = FaultSpec(loss=0.3, dup=0.2, reorder=0.2, delay=0.1, delay_s=0.01, seed=5)
    first = [decide(spec, 1, 2, pid, attempt) for pid in range(200) for attempt in range(3)]
    again = [decide(spec, 1, 2, pid, attempt) for pid in range(200) for attempt in range(3)]
    assert first == again
    drops = sum(f.drop for f in first)
    assert 0.2 < drops / len(first) < 0.4  # about the asked rate
    other_seed = [decide(FaultSpec(loss=0.3, seed=6), 1, 2, pid, 0).drop for pid in range(200)]
    assert other_seed != [f.drop for f in first[::3]]


def test_packet_id_ignores_credit_and_flags_but_not_ids() -> None:
    base = encode_packet(Packet(Opcode.READ, txn_id=1, rkey=RKEY, addr=8, length=8))
    retry = bytearray(base)
    retry[3] = 0x10  # RETRY flag
    retry[51] = 200  # credit
    assert packet_id(base) == packet_id(bytes(retry))
    other = encode_packet(Packet(Opcode.READ, txn_id=2, rkey=RKEY, addr=8, length=8))
    assert packet_id(base) != packet_id(other)


def test_fault_spec_validation() -> None:
    with pytest.raises(ValueError, match="--loss must be a probability between 0 and 1, got 1.5"):
        FaultSpec(loss=1.5)


def fetch_add_with_retries(faults: FaultSpec, increments: int) -> tuple[int, int, list[bytes]]:
    """A client that retries each FETCH_ADD (same txn) until answered. Returns (acked, memory, log)."""
    cluster = make_cluster(2, faults)
    acked = 0
    log: list[bytes] = []
    for txn in range(1, increments + 1):
        request = Packet(
            Opcode.FETCH_ADD,
            client_id=7,
            txn_id=txn,
            rkey=RKEY,
            addr=0,
            dtype=DType.U64,
            length=8,
            payload=struct.pack("<Q", 1),
        )
        for _attempt in range(50):
            replies = cluster.request(1, request)
            log += [encode_packet(r) for r in replies]
            if any(r.opcode == Opcode.ACK for r in replies):
                acked += 1
                break
    value = int(cluster.nodes[1].memory[0:8].view(np.uint64)[0])
    return acked, value, log


def test_retries_under_loss_and_dup_never_apply_twice() -> None:
    faults = FaultSpec(loss=0.3, dup=0.3, reorder=0.2, seed=42)
    acked, value, log = fetch_add_with_retries(faults, 200)
    assert acked == 200 and value == 200
    # The same seed replays the same run, packet for packet.
    assert fetch_add_with_retries(faults, 200)[2] == log


def test_multicast_excludes_sender_and_reaches_members() -> None:
    cluster = make_cluster(3)
    group = ("239.77.0.5", 7744)
    for endpoint in cluster.endpoints:
        cluster.fabric.join(group, endpoint)
    cluster.fabric.join(group, CLIENT)
    packet = Packet(Opcode.ALL_WRITE, rkey=RKEY, addr=0, length=4, payload=b"wxyz")
    cluster.fabric.send(cluster.endpoints[0], group, encode_packet(packet))
    cluster.fabric.run_until_idle()
    assert [decode_packet(d).payload for d, _ in cluster.fabric.receive(CLIENT)] == [b"wxyz"]
    assert bytes(cluster.nodes[0].memory[:4]) == b"\0\0\0\0"  # the sender gets no copy
    assert all(bytes(n.memory[:4]) == b"wxyz" for n in cluster.nodes[1:])


def test_delay_moves_the_clock() -> None:
    cluster = make_cluster(1, FaultSpec(delay=1.0, delay_s=0.5, seed=1))
    replies = cluster.request(0, Packet(Opcode.PING))
    assert len(replies) == 1 and cluster.fabric.now == pytest.approx(1.0)  # request and reply
