"""The pool's allocator, served on the wire: ALLOC, FREE and QUERY to the switch's VIP.

Two halves, one wire path (SPEC.md 11.9):

- ``PoolService`` runs inside the switch process and answers the three opcodes. ALLOC checks the
  tenant's quota, picks a global range, the nodes of the ways (by the switch's count of the
  bytes and region slots its regions take on each node, most free bytes first) and a random
  rkey, REGISTERs every way's backing on its node *under that same rkey* with the region's
  rights (so the node enforces rights and bounds too), letting the node place it
  (REGISTER_ANYWHERE: other regions may live on a node besides the pool's) and moving on to the
  next node when one refuses for room, writes the state file and swaps the switch's map before
  it answers. FREE removes the region from the map and the state file, then
  DEREGISTERs the backing. A region belongs to the tenant whose credential (a 64-bit secret from
  ``secrets``, handed out in the ACK of the ALLOC that created the tenant) allocated it; FREE and
  QUERY see only the caller's regions (the admin key sees all). The state file keeps a SHA-256
  of each credential, never the credential.
- ``PoolController`` is the client side every tool uses (``netdam pool``, tests, soak, fuzz): it
  sends those datagrams to the VIP with the admin key from the cluster file, or with a tenant
  credential.
"""

from __future__ import annotations

import secrets
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from netdam.cluster.clusterfile import ClusterFile, SwitchEntry, load_cluster, require_switch
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.tenants import credential_digest, tenant_keys
from netdam.core.node import MAX_REGIONS
from netdam.protocol.constants import (
    AMPLIFICATION_FACTOR,
    HEADER_SIZE,
    REGISTER_ANYWHERE,
    RIGHTS_ALL,
    Opcode,
    Status,
)
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.packet import Packet, endpoint_to_u64
from netdam.protocol.payloads import (
    ALLOC_TAGGED,
    TAG_KEY_SIZE,
    AllocRequest,
    RegionInfo,
    RegionWay,
    pack_credential,
    pack_key_rights,
    pack_register,
    region_info_size,
    unpack_alloc,
    unpack_credential,
    unpack_region_info,
)
from netdam.switch.addrmap import (
    GLOBAL_ALIGN,
    LOCAL_ALIGN,
    STRIDE_ALIGN,
    Region,
    Way,
    backing_per_way,
    page_round,
)
from netdam.switch.core import PoolReply
from netdam.switch.state import (
    PoolState,
    load_state,
    locked,
    save_state,
    short_digest,
    state_path_for,
)
from netdam.units import format_size

#: The switch's wait for one node's answer to REGISTER/DEREGISTER, and its retries: ALLOC and
#: FREE stall the switch's datapath for these round trips (SPEC.md 11.9).
NODE_TIMEOUT_S = 0.2
NODE_RETRIES = 2
#: ALLOC/FREE replies the switch keeps for retries of the same (source, client id, txn id).
REPLY_CACHE = 4096
#: How long a controller waits for the switch's answer to ALLOC/FREE/QUERY, and its retries.
REQUEST_TIMEOUT_S = 2.0
REQUEST_RETRIES = 2
#: Regions one node's table holds (netdam.core.node): pool ways and direct registrations alike.
NODE_REGION_SLOTS = MAX_REGIONS


class ControllerError(NetdamError):
    """A pool operation failed; the message says why and what to do. ``status``: the wire
    status it maps to (the switch's NACK), None when no answer came."""

    def __init__(self, message: str, status: int | None = Status.BAD_FIELD) -> None:
        super().__init__(message)
        self.status = status


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def node_use(state: PoolState, rank: int) -> tuple[int, int]:
    """(bytes, region slots) the pool's regions take on node *rank*, by the switch's own count:
    each way's backing in whole pages, one slot of the node's region table per way. The node may
    hold more (regions registered on it directly): it says so by refusing a REGISTER."""
    ways = [w for r in state.regions for w in r.ways if w.node == rank]
    return sum(page_round(w.size) for w in ways), len(ways)


def node_room(state: PoolState, rank: int) -> int:
    """Bytes of node *rank*'s memory the pool's regions leave, by the switch's count."""
    return int(state.nodes[rank].memory_bytes) - node_use(state, rank)[0]


def region_shape(
    nodes: int, size: int, interleave: int | None, ways: int | None
) -> tuple[int, int, int]:
    """(stride, ways, backing bytes per way) of a new region, checked (BAD_FIELD)."""
    if size <= 0:
        raise ControllerError(f"size {size} must be positive")
    if ways is not None and not 1 <= ways <= nodes:
        raise ControllerError(
            f"--ways {ways} does not fit a pool of {nodes} nodes: give 1..{nodes}"
        )
    if ways is not None and not interleave:
        raise ControllerError("--ways needs --interleave (a region without it lives on one node)")
    if interleave:
        if interleave % STRIDE_ALIGN or interleave < STRIDE_ALIGN:
            raise ControllerError(
                f"interleave stride {interleave} must be a positive multiple of {STRIDE_ALIGN} (e.g. 8KiB)"
            )
        count, stride = min(ways or nodes, nodes), interleave
    else:
        count, stride = 1, 0
    return stride, count, backing_per_way(size, stride, count)


def candidate_nodes(state: PoolState, per: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Nodes that can take a way of *per* bytes by the switch's count (the bytes and a free slot
    of the region table), most free bytes first (ties: lower rank): the order ALLOC asks them."""
    room = {}
    for rank in range(len(state.nodes)):
        used, slots = node_use(state, rank)
        if (
            rank not in exclude
            and slots < NODE_REGION_SLOTS
            and used + page_round(per) <= state.nodes[rank].memory_bytes
        ):
            room[rank] = state.nodes[rank].memory_bytes - used
    return sorted(room, key=lambda r: (-room[r], r))


def next_gaddr(state: PoolState) -> int:
    """The global address of the next region (never one handed out before)."""
    return _round_up(state.next_gaddr, GLOBAL_ALIGN)


#: The stride a hint suggests (the CLI's example): any multiple of STRIDE_ALIGN works.
HINT_STRIDE = max(8192, STRIDE_ALIGN)


def _fits(state: PoolState, size: int, stride: int, count: int) -> bool:
    """Whether *count* nodes have room for ways of a region of *size* bytes and *stride*, by the
    switch's count."""
    return len(candidate_nodes(state, backing_per_way(size, stride, count))) >= count


def room_hint(state: PoolState, size: int, interleave: int | None) -> str:
    """What the pool has free for a region of *size* bytes that found no room, and only the
    steps that would really help (each checked against *state*, none guessed)."""
    nodes = len(state.nodes)
    rooms = [
        node_room(state, r) if node_use(state, r)[1] < NODE_REGION_SLOTS else 0
        for r in range(nodes)
    ]
    total = sum(max(room, 0) for room in rooms)
    largest = max(rooms, default=0)
    steps = []
    if not interleave and nodes > 1 and _fits(state, size, HINT_STRIDE, nodes):
        steps.append(f"--interleave {format_size(HINT_STRIDE)} spreads it over the {nodes} nodes")
    if largest > 0:
        steps.append(f"a --size of at most {largest}B fits on one node")
    if state.regions:
        steps.append("free regions (`netdam pool list` shows them, `netdam pool free` frees one)")
    steps.append(
        "or start the cluster with more memory per node (`netdam up --switch --memory SIZE`)"
    )
    return (
        f"the pool has {_bytes(total)} free over {nodes} node(s), at most {_bytes(largest)} on one "
        "node: " + "; ".join(steps)
    )


def _bytes(n: int) -> str:
    return f"{n} B ({n / (1 << 20):.1f} MiB)"


def new_credential(state: PoolState) -> tuple[int, str]:
    """A new tenant's credential (64 bits from ``secrets``, never 0) and its digest, its id
    (SPEC.md 11.9, "Tenant tags") distinct from every tenant's in *state*."""
    taken = {tenant_keys(digest).id for digest in state.tenants}
    while True:
        credential = secrets.randbits(64)
        digest = credential_digest(credential)
        if credential and digest not in state.tenants and tenant_keys(digest).id not in taken:
            return credential, digest


def tenant_table(state: PoolState) -> dict[int, tuple[str, bytes]]:
    """The switch's table of *state*'s tenants (SwitchCore.set_tenants): id -> (digest, tag key).
    Ids are distinct (new_credential sees to it): on a collision in a hand-edited or merged file,
    the tenant first in the file keeps its tag and the other asks with its credential (v1)."""
    table: dict[int, tuple[str, bytes]] = {}
    for digest in state.tenants:
        keys = tenant_keys(digest)
        table.setdefault(keys.id, (digest, keys.tag_key))
    return table


def region_info(region: Region, credential: int = 0) -> RegionInfo:
    """The wire record of *region* (SPEC.md 11.9)."""
    return RegionInfo(
        region.gaddr,
        region.size,
        region.rkey,
        region.stride,
        region.rights,
        tuple(RegionWay(w.node, w.local, w.size) for w in region.ways),
        credential,
        region.tenant,
        region.tag_key,
    )


def record_bytes(ways: int, tagged: bool = False) -> int:
    """Bytes of the ACK that carries the record of a region of *ways* ways (SPEC.md 11.9)."""
    return int(HEADER_SIZE + region_info_size(ways, tagged))


def region_from_info(info: RegionInfo) -> Region:
    extra: dict[str, object] = {"credential": info.credential} if info.credential else {}
    return Region(
        info.gaddr,
        info.size,
        info.rkey,
        info.rights,
        info.stride,
        tuple(Way(w.node, w.local, w.size) for w in info.ways),
        info.label,
        tag_key=info.tag_key,
        extra=extra,
    )


def quota_check(state: PoolState, owner: str, footprint: int) -> str | None:
    """Why the tenant *owner* may not take one more region of *footprint* bytes (None: it may)."""
    held, regions = state.usage(owner)
    quota = state.quota_of(owner)
    label = state.tenants.get(owner, "") or short_digest(owner)
    if quota.regions is not None and regions + 1 > quota.regions:
        return f"region quota: tenant {label!r} holds {regions} of its {quota.regions} regions"
    limit = state.byte_limit(owner)
    if held + footprint > limit:
        return f"byte quota: tenant {label!r} holds {held} of its {limit} B; this region takes {footprint} B"
    return None


class NodeAgent(Protocol):
    """How the pool service reaches the nodes (the switch process gives it a UDP client)."""

    def register(
        self, node: tuple[str, int], size: int, rights: int, rkey: int, tag_key: bytes = b""
    ) -> tuple[Status, int]:
        """REGISTER of *size* bytes under *rkey* (tagged under *tag_key* when given) on *node*,
        placed by the node itself (REGISTER_ANYWHERE): (OK, the local base the node chose), or
        (its NACK status, 0); TIMEOUT: no answer."""
        ...

    def deregister(self, node: tuple[str, int], rkey: int) -> Status: ...


class PoolService:
    """ALLOC, FREE and QUERY at the switch (SPEC.md 11.9): authorisation, quotas, placement,
    registration on the nodes, persistence. ``on_change(state)`` is called after every change so
    the switch swaps its map before the ACK leaves."""

    def __init__(
        self,
        cluster: ClusterFile,
        state_path: Path,
        agent: NodeAgent,
        on_change: Callable[[PoolState], None] = lambda state: None,
    ) -> None:
        self.cluster = cluster
        self.state_path = Path(state_path)
        self.agent = agent
        self.on_change = on_change
        self._replies: OrderedDict[tuple[int, int, int], PoolReply] = OrderedDict()

    def handle(
        self, packet: Packet, src: int, proven: bool, admin: bool, tenant: str = ""
    ) -> PoolReply:
        """The answer to one ALLOC/FREE/QUERY from *src*; a retry of an ALLOC or FREE that
        succeeded (same source, client id and txn id) gets the same answer and changes nothing.
        *proven*: *src* showed it receives at its address (SPEC.md 12.4); else no answer exceeds
        AMPLIFICATION_FACTOR times the request. *admin*: the switch found the admin's authority
        on it (its control tag, or the admin key where no tag is required: core/authority.py);
        *tenant*: the credential digest of the tenant whose tag it carries (SPEC.md 11.9,
        "Tenant tags"); else the payload's tenant credential is all it has."""
        key = (src, packet.client_id, packet.txn_id)
        if packet.opcode != Opcode.QUERY and key in self._replies:
            self._replies.move_to_end(key)
            return self._replies[key]
        # The most bytes an ACK to this sender may have (None: no limit).
        room = None if proven else AMPLIFICATION_FACTOR * (HEADER_SIZE + packet.length)
        try:
            if packet.opcode == Opcode.ALLOC:
                request = unpack_alloc(packet.payload)
                credential = request.credential
            else:
                credential = unpack_credential(packet.payload)
        except RemoteProtocolError as exc:
            return PoolReply(exc.status, text=str(exc))
        if tenant and credential:
            return PoolReply(
                Status.BAD_FIELD,
                text="a sealed tenant request carries credential 0: its tag proves "
                "the tenant, and the credential stays off the wire",
            )
        owner = tenant or (credential_digest(credential) if credential else "")
        if packet.opcode == Opcode.ALLOC:
            reply = self._alloc(request, admin, room, owner)
        else:
            reply = self._free_or_query(packet.opcode, packet.addr, owner, admin, room)
        if reply.status == Status.OK and packet.opcode != Opcode.QUERY:
            self._replies[key] = reply
            while len(self._replies) > REPLY_CACHE:
                self._replies.popitem(last=False)
        return reply

    # ------------------------------------------------------------------ the three requests

    def _alloc(self, req: AllocRequest, admin: bool, room: int | None, owner: str) -> PoolReply:
        """ALLOC for *owner* (a credential digest; "" with the admin's authority: a new tenant)."""
        if req.flags & ~ALLOC_TAGGED:
            return PoolReply(
                Status.BAD_FIELD,
                text=f"ALLOC flags 0x{req.flags:02x}: only bit 0 (TAGGED) is defined",
            )
        tagged = bool(req.flags & ALLOC_TAGGED)
        with locked(self.state_path):
            state = load_state(self.state_path)
            # The ACK hands a new tenant its credential; a tenant that asked with its tag gets
            # 0 there (it holds the credential, which stays off the wire), one with it in the
            # payload (v1) or the admin acting for it gets it back.
            credential = req.credential
            if not owner:
                if not admin:
                    return PoolReply(Status.UNAUTHORIZED, text="a new tenant needs the admin key")
                credential, owner = new_credential(state)
            elif owner not in state.tenants:
                return PoolReply(Status.UNAUTHORIZED, text="unknown tenant credential")
            if req.size == 0 or req.rights == 0 or req.rights & ~int(RIGHTS_ALL):
                return PoolReply(Status.BAD_FIELD, text="size must be > 0, rights 1..7")
            try:
                stride, count, per = region_shape(
                    len(state.nodes), req.size, req.stride or None, req.ways or None
                )
            except ControllerError as exc:
                return PoolReply(Status.BAD_FIELD, text=str(exc))
            if room is not None and record_bytes(count, tagged) > room:
                return _unproven(record_bytes(count, tagged))
            if not admin:  # the admin's own ALLOCs are the operator's decision: never refused QUOTA
                refused = quota_check(state, owner, count * page_round(per))
                if refused is not None:
                    return PoolReply(Status.QUOTA, text=refused)
            try:
                region = self._place(state, req, stride, count, per, owner)
            except ControllerError as exc:
                return PoolReply(Status(exc.status or Status.BAD_FIELD), text=str(exc))
            except _NodeRefused as exc:
                return PoolReply(exc.status, text=str(exc))
            state.tenants.setdefault(owner, req.label)
            state.regions.append(region)
            state.next_gaddr = region.gaddr + _round_up(region.size, GLOBAL_ALIGN)
            state.generation += 1
            save_state(self.state_path, state)
        self.on_change(state)
        return PoolReply(
            Status.OK, region_info(region, credential).encode(), rkey=region.rkey, addr=region.gaddr
        )

    def _place(
        self, state: PoolState, req: AllocRequest, stride: int, count: int, per: int, owner: str
    ) -> Region:
        """Register the region's ways on nodes that take them, under a fresh rkey: the nodes the
        switch's count says have room, most free bytes first; a node that refuses for room
        (NO_SPACE: its memory or region table is full of registrations the switch does not
        count; IN_USE) is skipped for the next. The region once every way is registered;
        NO_SPACE (nothing registered) when too few nodes took one."""
        used = {r.rkey for r in state.regions}
        full: set[int] = set()
        # A tagged region's key, drawn here and handed to its nodes in REGISTER and to its
        # tenant in the ACK (SPEC.md 11.9); never all zeros (that is "no key").
        tag_key = b""
        while req.flags & ALLOC_TAGGED and not any(tag_key):
            tag_key = secrets.token_bytes(TAG_KEY_SIZE)
        for _attempt in range(8):
            rkey = secrets.randbits(32)
            if rkey == 0 or rkey in used:
                continue
            ways = self._register_ways(state, per, count, req.rights, rkey, full, tag_key)
            if ways is None:  # a node uses that rkey: pick another
                continue
            if len(ways) < count:
                refused = f"; node(s) {sorted(full)} refused for room" if full else ""
                raise ControllerError(
                    f"no room for {req.size} bytes: {count} node(s) need {per} free bytes and "
                    f"a region slot each{refused}; {room_hint(state, req.size, stride or None)}",
                    Status.NO_SPACE,
                )
            ways.sort(key=lambda w: w.node)
            return Region(
                next_gaddr(state),
                req.size,
                rkey,
                req.rights,
                stride,
                tuple(ways),
                req.label,
                owner=owner,
                tag_key=tag_key,
            )
        raise ControllerError(
            "could not find an rkey free on every node in 8 tries", Status.NO_SPACE
        )

    def _register_ways(
        self,
        state: PoolState,
        per: int,
        count: int,
        rights: int,
        rkey: int,
        full: set[int],
        tag_key: bytes,
    ) -> list[Way] | None:
        """Up to *count* ways of *per* bytes registered under *rkey*, one per node, on the
        candidates in order; nodes that refuse for room join *full*. Fewer than *count* ways
        (none registered any more) when the candidates ran out; None (likewise) when a node
        holds *rkey* already (EXISTS)."""
        ways: list[Way] = []
        for rank in candidate_nodes(state, per, frozenset(full)):
            if len(ways) == count:
                break
            node = self._endpoint(state, rank)
            status, local = self.agent.register(node, per, rights, rkey, tag_key)
            if status == Status.OK and _placed_inside(local, per, state.nodes[rank].memory_bytes):
                ways.append(Way(rank, local, per))
                continue
            if (
                status == Status.OK
            ):  # an answer no node of this protocol gives: take nothing from it
                self.agent.deregister(node, rkey)
                self._undo(state, ways, rkey)
                raise _NodeRefused(
                    Status.BAD_FIELD,
                    f"node {rank} placed the backing at 0x{local:x}, outside its "
                    "memory: does it run a netdam without REGISTER_ANYWHERE (SPEC.md 6.1)?",
                )
            if status in (Status.NO_SPACE, Status.IN_USE):
                full.add(rank)
                continue
            self._undo(state, ways, rkey)
            if status == Status.EXISTS:
                return None
            # OUT_OF_BOUNDS: the size fits its memory, so the node took REGISTER_ANYWHERE for a base.
            old = (
                " (does it run a netdam without REGISTER_ANYWHERE, SPEC.md 6.1?)"
                if status == Status.OUT_OF_BOUNDS
                else ""
            )
            raise _NodeRefused(
                status, f"node {rank} refused the backing of a new region: {status.name}{old}"
            )
        if len(ways) < count:
            self._undo(state, ways, rkey)
            return []
        return ways

    def _undo(self, state: PoolState, ways: list[Way], rkey: int) -> None:
        for way in ways:
            self.agent.deregister(self._endpoint(state, way.node), rkey)

    def _free_or_query(
        self, opcode: Opcode, addr: int, owner: str, admin: bool, room: int | None
    ) -> PoolReply:
        with locked(self.state_path):
            state = load_state(self.state_path)
            if not admin and owner not in state.tenants:
                return PoolReply(Status.UNAUTHORIZED, text="unknown tenant credential")
            visible = sorted(
                (r for r in state.regions if admin or r.owner == owner), key=lambda r: r.gaddr
            )
            if opcode == Opcode.QUERY:
                match = [r for r in visible if r.gaddr >= addr][:1]
            else:
                match = [r for r in visible if r.gaddr == addr]
            if not match:
                return PoolReply(Status.NO_ROUTE, text=f"no region of yours at 0x{addr:x}")
            region = match[0]
            answer = record_bytes(len(region.ways), bool(region.tag_key))
            if room is not None and answer > room:
                return _unproven(answer)
            if opcode == Opcode.FREE:
                state.regions.remove(region)
                state.generation += 1
                save_state(self.state_path, state)
        if opcode == Opcode.FREE:
            self.on_change(state)  # out of the map before the backing goes
            for way in region.ways:
                self.agent.deregister(self._endpoint(state, way.node), region.rkey)
        return PoolReply(
            Status.OK, region_info(region).encode(), rkey=region.rkey, addr=region.gaddr
        )

    # ------------------------------------------------------------------ nodes

    def _endpoint(self, state: PoolState, rank: int) -> tuple[str, int]:
        pooled = state.nodes[rank]
        entry = self.cluster.nodes[rank]
        if entry.endpoint != pooled.endpoint:
            raise _NodeRefused(
                Status.BAD_FIELD,
                f"state file names node {rank} {pooled.endpoint}, the cluster "
                f"file {entry.endpoint}: they belong to different clusters",
            )
        return (str(entry.address), int(entry.port))


def _placed_inside(local: int, size: int, memory_bytes: int) -> bool:
    return local % LOCAL_ALIGN == 0 and 0 <= local and local + size <= memory_bytes


def _unproven(answer: int) -> PoolReply:
    """The NACK to a sender without its address token whose ACK would be too big (SPEC.md 12.4)."""
    return PoolReply(
        Status.BAD_FIELD,
        text=f"answer of {answer} B is over {AMPLIFICATION_FACTOR}x the request: "
        f"PING the VIP, {SEND_TOKEN} (SPEC 12.4)",
    )


#: What a NACK that wants the sender's address token says (PoolController then PINGs for it).
SEND_TOKEN = "send its token in aux_addr"


class _NodeRefused(NetdamError):
    """A node refused (or could not take) a region's backing: the ALLOC is NACKed with *status*."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class UdpNodeAgent:
    """REGISTER/DEREGISTER over UDP with the admin key (the switch process's agent)."""

    def __init__(self, admin_key: int, admin_tag_key: bytes = b"") -> None:
        self.client = ControlClient(admin_key=admin_key, admin_tag_key=admin_tag_key)

    def register(
        self, node: tuple[str, int], size: int, rights: int, rkey: int, tag_key: bytes = b""
    ) -> tuple[Status, int]:
        payload = pack_register(rkey, rights, tag_key)
        packet = Packet(
            Opcode.REGISTER,
            rkey=self.client.admin_key,
            addr=REGISTER_ANYWHERE,
            aux_addr=size,
            length=len(payload),
            payload=payload,
        )
        try:
            reply = self.client.request(node, packet, timeout=NODE_TIMEOUT_S, retries=NODE_RETRIES)
        except ControlError as exc:
            return _status_of(exc), 0
        return Status.OK, int(reply.addr)  # the base the node chose (SPEC.md 6.1)

    def deregister(self, node: tuple[str, int], rkey: int) -> Status:
        packet = Packet(
            Opcode.DEREGISTER,
            rkey=self.client.admin_key,
            length=8,
            payload=pack_key_rights(rkey, 0),
        )
        try:
            self.client.request(node, packet, timeout=NODE_TIMEOUT_S, retries=NODE_RETRIES)
        except ControlError as exc:
            return _status_of(exc)
        return Status.OK

    def close(self) -> None:
        self.client.close()


def _status_of(exc: ControlError) -> Status:
    return Status(exc.status) if exc.status is not None else Status.TIMEOUT


class PoolController:
    """Client of one pool's allocator: ALLOC, FREE and QUERY to the switch's VIP (SPEC.md 11.9),
    with the cluster file's admin key, or with a tenant *credential* (then only that tenant's
    regions are visible)."""

    def __init__(
        self,
        cluster_path: Path,
        state_path: Path | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
        credential: int | None = None,
    ) -> None:
        self.cluster_path = Path(cluster_path)
        try:
            self.cluster: ClusterFile = load_cluster(self.cluster_path)
            entry = require_switch(self.cluster_path)
        except ValueError as exc:
            raise ControllerError(str(exc)) from None
        default = Path(entry.state_file) if entry.state_file else state_path_for(self.cluster_path)
        self.state_path = Path(state_path) if state_path else default
        self.timeout = timeout
        self.credential = credential
        self._client: ControlClient | None = None

    @property
    def switch(self) -> SwitchEntry:
        """The cluster file's [switch] table, read again each time (a restarted switch has a
        new management port and pid)."""
        try:
            return require_switch(self.cluster_path)
        except ValueError as exc:
            raise ControllerError(str(exc)) from None

    # ------------------------------------------------------------------ queries

    def state(self) -> PoolState:
        """The state file as the switch last wrote it (read-only: changes go over the wire)."""
        try:
            return load_state(self.state_path)
        except ValueError as exc:
            raise ControllerError(str(exc)) from None

    def regions(self) -> list[Region]:
        """Every region visible to this controller, by QUERY (SPEC.md 11.9), in address order."""
        found: list[Region] = []
        addr = 0
        while True:
            try:
                region = self.query(addr)
            except ControllerError as exc:
                if exc.status == Status.NO_ROUTE:
                    return found
                raise
            found.append(region)
            addr = region.gaddr + 1

    def query(self, addr: int) -> Region:
        """The first visible region at or after global address *addr* (NO_ROUTE: none)."""
        reply = self._request(Opcode.QUERY, addr, pack_credential(0))
        return region_from_info(unpack_region_info(reply.payload))

    def region(self, gaddr: int) -> Region:
        """The visible region that starts at *gaddr* (one QUERY)."""
        try:
            found = self.query(gaddr)
        except ControllerError as exc:
            if exc.status != Status.NO_ROUTE:
                raise
        else:
            if found.gaddr == gaddr:
                return found
        raise ControllerError(
            f"no region at 0x{gaddr:x}: `netdam pool list --cluster FILE` shows them",
            Status.NO_ROUTE,
        )

    def alloc(
        self,
        size: int,
        interleave: int | None = None,
        *,
        ways: int | None = None,
        rights: int = int(RIGHTS_ALL),
        tenant: str = "",
        tagged: bool = True,
    ) -> Region:
        """Allocate *size* bytes: range-mapped on one node, or interleaved with stride
        *interleave* over *ways* nodes (default all). Returns the region (gaddr, rkey, ...;
        ``extra["credential"]``: the tenant credential that frees and queries it; ``tag_key``:
        the key its requests are sealed under, SPEC.md 2.6, unless *tagged* is False, for
        clients of SPEC v1 before tags). The switch answers once it serves the new map."""
        if rights == 0 or rights & ~int(RIGHTS_ALL):
            raise ControllerError(f"rights {rights} must combine READ (1), WRITE (2), ATOMIC (4)")
        if size <= 0 or size >= 1 << 64:
            raise ControllerError(f"size {size} must be positive")
        if interleave is not None and not 0 < interleave < 1 << 32:
            raise ControllerError(
                f"interleave stride {interleave} must be 1..{(1 << 32) - 1} bytes"
            )
        if ways is not None and not 0 < ways < 1 << 16:
            raise ControllerError(f"ways {ways} must be 1..65535")
        # A tenant's ALLOC names it by its tag, with credential 0 (SPEC.md 11.9): the ACK's
        # record carries 0 too, and the region is given the credential here.
        request = AllocRequest(
            size, 0, interleave or 0, ways or 0, rights, tenant, ALLOC_TAGGED if tagged else 0
        )
        reply = self._request(Opcode.ALLOC, 0, request.encode())
        info = unpack_region_info(reply.payload)
        return region_from_info(replace(info, credential=info.credential or self.credential or 0))

    def free(self, gaddr: int) -> Region:
        """Free the region at *gaddr*: the switch removes it from the map, then deregisters its
        backing on the nodes. Returns what was freed."""
        reply = self._request(Opcode.FREE, gaddr, pack_credential(0))
        return region_from_info(unpack_region_info(reply.payload))

    def _request(self, opcode: Opcode, addr: int, payload: bytes) -> Packet:
        """Send one pool request to the VIP (admin key unless a credential is set), with this
        socket's address-validation token in aux_addr once it has one: an answer over 3x the
        request (a region record of many ways) needs it (SPEC.md 12.4), and the switch says so;
        then this PINGs for the token and asks again. A request that needs no token goes first
        without one: a sealed request is answered while a guesser holds the address locked out
        (12.3), a PING is not."""
        vip = self.switch.vip
        rkey = 0 if self.credential else self.cluster.admin_key
        client = self._vip_client()
        try:
            for _ in range(2):
                token = client.tokens.get(vip, 0)
                packet = Packet(
                    opcode,
                    rkey=rkey,
                    addr=addr,
                    aux_addr=token,
                    length=len(payload),
                    payload=payload,
                )
                try:
                    return client.request(
                        vip, packet, timeout=self.timeout, retries=REQUEST_RETRIES
                    )
                except ControlError as exc:
                    if (
                        token
                        or exc.status != Status.BAD_FIELD
                        or SEND_TOKEN.encode() not in exc.payload
                    ):
                        raise
                client.tokens[vip] = client.request(
                    vip, Packet(Opcode.PING), timeout=self.timeout, retries=REQUEST_RETRIES
                ).aux_addr
            raise ControlError(
                f"{opcode.name}: the VIP asks for an address token and refuses the one its PING "
                "gave: is another process bound to the VIP?",
                int(Status.BAD_FIELD),
            )
        except ControlError as exc:
            raise ControllerError(_explain(opcode, addr, exc), exc.status) from None

    def _vip_client(self) -> ControlClient:
        """One socket for every request of this controller: its token stays valid."""
        if self._client is None:
            # The admin's requests are sealed under the admin tag key, a tenant's under its own
            # (SPEC.md 11.9, "Tenant tags"): neither key nor credential goes on the wire.
            self._client = (
                ControlClient.for_tenant(self.credential)
                if self.credential
                else ControlClient.for_cluster(self.cluster)
            )
            # Controllers are often dropped without close(): the socket goes with the object.
            weakref.finalize(self, self._client.close)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> PoolController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ groups

    def join(self, group: tuple[str, int], member: tuple[str, int]) -> None:
        """JOIN *member* (a node) to *group* at the switch (persisted by the switch)."""
        self._group_op(Opcode.JOIN, group, member)

    def leave(self, group: tuple[str, int], member: tuple[str, int]) -> None:
        self._group_op(Opcode.LEAVE, group, member)

    def _group_op(self, opcode: Opcode, group: tuple[str, int], member: tuple[str, int]) -> None:

        with ControlClient.for_cluster(self.cluster) as client:
            try:
                client.request(
                    self.switch.control_endpoint,
                    Packet(
                        opcode,
                        rkey=self.cluster.admin_key,
                        addr=endpoint_to_u64(group),
                        aux_addr=endpoint_to_u64(member),
                    ),
                    timeout=self.timeout,
                )
            except ControlError as exc:
                raise ControllerError(str(exc)) from None


def _explain(opcode: Opcode, addr: int, exc: ControlError) -> str:
    """One line: what the switch said, and what to do."""
    status = exc.status
    if status is None:
        return f"{exc}: is the switch running (netdam up --switch)?"
    hint = {
        Status.NO_ROUTE: (
            f"no region at 0x{addr:x}: `netdam pool list --cluster FILE` shows them"
            if opcode == Opcode.FREE
            else "no region there"
        ),
        Status.NO_SPACE: "no room for the region in the pool",
        Status.UNAUTHORIZED: "the switch refused the key: pass the cluster file's admin key or the "
        "tenant credential that ALLOC returned",
        Status.BAD_FIELD: "the switch refused the request's fields (size, stride, ways or rights)",
        Status.QUOTA: f"{exc.payload.decode(errors='replace')}: `netdam pool quota --cluster FILE` shows each "
        "tenant's quota and use; free regions of this tenant, or the admin raises its quota",
    }.get(Status(status), str(exc))
    return f"{opcode.name} refused ({Status(status).name}): {hint}"
