"""Payload structs of NetDAM v1 (protocol/SPEC.md): every fixed layout a payload carries, built
from the tables of layout.py.

The header and the SR list are the codec's (``packet.py``); this module owns what sits behind
them. Payload fields are little-endian like the element data (SPEC.md section 2), unlike the
header. Each struct has one ``pack_*``/``unpack_*`` pair (or a dataclass with ``encode``) so that
nodes, the switch, clients, the decoder and the fixtures write and read the same bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

from netdam.protocol import layout as L

# The descriptor's flag bits live with the constants the kernels compile in (one cache key).
from netdam.protocol.constants import FLAG_AWAIT_STARTED as FLAG_AWAIT_STARTED
from netdam.protocol.constants import FLAG_SPARSE as FLAG_SPARSE
from netdam.protocol.constants import FLAG_UPDATE as FLAG_UPDATE
from netdam.protocol.constants import OptFlags, OptRule, Status
from netdam.protocol.errors import RemoteProtocolError

# The sparse prefix (nnz, reserved; SPEC.md 2.5) is the codec's own: it sizes sparse payloads.
from netdam.protocol.packet import SPARSE_PREFIX, Endpoint, endpoint_to_u64

#: INFO (reply to PING, SPEC.md 6.4): version, mtu, memory bytes, max payload, max segments,
#: rank, world size.
INFO: struct.Struct = L.INFO.struct
#: REGISTER request (requested rkey, rights), its ACK (granted rkey, rights) and DEREGISTER
#: (rkey, 0): SPEC.md 6.1 and 6.2.
KEY_RIGHTS: struct.Struct = L.REGISTER.struct
#: START_COLL descriptor, 64 bytes (SPEC.md 6.5), optionally followed by the collective's
#: 16-byte tag key (then its datagrams are TAGGED, SPEC.md 2.6).
DESCRIPTOR: struct.Struct = L.DESCRIPTOR.struct
TAG_KEY: struct.Struct = L.DESCRIPTOR_TAG_KEY.struct
#: Completion of a collective (ACK with aux_addr 1: retransmits, repair reads) and its failure
#: (NACK with aux_addr 1: first and last chunk still missing), SPEC.md 6.5.
COMPLETION: struct.Struct = L.COMPLETION.part("chains_resent", "repair_reads")
#: FETCH_ADD operand, and the old value every atomic answers with (SPEC.md 5.4).
U64: struct.Struct = L.FETCH_ADD.struct
#: CAS operands: compare, swap (SPEC.md 5.5).
CAS_OPERANDS: struct.Struct = L.CAS.struct

assert DESCRIPTOR.size == 64

#: ALLOC request (SPEC.md 11.9): size, tenant credential (0: a new tenant, admin key required),
#: stride (0: one node), ways (0: every node), rights, reserved, label (UTF-8, zero padded).
ALLOC_REQUEST: struct.Struct = L.ALLOC.struct
#: FREE and QUERY requests: the tenant credential (0 with the admin key).
CREDENTIAL: struct.Struct = L.CREDENTIAL.struct
#: A region as ALLOC's and QUERY's ACK describe it: gaddr, size, credential (ALLOC only, else 0),
#: rkey, stride, ways W, rights, reserved, reserved, label; then W x REGION_WAY.
REGION_INFO: struct.Struct = L.REGION_INFO.struct
#: One way of a region: node rank, reserved, local address, backing bytes.
REGION_WAY: struct.Struct = L.REGION_WAY.struct
#: ALLOC's and the region record's flag bit 0: a tagged region (SPEC.md 11.9).
ALLOC_TAGGED = 0x01
#: Bytes of the label field of ALLOC and of the region record.
LABEL_BYTES: int = L.ALLOC["label"].width

assert ALLOC_REQUEST.size == 40 and REGION_INFO.size == 56 and REGION_WAY.size == 24

#: The optimizer descriptor an UPDATE names (SPEC.md 6.8): 96 bytes in NIC memory, written by
#: the region's owner with WRITE.
OPTIMIZER: struct.Struct = L.OPTIMIZER.struct

#: The ring-host baseline's host-to-host step signal (not a NetDAM opcode: hosts of the RoCE-style
#: baseline tell their ring successor that a step's data is in place): b"RSTP", u32 step.
RING_STEP_MAGIC = b"RSTP"
#: Host-to-host word of the ring-host baseline: magic, step, segment of the step now in place.
RING_STEP = struct.Struct("<4sHH")


class Algo(IntEnum):
    """START_COLL descriptor byte 0 (torch.distributed names)."""

    ALL_REDUCE = 0
    REDUCE_SCATTER = 1
    ALL_GATHER = 2
    BROADCAST = 3


@dataclass(frozen=True)
class Info:
    """What a node (or the switch, rank 0xFFFFFFFF) says about itself in reply to PING."""

    version: int
    mtu: int
    memory_bytes: int
    max_payload: int
    max_segments: int
    rank: int
    world_size: int

    def encode(self) -> bytes:
        return INFO.pack(
            self.version,
            self.mtu,
            self.memory_bytes,
            self.max_payload,
            self.max_segments,
            self.rank,
            self.world_size,
        )


def unpack_info(payload: bytes) -> Info:
    return Info(*_unpack(INFO, payload, "INFO"))


def pack_key_rights(rkey: int, rights: int) -> bytes:
    return KEY_RIGHTS.pack(rkey, rights)


def unpack_key_rights(payload: bytes) -> tuple[int, int]:
    rkey, rights = _unpack(KEY_RIGHTS, payload, "REGISTER/DEREGISTER")
    return int(rkey), int(rights)


#: A tag key's size: SipHash-2-4's 128 bits (SPEC.md 2.6, table "Tag key").
TAG_KEY_SIZE = TAG_KEY.size


def pack_register(rkey: int, rights: int, tag_key: bytes = b"") -> bytes:
    """A REGISTER payload (SPEC.md 6.1): 8 bytes, or 24 with the tag key of a tagged region."""
    if tag_key and (len(tag_key) != TAG_KEY_SIZE or not any(tag_key)):
        raise ValueError(f"a tag key is {TAG_KEY_SIZE} bytes, not all zeros")
    return KEY_RIGHTS.pack(rkey, rights) + bytes(tag_key)


def unpack_register(payload: bytes) -> tuple[int, int, bytes]:
    """(requested rkey, rights, tag key or b"") of a REGISTER payload of 8 or 24 bytes."""
    if len(payload) == KEY_RIGHTS.size + TAG_KEY_SIZE:
        rkey, rights = unpack_key_rights(payload[: KEY_RIGHTS.size])
        return rkey, rights, bytes(payload[KEY_RIGHTS.size :])
    rkey, rights = unpack_key_rights(payload)
    return rkey, rights, b""


@dataclass(frozen=True)
class Descriptor:
    """The START_COLL payload as raw fields (endpoints as u64: IPv4 << 16 | port)."""

    algo: int
    flags: int
    window: int
    rank: int
    count: int
    in_addr: int
    out_addr: int
    rkey: int
    root: int
    group: int
    host: int
    timeout_ms: int
    reserved: int = 0
    #: The collective's tag key (16 bytes), or b"": an untagged (v1) collective.
    tag_key: bytes = field(default=b"", kw_only=True)

    def encode(self) -> bytes:
        return (
            DESCRIPTOR.pack(
                self.algo,
                self.flags,
                self.window,
                self.rank,
                self.count,
                self.in_addr,
                self.out_addr,
                self.rkey,
                self.root,
                self.group,
                self.host,
                self.timeout_ms,
                self.reserved,
            )
            + self.tag_key
        )


@dataclass(frozen=True)
class CollectiveDescriptor:
    """The START_COLL payload as a host writes it (SPEC.md 6.5), with typed endpoints."""

    algo: Algo
    rank: int
    count: int
    in_addr: int
    out_addr: int
    rkey: int
    window: int = 0  # 0: the node derives it from its receive buffer
    root: int = 0
    group: Endpoint | None = None  # multicast group of the all-gather; None: unicast fan-out
    host: Endpoint | None = None  # where the completion goes; None: the START_COLL sender
    timeout_ms: int = 0
    flags: int = 0
    #: 16 bytes: the collective's datagrams carry tags under this key (SPEC.md 2.6); b"": none.
    tag_key: bytes = b""

    def __post_init__(self) -> None:
        if self.tag_key and (len(self.tag_key) != TAG_KEY.size or not any(self.tag_key)):
            raise ValueError(f"a tag key is {TAG_KEY.size} bytes, not all zero")

    def encode(self) -> bytes:
        return Descriptor(
            self.algo,
            self.flags,
            self.window,
            self.rank,
            self.count,
            self.in_addr,
            self.out_addr,
            self.rkey,
            self.root,
            endpoint_to_u64(self.group) if self.group else 0,
            endpoint_to_u64(self.host) if self.host else 0,
            self.timeout_ms,
            tag_key=self.tag_key,
        ).encode()


def descriptor_tag_key(payload: bytes) -> bytes:
    """The tag key of a START_COLL payload, b"" when it has none (64 bytes, or malformed)."""
    if len(payload) != DESCRIPTOR.size + TAG_KEY.size or not any(payload[DESCRIPTOR.size :]):
        return b""
    return bytes(payload[DESCRIPTOR.size :])


def unpack_descriptor(payload: bytes) -> Descriptor:
    """ValueError (a RemoteProtocolError) when the size is wrong: 64 bytes, or 80 with a tag
    key (a key of all zeros is no key: BAD_FIELD)."""
    if len(payload) == DESCRIPTOR.size + TAG_KEY.size:
        key = bytes(payload[DESCRIPTOR.size :])
        if not any(key):
            raise RemoteProtocolError(Status.BAD_FIELD, "START_COLL tag key is all zeros")
        return Descriptor(
            *_unpack(DESCRIPTOR, payload[: DESCRIPTOR.size], "START_COLL descriptor"), tag_key=key
        )
    return Descriptor(*_unpack(DESCRIPTOR, payload, "START_COLL descriptor"))


@dataclass(frozen=True)
class CompletionPhases:
    """Where a collective's time went on one node (SPEC.md 4.1): the node's clock when the
    collective started there (ns; CLOCK_MONOTONIC for nodes on one Linux host) and the
    microseconds from then until every chain it started was ACKed, every chunk it needs was
    there, and every member's DONE was there (NO_PHASE_US: never)."""

    start_ns: int
    chains_us: int
    chunks_us: int
    done_us: int


#: A completion ACK's phases, after its two u64 counters: u64 start (ns), u32 x 3 (us), u32 0.
COMPLETION_PHASES: struct.Struct = L.COMPLETION.part("start_ns", "reserved")
#: A phase's microseconds when it never ended.
NO_PHASE_US = 0xFFFFFFFF


def pack_completion_phases(phases: CompletionPhases) -> bytes:
    return COMPLETION_PHASES.pack(
        phases.start_ns, phases.chains_us, phases.chunks_us, phases.done_us, 0
    )


def unpack_completion_phases(payload: bytes) -> CompletionPhases | None:
    """The phases of a completion ACK's payload; None when it has none (a 16-byte payload)."""
    if len(payload) < COMPLETION.size + COMPLETION_PHASES.size:
        return None
    start, chains, chunks, done, _ = COMPLETION_PHASES.unpack_from(payload, COMPLETION.size)
    return CompletionPhases(int(start), int(chains), int(chunks), int(done))


def pack_completion(first: int, second: int) -> bytes:
    return COMPLETION.pack(first, second)


def unpack_completion(payload: bytes) -> tuple[int, int]:
    first, second = COMPLETION.unpack_from(_at_least(COMPLETION, payload, "completion"))
    return int(first), int(second)


def pack_u64(value: int) -> bytes:
    return U64.pack(value % (1 << 64))


def unpack_u64(payload: bytes) -> int:
    return int(_unpack(U64, payload, "u64 operand")[0])


def pack_cas(compare: int, swap: int) -> bytes:
    return CAS_OPERANDS.pack(compare % (1 << 64), swap % (1 << 64))


def pack_sparse_prefix(nnz: int) -> bytes:
    return bytes(SPARSE_PREFIX.pack(nnz, 0))


def unpack_sparse_prefix(payload: bytes) -> int:
    """nnz of a sparse payload."""
    return int(SPARSE_PREFIX.unpack_from(_at_least(SPARSE_PREFIX, payload, "sparse prefix"))[0])


def _unpack(layout: struct.Struct, payload: bytes, name: str) -> tuple[int, ...]:
    if len(payload) != layout.size:
        raise RemoteProtocolError(
            Status.BAD_LENGTH, f"{name} payload must be {layout.size} bytes, got {len(payload)}"
        )
    return layout.unpack(payload)


def _at_least(layout: struct.Struct, payload: bytes, name: str) -> bytes:
    if len(payload) < layout.size:
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"{name} payload must be at least {layout.size} bytes, got {len(payload)}",
        )
    return payload


@dataclass(frozen=True)
class AllocRequest:
    """The ALLOC payload (SPEC.md 11.9)."""

    size: int
    credential: int = 0
    stride: int = 0
    ways: int = 0
    rights: int = 7
    label: str = ""
    #: ALLOC_TAGGED asks for a tagged region (SPEC.md 11.9); other bits are refused.
    flags: int = 0

    def encode(self) -> bytes:
        return ALLOC_REQUEST.pack(
            self.size,
            self.credential,
            self.stride,
            self.ways,
            self.rights,
            self.flags,
            encode_label(self.label),
        )


def encode_label(label: str) -> bytes:
    """*label* as the 16-byte field: UTF-8, cut at a character boundary, zero padded."""
    data = label.encode()[:LABEL_BYTES]
    while data:
        try:
            data.decode()
            break
        except UnicodeDecodeError:
            data = data[:-1]
    return data.ljust(LABEL_BYTES, b"\0")


def decode_label(field: bytes) -> str:
    return field.rstrip(b"\0").decode(errors="replace")


def unpack_alloc(payload: bytes) -> AllocRequest:
    size, credential, stride, ways, rights, flags, label = _unpack(ALLOC_REQUEST, payload, "ALLOC")
    return AllocRequest(size, credential, stride, ways, rights, decode_label(label), flags)  # type: ignore[arg-type]  # struct.unpack gives Any; the format fixes the types


def pack_credential(credential: int) -> bytes:
    return CREDENTIAL.pack(credential % (1 << 64))


def unpack_credential(payload: bytes) -> int:
    return int(_unpack(CREDENTIAL, payload, "credential")[0])


@dataclass(frozen=True)
class RegionWay:
    node: int
    local: int
    size: int


@dataclass(frozen=True)
class RegionInfo:
    """A region as ALLOC's and QUERY's ACK carry it (SPEC.md 11.9)."""

    gaddr: int
    size: int
    rkey: int
    stride: int
    rights: int
    ways: tuple[RegionWay, ...]
    credential: int = 0
    label: str = ""
    #: A tagged region's 16-byte tag key (SPEC.md 2.6), b"": untagged. The record carries it
    #: after the ways, with flag ALLOC_TAGGED.
    tag_key: bytes = b""

    def encode(self) -> bytes:
        flags = ALLOC_TAGGED if self.tag_key else 0
        head = REGION_INFO.pack(
            self.gaddr,
            self.size,
            self.credential,
            self.rkey,
            self.stride,
            len(self.ways),
            self.rights,
            flags,
            0,
            encode_label(self.label),
        )
        return (
            head
            + b"".join(REGION_WAY.pack(w.node, 0, w.local, w.size) for w in self.ways)
            + self.tag_key
        )


def region_info_size(ways: int, tagged: bool) -> int:
    """Bytes of a region record of *ways* ways (SPEC.md 11.9)."""
    return REGION_INFO.size + ways * REGION_WAY.size + (TAG_KEY_SIZE if tagged else 0)


def unpack_region_info(payload: bytes) -> RegionInfo:
    """RemoteProtocolError BAD_LENGTH when the size disagrees with the ways count and flags."""
    _at_least(REGION_INFO, payload, "region record")
    gaddr, size, credential, rkey, stride, count, rights, flags, _r, label = (
        REGION_INFO.unpack_from(payload)
    )
    tagged = bool(flags & ALLOC_TAGGED)
    want = region_info_size(count, tagged)
    if len(payload) != want:
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"region record with {count} ways{' and a tag key' * tagged} "
            f"must be {want} bytes, got {len(payload)}",
        )
    ways = tuple(
        RegionWay(int(n), int(local), int(sz))
        for n, _r, local, sz in (
            REGION_WAY.unpack_from(payload, REGION_INFO.size + k * REGION_WAY.size)
            for k in range(count)
        )
    )
    key = bytes(payload[want - TAG_KEY_SIZE :]) if tagged else b""
    return RegionInfo(
        int(gaddr),
        int(size),
        int(rkey),
        int(stride),
        int(rights),
        ways,
        int(credential),
        decode_label(label),
        key,
    )


def pack_ring_step(step: int, segment: int = 0) -> bytes:
    return RING_STEP.pack(RING_STEP_MAGIC, step, segment)


def unpack_ring_step(datagram: bytes) -> tuple[int, int] | None:
    """(step, segment) a ring-host signal names, or None when *datagram* is not one."""
    if len(datagram) < RING_STEP.size or datagram[:4] != RING_STEP_MAGIC:
        return None
    _, step, segment = RING_STEP.unpack_from(datagram)
    return int(step), int(segment)


@dataclass(frozen=True)
class OptimizerDescriptor:
    """What an UPDATE applies (SPEC.md 6.8): the rule, its hyperparameters, and where the masters,
    the moments and the step table sit, as byte offsets from the descriptor itself (so the
    block moves as a whole). Offsets of 0 mean "none" (a moment the rule does not use)."""

    rule: OptRule
    count: int
    chunk: int
    params: int
    moment1: int
    moment2: int
    steps: int
    lr: float
    beta1: float = 0.0
    beta2: float = 0.0
    weight_decay: float = 0.0
    eps: float = 0.0
    flags: OptFlags = OptFlags(0)

    def encode(self) -> bytes:
        return OPTIMIZER.pack(
            self.rule,
            self.flags,
            0,
            self.chunk,
            self.count,
            self.params,
            self.moment1,
            self.moment2,
            self.steps,
            self.lr,
            self.beta1,
            self.beta2,
            self.weight_decay,
            self.eps,
            0,
        )

    @classmethod
    def decode(cls, block: bytes) -> OptimizerDescriptor:
        (rule, flags, _, chunk, count, params, m1, m2, steps, lr, b1, b2, wd, eps, _) = _unpack(
            OPTIMIZER, block, "optimizer descriptor"
        )
        return cls(
            OptRule(rule), count, chunk, params, m1, m2, steps, lr, b1, b2, wd, eps, OptFlags(flags)
        )
