"""Wire constants of NetDAM protocol v1. protocol/SPEC.md is the contract; this file mirrors it.

Rule of this file: every value that appears on the wire is an enum or a named constant here, named
as SPEC.md names it, with the unit in the name and a comment that says where the number comes from.
"""

from __future__ import annotations

import functools
from enum import IntEnum, IntFlag

#: The only protocol version this code speaks (SPEC.md "Version evolution").
PROTOCOL_VERSION = 1

#: Default UDP port of nodes and of the switch's virtual IP. Deliberately not RoCEv2's 4791, so a
#: capture never confuses the two.
NETDAM_UDP_PORT = 7744

#: Fixed part of the header, bytes. Multiple of 8 so the SR list and the payload stay 8-aligned.
HEADER_SIZE = 64
#: One SR segment: IPv4 address (4), UDP port (2), reserved (2); 8 keeps the payload aligned.
SEGMENT_SIZE = 8
#: Most segments one packet may carry. 64 hops cover a 65-node chain; 64*8 = 512 B of SR list
#: still leaves room for 8192 payload bytes at MTU 9000 (64 + 512 + 8192 = 8768 <= 8972).
MAX_SEGMENTS = 64

#: Largest payload, bytes: the NetDAM reduction packet carries 2048 fp32 in a 9000 B frame
#: (authors' blog, BRIEF section 4), i.e. 1024 f64/i64 or 4096 f16.
MAX_PAYLOAD_BYTES = 8192

#: IPv4 (20) + UDP (8) header bytes: "MTU 9000" means a UDP payload of at most 8972 (BRIEF s7).
IP_UDP_OVERHEAD = 28
DEFAULT_MTU = 9000
#: Largest MTU a node accepts: an IPv4 datagram's total length is a 16-bit field (RFC 791), so
#: 65535; Linux's loopback device has MTU 65536 (``ip link show lo``).
MAX_MTU = 65535
#: The tag trailer of a TAGGED datagram, bytes (SPEC.md 2.6): one SipHash-2-4 output.
TAG_SIZE = 8
#: Payloads above MAX_PAYLOAD_BYTES (an emulation MTU, SPEC.md 2.7) come in whole units of this:
#: a multiple of every element size, and of a 4 KiB page, so chunks and WRITEs stay aligned.
PAYLOAD_UNIT_BYTES = 4096
#: What a send slot holds besides the payload: the header, a full SR list and the tag.
SLOT_OVERHEAD_BYTES = HEADER_SIZE + MAX_SEGMENTS * SEGMENT_SIZE + TAG_SIZE


def largest_payload(mtu: int) -> int:
    """The largest payload of any datagram at IP MTU *mtu* (SPEC.md 2.7; INFO's ``max_payload``).

    MAX_PAYLOAD_BYTES (8192) up to MTU 9000 and somewhat above, where a datagram with the full SR
    list and a tag still carries 8192 bytes. Above that, an emulation MTU (loopback, where the
    link's MTU is 65536): the room a full SR list and a tag leave, in whole PAYLOAD_UNIT_BYTES:
    61440 at MTU 65000."""
    room = mtu - IP_UDP_OVERHEAD - SLOT_OVERHEAD_BYTES
    return max(MAX_PAYLOAD_BYTES, room // PAYLOAD_UNIT_BYTES * PAYLOAD_UNIT_BYTES)


#: The largest payload at any MTU (at MAX_MTU): what a codec without a node's MTU accepts.
MAX_EMULATED_PAYLOAD_BYTES = largest_payload(MAX_MTU)


def slot_bytes(mtu: int) -> int:
    """Room one outgoing datagram may need at *mtu*: header, full SR list, largest payload, tag.
    A send queue's slot; 8776 at MTU 9000."""
    return SLOT_OVERHEAD_BYTES + largest_payload(mtu)


#: Smallest MTU a node accepts: the fixed header must fit, plus one 8-byte element.
MIN_MTU = IP_UDP_OVERHEAD + HEADER_SIZE + 8

#: Administratively scoped IPv4 multicast range used for all-gather groups (RFC 2365 239/8).
MULTICAST_PREFIX = "239.77.0.0/16"

#: Replies carry no SR list: their size is the fixed header plus the payload.
REPLY_HEADER_SIZE = HEADER_SIZE

#: Duplicate window per client id, transactions (SPEC.md "Memory semantics").
DUP_WINDOW = 256
#: Clients tracked at once by one node's duplicate window (least recently used is evicted).
DUP_WINDOW_CLIENTS = 256
#: Largest reply cached for duplicate replay (header + an 8-byte atomic result fits).
DUP_REPLY_BYTES = 128

# Source guard (SPEC.md 12): lockout of key guessers and the anti-amplification limit.
#: Failed authentications a source may make at once (token bucket size).
LOCKOUT_BURST = 32
#: Failed authentications per second the bucket refills (sustained, never locked out).
LOCKOUT_RATE_PER_S = 4.0
#: First lockout, seconds; doubled with every further lockout of the same address ...
LOCKOUT_FIRST_S = 1.0
#: ... up to this (one hour).
LOCKOUT_MAX_S = 3600.0
#: The doubling restarts after this long without a lockout (one hour).
LOCKOUT_FORGET_S = 3600.0
#: Sources of one IPv4 address (any ports) tracked at once: one set of the source table.
WAYS_PER_ADDRESS = 8
#: Sets of the source table (so 8192 sources tracked).
LOCKOUT_SETS = 1024
#: Until a source proved it receives at its address, a reply is at most this many times the
#: request (QUIC, RFC 9000 section 8.1).
AMPLIFICATION_FACTOR = 3


@functools.cache
def enum_values(kind: type[IntEnum]) -> frozenset[int]:
    """The wire values *kind* defines: ``value in enum_values(DType)`` checks a field before
    ``DType(value)`` would raise (one set lookup; the enum's own map is private to enum)."""
    return frozenset(int(member) for member in kind)


class Opcode(IntEnum):
    """Instruction codes, SPEC.md section "Opcodes"."""

    READ = 0x01
    READ_RESP = 0x02
    WRITE = 0x03
    ADD = 0x04
    CHAIN_ADD = 0x05
    ALL_WRITE = 0x06
    FETCH_ADD = 0x07
    CAS = 0x08
    PING = 0x09
    INFO = 0x0A
    ACK = 0x0B
    NACK = 0x0C
    # The pool's optimizer: a gradient applied to a region's parameters in place (SPEC.md 6.8).
    UPDATE = 0x0D
    # Control plane: require the node's admin key in the rkey field.
    REGISTER = 0x20
    DEREGISTER = 0x21
    JOIN = 0x22
    LEAVE = 0x23
    START_COLL = 0x24
    COUNTERS = 0x25
    # Pool control: sent to a switch's VIP, authorised by the admin key or a tenant credential
    # (SPEC.md 11.9). A node answers them NACK BAD_FIELD.
    ALLOC = 0x26
    FREE = 0x27
    QUERY = 0x28


#: Opcodes whose payload is `length` bytes of data elements (dense, or a sparse encoding).
DATA_OPCODES = frozenset(
    {Opcode.WRITE, Opcode.ADD, Opcode.CHAIN_ADD, Opcode.ALL_WRITE, Opcode.READ_RESP, Opcode.UPDATE}
)
#: Replies: never answered, never NACKed (a malformed reply is counted and dropped).
REPLY_OPCODES = frozenset({Opcode.READ_RESP, Opcode.INFO, Opcode.ACK, Opcode.NACK})
#: Control opcodes: authorised by the admin key, executed by the control plane.
CONTROL_OPCODES = frozenset(
    {
        Opcode.REGISTER,
        Opcode.DEREGISTER,
        Opcode.JOIN,
        Opcode.LEAVE,
        Opcode.START_COLL,
        Opcode.COUNTERS,
    }
)

#: Pool control opcodes, served by the switch (SPEC.md 11.9).
POOL_OPCODES = frozenset({Opcode.ALLOC, Opcode.FREE, Opcode.QUERY})
#: The range of control and pool opcodes: TAGGED, they carry a control tag under the cluster's
#: admin tag key over the whole datagram (SPEC.md 2.6, "Control tags").
CONTROL_FIRST, CONTROL_LAST = int(Opcode.REGISTER), int(Opcode.QUERY)
#: The pool's own control opcodes, ALLOC..QUERY (a tenant seals them under its key, SPEC.md 11.9).
POOL_FIRST = int(Opcode.ALLOC)
assert POOL_OPCODES == {Opcode(op) for op in range(POOL_FIRST, CONTROL_LAST + 1)}


class Flags(IntFlag):
    """Header flags (16 bits). Bits not named here must be zero in v1."""

    NONE = 0
    ACK_REQ = 0x0001  # the receiver (the storing hop, for CHAIN_ADD) replies with an ACK
    SPARSE = 0x0002  # payload is a sparse (index, value) encoding, SPEC.md "Sparse payload"
    MCAST = 0x0004  # sent to a multicast group
    RELAYED = 0x0008  # set by a switch that wrote the return segment
    RETRY = 0x0010  # a retransmission (informational; counted)
    TAGGED = 0x0020  # an 8-byte tag follows the payload: SipHash-2-4 of header and SR list (2.6)


#: All flag bits v1 defines.
FLAGS_V1_MASK = 0x003F

#: START_COLL descriptor flags bit 0: sparse payloads and the round of non-zero bitmaps (SPEC 4.1).
FLAG_SPARSE = 0x01
#: START_COLL descriptor flags bit 1: fused reduce and update (SPEC 4.1): each block's last hop
#: steps the optimizer whose descriptor the header's addr names, at the step in aux_addr, and
#: stores and multicasts the new weights in place of the reduced gradient.
FLAG_UPDATE = 0x02
#: START_COLL descriptor flags bit 2: chains await every member's STARTED (SPEC 4.1, "STARTED"):
#: each member multicasts STARTED when its host starts the collective, and an originator starts
#: its chains once every member's came, so none meets a node that has not started (BUSY). For
#: starts known to be spread wider than a node holds early chains: a torus's steps, long chains.
FLAG_AWAIT_STARTED = 0x04


class Status(IntEnum):
    """Status codes carried by replies (0 in every non-NACK packet)."""

    OK = 0
    BAD_VERSION = 1
    BAD_OPCODE = 2
    TRUNCATED = 3
    BAD_LENGTH = 4
    BAD_DTYPE = 5
    BAD_OP = 6
    BAD_SEGMENT = 7
    BAD_RKEY = 8
    NO_RIGHTS = 9
    OUT_OF_BOUNDS = 10
    MISALIGNED = 11
    TOO_LARGE = 12
    STALE = 13
    NOT_MEMBER = 14
    EXISTS = 15
    NO_SPACE = 16
    UNAUTHORIZED = 17
    BAD_FIELD = 18
    SPANS_NODES = 19
    NO_ROUTE = 20
    STALE_EPOCH = 21
    BUSY = 22
    TIMEOUT = 23
    IN_USE = 24
    QUOTA = 25
    OUT_OF_STEP = 26


class DType(IntEnum):
    """Element types of payloads and memory operands (payload elements are little-endian)."""

    RAW = 0
    F32 = 1
    F16 = 2
    I32 = 3
    I64 = 4
    U64 = 5
    F64 = 6
    BF16 = 7


#: The gradient dtypes UPDATE takes: widened exactly to the float32 masters (SPEC.md 6.8).
UPDATE_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})


class OptRule(IntEnum):
    """An optimizer descriptor's update rule (SPEC.md 6.8; protocol/optim.py's references)."""

    SGD = 1  # with momentum, dampening, weight decay, Nesterov (torch.optim.SGD)
    ADAM = 2  # torch.optim.Adam: weight decay into the gradient
    ADAMW = 3  # torch.optim.AdamW: decoupled weight decay


class OptFlags(IntFlag):
    """An optimizer descriptor's flags (SPEC.md 6.8)."""

    NESTEROV = 0x01  # SGD only, with a momentum and no dampening


#: Bytes per element of each DType.
ELEMENT_SIZE = {
    DType.RAW: 1,
    DType.F32: 4,
    DType.F16: 2,
    DType.I32: 4,
    DType.I64: 8,
    DType.U64: 8,
    DType.F64: 8,
    DType.BF16: 2,
}

#: numpy dtype strings (little-endian) of each DType; f16 travels as IEEE binary16. numpy has no
#: bfloat16: bf16 elements are their 16-bit patterns (``bf16_values`` widens them to float32).
NUMPY_DTYPE = {
    DType.RAW: "u1",
    DType.F32: "<f4",
    DType.F16: "<f2",
    DType.I32: "<i4",
    DType.I64: "<i8",
    DType.U64: "<u8",
    DType.F64: "<f8",
    DType.BF16: "<u2",
}


class ReduceOp(IntEnum):
    """Combine operations of ADD and CHAIN_ADD (torch.distributed / MPI names)."""

    SUM = 0
    MIN = 1
    MAX = 2


class SegmentType(IntEnum):
    """What the SR list holds. v1 defines NONE and IPv4; IPv6 is reserved for a later version."""

    NONE = 0
    IPV4 = 1
    IPV6 = 2  # reserved: a v1 receiver answers NACK(BAD_SEGMENT)


class Rights(IntFlag):
    """Rights an rkey grants on its region (SPEC.md "Rights")."""

    NONE = 0
    READ = 0x1
    WRITE = 0x2
    ATOMIC = 0x4
    #: The rkey works only in datagrams from cluster members (a collective's key, SPEC.md 8):
    #: a non-member that learns it is answered BAD_RKEY, as if the key named nothing.
    MEMBERS = 0x8


#: READ, WRITE and ATOMIC: every access right (MEMBERS restricts who, it grants nothing).
RIGHTS_ALL = Rights.READ | Rights.WRITE | Rights.ATOMIC
#: Every rights bit REGISTER accepts.
RIGHTS_DEFINED = RIGHTS_ALL | Rights.MEMBERS

#: REGISTER's ``addr`` asking the node to place the region itself (first fit, 4 KiB aligned);
#: the ACK's ``addr`` carries where it went (SPEC.md 6.1).
REGISTER_ANYWHERE = 0xFFFF_FFFF_FFFF_FFFF
#: Alignment of a region the node places.
REGISTER_ALIGN = 4096


def max_payload(mtu: int, tagged: bool = False) -> int:
    """Largest data payload (READ length, WRITE payload) one datagram carries at *mtu*, no SR list:
    min(MTU - 28 - header, largest_payload(MTU)). What INFO advertises and pool clients split at;
    *tagged*: 8 bytes less below the cap, the room of the tag (SPEC.md 2.6)."""
    return max(
        0,
        min(
            mtu - IP_UDP_OVERHEAD - HEADER_SIZE - (TAG_SIZE if tagged else 0), largest_payload(mtu)
        ),
    )


def max_elements(mtu: int, dtype: DType, segments: int = 0) -> int:
    """Elements of *dtype* one packet carries at *mtu* with an SR list of *segments* entries.

    floor((MTU - 28 - header - SR list) / element size), capped at largest_payload (BRIEF s7).
    """
    room = mtu - IP_UDP_OVERHEAD - HEADER_SIZE - SEGMENT_SIZE * segments
    room = min(room, largest_payload(mtu))
    size = ELEMENT_SIZE[dtype]
    return max(room // size, 0)


#: COUNTERS with this ``aux_addr`` asks for the NIC's trace ring instead of its counters, from
#: record number ``addr`` on (SPEC.md 6.7).
COUNTERS_TRACE = 1
#: COUNTERS with this ``aux_addr`` asks for the last epoch of collective ``coll_id`` this node
#: settled: the last it started, less one while that one still runs (SPEC.md 6.5, "Epochs").
#: A host starting a new group asks every member's node and goes on from the highest.
COUNTERS_EPOCH = 2
#: Most records one trace reply carries: the reply payload stays within 8192 bytes
#: (24 + 170 * 48 = 8184), the largest payload of any datagram (MAX_PAYLOAD_BYTES).
TRACE_RECORDS_PER_REPLY = 170


class TraceKind(IntEnum):
    """What a trace record says happened at the NIC (SPEC.md 6.7)."""

    RX = 1  # a datagram arrived (before any check)
    TX = 2  # a datagram left (the kernel took it)
    DROP = 3  # datagrams dropped; status = the counter that counted them, length = how many
    RETRANSMIT = 4  # the collective engine sent a chunk again; seq = the chunk
    PHASE = 5  # a collective's phase ended here; status = the TracePhase
    BLOCK = 6  # a collective's block plan: seq = block, addr = its first chunk, length = chunks


class TracePhase(IntEnum):
    """The phases of a collective at one NIC, in order (a PHASE record's status)."""

    START = 1  # START_COLL taken: the collective's clock starts
    CHAINS = 2  # every chain this NIC started was ACKed (the reduce-scatter is over here)
    CHUNKS = 3  # every chunk this NIC needs is here (the gather is over here)
    DONE = 4  # every member's DONE is here
    COMPLETE = 5  # the completion went to the host
    FAILED = 6  # the collective failed here (its completion NACK went to the host)
