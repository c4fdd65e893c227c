"""A NIC's trace as a client reads it (SPEC.md 6.7): the reply to COUNTERS with ``aux_addr``
COUNTERS_TRACE, parsed into a numpy record array whose fields are TRACE_RECORD's by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netdam.protocol.constants import Status
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import TRACE_RECORD, TRACE_RECORD_BYTES, TRACE_REPLY, Layout

_NUMPY = {"u8": "u1", "u16": "u2", "u32": "u4", "u64": "u8", "ipv4": "u4"}


def record_dtype(layout: Layout) -> np.dtype:
    """A numpy dtype with *layout*'s fields by name, offset and byte order (no bytes fields)."""
    order = "<" if layout.order == "<" else ">"
    return np.dtype(
        {
            "names": [f.name for f in layout.fields],
            "formats": [order + _NUMPY[f.kind] for f in layout.fields],
            "offsets": [f.offset for f in layout.fields],
            "itemsize": layout.size,
        }
    )


#: A NIC's trace ring unless its owner says otherwise (``--trace-records``): 32,768 records of 48
#: bytes, 1.5 MiB, the last ~16,000 datagrams each way of a busy NIC.
DEFAULT_TRACE_RECORDS = 32768

#: One trace record as numpy reads it: ``records["t_ns"]``, ``records["kind"]``, ...
TRACE_DTYPE = record_dtype(TRACE_RECORD)


@dataclass(frozen=True)
class TracePage:
    """One trace reply: records number ``first`` .. ``first + len(records) - 1`` of the
    ``written`` the NIC wrote so far, from a ring of ``slots`` (0: tracing off there)."""

    first: int
    written: int
    slots: int
    records: np.ndarray  # TRACE_DTYPE


def parse_trace_reply(payload: bytes) -> TracePage:
    """The trace reply's header and records; RemoteProtocolError when it is not one (a node without
    the trace answers its 1,024-byte counters, which no trace reply's length can be)."""
    head = TRACE_REPLY.size
    if len(payload) < head or (len(payload) - head) % TRACE_RECORD_BYTES != 0:
        raise RemoteProtocolError(
            Status.BAD_LENGTH,
            f"a trace reply of {len(payload)} bytes: expected {head} + 48 per record "
            "(a node that predates the trace answers its counters)",
        )
    first, written, slots, record_bytes, _reserved = TRACE_REPLY.struct.unpack_from(payload)
    if record_bytes != TRACE_RECORD_BYTES:
        raise RemoteProtocolError(
            Status.BAD_FIELD, f"trace records of {record_bytes} bytes: this client reads 48"
        )
    records = np.frombuffer(payload, TRACE_DTYPE, offset=head).copy()
    if first + len(records) > written:
        raise RemoteProtocolError(
            Status.BAD_FIELD, f"trace reply past the records written ({first} + {len(records)})"
        )
    return TracePage(first, written, slots, records)
