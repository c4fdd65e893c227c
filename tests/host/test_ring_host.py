"""The ring-host baseline (netdam/clients/ring_host.py) on real node processes: the RoCE way of
registering memory (the NIC reads the caller's input where it lies; only what the NICs wrote is
in node memory), bitwise the chain's result."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import pytest
from helpers import rank_fixtures
from reference import all_reduce_reference

from netdam.clients import ring_host
from netdam.clients.ring_host import RECEIVE_ALIGN, ring_all_reduce
from netdam.protocol.constants import Opcode, ReduceOp
from netdam.protocol.packet import Packet, encode_packet
from netdam.protocol.payloads import pack_ring_step

WORLD = 3
cluster, ranks = rank_fixtures(WORLD)
#: Elements per rank: three blocks of one segment each, the last block one element longer.
COUNT = 30_001
#: What the staging half of node memory holds before a call, to see what the call wrote there.
SENTINEL = 0xA5


def _inputs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(COUNT).astype(np.float32) for _ in range(WORLD)]


def _block(j: int) -> slice:
    return slice(j * COUNT // WORLD, (j + 1) * COUNT // WORLD)


def test_a_plain_array_is_read_where_it_lies_and_only_what_nics_wrote_is_copied_out(
    ranks: list[Any],
) -> None:
    inputs = _inputs(1)
    bufs = [x.copy() for x in inputs]
    staged = [
        g.memory[g.staging_base : g.staging_base + 2 * COUNT * 4 + RECEIVE_ALIGN] for g in ranks
    ]
    for area in staged:
        area[:] = SENTINEL
    result = ring_all_reduce(ranks, bufs, ReduceOp.SUM)
    expected = all_reduce_reference(inputs, int(ReduceOp.SUM))
    for buf in bufs:
        assert buf.tobytes() == expected.tobytes()  # bitwise the chain's, on every rank
    assert result.host_copy_bytes == COUNT * 4  # each owner's block, once
    for rank, area in enumerate(staged):
        out = area[: COUNT * 4].view(np.float32)
        for j in range(WORLD):
            if j == rank:  # the owner's sum went to the caller's array; no input was staged
                assert (area[_block(j).start * 4 : _block(j).stop * 4] == SENTINEL).all()
            else:  # the all-gather's WRITEs, from the previous NIC, then copied out
                assert out[_block(j)].tobytes() == expected[_block(j)].tobytes()


def test_a_nic_resident_array_is_reduced_in_place(ranks: list[Any]) -> None:
    inputs = _inputs(2)
    bufs = [g.empty(COUNT, np.float32) for g in ranks]
    for buf, x in zip(bufs, inputs, strict=True):
        buf[...] = x
    ring_all_reduce(ranks, bufs, ReduceOp.MAX)
    expected = all_reduce_reference(inputs, int(ReduceOp.MAX))
    assert all(buf.tobytes() == expected.tobytes() for buf in bufs)


def test_a_strided_array_is_refused_before_anything_is_sent(ranks: list[Any]) -> None:
    """The last rank's array is strided: refused, and the sockets the ranks before it opened
    are closed again."""
    bufs = [np.zeros(COUNT, np.float32) for _ in range(WORLD - 1)]
    bufs.append(np.zeros(2 * COUNT, np.float32)[::2])
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="C-contiguous") as refused:
        ring_all_reduce(ranks, bufs, ReduceOp.SUM)
    # Closed by the refusal itself, not by the garbage collector: the traceback still holds
    # every frame (and so every host made) while this is checked.
    assert refused.traceback and len(os.listdir("/proc/self/fd")) == open_before


def test_step_words_and_acks_from_another_local_socket_are_dropped(ranks: list[Any]) -> None:
    """Who may send to a ring host: its next node (ACKs, NACKs) and its previous host (step
    words). An unprivileged local process is neither (it cannot forge a loopback source
    address): before the ring starts it sends every host a step word for every step and an ACK
    for every WRITE the host will post. Believed, they would let a host reduce a segment before
    its data came and tell the next host early; they are dropped and counted, and the result is
    exact."""
    inputs = _inputs(3)
    bufs = [x.copy() for x in inputs]
    hosts = ring_host._ring_hosts(ranks, bufs, ReduceOp.SUM)
    steps = 2 * WORLD - 2
    acks = 3 * (COUNT * 4 // WORLD // 8000 + 1)  # more than a host's WRITEs
    ack = encode_packet(Packet(Opcode.ACK, txn_id=1))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
        forger.bind(("127.0.0.1", 0))
        for host in hosts:
            for step in range(steps):
                forger.sendto(pack_ring_step(step, 0), host.address)
            for _ in range(acks):
                forger.sendto(ack, host.address)
    result = ring_host._run(hosts, 30.0)
    expected = all_reduce_reference(inputs, int(ReduceOp.SUM))
    assert all(buf.tobytes() == expected.tobytes() for buf in bufs)
    assert result.ignored == WORLD * (steps + acks)
