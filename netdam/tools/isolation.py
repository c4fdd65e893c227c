"""Isolation campaign (SPEC.md 3.1, 4, 7, 8, 11 and 12): two tenants of one pool, the attacker
trying thousands of cross-accesses of every kind, through the switch and straight at the nodes,
with the same compiled cores the node and switch processes run, on the in-memory fabric.

For every kind ``run_kind`` reports what a failure would be: a cross-access that succeeded (a
READ_RESP, ACK or INFO of the victim's came back), a byte changed outside the attacker's own
regions, a 16-byte run of the victim's memory that reached the attacker, a datagram to a third
party, and the counts each kind must show. ``victim_unaffected`` then checks that the victim
works as before. ``netdam isolation`` and tests/security/test_isolation.py run both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from netdam.cluster.tenants import tenant_keys_of
from netdam.core.fabric import Fabric
from netdam.core.node import NodeConfig, NodeCore
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Flags, Opcode, ReduceOp, Rights, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import (
    AllocRequest,
    pack_credential,
    pack_key_rights,
    pack_register,
    pack_u64,
    unpack_u64,
)
from netdam.protocol.tag import seal_control
from netdam.switch.addrmap import GLOBAL_BASE, Region, Way, backing_per_way
from netdam.switch.core import SwitchConfig, SwitchCore

VIP: Endpoint = ("127.0.0.1", 7744)
VICTIM: Endpoint = ("127.0.0.1", 9001)
ATTACKER: Endpoint = ("127.0.0.1", 9666)
BYSTANDER: Endpoint = ("127.0.0.1", 9777)
GROUP: Endpoint = ("239.77.0.9", 7744)
ADMIN = 0x5EC12E7
ADMIN_TAG_KEY = bytes(range(200, 216))
NODES = 3
STRIDE = 8192
ALL = int(Rights.READ | Rights.WRITE | Rights.ATOMIC)
VICTIM_RKEY = 0xA11CE
ATTACKER_RKEY = 0xB0B
#: A collective's key (members only, SPEC.md 4.1) over each node's collective buffer: the
#: attacker knows it, as if sniffed from the all-gather's multicast group.
COLL_RKEY = 0xC011
#: A tagged region (SPEC.md 2.6) on node 2, whose rkey the attacker knows but not its tag key.
TAGGED_RKEY, TAGGED_KEY = 0x7A66ED, bytes(range(16, 32))
TAGGED_LOCAL, TAGGED_SIZE = 0x40000, 4096
COLL_BASE, COLL_SIZE = 0x80000, 0x10000
#: Attempts per kind by default: 23 kinds, 57,500 attempts (10,000 each took ~1.2 s per kind).
ATTEMPTS = 2_500
#: A pool tenant of the switch (SPEC.md 11.9, "Tenant tags"): its id is public, its key is not.
VICTIM_TENANT = tenant_keys_of(0x7E11A17)
#: Datagrams sent before the fabric runs to idle: keeps every NACK (no send queue overflow).
BURST = 256


@dataclass
class Tenancy:
    fabric: Fabric
    nodes: list[NodeCore]
    endpoints: list[Endpoint]
    victim: Region
    attacker: Region
    switch: SwitchCore
    #: The admin's sealed JOINs of the set-up, as a sniffer with root would have seen them.
    sniffed: list[bytes]

    def secrets(self) -> list[tuple[int, int, int]]:
        """(node, lo, hi) of every byte the attacker must never see: the victim's backing and
        the collective's buffers."""
        ways = [(w.node, w.local, w.local + w.size) for w in self.victim.ways]
        tagged = [(2, TAGGED_LOCAL, TAGGED_LOCAL + TAGGED_SIZE)]
        return ways + tagged + [(n, COLL_BASE, COLL_BASE + COLL_SIZE) for n in range(NODES)]

    def own_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Node -> [lo, hi) ranges the attacker may legitimately write."""
        ranges: dict[int, list[tuple[int, int]]] = {i: [] for i in range(NODES)}
        for way in self.attacker.ways:
            ranges[way.node].append((way.local, way.local + way.size))
        return ranges


def make_tenancy() -> Tenancy:
    """Two tenants of one pool on 3 nodes and the switch (the compiled cores the processes run),
    a tagged region, a collective's buffers and a multicast group, on the in-memory fabric."""
    fabric = Fabric()
    endpoints = [("127.0.0.1", 7001 + i) for i in range(NODES)]
    nodes = []
    for rank, ep in enumerate(endpoints):
        core = NodeCore(
            NodeConfig(
                endpoint=ep,
                memory_bytes=1 << 20,
                admin_key=ADMIN,
                admin_tag_key=ADMIN_TAG_KEY,
                members=tuple(endpoints) + (VIP,),
                rank=rank,
                world_size=NODES,
            )
        )
        fabric.add_core(ep, core)
        nodes.append(core)
    size = 6 * STRIDE
    victim = Region(
        GLOBAL_BASE,
        size,
        VICTIM_RKEY,
        ALL,
        STRIDE,
        tuple(Way(r, 0x10000, backing_per_way(size, STRIDE, NODES)) for r in range(NODES)),
    )
    # The attacker's region sits right behind the victim's backing on node 1 and in the pool.
    attacker = Region(
        GLOBAL_BASE + (1 << 20),
        4096,
        ATTACKER_RKEY,
        ALL,
        0,
        (Way(1, 0x10000 + backing_per_way(size, STRIDE, NODES), 4096),),
    )
    tagged = Region(
        GLOBAL_BASE + (2 << 20),
        TAGGED_SIZE,
        TAGGED_RKEY,
        ALL,
        0,
        (Way(2, TAGGED_LOCAL, TAGGED_SIZE),),
        tag_key=TAGGED_KEY,
    )
    for region in (victim, attacker, tagged):
        for way in region.ways:
            nodes[way.node].register_region(
                way.local, way.size, Rights(region.rights), rkey=region.rkey, tag_key=region.tag_key
            )
    for node in nodes:
        node.register_region(COLL_BASE, COLL_SIZE, Rights(ALL) | Rights.MEMBERS, rkey=COLL_RKEY)
    switch = SwitchCore(
        SwitchConfig(
            vip=VIP, nodes=tuple(endpoints), admin_key=ADMIN, admin_tag_key=ADMIN_TAG_KEY, seed=0
        ),
        [victim, attacker, tagged],
        generation=1,
    )
    switch.set_tenants({VICTIM_TENANT.id: ("victim", VICTIM_TENANT.tag_key)})
    fabric.add_core(VIP, switch)
    for ep in (VICTIM, ATTACKER, BYSTANDER):
        fabric.add_endpoint(ep)
    rng = np.random.default_rng(7)
    for node in nodes:  # the victim's data: a secret pattern, everything else random
        node.memory[:] = rng.integers(0, 256, node.memory.shape[0], dtype=np.uint8)
    sniffed = []
    for k, ep in enumerate(endpoints):  # a multicast group of all nodes, set up by the admin
        join = Packet(
            Opcode.JOIN,
            client_id=77,
            txn_id=k + 1,
            addr=endpoint_to_u64(GROUP),
            aux_addr=endpoint_to_u64(ep),
        )
        sniffed.append(seal_control(ADMIN_TAG_KEY, encode_packet(join)))
        fabric.send(VICTIM, VIP, sniffed[-1])
    fabric.run_until_idle()
    if not all(decode_packet(d).opcode == Opcode.ACK for d, _ in fabric.receive(VICTIM)):
        raise RuntimeError("the isolation campaign's set-up: the switch refused the admin's JOIN")
    return Tenancy(fabric, nodes, endpoints, victim, attacker, switch, sniffed)


# ------------------------------------------------------------------------ attack generators

Attack = Callable[[np.random.Generator, Tenancy], tuple[Endpoint, Packet]]


def _victim_gaddr(rng: np.random.Generator, t: Tenancy, length: int) -> int:
    return int(t.victim.gaddr) + int(rng.integers(0, t.victim.size - length + 1)) // 8 * 8


def _victim_local(rng: np.random.Generator, t: Tenancy, length: int) -> tuple[int, int]:
    way = t.victim.ways[int(rng.integers(0, len(t.victim.ways)))]
    return way.node, way.local + int(rng.integers(0, way.size - length + 1)) // 8 * 8


def _key(rng: np.random.Generator) -> int:
    """The attacker's own rkey (the right key for the wrong memory) or a guess."""
    return ATTACKER_RKEY if rng.random() < 0.5 else int(rng.integers(1, 2**32))


def _ids(rng: np.random.Generator) -> dict[str, int]:
    return {"client_id": int(rng.integers(0, 2**32)), "txn_id": int(rng.integers(0, 2**32))}


def _data_op(opcode: Opcode, via_switch: bool) -> Attack:
    def attack(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
        length = (
            int(rng.choice([8, 64, 1024, 8192]))
            if opcode in (Opcode.READ, Opcode.WRITE, Opcode.ADD)
            else 8
        )
        if via_switch:
            dst, addr = VIP, _victim_gaddr(rng, t, length)
        else:
            node, addr = _victim_local(rng, t, length)
            dst = t.endpoints[node]
        payload = {
            Opcode.READ: b"",
            Opcode.FETCH_ADD: pack_u64(1),
            Opcode.CAS: pack_u64(0) + pack_u64(1),
        }.get(opcode, bytes(rng.integers(0, 256, length, dtype=np.uint8)))
        dtype = DType.U64 if opcode in (Opcode.FETCH_ADD, Opcode.CAS) else DType.F32
        # An UPDATE names a descriptor at addr (the victim's memory here) and step 1 of its
        # first chunk: two f32 gradient elements.
        step = 1 if opcode == Opcode.UPDATE else 0
        return dst, Packet(
            opcode,
            flags=Flags.ACK_REQ,
            epoch=step,
            rkey=_key(rng),
            addr=addr,
            length=length,
            dtype=dtype,
            reduce_op=ReduceOp.SUM if opcode == Opcode.ADD else ReduceOp(0),
            payload=payload,
            **_ids(rng),
        )

    return attack


def _straddle(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """The attacker's own key and region, the range running off its start into the victim's."""
    way = t.attacker.ways[0]
    over = int(rng.integers(1, 512)) * 8
    if rng.random() < 0.5:  # straight at the node, local addresses
        return t.endpoints[way.node], Packet(
            Opcode.READ, rkey=ATTACKER_RKEY, addr=way.local - over, length=2 * over, dtype=DType.RAW
        )
    return VIP, Packet(
        Opcode.READ,
        rkey=ATTACKER_RKEY,
        addr=t.attacker.gaddr - over,
        length=2 * over,
        dtype=DType.RAW,
    )


def _chain_through_victim(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """CHAIN_ADD whose operand is the victim's memory, routed through victim nodes, with the last
    segment the attacker itself (a non-member) or a victim node storing into attacker memory."""
    node, addr = _victim_local(rng, t, 1024)
    attacker_way = t.attacker.ways[0]
    if rng.random() < 0.5:
        segments = (t.endpoints[node], ATTACKER)
        aux = addr
    else:
        segments = (t.endpoints[node], t.endpoints[attacker_way.node])
        aux = attacker_way.local
    return t.endpoints[node], Packet(
        Opcode.CHAIN_ADD,
        flags=Flags.ACK_REQ,
        rkey=_key(rng),
        addr=addr,
        aux_addr=aux,
        length=1024,
        dtype=DType.F32,
        reduce_op=ReduceOp.SUM,
        segments=segments,
        segments_left=1,
        ret=ATTACKER,
        payload=bytes(1024),
        **_ids(rng),
    )


def _multicast_write(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    _, addr = _victim_local(rng, t, 64)
    return VIP, Packet(
        Opcode.ALL_WRITE,
        flags=Flags.MCAST | Flags.ACK_REQ,
        rkey=_key(rng),
        addr=addr,
        aux_addr=endpoint_to_u64(GROUP),
        length=64,
        dtype=DType.RAW,
        payload=bytes(64),
        **_ids(rng),
    )


def _control(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """Control opcodes with a guessed admin key: REGISTER the victim's memory, DEREGISTER its
    rkey, JOIN a group, read COUNTERS, START_COLL."""
    node = int(rng.integers(0, NODES))
    dst = t.endpoints[node] if rng.random() < 0.7 else VIP
    opcode = [Opcode.REGISTER, Opcode.DEREGISTER, Opcode.JOIN, Opcode.COUNTERS, Opcode.START_COLL][
        int(rng.integers(0, 5))
    ]
    key = int(rng.integers(1, 2**32))
    if key == ADMIN:
        key += 1
    payload = {
        Opcode.REGISTER: pack_register(0, ALL),
        Opcode.DEREGISTER: pack_key_rights(VICTIM_RKEY, 0),
        Opcode.START_COLL: bytes(64),
    }.get(opcode, b"")
    return dst, Packet(
        opcode,
        rkey=key,
        addr=0x10000 if opcode == Opcode.REGISTER else endpoint_to_u64(GROUP),
        aux_addr=1 << 16,
        length=len(payload),
        payload=payload,
        coll_id=1 if opcode == Opcode.START_COLL else 0,
        **_ids(rng),
    )


def _admin_key_without_control_tag(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """The same control opcodes with the real admin key (sniffed, or guessed at last) but no
    control tag, or with a made-up control tag: where the admin tag key is set, neither is the
    admin's authority (SPEC.md 2.6, "Control tags")."""
    dst, packet = _control(rng, t)
    if rng.random() < 0.5:
        return dst, replace(packet, rkey=ADMIN)
    return dst, replace(packet, rkey=0, flags=Flags.TAGGED, tag=int(rng.integers(0, 2**63)))


def _tenant_without_its_key(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """ALLOC, FREE (of the victim's region) and QUERY to the VIP naming the victim tenant's id
    under a made-up tag, or an id no tenant has (SPEC.md 11.9, "Tenant tags")."""
    opcode = [Opcode.ALLOC, Opcode.FREE, Opcode.QUERY][int(rng.integers(0, 3))]
    payload = (
        AllocRequest(4096, 0, 0, 0, ALL, "").encode()
        if opcode == Opcode.ALLOC
        else pack_credential(0)
    )
    tenant = VICTIM_TENANT.id if rng.random() < 0.5 else int(rng.integers(1, 2**32)) | 1
    return VIP, Packet(
        opcode,
        rkey=tenant,
        addr=0 if opcode == Opcode.ALLOC else t.victim.gaddr,
        flags=Flags.TAGGED,
        tag=int(rng.integers(0, 2**63)),
        length=len(payload),
        payload=payload,
        **_ids(rng),
    )


def _replayed_control(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """The admin's sealed JOINs, sniffed and re-sent as they were from the attacker's socket
    (SPEC.md 2.6, "Control tags": a proven datagram from another source is a replay)."""
    return VIP, decode_packet(t.sniffed[int(rng.integers(0, len(t.sniffed)))])


def _reply_to_third_party(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """A legitimate READ of the attacker's own memory asking for the reply to go elsewhere."""
    way = t.attacker.ways[0]
    dst, addr = (
        (VIP, t.attacker.gaddr) if rng.random() < 0.5 else (t.endpoints[way.node], way.local)
    )
    return dst, Packet(
        Opcode.READ,
        rkey=ATTACKER_RKEY,
        addr=addr,
        length=64,
        dtype=DType.RAW,
        ret=BYSTANDER if rng.random() < 0.5 else t.endpoints[0],
    )


def _sniffed_collective_key(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """The collective's key, straight at a node: READ, WRITE, FETCH_ADD and ALL_WRITE of its
    buffer (the attacker is no member, so the key names nothing for it)."""
    node = int(rng.integers(0, NODES))
    addr = COLL_BASE + int(rng.integers(0, COLL_SIZE // 8 - 8)) * 8
    opcode = [Opcode.READ, Opcode.WRITE, Opcode.FETCH_ADD, Opcode.ALL_WRITE][
        int(rng.integers(0, 4))
    ]
    length = 8 if opcode == Opcode.FETCH_ADD else 64
    payload = b"" if opcode == Opcode.READ else bytes(length)
    return t.endpoints[node], Packet(
        opcode,
        flags=Flags.ACK_REQ if opcode != Opcode.READ else Flags.NONE,
        rkey=COLL_RKEY,
        addr=addr,
        length=length,
        dtype=DType.U64 if opcode == Opcode.FETCH_ADD else DType.RAW,
        payload=payload,
        **_ids(rng),
    )


def _made_up_tag(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """A tagged collective's datagrams (SPEC.md 2.6) with a tag the attacker made up: ALL_WRITE,
    CHAIN_ADD and READ of the collective's buffer under its key, and WRITE of the victim's
    region; without the tag key none is executed."""
    node = int(rng.integers(0, NODES))
    addr = COLL_BASE + int(rng.integers(0, COLL_SIZE // 8 - 8)) * 8
    opcode = [Opcode.READ, Opcode.ALL_WRITE, Opcode.CHAIN_ADD, Opcode.WRITE][
        int(rng.integers(0, 4))
    ]
    packet = Packet(
        opcode,
        flags=Flags.TAGGED | Flags.ACK_REQ,
        rkey=COLL_RKEY,
        addr=addr,
        coll_id=int(rng.integers(0, 3)),
        epoch=int(rng.integers(0, 3)),
        dtype=DType.F32,
        tag=int(rng.integers(0, 2**63)),
        **_ids(rng),
    )
    if opcode == Opcode.READ:
        return t.endpoints[node], replace(packet, length=64)
    if opcode == Opcode.WRITE:
        victim_node, local = _victim_local(rng, t, 64)
        packet = replace(packet, rkey=VICTIM_RKEY, addr=local, coll_id=0)
        return t.endpoints[victim_node], packet.with_payload(bytes(64))
    segments = (t.endpoints[node],) if opcode == Opcode.CHAIN_ADD else ()
    return t.endpoints[node], replace(packet, segments=segments, aux_addr=addr).with_payload(
        bytes(64)
    )


def _tagged_region_rkey(rng: np.random.Generator, t: Tenancy) -> tuple[Endpoint, Packet]:
    """A tagged region's rkey, sniffed: READ, WRITE, FETCH_ADD, CAS through the switch and at
    its node, without a tag or with a made-up one; without the region's tag key none executes."""
    opcode = [Opcode.READ, Opcode.WRITE, Opcode.FETCH_ADD, Opcode.CAS][int(rng.integers(0, 4))]
    atomic = opcode in (Opcode.FETCH_ADD, Opcode.CAS)
    length = 8 if atomic else 64
    offset = int(rng.integers(0, (TAGGED_SIZE - length) // 8)) * 8
    via_switch = rng.random() < 0.5
    dst, addr = (
        (VIP, GLOBAL_BASE + (2 << 20) + offset)
        if via_switch
        else (t.endpoints[2], TAGGED_LOCAL + offset)
    )
    payload = b"" if opcode == Opcode.READ else bytes(16 if opcode == Opcode.CAS else length)
    made_up = rng.random() < 0.5
    packet = Packet(
        opcode,
        flags=(Flags.TAGGED if made_up else Flags.NONE)
        | (Flags.NONE if atomic or opcode == Opcode.READ else Flags.ACK_REQ),
        rkey=TAGGED_RKEY,
        addr=addr,
        length=length,
        dtype=DType.U64 if atomic else DType.RAW,
        payload=payload,
        tag=int(rng.integers(0, 2**63)) if made_up else 0,
        **_ids(rng),
    )
    return dst, packet


KINDS: dict[str, Attack] = {
    "read via switch": _data_op(Opcode.READ, True),
    "write via switch": _data_op(Opcode.WRITE, True),
    "add via switch": _data_op(Opcode.ADD, True),
    "fetch_add via switch": _data_op(Opcode.FETCH_ADD, True),
    "cas via switch": _data_op(Opcode.CAS, True),
    "read at node": _data_op(Opcode.READ, False),
    "write at node": _data_op(Opcode.WRITE, False),
    "add at node": _data_op(Opcode.ADD, False),
    "fetch_add at node": _data_op(Opcode.FETCH_ADD, False),
    "cas at node": _data_op(Opcode.CAS, False),
    "update via switch": _data_op(Opcode.UPDATE, True),
    "update at node": _data_op(Opcode.UPDATE, False),
    "straddle own region": _straddle,
    "chain through victim": _chain_through_victim,
    "multicast write": _multicast_write,
    "control with guessed key": _control,
    "admin key without control tag": _admin_key_without_control_tag,
    "reply to third party": _reply_to_third_party,
    "sniffed collective key": _sniffed_collective_key,
    "made-up tag": _made_up_tag,
    "tagged region's rkey": _tagged_region_rkey,
    "tenant id without its key": _tenant_without_its_key,
    "replayed control datagram": _replayed_control,
}


# ------------------------------------------------------------------------ the campaign


@dataclass
class KindResult:
    """What one kind of attack achieved: nothing, when ``failures()`` is empty."""

    kind: str
    attempts: int
    replies: int
    succeeded: int
    statuses: dict[str, int]
    dropped_forged: int
    dropped_replayed: int
    bytes_changed: int
    leaked_runs: int
    third_party: int
    problems: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        return self.problems


def _snapshot(t: Tenancy) -> list[np.ndarray]:
    return [node.memory.copy() for node in t.nodes]


def _send_all(t: Tenancy, attack: Attack, seed: int, attempts: int) -> list[Packet]:
    rng = np.random.default_rng(seed)
    replies: list[Packet] = []
    for start in range(0, attempts, BURST):
        for _ in range(min(BURST, attempts - start)):
            dst, packet = attack(rng, t)
            t.fabric.send(ATTACKER, dst, encode_packet(packet))
        t.fabric.run_until_idle()
        replies += [decode_packet(d) for d, _ in t.fabric.receive(ATTACKER)]
    return replies


def run_kind(t: Tenancy, kind: str, attempts: int = ATTEMPTS) -> KindResult:
    """Run *attempts* attacks of *kind* (a key of KINDS, seeded by its name: a run replays)."""
    before = _snapshot(t)
    secret = [bytes(before[node][lo:hi]) for node, lo, hi in t.secrets()]
    node0_rx = int(t.nodes[0].counters[C.RX_PACKETS])
    dropped_before = {
        c: int(t.switch.counters[c]) for c in (C.DROP_CONTROL_FORGED, C.DROP_CONTROL_REPLAYED)
    }
    replies = _send_all(t, KINDS[kind], sum(map(ord, kind)), attempts)
    dropped = {c: int(t.switch.counters[c]) - n for c, n in dropped_before.items()}
    succeeded = [r for r in replies if r.opcode != Opcode.NACK]
    statuses = Counter(Status(r.status).name for r in replies if r.opcode == Opcode.NACK)
    problems = []
    if kind == "reply to third party":
        # Legit reads of its own memory: every one answered, to the attacker itself, none to the
        # bystander or to node 0, although the return segment named them.
        if len(succeeded) != attempts:
            problems.append(f"{len(succeeded)} of {attempts} of its own READs answered")
        if int(t.nodes[0].counters[C.RX_PACKETS]) != node0_rx:
            problems.append("a reply went to node 0, which the return segment named")
    elif succeeded:
        problems.append(f"{len(succeeded)} of {attempts} succeeded, e.g. {succeeded[0]}")
    if kind == "replayed control datagram":  # none answered, every one counted
        if replies or dropped[C.DROP_CONTROL_REPLAYED] != attempts:
            problems.append(
                f"{len(replies)} replays answered, {dropped[C.DROP_CONTROL_REPLAYED]} counted"
            )
    elif (
        kind == "tenant id without its key"
    ):  # unknown ids refused, the victim's id under a made-up tag dropped
        if (
            set(statuses) - {"UNAUTHORIZED"}
            or statuses["UNAUTHORIZED"] + dropped[C.DROP_CONTROL_FORGED] != attempts
        ):
            problems.append(
                f"answers {dict(statuses)}, {dropped[C.DROP_CONTROL_FORGED]} counted forged"
            )
    elif kind != "reply to third party" and not statuses:
        problems.append("no attempt was refused with a NACK")
    third = len(t.fabric.receive(BYSTANDER)) + len(t.fabric.receive(VICTIM))
    if third:
        problems.append(f"{third} datagrams reached the bystander or the victim")
    # Nothing outside the attacker's own regions changed, not one byte.
    own = t.own_ranges()
    changed_bytes = 0
    for i, node in enumerate(t.nodes):
        mask = np.ones(node.memory.shape[0], bool)
        for lo, hi in own[i]:
            mask[lo:hi] = False
        changed = np.flatnonzero((node.memory != before[i]) & mask)
        if changed.size:
            problems.append(f"node {i} bytes changed at {changed[:8].tolist()}")
        changed_bytes += int(changed.size)
    # No 16-byte run of the victim's memory reached the attacker.
    received = b"".join(r.payload for r in replies)
    leaked = sum(
        blob[at : at + 16] in received for blob in secret for at in range(0, len(blob) - 16, 997)
    )
    if leaked:
        problems.append(f"{leaked} 16-byte runs of the victim's memory reached the attacker")
    return KindResult(
        kind,
        attempts,
        len(replies),
        len(succeeded),
        dict(statuses),
        dropped[C.DROP_CONTROL_FORGED],
        dropped[C.DROP_CONTROL_REPLAYED],
        changed_bytes,
        leaked,
        third,
        problems,
    )


def victim_unaffected(t: Tenancy) -> list[str]:
    """After the attacks (and a borrowed client id), the victim writes, reads and counts as
    usual; what went wrong, or nothing."""
    problems: list[str] = []
    g = t.victim.gaddr
    data = bytes(range(256)) * 4
    t.fabric.send(
        VICTIM,
        VIP,
        encode_packet(
            Packet(
                Opcode.WRITE,
                flags=Flags.ACK_REQ,
                client_id=5,
                txn_id=1,
                rkey=VICTIM_RKEY,
                addr=g,
                length=1024,
                dtype=DType.RAW,
                payload=data,
            )
        ),
    )
    # The attacker borrows the victim's client id and next txn ids through the switch, on node 1,
    # where its region and the victim's stripe 1 live side by side.
    for txn in range(2, 10):
        t.fabric.send(
            ATTACKER,
            VIP,
            encode_packet(
                Packet(
                    Opcode.FETCH_ADD,
                    client_id=5,
                    txn_id=txn,
                    rkey=ATTACKER_RKEY,
                    addr=t.attacker.gaddr,
                    length=8,
                    dtype=DType.U64,
                    payload=pack_u64(1),
                )
            ),
        )
    t.fabric.run_until_idle()
    t.fabric.receive(ATTACKER)
    acks = [decode_packet(d) for d, _ in t.fabric.receive(VICTIM)]
    if [a.opcode for a in acks] != [Opcode.ACK]:
        problems.append(f"the victim's WRITE got {[a.opcode.name for a in acks]}, not one ACK")
    for txn in range(2, 10):  # the victim's own txns 2.. execute: not duplicates, not STALE
        t.fabric.send(
            VICTIM,
            VIP,
            encode_packet(
                Packet(
                    Opcode.FETCH_ADD,
                    client_id=5,
                    txn_id=txn,
                    rkey=VICTIM_RKEY,
                    addr=g + STRIDE + 1024,
                    length=8,
                    dtype=DType.U64,
                    payload=pack_u64(1),
                )
            ),
        )
    node, local = t.victim.locate(STRIDE + 1024)
    initial = int(t.nodes[node].memory[local : local + 8].view(np.uint64)[0])
    t.fabric.run_until_idle()
    olds = sorted(unpack_u64(decode_packet(d).payload) for d, _ in t.fabric.receive(VICTIM))
    if olds != [(initial + k) % 2**64 for k in range(8)]:
        problems.append(f"the victim's FETCH_ADDs returned {olds}")
    if int(t.nodes[node].memory[local : local + 8].view(np.uint64)[0]) != (initial + 8) % 2**64:
        problems.append("the victim's counter did not count 8")
    t.fabric.send(
        VICTIM,
        VIP,
        encode_packet(
            Packet(
                Opcode.READ,
                client_id=5,
                txn_id=20,
                rkey=VICTIM_RKEY,
                addr=g,
                length=1024,
                dtype=DType.RAW,
            )
        ),
    )
    t.fabric.run_until_idle()
    resps = [decode_packet(d) for d, _ in t.fabric.receive(VICTIM)]
    if len(resps) != 1 or resps[0].opcode != Opcode.READ_RESP or resps[0].payload != data:
        problems.append("the victim's READ did not return what it wrote")
    return problems


def run_campaign(attempts: int = ATTEMPTS, kinds: list[str] | None = None) -> dict[str, object]:
    """Every kind (or *kinds*) on one tenancy, then the victim's check: the result object of
    ``netdam isolation`` (``ok`` when nothing got through)."""
    t = make_tenancy()
    results = [run_kind(t, kind, attempts) for kind in (kinds or list(KINDS))]
    victim = victim_unaffected(t)
    return {
        "ok": not victim and not any(r.failures() for r in results),
        "attempts_per_kind": attempts,
        "kinds": {
            r.kind: {
                "attempts": r.attempts,
                "succeeded": r.succeeded,
                "nacks": r.statuses,
                "dropped_forged": r.dropped_forged,
                "dropped_replayed": r.dropped_replayed,
                "bytes_changed": r.bytes_changed,
                "leaked_runs": r.leaked_runs,
                "third_party": r.third_party,
                "failures": r.failures(),
            }
            for r in results
        },
        "victim_failures": victim,
    }
