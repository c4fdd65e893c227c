"""read_answer (protocol/packet.py): how a host reads its node's ACKs and NACKs without building
a Packet. It must say what decode_packet says of every answer, and take nothing decode_packet
refuses but the two fields an answer's reader never reads (dtype, reduce_op)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import valid_packets
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam.protocol.constants import Opcode, Status
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Answer, Packet, decode_packet, encode_packet, read_answer
from netdam.protocol.tag import seal


def _as_decoded(packet: Packet) -> Answer:
    return Answer(
        int(packet.opcode),
        int(packet.status),
        packet.client_id,
        packet.txn_id,
        packet.aux_addr,
        packet.payload,
    )


@settings(max_examples=300, deadline=None)
@given(valid_packets())
def test_it_reads_what_decode_packet_reads(packet: Packet) -> None:
    data = encode_packet(packet)
    answer = read_answer(data)
    if packet.opcode in (Opcode.ACK, Opcode.NACK):
        assert answer == _as_decoded(decode_packet(data))
    else:
        assert answer is None  # a request is no answer


def test_a_tagged_completion_is_read_without_its_trailer() -> None:
    completion = Packet(
        Opcode.ACK, client_id=7, txn_id=9, aux_addr=1, coll_id=3, epoch=2
    ).with_payload(bytes(range(40)))
    data = seal(bytes(range(1, 17)), encode_packet(completion))
    answer = read_answer(data)
    assert answer == Answer(int(Opcode.ACK), 0, 7, 9, 1, bytes(range(40)))
    assert answer == _as_decoded(decode_packet(data))


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(valid_packets(), st.integers(0, 200), st.integers(0, 255))
def test_a_mutated_answer_is_refused_where_decode_packet_refuses_it(
    packet: Packet, offset: int, value: int
) -> None:
    """One byte changed anywhere: read_answer agrees with decode_packet, except that it does
    not check dtype and reduce_op (no host reads them), and never raises."""
    packet = replace(packet, opcode=Opcode.NACK if packet.opcode == Opcode.NACK else Opcode.ACK)
    try:
        data = bytearray(encode_packet(packet))
    except Exception:  # an ACK can't carry what the drawn opcode's fields were
        return
    if offset < len(data):
        data[offset] = value
    answer = read_answer(bytes(data))
    try:
        decoded = decode_packet(bytes(data))
    except RemoteProtocolError as refused:
        unread = (HEADER.at("dtype"), HEADER.at("reduce_op"))
        assert answer is None or (
            offset in unread and refused.status in (Status.BAD_DTYPE, Status.BAD_OP)
        )
        return
    if decoded.opcode in (Opcode.ACK, Opcode.NACK):
        assert answer == _as_decoded(decoded)
    else:
        assert answer is None


def test_short_and_foreign_datagrams_are_no_answer() -> None:
    assert read_answer(b"") is None
    assert read_answer(bytes(HEADER.size - 1)) is None
    assert read_answer(b"\x00" * 200) is None  # version 0
