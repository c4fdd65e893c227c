"""Test helpers: a small cluster of node cores on the in-memory fabric, and a client mailbox."""

from __future__ import annotations

from dataclasses import dataclass, field

from netdam.protocol.constants import RIGHTS_ALL, Opcode
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet

from netdam.fabric import Fabric
from netdam.faults import FaultSpec
from netdam.node import NodeConfig, NodeCore

CLIENT: Endpoint = ("127.0.0.1", 9001)
ADMIN_KEY = 0x5EC12E7
MEMORY = 1 << 20
#: The region every test cluster registers on every node, under the same rkey.
RKEY = 0x1234_5678


@dataclass
class Cluster:
    fabric: Fabric
    nodes: list[NodeCore]
    endpoints: list[Endpoint]
    client: Endpoint = CLIENT
    txn: int = field(default=1)

    def send(self, node: int, packet: Packet) -> None:
        self.fabric.send(self.client, self.endpoints[node], encode_packet(packet))

    def request(self, node: int, packet: Packet) -> list[Packet]:
        """Send, run to idle, return the decoded replies the client got."""
        self.send(node, packet)
        self.fabric.run_until_idle()
        return [decode_packet(data) for data, _ in self.fabric.receive(self.client)]

    def next_txn(self) -> int:
        self.txn += 1
        return self.txn


def make_cluster(n: int = 3, faults: FaultSpec | None = None, memory: int = MEMORY) -> Cluster:
    fabric = Fabric(faults)
    endpoints = [("127.0.0.1", 7001 + i) for i in range(n)]
    nodes = []
    for rank, endpoint in enumerate(endpoints):
        core = NodeCore(
            NodeConfig(
                endpoint=endpoint,
                memory_bytes=memory,
                admin_key=ADMIN_KEY,
                members=tuple(endpoints),
                rank=rank,
                world_size=n,
            )
        )
        core.register_region(0, memory, RIGHTS_ALL, rkey=RKEY)
        fabric.add_core(endpoint, core)
        nodes.append(core)
    fabric.add_endpoint(CLIENT)
    return Cluster(fabric, nodes, endpoints)


def only(replies: list[Packet], opcode: Opcode) -> Packet:
    assert len(replies) == 1, replies
    assert replies[0].opcode == opcode, replies[0]
    return replies[0]
