"""Process groups (issue 25): ``new_group(ranks)`` with torch.distributed's semantics on 8 NICs,
groups of every size 2..8, overlapping and disjoint, their collectives in flight together, each
exact against numpy. All ranks live in this process (one ProcessGroup per rank), so every call
is started on every member (async) before any is waited on, in one order on every rank."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from helpers import rank_fixtures

from netdam import api
from netdam.protocol.constants import Opcode
from netdam.protocol.constants import ReduceOp as WireOp
from netdam.tools.allreduce import reference_chain_allreduce

WORLD = 8


cluster, ranks = rank_fixtures(WORLD)


def subgroups(ranks: list[api.ProcessGroup], members: list[int]) -> dict[int, api.ProcessGroup]:
    """Every cluster rank calls new_group (as torch requires); the members' groups, by rank."""
    made = {r: ranks[r].new_group(members) for r in range(WORLD)}
    for r, group in made.items():
        assert (group is api.NON_GROUP_MEMBER) == (r not in members)
    return {r: g for r, g in made.items() if isinstance(g, api.ProcessGroup)}


def test_groups_of_every_size_overlapping_and_disjoint_run_together(
    ranks: list[api.ProcessGroup],
) -> None:
    rng = np.random.default_rng(2508)
    shapes = [list(range(k)) for k in range(2, WORLD + 1)]  # overlapping: 0..k-1
    shapes += [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [1, 3, 5, 7],
        [6, 2, 4],
    ]  # disjoint pairs, odd, unsorted
    groups = [subgroups(ranks, members) for members in shapes]
    inputs = [
        {r: rng.standard_normal(3001 + 17 * i).astype(np.float32) for r in g}
        for i, g in enumerate(groups)
    ]
    bufs = [{r: x.copy() for r, x in per.items()} for per in inputs]
    works = [
        [api.all_reduce(bufs[i][r], group=g[r], async_op=True) for r in g]
        for i, g in enumerate(groups)
    ]
    for per in works:
        for work in per:
            work.wait()
    for i, members in enumerate(shapes):
        order = sorted(members)  # group rank k is the k-th smallest cluster rank
        assert [groups[i][r].rank for r in order] == list(range(len(order)))
        expected = reference_chain_allreduce([inputs[i][r] for r in order], WireOp.SUM).tobytes()
        assert all(buf.tobytes() == expected for buf in bufs[i].values()), f"group {members}"


def test_group_ranks_collectives_and_non_members(ranks: list[api.ProcessGroup]) -> None:
    """Ranks and sizes within the group; reduce-scatter and all-gather by group rank; a
    non-member's sentinel refuses collectives; new groups of the same members again move past
    the epochs the nodes ran (STALE_EPOCH), so no (coll_id, epoch) is reused."""
    members = [2, 5, 7]
    for _ in range(2):  # the same members twice: the second group counts from epoch 1 again
        group = subgroups(ranks, members)
        assert [api.get_rank(group[r]) for r in members] == [0, 1, 2]
        assert {api.get_world_size(g) for g in group.values()} == {3}
        n = 3 * 1000 + 2
        inputs = {r: np.arange(n, dtype=np.int64) * (k + 1) for k, r in enumerate(members)}
        outs = {r: np.zeros((k + 1) * n // 3 - k * n // 3, np.int64) for k, r in enumerate(members)}
        works = [
            api.reduce_scatter_tensor(outs[r], inputs[r], group=group[r], async_op=True)
            for r in members
        ]
        mine = {r: np.full(10, r, np.int32) for r in members}
        gathered = {r: np.zeros(30, np.int32) for r in members}
        works += [
            api.all_gather_into_tensor(gathered[r], mine[r], group=group[r], async_op=True)
            for r in members
        ]
        for work in works:
            work.wait()
        total = np.arange(n, dtype=np.int64) * 6
        for k, r in enumerate(members):
            assert outs[r].tolist() == total[k * n // 3 : (k + 1) * n // 3].tolist()
            assert gathered[r].tolist() == np.repeat(members, 10).tolist()
    outsider = ranks[0].new_group(members)
    assert outsider is api.NON_GROUP_MEMBER and api.get_rank(outsider) == -1
    with pytest.raises(ValueError, match="not a member of that group"):
        api.all_reduce(np.ones(4, np.float32), group=outsider)
    with pytest.raises(ValueError, match="distinct"):
        ranks[0].new_group([0, 0, 1])
    with pytest.raises(ValueError, match=r"0\.\.7"):
        ranks[0].new_group([0, 8])


def test_group_collectives_between_default_group_calls(ranks: list[api.ProcessGroup]) -> None:
    """The default group and a group interleave on the same NICs, in one issue order."""
    pair = subgroups(ranks, [3, 4])
    world_in = [np.full(100, r + 1, np.float64) for r in range(WORLD)]
    pair_in = {r: np.full(50, 10.0 * r) for r in pair}
    works = [api.all_reduce(world_in[r], group=ranks[r], async_op=True) for r in range(WORLD)]
    works += [api.all_reduce(pair_in[r], group=pair[r], async_op=True) for r in pair]
    works += [api.all_reduce(world_in[r], group=ranks[r], async_op=True) for r in range(WORLD)]
    for work in works:
        work.wait()
    assert all(x.tolist() == [36.0 * WORLD] * 100 for x in world_in)
    assert all(x.tolist() == [70.0] * 50 for x in pair_in.values())


#: The watchdog of the lost-START_COLL test: the re-send (0.5 s) must come well within it.
WATCHDOG_S = 1.5


class _LosesFirstStart:
    """A rank's control socket whose first START_COLL never leaves (as if lost on the way)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.lost = 0

    def sendto(self, data: bytes, where: object) -> int:
        if data[1] == Opcode.START_COLL and not self.lost:
            self.lost += 1
            return len(data)
        return self._sock.sendto(data, where)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_a_lost_start_coll_is_sent_again_while_its_host_computes(
    ranks: list[api.ProcessGroup],
) -> None:
    """Rank 5's START_COLL is lost and its host computes for longer than the watchdog before
    it waits: the rank's progress thread sends it again, so its peers' nodes are not left
    waiting on its node until they time out, and every rank's result is exact."""
    quiet = ranks[5]
    lossy = _LosesFirstStart(quiet.client.sock)
    quiet.client.sock = lossy
    for group in ranks:
        group.timeout_s = WATCHDOG_S
    try:
        bufs = [np.full(4096, r + 1, np.int32) for r in range(WORLD)]
        works = [api.all_reduce(bufs[r], group=ranks[r], async_op=True) for r in range(WORLD)]
        peers = [threading.Thread(target=works[r].wait) for r in range(WORLD) if r != 5]
        for thread in peers:
            thread.start()
        time.sleep(WATCHDOG_S + 0.5)  # rank 5's host is busy elsewhere
        for thread in peers:
            thread.join()
        for work in works:
            work.wait()
    finally:
        quiet.client.sock = lossy._sock
        for group in ranks:
            group.timeout_s = None
    assert lossy.lost == 1
    total = WORLD * (WORLD + 1) // 2
    assert all(buf.tolist() == [total] * 4096 for buf in bufs)
