"""SwitchCore with NodeCores on the in-memory fabric: translation, relay through the return
segment, rkey enforcement at the switch and at the node, multicast fan-out, faults per link
(including the k-th packet of an opcode) and retries under loss with no double apply."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import pytest

from netdam.core.fabric import Fabric
from netdam.core.faults import FaultSpec
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels import switch_path as K
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Flags, Opcode, Rights, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.switch.addrmap import GLOBAL_BASE, Region, Way, backing_per_way
from netdam.switch.core import SwitchConfig, SwitchCore, counters_from_payload
from netdam.switch.faults import parse_faults

VIP: Endpoint = ("127.0.0.1", 7744)
CLIENT: Endpoint = ("127.0.0.1", 9001)
OTHER: Endpoint = ("127.0.0.1", 9002)
ADMIN = 0x5EC12E7
STRIDE = 8192
ALL = int(Rights.READ | Rights.WRITE | Rights.ATOMIC)
GROUP: Endpoint = ("239.77.0.1", 7744)


@dataclass
class Pool:
    fabric: Fabric
    switch: SwitchCore
    nodes: list[NodeCore]
    endpoints: list[Endpoint]
    inter: Region
    ranged: Region
    txn: int = 100
    log: list[Packet] = field(default_factory=list)

    def request(self, packet: Packet, src: Endpoint = CLIENT) -> list[tuple[Packet, Endpoint]]:
        self.txn += 1
        data = encode_packet(Packet(**{**packet.__dict__, "txn_id": packet.txn_id or self.txn}))
        self.fabric.send(src, VIP, data)
        self.fabric.run_until_idle()
        return [(decode_packet(d), s) for d, s in self.fabric.receive(src)]


def make_pool(faults: FaultSpec | None = None, seed: int = 0) -> Pool:
    fabric = Fabric(faults)
    endpoints = [("127.0.0.1", 7001 + i) for i in range(3)]
    nodes = []
    for rank, ep in enumerate(endpoints):
        core = NodeCore(
            NodeConfig(
                endpoint=ep,
                memory_bytes=1 << 20,
                admin_key=ADMIN,
                members=tuple(endpoints) + (VIP,),
                rank=rank,
                world_size=3,
            )
        )
        fabric.add_core(ep, core)
        nodes.append(core)
    size = 6 * STRIDE + 64
    per = backing_per_way(size, STRIDE, 3)
    inter = Region(
        GLOBAL_BASE, size, 0xA11CE, ALL, STRIDE, tuple(Way(r, 0x10000, per) for r in range(3))
    )
    ranged = Region(
        GLOBAL_BASE + (1 << 20),
        4096,
        0xB0B,
        int(Rights.READ | Rights.WRITE),
        0,
        (Way(1, 0x40000, 4096),),
    )
    for region in (inter, ranged):  # what the controller does: same rkey, exact backing range
        for way in region.ways:
            nodes[way.node].register_region(
                way.local, way.size, Rights(region.rights), rkey=region.rkey
            )
    switch = SwitchCore(
        SwitchConfig(
            vip=VIP, nodes=tuple(endpoints), admin_key=ADMIN, seed=seed, pool_bytes=3 << 20
        ),
        [inter, ranged],
        generation=1,
    )
    fabric.add_core(VIP, switch)
    fabric.add_endpoint(CLIENT)
    fabric.add_endpoint(OTHER)
    return Pool(fabric, switch, nodes, endpoints, inter, ranged)


@pytest.fixture
def pool() -> Pool:
    return make_pool()


def test_write_read_translate_and_relay_through_return_segment(pool: Pool) -> None:
    g = pool.inter.gaddr
    data = bytes(range(256)) * 32  # one whole stripe
    for stripe in range(6):
        [(ack, src)] = pool.request(
            Packet(
                Opcode.WRITE,
                flags=Flags.ACK_REQ,
                rkey=0xA11CE,
                addr=g + stripe * STRIDE,
                length=STRIDE,
                payload=data[stripe:] + data[:stripe],
            )
        )
        # The reply comes from the node itself, not from the VIP, marked RELAYED, to the client.
        assert ack.opcode == Opcode.ACK and src == pool.endpoints[stripe % 3]
        assert ack.flags & Flags.RELAYED and ack.ret == CLIENT
    for stripe in range(6):
        node, local = pool.inter.locate(stripe * STRIDE)
        assert (node, local) == (stripe % 3, 0x10000 + (stripe // 3) * STRIDE)
        assert (
            bytes(pool.nodes[node].memory[local : local + STRIDE]) == data[stripe:] + data[:stripe]
        )
    [(resp, src)] = pool.request(
        Packet(Opcode.READ, rkey=0xA11CE, addr=g + 4 * STRIDE + 100, length=64)
    )
    assert resp.opcode == Opcode.READ_RESP and src == pool.endpoints[1]
    assert resp.payload == (data[4:] + data[:4])[100:164]
    assert pool.switch.pending() == 0 and pool.switch.held() == 0  # no per-request state


def test_client_id_filled_and_return_segment_not_spoofable(pool: Pool) -> None:
    g = pool.ranged.gaddr
    [(r1, _)] = pool.request(Packet(Opcode.READ, rkey=0xB0B, addr=g, length=8))
    [(r2, _)] = pool.request(Packet(Opcode.READ, rkey=0xB0B, addr=g, length=8))
    assert r1.client_id != 0 and r1.client_id == r2.client_id  # stable per client endpoint
    [(r3, _)] = pool.request(Packet(Opcode.READ, client_id=77, rkey=0xB0B, addr=g, length=8))
    assert r3.client_id == 77
    # A client naming a third party in the return segment still gets the reply itself.
    replies = pool.request(Packet(Opcode.READ, rkey=0xB0B, addr=g, length=8, ret=OTHER))
    assert len(replies) == 1 and replies[0][0].ret == CLIENT
    assert pool.fabric.receive(OTHER) == []
    assert pool.switch.sw[K.SW_IDS_FILLED] == 3


def fetch_add(
    pool: Pool, addr: int, value: int = 1, rkey: int = 0xA11CE, txn: int = 0, client_id: int = 0
) -> list[tuple[Packet, Endpoint]]:
    return pool.request(
        Packet(
            Opcode.FETCH_ADD,
            rkey=rkey,
            addr=addr,
            length=8,
            dtype=DType.U64,
            txn_id=txn,
            client_id=client_id,
            payload=struct.pack("<Q", value),
        )
    )


def test_rkey_enforced_at_the_switch_per_opcode_nothing_forwarded(pool: Pool) -> None:
    g, r = pool.inter.gaddr, pool.ranged.gaddr
    u64 = dict(dtype=DType.U64, length=8)
    cases = [
        (Packet(Opcode.READ, rkey=0xB0B, addr=g, length=8), Status.BAD_RKEY),
        (Packet(Opcode.READ, rkey=0, addr=g, length=8), Status.BAD_RKEY),
        (Packet(Opcode.WRITE, rkey=0x1234, addr=g, length=8, payload=bytes(8)), Status.BAD_RKEY),
        (
            Packet(Opcode.ADD, rkey=0xB0B, addr=g, length=8, dtype=DType.I64, payload=bytes(8)),
            Status.BAD_RKEY,
        ),
        (Packet(Opcode.ALL_WRITE, rkey=0, addr=g, length=8, payload=bytes(8)), Status.BAD_RKEY),
        (Packet(Opcode.FETCH_ADD, rkey=0xB0B, addr=r, **u64, payload=bytes(8)), Status.NO_RIGHTS),
        (Packet(Opcode.CAS, rkey=0xB0B, addr=r, **u64, payload=bytes(16)), Status.NO_RIGHTS),
        (Packet(Opcode.READ, rkey=0xB0B, addr=r + 4090, length=8), Status.OUT_OF_BOUNDS),
        (Packet(Opcode.WRITE, rkey=0xB0B, addr=r - 8, length=8, payload=bytes(8)), Status.NO_ROUTE),
        (
            Packet(Opcode.FETCH_ADD, rkey=0xA11CE, addr=g + 4, **u64, payload=bytes(8)),
            Status.MISALIGNED,
        ),
        (
            Packet(Opcode.WRITE, rkey=0xA11CE, addr=g + STRIDE - 4, length=8, payload=bytes(8)),
            Status.SPANS_NODES,
        ),
        (
            Packet(
                Opcode.CHAIN_ADD,
                rkey=0xA11CE,
                addr=g,
                length=8,
                dtype=DType.F32,
                segments=(pool.endpoints[0],),
                payload=bytes(8),
            ),
            Status.NO_ROUTE,
        ),
    ]
    before = [mem.memory.copy() for mem in pool.nodes]
    for packet, status in cases:
        [(nack, src)] = pool.request(packet)
        assert (nack.opcode, nack.status, src) == (Opcode.NACK, status, VIP), packet.opcode
    for core, mem in zip(pool.nodes, before):
        assert core.counters[C.RX_PACKETS] == 0  # the switch forwarded nothing
        assert np.array_equal(core.memory, mem)
    values = counters_from_payload(pool.request(Packet(Opcode.COUNTERS, rkey=ADMIN))[0][0].payload)
    regions = {r["gaddr"]: r for r in values["regions"]}
    assert regions[g]["nacks"] == 7 and regions[g]["spans_nodes"] == 1
    assert values["ports"][0]["rx_packets"] == len(cases) + 1


def test_node_hop_enforces_too(pool: Pool) -> None:
    """The switch's map grants ATOMIC but the node registered the backing read-only under the
    same rkey: the node refuses and the NACK reaches the client through the return segment."""
    g = pool.inter.gaddr
    node, local = pool.inter.locate(0)
    core = pool.nodes[node]
    core.deregister_region(0xA11CE)
    core.register_region(0x10000, pool.inter.ways[0].size, Rights.READ, rkey=0xA11CE)
    [(nack, src)] = fetch_add(pool, g)
    assert (nack.opcode, nack.status, src) == (Opcode.NACK, Status.NO_RIGHTS, pool.endpoints[node])
    assert nack.ret == CLIENT and nack.flags & Flags.RELAYED
    assert bytes(core.memory[local : local + 8]) == bytes(8)


def test_multicast_fan_out_and_membership(pool: Pool) -> None:
    group_u64 = endpoint_to_u64(GROUP)
    [(nack, _)] = pool.request(Packet(Opcode.JOIN, rkey=1, addr=group_u64))
    assert nack.status == Status.UNAUTHORIZED
    [(nack, _)] = pool.request(
        Packet(Opcode.JOIN, rkey=ADMIN, addr=group_u64, aux_addr=endpoint_to_u64(OTHER))
    )
    assert nack.status == Status.NOT_MEMBER  # only cluster nodes receive replicas
    [(nack, _)] = pool.request(
        Packet(
            Opcode.JOIN,
            rkey=ADMIN,
            addr=endpoint_to_u64(("10.0.0.1", 1)),
            aux_addr=endpoint_to_u64(pool.endpoints[0]),
        )
    )
    assert nack.status == Status.BAD_FIELD
    for ep in pool.endpoints:
        [(ack, _)] = pool.request(
            Packet(Opcode.JOIN, rkey=ADMIN, addr=group_u64, aux_addr=endpoint_to_u64(ep))
        )
        assert ack.opcode == Opcode.ACK
    assert pool.switch.groups() == {GROUP: sorted(pool.endpoints, key=endpoint_to_u64)}
    changes = [pool.switch.next_event() for _ in range(3)]
    assert all(c is not None and c.joined for c in changes)
    payload = np.arange(16, dtype="<f4").tobytes()
    write = Packet(
        Opcode.ALL_WRITE,
        flags=Flags.MCAST | Flags.ACK_REQ,
        rkey=0xA11CE,
        addr=0x10000 + 64,
        aux_addr=group_u64,
        dtype=DType.F32,
        length=64,
        payload=payload,
    )
    replies = pool.request(write)
    assert sorted(src for _, src in replies) == sorted(pool.endpoints)  # one ACK per member
    assert all(p.opcode == Opcode.ACK and p.flags & Flags.MCAST for p, _ in replies)
    for core in pool.nodes:
        assert bytes(core.memory[0x10000 + 64 : 0x10000 + 128]) == payload
    assert pool.switch.sw[K.SW_REPLICATED] == 3
    pool.request(
        Packet(
            Opcode.LEAVE, rkey=ADMIN, addr=group_u64, aux_addr=endpoint_to_u64(pool.endpoints[2])
        )
    )
    assert len(pool.request(write)) == 2
    [(nack, _)] = pool.request(
        Packet(**{**write.__dict__, "aux_addr": endpoint_to_u64(("239.77.0.9", 1))})
    )
    assert nack.status == Status.NO_ROUTE
    [(nack, _)] = pool.request(Packet(**{**write.__dict__, "opcode": Opcode.WRITE}))
    assert nack.status == Status.BAD_FIELD  # only ALL_WRITE is replicated


def test_control_at_the_switch(pool: Pool) -> None:
    [(info, src)] = pool.request(Packet(Opcode.PING))
    assert info.opcode == Opcode.INFO and src == VIP
    version, mtu, memory, _, _, rank, world = struct.unpack("<IIQIIII", info.payload)
    assert (version, rank, world, memory) == (
        1,
        0xFFFFFFFF,
        3,
        3 << 20,
    )  # the capacity, not what is mapped
    [(nack, _)] = pool.request(
        Packet(Opcode.REGISTER, rkey=ADMIN, length=8, aux_addr=64, payload=bytes(8))
    )
    assert nack.status == Status.BAD_FIELD and b"netdam pool alloc" in nack.payload
    pool.fabric.send(CLIENT, VIP, b"\x01\x01" + bytes(20))  # shorter than a header: dropped
    pool.fabric.send(CLIENT, VIP, b"\x02" + encode_packet(Packet(Opcode.PING))[1:])
    pool.fabric.run_until_idle()
    [(data, _)] = pool.fabric.receive(CLIENT)
    assert decode_packet(data).status == Status.BAD_VERSION
    assert pool.switch.counters[C.DROP_TRUNCATED] == 1


def run_fetch_adds(pool: Pool, count: int, client_id: int = 0x51) -> int:
    """FETCH_ADD 1, `count` times, each retried with the same txn until answered."""
    addr = pool.inter.gaddr + STRIDE + 16
    for k in range(count):
        for _attempt in range(50):
            replies = fetch_add(pool, addr, txn=1000 + k, client_id=client_id)
            if any(p.opcode == Opcode.ACK for p, _ in replies):
                break
            pool.fabric.advance(0.1)
        else:
            raise AssertionError("never answered")
    node, local = pool.inter.locate(STRIDE + 16)
    return int(struct.unpack("<Q", bytes(pool.nodes[node].memory[local : local + 8]))[0])


def test_retries_under_loss_never_apply_twice() -> None:
    pool = make_pool(FaultSpec(loss=0.3, dup=0.2, reorder=0.2, seed=11), seed=4)
    pool.switch.set_link_faults(2, K.DIR_TX, FaultSpec(loss=0.2, dup=0.3))
    assert run_fetch_adds(pool, 40) == 40
    node = pool.nodes[1]
    assert node.counters[C.DUP_REPLAYS] > 0  # retries and duplicates reached the node
    assert pool.switch.port_ctr[2, K.P_FAULT_DROPS_TX] > 0
    assert pool.switch.port_ctr[2, K.P_FAULT_DUPS] > 0


def test_kth_packet_of_an_opcode_is_dropped() -> None:
    pool = make_pool()
    [(_, _, spec)] = parse_faults("client:rx:kth=FETCH_ADD@3", 3)
    pool.switch.set_link_faults(0, K.DIR_RX, spec)
    got = [fetch_add(pool, pool.inter.gaddr, txn=500 + k, client_id=9) for k in range(5)]
    assert [len(r) for r in got] == [1, 1, 0, 1, 1]
    assert pool.switch.sw[K.SW_KTH_DROPS] == 1
    # Reads are not counted by the rule.
    assert pool.request(Packet(Opcode.READ, rkey=0xA11CE, addr=pool.inter.gaddr, length=8))


def fault_run(seed: int) -> tuple[list[int], list[int]]:
    pool = make_pool(seed=seed)
    for port in range(4):
        for direction in (K.DIR_RX, K.DIR_TX):
            pool.switch.set_link_faults(
                port,
                direction,
                FaultSpec(loss=0.15, dup=0.15, reorder=0.2, delay=0.1, delay_s=0.01),
            )
    outcome = []
    for k in range(60):
        replies = pool.request(
            Packet(Opcode.READ, rkey=0xA11CE, addr=pool.inter.gaddr + 8 * k, length=8)
        )
        outcome.append(len(replies))
    return outcome, pool.switch.port_ctr.reshape(-1).tolist()


def test_link_faults_replay_exactly() -> None:
    a, b, c = fault_run(3), fault_run(3), fault_run(4)
    assert a == b and a != c
    outcome, ports = a
    assert 0 in outcome and 2 in outcome  # losses and duplicates both happened
    held = np.array(ports).reshape(4, K.PORT_FIELDS)[:, K.P_FAULT_HELD]
    assert held.sum() > 0  # reordered or delayed datagrams were released later


def test_fault_text_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="OPCODE@K"):
        parse_faults("client:rx:kth=FETCH_ADD", 2)
    with pytest.raises(ValueError, match="node0..node1"):
        parse_faults("node7:rx:loss=0.1", 2)
    with pytest.raises(ValueError, match="LINK:rx|tx:SPEC"):
        parse_faults("client:loss=0.1", 2)
