"""The pool's address map: regions of the global address space and their backing on nodes.

Layout (protocol/SPEC.md 11.2 "Address map"):

- Global addresses start at ``GLOBAL_BASE`` (4 GiB, so a small integer is never a valid pool
  address); every region starts on a ``GLOBAL_ALIGN`` (1 MiB) boundary and the allocator never
  hands out a global range twice, so a stale address of a freed region answers NO_ROUTE instead
  of reaching another tenant's data.
- A region is either **range-mapped** (``stride`` 0: one node, offset o -> ``local + o``) or
  **interleaved** over M nodes (``ways``) with a stride S: byte o lives in stripe ``o // S`` on
  way ``(o // S) % M`` at ``local[way] + (o // S // M) * S + o % S``.
- A request must stay inside one stripe (SPANS_NODES otherwise): the switch rejects, it never
  splits; clients split at stride boundaries.

This module is pure (no I/O): the Python reference ``translate`` and ``build_tables``, which turns
a list of regions into the numpy arrays the switch kernel searches (``np.searchsorted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from netdam.protocol.constants import ELEMENT_SIZE, REGISTER_ALIGN, DType, Opcode, Rights, Status

if TYPE_CHECKING:
    from netdam.kernels.state import RegionTable

#: First global address the controller hands out.
GLOBAL_BASE = 1 << 32
#: Every region starts on this boundary.
GLOBAL_ALIGN = 1 << 20
#: Local backing ranges start on this boundary in node memory (the node's own placement
#: granule, REGISTER_ALIGN: SPEC.md 6.1).
LOCAL_ALIGN: int = REGISTER_ALIGN
#: Interleave strides must be a multiple of this (so element alignment survives translation).
STRIDE_ALIGN = 8


@dataclass(frozen=True)
class Way:
    """One node's share of a region: ``size`` bytes of its memory from ``local``."""

    node: int  # rank
    local: int
    size: int


@dataclass(frozen=True)
class Region:
    """A pool region: global ``[gaddr, gaddr + size)`` under ``rkey`` with ``rights``."""

    gaddr: int
    size: int
    rkey: int
    rights: int
    stride: int  # 0 = range-mapped on ways[0]
    ways: tuple[Way, ...]
    tenant: str = ""  # a label, not an identity
    #: SHA-256 (hex) of the credential of the tenant that owns the region ("": the admin's).
    owner: str = ""
    #: A tagged region's 16-byte tag key (SPEC.md 2.6): clients seal their requests under it,
    #: the switch checks and re-seals them, the nodes hold it too. b"": untagged.
    tag_key: bytes = b""
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def end(self) -> int:
        return self.gaddr + self.size

    @property
    def footprint(self) -> int:
        """Node memory the region takes: each way's backing in whole LOCAL_ALIGN pages."""
        return sum(page_round(w.size) for w in self.ways)

    def locate(self, offset: int) -> tuple[int, int]:
        """(rank, local address) of byte *offset* of the region."""
        if not 0 <= offset < self.size:
            raise ValueError(f"offset {offset} outside the region's {self.size} bytes")
        if self.stride == 0:
            way = self.ways[0]
            return way.node, way.local + offset
        stripe, within = divmod(offset, self.stride)
        way = self.ways[stripe % len(self.ways)]
        return way.node, way.local + (stripe // len(self.ways)) * self.stride + within

    def chunks(self, offset: int, length: int, limit: int = 8192) -> list[tuple[int, int]]:
        """Split [offset, offset+length) into (global address, length) pieces that stay inside
        one stripe and under *limit* bytes: what a client sends as separate requests."""
        pieces = []
        end = offset + length
        while offset < end:
            step = min(end - offset, limit)
            if self.stride:
                step = min(step, self.stride - offset % self.stride)
            pieces.append((self.gaddr + offset, step))
            offset += step
        return pieces


def page_round(size: int) -> int:
    """*size* rounded up to LOCAL_ALIGN: what a backing of *size* bytes takes of a node's memory
    (nodes place regions at that alignment, SPEC.md 6.1)."""
    return -(-size // LOCAL_ALIGN) * LOCAL_ALIGN


def backing_per_way(size: int, stride: int, ways: int) -> int:
    """Bytes each way backs: whole stripes, ``ceil(ceil(size / S) / M) * S`` (range: size)."""
    if stride == 0:
        return size
    stripes = -(-size // stride)
    return -(-stripes // ways) * stride


def needed_rights(opcode: Opcode) -> int:
    """Right an opcode needs (SPEC.md section 8)."""
    if opcode == Opcode.READ:
        return int(Rights.READ)
    if opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        return int(Rights.ATOMIC)
    return int(Rights.WRITE)


def alignment(opcode: Opcode, dtype: DType) -> int:
    """Alignment the operand's offset needs: 8 for atomics, else the element size."""
    if opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        return 8
    return int(ELEMENT_SIZE[dtype])


def find_region(regions: Sequence[Region], gaddr: int) -> Region | None:
    """The region holding global address *gaddr* (regions sorted by gaddr)."""
    for region in regions:
        if region.gaddr <= gaddr < region.end:
            return region
    return None


def translate(
    regions: Sequence[Region], gaddr: int, length: int, rkey: int, need: int, align: int
) -> tuple[Status, int, int]:
    """Python reference of the switch kernel's lookup: (status, rank, local address)."""
    region = find_region(regions, gaddr)
    if region is None:
        return Status.NO_ROUTE, -1, -1
    offset = gaddr - region.gaddr
    if rkey != region.rkey:
        return Status.BAD_RKEY, -1, -1
    if region.rights & need != need:
        return Status.NO_RIGHTS, -1, -1
    if offset + length > region.size:
        return Status.OUT_OF_BOUNDS, -1, -1
    if offset % align:
        return Status.MISALIGNED, -1, -1
    if region.stride and offset // region.stride != (offset + length - 1) // region.stride:
        return Status.SPANS_NODES, -1, -1
    node, local = region.locate(offset)
    return Status.OK, node, local


@dataclass
class MapTables:
    """The arrays the switch kernel reads, in ``switch_path._switch_batch``'s order."""

    reg_base: np.ndarray  # uint64, sorted
    reg_end: np.ndarray  # uint64
    reg_rkey: np.ndarray  # int64 (u32 values)
    reg_rights: np.ndarray  # int64
    reg_stride: np.ndarray  # int64
    reg_ways: np.ndarray  # int64
    reg_way0: np.ndarray  # int64: index of the region's first way
    way_node: np.ndarray  # int64: rank
    way_local: np.ndarray  # int64
    reg_tag: np.ndarray  # uint64 (regions, 2): tag key (k0, k1), zeros when untagged

    def bundle(self) -> RegionTable:
        """The table as the switch's kernels take it (netdam.kernels.state.RegionTable)."""
        # Imported here: netdam.kernels loads numba (~0.4 s), and the CLI's pool commands read
        # regions (region_to_json) without any kernel.
        from netdam.kernels.state import RegionTable

        return RegionTable(
            self.reg_base,
            self.reg_end,
            self.reg_rkey,
            self.reg_rights,
            self.reg_stride,
            self.reg_ways,
            self.reg_way0,
            self.way_node,
            self.way_local,
            self.reg_tag,
        )


def check_regions(regions: Sequence[Region], nodes: int) -> None:
    """ValueError naming the first inconsistency: overlap, bad stride, unknown node, bad way."""
    ordered = sorted(regions, key=lambda r: r.gaddr)
    for before, after in zip(ordered, ordered[1:]):
        if after.gaddr < before.end:
            raise ValueError(
                f"regions 0x{before.gaddr:x} and 0x{after.gaddr:x} overlap: the state file is corrupt"
            )
    for r in ordered:
        where = f"region 0x{r.gaddr:x}"
        if r.size <= 0 or r.gaddr < 0 or r.end > 1 << 64:
            raise ValueError(f"{where}: size {r.size} is not positive or leaves the address space")
        if not 0 < r.rkey < 1 << 32:
            raise ValueError(f"{where}: rkey {r.rkey} is not a non-zero u32")
        if r.tag_key and (len(r.tag_key) != 16 or not any(r.tag_key)):
            raise ValueError(f"{where}: a tag key is 16 bytes, not all zeros")
        if not r.ways or (r.stride == 0 and len(r.ways) != 1):
            raise ValueError(f"{where}: {len(r.ways)} ways (range-mapped regions have exactly 1)")
        if r.stride < 0 or r.stride % STRIDE_ALIGN:
            raise ValueError(f"{where}: stride {r.stride} is not a multiple of {STRIDE_ALIGN}")
        need = backing_per_way(r.size, r.stride, len(r.ways))
        for way in r.ways:
            if not 0 <= way.node < nodes:
                raise ValueError(
                    f"{where}: way on node {way.node}, but the cluster has {nodes} nodes"
                )
            if way.size < need or way.local < 0:
                raise ValueError(
                    f"{where}: way on node {way.node} backs {way.size} bytes, needs {need}"
                )


def build_tables(regions: Sequence[Region], nodes: int) -> MapTables:
    """Sorted numpy tables of *regions* (checked first)."""
    check_regions(regions, nodes)
    ordered = sorted(regions, key=lambda r: r.gaddr)
    count = len(ordered)
    way0 = np.zeros(count, np.int64)
    ways_node: list[int] = []
    ways_local: list[int] = []
    for k, r in enumerate(ordered):
        way0[k] = len(ways_node)
        ways_node += [w.node for w in r.ways]
        ways_local += [w.local for w in r.ways]
    return MapTables(
        reg_base=np.array([r.gaddr for r in ordered], np.uint64),
        reg_end=np.array([r.end for r in ordered], np.uint64),
        reg_rkey=np.array([r.rkey for r in ordered], np.int64),
        reg_rights=np.array([r.rights for r in ordered], np.int64),
        reg_stride=np.array([r.stride for r in ordered], np.int64),
        reg_ways=np.array([len(r.ways) for r in ordered], np.int64),
        reg_way0=way0,
        way_node=np.array(ways_node or [0], np.int64),
        way_local=np.array(ways_local or [0], np.int64),
        reg_tag=np.array(
            [np.frombuffer(r.tag_key or bytes(16), "<u8") for r in ordered], np.uint64
        ).reshape(count, 2),
    )


def region_to_json(region: Region) -> dict[str, object]:
    return {
        "gaddr": region.gaddr,
        "size": region.size,
        "rkey": region.rkey,
        "rights": region.rights,
        "stride": region.stride,
        "tenant": region.tenant,
        "owner": region.owner,
        "ways": [{"node": w.node, "local": w.local, "size": w.size} for w in region.ways],
        **({"tag_key": region.tag_key.hex()} if region.tag_key else {}),
    }


def region_from_json(data: dict[str, object]) -> Region:
    ways = data["ways"]
    if not isinstance(ways, list):
        raise ValueError("ways must be a list")
    return Region(
        gaddr=int(data["gaddr"]),  # type: ignore[call-overload]  # JSON values (object); int() raises on a bad file
        size=int(data["size"]),  # type: ignore[call-overload]  # JSON values (object); int() raises on a bad file
        rkey=int(data["rkey"]),  # type: ignore[call-overload]  # JSON values (object); int() raises on a bad file
        rights=int(data["rights"]),  # type: ignore[call-overload]  # JSON values (object); int() raises on a bad file
        stride=int(data.get("stride", 0)),  # type: ignore[call-overload]  # JSON values (object); int() raises on a bad file
        ways=tuple(Way(int(w["node"]), int(w["local"]), int(w["size"])) for w in ways),
        tenant=str(data.get("tenant", "")),
        owner=str(data.get("owner", "")),
        tag_key=bytes.fromhex(str(data.get("tag_key", ""))),
    )
