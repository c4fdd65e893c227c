"""The trace ring's reply (SPEC.md 6.7) at a node core with a hand clock: records numbered in
order, the ring turning over (the reader sees what it lost), tracing off, and who may read it."""

from __future__ import annotations

import pytest

from netdam.core.node import NodeConfig, NodeCore
from netdam.protocol.constants import (
    COUNTERS_TRACE,
    RIGHTS_ALL,
    TRACE_RECORDS_PER_REPLY,
    Opcode,
    Status,
    TraceKind,
)
from netdam.protocol.errors import ProtocolError
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import pack_register
from netdam.protocol.trace import TracePage, parse_trace_reply

ME: Endpoint = ("10.0.0.1", 7000)
ADMIN_HOST: Endpoint = ("10.0.0.9", 5000)
ADMIN = 0xAD


def node(records: int) -> NodeCore:
    return NodeCore(
        NodeConfig(endpoint=ME, memory_bytes=1 << 16, admin_key=ADMIN, trace_records=records)
    )


def ask(core: NodeCore, first: int, key: int = ADMIN, aux: int = COUNTERS_TRACE) -> Packet:
    request = Packet(
        Opcode.COUNTERS, client_id=3, txn_id=first % 999 + 1, rkey=key, addr=first, aux_addr=aux
    )
    core.receive_datagram(encode_packet(request), ADMIN_HOST, 1.0)
    [(reply, _)] = core.datagrams_to_send(1.0)
    return decode_packet(reply)


def page(core: NodeCore, first: int) -> TracePage:
    reply = ask(core, first)
    assert reply.opcode == Opcode.ACK
    return parse_trace_reply(reply.payload)


def registers(core: NodeCore, n: int) -> None:
    """*n* REGISTERs from the admin: control datagrams the trace records on arrival."""
    for k in range(n):
        payload = pack_register(0, int(RIGHTS_ALL))
        request = Packet(
            Opcode.REGISTER,
            client_id=3,
            txn_id=100 + k,
            rkey=ADMIN,
            addr=k * 4096,
            aux_addr=4096,
            length=len(payload),
            payload=payload,
        )
        core.receive_datagram(encode_packet(request), ADMIN_HOST, 0.5 + k * 1e-3)
        core.datagrams_to_send(0.5)


def test_records_are_numbered_in_order_and_read_in_pages() -> None:
    core = node(1024)
    registers(core, 3)
    got = page(core, 0)
    assert (got.first, got.written, got.slots) == (0, 3, 1024)
    assert list(got.records["kind"]) == [TraceKind.RX] * 3
    assert list(got.records["opcode"]) == [Opcode.REGISTER] * 3
    assert list(got.records["addr"]) == [0, 0, 0]  # control records carry ids, not operands
    assert list(got.records["t_ns"]) == [500_000_000, 501_000_000, 502_000_000]
    # From a later number, and past the end: nothing more, the count stands.
    assert len(page(core, 2).records) == 1
    beyond = page(core, 1 << 40)
    assert (len(beyond.records), beyond.first, beyond.written) == (0, 3, 3)
    # Reading does not write: COUNTERS is not recorded.
    assert page(core, 0).written == 3


def test_a_ring_that_turned_over_answers_from_its_oldest_record() -> None:
    core = node(8)
    registers(core, 12)
    got = page(core, 0)
    assert (got.first, got.written, got.slots) == (4, 12, 8)  # 0..3 were overwritten
    assert [int(t) for t in got.records["t_ns"]] == [
        round((0.5 + k * 1e-3) * 1e9) for k in range(4, 12)
    ]


def test_a_reply_holds_at_most_170_records() -> None:
    core = node(1024)
    registers(core, TRACE_RECORDS_PER_REPLY + 5)
    got = page(core, 0)
    assert len(got.records) == TRACE_RECORDS_PER_REPLY
    assert len(page(core, got.first + len(got.records)).records) == 5


def test_tracing_off_records_nothing() -> None:
    core = node(0)
    registers(core, 3)
    got = page(core, 0)
    assert (got.first, got.written, got.slots, len(got.records)) == (0, 0, 0, 0)


def test_only_the_admin_reads_the_trace() -> None:
    core = node(64)
    registers(core, 2)
    refused = ask(core, 0, key=ADMIN ^ 0x100)
    assert (refused.opcode, refused.status) == (Opcode.NACK, Status.UNAUTHORIZED)
    assert refused.payload == b""
    # An aux_addr COUNTERS does not define is refused, not read as counters.
    unknown = ask(core, 0, aux=7)
    assert (unknown.opcode, unknown.status) == (Opcode.NACK, Status.BAD_FIELD)


def test_a_counters_reply_is_not_taken_for_a_trace() -> None:
    core = node(64)
    counters = ask(core, 0, aux=0)
    assert counters.opcode == Opcode.ACK and len(counters.payload) == 1024
    with pytest.raises(ProtocolError, match="predates the trace"):
        parse_trace_reply(counters.payload)
