"""The host API in torch.distributed's words (issue 17): init_process_group (env:// and
file://), is_initialized, the flat *_tensor forms and the list forms, ReduceOp.AVG and
PRODUCT, barrier(async_op=), CPU torch tensors in place of numpy
arrays. Every result against a numpy oracle; all ranks live in this process, so each call is
started on every rank (async) before any is waited on."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import rank_fixtures

import netdam
from netdam import api
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.kernels.collective import TAKEN_SLOTS
from netdam.protocol import counters as C
from netdam.protocol.constants import ReduceOp as WireOp
from netdam.protocol.elements import bf16_round, bf16_values
from netdam.tools.allreduce import reference_chain_allreduce

WORLD = 3


cluster, groups = rank_fixtures(WORLD)


def on_every_rank(
    groups: list[api.ProcessGroup], call: Callable[[api.ProcessGroup, int], Any]
) -> None:
    works = [call(group, rank) for rank, group in enumerate(groups)]
    for work in works:
        work.wait()


@pytest.mark.slow
def test_avg_is_the_sum_divided_bitwise_identical(groups: list[api.ProcessGroup]) -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(5000).astype(np.float32) for _ in range(WORLD)]
    bufs = [x.copy() for x in inputs]
    on_every_rank(
        groups, lambda g, r: api.all_reduce(bufs[r], op=api.ReduceOp.AVG, group=g, async_op=True)
    )
    expected = reference_chain_allreduce(inputs, WireOp.SUM) / np.float32(WORLD)
    for buf in bufs:
        assert buf.tobytes() == expected.astype(np.float32).tobytes()


def test_avg_of_integers_is_refused_with_the_reason(groups: list[api.ProcessGroup]) -> None:
    with pytest.raises(ValueError, match="floating dtype"):
        api.all_reduce(np.ones(4, np.int32), op=api.ReduceOp.AVG, group=groups[0])
    assert int(api.ReduceOp.SUM) == int(WireOp.SUM) and int(api.ReduceOp.MAX) == int(WireOp.MAX)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_product_is_the_rank_order_product_bitwise_identical(
    groups: list[api.ProcessGroup], dtype: type
) -> None:
    """PRODUCT (no multiply on the wire): an all-gather, then every host multiplies in rank
    order; all_reduce and reduce_scatter_tensor against numpy, integers wrapping as numpy's do."""
    rng = np.random.default_rng(7)
    n = 3001  # blocks of unequal size in reduce_scatter
    if np.dtype(dtype).kind == "f":
        inputs = [rng.uniform(0.5, 1.5, n).astype(dtype) for _ in range(WORLD)]
    else:
        inputs = [rng.integers(-50_000, 50_000, n).astype(dtype) for _ in range(WORLD)]
    expected = inputs[0].copy()
    for x in inputs[1:]:
        expected = expected * x  # rank order, as the hosts do
    bufs = [x.copy() for x in inputs]
    on_every_rank(
        groups,
        lambda g, r: api.all_reduce(bufs[r], op=api.ReduceOp.PRODUCT, group=g, async_op=True),
    )
    for buf in bufs:
        assert buf.tobytes() == expected.tobytes()
    outs = [np.empty((r + 1) * n // WORLD - r * n // WORLD, dtype) for r in range(WORLD)]
    on_every_rank(
        groups,
        lambda g, r: api.reduce_scatter_tensor(
            outs[r], inputs[r], op=api.ReduceOp.PRODUCT, group=g, async_op=True
        ),
    )
    for r, out in enumerate(outs):
        assert out.tobytes() == expected[r * n // WORLD : (r + 1) * n // WORLD].tobytes()


def test_flat_and_list_forms(groups: list[api.ProcessGroup]) -> None:
    n = 4 * WORLD
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(WORLD)]
    total = reference_chain_allreduce(inputs, WireOp.SUM)
    # reduce_scatter_tensor (flat) and reduce_scatter (list of world tensors).
    outs = [np.empty(4, np.float32) for _ in range(WORLD)]
    on_every_rank(
        groups,
        lambda g, r: api.reduce_scatter_tensor(outs[r], inputs[r].copy(), group=g, async_op=True),
    )
    for r, out in enumerate(outs):
        assert out.tobytes() == total[4 * r : 4 * r + 4].tobytes()
    lists = [[x[4 * k : 4 * k + 4].copy() for k in range(WORLD)] for x in inputs]
    outs2 = [np.empty(4, np.float32) for _ in range(WORLD)]
    on_every_rank(
        groups, lambda g, r: api.reduce_scatter(outs2[r], lists[r], group=g, async_op=True)
    )
    assert [o.tobytes() for o in outs2] == [o.tobytes() for o in outs]
    # all_gather_into_tensor (flat) and all_gather (list).
    mine = [np.full(4, r + 1, np.float32) for r in range(WORLD)]
    flats = [np.empty(4 * WORLD, np.float32) for _ in range(WORLD)]
    on_every_rank(
        groups, lambda g, r: api.all_gather_into_tensor(flats[r], mine[r], group=g, async_op=True)
    )
    expected = np.concatenate(mine)
    assert all(f.tobytes() == expected.tobytes() for f in flats)
    got = [[np.empty(4, np.float32) for _ in range(WORLD)] for _ in range(WORLD)]
    on_every_rank(groups, lambda g, r: api.all_gather(got[r], mine[r], group=g, async_op=True))
    for lst in got:
        assert [t.tobytes() for t in lst] == [m.tobytes() for m in mine]
    with pytest.raises(ValueError, match="must hold 3 tensors"):
        api.all_gather([np.empty(4, np.float32)], mine[0], group=groups[0])


def test_barrier_async(groups: list[api.ProcessGroup]) -> None:
    on_every_rank(groups, lambda g, r: api.barrier(group=g, async_op=True))


def test_torch_cpu_tensors_are_reduced_in_place(groups: list[api.ProcessGroup]) -> None:
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(WORLD)]
    on_every_rank(groups, lambda g, r: api.all_reduce(tensors[r], group=g, async_op=True))
    expected = torch.arange(6, dtype=torch.float32) * sum(range(1, WORLD + 1))
    assert all(torch.equal(t, expected) for t in tensors)
    with pytest.raises(ValueError, match="not contiguous"):
        api.all_reduce(torch.zeros(4, 4).t(), group=groups[0])


def test_four_collectives_in_flight_per_group_each_exact(groups: list[api.ProcessGroup]) -> None:
    """Every rank starts four all-reduces (host arrays, so each is staged in NIC memory) before
    waiting on any, then a broadcast and an all-gather: each call keeps its own staging room
    while in flight and its own completion, and all are exact, completed in issue order."""
    rng = np.random.default_rng(44)
    sizes = (5_003, 40_000, 17, 70_001)
    inputs = [[rng.standard_normal(n).astype(np.float32) for _ in range(WORLD)] for n in sizes]
    bufs = [[x.copy() for x in per_rank] for per_rank in inputs]
    cast = [
        rng.standard_normal(999).astype(np.float32) if r == 1 else np.zeros(999, np.float32)
        for r in range(WORLD)
    ]
    mine = [np.full(333, r, np.int32) for r in range(WORLD)]
    gathered = [np.zeros(333 * WORLD, np.int32) for _ in range(WORLD)]
    works = []
    for rank, g in enumerate(groups):
        works.append(
            [api.all_reduce(bufs[k][rank], group=g, async_op=True) for k in range(len(sizes))]
            + [
                api.broadcast(cast[rank], src=1, group=g, async_op=True),
                api.all_gather_into_tensor(gathered[rank], mine[rank], group=g, async_op=True),
            ]
        )
    for per_rank in works:
        for work in per_rank:
            work.wait()
    for k in range(len(sizes)):
        expected = reference_chain_allreduce(inputs[k], WireOp.SUM).tobytes()
        assert all(buf.tobytes() == expected for buf in bufs[k]), (
            f"all-reduce {k} of {sizes[k]} elements"
        )
    assert all(c.tobytes() == cast[1].tobytes() for c in cast)
    assert all(out.tolist() == np.repeat(np.arange(WORLD), 333).tolist() for out in gathered)


@pytest.mark.slow
def test_collectives_in_flight_stay_exact_under_loss() -> None:
    """Four all-reduces of each of three ranks in flight at once on nodes that drop 15% and
    duplicate 5% of what they receive (seeded): every one exact, in issue order."""
    with start_cluster(
        WORLD, memory=4 << 20, faults=FaultSpec(loss=0.15, dup=0.05, seed=25)
    ) as lossy:
        made = [api.ProcessGroup(lossy.info, rank) for rank in range(WORLD)]
        try:
            rng = np.random.default_rng(15)
            inputs = [
                [rng.standard_normal(20_000 + 7 * k).astype(np.float32) for _ in range(WORLD)]
                for k in range(4)
            ]
            bufs = [[x.copy() for x in per_rank] for per_rank in inputs]
            works = [
                [api.all_reduce(bufs[k][r], group=g, async_op=True) for r, g in enumerate(made)]
                for k in range(4)
            ]
            for per_call in works:
                for work in per_call:
                    work.wait()
            for k in range(4):
                expected = reference_chain_allreduce(inputs[k], WireOp.SUM).tobytes()
                assert all(buf.tobytes() == expected for buf in bufs[k])
            assert (
                sum(w.stats["retransmits"] + w.stats["repair_reads"] for per in works for w in per)
                > 0
            )
        finally:
            for group in made:
                group.close()


def _half_inputs(dtype: str, n: int) -> list[np.ndarray]:
    """Every rank's f16 or bf16 input: ordinary values, and in a tenth of the places an edge of
    the format (zeros of both signs, subnormals, the largest finite, infinities, NaNs)."""
    rng = np.random.default_rng(1625)
    if dtype == "f16":
        specials = np.array(
            [0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01], np.uint16
        )
        ordinary = [
            (rng.standard_normal(n) * 100).astype(np.float16).view(np.uint16) for _ in range(WORLD)
        ]
        marked = np.dtype(np.float16)
    else:
        specials = np.array(
            [0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1], np.uint16
        )
        ordinary = [
            bf16_round((rng.standard_normal(n) * 100).astype(np.float32)) for _ in range(WORLD)
        ]
        marked = api.bfloat16
    for x in ordinary:
        where = rng.random(n) < 0.1
        x[where] = rng.choice(specials, int(where.sum()))
    return [x.view(marked) for x in ordinary]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("op", [WireOp.SUM, WireOp.MIN, WireOp.MAX])
def test_half_precision_reductions_are_the_reference_bitwise(
    groups: list[api.ProcessGroup], dtype: str, op: WireOp
) -> None:
    """f16 and bf16 SUM, MIN and MAX in the NICs, every hop rounding by SPEC.md 2.4, against the
    numpy reference folded in chain order, on every rank, bit for bit."""
    inputs = _half_inputs(dtype, 30_011)  # several chunks per block, blocks of unequal size
    bufs = [x.copy() for x in inputs]
    on_every_rank(groups, lambda g, r: api.all_reduce(bufs[r], op=int(op), group=g, async_op=True))
    expected = reference_chain_allreduce(inputs, op).tobytes()
    assert all(buf.tobytes() == expected for buf in bufs)


def test_bf16_avg_product_and_torch_tensors(groups: list[api.ProcessGroup]) -> None:
    """bf16 through the rest of the API: AVG divides in f32 and rounds once, PRODUCT multiplies
    in rank order rounding each product, and torch.bfloat16 tensors are reduced in place, 2
    bytes an element, as torch's own bf16 adds would."""
    inputs = [
        bf16_round(np.linspace(-3, 3, 999, dtype=np.float32) * (r + 1)).view(api.bfloat16)
        for r in range(WORLD)
    ]
    bufs = [x.copy() for x in inputs]
    on_every_rank(
        groups, lambda g, r: api.all_reduce(bufs[r], op=api.ReduceOp.AVG, group=g, async_op=True)
    )
    total = reference_chain_allreduce(inputs, WireOp.SUM)
    expected = bf16_round(bf16_values(total) / np.float32(WORLD))
    assert all(buf.tobytes() == expected.tobytes() for buf in bufs)
    bufs = [x.copy() for x in inputs]
    on_every_rank(
        groups,
        lambda g, r: api.all_reduce(bufs[r], op=api.ReduceOp.PRODUCT, group=g, async_op=True),
    )
    product = inputs[0].view(np.uint16)
    for x in inputs[1:]:
        product = bf16_round(bf16_values(product) * bf16_values(x.view(np.uint16)))
    assert all(buf.tobytes() == product.tobytes() for buf in bufs)
    torch = pytest.importorskip("torch")
    tensors = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) for x in inputs]
    on_every_rank(groups, lambda g, r: api.all_reduce(tensors[r], group=g, async_op=True))
    assert all(t.view(torch.int16).numpy().tobytes() == total.tobytes() for t in tensors)
    # Block 0 folds ranks 1, 2, 0: torch's own bf16 adds in that order give the same bits.
    block = slice(0, 999 // WORLD)
    as_torch = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) for x in inputs]
    by_torch = (as_torch[1][block] + as_torch[2][block]) + as_torch[0][block]
    assert torch.equal(tensors[0][block], by_torch)


def test_the_host_api_times_its_own_part_of_each_all_reduce(groups: list[api.ProcessGroup]) -> None:
    """``Work.host_overhead``: the API's seconds from the call to START_COLL leaving and from
    the completion to the wait's return, staging copies excluded; only for all_reduce, and
    only once a wait returned."""
    bufs = [np.ones(1000, np.float32) for _ in groups]
    works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs, strict=True)]
    assert all(w is not None and w.host_overhead() is None for w in works)  # no wait yet
    for work in works:
        assert work is not None
        work.wait()
        overhead = work.host_overhead()
        assert overhead is not None
        issue, back = overhead
        assert work.called_at is not None and work.finished_at is not None
        assert 0.0 <= issue <= work.sent_at - work.called_at
        assert work.wait_at is not None and 0.0 <= back <= work.finished_at - work.wait_at
    gathered = api.broadcast(np.ones(10, np.float32), group=groups[0], async_op=True)
    others = [api.broadcast(np.ones(10, np.float32), group=g, async_op=True) for g in groups[1:]]
    for work in [gathered, *others]:
        assert work is not None
        work.wait()
    assert gathered is not None and gathered.host_overhead() is None  # not recorded: not timed


def test_each_shape_of_call_gets_its_own_start_coll(groups: list[api.ProcessGroup]) -> None:
    """A group's next call of the same shape writes its epoch, txn_id and keys into the last
    START_COLL's bytes (protocol.packet.StartCollTemplate); a call of another count, op, dtype
    or algorithm builds its own. Mixed calls, each against numpy on every rank: a START_COLL
    left with another call's fields would reduce the wrong count, op or type, or time out."""
    world = len(groups)
    # Each shape differs from the one before it in one field: count, op, dtype.
    shapes = (
        (1000, np.float32, api.ReduceOp.SUM),
        (400, np.float32, api.ReduceOp.SUM),
        (400, np.float32, api.ReduceOp.MAX),
        (400, np.int32, api.ReduceOp.MAX),
    )
    built = []
    for k in range(3):
        for count, dtype, op in shapes:
            for repeat in range(2):  # the second call of a shape keeps the first's template
                bufs = [
                    (np.arange(count) * (r + 1) + k + repeat).astype(dtype) for r in range(world)
                ]
                reduce = np.sum if op == api.ReduceOp.SUM else np.max
                want = reduce(bufs, axis=0).astype(dtype)
                on_every_rank(
                    groups,
                    lambda g, r, b=bufs, o=op: api.all_reduce(b[r], op=o, group=g, async_op=True),
                )
                assert all(b.tobytes() == want.tobytes() for b in bufs), (k, count, repeat)
                kept = groups[0]._start_template
                assert kept is not None
                if repeat:
                    assert kept[1] is built[-1]
                else:
                    built.append(kept[1])
        sources = [np.full(300, r + k, np.float64) for r in range(world)]
        on_every_rank(
            groups, lambda g, r, b=sources: api.broadcast(b[r], src=1, group=g, async_op=True)
        )
        assert all(b.tobytes() == np.full(300, 1 + k, np.float64).tobytes() for b in sources)
    # A shape that follows another builds its template anew.
    assert len({id(t) for t in built}) == len(built) == 3 * len(shapes)


def test_a_repeated_all_reduce_starts_in_the_nodes_datapath(groups: list[api.ProcessGroup]) -> None:
    """SPEC.md 4.1, "Restart in the datapath": after a group's first call, the START_COLLs of
    its calls start in the node's compiled datapath. The control plane (the punted datagrams)
    sees few of them (a quarter at most; one in TAKEN_SLOTS + 1 when the slot's row of tags for
    the replay memory is full, and one that came in the round its predecessor ended, below),
    and every result is exact and the same on every rank."""

    def punted() -> list[int]:  # (each COUNTERS request is punted itself: one more each time)
        return [int(g.client.counters(g.node)[C.PUNTED]) for g in groups]

    calls = 3 * (TAKEN_SLOTS + 1)
    on_every_rank(
        groups, lambda g, r: api.all_reduce(np.ones(1000, np.float32), group=g, async_op=True)
    )
    before = punted()
    for k in range(calls):
        bufs = [np.full(1000, rank + k, np.float32) for rank in range(len(groups))]
        on_every_rank(
            groups, lambda g, r, bufs=bufs: api.all_reduce(bufs[r], group=g, async_op=True)
        )
        want = np.full(1000, sum(rank + k for rank in range(len(groups))), np.float32)
        assert all(b.tobytes() == want.tobytes() for b in bufs)
    grown = [b - a for a, b in zip(before, punted(), strict=True)]
    # A node's control plane takes a START_COLL when the slot's row of tags is full (one in
    # TAKEN_SLOTS + 1), and when its slot has not ended yet (a START_COLL that overtook the
    # last DONE of the call before, SPEC.md 4.1): on a loaded machine (the suite on 2 cores) a
    # few more of 51 on a node, run to run. Without the restart every call would go there.
    assert all(g <= calls // 4 for g in grown), grown


# After this test, the groups of ranks 1 and 2 no longer hold their arenas (init_process_group
# in this same process took them over): tests that run collectives on ``groups`` come before.
def test_init_process_group_env_and_file(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not netdam.is_initialized()
    monkeypatch.setenv("NETDAM_CLUSTER", str(cluster.path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    group = netdam.init_process_group()
    try:
        assert netdam.is_initialized() and group.rank == 1 and netdam.get_world_size() == WORLD
    finally:
        netdam.destroy_process_group()
    assert not netdam.is_initialized()
    group = netdam.init_process_group(
        init_method=f"file://{cluster.path}", rank=2, world_size=WORLD
    )
    try:
        assert netdam.get_rank() == 2
    finally:
        netdam.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"backend": "nccl"}, {}, "netdam is its own backend"),
        ({}, {}, "NETDAM_CLUSTER"),
        ({"init_method": "tcp://1.2.3.4:5"}, {}, "use 'env://' or 'file://PATH'"),
        ({"init_method": "file://{path}"}, {}, "needs rank="),
        ({"init_method": "file://{path}", "rank": 0, "world_size": 7}, {}, "one rank per node"),
        ({}, {"NETDAM_CLUSTER": "{path}", "RANK": "x"}, "not an integer"),
    ],
)
def test_init_process_group_errors_name_the_fix(
    cluster: LocalCluster,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    env: dict[str, str],
    message: str,
) -> None:
    monkeypatch.delenv("NETDAM_CLUSTER", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value.replace("{path}", str(cluster.path)))
    args = {
        k: (v.replace("{path}", str(cluster.path)) if isinstance(v, str) else v)
        for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        netdam.init_process_group(**args)
    assert not netdam.is_initialized()
    assert isinstance(cluster.path, Path)


def test_every_node_is_pinged_at_once_and_a_silent_one_costs_two_rounds(
    groups: list[api.ProcessGroup],
) -> None:
    """How a failed collective names the dead (ProcessGroup.dead_nodes, shrink): one PING to
    every node at once, again to the silent; three silent addresses cost two rounds, not two
    rounds each."""
    import socket
    import time

    silent = []
    for _ in range(3):  # bound and never read: as silent as a dead node
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        silent.append(sock)
    client = groups[0].client
    live = [node.control_endpoint for node in groups[0].cluster.nodes]
    dead = [s.getsockname() for s in silent]
    start = time.monotonic()
    heard = client.answering(live + dead, timeout=0.2)
    took = time.monotonic() - start
    for sock in silent:
        sock.close()
    assert heard == set(live)
    assert 0.4 <= took < 1.1, took  # two rounds of 0.2 s; one after another: 3 x 2 x 0.2 s
    assert groups[0].dead_nodes() == []


def test_closing_a_group_lets_go_of_its_node_memory() -> None:
    """A closed group detaches from its node's memory at once, with the groups new_group made
    from it, even while the group, those groups and their finished calls are still referenced
    (they refer to each other: only the garbage collector let the mapping go, and the bench,
    running cluster after cluster in one process, ran a 24 GiB machine out of memory at 4 x 256
    MiB). The collector is off here, so only close() can let it go."""
    with start_cluster(2, memory=16 << 20) as running:
        files = [str(node.memory_file) for node in running.info.nodes]

        def mapped() -> list[str]:
            with open("/proc/self/maps") as maps:
                return [line for line in maps if any(f in line for f in files)]

        collecting = gc.isenabled()
        gc.disable()
        try:
            made = [api.ProcessGroup(running.info, r) for r in range(2)]
            pairs = [g.new_group([0, 1]) for g in made]
            staged = [np.full(1000, r + 1.0, np.float32) for r in range(2)]
            resident = [g.empty(1000) for g in made]
            works = [
                api.all_reduce(b, group=g, async_op=True)
                for bufs, groups in ((staged, made), (resident, pairs))
                for b, g in zip(bufs, groups, strict=True)
            ]
            for work in works:
                assert work is not None
                work.wait()
            assert all(b.tolist() == [3.0] * 1000 for b in staged)
            assert len(mapped()) == 2
            del resident  # the caller's own views of node memory are the caller's to drop
            for group in made:
                group.close()
            assert mapped() == []
            assert all(g.memory.size == 0 for g in [*made, *pairs])
        finally:
            if collecting:
                gc.enable()
