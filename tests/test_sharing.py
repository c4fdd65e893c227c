"""Safe to share (SPEC.md 6.1, 7, 8, 12): what one user of the nodes can do to another.

Each test is one attack measured against v0.2 (the figure in its docstring) and the property
that now holds. The fabric ones run the nodes' datapath in memory; the ``slow`` ones run node
processes, a switch and plain sockets, as an unprivileged local user would."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import CLIENT, RKEY, Cluster, make_cluster, only

from netdam.api import ProcessGroup, collective_key, group_secret
from netdam.api import all_reduce as api_all_reduce
from netdam.clients.pool import PoolClient
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import start_cluster, start_pool_cluster
from netdam.core.events import ReplyReceived
from netdam.kernels import datapath
from netdam.protocol.constants import (
    DUP_WINDOW_CLIENTS,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.switch.controller import PoolController

KiB = 1024
ATTACKER: Endpoint = ("127.0.0.1", 9666)


def _fetch_add(addr: int, value: int, *, txn: int, client: int, rkey: int) -> Packet:
    return Packet(Opcode.FETCH_ADD, client_id=client, txn_id=txn, rkey=rkey, addr=addr, length=8,
                  dtype=DType.U64, payload=struct.pack("<Q", value))  # fmt: skip


def _write(addr: int, data: bytes, *, txn: int, client: int, rkey: int) -> Packet:
    return Packet(Opcode.WRITE, flags=Flags.ACK_REQ, client_id=client, txn_id=txn, rkey=rkey, addr=addr,
                  length=len(data), payload=data)  # fmt: skip


def _two_tenants() -> tuple[Cluster, int, int]:
    """One node, RKEY's region split in two: the victim's [0, 64 KiB), the attacker's above."""
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    node.deregister_region(RKEY)
    victim = node.register_region(0, 64 * KiB, RIGHTS_ALL)
    attacker = node.register_region(64 * KiB, 64 * KiB, RIGHTS_ALL)
    cluster.fabric.add_endpoint(ATTACKER)
    return cluster, victim, attacker


def test_forged_writes_cannot_make_a_real_write_vanish() -> None:
    """Before: 200 WRITEs under the victim's source address and client id (the attacker's own
    region and rkey) poisoned the victim's window; 100 of its 100 next WRITEs were ACKed and
    0 applied. The window is keyed by the rkey too: the victim's WRITEs all land."""
    cluster, victim, attacker = _two_tenants()
    for txn in range(1, 201):  # forged from the victim's address: the fabric sends as anyone
        cluster.fabric.send(CLIENT, cluster.endpoints[0],
                            encode_packet(_write(64 * KiB, b"x" * 8, txn=txn, client=7, rkey=attacker)))  # fmt: skip
    cluster.fabric.run_until_idle()
    cluster.fabric.receive(CLIENT)
    for txn in range(1, 101):
        only(cluster.request(0, _write(8 * txn, struct.pack("<Q", txn), txn=txn, client=7, rkey=victim)), Opcode.ACK)
    written = cluster.nodes[0].memory[8 : 8 * 101].view(np.uint64)
    assert written.tolist() == list(range(1, 101))


def test_retried_fetch_add_never_runs_twice_under_a_client_id_flood() -> None:
    """Before: a tenant writing its own region under 512 client ids evicted the victim's window
    entry, and the victim's retried FETCH_ADD ran twice (20 of 20 trials). Entries of one rkey
    are never taken by clients of another while they may still be retried: the flood gets BUSY
    where the table is full, the victim's retry is answered from its window."""
    cluster, victim, attacker = _two_tenants()
    first = only(cluster.request(0, _fetch_add(0, 1, txn=5, client=77, rkey=victim)), Opcode.ACK)
    for client in range(1, 4 * DUP_WINDOW_CLIENTS + 1):
        cluster.fabric.send(ATTACKER, cluster.endpoints[0],
                            encode_packet(_fetch_add(64 * KiB, 1, txn=1, client=client, rkey=attacker)))  # fmt: skip
    cluster.fabric.run_until_idle()
    flood = [decode_packet(data) for data, _ in cluster.fabric.receive(ATTACKER)]
    assert len(flood) == 4 * DUP_WINDOW_CLIENTS and all(r.opcode == Opcode.ACK for r in flood)  # it evicts its own
    retry = only(cluster.request(0, _fetch_add(0, 1, txn=5, client=77, rkey=victim)), Opcode.ACK)
    assert retry.payload == first.payload  # the cached answer: old value 0
    assert int(cluster.nodes[0].memory[0:8].view(np.uint64)[0]) == 1  # ran once


def test_a_members_only_key_names_nothing_for_anyone_else() -> None:
    """A collective's key (rights MEMBERS) works in datagrams from cluster members only: a
    non-member that learned it gets BAD_RKEY for READ, WRITE and atomics, and memory stays."""
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    node.deregister_region(RKEY)
    key = node.register_region(0, 64 * KiB, Rights.READ | Rights.WRITE | Rights.ATOMIC | Rights.MEMBERS)
    node.memory[:64] = 7
    before = node.memory.copy()
    for packet in (Packet(Opcode.READ, rkey=key, addr=0, length=64),
                   _write(0, b"overwrite", txn=1, client=3, rkey=key),
                   _fetch_add(0, 1, txn=2, client=3, rkey=key)):  # fmt: skip
        assert only(cluster.request(0, packet), Opcode.NACK).status == Status.BAD_RKEY
    np.testing.assert_array_equal(node.memory, before)
    member = cluster.endpoints[1]  # a node: the answer reaches its core as a reply event
    cluster.fabric.send(member, cluster.endpoints[0], encode_packet(Packet(Opcode.READ, rkey=key, addr=0, length=64)))
    cluster.fabric.run_until_idle()
    events = list(iter(cluster.nodes[1].next_event, None))
    assert [e.packet.opcode for e in events if isinstance(e, ReplyReceived)] == [Opcode.READ_RESP]


def _sniffer(group: Endpoint) -> socket.socket:
    """A plain socket of an unprivileged user, joined to a collective's multicast group."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", group[1]))
    membership = socket.inet_aton(group[0]) + socket.inet_aton("127.0.0.1")
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    sock.setblocking(False)
    return sock


def _sniffed(sock: socket.socket) -> list[Packet]:
    packets = []
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return packets
        try:
            packets.append(decode_packet(data))
        except Exception:  # noqa: BLE001 - anything on the group that is not NetDAM is skipped
            continue


@pytest.mark.slow
def test_sniffed_collective_gives_no_memory_access_and_no_wrong_result(tmp_path: Path) -> None:
    """Before: an all-gather's ALL_WRITEs carried one key for all node memory, valid forever;
    with it a local user read and overwrote a tenant's secret, and forged next-epoch
    ALL_WRITEs made 33 of 100 all-reduces wrong with no error. Now a collective's key is its
    own (derived per epoch from the cluster's 128-bit group key), covers only its buffers,
    works only from members, and is gone when it ends."""
    with start_cluster(2, memory=4 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(2)]
        sniffer = _sniffer(groups[0].group)
        node = cluster.info.nodes[0].endpoint
        with ControlClient(admin_key=cluster.info.admin_key) as admin:  # a direct client's secret
            secret_key, secret_at = admin.register_anywhere(node, 4096, Rights.READ | Rights.WRITE)
            admin.write(node, secret_key, secret_at, b"tenant secret!!!" * 256)
        inputs = [np.arange(16384, dtype=np.float32) * (r + 1) for r in range(2)]
        for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)]:
            w.wait()  # type: ignore[union-attr]
        sniffed = [p for p in _sniffed(sniffer) if p.opcode == Opcode.ALL_WRITE]
        assert sniffed, "the sniffer saw no ALL_WRITE: the test would prove nothing"
        seen = sniffed[0]
        assert seen.rkey == collective_key(group_secret(cluster.info), seen.coll_id, seen.epoch)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
            attacker.bind(("127.0.0.1", 0))
            attacker.settimeout(1.0)
            for probe in (Packet(Opcode.READ, rkey=seen.rkey, addr=secret_at, length=64),
                          Packet(Opcode.READ, rkey=seen.rkey, addr=seen.addr, length=64),
                          _write(secret_at, b"owned!!!", txn=1, client=9, rkey=seen.rkey)):  # fmt: skip
                attacker.sendto(encode_packet(probe), node)
                reply = decode_packet(attacker.recv(65536))
                assert reply.opcode == Opcode.NACK and reply.status == Status.BAD_RKEY
            # Forged ALL_WRITEs of the next epoch under the sniffed key and under the next
            # epoch's key guessed the old way: the next all-reduce is still exact.
            for rkey in (seen.rkey, seen.rkey + 1):
                forged = Packet(Opcode.ALL_WRITE, flags=Flags.MCAST, coll_id=seen.coll_id, epoch=seen.epoch + 1,
                                seq=0, rkey=rkey, addr=seen.addr, length=seen.length, dtype=seen.dtype,
                                payload=b"\xff" * seen.length)  # fmt: skip
                attacker.sendto(encode_packet(forged), groups[0].group)
                attacker.sendto(encode_packet(forged), node)
        inputs = [np.arange(16384, dtype=np.float32) * (r + 3) for r in range(2)]
        for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)]:
            w.wait()  # type: ignore[union-attr]
        expected = np.arange(16384, dtype=np.float32) * 3 + np.arange(16384, dtype=np.float32) * 4
        for b in inputs:
            np.testing.assert_array_equal(b, expected)
        with ControlClient(admin_key=cluster.info.admin_key) as admin:
            assert admin.read(node, secret_key, secret_at, 4096) == b"tenant secret!!!" * 256
        sniffer.close()
        for g in groups:
            g.close()


@pytest.mark.slow
def test_collectives_leave_pool_tenants_memory_alone(tmp_path: Path) -> None:
    """Before: pool backing began at address 0, inside memory the collectives' key covered, and
    `netdam allreduce --cluster` overwrote 2.09 MB of a tenant's 14.7 MB. A process group now
    owns an arena the node placed in free memory; the tenant's bytes read back bit-exact."""
    cluster, switch = start_pool_cluster(2, memory=4 << 20, cluster_path=tmp_path / "c.toml")
    try:
        controller = PoolController(cluster.path)
        region = controller.alloc(1 << 20, interleave=8 * KiB)
        pattern = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        with PoolClient(switch.vip) as client:
            client.write(region.gaddr, pattern, region.rkey, stride=region.stride)
        info = cluster.info
        groups = [ProcessGroup(info, rank) for rank in range(2)]
        for _ in range(3):
            bufs = [np.full(256 * KiB, rank + 1.0, np.float32) for rank in range(2)]
            for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(bufs, groups)]:
                w.wait()  # type: ignore[union-attr]
            assert all((b == 3.0).all() for b in bufs)
        with PoolClient(switch.vip) as client:
            assert client.read(region.gaddr, len(pattern), region.rkey, stride=region.stride) == pattern
        for g in groups:
            assert not any(g.arena_base < w.local + w.size and w.local < g.arena_end
                           for w in region.ways if w.node == g.rank)  # fmt: skip
            g.close()
    finally:
        switch.stop()
        cluster.stop()


@pytest.mark.slow
def test_alloc_returns_zeroed_memory(tmp_path: Path) -> None:
    """Before: tenant B's first READ of a fresh ALLOC returned all 65,536 bytes tenant A had
    written and freed. Freed backing is wiped: B reads zeros."""
    cluster, switch = start_pool_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml")
    try:
        admin = PoolController(cluster.path)
        first = admin.alloc(64 * KiB)
        with PoolClient(switch.vip) as client:
            client.write(first.gaddr, b"A's data" * (8 * KiB), first.rkey)
        admin.free(first.gaddr)
        second = admin.alloc(64 * KiB)
        assert {(w.node, w.local) for w in second.ways} == {(w.node, w.local) for w in first.ways}
        with PoolClient(switch.vip) as client:
            assert client.read(second.gaddr, 64 * KiB, second.rkey) == bytes(64 * KiB)
    finally:
        switch.stop()
        cluster.stop()


def test_window_key_includes_the_rkey() -> None:
    """The same client id and requester under two rkeys are two window entries."""
    requester = endpoint_to_u64(CLIENT)
    assert int(datapath._requester_key(7, requester, 1)) != int(datapath._requester_key(7, requester, 2))
