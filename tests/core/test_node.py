"""NodeCore on the in-memory fabric: every opcode, status, rights check and duplicate-window case."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import ADMIN_KEY, CLIENT, MEMORY, RKEY, Cluster, make_cluster, only

from netdam.core.events import GroupJoined, GroupLeft, RegionRegistered, ReplyReceived
from netdam.core.fabric import Fabric
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels import datapath
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DUP_WINDOW,
    DUP_WINDOW_CLIENTS,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Rights,
    Status,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import INFO as INFO_STRUCT


def write(
    addr: int,
    data: bytes,
    txn: int = 0,
    client: int = 1,
    rkey: int = RKEY,
    flags: Flags = Flags.ACK_REQ,
    dtype: DType = DType.RAW,
) -> Packet:
    return Packet(
        Opcode.WRITE,
        flags=flags,
        client_id=client,
        txn_id=txn,
        rkey=rkey,
        addr=addr,
        dtype=dtype,
        length=len(data),
        payload=data,
    )


def read(addr: int, length: int, rkey: int = RKEY, dtype: DType = DType.RAW) -> Packet:
    return Packet(Opcode.READ, rkey=rkey, addr=addr, length=length, dtype=dtype)


def atomic(
    opcode: Opcode, addr: int, *values: int, txn: int = 0, client: int = 1, rkey: int = RKEY
) -> Packet:
    payload = struct.pack(f"<{len(values)}Q", *values)
    return Packet(
        opcode,
        client_id=client,
        txn_id=txn,
        rkey=rkey,
        addr=addr,
        dtype=DType.U64,
        length=8,
        payload=payload,
    )


def control(opcode: Opcode, key: int = ADMIN_KEY, **kw: object) -> Packet:
    return Packet(opcode, rkey=key, **kw)


def old_value(reply: Packet) -> int:
    return int(struct.unpack("<Q", reply.payload)[0])


def test_write_then_read(cluster: Cluster) -> None:
    data = bytes(range(200))
    ack = only(cluster.request(0, write(1000, data, txn=5)), Opcode.ACK)
    assert (ack.txn_id, ack.client_id, ack.status, ack.length) == (5, 1, Status.OK, 0)
    resp = only(cluster.request(0, read(1000, 200)), Opcode.READ_RESP)
    assert resp.payload == data and resp.length == 200 and resp.addr == 1000
    assert bytes(cluster.nodes[0].memory[1000:1200]) == data


def test_write_without_ack_req_is_silent(cluster: Cluster) -> None:
    assert cluster.request(0, write(0, b"abcd", txn=1, flags=Flags.NONE)) == []
    assert bytes(cluster.nodes[0].memory[:4]) == b"abcd"


def test_add_combines_into_memory(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    node.memory[64:80].view(np.float32)[:] = [1.0, 2.0, 3.0, 4.0]
    payload = np.array([0.5, 0.25, -3.0, 1e30], np.float32).tobytes()
    packet = Packet(
        Opcode.ADD,
        flags=Flags.ACK_REQ,
        client_id=1,
        txn_id=3,
        rkey=RKEY,
        addr=64,
        dtype=DType.F32,
        length=16,
        payload=payload,
    )
    only(cluster.request(0, packet), Opcode.ACK)
    np.testing.assert_array_equal(
        node.memory[64:80].view(np.float32), np.array([1.5, 2.25, 0.0, 1e30], np.float32)
    )
    maxed = Packet(
        Opcode.ADD,
        client_id=1,
        txn_id=4,
        rkey=RKEY,
        addr=64,
        dtype=DType.F32,
        reduce_op=ReduceOp.MAX,
        length=16,
        payload=np.full(4, 2.0, np.float32).tobytes(),
    )
    cluster.request(0, maxed)
    np.testing.assert_array_equal(
        node.memory[64:80].view(np.float32), np.array([2.0, 2.25, 2.0, 1e30], np.float32)
    )


def test_fetch_add_and_cas(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    node.memory[8:16].view(np.uint64)[0] = 2**64 - 2
    reply = only(cluster.request(0, atomic(Opcode.FETCH_ADD, 8, 5, txn=1)), Opcode.ACK)
    assert old_value(reply) == 2**64 - 2 and reply.length == 8
    assert int(node.memory[8:16].view(np.uint64)[0]) == 3  # wraps mod 2^64
    fail = only(cluster.request(0, atomic(Opcode.CAS, 8, 99, 7, txn=2)), Opcode.ACK)
    assert old_value(fail) == 3 and int(node.memory[8:16].view(np.uint64)[0]) == 3
    ok = only(cluster.request(0, atomic(Opcode.CAS, 8, 3, 7, txn=3)), Opcode.ACK)
    assert old_value(ok) == 3 and int(node.memory[8:16].view(np.uint64)[0]) == 7


def test_duplicate_fetch_add_replays_cached_reply(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    first = only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 10, txn=77)), Opcode.ACK)
    again = only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 10, txn=77)), Opcode.ACK)
    assert encode_packet(first) == encode_packet(again)
    assert int(node.memory[0:8].view(np.uint64)[0]) == 10
    assert node.counters[C.DUP_REPLAYS] == 1
    # Another client with the same txn id is a different transaction.
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 10, txn=77, client=2)), Opcode.ACK)
    assert int(node.memory[0:8].view(np.uint64)[0]) == 20


def test_duplicate_write_without_reply_is_dropped(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    cluster.request(0, write(0, b"x", txn=4, flags=Flags.NONE))
    node.memory[0] = 0
    assert cluster.request(0, write(0, b"x", txn=4, flags=Flags.NONE)) == []
    assert node.memory[0] == 0 and node.counters[C.DUP_SILENT] == 1


def test_window_stale_and_out_of_order(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=1000)), Opcode.ACK)
    # Older but inside the window, never seen: executes.
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=1000 - DUP_WINDOW + 1)), Opcode.ACK)
    stale = only(
        cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=1000 - DUP_WINDOW)), Opcode.NACK
    )
    assert stale.status == Status.STALE
    assert int(node.memory[0:8].view(np.uint64)[0]) == 2
    # Moving far ahead forgets everything behind the window.
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=1000 + 5 * DUP_WINDOW)), Opcode.ACK)
    assert (
        only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=1000)), Opcode.NACK).status
        == Status.STALE
    )
    # txn ids wrap: 2^32-1 -> 0 is forward.
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=2**32 - 1, client=9)), Opcode.ACK)
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=0, client=9)), Opcode.ACK)
    assert (
        old_value(
            only(
                cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=2**32 - 1, client=9)),
                Opcode.ACK,
            )
        )
        == 3
    )


def test_client_zero_is_not_tracked(cluster: Cluster) -> None:
    for _ in range(2):
        only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=5, client=0)), Opcode.ACK)
    assert int(cluster.nodes[0].memory[0:8].view(np.uint64)[0]) == 2


def _clients_sharing_a_set(requester: Endpoint, count: int) -> list[int]:
    """Client ids whose window keys, for *requester*, fall in one set of the client table."""
    ways = datapath._WAYS
    sets = DUP_WINDOW_CLIENTS // ways
    target = int(datapath._requester_key(1, endpoint_to_u64(requester), RKEY)) % sets
    found = [
        c
        for c in range(1, 100_000)
        if int(datapath._requester_key(c, endpoint_to_u64(requester), RKEY)) % sets == target
    ]
    assert len(found) >= count
    return found[:count]


def test_clients_sharing_a_set_keep_their_history(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    clients = _clients_sharing_a_set(CLIENT, datapath._WAYS + 1)
    for client in clients[:-1]:
        only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=5, client=client)), Opcode.ACK)
    for client in clients[:-1]:  # every retry is answered from the window: no new increment
        only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=5, client=client)), Opcode.ACK)
    assert int(node.memory[0:8].view(np.uint64)[0]) == datapath._WAYS
    # A fifth requester of the set evicts the least recently used one, which loses its history.
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=5, client=clients[-1])), Opcode.ACK)
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=5, client=clients[0])), Opcode.ACK)
    assert int(node.memory[0:8].view(np.uint64)[0]) == datapath._WAYS + 2  # documented limit


def test_borrowed_client_id_neither_replays_nor_poisons(cluster: Cluster) -> None:
    """Another requester using the victim's client id and its next txn ids gets no cached reply
    of the victim's and does not turn the victim's requests into duplicates or STALE."""
    node = cluster.nodes[0]
    attacker: Endpoint = ("127.0.0.1", 9666)
    cluster.fabric.add_endpoint(attacker)
    only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=50, client=77)), Opcode.ACK)
    for txn in (50, 51, 50 + 5 * DUP_WINDOW):
        cluster.fabric.send(
            attacker,
            cluster.endpoints[0],
            encode_packet(atomic(Opcode.FETCH_ADD, 0, 100, txn=txn, client=77)),
        )
    cluster.fabric.run_until_idle()
    attacker_replies = [decode_packet(d) for d, _ in cluster.fabric.receive(attacker)]
    assert [old_value(r) for r in attacker_replies] == [1, 101, 201]  # all executed, as its own
    assert cluster.fabric.receive(CLIENT) == []
    # The victim's next txn executes (not a DUP of the attacker's 51, not STALE).
    reply = only(cluster.request(0, atomic(Opcode.FETCH_ADD, 0, 1, txn=51, client=77)), Opcode.ACK)
    assert old_value(reply) == 301
    assert int(node.memory[0:8].view(np.uint64)[0]) == 302


@pytest.fixture
def restricted() -> tuple[Cluster, int, int]:
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    node.deregister_region(RKEY)  # one owner per byte: RKEY keeps the memory above 16 KiB
    node.register_region(16384, MEMORY - 16384, RIGHTS_ALL, rkey=RKEY)
    read_only = node.register_region(4096, 4096, Rights.READ)
    write_only = node.register_region(8192, 4096, Rights.WRITE)
    node.memory[:] = 0xAA
    return cluster, read_only, write_only


NACK_CASES = [
    ("bad rkey", lambda ro, wo: write(4096, b"z", rkey=0xDEAD), Status.BAD_RKEY),
    ("zero rkey", lambda ro, wo: read(4096, 4, rkey=0), Status.BAD_RKEY),
    ("write with read key", lambda ro, wo: write(4096, b"z", rkey=ro), Status.NO_RIGHTS),
    ("read with write key", lambda ro, wo: read(8192, 4, rkey=wo), Status.NO_RIGHTS),
    (
        "atomic without right",
        lambda ro, wo: atomic(Opcode.FETCH_ADD, 8192, 1, rkey=wo),
        Status.NO_RIGHTS,
    ),
    ("read past region", lambda ro, wo: read(4096 + 4090, 8, rkey=ro), Status.OUT_OF_BOUNDS),
    ("read before region", lambda ro, wo: read(4000, 8, rkey=ro), Status.OUT_OF_BOUNDS),
    ("huge address", lambda ro, wo: read(2**64 - 4, 8, rkey=ro), Status.OUT_OF_BOUNDS),
    ("write past region", lambda ro, wo: write(8192 + 4095, b"zz", rkey=wo), Status.OUT_OF_BOUNDS),
    ("misaligned f32", lambda ro, wo: read(4098, 8, rkey=ro, dtype=DType.F32), Status.MISALIGNED),
    (
        "misaligned atomic",
        lambda ro, wo: atomic(Opcode.FETCH_ADD, 16384 + 12, 1),
        Status.MISALIGNED,
    ),
    (
        "register without admin",
        lambda ro, wo: control(
            Opcode.REGISTER,
            key=RKEY,
            addr=0,
            aux_addr=64,
            length=8,
            payload=struct.pack("<II", 0, 1),
        ),
        Status.UNAUTHORIZED,
    ),
    ("counters without admin", lambda ro, wo: control(Opcode.COUNTERS, key=0), Status.UNAUTHORIZED),
]


@pytest.mark.parametrize("name,make,status", NACK_CASES, ids=[c[0] for c in NACK_CASES])
def test_refused_requests_touch_nothing(
    restricted: tuple[Cluster, int, int], name: str, make, status: Status
) -> None:
    cluster, ro, wo = restricted
    node = cluster.nodes[0]
    before = node.memory.copy()
    nack = only(cluster.request(0, make(ro, wo)), Opcode.NACK)
    assert nack.status == status
    assert node.counters[C.NACK_BASE + status] == 1
    np.testing.assert_array_equal(node.memory, before)


def test_structural_nack_and_silent_drops(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    bad = bytearray(encode_packet(read(0, 4)))
    bad[48] = 9
    cluster.fabric.send(CLIENT, cluster.endpoints[0], bytes(bad))
    cluster.fabric.run_until_idle()
    (reply,) = cluster.fabric.receive(CLIENT)
    assert decode_packet(reply[0]).status == Status.BAD_DTYPE
    # Too short to answer: dropped and counted.
    cluster.fabric.send(CLIENT, cluster.endpoints[0], b"\x01\x01abc")
    # A malformed reply is never answered.
    bad_ack = bytearray(encode_packet(Packet(Opcode.ACK)))
    bad_ack[55] = 1
    cluster.fabric.send(CLIENT, cluster.endpoints[0], bytes(bad_ack))
    # A well-formed reply nobody asked for becomes an event, not a NACK.
    cluster.fabric.send(CLIENT, cluster.endpoints[0], encode_packet(Packet(Opcode.ACK, txn_id=3)))
    cluster.fabric.run_until_idle()
    assert cluster.fabric.receive(CLIENT) == []
    assert node.counters[C.DROP_TRUNCATED] == 1 and node.counters[C.DROP_BAD_REPLY] == 1
    replies = [e for e in iter(node.next_event, None) if isinstance(e, ReplyReceived)]
    assert [e.packet.txn_id for e in replies] == [3]


def test_datagram_over_the_mtu_is_dropped(cluster: Cluster) -> None:
    cluster.fabric.send(CLIENT, cluster.endpoints[0], encode_packet(read(0, 4)) + bytes(9000))
    cluster.fabric.send(CLIENT, cluster.endpoints[0], encode_packet(read(0, 4)) + bytes(8972 - 64))
    cluster.fabric.run_until_idle()
    (reply,) = cluster.fabric.receive(CLIENT)  # the one that fits is answered
    assert decode_packet(reply[0]).status == Status.BAD_LENGTH
    assert cluster.nodes[0].counters[C.DROP_OVERSIZE] == 1


def test_ping_info(cluster: Cluster) -> None:
    info = only(cluster.request(1, Packet(Opcode.PING, txn_id=4)), Opcode.INFO)
    version, mtu, memory, max_payload, max_segments, rank, world = INFO_STRUCT.unpack(info.payload)
    assert (version, mtu, memory, max_payload, max_segments, rank, world) == (
        1,
        9000,
        MEMORY,
        8192,
        64,
        1,
        3,
    )


def test_register_deregister_over_the_wire(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    node.deregister_region(RKEY)  # free memory to register in (one owner per byte) ...
    node.register_region(0, 4096, RIGHTS_ALL, rkey=RKEY)  # ... beside another region
    payload = struct.pack("<II", 0, int(Rights.READ | Rights.WRITE))
    ack = only(
        cluster.request(
            0,
            control(
                Opcode.REGISTER,
                addr=65536,
                aux_addr=1024,
                length=8,
                payload=payload,
                client_id=4,
                txn_id=1,
            ),
        ),
        Opcode.ACK,
    )
    rkey = ack.rkey
    assert rkey in node.regions() and node.regions()[rkey] == (65536, 1024, 3)
    assert any(isinstance(e, RegionRegistered) for e in iter(node.next_event, None))
    # A retried REGISTER is answered from the window: same rkey, no second region.
    again = only(
        cluster.request(
            0,
            control(
                Opcode.REGISTER,
                addr=65536,
                aux_addr=1024,
                length=8,
                payload=payload,
                client_id=4,
                txn_id=1,
            ),
        ),
        Opcode.ACK,
    )
    assert again.rkey == rkey and len(node.regions()) == 2
    only(cluster.request(0, write(65536 + 1020, b"1234", rkey=rkey, txn=9)), Opcode.ACK)
    assert (
        only(
            cluster.request(0, write(65536 + 1021, b"1234", rkey=rkey, txn=10)), Opcode.NACK
        ).status
        == Status.OUT_OF_BOUNDS
    )
    exists = control(
        Opcode.REGISTER,
        addr=0,
        aux_addr=8,
        length=8,
        payload=struct.pack("<II", rkey, 1),
        client_id=4,
        txn_id=2,
    )
    assert only(cluster.request(0, exists), Opcode.NACK).status == Status.EXISTS
    too_big = control(
        Opcode.REGISTER,
        addr=MEMORY - 8,
        aux_addr=16,
        length=8,
        payload=struct.pack("<II", 0, 1),
        client_id=4,
        txn_id=3,
    )
    assert only(cluster.request(0, too_big), Opcode.NACK).status == Status.OUT_OF_BOUNDS
    bad_rights = control(
        Opcode.REGISTER,
        addr=0,
        aux_addr=16,
        length=8,
        payload=struct.pack("<II", 0, 8),
        client_id=4,
        txn_id=4,
    )
    assert only(cluster.request(0, bad_rights), Opcode.NACK).status == Status.BAD_FIELD
    only(
        cluster.request(
            0,
            control(
                Opcode.DEREGISTER,
                length=8,
                payload=struct.pack("<II", rkey, 0),
                client_id=4,
                txn_id=5,
            ),
        ),
        Opcode.ACK,
    )
    assert (
        only(cluster.request(0, read(65536, 4, rkey=rkey)), Opcode.NACK).status == Status.BAD_RKEY
    )
    only(cluster.request(0, read(0, 4)), Opcode.READ_RESP)  # the other region still works
    gone = control(
        Opcode.DEREGISTER, length=8, payload=struct.pack("<II", rkey, 0), client_id=4, txn_id=6
    )
    assert only(cluster.request(0, gone), Opcode.NACK).status == Status.BAD_RKEY


def test_region_table_full() -> None:
    node = NodeCore(NodeConfig(endpoint=("127.0.0.1", 1), memory_bytes=1 << 16))
    for i in range(512):
        node.register_region(i * 8, 8, Rights.READ)
    with pytest.raises(ValueError, match="NO_SPACE"):
        node.register_region(0, 8, Rights.READ)


def test_join_leave_and_counters(cluster: Cluster) -> None:
    node = cluster.nodes[2]
    group = ("239.77.0.1", 7744)

    # The JOIN waits for the shell's word on the group's port: refused, then taken.
    def answered(status: Status) -> Packet:
        assert cluster.request(2, control(Opcode.JOIN, addr=endpoint_to_u64(group))) == []
        joined = node.next_event()
        assert isinstance(joined, GroupJoined) and joined.group == group
        node.answer_join(joined, status)
        cluster.fabric.run_until_idle()
        [answer] = [decode_packet(data) for data, _ in cluster.fabric.receive(cluster.client)]
        return answer

    refused = answered(Status.IN_USE)
    assert (refused.opcode, refused.status) == (Opcode.NACK, Status.IN_USE)
    assert group not in node.groups
    assert answered(Status.OK).opcode == Opcode.ACK and group in node.groups
    unicast = control(Opcode.JOIN, addr=endpoint_to_u64(("10.0.0.1", 7744)))
    assert only(cluster.request(2, unicast), Opcode.NACK).status == Status.BAD_FIELD
    assert node.next_event() is None
    only(cluster.request(2, control(Opcode.LEAVE, addr=endpoint_to_u64(group))), Opcode.ACK)
    assert group not in node.groups and node.next_event() == GroupLeft(group)
    reply = only(cluster.request(2, control(Opcode.COUNTERS)), Opcode.ACK)
    values = np.frombuffer(reply.payload, "<u8")
    assert values.shape == (C.NUM_COUNTERS,)
    assert values[C.OPCODE_BASE + Opcode.JOIN] == 3 and values[C.OPCODE_BASE + Opcode.COUNTERS] == 1
    assert values[C.NACK_BASE + Status.IN_USE] == 1 and values[C.NACK_BASE + Status.BAD_FIELD] == 1
    assert values[C.RX_PACKETS] == 5


def chain_packet(
    cluster: Cluster,
    order: list[int],
    payload: np.ndarray,
    addr: int = 0,
    store: int = 0,
    **kw: object,
) -> Packet:
    segments = tuple(cluster.endpoints[i] for i in order)
    fields = dict(
        flags=Flags.ACK_REQ,
        rkey=RKEY,
        addr=addr,
        aux_addr=store,
        dtype=DType.F32,
        segments=segments,
        segments_left=len(segments) - 1,
        coll_id=0,
        epoch=0,
        seq=0,
        length=payload.nbytes,
        payload=payload.tobytes(),
    )
    fields.update(kw)
    return Packet(Opcode.CHAIN_ADD, **fields)


def test_chain_add_three_hops_exact(cluster: Cluster, rng: np.random.Generator) -> None:
    blocks = [rng.standard_normal(2048).astype(np.float32) for _ in range(4)]
    for node, block in zip(cluster.nodes, blocks[1:]):
        node.memory[:8192].view(np.float32)[:] = block
    before = [n.memory.copy() for n in cluster.nodes]
    ack = only(
        cluster.request(0, chain_packet(cluster, [0, 1, 2], blocks[0], store=65536)), Opcode.ACK
    )
    assert ack.coll_id == 0 and ack.seq == 0
    expected = ((blocks[0] + blocks[1]) + blocks[2]) + blocks[3]  # chain order
    stored = cluster.nodes[2].memory[65536 : 65536 + 8192].view(np.float32)
    assert stored.tobytes() == expected.tobytes()
    for node, snapshot in zip(cluster.nodes[:2], before[:2]):
        np.testing.assert_array_equal(node.memory, snapshot)  # intermediate hops never write
    assert cluster.nodes[0].counters[C.FORWARDED] == 1 and cluster.nodes[2].counters[C.STORED] == 1


def test_collective_packets_wait_for_start_collective(cluster: Cluster) -> None:
    """coll_id != 0 marks a collective's packet: refused (BUSY) until the host started that
    collective on the node, because its input may not be staged yet (tests/core/test_collectives.py
    covers the running case)."""
    for node in cluster.nodes:
        node.memory[:16].view(np.float32)[:] = 1.0
    packet = chain_packet(cluster, [0, 1, 2], np.full(4, 1.0, np.float32), coll_id=7, epoch=1)
    assert only(cluster.request(0, packet), Opcode.NACK).status == Status.BUSY
    assert cluster.nodes[2].counters[C.STORED] == 0
    gather = Packet(
        Opcode.ALL_WRITE, rkey=RKEY, addr=0, length=4, payload=b"zzzz", coll_id=7, epoch=1
    )
    assert cluster.request(1, gather) == [] and cluster.nodes[1].counters[C.DROP_COLL_EARLY] == 1
    repair = Packet(Opcode.READ, rkey=RKEY, addr=0, length=4, coll_id=7, epoch=1)
    assert only(cluster.request(1, repair), Opcode.NACK).status == Status.BUSY


def test_chain_to_non_member_is_refused(cluster: Cluster) -> None:
    outsider = ("127.0.0.1", 6666)
    cluster.fabric.add_endpoint(outsider)
    packet = chain_packet(cluster, [0, 1], np.ones(4, np.float32))
    packet = Packet(**{**packet.__dict__, "segments": (cluster.endpoints[0], outsider)})
    nack = only(cluster.request(0, packet), Opcode.NACK)
    assert nack.status == Status.NOT_MEMBER
    assert cluster.fabric.receive(outsider) == []


def test_chain_needs_read_rights_at_every_hop(cluster: Cluster) -> None:
    victim = cluster.nodes[1]
    victim.deregister_region(RKEY)
    victim.register_region(0, MEMORY, Rights.WRITE, rkey=RKEY)  # same key, no READ
    victim.memory[:16] = 0x42
    nack = only(
        cluster.request(0, chain_packet(cluster, [0, 1, 2], np.zeros(4, np.float32), store=4096)),
        Opcode.NACK,
    )
    assert nack.status == Status.NO_RIGHTS
    assert not cluster.nodes[2].memory[4096:4112].any()  # nothing of the victim's reached anyone


def test_chain_last_hop_needs_write_rights(cluster: Cluster) -> None:
    last = cluster.nodes[2]
    last.deregister_region(RKEY)
    last.register_region(0, MEMORY, Rights.READ, rkey=RKEY)
    nack = only(
        cluster.request(0, chain_packet(cluster, [0, 1, 2], np.zeros(4, np.float32), store=4096)),
        Opcode.NACK,
    )
    assert nack.status == Status.NO_RIGHTS and last.counters[C.STORED] == 0


def test_client_cannot_aim_replies_elsewhere(cluster: Cluster) -> None:
    victim = ("127.0.0.1", 5555)
    cluster.fabric.add_endpoint(victim)
    reply = cluster.request(0, Packet(**{**read(0, 4).__dict__, "ret": victim}))
    assert only(reply, Opcode.READ_RESP) and cluster.fabric.receive(victim) == []


def test_all_write_to_multicast_group(cluster: Cluster) -> None:
    group = ("239.77.0.9", 7744)
    for endpoint in cluster.endpoints:
        cluster.fabric.join(group, endpoint)
    data = bytes(range(64))
    packet = Packet(
        Opcode.ALL_WRITE, flags=Flags.MCAST, rkey=RKEY, addr=512, length=64, payload=data
    )
    cluster.fabric.send(CLIENT, group, encode_packet(packet))
    cluster.fabric.run_until_idle()
    assert cluster.fabric.receive(CLIENT) == []
    for node in cluster.nodes:
        assert bytes(node.memory[512:576]) == data


def test_batch_argument_checks(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    offs, lens, srcs = np.zeros(2, np.int64), np.zeros(2, np.int32), np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="1-D C-contiguous uint8"):
        node.receive_batch(np.zeros(20, np.int8), offs, lens, srcs, 2, 0.0)
    with pytest.raises(ValueError, match="int64"):
        node.receive_batch(np.zeros(20, np.uint8), lens, lens, srcs, 2, 0.0)
    with pytest.raises(ValueError, match="int32"):
        node.receive_batch(np.zeros(20, np.uint8), offs, offs, srcs, 2, 0.0)
    with pytest.raises(ValueError, match="exceeds the arrays"):
        node.receive_batch(np.zeros(20, np.uint8), offs, lens, srcs, 3, 0.0)
    with pytest.raises(ValueError, match="MTU 99 is too small"):
        NodeCore(NodeConfig(endpoint=("127.0.0.1", 1), mtu=99))


def test_datagram_beyond_the_receive_buffer_is_dropped(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    data = encode_packet(read(0, 4))
    buf = np.frombuffer(data, np.uint8).copy()
    node.receive_batch(
        buf,
        np.array([8], np.int64),
        np.array([len(data)], np.int32),
        np.array([1], np.uint64),
        1,
        0.0,
    )
    assert node.pending() == 0 and node.counters[C.DROP_OVERSIZE] == 1


def test_large_batch_grows_send_queue(cluster: Cluster) -> None:
    for i in range(600):
        cluster.send(0, read(8 * i, 8))
    cluster.fabric.run_until_idle()
    replies = cluster.fabric.receive(CLIENT)
    assert len(replies) == 600


def test_remaining_node_statuses_over_the_wire(cluster: Cluster) -> None:
    # A sparse WRITE executes as the dense one: the listed value, zeros elsewhere.
    cluster.nodes[0].memory[:64] = 0xFF
    body = struct.pack("<II", 1, 0) + struct.pack("<H", 2) + bytes(6) + struct.pack("<f", 1.0)
    sparse = Packet(
        Opcode.WRITE,
        flags=Flags.SPARSE | Flags.ACK_REQ,
        rkey=RKEY,
        addr=0,
        dtype=DType.F32,
        length=64,
        payload=body,
    )
    only(cluster.request(0, sparse), Opcode.ACK)
    expected = np.zeros(16, np.float32)
    expected[2] = 1.0
    assert cluster.nodes[0].memory[:64].tobytes() == expected.tobytes()
    # BAD_FIELD: ADD has no sparse form.
    add = bytearray(
        encode_packet(
            Packet(Opcode.ADD, rkey=RKEY, addr=0, dtype=DType.F32, length=4, payload=bytes(4))
        )
    )
    add[3] |= Flags.SPARSE
    cluster.fabric.send(CLIENT, cluster.endpoints[0], bytes(add))
    cluster.fabric.run_until_idle()
    (reply,) = cluster.fabric.receive(CLIENT)
    assert decode_packet(reply[0]).status == Status.BAD_FIELD
    # A malformed sparse payload gets the codec's status from the datapath.
    cluster.fabric.send(CLIENT, cluster.endpoints[0], encode_packet(sparse)[:65])
    cluster.fabric.run_until_idle()
    (reply,) = cluster.fabric.receive(CLIENT)
    assert decode_packet(reply[0]).status == Status.TRUNCATED
    # NO_SPACE over the wire: fill the region table.
    node = cluster.nodes[1]
    node.deregister_region(RKEY)
    for i in range(512):
        node.register_region(i * 8, 8, Rights.READ)
    full = control(
        Opcode.REGISTER,
        addr=0,
        aux_addr=8,
        length=8,
        payload=struct.pack("<II", 0, 1),
        client_id=4,
        txn_id=1,
    )
    assert only(cluster.request(1, full), Opcode.NACK).status == Status.NO_SPACE


def test_small_mtu_shrinks_what_the_node_offers_and_answers() -> None:
    """At MTU 1500 a node advertises 1408-byte payloads in INFO and answers a READ whose reply
    would not fit with NACK TOO_LARGE (the kernel would refuse to send it: a silent timeout)."""
    fabric = Fabric()
    endpoint = ("127.0.0.1", 7001)
    core = NodeCore(
        NodeConfig(endpoint=endpoint, memory_bytes=MEMORY, admin_key=ADMIN_KEY, mtu=1500)
    )
    core.register_region(0, MEMORY, Rights.READ, rkey=RKEY)
    fabric.add_core(endpoint, core)
    fabric.add_endpoint(CLIENT)
    cluster = Cluster(fabric, [core], [endpoint])
    info = only(cluster.request(0, Packet(Opcode.PING)), Opcode.INFO)
    assert INFO_STRUCT.unpack(info.payload)[3] == 1500 - 28 - 64
    assert len(only(cluster.request(0, read(0, 1408)), Opcode.READ_RESP).payload) == 1408
    assert only(cluster.request(0, read(0, 1416)), Opcode.NACK).status == Status.TOO_LARGE


@pytest.mark.parametrize(("mtu", "largest"), [(9000, 8192), (65000, 61440)])
def test_a_node_takes_payloads_up_to_its_mtus_largest_and_refuses_one_byte_more(
    mtu: int, largest: int
) -> None:
    """SPEC.md 2.7: the largest payload follows the MTU; at an emulation MTU (65000) a WRITE and
    a READ of 61440 bytes go through in one datagram each, and one byte more is TOO_LARGE
    there as 8193 is at the default MTU, with nothing written."""
    fabric = Fabric()
    endpoint = ("127.0.0.1", 7001)
    core = NodeCore(
        NodeConfig(endpoint=endpoint, memory_bytes=MEMORY, admin_key=ADMIN_KEY, mtu=mtu)
    )
    core.register_region(0, MEMORY, RIGHTS_ALL, rkey=RKEY)
    fabric.add_core(endpoint, core)
    fabric.add_endpoint(CLIENT)
    cluster = Cluster(fabric, [core], [endpoint], max_payload=1 << 16)  # the node decides
    info = only(cluster.request(0, Packet(Opcode.PING)), Opcode.INFO)
    assert INFO_STRUCT.unpack(info.payload)[3] == largest
    data = np.random.default_rng(mtu).integers(0, 256, largest + 1, np.uint8).tobytes()
    assert only(cluster.request(0, write(64, data[:largest], txn=1)), Opcode.ACK)
    assert only(cluster.request(0, read(64, largest)), Opcode.READ_RESP).payload == data[:largest]
    over = only(cluster.request(0, write(1 << 17, data, txn=2)), Opcode.NACK)
    assert over.status == Status.TOO_LARGE
    assert not core.memory[1 << 17 : (1 << 17) + largest + 1].any()
    assert only(cluster.request(0, read(64, largest + 1)), Opcode.NACK).status == Status.TOO_LARGE
