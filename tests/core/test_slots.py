"""Several collectives in one NIC at once (SPEC.md 4.1): each in a slot of its own, each exact
against numpy and bitwise identical on every rank, under loss, duplication and reordering; one
collective more than the slots is answered NACK BUSY and runs once a slot is free (a status,
never a hang). Run on the in-process fabric (netdam.core.fabric): seeded and replayable."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from helpers import ADMIN_KEY, RKEY, Cluster, make_cluster
from reference import all_reduce_reference

from netdam.core.faults import FaultSpec
from netdam.kernels import collective as L
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Opcode, ReduceOp, Status
from netdam.protocol.packet import Packet, decode_packet, encode_packet
from netdam.protocol.payloads import Algo, CollectiveDescriptor

MEMORY = 1 << 20
COUNT = 6_001  # elements per collective: ~4 chunks per block on 4 nodes


@dataclass
class Call:
    """One collective of the test: its group, buffers and what its hosts heard."""

    coll_id: int
    inputs: list[np.ndarray]
    in_addr: int
    out_addr: int
    tag_key: bytes
    op: ReduceOp = ReduceOp.SUM
    busy: int = 0  # NACK BUSY answers to its START_COLLs

    def start(self, cluster: Cluster, rank: int) -> bytes:
        desc = CollectiveDescriptor(
            Algo.ALL_REDUCE,
            rank,
            COUNT,
            self.in_addr,
            self.out_addr,
            RKEY,
            timeout_ms=30_000,
            tag_key=self.tag_key,
        )
        return encode_packet(
            Packet(
                Opcode.START_COLL,
                rkey=ADMIN_KEY,
                client_id=70 + rank,
                txn_id=self.coll_id,
                coll_id=self.coll_id,
                epoch=1,
                dtype=DType.F32,
                reduce_op=self.op,
                segments=tuple(cluster.endpoints),
            ).with_payload(desc.encode())
        )


def calls_of(rng: np.random.Generator, n: int, k: int) -> list[Call]:
    """*k* collectives over the same *n* nodes, each with its own buffers, key and operator."""
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.SUM, ReduceOp.SUM]
    span = COUNT * 4
    return [
        Call(
            coll_id=100 + j,
            inputs=[rng.standard_normal(COUNT).astype(np.float32) for _ in range(n)],
            in_addr=2 * j * span,
            out_addr=(2 * j + 1) * span,
            tag_key=bytes([j + 1] * 16),
            op=ops[j % len(ops)],
        )
        for j in range(k)
    ]


def run_together(n: int, calls: list[Call], faults: FaultSpec | None) -> Cluster:
    """Stage every call's inputs, send every START_COLL at once (each host re-sends until it
    hears the completion, as netdam.api does on BUSY), run the fabric until every host heard."""
    cluster = make_cluster(n, faults, memory=MEMORY)
    hosts = {(j, r): ("127.0.0.1", 9300 + 10 * j + r) for j in range(len(calls)) for r in range(n)}
    for (j, r), host in hosts.items():
        cluster.fabric.add_endpoint(host)
        data = calls[j].inputs[r]
        cluster.nodes[r].memory[calls[j].in_addr : calls[j].in_addr + data.nbytes] = data.view(
            np.uint8
        )
    starts = {key: calls[key[0]].start(cluster, key[1]) for key in hosts}
    finals: dict[tuple[int, int], Packet] = {}
    for round_ in range(60_000):
        if round_ % 100 == 0:
            for key, host in hosts.items():
                if key not in finals:
                    cluster.fabric.send(host, cluster.endpoints[key[1]], starts[key])
        if cluster.fabric.step() == 0:
            cluster.fabric.advance(0.005)
        for key, host in hosts.items():
            for data, _ in cluster.fabric.receive(host):
                reply = decode_packet(data)
                if reply.opcode == Opcode.NACK and reply.status == Status.BUSY:
                    calls[key[0]].busy += 1
                elif reply.aux_addr == 1:
                    finals.setdefault(key, reply)
        if len(finals) == len(hosts):
            break
    assert len(finals) == len(hosts), (
        f"hosts without completion: {sorted(set(hosts) - set(finals))}"
    )
    failed = {key: reply.status for key, reply in finals.items() if reply.opcode != Opcode.ACK}
    assert not failed, f"collectives failed: {failed}"
    cluster.fabric.run_until_idle()
    return cluster


def assert_exact(cluster: Cluster, calls: list[Call]) -> None:
    for call in calls:
        expected = all_reduce_reference(call.inputs, call.op).tobytes()
        for rank, node in enumerate(cluster.nodes):
            got = node.memory[call.out_addr : call.out_addr + COUNT * 4].tobytes()
            assert got == expected, f"coll_id {call.coll_id} rank {rank}"


@pytest.mark.parametrize("loss", [0.0, 0.1, 0.3])
def test_collectives_of_every_slot_run_together_exact(loss: float) -> None:
    calls = calls_of(np.random.default_rng(25), 4, L.MAX_COLLECTIVES)
    faults = FaultSpec(seed=11, loss=loss, dup=loss / 2, reorder=loss / 2) if loss else None
    cluster = run_together(4, calls, faults)
    assert_exact(cluster, calls)
    assert [c.busy for c in calls] == [0] * len(calls)  # each had a slot at once
    # They ran side by side: every node held all of them, one slot each.
    for node in cluster.nodes:
        held = sorted(int(node.collective.cfg[s, L.CFG_COLL]) for s in range(L.MAX_COLLECTIVES))
        assert held == [c.coll_id for c in calls]


def test_one_collective_more_than_the_slots_gets_busy_then_runs() -> None:
    calls = calls_of(np.random.default_rng(26), 3, L.MAX_COLLECTIVES + 1)
    cluster = run_together(3, calls, FaultSpec(seed=12, loss=0.1))
    assert_exact(cluster, calls)
    assert calls[-1].busy > 0, "the collective past the slots was never answered BUSY"
    assert all(c.busy == 0 for c in calls[:-1])


def test_a_slot_keeps_its_group_and_late_packets_of_another_change_nothing() -> None:
    """Two collectives ended in their slots: a datagram of a collective no slot holds is answered
    BUSY (not started here), and an untagged one under a tagged collective's coll_id is dropped
    as forged: no slot's memory or state moves."""
    rng = np.random.default_rng(27)
    calls = calls_of(rng, 2, 2)
    cluster = run_together(2, calls, None)
    assert_exact(cluster, calls)
    node = cluster.nodes[0]
    slots_before = node.collective.cfg.copy()
    memory_before = node.memory.copy()
    # A CHAIN_ADD of a collective nobody started (its own key), from a member: BUSY, nothing
    # written. (Under RKEY it would be dropped as forged: the tagged collectives name RKEY.)
    busy_before = int(node.counters[C.NACK_BASE + Status.BUSY])
    stranger = Packet(
        Opcode.CHAIN_ADD,
        rkey=0x5151,
        coll_id=999,
        epoch=1,
        seq=0,
        addr=0,
        aux_addr=0,
        dtype=DType.F32,
        reduce_op=ReduceOp.SUM,
        segments=tuple(cluster.endpoints[::-1]),
    ).with_payload(np.ones(8, np.float32).tobytes())
    cluster.fabric.send(cluster.endpoints[1], cluster.endpoints[0], encode_packet(stranger))
    # Untagged, under a tagged collective's coll_id and epoch, from a member: forged, dropped.
    dropped_before = int(node.counters[C.DROP_COLL_FORGED])
    forged = replace(stranger, coll_id=calls[1].coll_id, rkey=RKEY)
    cluster.fabric.send(cluster.endpoints[1], cluster.endpoints[0], encode_packet(forged))
    cluster.fabric.run_until_idle()
    assert int(node.counters[C.NACK_BASE + Status.BUSY]) == busy_before + 1
    assert int(node.counters[C.DROP_COLL_FORGED]) == dropped_before + 1
    np.testing.assert_array_equal(node.memory, memory_before)
    state_words = [L.CFG_STATE, L.CFG_COLL, L.CFG_EPOCH, L.CFG_DONE_COUNT, L.CFG_ACKED]
    np.testing.assert_array_equal(node.collective.cfg[:, state_words], slots_before[:, state_words])
