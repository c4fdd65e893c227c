"""Counter layout of a node: one u64 array the datapath increments and the control plane reads.

The index of every counter is fixed (SPEC.md "COUNTERS"): COUNTERS replies carry the array as
u64 little-endian in this order, so a client maps names without asking.
"""

from __future__ import annotations

import numpy as np

from netdam.protocol.constants import Opcode, Status

RX_PACKETS = 0
RX_BYTES = 1
TX_PACKETS = 2
TX_BYTES = 3
FORWARDED = 4  # CHAIN_ADD packets combined and sent on to the next segment
STORED = 5  # CHAIN_ADD packets combined and stored by the last hop
CHAIN_REACKS = 6  # CHAIN_ADD re-sends of a chunk already stored: re-ACKed, not added again
DUP_REPLAYS = 7  # duplicate (client, txn) answered from the window
DUP_SILENT = 8  # duplicate of a request that had no reply: dropped
PUNTED = 9  # packets handed to the control plane (slow path)
BYTES_COMBINED = 10  # payload bytes through the combine ALUs
DROP_TRUNCATED = 11  # shorter than the fixed header: no ids to answer with
DROP_BAD_REPLY = 12  # malformed reply: replies are never NACKed
DROP_STALE_EPOCH = 13  # collective packet of an earlier epoch
DROP_TX_FULL = 14  # no room in the send queue
DROP_OVERSIZE = 15  # datagram larger than the receive slot
DROP_UNEXPECTED_REPLY = 16  # reply nobody waited for
DROP_FAULT = 17  # dropped by receive-side fault injection
KERNEL_DROPS = 18  # datagrams the kernel dropped (SO_RXQ_OVFL), filled by the I/O shell
RETRANSMITS = 19  # packets re-sent by this node's recovery
RCVBUF_BYTES = 20  # gauge: receive buffer the kernel granted (SO_RCVBUF as getsockopt reports)
SNDBUF_BYTES = 21  # gauge: send buffer the kernel granted
DROP_COLL_EARLY = 22  # all-gather data for a collective not started here yet (READ repairs it)
SEND_DROPS = 23  # datagrams the kernel refused to send (EMSGSIZE over the MTU, ...), I/O shell
DROP_LOCKOUT = 24  # datagrams from a locked-out source, dropped (SPEC.md 12.3)
AUTH_FAILURES = 25  # BAD_RKEY / UNAUTHORIZED NACKs to non-members (the lockout's input)
LOCKOUTS = 26  # times a source (or a set of sources) was locked out
DROP_AMPLIFICATION = 27  # READs dropped: no address-validation token, answer over 3x (SPEC.md 12.4)
DROP_COLL_FORGED = 28  # a collective's datagrams without its key or tag, dropped (SPEC.md 4.1, 2.6)
DROP_REGION_FORGED = 29  # datagrams naming a tagged region with a wrong tag, dropped (SPEC.md 2.6)
DROP_CONTROL_FORGED = 30  # TAGGED control datagrams with a wrong admin tag, dropped (SPEC.md 2.6)
DROP_CONTROL_REPLAYED = (
    31  # a proven control datagram taken before from another source (SPEC.md 2.6)
)
#: Packets received per opcode value (0..63).
OPCODE_BASE = 32
OPCODE_SLOTS = 64
#: NACKs sent per status value (0..31).
NACK_BASE = OPCODE_BASE + OPCODE_SLOTS
NACK_SLOTS = 32
NUM_COUNTERS = NACK_BASE + NACK_SLOTS

_SCALAR_NAMES = {
    RX_PACKETS: "rx_packets",
    RX_BYTES: "rx_bytes",
    TX_PACKETS: "tx_packets",
    TX_BYTES: "tx_bytes",
    FORWARDED: "forwarded",
    STORED: "stored",
    CHAIN_REACKS: "chain_reacks",
    DUP_REPLAYS: "dup_replays",
    DUP_SILENT: "dup_silent",
    PUNTED: "punted",
    BYTES_COMBINED: "bytes_combined",
    DROP_TRUNCATED: "drop_truncated",
    DROP_BAD_REPLY: "drop_bad_reply",
    DROP_STALE_EPOCH: "drop_stale_epoch",
    DROP_TX_FULL: "drop_tx_full",
    DROP_OVERSIZE: "drop_oversize",
    DROP_UNEXPECTED_REPLY: "drop_unexpected_reply",
    DROP_FAULT: "drop_fault",
    KERNEL_DROPS: "kernel_drops",
    RETRANSMITS: "retransmits",
    RCVBUF_BYTES: "rcvbuf_bytes",
    SNDBUF_BYTES: "sndbuf_bytes",
    DROP_COLL_EARLY: "drop_coll_early",
    SEND_DROPS: "send_drops",
    DROP_LOCKOUT: "drop_lockout",
    AUTH_FAILURES: "auth_failures",
    LOCKOUTS: "lockouts",
    DROP_AMPLIFICATION: "drop_amplification",
    DROP_COLL_FORGED: "drop_coll_forged",
    DROP_REGION_FORGED: "drop_region_forged",
    DROP_CONTROL_FORGED: "drop_control_forged",
    DROP_CONTROL_REPLAYED: "drop_control_replayed",
}


def new_counters() -> np.ndarray:
    """A zeroed counter array."""
    return np.zeros(NUM_COUNTERS, dtype=np.uint64)


#: The counters that count dropped datagrams (their sum is ``drops``; a trace's DROP records
#: name one of them).
DROP_INDICES = (
    *range(DROP_TRUNCATED, KERNEL_DROPS + 1),
    DROP_COLL_EARLY,
    SEND_DROPS,
    DROP_LOCKOUT,
    DROP_AMPLIFICATION,
    DROP_COLL_FORGED,
    DROP_REGION_FORGED,
    DROP_CONTROL_FORGED,
    DROP_CONTROL_REPLAYED,
)


def counters_to_dict(values: np.ndarray) -> dict[str, object]:
    """Name the counters: scalars, ``ops`` by opcode name and ``nacks`` by status name."""
    result: dict[str, object] = {name: int(values[index]) for index, name in _SCALAR_NAMES.items()}
    result["ops"] = {
        op.name: int(values[OPCODE_BASE + op]) for op in Opcode if values[OPCODE_BASE + op]
    }
    result["nacks"] = {
        st.name: int(values[NACK_BASE + st]) for st in Status if values[NACK_BASE + st]
    }
    result["drops"] = sum(int(values[i]) for i in DROP_INDICES)
    return result


def counter_names() -> list[str]:
    """Name of every index (for SPEC.md and the COUNTERS reply); unused indices are "reserved"."""
    names = ["reserved"] * NUM_COUNTERS
    for index, name in _SCALAR_NAMES.items():
        names[index] = name
    for op in Opcode:
        names[OPCODE_BASE + op] = f"op_{op.name.lower()}"
    for st in Status:
        names[NACK_BASE + st] = f"nack_{st.name.lower()}"
    return names
