"""A collective's next epoch started in the datapath (kernels/restart.py, SPEC.md 4.1 "Restart
in the datapath"): the same START_COLL with a new epoch and keys starts without the control
plane, and everything else still goes to it, with the same answers.

Two node cores on the in-memory fabric, the admin's control tag on every START_COLL, as the
host library sends them.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import all_reduce_reference

from netdam.core.fabric import Fabric
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels import collective as L
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Opcode, Rights, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import Algo, CollectiveDescriptor, pack_register
from netdam.protocol.tag import seal_control, verify, verify_control

NODES: tuple[Endpoint, ...] = (("10.0.0.1", 7000), ("10.0.0.2", 7000))
HOST: Endpoint = ("10.0.0.9", 5000)
OTHER_HOST: Endpoint = ("10.0.0.10", 5000)
ADMIN = 0xAD
ADMIN_TAG = bytes(range(100, 116))
COUNT = 1000  # f32: several chunks per block at the default MTU
IN_ADDR, OUT_ADDR = 0, 8192
COLL = 7


def cluster() -> tuple[Fabric, list[NodeCore]]:
    fabric = Fabric()
    cores = []
    for rank, endpoint in enumerate(NODES):
        core = NodeCore(
            NodeConfig(
                endpoint=endpoint,
                memory_bytes=1 << 16,
                admin_key=ADMIN,
                admin_tag_key=ADMIN_TAG,
                members=NODES,
                rank=rank,
                world_size=len(NODES),
            )
        )
        fabric.add_core(endpoint, core)
        cores.append(core)
    for host in (HOST, OTHER_HOST):
        fabric.add_endpoint(host)
    for rank in range(len(NODES)):
        payload = pack_register(0, int(Rights.READ | Rights.WRITE))
        register = Packet(
            Opcode.REGISTER,
            client_id=3,
            txn_id=1,
            addr=0,
            aux_addr=1 << 15,
            length=len(payload),
            payload=payload,
        )
        [reply] = exchange(fabric, rank, seal_control(ADMIN_TAG, encode_packet(register)))
        assert decode_packet(reply).opcode == Opcode.ACK
    return fabric, cores


def exchange(fabric: Fabric, rank: int, data: bytes, src: Endpoint = HOST) -> list[bytes]:
    fabric.send(src, NODES[rank], data)
    fabric.run_until_idle()
    return [d for d, _ in fabric.receive(src)]


def ask(core: NodeCore, data: bytes, src: Endpoint = HOST) -> list[bytes]:
    """One datagram to a core alone (its peer stays quiet), its answers to *src*."""
    core.receive_datagram(data, src, 1.0)
    return [d for d, dst in core.datagrams_to_send(1.0) if dst == src]


def tag_key(epoch: int) -> bytes:
    return bytes((epoch * 31 + k) & 0xFF or 1 for k in range(16))


def start_coll(rank: int, epoch: int, count: int = COUNT, rkey: int = 0) -> bytes:
    descriptor = CollectiveDescriptor(
        Algo.ALL_REDUCE,
        rank,
        count,
        IN_ADDR,
        OUT_ADDR,
        rkey or 0x1000 + epoch,
        tag_key=tag_key(epoch),
    )
    packet = Packet(
        Opcode.START_COLL,
        rkey=ADMIN,
        coll_id=COLL,
        epoch=epoch,
        dtype=DType.F32,
        segments=NODES,
        client_id=3,
        txn_id=100 + epoch,
    ).with_payload(descriptor.encode())
    return seal_control(ADMIN_TAG, encode_packet(packet))


def run_epoch(
    fabric: Fabric, cores: list[NodeCore], epoch: int, count: int = COUNT
) -> list[list[Packet]]:
    """Each rank's input set, its START_COLL sent, the fabric run; every rank's answers (their
    tags checked under the epoch's tag key)."""
    rng = np.random.default_rng(epoch)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in cores]
    for core, x in zip(cores, inputs, strict=True):
        core.memory[IN_ADDR : IN_ADDR + x.nbytes] = x.view(np.uint8)
    for rank in range(len(cores)):
        fabric.send(HOST, NODES[rank], start_coll(rank, epoch, count))
    fabric.run_until_idle()
    for _ in range(200):  # the engines' clocks: every chunk, DONE, the completions
        if all(not c.collective.needs_tick for c in cores):
            break
        fabric.advance(0.002)
        fabric.run_until_idle()
    answers: list[list[Packet]] = [[] for _ in cores]
    for data, src in fabric.receive(HOST):
        assert verify(tag_key(epoch), data)
        answers[NODES.index(src)].append(decode_packet(data))
    want = all_reduce_reference(inputs)
    for core in cores:
        got = core.memory[OUT_ADDR : OUT_ADDR + 4 * count].view(np.float32)
        assert got.tobytes() == want.tobytes()
    return answers


def punted(core: NodeCore) -> int:
    return int(core.counters[C.PUNTED])


def test_the_next_epoch_starts_in_the_datapath_and_answers_as_the_control_plane() -> None:
    fabric, cores = cluster()
    first = run_epoch(fabric, cores, 1)
    before = [punted(c) for c in cores]
    second = run_epoch(fabric, cores, 2)
    assert [punted(c) for c in cores] == before  # no START_COLL reached the control plane
    for answers_1, answers_2 in zip(first, second, strict=True):
        running = [p for p in answers_2 if p.aux_addr == 0]
        done = [p for p in answers_2 if p.aux_addr == 1]
        assert [p.opcode for p in running + done] == [Opcode.ACK, Opcode.ACK]
        # The same answer as the control plane's of epoch 1, but for the ids and the tag.
        [python_ack] = [p for p in answers_1 if p.aux_addr == 0]
        assert running[0].txn_id == 102 and running[0].epoch == 2
        assert (running[0].client_id, running[0].coll_id, running[0].rkey) == (
            python_ack.client_id,
            python_ack.coll_id,
            python_ack.rkey,
        )
    for core in cores:
        engine = core.collective.engine_of(COLL)
        assert engine is not None and engine.epoch_before == 1
        assert engine.started_by == (int(core.collective.cfg[0, L.CFG_STARTER]), 3)
        # The request the control plane would have kept: epoch 2's, with its keys.
        assert engine.request is not None and engine.request.epoch == 2
        assert engine.request.txn_id == 102
        # The key went when the collective ended, as the control plane's does.
        assert 0x1002 not in core.regions() and 0x1002 not in core._keys()
    run_epoch(fabric, cores, 3)  # and again
    assert [punted(c) for c in cores] == before


def test_the_restarted_collectives_key_is_members_only_over_its_buffers() -> None:
    fabric, cores = cluster()
    run_epoch(fabric, cores, 1)
    core = cores[0]  # its peer has not started epoch 2: the core alone, by hand
    before = punted(core)
    core.receive_datagram(start_coll(0, 2), HOST, 1.0)
    assert punted(core) == before  # started in the datapath
    rights = int(Rights.READ | Rights.WRITE | Rights.MEMBERS)
    assert core._keys()[0x1002] == (IN_ADDR, OUT_ADDR + 4 * COUNT - IN_ADDR, rights)
    # A non-member reading with it: refused as if the key did not exist.
    read = Packet(Opcode.READ, rkey=0x1002, addr=IN_ADDR, length=8, client_id=9, txn_id=1)
    [nack] = [decode_packet(d) for d in ask(core, encode_packet(read), OTHER_HOST)]
    assert nack.opcode == Opcode.NACK and nack.status == Status.BAD_RKEY


@pytest.mark.parametrize(
    "what", ["another source", "another count", "a registered key", "the same epoch", "a wrong tag"]
)
def test_anything_else_goes_to_the_control_plane(what: str) -> None:
    fabric, cores = cluster()
    run_epoch(fabric, cores, 1)
    core = cores[0]
    before = punted(core)
    src = OTHER_HOST if what == "another source" else HOST
    data = {
        "another source": start_coll(0, 2),
        "another count": start_coll(0, 2, count=COUNT - 1),
        "a registered key": start_coll(0, 2, rkey=next(iter(core.regions()))),
        "the same epoch": start_coll(0, 1),
        "a wrong tag": start_coll(0, 2)[:-1] + bytes([start_coll(0, 2)[-1] ^ 1]),
    }[what]
    answers = ask(core, data, src)
    cfg = core.collective.cfg[0]
    if what == "a wrong tag":
        assert answers == [] and punted(core) == before  # forged: dropped in the datapath
        assert core.counters[C.DROP_CONTROL_FORGED] == 1
        return
    assert punted(core) == before + 1
    [reply] = [decode_packet(d) for d in answers]
    if what == "the same epoch":  # a retry of a finished collective: its completion again
        assert (reply.opcode, reply.aux_addr) == (Opcode.ACK, 1)
    else:  # the control plane started it
        assert (reply.opcode, reply.aux_addr, reply.epoch) == (Opcode.ACK, 0, 2)
        assert cfg[L.CFG_STATE] == L.STATE_RUNNING and cfg[L.CFG_EPOCH] == 2


def test_a_restarting_start_coll_replayed_from_another_source_is_dropped() -> None:
    """Its control tag reaches the replay memory as the control plane's own do (SPEC.md 2.6)."""
    fabric, cores = cluster()
    run_epoch(fabric, cores, 1)
    core = cores[0]
    data = start_coll(0, 2)
    before = punted(core)
    [ack] = ask(core, data)
    assert punted(core) == before  # started in the datapath
    assert verify(tag_key(2), ack)
    assert ask(core, data, OTHER_HOST) == []
    assert core.counters[C.DROP_CONTROL_REPLAYED] == 1
    # Its own source's retry is answered ("running"), as the control plane answers one.
    [again] = [decode_packet(d) for d in ask(core, data)]
    assert (again.opcode, again.aux_addr, again.epoch) == (Opcode.ACK, 0, 2)
    assert verify_control(ADMIN_TAG, data)
