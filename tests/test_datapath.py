"""The numba datapath against the Python codec (the reference): same verdict for the same bytes,
and no access outside the rkey's region whatever the bytes say."""

from __future__ import annotations

import struct

import numpy as np
from helpers import valid_packets
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam import counters as C
from netdam.node import NodeConfig, NodeCore
from netdam.protocol.constants import (
    HEADER_SIZE,
    REPLY_OPCODES,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Rights,
    Status,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import Packet, decode_packet, encode_packet, endpoint_to_u64

SELF = ("127.0.0.1", 7001)
PEER = ("127.0.0.1", 7002)
CLIENT = ("127.0.0.1", 9001)
REGION = (4096, 8192)  # the only bytes any request may touch
RKEY = 0x00C0FFEE
CANARY = 0x5A
#: Statuses that only the codec's structural checks produce.
STRUCTURAL = {
    Status.BAD_VERSION,
    Status.BAD_OPCODE,
    Status.TRUNCATED,
    Status.BAD_LENGTH,
    Status.BAD_DTYPE,
    Status.BAD_OP,
    Status.BAD_SEGMENT,
}


def fresh_node() -> NodeCore:
    node = NodeCore(
        NodeConfig(endpoint=SELF, memory_bytes=1 << 16, admin_key=0xAD, members=(SELF, PEER))
    )
    node.register_region(
        REGION[0], REGION[1], Rights.READ | Rights.WRITE | Rights.ATOMIC, rkey=RKEY
    )
    node.memory[:] = CANARY
    return node


_SHARED_NODE = fresh_node()  # hypothesis examples share one node: state carries over, as in life


def verdict_of_node(node: NodeCore, data: bytes) -> list[Packet]:
    node.receive_datagram(data, CLIENT, 0.0)
    out = node.datagrams_to_send(0.0)
    return [decode_packet(d) for d, _ in out]


def check_parity(node: NodeCore, data: bytes) -> None:
    before_trunc = int(node.counters[C.DROP_TRUNCATED])
    before_bad_reply = int(node.counters[C.DROP_BAD_REPLY])
    replies = verdict_of_node(node, data)
    try:
        decode_packet(data)
        codec_status = Status.OK
    except RemoteProtocolError as exc:
        codec_status = exc.status
    nacks = [r for r in replies if r.opcode == Opcode.NACK]
    if codec_status == Status.OK:
        assert not any(n.status in STRUCTURAL for n in nacks), (data.hex(), nacks)
    elif len(data) < HEADER_SIZE:
        assert replies == [] and node.counters[C.DROP_TRUNCATED] == before_trunc + 1
    elif data[1] in REPLY_OPCODES:
        assert replies == [] and node.counters[C.DROP_BAD_REPLY] == before_bad_reply + 1
    else:
        assert [n.status for n in nacks] == [codec_status], (data.hex(), codec_status, replies)
        assert len(replies) == 1
    # Nothing outside the region ever changes.
    outside = np.concatenate([node.memory[: REGION[0]], node.memory[REGION[0] + REGION[1] :]])
    assert (outside == CANARY).all(), data.hex()


def targeted(rng: np.random.Generator) -> bytes:
    """A packet aimed at the live region, often near its edges."""
    opcode = Opcode(rng.choice([Opcode.READ, Opcode.WRITE, Opcode.ADD, Opcode.CHAIN_ADD,
                                Opcode.ALL_WRITE, Opcode.FETCH_ADD, Opcode.CAS]))  # fmt: skip
    dtype = DType(rng.integers(1, 7))
    if opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        dtype = DType.U64
    size = {DType.F32: 4, DType.F16: 2, DType.I32: 4}.get(dtype, 8)
    count = int(rng.integers(1, 64))
    edge = REGION[0] + REGION[1] - count * size
    addr = int(
        rng.choice([REGION[0], edge, edge + size, REGION[0] - size, rng.integers(0, 1 << 16)])
    )
    addr -= addr % (size if rng.random() < 0.9 else 1)
    fields: dict[str, object] = dict(rkey=RKEY if rng.random() < 0.9 else int(rng.integers(0, 2**32)),
                                     addr=addr, dtype=dtype, reduce_op=ReduceOp(rng.integers(0, 3)),
                                     client_id=int(rng.integers(0, 4)), txn_id=int(rng.integers(0, 600)))  # fmt: skip
    if opcode == Opcode.READ:
        fields["length"] = count * size
    elif opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        fields["length"] = 8
        fields["payload"] = bytes(
            rng.integers(0, 256, 8 if opcode == Opcode.FETCH_ADD else 16, dtype=np.uint8)
        )
    else:
        payload = bytes(rng.integers(0, 256, count * size, dtype=np.uint8))
        fields["length"], fields["payload"] = len(payload), payload
    if opcode == Opcode.CHAIN_ADD:
        hops = [SELF, PEER, CLIENT][: int(rng.integers(1, 4))]
        fields["segments"] = tuple(hops)
        fields["segments_left"] = int(rng.integers(0, len(hops)))
        fields["aux_addr"] = int(rng.choice([REGION[0], edge, edge + size, 0]))
        fields["coll_id"] = int(rng.integers(0, 3))
        fields["seq"] = int(rng.integers(0, 1 << 18))
    fields["flags"] = Flags(int(rng.integers(0, 2)))
    data = bytearray(encode_packet(Packet(opcode, **fields)))  # type: ignore[arg-type]
    for _ in range(int(rng.integers(0, 3))):  # mutate a few bytes, mostly the header
        pos = int(rng.integers(0, min(len(data), 80) if rng.random() < 0.8 else len(data)))
        data[pos] = int(rng.integers(0, 256))
    if rng.random() < 0.05:
        data = data[: int(rng.integers(0, len(data)))]
    return bytes(data)


def test_datapath_matches_codec_on_targeted_mutations() -> None:
    rng = np.random.default_rng(7)
    node = fresh_node()
    for _ in range(4000):
        check_parity(node, targeted(rng))
    # The run must have exercised the datapath, not just its error paths.
    assert node.counters[C.OPCODE_BASE + Opcode.WRITE] > 0 and node.counters[C.FORWARDED] > 0
    assert node.counters[C.NACK_BASE + Status.OUT_OF_BOUNDS] > 0


@settings(max_examples=400, deadline=None)
@given(valid_packets(), st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), max_size=3))
def test_datapath_matches_codec_hypothesis(
    packet: Packet, mutations: list[tuple[int, int]]
) -> None:
    data = bytearray(encode_packet(packet))
    for offset, value in mutations:
        data[offset % len(data)] = value
    check_parity(_SHARED_NODE, bytes(data))


def test_batch_of_mixed_packets_equals_one_by_one() -> None:
    """A batch gives the same replies, in order, as the same datagrams one at a time."""
    rng = np.random.default_rng(11)
    datagrams = [targeted(rng) for _ in range(300)]
    one = fresh_node()
    singles = []
    for data in datagrams:
        one.receive_datagram(data, CLIENT, 0.0)
        singles += one.datagrams_to_send(0.0)
    batched = fresh_node()
    buf = np.frombuffer(b"".join(datagrams), np.uint8).copy()
    lens = np.array([len(d) for d in datagrams], np.int32)
    offs = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
    srcs = np.full(len(datagrams), endpoint_to_u64(CLIENT), np.uint64)
    batched.receive_batch(buf, offs, lens, srcs, len(datagrams), 0.0)

    def without_credit(items: list[tuple[bytes, object]]) -> list[tuple[bytes, object]]:
        return [(d[:51] + b"\0" + d[52:], dst) for d, dst in items]  # credit = queue occupancy

    assert without_credit(batched.datagrams_to_send(0.0)) == without_credit(singles)
    np.testing.assert_array_equal(batched.memory, one.memory)


def test_fetch_add_u64_le_layout() -> None:
    node = fresh_node()
    node.memory[4096:4104] = np.frombuffer(struct.pack("<Q", 41), np.uint8)
    req = Packet(
        Opcode.FETCH_ADD,
        rkey=RKEY,
        addr=4096,
        dtype=DType.U64,
        length=8,
        payload=struct.pack("<Q", 1),
    )
    (reply,) = verdict_of_node(node, encode_packet(req))
    assert struct.unpack("<Q", reply.payload) == (41,)
    assert struct.unpack("<Q", bytes(node.memory[4096:4104])) == (42,)
