"""SwitchCore: the pool switch, sans-I/O and batch-shaped, with the same verbs as NodeCore.

``receive_batch(buf, offs, lens, srcs, n, now)`` runs a batch through one numba call
(``netdam.kernels.switch_path.switch_round_kernel``: receive faults, translation or replication,
transmit faults); ``fill_send_batch(out, out_offs, out_lens, out_dsts, now) -> n`` hands back
what to send. Control opcodes, PING and replies are punted to Python here (JOIN/LEAVE of
multicast groups, COUNTERS, INFO). The switch keeps no per-request state: nodes answer the
client named in the return segment directly.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from netdam.core.authority import ControlProof, control_authority, refusal_text
from netdam.core.base import CoreBase, check_batch
from netdam.core.faults import FaultSpec
from netdam.core.guard import GuardConfig, set_admin_tag_key
from netdam.core.sendqueue import SendQueue
from netdam.kernels import switch_path as K
from netdam.kernels.guard import G_FACTOR, G_NOW, address_token, record_failure
from netdam.kernels.state import (
    FCLOCK_NOW,
    TXQ_TAIL,
    Groups,
    HoldTable,
    LinkFaults,
    RxBatch,
    SwitchCounters,
    SwitchPorts,
    SwitchState,
    Tenants,
)
from netdam.kernels.tag import verify_control_bytes
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    AMPLIFICATION_FACTOR,
    DEFAULT_MTU,
    HEADER_SIZE,
    IP_UDP_OVERHEAD,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    MIN_MTU,
    POOL_OPCODES,
    PROTOCOL_VERSION,
    REPLY_OPCODES,
    Flags,
    Opcode,
    Status,
    max_payload,
    slot_bytes,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import Endpoint, Packet, decode_packet, endpoint_to_u64, u64_to_endpoint
from netdam.protocol.payloads import INFO
from netdam.switch.addrmap import Region, build_tables

#: Send-queue bound (datagrams).
MAX_TX_QUEUE = 1 << 15
#: Datagrams held aside by reorder/delay faults at once.
HOLD_SLOTS = 256
#: Attempt-count table of fault injection (power of two).
FAULT_TABLE = 1 << 14
#: Most members of one multicast group, and most groups.
MAX_GROUP_MEMBERS = 64
MAX_GROUPS = 1024
#: The multicast range group names must come from (administratively scoped, RFC 2365).
GROUP_NET = ipaddress.IPv4Network("239.0.0.0/8")
#: Longest UTF-8 text a pool NACK carries (SPEC.md 11.9).
MAX_NACK_TEXT = 160
#: INFO's rank field at a switch (nodes have 0..N-1).
SWITCH_RANK = 0xFFFFFFFF
#: COUNTERS payload: 128 node-layout values, then the switch section (protocol/SPEC.md 11.7).
SECTION_LEN = 16
REGION_ROW = 2 + K.REGION_FIELDS
MAX_COUNTER_WORDS = MAX_PAYLOAD_BYTES // 8
#: Switch section indices (u64 index into the COUNTERS payload).
S_PORTS = C.NUM_COUNTERS + 0
S_REGIONS_TOTAL = C.NUM_COUNTERS + 1
S_FIRST_REGION = C.NUM_COUNTERS + 2
S_REGIONS_LISTED = C.NUM_COUNTERS + 3
S_SW_BASE = C.NUM_COUNTERS + 4  # sw[0..7]: forwarded, replicated, ids_filled, generation, ...

SW_NAMES = (
    "forwarded",
    "replicated",
    "client_ids_filled",
    "map_generation",
    "regions",
    "groups",
    "nodes",
    "kth_drops",
)
PORT_NAMES = (
    "rx_packets",
    "rx_bytes",
    "tx_packets",
    "tx_bytes",
    "fault_drops_rx",
    "fault_drops_tx",
    "fault_dups",
    "fault_held",
)
REGION_NAMES = (
    "forwarded",
    "bytes",
    "reads",
    "writes",
    "atomics",
    "nacks",
    "spans_nodes",
    "reserved",
)


@dataclass
class SwitchConfig:
    """Settings of one switch."""

    #: The virtual IP:port clients send to (and the source of every forwarded packet).
    vip: Endpoint
    #: Cluster nodes in rank order (port 1 + rank).
    nodes: tuple[Endpoint, ...]
    #: Key authorising control opcodes at the switch (the cluster's admin key).
    admin_key: int
    #: The cluster's admin tag key (SPEC.md 2.6, "Control tags"): given one, the switch takes
    #: the admin's control opcodes only with their control tag.
    admin_tag_key: bytes = b""
    mtu: int = DEFAULT_MTU
    #: Seed of every fault decision.
    seed: int = 0
    tx_slots: int = 256
    #: Lockout and anti-amplification for clients (SPEC.md 12); the switch process turns it on.
    guard: GuardConfig = field(default_factory=GuardConfig)
    #: The pool's capacity, the sum of the nodes' memory: what INFO reports as memory (never
    #: what the regions map, which would show every tenant the others' allocations).
    pool_bytes: int = 0


@dataclass(frozen=True)
class GroupChanged:
    """JOIN/LEAVE changed a group at the switch (the owner persists it)."""

    group: Endpoint
    member: Endpoint
    joined: bool


@dataclass(frozen=True)
class PoolReply:
    """What the switch answers an ALLOC, FREE or QUERY: an ACK (status OK) or a NACK."""

    status: Status
    payload: bytes = b""
    rkey: int | None = None
    addr: int | None = None
    text: str = ""

    @property
    def opcode(self) -> Opcode:
        return Opcode.ACK if self.status == Status.OK else Opcode.NACK


class PoolHandler(Protocol):
    """The switch's allocator (``netdam.switch.controller.PoolService``): answers ALLOC, FREE
    and QUERY (SPEC.md 11.9)."""

    def handle(
        self, packet: Packet, src: int, proven: bool, admin: bool, tenant: str = ""
    ) -> PoolReply: ...


@dataclass
class _Tables:
    nodes_ep: np.ndarray
    node_sorted: np.ndarray
    node_port: np.ndarray
    groups: dict[int, list[int]] = field(default_factory=dict)


class SwitchCore(CoreBase):
    """Address map, groups, counters, faults and the batch datapath of one switch."""

    def __init__(
        self, config: SwitchConfig, regions: Sequence[Region] = (), generation: int = 0
    ) -> None:
        if config.mtu < MIN_MTU:
            raise ValueError(
                f"MTU {config.mtu} is too small: NetDAM needs at least {MIN_MTU} (--mtu)"
            )
        if not config.nodes:
            raise ValueError(
                "a switch needs at least one node: pass the cluster file of `netdam up`"
            )
        self.config = config
        self.max_datagram = config.mtu - IP_UDP_OVERHEAD
        n_ports = 1 + len(config.nodes)
        self.n_ports = n_ports
        nodes_u64 = np.array([endpoint_to_u64(ep) for ep in config.nodes], np.uint64)
        order = np.argsort(nodes_u64, kind="stable")
        if len(set(nodes_u64.tolist())) != len(config.nodes):
            raise ValueError("the node list names one endpoint twice")
        self.cfg = np.zeros(K.CFG_LEN, np.uint64)
        self.cfg[K.CFG_VIP] = endpoint_to_u64(config.vip)
        self.cfg[K.CFG_FANOUT] = 1
        self._nodes_ep = nodes_u64
        self._node_sorted = nodes_u64[order].copy()
        self._node_port = (order + 1).astype(np.int64)
        self._trusted = set(nodes_u64.tolist())
        self.counters = C.new_counters()
        self.guard = config.guard.build()
        set_admin_tag_key(self.guard, config.admin_tag_key)
        self.sw = np.zeros(K.SW_LEN, np.uint64)
        self.sw[K.SW_NODES] = len(config.nodes)
        self.port_ctr = np.zeros((n_ports, K.PORT_FIELDS), np.uint64)
        self.regions: list[Region] = []
        self.reg_ctr = np.zeros((0, K.REGION_FIELDS), np.uint64)
        self._groups: dict[int, list[int]] = {}
        self._set_group_arrays()
        # Faults.
        self.fcfg = np.zeros((n_ports, 2, K.FAULT_FIELDS), np.float64)
        self.fkeys = np.array([config.seed & (2**64 - 1), self.cfg[K.CFG_VIP]], np.uint64)
        self.fclock = np.zeros(2, np.float64)
        self.fstate = np.zeros(K.FSTATE_LEN, np.int64)
        self.ftab_key = np.zeros(FAULT_TABLE, np.uint64)
        self.ftab_count = np.zeros(FAULT_TABLE, np.uint32)
        self.kctr = np.zeros((n_ports, 2, 64), np.int64)
        self.hold_buf = np.zeros((HOLD_SLOTS, slot_bytes(config.mtu)), np.uint8)
        self.hold_len = np.zeros(HOLD_SLOTS, np.int32)
        self.hold_ep = np.zeros(HOLD_SLOTS, np.uint64)
        self.hold_dir = np.zeros(HOLD_SLOTS, np.int64)
        self.hold_time = np.zeros(HOLD_SLOTS, np.float64)
        self.hold_gen = np.zeros(HOLD_SLOTS, np.int64)
        # Send queue (as NodeCore's: back to back, [head, tail]).
        self.sendq = SendQueue(config.tx_slots, self.counters, slot_bytes(config.mtu))
        self._punt = np.zeros(64, np.int32)
        self._events: deque[GroupChanged] = deque()
        #: The allocator answering ALLOC/FREE/QUERY (the switch process sets it; None: NACK).
        self.pool: PoolHandler | None = None
        self.set_regions(regions, generation)
        self.set_tenants({})

    # ------------------------------------------------------------------ tables

    def set_regions(self, regions: Sequence[Region], generation: int) -> None:
        """Replace the address map (checked); per-region counters follow their region."""
        tables = build_tables(regions, len(self.config.nodes))
        ordered = sorted(regions, key=lambda r: r.gaddr)
        old = {r.gaddr: self.reg_ctr[k] for k, r in enumerate(self.regions)}
        reg_ctr = np.zeros((len(ordered), K.REGION_FIELDS), np.uint64)
        for k, r in enumerate(ordered):
            if r.gaddr in old:
                reg_ctr[k] = old[r.gaddr]
        self._tables = tables
        self.regions = ordered
        self.reg_ctr = reg_ctr
        self.sw[K.SW_MAP_GENERATION] = generation
        self.sw[K.SW_REGIONS] = len(ordered)

    def set_tenants(self, tenants: Mapping[int, tuple[str, bytes]]) -> None:
        """Replace the pool's tenants: id -> (owner, the digest its regions name; tag key, 16
        bytes), as netdam.cluster.tenants derives them. Their sealed ALLOC/FREE/QUERY carry the
        id in rkey and a control tag under the key (SPEC.md 11.9, "Tenant tags")."""
        ids = sorted(tenants)
        if any(not 0 < t < 1 << 32 or len(tenants[t][1]) != 16 for t in ids):
            raise ValueError("tenant ids are u32 above 0, their tag keys 16 bytes")
        self._tenants = dict(tenants)
        self._tenant_ids = np.array(ids, np.uint32)
        self._tenant_keys = np.array(
            [np.frombuffer(tenants[t][1], "<u8") for t in ids], np.uint64
        ).reshape(-1, 2)

    @property
    def generation(self) -> int:
        return int(self.sw[K.SW_MAP_GENERATION])

    def set_generation(self, generation: int) -> None:
        """The state file's generation now in force (groups changed at the switch)."""
        self.sw[K.SW_MAP_GENERATION] = generation

    def groups(self) -> dict[Endpoint, list[Endpoint]]:
        """Multicast groups at this switch: group -> members."""
        return {
            u64_to_endpoint(g): [u64_to_endpoint(m) for m in ms] for g, ms in self._groups.items()
        }

    def set_groups(self, groups: dict[Endpoint, list[Endpoint]]) -> None:
        """Replace every group (members checked like JOIN's)."""
        table: dict[int, list[int]] = {}
        for group, members in groups.items():
            self._check_group(group)
            for member in members:
                if endpoint_to_u64(member) not in self._trusted:
                    raise ValueError(
                        f"group {group[0]}:{group[1]}: member {member[0]}:{member[1]} is not a cluster node"
                    )
            table[endpoint_to_u64(group)] = sorted({endpoint_to_u64(m) for m in members})
        self._groups = {g: ms for g, ms in table.items() if ms}
        self._set_group_arrays()

    def join(self, group: Endpoint, member: Endpoint) -> Status:
        """Add *member* (a cluster node) to *group*; the status JOIN would answer."""
        try:
            self._check_group(group)
        except ValueError:
            return Status.BAD_FIELD
        g, m = endpoint_to_u64(group), endpoint_to_u64(member)
        if m not in self._trusted:
            return Status.NOT_MEMBER
        members = self._groups.get(g, [])
        if m in members:
            return Status.OK
        if len(members) >= MAX_GROUP_MEMBERS or (not members and len(self._groups) >= MAX_GROUPS):
            return Status.NO_SPACE
        self._groups[g] = sorted(members + [m])
        self._set_group_arrays()
        return Status.OK

    def leave(self, group: Endpoint, member: Endpoint) -> Status:
        g, m = endpoint_to_u64(group), endpoint_to_u64(member)
        members = [x for x in self._groups.get(g, []) if x != m]
        if members:
            self._groups[g] = members
        else:
            self._groups.pop(g, None)
        self._set_group_arrays()
        return Status.OK

    def _check_group(self, group: Endpoint) -> None:
        if ipaddress.IPv4Address(group[0]) not in GROUP_NET:
            raise ValueError(
                f"group {group[0]}:{group[1]} is not in {GROUP_NET}: name groups with 239.x addresses"
            )

    def _set_group_arrays(self) -> None:
        keys = sorted(self._groups)
        first: list[int] = []
        count: list[int] = []
        members: list[int] = []
        for g in keys:
            first.append(len(members))
            count.append(len(self._groups[g]))
            members += self._groups[g]
        self._grp_key = np.array(keys, np.uint64)
        self._grp_first = np.array(first, np.int64)
        self._grp_count = np.array(count, np.int64)
        self._grp_member = np.array(members or [0], np.uint64)
        self.cfg[K.CFG_FANOUT] = max([1] + count)
        self.sw[K.SW_GROUPS] = len(keys)

    # ------------------------------------------------------------------ faults

    def set_link_faults(self, port: int, direction: int, spec: FaultSpec) -> None:
        """Faults on *port* (0 clients, 1 + rank) in *direction* (0 rx, 1 tx)."""
        row = self.fcfg[port, direction]
        row[:] = (
            float(spec.random_active),
            spec.loss,
            spec.dup,
            spec.reorder,
            spec.delay,
            spec.delay_s,
            float(spec.kth_opcode),
            float(spec.kth_k),
        )
        self.kctr[port, direction, :] = 0
        for d in (K.DIR_RX, K.DIR_TX):
            self.fstate[d] = int(
                bool(np.any(self.fcfg[:, d, K.F_ACTIVE]) or np.any(self.fcfg[:, d, K.F_KTH_K]))
            )

    # ------------------------------------------------------------------ the batch verbs

    def switch_state(self) -> SwitchState:
        """What the switch's datapath reads and changes besides the batches (made here only;
        afresh per call: a new address map or group replaces its tables' arrays)."""
        return SwitchState(
            SwitchPorts(self.cfg, self._nodes_ep, self._node_sorted, self._node_port),
            self._tables.bundle(),
            Groups(self._grp_key, self._grp_first, self._grp_count, self._grp_member),
            SwitchCounters(self.counters, self.sw, self.port_ctr, self.reg_ctr),
            LinkFaults(
                self.fcfg,
                self.fkeys,
                self.fclock,
                self.fstate,
                self.ftab_key,
                self.ftab_count,
                self.kctr,
                HoldTable(
                    self.hold_buf,
                    self.hold_len,
                    self.hold_ep,
                    self.hold_dir,
                    self.hold_time,
                    self.hold_gen,
                ),
            ),
            self.guard,
            Tenants(self._tenant_ids, self._tenant_keys),
        )

    @property
    def tx_queue(self) -> np.ndarray:
        """``[head, tail]`` of the send queue (shared with compiled I/O loops)."""
        return self._txq

    @property
    def faults_engaged(self) -> bool:
        """Receive faults configured or datagrams held: rx arrays need room (2n + HOLD_SLOTS)."""
        return bool(
            self.fstate[K.FS_RX_ACTIVE] or self.fstate[K.FS_HELD_RX] or self.fstate[K.FS_HELD_TX]
        )

    def room_per_datagram(self) -> int:
        """Send-queue entries one received datagram may need: fan-out x fault duplicates."""
        per = int(self.cfg[K.CFG_FANOUT])
        return (
            per
            * (2 if self.fstate[K.FS_TX_ACTIVE] else 1)
            * (2 if self.fstate[K.FS_RX_ACTIVE] else 1)
        )

    def reserve(self, n: int) -> None:
        """Room in the send queue for everything *n* received datagrams may produce."""
        self._reserve_tx(n * self.room_per_datagram() + HOLD_SLOTS + 1)

    def round_datagrams(self, wanted: int) -> int:
        """Datagrams a compiled round may take so that its output fits MAX_TX_QUEUE (at least
        64: one whole GRO run)."""
        fit = (MAX_TX_QUEUE - 2 * HOLD_SLOTS - 2) // self.room_per_datagram()
        return max(64, min(wanted, fit))

    def receive_batch(
        self,
        buf: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        srcs: np.ndarray,
        n: int,
        now: float,
    ) -> None:
        """Run datagrams ``buf[offs[i] : offs[i] + lens[i]]`` from ``srcs[i]`` (i < n)."""
        check_batch(buf, offs, lens, srcs, n)
        if n == 0 and not (self.fstate[K.FS_HELD_RX] or self.fstate[K.FS_HELD_TX]):
            return
        if self.faults_engaged:
            # Faults rewrite the batch in place and append released datagrams: use own arrays.
            total = int(sum(int(lens[i]) for i in range(n)))
            room = 2 * n + HOLD_SLOTS
            own = np.zeros(total + HOLD_SLOTS * self.sendq.slot + 1, np.uint8)
            o_off = np.zeros(room, np.int64)
            o_len = np.zeros(room, np.int32)
            o_src = np.zeros(room, np.uint64)
            pos = 0
            for i in range(n):
                ln = int(lens[i])
                own[pos : pos + ln] = buf[int(offs[i]) : int(offs[i]) + ln]
                o_off[i], o_len[i], o_src[i] = pos, ln, srcs[i]
                pos += ln
            buf, offs, lens, srcs = own, o_off, o_len, o_src
        self.reserve(max(n, 1))
        if self._punt.shape[0] < lens.shape[0]:
            self._punt = np.zeros(lens.shape[0], np.int32)
        self.fclock[FCLOCK_NOW] = now
        self.guard.cfg[G_NOW] = now
        tx_n, n_punt = K.switch_round(
            RxBatch(buf, offs, lens, srcs),
            n,
            self.max_datagram,
            self.switch_state(),
            self.tx_bundle(),
            int(self._txq[TXQ_TAIL]),
            self._punt,
        )
        self._txq[TXQ_TAIL] = tx_n
        self.handle_punted(buf, offs, lens, srcs, self._punt, int(n_punt))

    def get_timer(self) -> float | None:
        """When the earliest datagram held by a reorder/delay fault is due (None: none held)."""
        if not self.held():
            return None
        return float(self.hold_time[self.hold_len > 0].min())

    def handle_timer(self, now: float) -> None:
        """Release held datagrams that are due (an empty round of the kernel)."""
        if self.held():
            self.receive_batch(
                np.zeros(1, np.uint8),
                np.zeros(1, np.int64),
                np.zeros(1, np.int32),
                np.zeros(1, np.uint64),
                0,
                now,
            )

    def held(self) -> int:
        """Datagrams held aside by reorder/delay faults."""
        return int(self.fstate[K.FS_HELD_RX] + self.fstate[K.FS_HELD_TX])

    # ------------------------------------------------------------------ counters

    def counters_payload(self, first_region: int = 0) -> bytes:
        """The COUNTERS reply payload (u64 LE): node layout, switch section, ports, regions."""
        ports = self.port_ctr.reshape(-1)
        head = np.zeros(SECTION_LEN, np.uint64)
        room = (MAX_COUNTER_WORDS - C.NUM_COUNTERS - SECTION_LEN - ports.shape[0]) // REGION_ROW
        first = min(max(first_region, 0), len(self.regions))
        listed = max(0, min(room, len(self.regions) - first))
        head[0] = self.n_ports
        head[1] = len(self.regions)
        head[2] = first
        head[3] = listed
        head[4 : 4 + 8] = self.sw[:8]
        rows = np.zeros((listed, REGION_ROW), np.uint64)
        for k in range(listed):
            r = self.regions[first + k]
            rows[k, 0] = r.gaddr
            rows[k, 1] = r.rkey
            rows[k, 2:] = self.reg_ctr[first + k]
        words = np.concatenate([self.counters, head, ports, rows.reshape(-1)])
        return words.astype("<u8").tobytes()

    # ------------------------------------------------------------------ internals

    def _push(self, data: bytes, dst: int) -> None:
        data = self._outgoing(data)
        if not self.sendq.push(data, dst):
            return
        port = self._port(dst)
        self.port_ctr[port, K.P_TX_PACKETS] += 1
        self.port_ctr[port, K.P_TX_BYTES] += len(data)

    def _port(self, ep: int) -> int:
        i = int(np.searchsorted(self._node_sorted, np.uint64(ep)))
        if i < self._node_sorted.shape[0] and int(self._node_sorted[i]) == ep:
            return int(self._node_port[i])
        return 0

    def _handle_punted(self, data: bytes, src: int) -> None:
        try:
            packet = decode_packet(data)
        except RemoteProtocolError:
            self.counters[C.DROP_BAD_REPLY] += 1
            return
        if packet.opcode in REPLY_OPCODES:
            self.counters[C.DROP_UNEXPECTED_REPLY] += 1  # the switch asks nobody anything
            return
        if packet.opcode == Opcode.PING:
            info = INFO.pack(
                PROTOCOL_VERSION,
                self.config.mtu,
                self.config.pool_bytes,
                max_payload(self.config.mtu),
                MAX_SEGMENTS,
                SWITCH_RANK,
                len(self.config.nodes),
            )
            # aux_addr: the address-validation token of the PING's source (SPEC.md 12.4).
            self._reply(
                packet, src, Opcode.INFO, payload=info, aux_addr=address_token(self.guard, src)
            )
            return
        if packet.flags & Flags.TAGGED and packet.opcode in POOL_OPCODES and packet.rkey:
            self._tenant_request(packet, src, data)
            return
        proof = control_authority(self.config.admin_key, self.config.admin_tag_key, packet, data)
        if proof is ControlProof.FORGED:
            self.counters[C.DROP_CONTROL_FORGED] += 1  # the datapath drops these before us
            return
        if proof is ControlProof.REFUSED or (
            proof is ControlProof.NONE and packet.opcode not in POOL_OPCODES
        ):
            self._reply(
                packet,
                src,
                Opcode.NACK,
                Status.UNAUTHORIZED,
                payload=refusal_text(self.config.admin_tag_key),
            )
            self._failed(src)
            return
        if proof is ControlProof.TAG and self._replayed(data, src):
            return
        seal_key = self.config.admin_tag_key if proof is ControlProof.TAG else b""
        self._answer(
            seal_key,
            lambda: self._control(packet, src, admin=proof in (ControlProof.TAG, ControlProof.KEY)),
        )

    def _tenant_request(self, packet: Packet, src: int, data: bytes) -> None:
        """A pool request sealed by a tenant: rkey its id, a control tag under its tag key
        (SPEC.md 11.9, "Tenant tags"). The datapath checked the tag; checked again here, as a
        punted datagram carries no verdict (and the table may have changed in between)."""
        tenant = self._tenants.get(packet.rkey)
        if tenant is None:
            text = f"no tenant has id 0x{packet.rkey:08x} here: its credential is not this pool's (SPEC 11.9)"
            self._reply(packet, src, Opcode.NACK, Status.UNAUTHORIZED, payload=text.encode())
            self._failed(src)
            return
        owner, key = tenant
        if not verify_control_bytes(key, data):
            self.counters[C.DROP_CONTROL_FORGED] += 1
            return
        if self._replayed(data, src):
            return
        self._answer(key, lambda: self._pool_request(packet, src, admin=False, tenant=owner))

    def _control(self, packet: Packet, src: int, admin: bool) -> None:
        """A control or pool request with its authority established (*admin*, or a tenant's
        pool request)."""
        if packet.opcode in POOL_OPCODES:
            self._pool_request(packet, src, admin)
            return
        if packet.opcode == Opcode.COUNTERS:
            self._reply(packet, src, Opcode.ACK, payload=self.counters_payload(packet.addr))
        elif packet.opcode in (Opcode.JOIN, Opcode.LEAVE):
            group = u64_to_endpoint(packet.addr)
            member = u64_to_endpoint(packet.aux_addr or src)
            joined = packet.opcode == Opcode.JOIN
            status = self.join(group, member) if joined else self.leave(group, member)
            if status == Status.OK:
                self._events.append(GroupChanged(group, member, joined))
                self._reply(packet, src, Opcode.ACK)
            else:
                self._reply(packet, src, Opcode.NACK, status)
        else:
            text = (
                f"{packet.opcode.name} goes to a node, not to the switch: a pool region "
                "comes from ALLOC to the VIP (SPEC.md 11.9; netdam pool alloc sends it)"
            ).encode()
            self._reply(replace(packet, length=0), src, Opcode.NACK, Status.BAD_FIELD, payload=text)

    def _failed(self, src: int) -> None:
        """A failed authentication by *src* (nodes are trusted): the lockout counts it."""
        if src not in self._trusted:
            record_failure(self.guard, src, self.counters)

    def _pool_request(self, packet: Packet, src: int, admin: bool, tenant: str = "") -> None:
        if self.pool is None:
            text = (
                b"this switch runs without a pool controller (start it with --cluster and --state)"
            )
            self._reply(replace(packet, length=0), src, Opcode.NACK, Status.BAD_FIELD, payload=text)
            return
        answer = self.pool.handle(packet, src, self._proven(packet, src), admin, tenant)
        if answer.status == Status.UNAUTHORIZED:
            self._failed(src)
        reply = packet if answer.addr is None else replace(packet, addr=answer.addr)
        if answer.status == Status.OK:
            payload = answer.payload
        else:  # even the explanation stays within 3x the request (SPEC.md 12.4)
            room = min(
                MAX_NACK_TEXT, AMPLIFICATION_FACTOR * (HEADER_SIZE + packet.length) - HEADER_SIZE
            )
            payload = answer.text.encode()[:room].decode(errors="ignore").encode()
        self._reply(reply, src, answer.opcode, answer.status, payload=payload, rkey=answer.rkey)

    def _proven(self, packet: Packet, src: int) -> bool:
        """Whether *src* may get answers over 3x its request: a member, a switch without the
        anti-amplification limit, or a client whose aux_addr is its address token (SPEC.md 12.4)."""
        if src in self._trusted or self.guard.cfg[G_FACTOR] == 0.0:
            return True
        token = int(packet.aux_addr)
        return token != 0 and token == address_token(self.guard, src)


def counters_from_payload(payload: bytes) -> dict[str, object]:
    """Name the values of a switch's COUNTERS reply (protocol/SPEC.md 11.7 layout)."""
    words = np.frombuffer(payload, "<u8").astype(np.uint64)
    if words.shape[0] < C.NUM_COUNTERS + SECTION_LEN:
        raise ValueError(
            f"switch COUNTERS payload has {words.shape[0]} values, expected at least "
            f"{C.NUM_COUNTERS + SECTION_LEN}: is this a switch?"
        )
    result: dict[str, object] = C.counters_to_dict(words[: C.NUM_COUNTERS])
    head = words[C.NUM_COUNTERS : C.NUM_COUNTERS + SECTION_LEN]
    n_ports, total, first, listed = (int(v) for v in head[:4])
    result["switch"] = {name: int(head[4 + k]) for k, name in enumerate(SW_NAMES)}
    pos = C.NUM_COUNTERS + SECTION_LEN
    ports = words[pos : pos + n_ports * K.PORT_FIELDS].reshape(n_ports, K.PORT_FIELDS)
    result["ports"] = [
        {
            "port": "client" if p == 0 else f"node{p - 1}",
            **{n: int(ports[p, k]) for k, n in enumerate(PORT_NAMES)},
        }
        for p in range(n_ports)
    ]
    pos += n_ports * K.PORT_FIELDS
    rows = words[pos : pos + listed * REGION_ROW].reshape(listed, REGION_ROW)
    result["regions"] = [
        {
            "gaddr": int(row[0]),
            "rkey": int(row[1]),
            **{n: int(row[2 + k]) for k, n in enumerate(REGION_NAMES) if n != "reserved"},
        }
        for row in rows
    ]
    result["regions_total"] = total
    result["first_region"] = first
    return result
