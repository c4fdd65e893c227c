"""The NICs' compiled serve loop (netdam.kernels.serve.NicLoop): a process's NICs visited in one
call; arguments typed by numba's dispatcher once (which refuses a mismatch), then the compiled
entry called directly while they are the same objects; the owners' bundles stay the same
objects until an array in them is replaced (netdam.kernels.state.Kept)."""

from __future__ import annotations

import operator
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdam.core.sendqueue import SLOT_BYTES
from netdam.kernels import collective as L
from netdam.kernels import serve
from netdam.kernels import udp_io as U
from netdam.kernels.state import Kept, Regions, TxQueue
from netdam.kernels.wire import find_rkey
from netdam.protocol import counters as C
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet, encode_packet
from netdam.shell.node_process import NodeProcess, NodeProcessConfig, ServeBuffers


class _CountingDispatcher:
    """Stands in for a jitted function: counts the calls that go through numba's dispatcher."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0
        self.overloads = real.overloads

    def __call__(self, *args: object) -> object:
        self.calls += 1
        return self.real(*args)


@pytest.fixture
def nic(tmp_path: Path) -> Any:
    process = NodeProcess(
        NodeProcessConfig(memory_bytes=1 << 20, bind=("127.0.0.1", 0), shm_dir=tmp_path)
    )
    yield process
    process.close()


def _nics_of_one_batch(tmp_path: Path, count: int) -> tuple[ServeBuffers, list[NodeProcess]]:
    """*count* NICs receiving into one shared batch, as a node process's NICs do."""
    buffers = ServeBuffers.new()
    nics = [
        NodeProcess(
            NodeProcessConfig(
                memory_bytes=1 << 20, bind=("127.0.0.1", 0), shm_dir=tmp_path, name=f"n{k}"
            ),
            buffers,
        )
        for k in range(count)
    ]
    return buffers, nics


def test_kept_makes_a_bundle_again_only_when_a_part_is_another_object() -> None:
    kept: Kept[TxQueue] = Kept()
    a, b, c, d = (np.zeros(4, np.uint8), np.zeros(2), np.zeros(1), np.zeros(1))
    slot = SLOT_BYTES
    first = kept.of(TxQueue, a, b, c, d, slot)
    assert kept.of(TxQueue, a, b, c, d, slot) is first
    replaced = kept.of(TxQueue, a, b, c, np.zeros(1), slot)  # equal contents, another array
    assert replaced is not first and replaced[3] is not d
    assert kept.of(TxQueue, a, b, c, replaced[3], slot) is replaced


def test_the_owners_hand_out_the_same_bundles_until_an_array_is_replaced(nic: Any) -> None:
    core = nic.core
    state, tx = core.node_state(), core.tx_bundle()
    assert core.node_state() is state and core.tx_bundle() is tx
    assert core.collective.state() is state.coll
    core.set_members([("127.0.0.1", 9), nic.endpoint])  # replaces the members array
    moved = core.node_state()
    assert moved is not state and moved.members is not state.members
    assert moved.regions is state.regions  # the unchanged parts are the same bundles
    core.reserve(8 * tx.len.shape[0])  # the send queue grows: new arrays
    assert core.tx_bundle() is not tx


def test_same_arguments_skip_the_dispatcher_and_a_mismatch_is_refused(
    nic: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone NIC's serve_once: its loop types its arguments once (one put through the
    dispatcher, one loop call through it) and then enters the compiled loop directly; a
    wrongly typed bundle is refused by the dispatcher, and the arguments known before stay."""
    puts = _CountingDispatcher(serve._put_nic)
    calls = _CountingDispatcher(serve._serve_nics)
    monkeypatch.setattr(serve, "_put_nic", puts)
    monkeypatch.setattr(serve, "_serve_nics", calls)
    for _ in range(50):
        assert nic.serve_once(0, 1, control=False) == serve.RETURN_IDLE
    assert (puts.calls, calls.calls) == (1, 1)
    assert all(map(operator.is_, nic.serve_args(0, 1), nic.serve_args(0, 1)))
    loop = serve.NicLoop(nic.rx, nic.punt)
    loop.put(0, nic.serve_args(0, 1))
    # A NodeState whose rkey table has the wrong dtype: the entry point would have read the
    # uint64 keys as uint32; the dispatcher has no such signature and refuses it.
    io, rx, faults, state, guard, tx, txq, punt = nic.serve_args(0, 1)
    wrong = state._replace(regions=Regions(*(np.zeros(r.shape, np.uint64) for r in state.regions)))
    with pytest.raises(TypeError, match="not of the types"):
        loop.put(0, (io, rx, faults, wrong, guard, tx, txq, punt))
    assert puts.calls == 3
    report = np.zeros((1, serve.OUT_COLUMNS), np.int64)
    assert loop.serve(np.zeros(1, np.int64), 0, report) == 1  # still the right arguments
    # The bounds are checked when arguments are given, and the queue's ends at every visit.
    txq[1] = tx.len.shape[0]
    with pytest.raises(ValueError, match="send queue"):
        serve.NicLoop(nic.rx, nic.punt).put(0, nic.serve_args(0, 1))
    with pytest.raises(ValueError, match="NIC 0: send queue"):
        loop.serve(np.zeros(1, np.int64), 0, report)
    txq[1] = 0


def test_a_nic_loop_serves_its_nics_in_one_call_and_refuses_what_it_cannot_trust(
    tmp_path: Path,
) -> None:
    """serve.NicLoop: two NICs sharing one receive batch, visited by one compiled call; each
    takes its own datagrams. A NIC that does not share the batch, an order or a report out of
    bounds, or arguments of other types are refused before any compiled code runs; a NIC whose
    send queue's ends are bad is not served, and the report says so."""
    buffers, nics = _nics_of_one_batch(tmp_path, 2)
    alone = NodeProcess(
        NodeProcessConfig(memory_bytes=1 << 20, bind=("127.0.0.1", 0), shm_dir=tmp_path, name="x")
    )
    try:
        loop = serve.NicLoop(nics[0].rx, buffers.punt)
        for k, nic in enumerate(nics):
            loop.put(k, nic.loop_args(4))
        report = np.zeros((2, serve.OUT_COLUMNS), np.int64)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(3):
                sock.sendto(b"not a netdam datagram", nics[1].endpoint)
            time.sleep(0.05)
        assert loop.serve(np.array([0, 1], np.int64), 0, report) == 2
        assert report[:, serve.OUT_REASON].tolist() == [serve.RETURN_IDLE] * 2  # drained
        assert [int(nic.core.counters[C.RX_PACKETS]) for nic in nics] == [0, 3]
        with pytest.raises(ValueError, match="shared batch"):
            loop.put(2, alone.loop_args(4))
        with pytest.raises(ValueError, match="outside the loop"):
            loop.serve(np.array([0, 2], np.int64), 0, report)
        with pytest.raises(ValueError, match="start"):
            loop.serve(np.array([0], np.int64), 2, report)
        with pytest.raises(ValueError, match="rows"):
            loop.serve(np.array([0], np.int64), 0, report[:1])
        args = list(nics[1].loop_args(4))
        state = args[3]
        args[3] = state._replace(
            regions=Regions(*(np.zeros(r.shape, np.uint64) for r in state.regions))
        )
        with pytest.raises(TypeError, match="not of the types"):
            loop.put(1, tuple(args))  # type: ignore[arg-type]
        # A collective running on NIC 0 under a key of its own, whose watchdog has long run
        # out: the visit fails it and no clock runs; its key outlives it by one round and goes
        # in the loop's next round (restart.drop_ended_keys), with no Python.
        core = nics[0].core
        slots = core.collective
        slots.cfg[0, L.CFG_STATE] = L.STATE_RUNNING
        slots.fcfg[0, [L.F_START, L.F_LAST_ADVANCE, L.F_DEADLINE]] = (1.0, 1.0, 0.001)
        slots.cfg[0, [L.CFG_SPAN_LO, L.CFG_SPAN_HI, L.CFG_CKEY, L.CFG_CKEY_RIGHTS]] = (
            0,
            64,
            0x77,
            3,
        )
        core._install_rkey(0x77, (0, 64, 3))
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
        assert slots.cfg[0, L.CFG_STATE] == L.STATE_FAILED
        assert report[0, serve.OUT_CLOCK] == 0 and 0x77 in core._keys()
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
        assert 0x77 not in core._keys() and find_rkey(core._rk_key, 0x77) == -1
        slots.cfg[0, L.CFG_STATE] = L.STATE_RUNNING  # running, and nothing fails it yet
        slots.fcfg[0, L.F_DEADLINE] = 1e9
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
        assert report[0, serve.OUT_CLOCK] == 1
        slots.cfg[0, L.CFG_STATE] = L.STATE_FAILED
        txq = nics[1].core.tx_queue
        txq[1] = nics[1].core.tx_bundle().len.shape[0]  # the tail past the last slot
        report[:] = -1
        with pytest.raises(ValueError, match="NIC 1: send queue"):
            loop.serve(np.array([0, 1], np.int64), 0, report)
        assert report[:, serve.OUT_REASON].tolist() == [serve.RETURN_IDLE, serve.RETURN_BAD_QUEUE]
        txq[1] = 0
    finally:
        for nic in (*nics, alone):
            nic.close()


def test_a_visit_reads_a_socket_again_only_when_its_last_batch_was_full(nic: Any) -> None:
    """A round reads a socket again at once only when its batch came back full: three datagrams
    take one receive call where the visit used to make a second that found nothing, and 100
    datagrams of mixed sizes (one per 64 KiB receive slot: 32 a round) are all taken in the
    same visit, each full round reading again."""
    loop = serve.NicLoop(nic.rx, nic.buffers.punt)
    loop.put(0, nic.loop_args(8))
    report = np.zeros((1, serve.OUT_COLUMNS), np.int64)
    state = nic.io_state
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(3):
            sock.sendto(b"not a netdam datagram", nic.endpoint)
        time.sleep(0.05)
        calls = int(state[U.ST_RECV_CALLS])
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
        assert int(nic.core.counters[C.RX_PACKETS]) == 3
        assert int(state[U.ST_RECV_CALLS]) - calls == 1
        for k in range(100):
            sock.sendto(b"x" * (8 + k % 3), nic.endpoint)  # sizes that GRO does not coalesce
        time.sleep(0.1)
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
    assert int(nic.core.counters[C.RX_PACKETS]) == 103
    assert report[0, serve.OUT_REASON] == serve.RETURN_IDLE  # drained within the visit


def test_a_sweep_takes_a_hop_between_nics_of_the_loop_in_the_same_call(tmp_path: Path) -> None:
    """serve._serve_nics sweeps again after a call in which a few datagrams moved: NIC 0's
    NACK to a READ (of a key it does not hold) that NIC 1's socket sent is taken by NIC 1 in
    the same call (NIC 1 is not in the order: the sweep polls every NIC of the loop). NIC 1
    punts it, as an answer to no request of its own, and the report says NIC 1 was swept, so
    that its control plane runs after the call. A call in which nothing moved sweeps nothing,
    and its report clears the flags."""
    buffers, nics = _nics_of_one_batch(tmp_path, 2)
    try:
        loop = serve.NicLoop(nics[0].rx, buffers.punt)
        for k, nic in enumerate(nics):
            loop.put(k, nic.loop_args(4))
        report = np.zeros((2, serve.OUT_COLUMNS), np.int64)
        read = Packet(opcode=Opcode.READ, client_id=1, txn_id=9, rkey=12345, length=8)
        nics[1].sock.sendto(encode_packet(read), nics[0].endpoint)
        time.sleep(0.05)
        assert loop.serve(np.array([0], np.int64), 0, report) == 1
        assert [int(nic.core.counters[C.RX_PACKETS]) for nic in nics] == [1, 1]
        assert [int(nic.core.counters[C.TX_PACKETS]) for nic in nics] == [1, 0]
        assert report[:, serve.OUT_SWEPT].tolist() == [0, 1]
        assert report[1, serve.OUT_REASON] == serve.RETURN_PUNT and report[1, serve.OUT_PUNT] == 1
        nics[1].after_visit(serve.RETURN_PUNT, 1, False, False)  # as NicHost does
        assert loop.serve(np.array([0, 1], np.int64), 0, report) == 2
        assert report[:, serve.OUT_SWEPT].tolist() == [0, 0]
        assert [int(nic.core.counters[C.RX_PACKETS]) for nic in nics] == [1, 1]
    finally:
        for nic in nics:
            nic.close()


def test_a_busy_visit_gives_way_to_management_traffic_within_a_millisecond(nic: Any) -> None:
    """A visit whose every round takes datagrams never waits on the poll that includes the
    management socket; it looks at that socket once per serve.CONTROL_LOOK_NS instead, so a
    stats request under a flood is not kept for the call's rounds. 20,000 queued datagrams
    (each ~0.3 us or more to take and drop: several milliseconds) and one request on the
    management port: a call allowed a million rounds returns with datagrams still queued and
    leaves the request for the control plane; the next call, with none, takes the rest."""
    loop = serve.NicLoop(nic.rx, nic.buffers.punt)
    loop.put(0, nic.loop_args(1_000_000))
    report = np.zeros((1, serve.OUT_COLUMNS), np.int64)
    count = 20_000
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for k in range(count):
            sock.sendto(b"x" * (100 + k % 3), nic.endpoint)  # sizes GRO does not coalesce
        sock.sendto(b"stats?", (nic.endpoint[0], nic.control_port))
        time.sleep(0.05)
        loop.serve(np.array([0], np.int64), 0, report)
        taken = int(nic.core.counters[C.RX_PACKETS])
        assert report[0, serve.OUT_REASON] == serve.RETURN_ROUNDS
        assert nic.ctrl_sock.recv(64) == b"stats?"  # left for the control plane
        loop.serve(np.array([0], np.int64), 0, report)
    assert report[0, serve.OUT_REASON] == serve.RETURN_IDLE
    queued = int(nic.core.counters[C.RX_PACKETS])  # what the receive buffer held: all of it
    assert queued + int(nic.io_state[U.ST_KERNEL_DROPS]) == count
    assert queued > 5_000, "the receive buffer held too few to keep a visit busy"
    assert 0 < taken < queued
