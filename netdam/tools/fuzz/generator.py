"""Structured fuzzing of NetDAM nodes and switches, sans-I/O: the layout and the generator.

The I/O shell (``netdam fuzz``, runner.py beside this) starts a cluster, sends what this module
generates and reads counters and memory; everything that decides lives here, so the tests drive
the same code against ``NodeCore`` and ``SwitchCore`` in memory:

- ``Layout``: the cluster as the fuzzer sees it: endpoints, the regions registered on every
  node (rkey, base, size, rights), the pool's address map and multicast group (switch target),
  and a third-party endpoint that must never receive anything.
- ``DatagramGenerator``: seeded datagrams (``numpy`` RNG, drawn in batches): valid packets
  with live rkeys and addresses near region and stripe bounds, structured mutations of them
  (bit flips; field-aware changes of opcode, flags, length, address, rkey, dtype, version,
  reserved bytes; SR-list and sparse-payload corruption; truncation; extension; repeats) and
  random bytes. The sequence depends on the seed only, so a run replays.
- The oracle and the checks (``Oracle``, ``Expectation``, ``counter_checks``, ``MemoryGuard``)
  live in netdam/tools/fuzz/oracle.py.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DEFAULT_MTU,
    ELEMENT_SIZE,
    FLAGS_V1_MASK,
    HEADER_SIZE,
    IP_UDP_OVERHEAD,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    REPLY_OPCODES,
    SEGMENT_SIZE,
    UPDATE_DTYPES,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.layout import (
    H_ADDR,
    H_AUX_ADDR,
    H_CLIENT_ID,
    H_COLL_ID,
    H_CREDIT,
    H_DTYPE,
    H_EPOCH,
    H_FLAGS,
    H_LENGTH,
    H_OPCODE,
    H_REDUCE_OP,
    H_RESERVED1,
    H_RESERVED2,
    H_RET_IP,
    H_RET_PORT,
    H_RKEY,
    H_SEG_COUNT,
    H_SEG_TYPE,
    H_SEGMENTS_LEFT,
    H_SEQ,
    H_STATUS,
    H_TXN_ID,
    H_VERSION,
)
from netdam.protocol.packet import HEADER_STRUCT, SEGMENT_STRUCT, Endpoint, endpoint_to_u64
from netdam.protocol.payloads import pack_key_rights, pack_sparse_prefix
from netdam.switch.addrmap import GLOBAL_BASE, Region, Way, page_round
from netdam.switch.state import PoolNode, PoolState

TARGETS = ("node", "switch")
_T = TypeVar("_T")
_R = TypeVar("_R", "NodeRegion", Region)

# Header field offsets (SPEC.md 2.1, protocol/layout.py).
O_VERSION, O_OPCODE, O_FLAGS, O_SEQ, O_CLIENT, O_TXN = (
    H_VERSION,
    H_OPCODE,
    H_FLAGS,
    H_SEQ,
    H_CLIENT_ID,
    H_TXN_ID,
)
O_COLL, O_EPOCH, O_RKEY, O_LENGTH, O_ADDR, O_AUX = (
    H_COLL_ID,
    H_EPOCH,
    H_RKEY,
    H_LENGTH,
    H_ADDR,
    H_AUX_ADDR,
)
O_DTYPE, O_OP, O_STATUS, O_CREDIT = H_DTYPE, H_REDUCE_OP, H_STATUS, H_CREDIT
O_SEG_TYPE, O_LEFT, O_COUNT = H_SEG_TYPE, H_SEGMENTS_LEFT, H_SEG_COUNT
O_RES1, O_RET_IP, O_RET_PORT, O_RES2 = H_RESERVED1, H_RET_IP, H_RET_PORT, H_RESERVED2

# Event codes of an Outcome: (process, code, value).
EV_RX = 0  # a datagram arrived (value unused)
EV_OP = 1  # passed the structural checks; value = opcode (the per-opcode counter)
EV_NACK = 2  # NACK sent; value = status
EV_DROP = 3  # dropped silently; value = the counter index (netdam.protocol.counters)
EV_FWD = 4  # CHAIN_ADD forwarded (node) or pool request translated and forwarded (switch)
EV_REPL = 5  # multicast copy sent by the switch
EV_STORED = 6  # CHAIN_ADD stored by its last hop
EV_WINDOW = 7  # went through the duplicate window: executes, replays, or NACK STALE or BUSY
EV_OPEN = 8  # an UPDATE past its descriptor's access check: node memory decides (oracle.py)

#: Drop counters the oracle predicts (every other drop counter must stay 0).
DROP_COUNTERS = (
    C.DROP_TRUNCATED,
    C.DROP_BAD_REPLY,
    C.DROP_STALE_EPOCH,
    C.DROP_TX_FULL,
    C.DROP_OVERSIZE,
    C.DROP_UNEXPECTED_REPLY,
    C.DROP_FAULT,
    C.DROP_COLL_EARLY,
    C.DROP_COLL_FORGED,
)

_DATA_OPCODES = (
    Opcode.READ,
    Opcode.WRITE,
    Opcode.ADD,
    Opcode.CHAIN_ADD,
    Opcode.ALL_WRITE,
    Opcode.FETCH_ADD,
    Opcode.CAS,
    Opcode.UPDATE,
)
_SPARSE_OPCODES = (Opcode.WRITE, Opcode.ALL_WRITE, Opcode.CHAIN_ADD)
#: Opcodes a node's duplicate window remembers (SPEC.md 7): the oracle predicts their replays.
WINDOWED_OPCODES = (Opcode.WRITE, Opcode.ADD, Opcode.FETCH_ADD, Opcode.CAS, Opcode.UPDATE)
_NEEDS = {
    Opcode.READ: int(Rights.READ),
    Opcode.CHAIN_ADD: int(Rights.READ | Rights.WRITE),
    Opcode.FETCH_ADD: int(Rights.ATOMIC),
    Opcode.CAS: int(Rights.ATOMIC),
    Opcode.WRITE: int(Rights.WRITE),
    Opcode.ADD: int(Rights.WRITE),
    Opcode.ALL_WRITE: int(Rights.WRITE),
    Opcode.UPDATE: int(Rights.READ | Rights.WRITE),
}
#: The gradient dtypes an UPDATE takes (the others: BAD_DTYPE), by value.
_GRADIENT_DTYPES = sorted(int(t) for t in UPDATE_DTYPES)
#: Bytes per element by DType value (a list: the generator indexes it with raw field values).
ELEMENT_BYTES = [ELEMENT_SIZE[DType(v)] for v in range(len(DType))]
#: The highest dtype code (SPEC.md 2.4); codes above it are BAD_DTYPE.
MAX_DTYPE = max(DType)
_ALL_OPCODES = [int(op) for op in Opcode]
#: Opcode values a mutation tries besides the defined ones: the edges of the free ranges.
_ODD_OPCODES = [0x00, 0x0E, 0x1F, 0x26, 0x3F, 0x40, 0x7F, 0x80, 0xFF]
_INTERESTING_BYTES = [0x00, 0x01, 0x02, 0x07, 0x08, 0x3F, 0x40, 0x7F, 0x80, 0xFE, 0xFF]


def expected_statuses(target: str) -> tuple[Status, ...]:
    """NACK statuses a fuzz run must reach (as a client without the admin key).

    Unreachable that way, by design: EXISTS and NO_SPACE (REGISTER needs the admin key),
    STALE_EPOCH (reserved), TIMEOUT (collective completions), SPANS_NODES and NO_ROUTE at a
    node (switch statuses), NOT_MEMBER at the switch (JOIN needs the admin key)."""
    common = [
        Status.BAD_VERSION,
        Status.BAD_OPCODE,
        Status.TRUNCATED,
        Status.BAD_LENGTH,
        Status.BAD_DTYPE,
        Status.BAD_OP,
        Status.BAD_SEGMENT,
        Status.BAD_RKEY,
        Status.NO_RIGHTS,
        Status.OUT_OF_BOUNDS,
        Status.MISALIGNED,
        Status.TOO_LARGE,
        Status.STALE,
        Status.UNAUTHORIZED,
        Status.BAD_FIELD,
        Status.BUSY,
    ]
    extra = [Status.NOT_MEMBER] if target == "node" else [Status.SPANS_NODES, Status.NO_ROUTE]
    return tuple(sorted(common + extra))


def expected_opcodes(target: str) -> tuple[Opcode, ...]:
    """Opcodes that must reach the target's processes valid (every one of them)."""
    return tuple(Opcode)


# ---------------------------------------------------------------- the cluster as fuzzed


@dataclass(frozen=True)
class NodeRegion:
    """A region registered on a node: ``[base, base + size)`` under ``rkey`` with ``rights``."""

    rkey: int
    base: int
    size: int
    rights: int

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass(frozen=True)
class Layout:
    """What the fuzzer aims at and what the oracle knows about the target cluster."""

    target: str
    nodes: tuple[Endpoint, ...]
    #: Per node (rank order): the regions registered there.
    node_regions: tuple[tuple[NodeRegion, ...], ...]
    memory_bytes: int
    mtu: int = DEFAULT_MTU
    #: Switch target: the VIP, the pool's regions, the multicast group and its members (ranks).
    vip: Endpoint | None = None
    pool: tuple[Region, ...] = ()
    group: Endpoint | None = None
    group_members: tuple[int, ...] = ()
    #: An endpoint that must never receive a datagram (used as return segment and SR hop).
    third_party: Endpoint = ("127.0.0.1", 9)
    #: The target processes hold the cluster's admin tag key (SPEC.md 2.6, "Control tags"),
    #: as every process `netdam up` starts does; bare cores in tests hold none.
    admin_tagged: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown fuzz target {self.target!r}: give node or switch")
        if len(self.node_regions) != len(self.nodes):
            raise ValueError("give the regions of every node (node_regions, one tuple per node)")
        if self.target == "switch" and (self.vip is None or not self.pool):
            raise ValueError("a switch layout needs the VIP and at least one pool region")

    @property
    def destinations(self) -> tuple[Endpoint, ...]:
        """Where fuzz datagrams go: the nodes, or the VIP."""
        if self.target == "switch":
            assert self.vip is not None
            return (self.vip,)
        return self.nodes

    @property
    def processes(self) -> tuple[Endpoint, ...]:
        """Every process, nodes in rank order then the switch (event process indices)."""
        return self.nodes + ((self.vip,) if self.vip is not None else ())

    @property
    def max_datagram(self) -> int:
        return int(self.mtu - IP_UDP_OVERHEAD)

    def process_name(self, index: int) -> str:
        return f"node{index}" if index < len(self.nodes) else "switch"


#: Pool regions a switch-target run allocates: (size, interleave stride or 0, rights). Sizes
#: and strides are uneven on purpose (a region ending mid-stripe, a 64-byte stride).
POOL_PLAN: tuple[tuple[int, int, int], ...] = (
    (40 * 1024 + 24, 8192, int(Rights.READ | Rights.WRITE | Rights.ATOMIC)),
    (16 * 1024, 0, int(Rights.READ)),
    (8 * 1024, 0, int(Rights.WRITE)),
    (4 * 1024, 0, int(Rights.ATOMIC)),
    (24 * 1024, 64, int(Rights.READ | Rights.WRITE)),
)
#: Smallest node memory the node-target plan fits in.
NODE_PLAN_BYTES = 0x60000


def fuzz_rkeys(seed: int, count: int) -> list[int]:
    """*count* distinct non-zero rkeys, none next to another (rkey +- 1 is never live)."""
    rng = np.random.default_rng([seed, 0x52C3])
    keys: list[int] = []
    while len(keys) < count:
        key = int(rng.integers(2, 1 << 32))
        if all(abs(key - k) > 1 for k in keys) and key < 0xFFFFFFFF:
            keys.append(key)
    return keys


def node_region_plan(memory_bytes: int, seed: int) -> tuple[NodeRegion, ...]:
    """Regions a node-target run registers on every node, under the same rkeys: all rights;
    read-only; write-only; atomic-only; read-write of an odd size; a tiny one at an odd base.
    Every other byte of memory is registered nowhere, so nothing may ever change it."""
    if memory_bytes < NODE_PLAN_BYTES:
        raise ValueError(
            f"node memory of {memory_bytes} bytes is too small for the fuzz regions: give at least {NODE_PLAN_BYTES}"
        )
    all_rights = int(Rights.READ | Rights.WRITE | Rights.ATOMIC)
    spans = [
        (0x01000, 0x10000, all_rights),
        (0x20000, 0x04000, int(Rights.READ)),
        (0x28000, 0x04000, int(Rights.WRITE)),
        (0x30000, 0x01000, int(Rights.ATOMIC)),
        (0x40000, 0x02004, int(Rights.READ | Rights.WRITE)),
        (0x50003, 13, all_rights),
    ]
    keys = fuzz_rkeys(seed, len(spans))
    return tuple(
        NodeRegion(k, base, size, rights)
        for k, (base, size, rights) in zip(keys, spans, strict=True)
    )


def node_regions_of_pool(pool: Sequence[Region], nodes: int) -> tuple[tuple[NodeRegion, ...], ...]:
    """What the pool controller registers on each node: every way's backing under the region's
    rkey and rights (SPEC.md 11.2)."""
    return tuple(
        tuple(
            NodeRegion(r.rkey, w.local, w.size, r.rights)
            for r in pool
            for w in r.ways
            if w.node == rank
        )
        for rank in range(nodes)
    )


def plan_pool(nodes: Sequence[Endpoint], memory_bytes: int, seed: int) -> tuple[Region, ...]:
    """The regions of POOL_PLAN on the nodes the pool controller picks (its pure choice), each
    way's backing where a node with nothing else registered puts it (first fit, page-aligned:
    SPEC.md 6.1), with rkeys from *seed*: for tests that run the switch in memory."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import candidate_nodes, next_gaddr, region_shape

    state = PoolState(nodes=[PoolNode(ep[0], ep[1], memory_bytes) for ep in nodes])
    tops = [0] * len(nodes)  # each node's first free byte: the pool's regions are all it holds
    for rkey, (size, interleave, rights) in zip(
        fuzz_rkeys(seed, len(POOL_PLAN)), POOL_PLAN, strict=True
    ):
        stride, count, per = region_shape(len(nodes), size, interleave or None, None)
        ways = []
        for rank in sorted(candidate_nodes(state, per)[:count]):
            ways.append(Way(rank, tops[rank], per))
            tops[rank] += page_round(per)
        region = Region(next_gaddr(state), size, rkey, rights, stride, tuple(ways), "fuzz")
        state.regions.append(region)
        state.next_gaddr = region.end
    return tuple(state.regions)


# ---------------------------------------------------------------- seeded draws


#: Random bytes payloads are sliced from (refreshed every 4096 slices).
_POOL_BYTES = 1 << 16


class Draws:
    """Fast seeded random numbers: numpy draws in batches, handed out as Python ints."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._vals: list[int] = []
        self._pos = 0
        self._pool = self._rng.bytes(_POOL_BYTES)
        self._pool_uses = 0

    def u32(self) -> int:
        if self._pos >= len(self._vals):
            self._vals = self._rng.integers(0, 1 << 32, 8192, dtype=np.uint64).tolist()
            self._pos = 0
        value = self._vals[self._pos]
        self._pos += 1
        return int(value)

    def u64(self) -> int:
        return (self.u32() << 32) | self.u32()

    def below(self, n: int) -> int:
        """0 <= value < n (n >= 1)."""
        return self.u32() % n if n < (1 << 32) else self.u64() % n

    def between(self, low: int, high: int) -> int:
        """low <= value <= high."""
        return low + self.below(high - low + 1)

    def chance(self, p: float) -> bool:
        return self.u32() < p * 4294967296.0

    def pick(self, items: Sequence[_T]) -> _T:
        return items[self.below(len(items))]

    def blob(self, n: int) -> bytes:
        """*n* random bytes (slices of a random pool, refreshed now and then)."""
        if n <= 0:
            return b""
        self._pool_uses += 1
        if self._pool_uses >= 1 << 12:
            self._pool = self._rng.bytes(_POOL_BYTES)
            self._pool_uses = 0
        if n >= len(self._pool):
            return self._rng.bytes(n)
        start = self.below(len(self._pool) - n)
        return self._pool[start : start + n]


def _weighted(table: Sequence[tuple[_T, int]]) -> list[_T]:
    """A list where each item appears *weight* times: ``Draws.pick`` on it is a weighted pick."""
    out: list[_T] = []
    for item, weight in table:
        out += [item] * weight
    return out


# ---------------------------------------------------------------- packet building


def header(
    op: int,
    *,
    flags: int = 0,
    seq: int = 0,
    client: int = 0,
    txn: int = 0,
    coll: int = 0,
    epoch: int = 0,
    rkey: int = 0,
    length: int = 0,
    addr: int = 0,
    aux: int = 0,
    dtype: int = 0,
    rop: int = 0,
    status: int = 0,
    credit: int = 0,
    segments: Sequence[int] = (),
    left: int = 0,
    ret: int = 0,
    version: int = 1,
) -> bytes:
    """Fixed header and SR list (segments as ``ip << 16 | port``), packed as SPEC.md 2.1-2.2."""
    head = HEADER_STRUCT.pack(
        version,
        op,
        flags,
        seq,
        client,
        txn,
        coll,
        epoch,
        rkey,
        length,
        addr,
        aux,
        dtype,
        rop,
        status,
        credit,
        1 if segments else 0,
        left,
        len(segments),
        0,
        (ret >> 16) & 0xFFFFFFFF,
        ret & 0xFFFF,
        0,
    )
    return bytes(head) + b"".join(SEGMENT_STRUCT.pack(s >> 16, s & 0xFFFF, 0) for s in segments)


def sparse_encode(dense: bytes, esize: int, keep: Sequence[int]) -> bytes:
    """SPEC.md 2.5 sparse payload listing elements *keep* (strictly increasing) of *dense*."""
    body = bytes(pack_sparse_prefix(len(keep))) + struct.pack(f"<{len(keep)}H", *keep)
    body += bytes(-len(body) % 8)
    return body + b"".join(dense[i * esize : (i + 1) * esize] for i in keep)


@dataclass
class Shape:
    """What a mutation needs to know about a valid packet it changes."""

    segments: int = 0
    sparse: bool = False
    lo: int = 0  # bounds of the range the address was aimed at
    hi: int = 0
    esize: int = 1
    stride: int = 0


@dataclass
class Datagram:
    """One generated datagram: bytes, index into ``Layout.destinations``, how it was made."""

    data: bytes
    dst: int
    kind: str  # "valid", "mutated", "repeated", "random"


class DatagramGenerator:
    """Seeded fuzz datagrams for a layout: valid packets, structured mutations, random bytes.

    ``mix`` sets the shares (valid, mutated, repeated, random); mutations of valid packets are
    always at least half."""

    def __init__(
        self,
        layout: Layout,
        seed: int,
        mix: tuple[float, float, float, float] = (0.33, 0.55, 0.02, 0.10),
    ) -> None:
        if mix[1] < 0.5:
            raise ValueError("at least half of the datagrams must be mutations of valid packets")
        self.layout = layout
        self.d = Draws(seed)
        self._mix = mix
        self._nodes_u64 = [endpoint_to_u64(ep) for ep in layout.nodes]
        self._third = endpoint_to_u64(layout.third_party)
        # In layout order, not by value: the pool's rkeys are random per cluster, and the
        # datagrams' structure must depend on the seed alone.
        self._rkeys = list(
            dict.fromkeys(
                [r.rkey for r in layout.pool] + [r.rkey for rs in layout.node_regions for r in rs]
            )
        )
        # Clients of the duplicate window: anonymous, and three ids with their own txn counters.
        self._clients = [0] + [self.d.u32() | 1 for _ in range(3)]
        self._txn = {c: self.d.u32() for c in self._clients}
        self._recent: list[tuple[bytes, int]] = []
        self._valid_ops = _weighted(_VALID_NODE if layout.target == "node" else _VALID_SWITCH)
        self._mutations = _weighted(_MUTATIONS)
        self.made: Counter[str] = Counter()

    # ------------------------------------------------------------ batches

    def batch(self, n: int) -> list[Datagram]:
        return [self.next() for _ in range(n)]

    def next(self) -> Datagram:
        d = self.d
        roll = d.u32() / 4294967296.0
        valid, mutated, repeated = self._mix[0], self._mix[1], self._mix[2]
        if roll < valid:
            data, dst, _ = self.valid()
            kind = "valid"
        elif roll < valid + mutated:
            base, dst, shape = self.valid()
            data = self.mutate(base, shape)
            kind = "mutated"
        elif roll < valid + mutated + repeated and self._recent:
            data, dst = self._recent[d.below(len(self._recent))]
            kind = "repeated"
        else:
            data, dst = self.random_bytes(), d.below(len(self.layout.destinations))
            kind = "random"
        if len(self._recent) < 64:
            self._recent.append((data, dst))
        else:
            self._recent[d.below(64)] = (data, dst)
        self.made[kind] += 1
        return Datagram(data, dst, kind)

    # ------------------------------------------------------------ valid packets

    def valid(self) -> tuple[bytes, int, Shape]:
        """A valid packet (SPEC.md), aimed at live regions; (bytes, destination, shape)."""
        what = self.d.pick(self._valid_ops)
        if self.layout.target == "switch":
            return self._valid_switch(what)
        dst = self.d.below(len(self.layout.nodes))
        data, shape = self._valid_node(what, dst)
        return data, dst, shape

    def _valid_node(self, what: str, node: int) -> tuple[bytes, Shape]:
        regions = self.layout.node_regions[node]
        if what in ("READ", "WRITE", "ADD", "ALL_WRITE", "FETCH_ADD", "CAS", "CHAIN_ADD", "UPDATE"):
            region = self._region_for(Opcode[what], regions)
            return self._data_packet(Opcode[what], region.rkey, region.base, region.end, 0)
        return self._other_packet(what)

    def _valid_switch(self, what: str) -> tuple[bytes, int, Shape]:
        d = self.d
        if what == "MCAST":
            # ALL_WRITE to the group: node-local address and rkey of a way of a pool region.
            region = self.layout.pool[d.below(len(self.layout.pool))]
            way = region.ways[d.below(len(region.ways))]
            data, shape = self._data_packet(
                Opcode.ALL_WRITE, region.rkey, way.local, way.local + way.size, 0, mcast=True
            )
            return data, 0, shape
        if what in ("READ", "WRITE", "ADD", "ALL_WRITE", "FETCH_ADD", "CAS", "UPDATE"):
            region = self._region_for(Opcode[what], self.layout.pool)
            data, shape = self._data_packet(
                Opcode[what], region.rkey, region.gaddr, region.end, region.stride
            )
            return data, 0, shape
        if what == "CHAIN_ADD":
            region = self.layout.pool[d.below(len(self.layout.pool))]
            data, shape = self._data_packet(
                Opcode.CHAIN_ADD, region.rkey, region.gaddr, region.end, region.stride
            )
            return data, 0, shape
        data, shape = self._other_packet(what)
        return data, 0, shape

    def _region_for(self, op: Opcode, regions: Sequence[_R]) -> _R:
        """Mostly a region whose rights allow *op* (the rest: NO_RIGHTS)."""
        need = _NEEDS[op]
        fit = [r for r in regions if r.rights & need == need]
        if fit and self.d.chance(0.85):
            return fit[0] if self.d.chance(0.4) else self.d.pick(fit)
        return self.d.pick(regions)

    def _client_txn(self) -> tuple[int, int]:
        d = self.d
        client = self._clients[d.below(len(self._clients))]
        if client == 0 and self.layout.target == "node":
            return 0, d.u32()
        roll = d.below(100)
        if roll < 92:
            self._txn[client] = (self._txn[client] + 1) & 0xFFFFFFFF
            txn = self._txn[client]
        elif roll < 96:
            txn = (self._txn[client] - d.below(8)) & 0xFFFFFFFF  # a retry inside the window
        else:
            txn = (self._txn[client] - 256 - d.below(1000)) & 0xFFFFFFFF  # STALE
        return client, txn

    def _flags(self, op: Opcode) -> int:
        d = self.d
        flags = Flags.ACK_REQ if d.chance(0.7) else 0
        if d.chance(0.1):
            flags |= Flags.RETRY
        if d.chance(0.03):
            flags |= Flags.RELAYED
        if d.chance(0.03) and self.layout.target == "node":
            flags |= Flags.MCAST  # informational at a node
        return int(flags)

    def _elements(self, esize: int, segments: int) -> int:
        d = self.d
        room = (
            int(
                min(
                    MAX_PAYLOAD_BYTES,
                    self.layout.max_datagram - HEADER_SIZE - SEGMENT_SIZE * segments,
                )
            )
            // esize
        )
        roll = d.below(100)
        if roll < 70:
            n = d.between(1, 16)
        elif roll < 90:
            n = d.between(1, 256)
        else:
            n = d.between(1, room)
        return max(1, min(n, room))

    def _aim(self, lo: int, hi: int, nbytes: int, align: int, stride: int) -> int:
        """An address for an operand of *nbytes* in [lo, hi): mostly inside and aligned, often
        at the edges (exactly at the end, one element past, before the start, misaligned,
        across a stripe)."""
        d = self.d
        roll = d.below(100)
        size = hi - lo
        if roll < 72 or size <= 0:
            if stride and d.chance(0.8):
                stripes = max(1, -(-size // stride))
                start = lo + d.below(stripes) * stride
                room = min(stride, hi - start) - nbytes
                addr = start + (d.below(room // align + 1) * align if room >= 0 else 0)
            else:
                first = -(-lo // align) * align  # node memory: aligned in absolute terms
                room = hi - nbytes - first
                addr = first + (d.below(room // align + 1) * align if room >= 0 else 0)
        elif roll < 79:
            addr = hi - nbytes
        elif roll < 84:
            addr = hi - nbytes + align
        elif roll < 88:
            addr = lo - align
        elif roll < 90:
            addr = hi
        elif roll < 94 and stride:
            addr = lo + d.between(1, max(1, size // stride)) * stride - align * d.between(1, 4)
        else:
            addr = lo + d.below(max(size, 1)) + 1
        if roll < 88 and align > 1:
            addr -= (addr - (lo if stride else 0)) % align  # keep element alignment
        return max(0, min(addr, (1 << 64) - 1))

    def _data_packet(
        self, op: Opcode, rkey: int, lo: int, hi: int, stride: int, mcast: bool = False
    ) -> tuple[bytes, Shape]:
        d = self.d
        segments: list[int] = []
        if op == Opcode.CHAIN_ADD:
            count = d.between(1, 4) if d.chance(0.97) else d.between(5, MAX_SEGMENTS)
            for _ in range(count):
                segments.append(
                    self._third
                    if d.chance(0.05)
                    else self._nodes_u64[d.below(len(self._nodes_u64))]
                )
        if op in (Opcode.FETCH_ADD, Opcode.CAS):
            dtype, nbytes, align = int(DType.U64), 8, 8
        elif op == Opcode.UPDATE:
            # A gradient (mostly of a dtype UPDATE takes) for the descriptor at addr (8-aligned).
            dtype = d.pick(_GRADIENT_DTYPES) if d.chance(0.9) else d.between(0, MAX_DTYPE)
            nbytes = self._elements(ELEMENT_BYTES[dtype], 0) * ELEMENT_BYTES[dtype]
            align = 8
        else:
            low = 1 if op in (Opcode.ADD, Opcode.CHAIN_ADD) else 0
            dtype = d.between(low, MAX_DTYPE)
            align = ELEMENT_BYTES[dtype]
            count = self._elements(align, len(segments))
            fits = (min(hi - lo, stride or hi - lo)) // align
            if count > fits >= 1 and d.chance(0.85):
                count = d.between(1, fits)
            nbytes = count * align
        addr = self._aim(lo, hi, nbytes, align, stride)
        aux = self._aim(lo, hi, nbytes, align, stride) if op == Opcode.CHAIN_ADD else 0
        if op == Opcode.UPDATE:
            aux = d.below(1 << 12)  # the chunk's first element
        if d.chance(0.06):
            rkey = self._other_rkey(rkey)
        client, txn = (
            self._client_txn() if op in WINDOWED_OPCODES else (self._clients[d.below(4)], d.u32())
        )
        flags = self._flags(op)
        coll = d.between(1, 3) if d.chance(0.03) else 0
        payload = b""
        length = nbytes
        sparse = False
        if op == Opcode.FETCH_ADD:
            payload = d.blob(8)
        elif op == Opcode.CAS:
            payload = d.blob(16)
        elif op != Opcode.READ:
            payload = d.blob(nbytes)
            if op in _SPARSE_OPCODES and d.chance(0.2) and nbytes // align <= 0xFFFF:
                elements = nbytes // align
                picks = d.below(min(elements, 64) + 1) if d.chance(0.8) else elements
                keep = (
                    sorted({d.below(elements) for _ in range(picks)})
                    if picks < elements
                    else list(range(elements))
                )
                payload = sparse_encode(payload, align, keep)
                flags |= Flags.SPARSE
                sparse = True
        if mcast:
            flags |= Flags.MCAST
            assert self.layout.group is not None
            aux = (
                endpoint_to_u64(self.layout.group)
                if d.chance(0.9)
                else (0xEF4D0000 + d.below(256)) << 16 | 7744
            )
        left = d.below(len(segments)) if segments else 0
        data = header(
            op,
            flags=flags,
            seq=d.u32() if coll else d.below(1 << 16),
            client=client,
            txn=txn,
            coll=coll,
            epoch=d.u32() if coll else (d.below(4) if op == Opcode.UPDATE else 0),
            rkey=rkey,
            length=length,
            addr=addr,
            aux=aux,
            dtype=dtype,
            rop=d.below(3),
            segments=segments,
            left=left,
            ret=self._ret(),
        )
        return data + payload, Shape(len(segments), sparse, lo, hi, align, stride)

    def _other_rkey(self, rkey: int) -> int:
        d = self.d
        roll = d.below(4)
        if roll == 0:
            return int(d.pick(self._rkeys))
        if roll == 1:
            return (rkey + 1) & 0xFFFFFFFF
        if roll == 2:
            return (rkey - 1) & 0xFFFFFFFF
        return 0 if d.chance(0.5) else d.u32()

    def _ret(self) -> int:
        d = self.d
        if d.chance(0.9):
            return 0
        return self._third if d.chance(0.7) else d.u64() & 0xFFFFFFFFFFFF

    def _other_packet(self, what: str) -> tuple[bytes, Shape]:
        """PING, replies and control opcodes (without the admin key)."""
        d = self.d
        op = Opcode[what]
        client, txn, ret = self._clients[d.below(4)], d.u32(), self._ret()
        flags = int(Flags.RELAYED | Flags.MCAST) & d.u32() if d.chance(0.1) else 0
        rkey = int(d.pick(self._rkeys)) if d.chance(0.5) else d.u32()
        if op == Opcode.PING:
            return header(op, client=client, txn=txn, ret=ret, flags=flags), Shape()
        if op in REPLY_OPCODES:
            coll = d.between(1, 3) if d.chance(0.1) else 0
            status = d.between(1, 23) if op == Opcode.NACK else 0
            if op == Opcode.READ_RESP:
                dtype = d.between(0, MAX_DTYPE)
                payload = d.blob(self._elements(ELEMENT_BYTES[dtype], 0) * ELEMENT_BYTES[dtype])
            else:
                dtype = 0
                payload = d.blob(32 if op == Opcode.INFO else d.pick([0, 8, 16]))
            return header(
                op,
                coll=coll,
                status=status,
                dtype=dtype,
                length=len(payload),
                rkey=rkey,
                addr=d.u64(),
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ) + payload, Shape()
        if op in (Opcode.REGISTER, Opcode.DEREGISTER):
            payload = pack_key_rights(
                int(d.pick(self._rkeys)) if d.chance(0.5) else d.u32(), d.below(8)
            )
            return header(
                op,
                rkey=rkey,
                length=8,
                addr=d.below(self.layout.memory_bytes),
                aux=d.below(1 << 16),
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ) + payload, Shape()
        if op in (Opcode.JOIN, Opcode.LEAVE):
            group = (0xEF4D0000 + d.below(256)) << 16 | d.below(1 << 16)
            return header(
                op,
                rkey=rkey,
                addr=group,
                aux=int(d.pick(self._nodes_u64)),
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ), Shape()
        if op == Opcode.START_COLL:
            ring = [int(d.pick(self._nodes_u64)) for _ in range(d.between(1, 4))]
            return header(
                op,
                rkey=rkey,
                length=64,
                coll=d.between(1, 5),
                dtype=d.between(0, MAX_DTYPE),
                segments=ring,
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ) + d.blob(64), Shape(len(ring))
        if (
            op == Opcode.ALLOC
        ):  # pool control (SPEC.md 11.9): rkey 0 half the time, credentials made up
            payload = struct.pack(
                "<QQIHBB16s",
                d.u64(),
                d.u64() if d.chance(0.7) else 0,
                d.pick([0, 8192, 12]),
                d.below(4),
                d.below(9),
                d.pick([0, 0, 0, 1]),
                d.blob(16),
            )
            return header(
                op,
                rkey=0 if d.chance(0.5) else rkey,
                length=40,
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ) + payload, Shape()
        if op in (Opcode.FREE, Opcode.QUERY):
            payload = struct.pack("<Q", d.u64() if d.chance(0.8) else 0)
            return header(
                op,
                rkey=0 if d.chance(0.5) else rkey,
                length=8,
                addr=GLOBAL_BASE + d.below(1 << 24),
                client=client,
                txn=txn,
                ret=ret,
                flags=flags,
            ) + payload, Shape()
        return header(
            Opcode.COUNTERS,
            rkey=rkey,
            addr=d.below(4),
            client=client,
            txn=txn,
            ret=ret,
            flags=flags,
        ), Shape()

    # ------------------------------------------------------------ mutations

    def mutate(self, data: bytes, shape: Shape) -> bytes:
        """One to four structured mutations of a valid packet."""
        d = self.d
        count = 1 if d.chance(0.7) else (2 if d.chance(0.65) else d.between(3, 4))
        return self.apply_mutations(data, shape, [d.pick(self._mutations) for _ in range(count)])

    def apply_mutations(self, data: bytes, shape: Shape, names: Sequence[str]) -> bytes:
        """Apply the mutations *names* (from MUTATIONS) in order, parameters from the draws."""
        b = bytearray(data)
        for name in names:
            if len(b) < HEADER_SIZE and name not in _ANY_LENGTH:
                name = "extend"  # field mutations need a whole header
            b = getattr(self, "_m_" + name)(b, shape)
        return bytes(b)

    def _m_bitflip(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        if not b:
            return b
        limit = HEADER_SIZE + SEGMENT_SIZE * shape.segments
        for _ in range(d.between(1, 4)):
            pos = d.below(min(limit, len(b))) if d.chance(0.7) else d.below(len(b))
            b[pos] ^= 1 << d.below(8)
        return b

    def _m_byte(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        if b:
            pos = d.below(min(len(b), HEADER_SIZE)) if d.chance(0.6) else d.below(len(b))
            b[pos] = d.pick(_INTERESTING_BYTES) if d.chance(0.5) else d.below(256)
        return b

    def _m_opcode(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        b[O_OPCODE] = (
            d.pick(_ALL_OPCODES)
            if d.chance(0.6)
            else (d.pick(_ODD_OPCODES) if d.chance(0.5) else d.below(256))
        )
        return b

    def _m_flags(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        flags = (b[O_FLAGS] << 8) | b[O_FLAGS + 1]
        roll = d.below(5)
        if roll == 0:
            flags |= 1 << d.between(5, 15)  # undefined bit
        elif roll == 1:
            flags ^= Flags.SPARSE
        elif roll == 2:
            flags ^= Flags.MCAST
        elif roll == 3:
            flags ^= 1 << d.below(5)
        else:
            flags = d.below(1 << 16)
        struct.pack_into("!H", b, O_FLAGS, flags & 0xFFFF)
        return b

    def _m_length(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        (length,) = struct.unpack_from("!I", b, O_LENGTH)
        payload = len(b) - HEADER_SIZE - SEGMENT_SIZE * shape.segments
        choices = [
            length + 1,
            length - 1,
            length + shape.esize,
            length - shape.esize,
            0,
            MAX_PAYLOAD_BYTES,
            MAX_PAYLOAD_BYTES + 1,
            0xFFFFFFFF,
            payload,
            payload + 8,
            1 << 31,
            d.u32(),
        ]
        struct.pack_into("!I", b, O_LENGTH, d.pick(choices) & 0xFFFFFFFF)
        return b

    def _addr_choices(self, value: int, shape: Shape) -> list[int]:
        d = self.d
        lo, hi, e = shape.lo, shape.hi, shape.esize
        choices = [
            hi - e,
            hi,
            hi + e,
            lo - e,
            lo - 1,
            lo + 1,
            0,
            (1 << 64) - 1,
            1 << 63,
            (1 << 64) - e,
            value ^ (1 << d.below(64)),
            value + e,
            value - e,
            hi + d.below(1 << 20),
            GLOBAL_BASE - e,
            d.u64(),
        ]
        if shape.stride:
            stripe_end = lo + (max(value - lo, 0) // shape.stride + 1) * shape.stride
            choices += [stripe_end - e, stripe_end - 1, stripe_end]
        return [c & ((1 << 64) - 1) for c in choices]

    def _m_addr(self, b: bytearray, shape: Shape) -> bytearray:
        (addr,) = struct.unpack_from("!Q", b, O_ADDR)
        struct.pack_into("!Q", b, O_ADDR, self.d.pick(self._addr_choices(addr, shape)))
        return b

    def _m_aux(self, b: bytearray, shape: Shape) -> bytearray:
        (aux,) = struct.unpack_from("!Q", b, O_AUX)
        struct.pack_into("!Q", b, O_AUX, self.d.pick(self._addr_choices(aux, shape)))
        return b

    def _m_rkey(self, b: bytearray, shape: Shape) -> bytearray:
        (rkey,) = struct.unpack_from("!I", b, O_RKEY)
        struct.pack_into("!I", b, O_RKEY, self._other_rkey(rkey))
        return b

    def _m_dtype(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        b[O_DTYPE] = (
            d.between(0, MAX_DTYPE)
            if d.chance(0.7)
            else d.pick([MAX_DTYPE + 1, MAX_DTYPE + 2, 0x7F, 0xFF])
        )
        return b

    def _m_reduce_op(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        b[O_OP] = d.between(0, 2) if d.chance(0.5) else d.pick([3, 4, 0xFF])
        return b

    def _m_status(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        b[O_STATUS] = d.between(0, 23) if d.chance(0.5) else d.between(24, 255)
        return b

    def _m_version(self, b: bytearray, shape: Shape) -> bytearray:
        b[O_VERSION] = self.d.pick([0, 2, 3, 0x7F, 0xFF])
        return b

    def _m_reserved(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        b[d.pick([O_RES1, O_RES2, O_RES2 + 1])] = d.between(1, 255)
        return b

    def _m_segments(self, b: bytearray, shape: Shape) -> bytearray:
        """SR-list corruption: count, type, segments_left, reserved bytes, hops, or a list on
        an opcode that takes none."""
        d = self.d
        count = b[O_COUNT]
        roll = d.below(7)
        if roll == 0:
            b[O_COUNT] = (
                d.pick([count + 1, count - 1, 0, MAX_SEGMENTS, MAX_SEGMENTS + 1, 255]) & 0xFF
            )
        elif roll == 1:
            b[O_SEG_TYPE] = d.pick([0, 1, 2, 3, 255])
        elif roll == 2:
            b[O_LEFT] = d.pick([count, count + 1, 255, max(count - 1, 0), 0]) & 0xFF
        elif roll == 3 and count:
            pos = HEADER_SIZE + SEGMENT_SIZE * d.below(count) + 6 + d.below(2)
            if pos < len(b):
                b[pos] = d.between(1, 255)
        elif roll == 4 and count:
            pos = HEADER_SIZE + SEGMENT_SIZE * d.below(count)
            hop = self._third if d.chance(0.5) else d.u64() & 0xFFFFFFFFFFFF
            if pos + 6 <= len(b):
                struct.pack_into("!IH", b, pos, hop >> 16, hop & 0xFFFF)
        else:
            # Insert a valid-looking SR list (before the payload) and fix the header to match.
            hops = [int(d.pick(self._nodes_u64)) for _ in range(d.between(1, 3))]
            extra = b"".join(SEGMENT_STRUCT.pack(h >> 16, h & 0xFFFF, 0) for h in hops)
            pos = HEADER_SIZE + SEGMENT_SIZE * count
            b[pos:pos] = extra
            b[O_SEG_TYPE] = 1
            b[O_COUNT] = min(count + len(hops), 255)
            b[O_LEFT] = d.below(b[O_COUNT])
        return b

    def _m_truncate(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        if not b:
            return b
        cuts = [
            0,
            1,
            8,
            HEADER_SIZE - 1,
            HEADER_SIZE,
            len(b) - 1,
            d.below(len(b)),
            HEADER_SIZE + SEGMENT_SIZE * shape.segments - 1,
            HEADER_SIZE + SEGMENT_SIZE * max(shape.segments - 1, 0) + 3,
        ]
        cut = d.pick(cuts)
        return b[: max(0, min(cut, len(b) - 1))]

    def _m_extend(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        roll = d.below(10)
        if roll < 5:
            b += self.d.blob(d.between(1, 16))
        elif roll < 8:
            b += bytes(d.pick([1, 2, 4, 8, 64]))
        else:
            # Over the MTU: the receiver drops it (counted), it never reads past its buffer.
            b += self.d.blob(max(1, self.layout.max_datagram - len(b) + d.between(1, 200)))
        return b

    def _m_sparse(self, b: bytearray, shape: Shape) -> bytearray:
        """Corrupt a sparse payload's prefix, indices or padding (or make a dense one 'sparse')."""
        d = self.d
        start = HEADER_SIZE + SEGMENT_SIZE * shape.segments
        if not shape.sparse or start + 8 > len(b):
            struct.pack_into("!H", b, O_FLAGS, ((b[O_FLAGS] << 8) | b[O_FLAGS + 1]) | Flags.SPARSE)
            return b
        (nnz,) = struct.unpack_from("<I", b, start)
        roll = d.below(5)
        if roll == 0:
            struct.pack_into("<I", b, start, d.pick([nnz + 1, max(nnz - 1, 0), 0xFFFF, 0xFFFFFFFF]))
        elif roll == 1:
            struct.pack_into("<I", b, start + 4, d.between(1, 0xFFFFFFFF))
        elif roll == 2 and nnz and start + 8 + 2 * nnz <= len(b):
            k = d.below(nnz)
            struct.pack_into("<H", b, start + 8 + 2 * k, d.pick([0, 0xFFFF, d.below(1 << 16)]))
        elif roll == 3 and nnz % 4:
            pos = start + 8 + 2 * nnz + d.below(2 * (4 - nnz % 4))
            if pos < len(b):
                b[pos] = d.between(1, 255)
        else:
            b = b[: start + d.below(8)]  # cut inside the prefix
        return b

    def _m_client(self, b: bytearray, shape: Shape) -> bytearray:
        d = self.d
        (txn,) = struct.unpack_from("!I", b, O_TXN)
        if d.chance(0.5):
            struct.pack_into("!I", b, O_CLIENT, d.pick(self._clients))
        struct.pack_into(
            "!I",
            b,
            O_TXN,
            d.pick([txn + 1, txn - 256, txn + 256, txn ^ 0x80000000, d.u32()]) & 0xFFFFFFFF,
        )
        return b

    def _m_ret(self, b: bytearray, shape: Shape) -> bytearray:
        hop = self._third if self.d.chance(0.6) else self.d.u64() & 0xFFFFFFFFFFFF
        struct.pack_into("!IH", b, O_RET_IP, hop >> 16, hop & 0xFFFF)
        return b

    def _m_splice(self, b: bytearray, shape: Shape) -> bytearray:
        """Header of this packet, tail of another valid one."""
        other, _, _ = self.valid()
        cut = self.d.below(len(other) + 1)
        return (
            b[:HEADER_SIZE] + bytearray(other[cut:])
            if self.d.chance(0.5)
            else bytearray(other[:HEADER_SIZE]) + b[HEADER_SIZE:]
        )

    # ------------------------------------------------------------ random bytes

    def random_bytes(self) -> bytes:
        d = self.d
        roll = d.below(100)
        if roll < 15:
            n = d.below(HEADER_SIZE)
        elif roll < 40:
            n = d.between(HEADER_SIZE, HEADER_SIZE + 24)
        elif roll < 92:
            n = d.between(HEADER_SIZE, 1200)
        else:
            n = d.between(HEADER_SIZE, self.layout.max_datagram + 128)
        b = bytearray(d.blob(n))
        if n >= HEADER_SIZE and d.chance(0.6):
            # Past the first checks now and then: version 1, a real opcode, clean fields.
            b[O_VERSION] = 1
            if d.chance(0.7):
                b[O_OPCODE] = d.pick(_ALL_OPCODES)
            if d.chance(0.5):
                b[O_RES1] = b[O_RES2] = b[O_RES2 + 1] = 0
                b[O_FLAGS] = 0
                b[O_FLAGS + 1] &= FLAGS_V1_MASK
                b[O_DTYPE] %= MAX_DTYPE + 1
                b[O_OP] %= 3
                b[O_STATUS] %= 24
                b[O_SEG_TYPE] = b[O_LEFT] = b[O_COUNT] = 0
                if d.chance(0.5):
                    struct.pack_into("!I", b, O_LENGTH, n - HEADER_SIZE)
        return bytes(b)


#: Mutations that work on datagrams shorter than a header.
_ANY_LENGTH = ("bitflip", "byte", "truncate", "extend", "splice")
_VALID_NODE: list[tuple[str, int]] = [
    ("READ", 13),
    ("WRITE", 13),
    ("ADD", 9),
    ("CHAIN_ADD", 11),
    ("ALL_WRITE", 6),
    ("FETCH_ADD", 8),
    ("CAS", 6),
    ("UPDATE", 6),
    ("PING", 3),
    ("READ_RESP", 2),
    ("ACK", 2),
    ("NACK", 2),
    ("INFO", 1),
    ("REGISTER", 1),
    ("DEREGISTER", 1),
    ("JOIN", 1),
    ("LEAVE", 1),
    ("START_COLL", 1),
    ("COUNTERS", 1),
    ("ALLOC", 1),
    ("FREE", 1),
    ("QUERY", 1),
]
_VALID_SWITCH: list[tuple[str, int]] = [
    ("READ", 14),
    ("WRITE", 14),
    ("ADD", 9),
    ("FETCH_ADD", 8),
    ("CAS", 6),
    ("UPDATE", 2),
    ("ALL_WRITE", 5),
    ("MCAST", 7),
    ("CHAIN_ADD", 3),
    ("PING", 3),
    ("READ_RESP", 1),
    ("ACK", 1),
    ("NACK", 1),
    ("INFO", 1),
    ("REGISTER", 1),
    ("DEREGISTER", 1),
    ("JOIN", 1),
    ("LEAVE", 1),
    ("START_COLL", 1),
    ("COUNTERS", 1),
    ("ALLOC", 1),
    ("FREE", 1),
    ("QUERY", 1),
]
_MUTATIONS: list[tuple[str, int]] = [
    ("bitflip", 14),
    ("byte", 8),
    ("opcode", 8),
    ("flags", 8),
    ("length", 10),
    ("addr", 10),
    ("aux", 4),
    ("rkey", 8),
    ("dtype", 5),
    ("reduce_op", 3),
    ("status", 3),
    ("version", 3),
    ("reserved", 3),
    ("segments", 8),
    ("truncate", 8),
    ("extend", 6),
    ("sparse", 4),
    ("client", 4),
    ("ret", 3),
    ("splice", 2),
]


#: Names of the structured mutations (``DatagramGenerator.apply_mutations``).
MUTATIONS = tuple(name for name, _ in _MUTATIONS)
