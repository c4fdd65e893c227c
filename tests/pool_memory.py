"""The pool's allocator and switch in memory (SPEC.md 11.9): a ``PoolService`` on a fresh state
file over nodes that behave as SPEC.md 6.1 tells the allocator, and a ``SwitchCore`` (its compiled
datapath) in front of it on an in-memory fabric. Fast, exact numbers for the pool's tests."""

from __future__ import annotations

from pathlib import Path

from netdam.cluster.clusterfile import ClusterFile, NodeEntry
from netdam.core.fabric import Fabric
from netdam.core.guard import GuardConfig
from netdam.core.node import MAX_REGIONS
from netdam.protocol.constants import Opcode, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import AllocRequest, pack_credential, unpack_region_info
from netdam.switch.controller import PoolService, tenant_table
from netdam.switch.core import SwitchConfig, SwitchCore
from netdam.switch.state import PoolNode, PoolState, load_state, save_state

ADMIN = 0x5EC12E7
PAGE = 4096


class SpecNodes:
    """The nodes as SPEC.md 6.1 describes them to the allocator: REGISTER_ANYWHERE places the
    region first fit at a page boundary and answers its base; NO_SPACE when no range fits or
    the region table (MAX_REGIONS) is full; EXISTS for an rkey in use."""

    def __init__(self, memory: dict[Endpoint, int]) -> None:
        self.memory = memory
        self.tables: dict[Endpoint, dict[int, tuple[int, int]]] = {ep: {} for ep in memory}
        self.asked: list[Endpoint] = []
        #: Region slots per node: MAX_REGIONS, as a node has.
        self.slots = MAX_REGIONS

    def register(
        self, node: Endpoint, size: int, rights: int, rkey: int, tag_key: bytes = b""
    ) -> tuple[Status, int]:
        self.asked.append(node)
        table = self.tables[node]
        if rkey in table:
            return Status.EXISTS, 0
        if len(table) >= self.slots:
            return Status.NO_SPACE, 0
        base = 0
        for start, length in sorted(table.values()):
            if base + size <= start:
                break
            base = max(base, -(-(start + length) // PAGE) * PAGE)
        if base + size > self.memory[node]:
            return Status.NO_SPACE, 0
        table[rkey] = (base, size)
        return Status.OK, base

    def deregister(self, node: Endpoint, rkey: int) -> Status:
        return Status.OK if self.tables[node].pop(rkey, None) else Status.BAD_RKEY

    def direct(self, node: Endpoint, count: int, size: int = 8) -> None:
        """*count* regions registered on *node* by someone else than the pool (a direct client,
        a collective): the switch does not count them."""
        for k in range(count):
            assert self.register(node, size, 7, 0xD0000000 + k)[0] == Status.OK


class Allocator:
    """A PoolService on a fresh state file over nodes of the given memory sizes."""

    def __init__(self, tmp_path: Path, memory: list[int]) -> None:
        self.endpoints = [("127.0.0.1", 7001 + r) for r in range(len(memory))]
        self.nodes = SpecNodes(dict(zip(self.endpoints, memory, strict=True)))
        self.path = tmp_path / "pool.json"
        save_state(
            self.path,
            PoolState(
                nodes=[PoolNode(ip, port, m) for (ip, port), m in zip(self.endpoints, memory)]
            ),
        )
        entries = tuple(
            NodeEntry(rank=r, address=ip, port=port, memory_bytes=m)
            for r, ((ip, port), m) in enumerate(zip(self.endpoints, memory))
        )
        self.service = PoolService(
            ClusterFile(name="quota", admin_key=ADMIN, mtu=9000, nodes=entries),
            self.path,
            self.nodes,
        )
        self.txn = 0

    def ask(
        self, opcode: Opcode, payload: bytes, rkey: int = 0, addr: int = 0, proven: bool = True
    ) -> Packet:
        """The answer as the switch sends it (header fields as in SwitchCore._pool_request)."""
        self.txn += 1
        reply = self.service.handle(
            Packet(
                opcode,
                client_id=5,
                txn_id=self.txn,
                rkey=rkey,
                addr=addr,
                length=len(payload),
                payload=payload,
            ),
            0x7F00000190000,
            proven,
            admin=rkey == ADMIN,
        )
        return Packet(
            reply.opcode,
            status=reply.status,
            rkey=reply.rkey or 0,
            addr=reply.addr or 0,
            length=len(reply.payload or reply.text.encode()),
            payload=reply.payload or reply.text.encode(),
        )

    def alloc(self, size: int, credential: int = 0, admin: bool = False, **kw: int) -> Packet:
        return self.ask(
            Opcode.ALLOC,
            AllocRequest(size, credential, **kw).encode(),
            rkey=ADMIN if admin or credential == 0 else 0,
        )

    def free(self, gaddr: int, credential: int) -> Packet:
        return self.ask(Opcode.FREE, pack_credential(credential), addr=gaddr)

    def tenant(self, size: int = PAGE, label: str = "") -> tuple[int, int]:
        """A new tenant (the admin's ALLOC): (credential, gaddr of its first region)."""
        info = unpack_region_info(ok(self.alloc(size, label=label)).payload)
        return info.credential, info.gaddr

    def state(self) -> PoolState:
        return load_state(self.path)


def ok(reply: Packet) -> Packet:
    assert reply.opcode == Opcode.ACK, (reply.status.name, reply.payload)
    return reply


def refused(reply: Packet, status: Status) -> str:
    assert reply.opcode == Opcode.NACK and reply.status == status, (
        reply.status.name,
        reply.payload,
    )
    return bytes(reply.payload).decode()


# ------------------------------------------------------------------ quotas


VIP: Endpoint = ("127.0.0.1", 7744)
CLIENT: Endpoint = ("127.0.0.1", 9001)


def switch_with_pool(
    tmp_path: Path, nodes: int, guard: GuardConfig
) -> tuple[Fabric, SwitchCore, Allocator]:
    pool = Allocator(tmp_path, [1 << 20] * nodes)
    switch = SwitchCore(
        SwitchConfig(
            vip=VIP,
            nodes=tuple(pool.endpoints),
            admin_key=ADMIN,
            guard=guard,
            pool_bytes=pool.state().capacity,
        )
    )
    switch.pool = pool.service
    pool.service.on_change = lambda state: (
        switch.set_regions(state.regions, state.generation),
        switch.set_tenants(tenant_table(state)),
    )
    fabric = Fabric()
    fabric.add_core(VIP, switch)
    fabric.add_endpoint(CLIENT)
    return fabric, switch, pool


def exchange(fabric: Fabric, packet: Packet) -> tuple[Packet, int]:
    """One datagram from CLIENT to the VIP: the answer and its size in bytes."""
    fabric.send(CLIENT, VIP, encode_packet(packet))
    fabric.run_until_idle()
    [(data, _)] = fabric.receive(CLIENT)
    return decode_packet(data), len(data)
