"""Issue 15: without loss, a collective moves only on packets, never on a timer.

The in-memory fabric's clock is frozen at 0 here (``step`` only, never ``advance``): the BUSY
backoff, the RTO, repair and DONE re-sends can never fire, so a collective that completes
completed on packets alone. Hosts start in every order and with gaps between them (start
skew), which used to leave chains refused BUSY until a backoff timer and DONEs unanswered
until an RTO.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import ADMIN_KEY, RKEY, make_cluster
from reference import all_reduce_reference
from test_collectives import hosts

from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Opcode, ReduceOp, Status
from netdam.protocol.packet import Packet, decode_packet, encode_packet
from netdam.protocol.payloads import (
    NO_PHASE_US,
    Algo,
    CollectiveDescriptor,
    CompletionPhases,
    pack_completion,
    pack_completion_phases,
    unpack_completion,
    unpack_completion_phases,
)

IN, OUT = 0, 1 << 18
GROUP = ("239.77.0.9", 7745)


def _start_packet(
    rank: int, n: int, count: int, endpoints: list[tuple[str, int]], multicast: bool
) -> bytes:
    desc = CollectiveDescriptor(
        Algo.ALL_REDUCE,
        rank,
        count,
        IN,
        OUT,
        RKEY,
        group=GROUP if multicast else None,
        timeout_ms=30_000,
    )
    return encode_packet(
        Packet(
            Opcode.START_COLL,
            rkey=ADMIN_KEY,
            client_id=60 + rank,
            txn_id=1,
            coll_id=5,
            epoch=1,
            dtype=DType.F32,
            reduce_op=ReduceOp.SUM,
            segments=tuple(endpoints),
            payload=desc.encode(),
            length=64,
        )
    )


def run_frozen(
    n: int, order: tuple[int, ...], gap_steps: int, count: int, multicast: bool
) -> dict[str, object]:
    """Start ranks in *order*, *gap_steps* fabric rounds apart; step with the clock frozen."""
    cluster = make_cluster(n, memory=1 << 20)
    rng = np.random.default_rng(n * 100 + gap_steps)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    for node, data in zip(cluster.nodes, inputs, strict=True):
        node.memory[IN : IN + data.nbytes] = data.view(np.uint8)
    if multicast:
        for endpoint in cluster.endpoints:
            cluster.fabric.join(GROUP, endpoint)
    for host in hosts(n):
        cluster.fabric.add_endpoint(host)
    pending = list(order)
    finals: dict[int, Packet] = {}
    for round_ in range(5_000):
        if pending and round_ % max(gap_steps, 1) == 0:
            rank = pending.pop(0)
            cluster.fabric.send(
                hosts(n)[rank],
                cluster.endpoints[rank],
                _start_packet(rank, n, count, cluster.endpoints, multicast),
            )
        cluster.fabric.step()
        for rank, host in enumerate(hosts(n)):
            for data, _ in cluster.fabric.receive(host):
                reply = decode_packet(data)
                if reply.aux_addr == 1:
                    finals[rank] = reply
        if len(finals) == n and not pending:
            break
    assert cluster.fabric.now == 0.0, "the clock moved: this test must only step"
    busy = sum(int(node.counters[C.NACK_BASE + int(Status.BUSY)]) for node in cluster.nodes)
    return {"finals": finals, "cluster": cluster, "inputs": inputs, "busy": busy}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("multicast", [False, True])
def test_every_start_order_completes_without_a_timer(n: int, multicast: bool) -> None:
    count = 3000  # several chunks per block at 4 nodes
    orders = list(itertools.permutations(range(n)))[:6]
    saw_busy = False
    for order in orders:
        for gap in (0, 1, 3, 25):
            out = run_frozen(n, order, gap, count, multicast)
            finals = out["finals"]
            assert isinstance(finals, dict)
            assert sorted(finals) == list(range(n)), (
                f"order {order}, gap {gap}: ranks {sorted(finals)} completed"
            )
            assert all(reply.opcode == Opcode.ACK for reply in finals.values())
            expected = all_reduce_reference(out["inputs"], ReduceOp.SUM)
            for node in out["cluster"].nodes:
                got = node.memory[OUT : OUT + count * 4].view(np.float32)
                assert got.tobytes() == expected.tobytes()
            saw_busy = saw_busy or int(out["busy"]) > 0
    assert saw_busy, "no start skew was exercised: no chain was ever refused BUSY"


def test_the_completion_carries_every_phase_in_order() -> None:
    """SPEC.md 4.1: the completion's phases (here on a fabric whose clock stands still, so every
    phase ends at the start's instant: 0 us, never the 'did not end' value)."""
    out = run_frozen(3, (2, 0, 1), 1, 3000, True)
    for reply in out["finals"].values():
        assert len(reply.payload) == 40
        assert unpack_completion(reply.payload) == (0, 0)  # nothing re-sent, nothing repaired
        phases = unpack_completion_phases(reply.payload)
        assert phases == CompletionPhases(start_ns=0, chains_us=0, chunks_us=0, done_us=0)
        assert reply.payload[36:40] == bytes(4)


def test_completion_phases_pack_and_unpack() -> None:
    phases = CompletionPhases(
        start_ns=123_456_789_012, chains_us=1_000, chunks_us=1_500, done_us=NO_PHASE_US
    )
    data = pack_completion(7, 1) + pack_completion_phases(phases)
    assert data[16:24] == (123_456_789_012).to_bytes(8, "little")
    assert data[24:28] == (1_000).to_bytes(4, "little") and data[32:36] == b"\xff\xff\xff\xff"
    assert unpack_completion_phases(data) == phases
    assert (
        unpack_completion_phases(pack_completion(7, 1)) is None
    )  # a 16-byte completion: no phases
