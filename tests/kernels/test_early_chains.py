"""Chains that reach a node before its host's START_COLL wait aside and come back when it
starts (netdam.kernels.collective.hold_early_chains; SPEC.md 4.1, "Early chains")."""

from __future__ import annotations

import socket
import time

import numpy as np

from netdam.cluster.launch import start_cluster
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels import collective as L
from netdam.kernels.state import HoldTable, RxBatch
from netdam.protocol.constants import DType, Opcode, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64

ME: Endpoint = ("127.0.0.1", 7001)
PEER: Endpoint = ("127.0.0.1", 7002)
STRANGER: Endpoint = ("127.0.0.1", 7999)
COLL, EPOCH = 7, 3
AREA = 1 << 16  # where released datagrams are copied (after the receive runs)


def chain(
    seq: int = 0, opcode: Opcode = Opcode.CHAIN_ADD, coll: int = COLL, to: Endpoint = ME
) -> bytes:
    """A datagram of collective *coll* (a chain's last hop *to*), as a member would send it."""
    if opcode == Opcode.READ:  # a repair READ of a chunk: no payload, its length asked for
        return encode_packet(
            Packet(opcode, seq=seq, coll_id=coll, epoch=EPOCH, rkey=0x55, length=16)
        )
    return encode_packet(
        Packet(
            opcode,
            seq=seq,
            coll_id=coll,
            epoch=EPOCH,
            rkey=0x55,
            dtype=DType.F32,
            segments=(to,) if opcode == Opcode.CHAIN_ADD else (),
            aux_addr=0,
        ).with_payload(np.arange(4, dtype="<f4").tobytes())
    )


class Batch:
    """A receive batch with room after AREA for released datagrams, and a hold table."""

    def __init__(self, slots: int = 2 * L.EARLY_SLOTS) -> None:
        self.rx = RxBatch(
            np.zeros(AREA + slots * 9216, np.uint8),
            np.zeros(4 * slots, np.int64),
            np.zeros(4 * slots, np.int32),
            np.zeros(4 * slots, np.uint64),
        )
        self.hold = HoldTable(
            np.zeros((slots, 9216), np.uint8),
            np.zeros(slots, np.int32),
            np.zeros(slots, np.uint64),
            np.zeros(slots, np.int64),
            np.zeros(slots, np.float64),
            np.zeros(slots, np.int64),
        )
        self.core = NodeCore(NodeConfig(endpoint=ME, members=(ME, PEER), memory_bytes=1 << 16))

    def run(self, datagrams: list[tuple[bytes, Endpoint]], now: float) -> list[tuple[bytes, int]]:
        """Offer *datagrams*; the batch that goes on to the datapath, as (bytes, source)."""
        buf, off, ln, src = self.rx
        at = 0
        for k, (data, sender) in enumerate(datagrams):
            buf[at : at + len(data)] = np.frombuffer(data, np.uint8)
            off[k], ln[k], src[k] = at, len(data), endpoint_to_u64(sender)
            at += len(data)
        state = self.core.node_state()
        n, _ = L.hold_early_chains(
            self.rx, len(datagrams), AREA, state.members, state.coll, self.hold, now
        )
        return [(bytes(buf[off[k] : off[k] + ln[k]]), int(src[k])) for k in range(n)]

    def start(self) -> None:
        """What START_COLL leaves in a slot's row, as far as the phase check reads it."""
        cfg = self.core.collective.cfg[0]
        cfg[L.CFG_COLL], cfg[L.CFG_EPOCH], cfg[L.CFG_STATE] = COLL, EPOCH, L.STATE_RUNNING


def test_a_members_early_chain_waits_and_comes_back_when_its_collective_starts() -> None:
    batch = Batch()
    assert batch.run([(chain(), PEER)], now=1.0) == []
    assert L.early_count(batch.hold) == 1
    assert batch.run([], now=1.001) == []  # not started yet, not held too long: still waits
    batch.start()
    [(data, src)] = batch.run([], now=1.002)
    assert data == chain() and src == endpoint_to_u64(PEER)
    assert batch.rx.off[0] >= AREA and L.early_count(batch.hold) == 0


def test_a_held_chains_originator_is_remembered_for_resume() -> None:
    """The originator of a held chain is remembered as one answered BUSY is: the node RESUMEs
    it when its host starts the collective, and the originator restarts the timer of its
    chains in flight (SPEC.md 4.1, "Early chains"). A stranger's chain is not held, and its
    sender is not remembered."""
    batch = Batch()
    batch.run([(chain(), PEER), (chain(), STRANGER)], now=1.0)
    row = batch.core.collective.cfg[L.SPARE_SLOT]  # no slot holds the collective yet
    assert (row[L.CFG_REFUSED_COLL], row[L.CFG_REFUSED_EPOCH]) == (COLL, EPOCH)
    assert row[L.CFG_REFUSED_N] == 1
    assert row[L.CFG_REFUSED_BASE] == endpoint_to_u64(PEER)


def test_a_held_chain_never_makes_a_node_forget_a_refused_originator() -> None:
    """A node remembers the refused originators of one (coll, epoch) per row. A held chain's
    originator has its chain on the way (only its timer gains by a RESUME), where one answered
    BUSY, or whose all-gather chunk was dropped as early, waits for the RESUME: a held chain of
    another collective leaves that record alone and is not remembered itself."""
    batch = Batch()
    row = batch.core.collective.cfg[L.SPARE_SLOT]
    other = endpoint_to_u64(("127.0.0.1", 7003))
    row[L.CFG_REFUSED_COLL], row[L.CFG_REFUSED_EPOCH] = COLL + 1, EPOCH
    row[L.CFG_REFUSED_N], row[L.CFG_REFUSED_BASE] = 1, np.int64(other)
    assert batch.run([(chain(), PEER)], now=1.0) == []  # held, as before
    assert (row[L.CFG_REFUSED_COLL], row[L.CFG_REFUSED_EPOCH]) == (COLL + 1, EPOCH)
    assert row[L.CFG_REFUSED_N] == 1 and row[L.CFG_REFUSED_BASE] == np.int64(other)


def test_only_a_members_chains_are_held() -> None:
    """A stranger's chain, a READ, an ALL_WRITE, a chain of coll_id 0 and a chain of a running
    collective go on at once (the datapath answers or executes them as before)."""
    batch = Batch()
    batch.start()
    others = [
        (chain(), STRANGER),
        (chain(opcode=Opcode.READ), PEER),
        (chain(opcode=Opcode.ALL_WRITE), PEER),
        (chain(coll=0), PEER),
        (chain(), PEER),  # its collective runs here
    ]
    assert batch.run(others, now=1.0) == [(d, endpoint_to_u64(s)) for d, s in others]
    assert L.early_count(batch.hold) == 0


def test_a_chain_held_too_long_goes_on_to_be_answered_busy() -> None:
    batch = Batch()
    batch.run([(chain(), PEER)], now=1.0)
    assert batch.run([], now=1.0 + L.EARLY_HOLD_S / 2) == []
    assert batch.run([], now=1.0 + L.EARLY_HOLD_S * 1.01) == [(chain(), endpoint_to_u64(PEER))]


def test_at_most_early_slots_are_held_the_rest_go_on() -> None:
    batch = Batch(slots=2 * L.EARLY_SLOTS)
    offered = [(chain(seq), PEER) for seq in range(L.EARLY_SLOTS + 3)]
    passed = batch.run(offered, now=1.0)
    assert [decode_packet(d).seq for d, _ in passed] == [
        L.EARLY_SLOTS,
        L.EARLY_SLOTS + 1,
        L.EARLY_SLOTS + 2,
    ]
    assert L.early_count(batch.hold) == L.EARLY_SLOTS


def test_a_node_holds_a_members_early_chain_and_answers_a_strangers_at_once() -> None:
    """Real node processes: a chain from a member's address for a collective the node never
    starts is answered BUSY only once it was held EARLY_HOLD_S; the same chain from an address
    outside the cluster is answered first, in the same batch."""
    member = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with member, stranger:
        member.bind(("127.0.0.1", 0))
        stranger.bind(("127.0.0.1", 0))
        member.settimeout(5.0)
        stranger.settimeout(5.0)
        with start_cluster(2, memory=1 << 20, extra_members=(member.getsockname(),)) as cluster:
            node = cluster.info.nodes[1].endpoint
            data = chain(to=node)
            sent = time.monotonic()
            member.sendto(data, node)
            stranger.sendto(data, node)
            first = decode_packet(stranger.recv(65536))
            assert (first.opcode, first.status) == (Opcode.NACK, Status.BUSY)
            held = decode_packet(member.recv(65536))
            waited = time.monotonic() - sent
    assert (held.opcode, held.status) == (Opcode.NACK, Status.BUSY)
    assert waited >= L.EARLY_HOLD_S, f"answered after {waited * 1e3:.2f} ms: not held"
