"""Byte layout of NetDAM v1 datagrams, declared once: the fixed header, the SR segment and every
fixed payload, as tables of fields (name, offset, width, type, description).

Rules of this file:
1. Each table is SPEC.md's table of the same name, row for row (tests/protocol/test_layout.py parses
   SPEC.md and holds every row to it; it checks the Wireshark dissector's offsets too).
2. Everything else derives from the tables: the codec's struct formats (``HEADER.struct``,
   payloads.py's structs) and the integer constants below, which the numba kernels and the
   Python cores use by name instead of writing offsets out (numba freezes module-level ints at
   compile time: a named offset costs nothing). Offsets of header and segment fields are from
   the start of the header or segment; offsets of payload fields are from the start of the
   payload.
3. Only protocol/ subscripts a datagram by an integer literal (tests/architecture/test_layering.py).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from struct import Struct, calcsize, pack_into, unpack_from
from typing import Any

from netdam.protocol.constants import HEADER_SIZE, SEGMENT_SIZE

#: struct code of each field type; width in bytes is the code's size (``bytes``: the field's).
_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "f64": "d", "ipv4": "I", "bytes": "s"}


@dataclass(frozen=True)
class Field:
    """One field of a layout. *kind* is u8/u16/u32/u64, f64, ipv4 (a u32) or bytes."""

    name: str
    offset: int
    width: int
    kind: str
    doc: str

    @property
    def code(self) -> str:
        """The field's struct code (``16s`` for a 16-byte string)."""
        return f"{self.width}s" if self.kind == "bytes" else _CODES[self.kind]

    @property
    def end(self) -> int:
        return self.offset + self.width


class Layout:
    """Fields that tile a fixed-size block without gap or overlap, in one byte order."""

    def __init__(self, name: str, order: str, fields: list[Field], spec: str) -> None:
        self.name = name
        self.order = order  # "!" network order (header, segments), "<" payloads
        self.fields = tuple(fields)
        self.spec = spec  # what SPEC.md writes above this table (its heading or caption)
        self._by_name = {f.name: f for f in self.fields}
        position = 0
        for f in self.fields:
            if f.offset != position:
                raise ValueError(
                    f"{name}.{f.name} at {f.offset}, expected {position}: gap or overlap"
                )
            if f.kind not in _CODES or (f.kind != "bytes" and calcsize(f.code) != f.width):
                raise ValueError(f"{name}.{f.name}: width {f.width} is not that of a {f.kind}")
            position = f.end
        if len(self._by_name) != len(self.fields):
            raise ValueError(f"{name}: a field name appears twice")
        self.size = position
        self.struct = Struct(order + "".join(f.code for f in self.fields))
        #: The block's fields by name, as unpack() gives them.
        self.record: type[tuple[Any, ...]] = namedtuple(  # type: ignore[misc]
            f"{name.title().replace('_', '')}Fields", [f.name for f in self.fields]
        )

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def at(self, name: str) -> int:
        """Offset of field *name* (KeyError for a name the table lacks)."""
        return self._by_name[name].offset

    def part(self, first: str, last: str) -> Struct:
        """The struct of the fields *first* .. *last* (a contiguous run of the table)."""
        names = [f.name for f in self.fields]
        run = self.fields[names.index(first) : names.index(last) + 1]
        return Struct(self.order + "".join(f.code for f in run))

    def unpack(self, data: Any, base: int = 0) -> Any:
        """Every field of the block at data[base:], by name (one struct call, ~1 us for the
        header: a host reads its answers so, without building a Packet)."""
        return self.record._make(self.struct.unpack_from(data, base))  # type: ignore[attr-defined]

    def read(self, data: Any, name: str, base: int = 0) -> int:
        """Field *name* of the block at data[base:] (a number; bytes fields are not read here)."""
        f = self._by_name[name]
        return int(unpack_from(self.order + f.code, data, base + f.offset)[0])

    def write(self, data: bytearray, name: str, value: int, base: int = 0) -> None:
        f = self._by_name[name]
        pack_into(self.order + f.code, data, base + f.offset, value)

    def pack_into(self, data: Any, base: int, **values: int) -> None:
        """Write one whole block at data[base:]: the fields *values* names, every other 0 (one
        struct call: a field at a time through numpy costs ~1 us each)."""
        unknown = values.keys() - self._by_name.keys()
        if unknown:
            raise KeyError(f"{self.name} has no field {sorted(unknown)[0]!r}")
        self.struct.pack_into(data, base, *[values.get(f.name, 0) for f in self.fields])

    def span(self, name: str, base: int = 0) -> slice:
        """The bytes of field *name* as a slice of the datagram (block at *base*)."""
        f = self._by_name[name]
        return slice(base + f.offset, base + f.end)

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, {self.size} bytes)"


def _f(name: str, offset: int, width: int, kind: str, doc: str) -> Field:
    return Field(name, offset, width, kind, doc)


# ---------------------------------------------------------------- header and SR list

HEADER = Layout(
    "header",
    "!",
    [
        _f("version", 0, 1, "u8", "protocol version, 1"),
        _f("opcode", 1, 1, "u8", "section 3"),
        _f("flags", 2, 2, "u16", "section 2.3; undefined bits 0"),
        _f("seq", 4, 4, "u32", "sequence number; a collective's chunk index"),
        _f("client_id", 8, 4, "u32", "who asks; 0 anonymous"),
        _f("txn_id", 12, 4, "u32", "transaction id of the client"),
        _f("coll_id", 16, 4, "u32", "collective id; 0 none"),
        _f("epoch", 20, 4, "u32", "collective epoch"),
        _f("rkey", 24, 4, "u32", "access key; the admin key for control opcodes"),
        _f("length", 28, 4, "u32", "operand length in bytes"),
        _f("addr", 32, 8, "u64", "byte address of the operand"),
        _f("aux_addr", 40, 8, "u64", "second address (store address, region size, token, message)"),
        _f("dtype", 48, 1, "u8", "element type, section 2.4"),
        _f("reduce_op", 49, 1, "u8", "0 SUM, 1 MIN, 2 MAX"),
        _f("status", 50, 1, "u8", "0, or the NACK's status"),
        _f("credit", 51, 1, "u8", "replies: send-queue occupancy 0..255"),
        _f("seg_type", 52, 1, "u8", "0 NONE, 1 IPv4"),
        _f("segments_left", 53, 1, "u8", "hops still to visit after this one"),
        _f("seg_count", 54, 1, "u8", "entries in the SR list"),
        _f("reserved1", 55, 1, "u8", "0"),
        _f("ret_ip", 56, 4, "ipv4", "return segment: IPv4 (0: the UDP source)"),
        _f("ret_port", 60, 2, "u16", "return segment: UDP port"),
        _f("reserved2", 62, 2, "u16", "0"),
    ],
    spec="2.1 Fixed header",
)

SEGMENT = Layout(
    "segment",
    "!",
    [
        _f("ip", 0, 4, "ipv4", "IPv4 address of the hop"),
        _f("port", 4, 2, "u16", "UDP port of the hop"),
        _f("reserved", 6, 2, "u16", "0"),
    ],
    spec="2.2 SR list",
)

assert HEADER.size == HEADER_SIZE and SEGMENT.size == SEGMENT_SIZE

# ---------------------------------------------------------------- payloads (little-endian)

SPARSE_PREFIX = Layout(
    "sparse_prefix",
    "<",
    [_f("nnz", 0, 4, "u32", "entries that follow"), _f("reserved", 4, 4, "u32", "0")],
    spec="2.5 Sparse payload",
)

REGISTER = Layout(
    "register",
    "<",
    [
        _f("rkey", 0, 4, "u32", "requested rkey (0: the node picks one); the ACK: the granted one"),
        _f("rights", 4, 4, "u32", "bit 0 READ, bit 1 WRITE, bit 2 ATOMIC"),
    ],
    spec="6.1 REGISTER payload",
)

DEREGISTER = Layout(
    "deregister",
    "<",
    [_f("rkey", 0, 4, "u32", "rkey to remove"), _f("reserved", 4, 4, "u32", "0")],
    spec="6.2 DEREGISTER payload",
)

INFO = Layout(
    "info",
    "<",
    [
        _f("version", 0, 4, "u32", "protocol version (1)"),
        _f("mtu", 4, 4, "u32", "MTU"),
        _f("memory_bytes", 8, 8, "u64", "node memory bytes"),
        _f("max_payload", 16, 4, "u32", "largest payload"),
        _f("max_segments", 20, 4, "u32", "largest SR list"),
        _f("rank", 24, 4, "u32", "rank"),
        _f("world_size", 28, 4, "u32", "world size"),
    ],
    spec="6.4 INFO payload",
)

DESCRIPTOR = Layout(
    "descriptor",
    "<",
    [
        _f("algo", 0, 1, "u8", "0 ALL_REDUCE, 1 REDUCE_SCATTER, 2 ALL_GATHER, 3 BROADCAST"),
        _f(
            "flags",
            1,
            1,
            "u8",
            "bit 0 sparse mode, bit 1 fused reduce and update, bit 2 chains await STARTED",
        ),
        _f("window", 2, 2, "u16", "chains in flight per originator (0: derived)"),
        _f("rank", 4, 4, "u32", "rank of the receiving node in the SR list"),
        _f("count", 8, 8, "u64", "elements of the whole buffer"),
        _f("in_addr", 16, 8, "u64", "input address"),
        _f("out_addr", 24, 8, "u64", "output address"),
        _f("rkey", 32, 4, "u32", "rkey of the collective's data"),
        _f("root", 36, 4, "u32", "root rank (BROADCAST)"),
        _f("group", 40, 8, "u64", "all-gather group, ip << 16 | port (0: unicast)"),
        _f("host", 48, 8, "u64", "where the completion goes, ip << 16 | port (0: the sender)"),
        _f("timeout_ms", 56, 4, "u32", "watchdog, ms without progress (0: 10000)"),
        _f("reserved", 60, 4, "u32", "0"),
    ],
    spec="6.5 START_COLL descriptor",
)

DESCRIPTOR_TAG_KEY = Layout(
    "descriptor_tag_key",
    "<",
    [
        _f("tag_k0", 0, 8, "u64", "key bytes 0-7: SipHash k0"),
        _f("tag_k1", 8, 8, "u64", "key bytes 8-15: SipHash k1"),
    ],
    spec="**Tag key**",
)

COMPLETION = Layout(
    "completion",
    "<",
    [
        _f("chains_resent", 0, 8, "u64", "chains re-sent"),
        _f("repair_reads", 8, 8, "u64", "repair READs"),
        _f("start_ns", 16, 8, "u64", "the node's clock when the collective started there, ns"),
        _f("chains_us", 24, 4, "u32", "us until every chain this node started was ACKed"),
        _f("chunks_us", 28, 4, "u32", "us until every chunk it needs was here"),
        _f("done_us", 32, 4, "u32", "us until every member's DONE was here"),
        _f("reserved", 36, 4, "u32", "0"),
    ],
    spec="**Completion ACK**",
)

COMPLETION_FAILURE = Layout(
    "completion_failure",
    "<",
    [
        _f("first_missing", 0, 8, "u64", "first chunk still missing here"),
        _f("last_missing", 8, 8, "u64", "last chunk still missing here"),
    ],
    spec="**Completion NACK**",
)

FETCH_ADD = Layout(
    "fetch_add",
    "<",
    [_f("addend", 0, 8, "u64", "addend; the ACK of every atomic: the old value")],
    spec="**FETCH_ADD operand**",
)

CAS = Layout(
    "cas",
    "<",
    [_f("compare", 0, 8, "u64", "compare"), _f("swap", 8, 8, "u64", "swap")],
    spec="**CAS operands**",
)

ALLOC = Layout(
    "alloc",
    "<",
    [
        _f("size", 0, 8, "u64", "bytes (> 0)"),
        _f("credential", 8, 8, "u64", "0: a new tenant (admin key), else the tenant's credential"),
        _f("stride", 16, 4, "u32", "0: one node; else the interleave stride"),
        _f("ways", 20, 2, "u16", "nodes to interleave over (0: all)"),
        _f("rights", 22, 1, "u8", "bit 0 READ, bit 1 WRITE, bit 2 ATOMIC"),
        _f("flags", 23, 1, "u8", "bit 0 TAGGED: a tagged region (its record carries the tag key)"),
        _f("label", 24, 16, "bytes", "UTF-8, zero padded"),
    ],
    spec="**ALLOC (0x26).**",
)

CREDENTIAL = Layout(
    "credential",
    "<",
    [_f("credential", 0, 8, "u64", "tenant credential (0 with the admin key)")],
    spec="**Credential payload**",
)

REGION_INFO = Layout(
    "region_info",
    "<",
    [
        _f("gaddr", 0, 8, "u64", "global address"),
        _f("size", 8, 8, "u64", "size, bytes"),
        _f("credential", 16, 8, "u64", "tenant credential (ALLOC's ACK), else 0"),
        _f("rkey", 24, 4, "u32", "rkey"),
        _f("stride", 28, 4, "u32", "stride (0: range-mapped)"),
        _f("ways", 32, 2, "u16", "ways W"),
        _f("rights", 34, 1, "u8", "rights"),
        _f("flags", 35, 1, "u8", "bit 0 TAGGED: the tag key follows the ways"),
        _f("reserved", 36, 4, "u32", "0"),
        _f("label", 40, 16, "bytes", "label"),
    ],
    spec="**Region record**",
)

REGION_WAY = Layout(
    "region_way",
    "<",
    [
        _f("node", 0, 4, "u32", "node rank"),
        _f("reserved", 4, 4, "u32", "0"),
        _f("local", 8, 8, "u64", "local address of the backing on that node"),
        _f("size", 16, 8, "u64", "backing bytes"),
    ],
    spec="**Region way**",
)

TRACE_REPLY = Layout(
    "trace_reply",
    "<",
    [
        _f("first", 0, 8, "u64", "number of the first record in this reply"),
        _f("next", 8, 8, "u64", "number the NIC gives its next record (records written so far)"),
        _f("slots", 16, 4, "u32", "records the NIC's ring holds (0: tracing off)"),
        _f("record_bytes", 20, 2, "u16", "bytes per record, 48"),
        _f("reserved", 22, 2, "u16", "0"),
    ],
    spec="**Trace reply**",
)

TRACE_RECORD = Layout(
    "trace_record",
    "<",
    [
        _f("t_ns", 0, 8, "u64", "the NIC's CLOCK_MONOTONIC, ns"),
        _f("kind", 8, 1, "u8", "what happened (the table below)"),
        _f("opcode", 9, 1, "u8", "the datagram's opcode (RX, TX, RETRANSMIT), else 0"),
        _f("status", 10, 1, "u8", "NACK status; DROP: the counter index; PHASE: the phase"),
        _f("seg_left", 11, 1, "u8", "the datagram's segments_left (RX, TX)"),
        _f("length", 12, 4, "u32", "datagram bytes; DROP: datagrams dropped; BLOCK: chunks"),
        _f("peer", 16, 8, "u64", "source (RX) or destination (TX), ip << 16 | port"),
        _f("coll_id", 24, 4, "u32", "the datagram's or collective's coll_id"),
        _f("epoch", 28, 4, "u32", "its epoch"),
        _f("seq", 32, 4, "u32", "the datagram's seq (a collective's chunk); BLOCK: the block"),
        _f("seg_count", 36, 1, "u8", "the datagram's seg_count (RX, TX)"),
        _f("reserved", 37, 1, "u8", "0"),
        _f("flags", 38, 2, "u16", "the datagram's flags (RX, TX)"),
        _f("addr", 40, 8, "u64", "the datagram's addr; BLOCK: its first chunk; FAILED: the status"),
    ],
    spec="**Trace record**",
)

OPTIMIZER = Layout(
    "optimizer",
    "<",
    [
        _f("rule", 0, 1, "u8", "1 SGD, 2 ADAM, 3 ADAMW"),
        _f("flags", 1, 1, "u8", "bit 0 NESTEROV (SGD); other bits 0"),
        _f("reserved", 2, 2, "u16", "0"),
        _f("chunk", 4, 4, "u32", "elements each UPDATE covers (the last one: the rest)"),
        _f("count", 8, 8, "u64", "elements of the parameters"),
        _f("params", 16, 8, "u64", "offset of the float32 masters from the descriptor"),
        _f("moment1", 24, 8, "u64", "offset of SGD's momentum buffer or Adam's first moment"),
        _f("moment2", 32, 8, "u64", "offset of Adam's second moment; SGD: 0"),
        _f("steps", 40, 8, "u64", "offset of the step table: a u32 per chunk"),
        _f("lr", 48, 8, "f64", "learning rate"),
        _f("beta1", 56, 8, "f64", "Adam's beta1; SGD's momentum"),
        _f("beta2", 64, 8, "f64", "Adam's beta2; SGD's dampening"),
        _f("weight_decay", 72, 8, "f64", "weight decay (ADAMW: decoupled)"),
        _f("eps", 80, 8, "f64", "Adam's epsilon; SGD: 0"),
        _f("reserved2", 88, 8, "u64", "0"),
    ],
    spec="6.8 UPDATE and the optimizer descriptor",
)

#: Every table, for tests and tools that walk them.
LAYOUTS = (
    HEADER,
    SEGMENT,
    SPARSE_PREFIX,
    REGISTER,
    DEREGISTER,
    INFO,
    DESCRIPTOR,
    DESCRIPTOR_TAG_KEY,
    COMPLETION,
    COMPLETION_FAILURE,
    FETCH_ADD,
    CAS,
    ALLOC,
    CREDENTIAL,
    REGION_INFO,
    REGION_WAY,
    TRACE_REPLY,
    TRACE_RECORD,
    OPTIMIZER,
)

# ---------------------------------------------------------------- named offsets

# Header fields, from the start of the datagram (H_) ...
H_VERSION = HEADER.at("version")
H_OPCODE = HEADER.at("opcode")
H_FLAGS = HEADER.at("flags")
H_SEQ = HEADER.at("seq")
H_CLIENT_ID = HEADER.at("client_id")
H_TXN_ID = HEADER.at("txn_id")
H_COLL_ID = HEADER.at("coll_id")
H_EPOCH = HEADER.at("epoch")
H_RKEY = HEADER.at("rkey")
H_LENGTH = HEADER.at("length")
H_ADDR = HEADER.at("addr")
H_AUX_ADDR = HEADER.at("aux_addr")
H_DTYPE = HEADER.at("dtype")
H_REDUCE_OP = HEADER.at("reduce_op")
H_STATUS = HEADER.at("status")
H_CREDIT = HEADER.at("credit")
H_SEG_TYPE = HEADER.at("seg_type")
H_SEGMENTS_LEFT = HEADER.at("segments_left")
H_SEG_COUNT = HEADER.at("seg_count")
H_RESERVED1 = HEADER.at("reserved1")
H_RET_IP = HEADER.at("ret_ip")
H_RET_PORT = HEADER.at("ret_port")
H_RESERVED2 = HEADER.at("reserved2")

# ... an endpoint ``ip << 16 | port`` in a u64 field (addr, aux_addr; descriptor group, host):
# its IPv4 and port bytes, from the field's start (big-endian fields only).
EP_IP = 2
EP_PORT = 6

# ... an SR segment's fields, from the start of the segment (SEG_) ...
SEG_IP = SEGMENT.at("ip")
SEG_PORT = SEGMENT.at("port")
SEG_RESERVED = SEGMENT.at("reserved")

# ... and payload fields, from the start of the payload.
SP_NNZ = SPARSE_PREFIX.at("nnz")
SP_RESERVED = SPARSE_PREFIX.at("reserved")
SP_INDICES = SPARSE_PREFIX.size  # the u16 indices follow the prefix
D_ALGO = DESCRIPTOR.at("algo")
D_FLAGS = DESCRIPTOR.at("flags")
D_WINDOW = DESCRIPTOR.at("window")
D_RANK = DESCRIPTOR.at("rank")
D_COUNT = DESCRIPTOR.at("count")
D_IN_ADDR = DESCRIPTOR.at("in_addr")
D_OUT_ADDR = DESCRIPTOR.at("out_addr")
D_RKEY = DESCRIPTOR.at("rkey")
D_ROOT = DESCRIPTOR.at("root")
D_GROUP = DESCRIPTOR.at("group")
D_HOST = DESCRIPTOR.at("host")
D_TIMEOUT_MS = DESCRIPTOR.at("timeout_ms")
D_RESERVED = DESCRIPTOR.at("reserved")
DESCRIPTOR_BYTES = DESCRIPTOR.size
#: The tag key follows the descriptor (an 80-byte payload, SPEC.md 6.5 "Tag key").
D_TAG_K0 = DESCRIPTOR_BYTES + DESCRIPTOR_TAG_KEY.at("tag_k0")
D_TAG_K1 = DESCRIPTOR_BYTES + DESCRIPTOR_TAG_KEY.at("tag_k1")
TAGGED_DESCRIPTOR_BYTES = DESCRIPTOR_BYTES + DESCRIPTOR_TAG_KEY.size
CPL_CHAINS_RESENT = COMPLETION.at("chains_resent")
CPL_REPAIR_READS = COMPLETION.at("repair_reads")
CPL_START_NS = COMPLETION.at("start_ns")
CPL_CHAINS_US = COMPLETION.at("chains_us")
CPL_CHUNKS_US = COMPLETION.at("chunks_us")
CPL_DONE_US = COMPLETION.at("done_us")
CPL_RESERVED = COMPLETION.at("reserved")
COMPLETION_BYTES = COMPLETION.size
COMPLETION_FAILURE_BYTES = COMPLETION_FAILURE.size
CPL_FIRST_MISSING = COMPLETION_FAILURE.at("first_missing")
CPL_LAST_MISSING = COMPLETION_FAILURE.at("last_missing")
FA_ADDEND = FETCH_ADD.at("addend")
CAS_COMPARE = CAS.at("compare")
TR_FIRST = TRACE_REPLY.at("first")
TR_NEXT = TRACE_REPLY.at("next")
TR_SLOTS = TRACE_REPLY.at("slots")
TR_RECORD_BYTES = TRACE_REPLY.at("record_bytes")
TRACE_REPLY_BYTES = TRACE_REPLY.size
TREC_T_NS = TRACE_RECORD.at("t_ns")
TREC_KIND = TRACE_RECORD.at("kind")
TREC_OPCODE = TRACE_RECORD.at("opcode")
TREC_STATUS = TRACE_RECORD.at("status")
TREC_SEG_LEFT = TRACE_RECORD.at("seg_left")
TREC_LENGTH = TRACE_RECORD.at("length")
TREC_PEER = TRACE_RECORD.at("peer")
TREC_COLL_ID = TRACE_RECORD.at("coll_id")
TREC_EPOCH = TRACE_RECORD.at("epoch")
TREC_SEQ = TRACE_RECORD.at("seq")
TREC_SEG_COUNT = TRACE_RECORD.at("seg_count")
TREC_RESERVED = TRACE_RECORD.at("reserved")
TREC_FLAGS = TRACE_RECORD.at("flags")
TREC_ADDR = TRACE_RECORD.at("addr")
TRACE_RECORD_BYTES = TRACE_RECORD.size
CAS_SWAP = CAS.at("swap")
OPT_RULE = OPTIMIZER.at("rule")
OPT_FLAGS = OPTIMIZER.at("flags")
OPT_RESERVED = OPTIMIZER.at("reserved")
OPT_CHUNK = OPTIMIZER.at("chunk")
OPT_COUNT = OPTIMIZER.at("count")
OPT_PARAMS = OPTIMIZER.at("params")
OPT_MOMENT1 = OPTIMIZER.at("moment1")
OPT_MOMENT2 = OPTIMIZER.at("moment2")
OPT_STEPS = OPTIMIZER.at("steps")
OPT_LR = OPTIMIZER.at("lr")
OPT_BETA1 = OPTIMIZER.at("beta1")
OPT_BETA2 = OPTIMIZER.at("beta2")
OPT_WEIGHT_DECAY = OPTIMIZER.at("weight_decay")
OPT_EPS = OPTIMIZER.at("eps")
OPT_RESERVED2 = OPTIMIZER.at("reserved2")
OPTIMIZER_BYTES = OPTIMIZER.size
