"""The pool's allocator, served on the wire: ALLOC, FREE and QUERY to the switch's VIP.

Two halves, one wire path (SPEC.md 11.9):

- ``PoolService`` runs inside the switch process and answers the three opcodes. ALLOC picks a
  global range, backing ranges on the nodes (first fit in each node's heap) and a random rkey,
  REGISTERs every backing range on its node *under that same rkey* with the region's rights (so
  the node enforces rights and bounds too), writes the state file and swaps the switch's map
  before it answers. FREE removes the region from the map and the state file, then
  DEREGISTERs the backing. A region belongs to the tenant whose credential (a 64-bit secret from
  ``secrets``, handed out in the ACK of the ALLOC that created the tenant) allocated it; FREE and
  QUERY see only the caller's regions (the admin key sees all). The state file keeps a SHA-256
  of each credential, never the credential.
- ``PoolController`` is the client side every tool uses (``netdam pool``, tests, soak, fuzz): it
  sends those datagrams to the VIP with the admin key from the cluster file, or with a tenant
  credential.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from netdam.cluster.clusterfile import ClusterFile, SwitchEntry, load_cluster, require_switch
from netdam.cluster.control import ControlClient, ControlError
from netdam.protocol.constants import RIGHTS_ALL, Opcode, Status
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.packet import Packet, endpoint_to_u64
from netdam.protocol.payloads import (
    AllocRequest,
    RegionInfo,
    RegionWay,
    pack_credential,
    pack_key_rights,
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
)
from netdam.switch.core import PoolReply
from netdam.switch.state import PoolState, load_state, locked, save_state, state_path_for
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


class ControllerError(NetdamError):
    """A pool operation failed; the message says why and what to do. ``status``: the wire
    status it maps to (the switch's NACK), None when no answer came."""

    def __init__(self, message: str, status: int | None = Status.BAD_FIELD) -> None:
        super().__init__(message)
        self.status = status


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def free_ranges(state: PoolState, rank: int) -> list[tuple[int, int]]:
    """[start, end) ranges of node *rank*'s heap no region uses."""
    heap = state.nodes[rank]
    used = sorted((w.local, w.local + w.size) for r in state.regions for w in r.ways if w.node == rank)
    gaps, pos = [], heap.heap_start
    for start, end in used:
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, end)
    if pos < heap.heap_end:
        gaps.append((pos, heap.heap_end))
    return gaps


def first_fit(state: PoolState, rank: int, size: int) -> int | None:
    for start, end in free_ranges(state, rank):
        base = _round_up(start, LOCAL_ALIGN)
        if base + size <= end:
            return base
    return None


def plan_region(state: PoolState, size: int, interleave: int | None, ways: int | None,
                rights: int, rkey: int, tenant: str, owner: str = "") -> Region:  # fmt: skip
    """Where a new region goes (pure: the caller registers and saves)."""
    if size <= 0:
        raise ControllerError(f"size {size} must be positive")
    nodes = len(state.nodes)
    if ways is not None and not 1 <= ways <= nodes:
        raise ControllerError(f"--ways {ways} does not fit a pool of {nodes} nodes: give 1..{nodes}")
    if ways is not None and not interleave:
        raise ControllerError("--ways needs --interleave (a region without it lives on one node)")
    if interleave:
        if interleave % STRIDE_ALIGN or interleave < STRIDE_ALIGN:
            raise ControllerError(f"interleave stride {interleave} must be a positive multiple of {STRIDE_ALIGN} (e.g. 8KiB)")
        count = min(ways or nodes, nodes)
        if count < 1:
            raise ControllerError(f"ways must be 1..{nodes}")
        stride = interleave
    else:
        count, stride = 1, 0
    per = backing_per_way(size, stride, count)
    # Ways on the nodes with the most free bytes (ties: lower rank), one way per node.
    by_room = sorted(range(nodes), key=lambda r: (-sum(e - s for s, e in free_ranges(state, r)), r))
    chosen = []
    for rank in by_room:
        base = first_fit(state, rank, per)
        if base is not None:
            chosen.append(Way(rank, base, per))
        if len(chosen) == count:
            break
    if len(chosen) < count:
        raise ControllerError(f"no room for {size} bytes: {count} node(s) need {per} free bytes each; "
                              f"{room_hint(state, size, interleave)}", Status.NO_SPACE)  # fmt: skip
    chosen.sort(key=lambda w: w.node)
    gaddr = _round_up(state.next_gaddr, GLOBAL_ALIGN)
    return Region(gaddr, size, rkey, rights, stride, tuple(chosen), tenant, owner=owner)


#: The stride a hint suggests (the CLI's example): any multiple of STRIDE_ALIGN works.
HINT_STRIDE = max(8192, STRIDE_ALIGN)


def _fits(state: PoolState, size: int, stride: int, count: int) -> bool:
    """Whether plan_region would place *size* bytes in *count* ways of *stride* now."""
    per = backing_per_way(size, stride, count)
    return sum(first_fit(state, rank, per) is not None for rank in range(len(state.nodes))) >= count


def room_hint(state: PoolState, size: int, interleave: int | None) -> str:
    """What the pool has free for a region of *size* bytes that found no room, and only the
    steps that would really help (each checked against *state*, none guessed)."""
    nodes = len(state.nodes)
    ranges = [(_round_up(s, LOCAL_ALIGN), e) for r in range(nodes) for s, e in free_ranges(state, r)]
    total = sum(max(e - s, 0) for s, e in ranges)
    largest = max((e - s for s, e in ranges), default=0)
    steps = []
    if not interleave and nodes > 1 and _fits(state, size, HINT_STRIDE, nodes):
        steps.append(f"--interleave {format_size(HINT_STRIDE)} spreads it over the {nodes} nodes")
    if largest > 0:
        steps.append(f"a --size of at most {largest}B fits on one node")
    if state.regions:
        steps.append("free regions (`netdam pool list` shows them, `netdam pool free` frees one)")
    steps.append("or start the cluster with more memory per node (`netdam up --switch --memory SIZE`)")
    return (f"the pool has {_bytes(total)} free over {nodes} node(s), at most {_bytes(largest)} in one "
            "piece: " + "; ".join(steps))


def _bytes(n: int) -> str:
    return f"{n} B ({n / (1 << 20):.1f} MiB)"


def credential_digest(credential: int) -> str:
    """What the state file keeps of a tenant credential: SHA-256 of its 8 bytes (LE), hex."""
    return hashlib.sha256(credential.to_bytes(8, "little")).hexdigest()


def region_info(region: Region, credential: int = 0) -> RegionInfo:
    """The wire record of *region* (SPEC.md 11.9)."""
    return RegionInfo(region.gaddr, region.size, region.rkey, region.stride, region.rights,
                      tuple(RegionWay(w.node, w.local, w.size) for w in region.ways), credential,
                      region.tenant)  # fmt: skip


def region_from_info(info: RegionInfo) -> Region:
    extra: dict[str, object] = {"credential": info.credential} if info.credential else {}
    return Region(info.gaddr, info.size, info.rkey, info.rights, info.stride,
                  tuple(Way(w.node, w.local, w.size) for w in info.ways), info.label, extra=extra)  # fmt: skip


class NodeAgent(Protocol):
    """How the pool service reaches the nodes (the switch process gives it a UDP client)."""

    def register(self, node: tuple[str, int], base: int, size: int, rights: int, rkey: int) -> Status:
        """REGISTER on *node*: OK, or the node's NACK status (TIMEOUT: no answer)."""
        ...

    def deregister(self, node: tuple[str, int], rkey: int) -> Status:
        ...


class PoolService:
    """ALLOC, FREE and QUERY at the switch (SPEC.md 11.9): authorisation, allocation,
    registration on the nodes, persistence. ``on_change(state)`` is called after every change so
    the switch swaps its map before the ACK leaves."""

    def __init__(self, cluster: ClusterFile, state_path: Path, agent: NodeAgent,
                 on_change: Callable[[PoolState], None] = lambda state: None) -> None:  # fmt: skip
        self.cluster = cluster
        self.state_path = Path(state_path)
        self.agent = agent
        self.on_change = on_change
        self._replies: OrderedDict[tuple[int, int, int], PoolReply] = OrderedDict()

    def handle(self, packet: Packet, src: int) -> PoolReply:
        """The answer to one ALLOC/FREE/QUERY from *src*; a retry of an ALLOC or FREE that
        succeeded (same source, client id and txn id) gets the same answer and changes nothing."""
        key = (src, packet.client_id, packet.txn_id)
        if packet.opcode != Opcode.QUERY and key in self._replies:
            self._replies.move_to_end(key)
            return self._replies[key]
        try:
            if packet.rkey not in (0, self.cluster.admin_key):
                return PoolReply(Status.UNAUTHORIZED)
            admin = packet.rkey == self.cluster.admin_key
            if packet.opcode == Opcode.ALLOC:
                reply = self._alloc(unpack_alloc(packet.payload), admin)
            else:
                reply = self._free_or_query(packet.opcode, packet.addr, unpack_credential(packet.payload), admin)
        except RemoteProtocolError as exc:
            return PoolReply(exc.status, text=str(exc))
        if reply.status == Status.OK and packet.opcode != Opcode.QUERY:
            self._replies[key] = reply
            while len(self._replies) > REPLY_CACHE:
                self._replies.popitem(last=False)
        return reply

    # ------------------------------------------------------------------ the three requests

    def _alloc(self, req: AllocRequest, admin: bool) -> PoolReply:
        if req.reserved:
            return PoolReply(Status.BAD_FIELD, text="ALLOC reserved byte must be 0")
        with locked(self.state_path):
            state = load_state(self.state_path)
            credential = req.credential
            if credential == 0:
                if not admin:
                    return PoolReply(Status.UNAUTHORIZED, text="a new tenant needs the admin key")
                while credential == 0:
                    credential = secrets.randbits(64)
                owner = credential_digest(credential)
            else:
                owner = credential_digest(credential)
                if owner not in state.tenants:
                    return PoolReply(Status.UNAUTHORIZED, text="unknown tenant credential")
            if req.size == 0 or req.rights == 0 or req.rights & ~int(RIGHTS_ALL):
                return PoolReply(Status.BAD_FIELD, text="size must be > 0, rights 1..7")
            try:
                region = self._place(state, req, owner)
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
        return PoolReply(Status.OK, region_info(region, credential).encode(), rkey=region.rkey, addr=region.gaddr)

    def _place(self, state: PoolState, req: AllocRequest, owner: str) -> Region:
        """Plan the region and register its backing on the nodes under a fresh rkey."""
        used = {r.rkey for r in state.regions}
        for _attempt in range(8):
            rkey = secrets.randbits(32)
            if rkey == 0 or rkey in used:
                continue
            region = plan_region(state, req.size, req.stride or None, req.ways or None, req.rights, rkey,
                                 req.label, owner)  # fmt: skip
            if self._register(state, region) == Status.EXISTS:  # a node uses that rkey: pick another
                continue
            return region
        raise ControllerError("could not find an rkey free on every node in 8 tries", Status.NO_SPACE)

    def _free_or_query(self, opcode: Opcode, addr: int, credential: int, admin: bool) -> PoolReply:
        owner = credential_digest(credential) if credential else ""
        with locked(self.state_path):
            state = load_state(self.state_path)
            if not admin and (not credential or owner not in state.tenants):
                return PoolReply(Status.UNAUTHORIZED, text="unknown tenant credential")
            visible = sorted((r for r in state.regions if admin or r.owner == owner), key=lambda r: r.gaddr)
            if opcode == Opcode.QUERY:
                match = [r for r in visible if r.gaddr >= addr][:1]
            else:
                match = [r for r in visible if r.gaddr == addr]
            if not match:
                return PoolReply(Status.NO_ROUTE, text=f"no region of yours at 0x{addr:x}")
            region = match[0]
            if opcode == Opcode.FREE:
                state.regions.remove(region)
                state.generation += 1
                save_state(self.state_path, state)
        if opcode == Opcode.FREE:
            self.on_change(state)  # out of the map before the backing goes
            for way in region.ways:
                self.agent.deregister(self._endpoint(state, way.node), region.rkey)
        return PoolReply(Status.OK, region_info(region).encode(), rkey=region.rkey, addr=region.gaddr)

    # ------------------------------------------------------------------ nodes

    def _register(self, state: PoolState, region: Region) -> Status:
        done: list[Way] = []
        for way in region.ways:
            node = self._endpoint(state, way.node)
            status = self.agent.register(node, way.local, way.size, region.rights, region.rkey)
            if status != Status.OK:
                for back in done:
                    self.agent.deregister(self._endpoint(state, back.node), region.rkey)
                if status == Status.EXISTS:
                    return status
                raise _NodeRefused(status, f"node {way.node} refused the backing of a new region: {status.name}")
            done.append(way)
        return Status.OK

    def _endpoint(self, state: PoolState, rank: int) -> tuple[str, int]:
        heap = state.nodes[rank]
        entry = self.cluster.nodes[rank]
        if entry.endpoint != heap.endpoint:
            raise _NodeRefused(Status.BAD_FIELD, f"state file names node {rank} {heap.endpoint}, the cluster "
                               f"file {entry.endpoint}: they belong to different clusters")  # fmt: skip
        return (str(entry.address), int(entry.port))


class _NodeRefused(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class UdpNodeAgent:
    """REGISTER/DEREGISTER over UDP with the admin key (the switch process's agent)."""

    def __init__(self, admin_key: int) -> None:
        self.client = ControlClient(admin_key=admin_key)

    def register(self, node: tuple[str, int], base: int, size: int, rights: int, rkey: int) -> Status:
        packet = Packet(Opcode.REGISTER, rkey=self.client.admin_key, addr=base, aux_addr=size, length=8,
                        payload=pack_key_rights(rkey, rights))  # fmt: skip
        return self._call(node, packet)

    def deregister(self, node: tuple[str, int], rkey: int) -> Status:
        packet = Packet(Opcode.DEREGISTER, rkey=self.client.admin_key, length=8, payload=pack_key_rights(rkey, 0))
        return self._call(node, packet)

    def _call(self, node: tuple[str, int], packet: Packet) -> Status:
        try:
            self.client.request(node, packet, timeout=NODE_TIMEOUT_S, retries=NODE_RETRIES)
        except ControlError as exc:
            return Status(exc.status) if exc.status is not None else Status.TIMEOUT
        return Status.OK

    def close(self) -> None:
        self.client.close()


class PoolController:
    """Client of one pool's allocator: ALLOC, FREE and QUERY to the switch's VIP (SPEC.md 11.9),
    with the cluster file's admin key, or with a tenant *credential* (then only that tenant's
    regions are visible)."""

    def __init__(self, cluster_path: Path, state_path: Path | None = None, timeout: float = REQUEST_TIMEOUT_S,
                 credential: int | None = None) -> None:  # fmt: skip
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
        reply = self._request(Opcode.QUERY, addr, pack_credential(self.credential or 0))
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
        raise ControllerError(f"no region at 0x{gaddr:x}: `netdam pool list --cluster FILE` shows them",
                              Status.NO_ROUTE)  # fmt: skip

    def alloc(self, size: int, interleave: int | None = None, *, ways: int | None = None,
              rights: int = int(RIGHTS_ALL), tenant: str = "") -> Region:  # fmt: skip
        """Allocate *size* bytes: range-mapped on one node, or interleaved with stride
        *interleave* over *ways* nodes (default all). Returns the region (gaddr, rkey, ...;
        ``extra["credential"]``: the tenant credential that frees and queries it). The switch
        answers once it serves the new map."""
        if rights == 0 or rights & ~int(RIGHTS_ALL):
            raise ControllerError(f"rights {rights} must combine READ (1), WRITE (2), ATOMIC (4)")
        if size <= 0 or size >= 1 << 64:
            raise ControllerError(f"size {size} must be positive")
        if interleave is not None and not 0 < interleave < 1 << 32:
            raise ControllerError(f"interleave stride {interleave} must be 1..{(1 << 32) - 1} bytes")
        if ways is not None and not 0 < ways < 1 << 16:
            raise ControllerError(f"ways {ways} must be 1..65535")
        request = AllocRequest(size, self.credential or 0, interleave or 0, ways or 0, rights, tenant)
        reply = self._request(Opcode.ALLOC, 0, request.encode())
        return region_from_info(unpack_region_info(reply.payload))

    def free(self, gaddr: int) -> Region:
        """Free the region at *gaddr*: the switch removes it from the map, then deregisters its
        backing on the nodes. Returns what was freed."""
        reply = self._request(Opcode.FREE, gaddr, pack_credential(self.credential or 0))
        return region_from_info(unpack_region_info(reply.payload))

    def _request(self, opcode: Opcode, addr: int, payload: bytes) -> Packet:
        """Send one pool request to the VIP (admin key unless a credential is set)."""
        vip = self.switch.vip
        rkey = 0 if self.credential else self.cluster.admin_key
        packet = Packet(opcode, rkey=rkey, addr=addr, length=len(payload), payload=payload)
        with ControlClient() as client:
            try:
                return client.request(vip, packet, timeout=self.timeout, retries=REQUEST_RETRIES)
            except ControlError as exc:
                raise ControllerError(_explain(opcode, addr, exc), exc.status) from None

    # ------------------------------------------------------------------ groups

    def join(self, group: tuple[str, int], member: tuple[str, int]) -> None:
        """JOIN *member* (a node) to *group* at the switch (persisted by the switch)."""
        self._group_op(Opcode.JOIN, group, member)

    def leave(self, group: tuple[str, int], member: tuple[str, int]) -> None:
        self._group_op(Opcode.LEAVE, group, member)

    def _group_op(self, opcode: Opcode, group: tuple[str, int], member: tuple[str, int]) -> None:

        with ControlClient(admin_key=self.cluster.admin_key) as client:
            try:
                client.request(self.switch.control_endpoint,
                               Packet(opcode, rkey=self.cluster.admin_key, addr=endpoint_to_u64(group),
                                      aux_addr=endpoint_to_u64(member)), timeout=self.timeout)  # fmt: skip
            except ControlError as exc:
                raise ControllerError(str(exc)) from None


def _explain(opcode: Opcode, addr: int, exc: ControlError) -> str:
    """One line: what the switch said, and what to do."""
    status = exc.status
    if status is None:
        return f"{exc}: is the switch running (netdam up --switch)?"
    hint = {
        Status.NO_ROUTE: (f"no region at 0x{addr:x}: `netdam pool list --cluster FILE` shows them"
                          if opcode == Opcode.FREE else "no region there"),
        Status.NO_SPACE: "no room for the region in the pool",
        Status.UNAUTHORIZED: "the switch refused the key: pass the cluster file's admin key or the "
                             "tenant credential that ALLOC returned",
        Status.BAD_FIELD: "the switch refused the request's fields (size, stride, ways or rights)",
    }.get(Status(status), str(exc))  # fmt: skip
    return f"{opcode.name} refused ({Status(status).name}): {hint}"
