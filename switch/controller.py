"""The pool controller: allocates and frees regions, registers their backing on the nodes.

``alloc(size, interleave=None|stride) -> Region`` (its ``gaddr`` and ``rkey`` are what a client
needs): picks a global range, picks backing ranges on the nodes (first fit in each node's heap),
picks a random rkey, REGISTERs every backing range on its node *under that same rkey* with the
region's rights (so the node enforces rights and bounds too), then writes the state file; the
switch reloads it and ``alloc`` returns once the switch serves the new map (its COUNTERS show
the new generation). ``free`` removes the region from the map first, then DEREGISTERs.

Runs in any process that can read the cluster file (``netdam pool``, tests): the state file's
lock serialises concurrent controllers.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from netdam.cluster.clusterfile import ClusterFile, SwitchEntry, load_cluster, require_switch
from netdam.cluster.control import ControlClient, ControlError
from netdam.protocol.constants import RIGHTS_ALL, Opcode, Rights, Status
from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Packet, endpoint_to_u64
from netdam.protocol.payloads import pack_key_rights
from netdam.switch.addrmap import (
    GLOBAL_ALIGN,
    LOCAL_ALIGN,
    STRIDE_ALIGN,
    Region,
    Way,
    backing_per_way,
)
from netdam.switch.core import counters_from_payload
from netdam.switch.state import NodeHeap, PoolState, load_state, locked, save_state, state_path_for

#: How long alloc/free wait for the switch to load the new map.
SWITCH_SYNC_TIMEOUT_S = 5.0


class ControllerError(NetdamError):
    """A pool operation failed; the message says why and what to do."""


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
                rights: int, rkey: int, tenant: str) -> Region:  # fmt: skip
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
        hint = "use --interleave to spread it over nodes, or free regions" if not interleave else "free regions or add nodes"
        raise ControllerError(f"no room for {size} bytes: {count} node(s) need {per} free bytes each; {hint}")
    chosen.sort(key=lambda w: w.node)
    gaddr = _round_up(state.next_gaddr, GLOBAL_ALIGN)
    return Region(gaddr, size, rkey, rights, stride, tuple(chosen), tenant)


class PoolController:
    """Allocator of one pool (the cluster file names nodes, admin key and the switch)."""

    def __init__(self, cluster_path: Path, state_path: Path | None = None, timeout: float = 1.0) -> None:
        self.cluster_path = Path(cluster_path)
        try:
            self.cluster: ClusterFile = load_cluster(self.cluster_path)
            entry = require_switch(self.cluster_path)
        except ValueError as exc:
            raise ControllerError(str(exc)) from None
        default = Path(entry.state_file) if entry.state_file else state_path_for(self.cluster_path)
        self.state_path = Path(state_path) if state_path else default
        self.timeout = timeout

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
        try:
            return load_state(self.state_path)
        except ValueError as exc:
            raise ControllerError(str(exc)) from None

    def regions(self) -> list[Region]:
        return list(self.state().regions)

    def region(self, gaddr: int) -> Region:
        for r in self.regions():
            if r.gaddr == gaddr:
                return r
        raise ControllerError(f"no region at 0x{gaddr:x}: `netdam pool list --cluster FILE` shows them")

    def switch_generation(self) -> int:
        """Map generation the switch serves (COUNTERS on its management port)."""
        switch = self.switch
        with ControlClient(admin_key=self.cluster.admin_key) as client:
            try:
                reply = client.request(switch.control_endpoint,
                                       Packet(Opcode.COUNTERS, rkey=self.cluster.admin_key),
                                       timeout=self.timeout / 4, retries=3)  # fmt: skip
            except ControlError as exc:
                raise ControllerError(f"switch {switch.address}:{switch.port}: {exc}") from None
        values = counters_from_payload(reply.payload)["switch"]
        return int(values["map_generation"])  # type: ignore[index]

    def wait_for_switch(self, generation: int) -> None:
        deadline = time.monotonic() + SWITCH_SYNC_TIMEOUT_S
        while True:
            if self.switch_generation() >= generation:
                return
            if time.monotonic() > deadline:
                raise ControllerError(f"the switch at {self.switch.address}:{self.switch.port} did not load "
                                f"map generation {generation} within {SWITCH_SYNC_TIMEOUT_S:.0f} s: "
                                f"is it running with --state {self.state_path}?")  # fmt: skip
            time.sleep(0.01)

    # ------------------------------------------------------------------ changes

    def alloc(self, size: int, interleave: int | None = None, *, ways: int | None = None,
              rights: int = int(RIGHTS_ALL), tenant: str = "", wait: bool = True) -> Region:  # fmt: skip
        """Allocate *size* bytes: range-mapped on one node, or interleaved with stride
        *interleave* over *ways* nodes (default all). Returns the region (gaddr, rkey, ...)."""
        if rights == 0 or rights & ~int(RIGHTS_ALL):
            raise ControllerError(f"rights {rights} must combine READ (1), WRITE (2), ATOMIC (4)")
        with locked(self.state_path):
            state = self.state()
            used = {r.rkey for r in state.regions}
            for _attempt in range(8):
                rkey = secrets.randbits(32)
                if rkey == 0 or rkey in used:
                    continue
                region = plan_region(state, size, interleave, ways, rights, rkey, tenant)
                status = self._register(state, region)
                if status == Status.EXISTS:  # a node uses that rkey already: pick another
                    continue
                break
            else:
                raise ControllerError("could not find an rkey free on every node in 8 tries")
            state.regions.append(region)
            state.next_gaddr = region.gaddr + _round_up(region.size, GLOBAL_ALIGN)
            state.generation += 1
            save_state(self.state_path, state)
            generation = state.generation
        if wait:
            self.wait_for_switch(generation)
        return region

    def free(self, gaddr: int, *, wait: bool = True) -> Region:
        """Remove the region at *gaddr* from the map, then deregister its backing on the nodes."""
        with locked(self.state_path):
            state = self.state()
            match = [r for r in state.regions if r.gaddr == gaddr]
            if not match:
                raise ControllerError(f"no region at 0x{gaddr:x}: `netdam pool list --cluster FILE` shows them")
            region = match[0]
            state.regions.remove(region)
            state.generation += 1
            save_state(self.state_path, state)
            if wait:
                self.wait_for_switch(state.generation)
            self._deregister(state, region)
        return region

    def _register(self, state: PoolState, region: Region) -> Status:
        done: list[Way] = []
        with ControlClient(admin_key=self.cluster.admin_key) as client:
            for way in region.ways:
                node = self._node(state.nodes[way.node], way.node)
                try:
                    client.register(node, way.local, way.size, Rights(region.rights), rkey=region.rkey)
                except ControlError as exc:
                    self._deregister_ways(client, state, region.rkey, done)
                    if exc.status == Status.EXISTS:
                        return Status.EXISTS
                    raise ControllerError(f"node {way.node} refused the backing of a new region: {exc}") from None
                done.append(way)
        return Status.OK

    def _deregister(self, state: PoolState, region: Region) -> None:
        with ControlClient(admin_key=self.cluster.admin_key) as client:
            self._deregister_ways(client, state, region.rkey, list(region.ways))

    def _deregister_ways(self, client: ControlClient, state: PoolState, rkey: int, ways: list[Way]) -> None:

        for way in ways:
            node = self._node(state.nodes[way.node], way.node)
            try:
                client.request(node, Packet(Opcode.DEREGISTER, rkey=self.cluster.admin_key, length=8,
                                            payload=pack_key_rights(rkey, 0)))  # fmt: skip
            except ControlError as exc:
                if exc.status != Status.BAD_RKEY:  # already gone
                    raise ControllerError(f"node {way.node} did not deregister rkey 0x{rkey:08x}: {exc}") from None

    def _node(self, heap: NodeHeap, rank: int) -> tuple[str, int]:
        """The data endpoint of node *rank* (checked against the state's node list)."""
        entry = self.cluster.nodes[rank]
        if entry.endpoint != heap.endpoint:
            raise ControllerError(f"state file {self.state_path} names node {rank} {heap.endpoint}, the "
                            f"cluster file {entry.endpoint}: they belong to different clusters")  # fmt: skip
        return (str(entry.address), int(entry.port))

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
