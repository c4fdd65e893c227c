"""A NIC that shares its process reads its socket only in its turn (netdam/shell/nic_host.py):
its collective timers cover the host loop's longest recent pass, so waiting for a turn is
never taken for loss (kernels.collective._rto_bounds), while a NIC alone in its process keeps
the plain bounds. On the in-process fabric, with a delay standing for the turns."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import make_cluster
from reference import all_reduce_reference
from test_collectives import run

from netdam.core.collective import CollectiveSlots
from netdam.core.faults import FaultSpec
from netdam.kernels import collective as L
from netdam.protocol import counters as C
from netdam.protocol.constants import ReduceOp
from netdam.shell.nic_host import BOARD_PERIOD_S, TURN_HALF_LIFE_S, NicHost
from netdam.shell.turns import TurnBoard

#: Every datagram 80 ms late: a 4-NIC chain's round trip (3 hops and the ACK) takes 320 ms,
#: past the plain RTO ceiling (RTO_MAX_S, 100 ms).
SLOW = FaultSpec(delay=1.0, delay_s=0.08, seed=3)


def _resent(turn_s: float) -> tuple[int, bool]:
    """Chains re-sent by a 4-NIC all-reduce whose every datagram waits SLOW's delay, with the
    NICs told their host's turn is *turn_s*; and whether the result was exact."""
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(3_000).astype(np.float32) for _ in range(4)]
    cluster = make_cluster(4, SLOW, memory=1 << 20)
    for node in cluster.nodes:
        node.collective.set_host_turn(turn_s)
    outcome = run(4, inputs, cluster=cluster, max_rounds=60_000)
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    exact = all(out.tobytes() == expected.tobytes() for out in outcome.outputs)
    return sum(int(node.counters[C.RETRANSMITS]) for node in cluster.nodes), exact


def test_timers_that_cover_the_turns_resend_nothing() -> None:
    plain, plain_exact = _resent(0.0)
    assert plain > 0 and plain_exact  # the plain bounds take the wait for loss (and recover)
    covered, covered_exact = _resent(0.1)  # 4 turns of 100 ms: past the 320 ms round trip
    assert covered == 0 and covered_exact


def test_the_bounds_follow_the_turn_and_running_timers_rise_with_it() -> None:
    slots = CollectiveSlots()
    row = slots.fcfg[0]
    assert L._rto_bounds(row) == (L.RTO_MIN_S, L.RTO_MAX_S)  # alone in its process
    row[L.F_RTO] = row[L.F_BASE_RTO] = 0.03  # a collective's timers, from its samples
    slots.set_host_turn(0.05)
    floor = L.HOST_TURNS_PER_RTO * 0.05
    assert L._rto_bounds(row) == pytest.approx((floor, 2 * floor))
    assert row[L.F_RTO] == row[L.F_BASE_RTO] == pytest.approx(floor)


class _Nic:
    def __init__(self) -> None:
        self.core = SimpleNamespace(collective=CollectiveSlots())


def test_the_host_loop_remembers_its_longest_pass_and_tells_its_nics() -> None:
    host = NicHost.__new__(NicHost)  # the turn bookkeeping only: no sockets
    host.nics = [_Nic(), _Nic()]
    host._start_turns(time.monotonic())
    host.board = None  # alone on the machine
    now = host._turn_at
    host._note_turn(0.2, now)
    host._note_turn(0.001, now + 0.01)  # a short pass forgets nothing yet
    assert host.turn_s == pytest.approx(0.2, rel=0.01)
    assert all(nic.core.collective.fcfg[0, L.F_HOST_TURN] == 0.2 for nic in host.nics)
    host._note_turn(0.001, now + 3 * TURN_HALF_LIFE_S)  # three half-lives later: an eighth
    assert host.turn_s == pytest.approx(0.2 / 8, rel=0.02)
    assert all(nic.core.collective.fcfg[0, L.F_HOST_TURN] == host.turn_s for nic in host.nics)


def test_the_nics_cover_the_longest_pass_of_any_process_of_the_machine(tmp_path: Path) -> None:
    """A chain's ACK may come from a NIC of another process, whose passes run longer (its row
    still reducing): the NICs' timers cover the longest pass any node process of the cluster on
    the machine published (netdam.shell.turns), not only their own process's."""
    members = (("127.0.0.1", 21100), ("127.0.0.1", 21101), ("127.0.0.1", 21102))
    host = NicHost.__new__(NicHost)
    host.nics = [_Nic(), _Nic()]
    host._start_turns(time.monotonic())
    host.board = TurnBoard.open(tmp_path, members, 3, 0)
    other = TurnBoard.open(tmp_path, members, 3, 2)  # the other process's
    assert host.board is not None and other is not None
    try:
        now = host._turn_at
        other.publish(0.15, now)  # its row reduces: 150 ms passes
        host._note_turn(0.002, now)  # this process's passes are short
        assert host.turn_s == pytest.approx(0.002)
        told = [nic.core.collective.fcfg[0, L.F_HOST_TURN] for nic in host.nics]
        assert told == [pytest.approx(0.15), pytest.approx(0.15)]
        assert other.longest(now, TURN_HALF_LIFE_S) == pytest.approx(0.15)  # ours is 0.002
        # The board is read at most every BOARD_PERIOD_S: a longer pass published meanwhile
        # reaches the NICs at the first pass after that.
        other.publish(0.4, now)
        host._note_turn(0.002, now + BOARD_PERIOD_S / 2)
        assert host.nics[0].core.collective.fcfg[0, L.F_HOST_TURN] == pytest.approx(0.15)
        host._note_turn(0.002, now + BOARD_PERIOD_S)
        told = [nic.core.collective.fcfg[0, L.F_HOST_TURN] for nic in host.nics]
        assert told == [pytest.approx(0.4, rel=0.01), pytest.approx(0.4, rel=0.01)]
    finally:
        other.close()
        host.board.close()
