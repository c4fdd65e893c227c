"""Fused reduce and update at its edges (SPEC.md 4.1, 6.5), on the in-memory fabric: what a
START_COLL with descriptor flags bit 1 must name before anything starts, and that a chain
ending at the block's owner must be exactly the chunk the plan puts there, whoever sends it.
Every refusal leaves the masters and the step table as they were."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ADMIN_KEY, RKEY, Cluster, make_cluster

from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Opcode, ReduceOp, Status
from netdam.protocol.optim import SgdRule, descriptor_for
from netdam.protocol.packet import Packet, decode_packet, encode_packet
from netdam.protocol.payloads import FLAG_SPARSE, FLAG_UPDATE, Algo, CollectiveDescriptor

IN = 0
DESC = 0xC0000
HOST = ("127.0.0.1", 9100)
COUNT = 100  # two ranks: each owns a block of 50


def _cluster(block: int = COUNT // 2) -> Cluster:
    cluster = make_cluster(2)
    for node in cluster.nodes:
        d = descriptor_for(SgdRule(lr=0.5, momentum=0.9), block, 64, 128)
        node.memory[DESC : DESC + 96] = np.frombuffer(d.encode(), np.uint8)
        node.memory[DESC + 128 : DESC + 128 + 4 * block] = np.arange(block, dtype="<f4").view(
            np.uint8
        )
    cluster.fabric.add_endpoint(HOST)
    return cluster


def _state(cluster: Cluster) -> bytes:
    return cluster.nodes[0].memory[DESC : DESC + 128 + 16 * COUNT].tobytes()


def _start(cluster: Cluster, flags: int = FLAG_UPDATE, **kw: object) -> Packet:
    fields: dict[str, object] = dict(
        rkey=ADMIN_KEY,
        coll_id=3,
        epoch=1,
        dtype=DType.F32,
        segments=tuple(cluster.endpoints),
        addr=DESC,
        aux_addr=1,
    )
    fields.update(kw)
    desc = CollectiveDescriptor(Algo.ALL_REDUCE, 0, COUNT, IN, IN, RKEY, flags=flags)
    packet = Packet(Opcode.START_COLL, **fields).with_payload(desc.encode())  # type: ignore[arg-type]
    cluster.fabric.send(HOST, cluster.endpoints[0], encode_packet(packet))
    _steps(cluster)
    (reply,) = [decode_packet(d) for d, _ in cluster.fabric.receive(HOST)]
    return reply


def _steps(cluster: Cluster) -> None:
    """A few rounds of the fabric: a started collective's chains then wait on a peer whose host
    never starts it (BUSY), so the fabric is never idle."""
    for _ in range(4):
        cluster.fabric.step()


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"rkey": 1}, Status.UNAUTHORIZED),  # only the admin starts collectives, fused or not
        ({"flags": FLAG_UPDATE | FLAG_SPARSE}, Status.BAD_FIELD),  # sparse skips chunks
        ({"reduce_op": ReduceOp.MAX}, Status.BAD_FIELD),
        ({"dtype": DType.I32}, Status.BAD_DTYPE),
        ({"aux_addr": 0}, Status.BAD_FIELD),  # steps count from 1
        ({"aux_addr": 1 << 32}, Status.BAD_FIELD),
        ({"aux_addr": 2}, Status.OUT_OF_STEP),  # the NIC is at step 0
        ({"addr": (1 << 20) - 64}, Status.OUT_OF_BOUNDS),  # past the region
        ({"addr": DESC + 4}, Status.MISALIGNED),
        ({"addr": DESC + 128}, Status.BAD_FIELD),  # the masters are no descriptor
    ],
)
def test_a_fused_start_names_a_block_it_can_step(fields: dict[str, object], status: Status) -> None:
    cluster = _cluster()
    before = _state(cluster)
    reply = _start(cluster, **fields)
    assert (reply.opcode, reply.status) == (Opcode.NACK, status)
    assert _state(cluster) == before


def test_a_descriptor_of_another_size_than_the_block_is_refused() -> None:
    cluster = _cluster(block=COUNT)  # the whole model: not rank 0's block of two
    before = _state(cluster)
    assert _start(cluster).status == Status.BAD_FIELD
    assert _state(cluster) == before


def test_a_started_fused_call_sets_the_step_and_answers_running() -> None:
    cluster = _cluster()
    reply = _start(cluster)
    assert (reply.opcode, reply.status, reply.aux_addr) == (Opcode.ACK, Status.OK, 0)
    table = cluster.nodes[0].memory[DESC + 128 + 12 * 50 : DESC + 128 + 12 * 50 + 4]
    assert int(table.view("<u4")[0]) == 1  # an UPDATE of step 1 is now a duplicate


def test_a_chain_ending_off_the_plan_is_refused_at_the_owner() -> None:
    """A member's CHAIN_ADD that ends at the owner but names another store address or length
    than chunk 0 of the owner's block would step masters the plan gives to no chunk there: NACK
    BAD_FIELD, nothing stepped, even under the collective's own (untagged, v1) rkey."""
    cluster = _cluster()
    assert _start(cluster).status == Status.OK
    before = _state(cluster)
    member, owner = cluster.endpoints[1], cluster.nodes[0]
    for aux_addr, nbytes in ((IN + 4, 200), (IN, 196), (IN + 200, 200)):
        chain = Packet(
            Opcode.CHAIN_ADD,
            flags=0x1,
            seq=0,
            coll_id=3,
            epoch=1,
            rkey=RKEY,
            addr=IN,
            aux_addr=aux_addr,
            dtype=DType.F32,
        ).with_payload(bytes(nbytes))
        refused = int(owner.counters[C.NACK_BASE + Status.BAD_FIELD])
        cluster.fabric.send(member, cluster.endpoints[0], encode_packet(chain))
        _steps(cluster)
        assert owner.counters[C.NACK_BASE + Status.BAD_FIELD] == refused + 1, (aux_addr, nbytes)
    assert _state(cluster) == before
