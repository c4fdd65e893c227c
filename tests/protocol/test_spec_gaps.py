"""Behaviours SPEC.md states that a plain-socket client found unstated (issue 17), each pinned
against a node: requests built with the codec, then bytes changed where the codec would refuse."""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable

import numpy as np
import pytest
from helpers import ADMIN_KEY, CLIENT, MEMORY, RKEY, Cluster, make_cluster

from netdam.clients.async_pool import AsyncPoolClient
from netdam.clients.pool import TXN_SPAN, PoolClient
from netdam.protocol.constants import REGISTER_ANYWHERE, DType, Flags, Opcode, Rights, Status
from netdam.protocol.packet import Packet, decode_packet, encode_packet

Mutation = Callable[[bytearray], None]


@pytest.fixture()
def cluster() -> Cluster:
    return make_cluster(2)


def answers(cluster: Cluster, data: bytes) -> list[tuple[Opcode, Status]]:
    cluster.fabric.send(CLIENT, cluster.endpoints[0], data)
    cluster.fabric.run_until_idle()
    return [
        (decode_packet(d).opcode, decode_packet(d).status)
        for d, _ in cluster.fabric.receive(CLIENT)
    ]


def mutated(packet: Packet, *changes: Mutation) -> bytes:
    data = bytearray(encode_packet(packet))
    for change in changes:
        change(data)
    return bytes(data)


def byte(offset: int, value: int) -> Mutation:
    return lambda b: b.__setitem__(offset, value)


def flags(value: int) -> Mutation:
    return lambda b: b.__setitem__(slice(2, 4), value.to_bytes(2, "big"))


def write(txn: int, flag: Flags = Flags.ACK_REQ, rkey: int = RKEY) -> Packet:
    return Packet(
        Opcode.WRITE, flags=flag, rkey=rkey, length=8, payload=b"12345678", client_id=1, txn_id=txn
    )


NACK = Opcode.NACK


def test_status_and_credit_in_requests(cluster: Cluster) -> None:
    assert answers(cluster, mutated(write(1), byte(50, 5))) == [(Opcode.ACK, Status.OK)]
    assert answers(cluster, mutated(write(2), byte(51, 200))) == [(Opcode.ACK, Status.OK)]
    assert answers(cluster, mutated(write(3), byte(50, 200))) == [(NACK, Status.BAD_FIELD)]


def test_nacks_do_not_need_ack_req(cluster: Cluster) -> None:
    assert answers(cluster, encode_packet(write(4, Flags(0), rkey=0xDEAD))) == [
        (NACK, Status.BAD_RKEY)
    ]
    assert (
        answers(cluster, encode_packet(write(5, Flags(0)))) == []
    )  # success without ACK_REQ: silent


def test_mcast_flag_on_a_unicast_write_is_informational(cluster: Cluster) -> None:
    assert answers(cluster, encode_packet(write(6, Flags.ACK_REQ | Flags.MCAST))) == [
        (Opcode.ACK, Status.OK)
    ]


def test_sparse_flag_is_checked_after_the_dtype(cluster: Cluster) -> None:
    sparse = flags(int(Flags.ACK_REQ | Flags.SPARSE))
    read = Packet(
        Opcode.READ,
        flags=Flags.ACK_REQ,
        rkey=RKEY,
        length=8,
        dtype=DType.F32,
        client_id=1,
        txn_id=7,
    )
    assert answers(cluster, mutated(read, sparse)) == [(NACK, Status.BAD_FIELD)]
    fetch = Packet(
        Opcode.FETCH_ADD,
        flags=Flags.ACK_REQ,
        rkey=RKEY,
        length=8,
        dtype=DType.U64,
        payload=bytes(8),
        client_id=1,
        txn_id=8,
    )
    assert answers(cluster, mutated(fetch, sparse, byte(48, int(DType.F32)))) == [
        (NACK, Status.BAD_DTYPE)
    ]


def test_wrong_payload_sizes_are_bad_length(cluster: Cluster) -> None:
    fetch = encode_packet(
        Packet(
            Opcode.FETCH_ADD,
            flags=Flags.ACK_REQ,
            rkey=RKEY,
            length=8,
            dtype=DType.U64,
            payload=bytes(8),
            client_id=1,
            txn_id=9,
        )
    )
    cas = encode_packet(
        Packet(
            Opcode.CAS,
            flags=Flags.ACK_REQ,
            rkey=RKEY,
            length=8,
            dtype=DType.U64,
            payload=bytes(16),
            client_id=1,
            txn_id=10,
        )
    )
    read = encode_packet(
        Packet(Opcode.READ, flags=Flags.ACK_REQ, rkey=RKEY, length=8, client_id=1, txn_id=11)
    )
    ping = encode_packet(Packet(Opcode.PING, client_id=1, txn_id=12))
    for data in (fetch[:-4], fetch + bytes(8), cas[:-8], read + bytes(8), ping + bytes(8)):
        assert answers(cluster, data) == [(NACK, Status.BAD_LENGTH)]


def test_segment_type_and_count_must_agree(cluster: Cluster) -> None:
    read = Packet(Opcode.READ, flags=Flags.ACK_REQ, rkey=RKEY, length=8, client_id=1, txn_id=13)
    assert answers(cluster, mutated(read, byte(52, 1))) == [
        (NACK, Status.BAD_SEGMENT)
    ]  # type 1, 0 segments


def register(size: int, rights: int, txn: int, addr: int = 0) -> bytes:
    return encode_packet(
        Packet(
            Opcode.REGISTER,
            rkey=ADMIN_KEY,
            addr=addr,
            aux_addr=size,
            length=8,
            payload=struct.pack("<II", 0, rights),
            client_id=4,
            txn_id=txn,
        )
    )


def test_register_edge_cases(cluster: Cluster) -> None:
    assert answers(cluster, register(0, 1, 20)) == [(NACK, Status.OUT_OF_BOUNDS)]
    assert answers(cluster, register(4096, 0, 21)) == [(NACK, Status.BAD_FIELD)]
    # MEMBERS alone grants nothing: BAD_FIELD, like rights 0.
    assert answers(cluster, register(4096, int(Rights.MEMBERS), 25)) == [(NACK, Status.BAD_FIELD)]
    gone = encode_packet(
        Packet(
            Opcode.DEREGISTER,
            rkey=ADMIN_KEY,
            length=8,
            payload=struct.pack("<II", 0xBAD, 0),
            client_id=4,
            txn_id=24,
        )
    )
    assert answers(cluster, gone) == [(NACK, Status.BAD_RKEY)]


def test_register_gives_every_byte_one_owner(cluster: Cluster) -> None:
    """SPEC.md 6.1: a range overlapping a registered region is IN_USE, in every order; the node
    places a REGISTER_ANYWHERE region in free memory and says where in the ACK's addr."""
    node = cluster.nodes[0]
    # RKEY holds all of node memory: any explicit range overlaps it.
    assert answers(cluster, register(4096, 1, 30, addr=2048)) == [(NACK, Status.IN_USE)]
    assert answers(cluster, register(4096, 1, 31, addr=MEMORY - 4096)) == [(NACK, Status.IN_USE)]
    assert answers(cluster, register(8, 1, 32, addr=REGISTER_ANYWHERE)) == [(NACK, Status.NO_SPACE)]
    node.deregister_region(RKEY)
    first = decode_packet(_one(cluster, register(10000, 3, 33, addr=REGISTER_ANYWHERE)))
    second = decode_packet(_one(cluster, register(4096, 1, 34, addr=REGISTER_ANYWHERE)))
    assert (first.opcode, first.addr, second.opcode, second.addr) == (
        Opcode.ACK,
        0,
        Opcode.ACK,
        12288,
    )
    assert node.regions()[first.rkey] == (0, 10000, 3) and node.regions()[second.rkey] == (
        12288,
        4096,
        1,
    )
    for base, size in (
        (9999, 2),
        (12287, 2),
        (16383, 1),
        (0, MEMORY),
        (8192, 8192),
    ):  # each overlaps
        assert answers(cluster, register(size, 1, 35 + base % 97, addr=base)) == [
            (NACK, Status.IN_USE)
        ]
    assert answers(cluster, register(2288, 1, 40, addr=10000)) == [
        (Opcode.ACK, Status.OK)
    ]  # the gap, exactly


def test_deregistered_memory_reaches_the_next_owner_zeroed(cluster: Cluster) -> None:
    """A region's bytes are wiped when it is deregistered: a new owner of the same range reads
    zeros, never the previous owner's data."""
    node = cluster.nodes[0]
    node.deregister_region(RKEY)
    first = decode_packet(_one(cluster, register(65536, 3, 50, addr=REGISTER_ANYWHERE)))
    secret = bytes(range(256)) * 4
    write = Packet(
        Opcode.WRITE,
        flags=Flags.ACK_REQ,
        rkey=first.rkey,
        addr=first.addr,
        length=len(secret),
        payload=secret,
        client_id=4,
        txn_id=51,
    )
    assert answers(cluster, encode_packet(write)) == [(Opcode.ACK, Status.OK)]
    gone = encode_packet(
        Packet(
            Opcode.DEREGISTER,
            rkey=ADMIN_KEY,
            length=8,
            payload=struct.pack("<II", first.rkey, 0),
            client_id=4,
            txn_id=52,
        )
    )
    assert answers(cluster, gone) == [(Opcode.ACK, Status.OK)]
    second = decode_packet(_one(cluster, register(65536, 1, 53, addr=REGISTER_ANYWHERE)))
    assert second.addr == first.addr
    read = Packet(
        Opcode.READ, rkey=second.rkey, addr=second.addr, length=len(secret), client_id=4, txn_id=54
    )
    reply = decode_packet(_one(cluster, encode_packet(read)))
    assert reply.opcode == Opcode.READ_RESP and reply.payload == bytes(len(secret))


def _one(cluster: Cluster, data: bytes) -> bytes:
    cluster.fabric.send(CLIENT, cluster.endpoints[0], data)
    cluster.fabric.run_until_idle()
    (reply,) = cluster.fabric.receive(CLIENT)
    return bytes(reply[0])


def test_the_shipped_clients_retry_as_spec_says() -> None:
    """SPEC.md 7, Retries: 50 ms, at most 20 re-sends, 32 in flight, for both pool clients."""
    for signature in (
        inspect.signature(PoolClient.__init__),
        inspect.signature(AsyncPoolClient.open),
    ):
        defaults = {name: p.default for name, p in signature.parameters.items()}
        assert (defaults["timeout"], defaults["retries"], defaults["window"]) == (0.05, 20, 32)
    assert TXN_SPAN == 192


def test_a_node_may_appear_in_an_sr_list_more_than_once(cluster: Cluster) -> None:
    """SPEC.md 4: each appearance is one hop; node 0, node 1, node 0 adds node 0's operand twice."""
    for node, value in ((0, 1.5), (1, 10.0)):
        cluster.nodes[node].memory[0:8] = np.full(2, value, np.float32).view(np.uint8)
    chain = Packet(
        Opcode.CHAIN_ADD,
        flags=Flags.ACK_REQ,
        rkey=RKEY,
        addr=0,
        aux_addr=64,
        length=8,
        dtype=DType.F32,
        payload=np.full(2, 100.0, np.float32).tobytes(),
        segments=(cluster.endpoints[0], cluster.endpoints[1], cluster.endpoints[0]),
        segments_left=2,
        client_id=1,
        txn_id=40,
    )
    assert answers(cluster, encode_packet(chain)) == [(Opcode.ACK, Status.OK)]
    assert cluster.nodes[0].memory[64:72].view(np.float32).tolist() == [113.0, 113.0]


def test_read_over_the_mtu_is_too_large_before_the_amplification_drop() -> None:
    """SPEC.md 5's order: a READ whose answer would not fit the MTU is TOO_LARGE (a 64-byte NACK,
    so no amplifier) even from a sender without its token; one that fits but answers over 3x its
    request without the token is dropped and counted (12.4); one within 3x is answered."""
    from netdam.core.guard import GuardConfig
    from netdam.core.node import NodeConfig, NodeCore
    from netdam.protocol import counters as C

    me, client = ("10.0.0.1", 7744), ("10.9.9.9", 5000)
    core = NodeCore(
        NodeConfig(
            endpoint=me, memory_bytes=1 << 16, admin_key=ADMIN_KEY, mtu=1500, guard=GuardConfig.on()
        )
    )
    core.register_region(0, 1 << 16, Rights.READ, rkey=RKEY)

    def ask(length: int) -> list[tuple[Opcode, Status]]:
        core.receive_datagram(
            encode_packet(Packet(Opcode.READ, rkey=RKEY, addr=0, length=length)), client, 0.0
        )
        return [
            (decode_packet(d).opcode, decode_packet(d).status)
            for d, _ in core.datagrams_to_send(0.0)
        ]

    assert ask(4096) == [(NACK, Status.TOO_LARGE)]  # 64 + 4096 > 1472
    assert ask(1000) == [] and int(core.counters[C.DROP_AMPLIFICATION]) == 1
    assert ask(128) == [(Opcode.READ_RESP, Status.OK)]


def test_an_emulation_mtu_gives_an_unproven_sender_no_larger_reflection() -> None:
    """SPEC.md 2.7 and 12.4: at MTU 65000 a READ may ask 61440 bytes, 960x its 64-byte request;
    from an address that has not proven it receives there, it is dropped as at any MTU, and a
    member or a proven sender gets it whole. Over 61440 is TOO_LARGE (a 64-byte answer)."""
    from netdam.core.guard import GuardConfig
    from netdam.core.node import NodeConfig, NodeCore
    from netdam.protocol import counters as C

    me, member, stranger = ("10.0.0.1", 7744), ("10.0.0.2", 7744), ("10.9.9.9", 5000)
    core = NodeCore(
        NodeConfig(
            endpoint=me,
            memory_bytes=1 << 17,
            admin_key=ADMIN_KEY,
            mtu=65000,
            members=(me, member),
            guard=GuardConfig.on(),
        )
    )
    core.register_region(0, 1 << 17, Rights.READ, rkey=RKEY)

    def ask(length: int, src: tuple[str, int]) -> list[tuple[Opcode, Status, int]]:
        request = Packet(Opcode.READ, rkey=RKEY, addr=0, length=length)
        core.receive_datagram(encode_packet(request, 1 << 16), src, 0.0)
        out = [decode_packet(d, 1 << 16) for d, _ in core.datagrams_to_send(0.0)]
        return [(p.opcode, p.status, len(p.payload)) for p in out]

    assert ask(61440, stranger) == [] and int(core.counters[C.DROP_AMPLIFICATION]) == 1
    assert ask(61441, stranger) == [(NACK, Status.TOO_LARGE, 0)]
    assert ask(61440, member) == [(Opcode.READ_RESP, Status.OK, 61440)]
