"""A host's per-call datagrams, compiled (netdam.kernels.host_calls): START_COLLs stamped and
sealed equal protocol.packet.StartCollTemplate.moved sealed by the control client (the plain
references), and answers read compiled equal protocol.packet.read_answer's."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import start_coll_packet
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam.cluster.control import ControlClient
from netdam.kernels.host_calls import AnswerReader, StartStamper
from netdam.protocol.constants import DType, Flags, Opcode, Status
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Packet, StartCollTemplate, encode_packet, read_answer
from netdam.protocol.payloads import pack_completion

ADMIN_KEY = 0xABCD  # start_coll_packet's header rkey: the admin key
ADMIN_TAG_KEY = bytes(range(1, 17))


@pytest.fixture(scope="module")
def client() -> Iterator[ControlClient]:
    with ControlClient(admin_key=ADMIN_KEY, bind="127.0.0.1", admin_tag_key=ADMIN_TAG_KEY) as c:
        yield c


#: A call's fields: epoch, txn_id, the descriptor's rkey, a tag key (not all zero).
_U32 = st.integers(0, 2**32 - 1)
CALL_FIELDS = st.tuples(_U32, _U32, _U32, st.binary(min_size=16, max_size=16).filter(any))


@settings(max_examples=150, deadline=None)
@given(CALL_FIELDS)
def test_a_stamped_start_coll_is_the_template_moved_and_sealed_by_the_control_client(
    client: ControlClient, fields: tuple[int, int, int, bytes]
) -> None:
    epoch, txn_id, rkey, tag_key = fields
    template = StartCollTemplate.of(start_coll_packet(1, 2, 3, b"\x01" * 16))
    packet, encoded = template.moved(epoch, txn_id, rkey, tag_key)
    sealing = client.sealing(template.prototype)
    assert sealing == (ADMIN_TAG_KEY, 0)  # an admin's START_COLL leaves sealed
    sealed = StartStamper(template, sealing)
    assert sealed.stamp(epoch, txn_id, rkey, tag_key) == (packet, client.encode(packet, encoded))
    # Twice from one stamper (its buffer is reused), and unsealed: the template moved.
    assert sealed.stamp(epoch, txn_id, rkey, tag_key)[1] == client.encode(packet, encoded)
    assert StartStamper(template, None).stamp(epoch, txn_id, rkey, tag_key) == (packet, encoded)


def test_a_stamper_refuses_fields_out_of_their_width_and_bad_keys() -> None:
    template = StartCollTemplate.of(start_coll_packet(1, 2, 3, b"\x01" * 16))
    stamper = StartStamper(template, (ADMIN_TAG_KEY, 0))
    for epoch, txn, rkey in ((2**32, 0, 3), (1, -1, 3), (1, 0, 2**32)):
        with pytest.raises(ValueError, match="32-bit fields"):
            stamper.stamp(epoch, txn, rkey, b"\x01" * 16)
    for bad in (b"\x00" * 16, b"\x01" * 15, b"\x01" * 17):
        with pytest.raises(ValueError, match="a tag key is 16 bytes"):
            stamper.stamp(1, 0, 3, bad)
    with pytest.raises(ValueError, match="16 bytes"):
        StartStamper(template, (b"short", 0))


def _answers() -> list[bytes]:
    """Datagrams a host may find on its socket: answers, a tagged completion, and what is no
    well-formed answer (read_answer's None)."""
    ack = encode_packet(Packet(Opcode.ACK, client_id=5, txn_id=77, aux_addr=3))
    completion_payload = pack_completion(2, 1)
    completion = encode_packet(
        Packet(
            Opcode.ACK,
            client_id=5,
            txn_id=78,
            aux_addr=2,
            length=len(completion_payload),
            payload=completion_payload,
        )
    )
    tagged = bytearray(ack)
    HEADER.write(tagged, "flags", int(Flags.TAGGED))  # then an 8-byte trailer
    nack = encode_packet(Packet(Opcode.NACK, client_id=5, txn_id=79, status=Status.BUSY))
    bad_version = bytearray(ack)
    bad_version[0] = 2
    bad_status = bytearray(nack)
    HEADER.write(bad_status, "status", 250)
    return [
        ack,
        completion,
        bytes(tagged) + b"12345678",
        bytes(tagged) + b"1234",  # TAGGED without its whole tag
        nack,
        bytes(bad_version),
        bytes(bad_status),
        ack[:40],  # truncated
        encode_packet(Packet(Opcode.PING)),  # no answer
        b"",  # a waiter's wake-up
    ]


def _read_all(reader: AnswerReader, fd: int) -> list[int]:
    counts = [reader.read(fd)]
    while counts[-1] == reader.capacity:
        counts.append(reader.read(fd))
    return counts


def test_answers_read_compiled_are_read_answer_s_and_come_whole() -> None:
    """Every datagram queued is taken (a read takes at most ``capacity``, so ten take three
    reads), each as read_answer reads it, and whole."""
    sent = _answers()
    reader = AnswerReader()
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as host,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as node,
    ):
        host.bind(("127.0.0.1", 0))
        for data in sent:
            node.sendto(data, host.getsockname())
        time.sleep(0.05)
        got: list[bytes] = []
        answers = []
        counts = [reader.read(host.fileno())]
        while True:
            for k in range(counts[-1]):
                got.append(reader.datagram(k))
                answers.append(reader.answer(k))
            if counts[-1] < reader.capacity:
                break
            counts.append(reader.read(host.fileno()))
        assert counts == [4, 4, 2]
        assert reader.read(host.fileno()) == 0  # nothing waits: no wait either
    assert got == sent
    assert answers == [read_answer(data) for data in sent]
    assert [a is not None for a in answers] == [True] * 3 + [False, True] + [False] * 5
    with pytest.raises(ValueError, match="no open socket"):
        reader.read(-1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), min_size=1, max_size=4))
def test_a_mangled_answer_is_read_as_read_answer_reads_it(changes: list[tuple[int, int]]) -> None:
    """Bytes of a completion changed at random: the compiled read agrees with read_answer,
    except that it also refuses a dtype or reduce op SPEC.md does not name (fields read_answer
    leaves unread, and a node never writes out of range)."""
    payload = pack_completion(2, 1)
    data = bytearray(
        encode_packet(
            Packet(
                Opcode.ACK, client_id=5, txn_id=78, aux_addr=2, length=len(payload), payload=payload
            )
        )
    )
    for at, value in changes:
        data[at] = value
    reader = AnswerReader()
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as host,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as node,
    ):
        host.bind(("127.0.0.1", 0))
        node.sendto(bytes(data), host.getsockname())
        deadline = time.monotonic() + 1.0
        while (n := reader.read(host.fileno())) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert n == 1
    compiled, reference = reader.answer(0), read_answer(bytes(data))
    unnamed = data[48] not in {int(d) for d in DType} or data[49] > 2
    if compiled is None and reference is not None:
        assert unnamed, bytes(data)
    else:
        assert compiled == reference
    assert np.array_equal(
        np.frombuffer(reader.datagram(0), np.uint8), np.frombuffer(data, np.uint8)
    )
