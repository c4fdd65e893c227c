"""All-reduce past one chain on real NICs: a torus of chains (SPEC.md 4.2). Eight NICs with
chains of at most 4 (``max_chain``) run the same code as 128 NICs with chains of 64; the slow
test runs 128."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from netdam import api
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.core.torus import torus_shape
from netdam.protocol.constants import ReduceOp as WireOp
from netdam.tools.allreduce import (
    node_memory_needed,
    reference_chain_allreduce,
    reference_torus_allreduce,
)

WORLD, MAX_CHAIN = 8, 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with start_cluster(WORLD, memory=4 << 20) as running:
        yield running


@pytest.fixture(scope="module")
def ranks(cluster: LocalCluster) -> Iterator[list[api.ProcessGroup]]:
    made = [api.ProcessGroup(cluster.info, r, max_chain=MAX_CHAIN) for r in range(WORLD)]
    yield made
    for group in made:
        group.close()


def _all_reduce(
    ranks: list[api.ProcessGroup], inputs: list[np.ndarray], op: int = api.ReduceOp.SUM
) -> list[np.ndarray]:
    bufs = [x.copy() for x in inputs]
    works = [
        api.all_reduce(b, op=op, group=g, async_op=True) for g, b in zip(ranks, bufs, strict=True)
    ]
    for work in works:
        assert work is not None
        work.wait()
    return bufs


def _three_in_flight(ranks: list[api.ProcessGroup], rng: np.random.Generator) -> None:
    """Three all-reduces in flight on every rank (all issued, then all waited on), each
    checked bitwise against the torus reference."""
    batches = [
        [rng.standard_normal(2_000).astype(np.float32) for _ in range(WORLD)] for _ in range(3)
    ]
    bufs = [[x.copy() for x in batch] for batch in batches]
    works = [
        [api.all_reduce(bufs[k][r], group=ranks[r], async_op=True) for r in range(WORLD)]
        for k in range(3)
    ]
    for per in works:
        for work in per:
            assert work is not None
            work.wait()
    for k, batch in enumerate(batches):
        expected = reference_torus_allreduce(batch, WireOp.SUM, MAX_CHAIN).tobytes()
        assert all(b.tobytes() == expected for b in bufs[k])


@pytest.mark.parametrize(
    ("dtype", "op", "count"),
    [
        (np.float32, WireOp.SUM, 10_007),
        (np.float64, WireOp.MAX, 5_000),
        (np.int32, WireOp.MIN, 3),  # fewer elements than a row has members: empty blocks
        (np.float32, WireOp.SUM, 1),
    ],
)
def test_torus_all_reduce_is_exact_and_identical_on_every_rank(
    ranks: list[api.ProcessGroup], dtype: type, op: WireOp, count: int
) -> None:
    rng = np.random.default_rng(count)
    inputs = [(rng.standard_normal(count) * 100).astype(dtype) for _ in range(WORLD)]
    results = _all_reduce(ranks, inputs, int(op))
    expected = reference_torus_allreduce(inputs, op, MAX_CHAIN)
    assert all(r.tobytes() == expected.tobytes() for r in results)
    # Not the flat chain's order: the test would pass a flat chain by accident otherwise.
    if count > 100 and dtype is np.float32:
        assert expected.tobytes() != reference_chain_allreduce(inputs, op).tobytes()


@pytest.mark.parametrize("enough", [True, False])
def test_the_node_memory_a_torus_is_told_it_needs_is_what_it_needs(enough: bool) -> None:
    """`netdam allreduce --cluster` checks node memory before the first packet
    (node_memory_needed). A torus makes its rows' and columns' groups, after which the default
    group stages in its share of the arena's staging half (api.GROUPS_STAGING_SHARE): what the
    check asks for a torus stages the buffer; the 4x the buffer one chain needs does not (256
    NICs of 4 MiB passed the old check for 1 MiB and then raised MemoryError)."""
    nbytes = 192 << 10
    chain = node_memory_needed(nbytes, "chain")
    memory = node_memory_needed(nbytes, "chain", torus=True) if enough else chain
    inputs = [np.full(nbytes // 4, r + 1, np.float32) for r in range(WORLD)]
    with start_cluster(WORLD, memory=memory) as running:
        made = [api.ProcessGroup(running.info, r, max_chain=MAX_CHAIN) for r in range(WORLD)]
        try:
            if enough:
                results = _all_reduce(made, inputs)
                expected = reference_torus_allreduce(inputs, WireOp.SUM, MAX_CHAIN)
                assert all(r.tobytes() == expected.tobytes() for r in results)
            else:
                with pytest.raises(MemoryError, match="staging area"):
                    _all_reduce(made, inputs)
        finally:
            for group in made:
                group.close()


def test_torus_calls_in_flight_average_barrier_and_resident_buffers(
    ranks: list[api.ProcessGroup],
) -> None:
    """Several torus all-reduces in flight on every rank end in issue order with their own
    results; AVG divides by all 8; barrier runs over the torus; a NIC-resident buffer needs no
    staging."""
    rng = np.random.default_rng(3)
    _three_in_flight(ranks, rng)
    avg = _all_reduce(
        ranks, [np.full(100, float(r), np.float64) for r in range(WORLD)], api.ReduceOp.AVG
    )
    assert all(np.all(a == sum(range(WORLD)) / WORLD) for a in avg)
    barriers = [api.barrier(group=g, async_op=True) for g in ranks]
    for work in barriers:
        assert work is not None
        work.wait()
    held = [g.empty(500, np.float32) for g in ranks]
    for r, h in enumerate(held):
        h[:] = r + 1
    works2 = [api.all_reduce(h, group=g, async_op=True) for g, h in zip(ranks, held, strict=True)]
    for work in works2:
        assert work is not None
        work.wait()
    assert all(np.all(h == sum(range(1, WORLD + 1))) for h in held)


@pytest.mark.slow
def test_torus_calls_in_flight_round_after_round_never_wait_on_each_other(
    ranks: list[api.ProcessGroup],
) -> None:
    """Three torus all-reduces in flight on every rank, 25 rounds. A rank's row reduce-scatter,
    column and row gather share its lanes; each step used to be queued only when the one
    before it ended on that rank, so one rank's lane held a later call's reduce-scatter ahead
    of an earlier call's gather while its row neighbour held them the other way round, and
    both waited until the watchdog failed the row (this test failed 1 run in 3 so). Each step
    now takes its place in its lane when the all-reduce is issued."""
    rng = np.random.default_rng(25)
    for _ in range(25):
        _three_in_flight(ranks, rng)


def test_other_collectives_past_one_chain_say_what_runs_there(
    ranks: list[api.ProcessGroup],
) -> None:
    with pytest.raises(
        ValueError, match=r"broadcast over 8 ranks.*all_reduce and barrier run over more"
    ):
        api.broadcast(np.zeros(4, np.float32), group=ranks[0])
    with pytest.raises(ValueError, match="new_group"):
        api.all_gather_into_tensor(np.zeros(8, np.float32), np.zeros(1, np.float32), group=ranks[0])


def test_a_rank_count_that_does_not_split_is_refused_before_anything_is_sent(
    cluster: LocalCluster,
) -> None:
    group = api.ProcessGroup(
        cluster.info, 0, max_chain=3, job="unsplit"
    )  # 8 > 3 and 8 = 2 x 4 only
    try:
        with pytest.raises(ValueError, match="does not split into equal rows"):
            api.all_reduce(np.ones(4, np.float32), group=group)
        assert group.epoch == 0  # nothing started
    finally:
        group.close()


def test_a_subgroup_past_one_chain_runs_as_a_torus_too(ranks: list[api.ProcessGroup]) -> None:
    """new_group of 6 ranks with chains of 4: rows of 3 (every rank makes the torus's groups,
    member or not, so numbering agrees)."""
    members = [0, 1, 2, 4, 5, 6]
    made = {r: ranks[r].new_group(members) for r in range(WORLD)}
    groups = {r: g for r, g in made.items() if isinstance(g, api.ProcessGroup)}
    assert sorted(groups) == members
    rng = np.random.default_rng(6)
    inputs = {r: rng.standard_normal(777).astype(np.float32) for r in members}
    bufs = {r: x.copy() for r, x in inputs.items()}
    works = [api.all_reduce(bufs[r], group=groups[r], async_op=True) for r in members]
    for work in works:
        assert work is not None
        work.wait()
    expected = reference_torus_allreduce(
        [inputs[r] for r in members], WireOp.SUM, MAX_CHAIN
    ).tobytes()
    assert all(b.tobytes() == expected for b in bufs.values())


@pytest.mark.slow
def test_128_nics_all_reduce_exact_as_8_rows_of_16(tmp_path: Path) -> None:
    assert torus_shape(128) == (8, 16)  # as square as 128 splits (SPEC.md 4.2)
    with start_cluster(128, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        groups = [api.ProcessGroup(cluster.info, r) for r in range(128)]
        try:
            rng = np.random.default_rng(128)
            inputs = [rng.standard_normal(64 * 129).astype(np.float32) for _ in range(128)]
            results = _all_reduce(groups, inputs)
            expected = reference_torus_allreduce(inputs, WireOp.SUM)
            assert all(r.tobytes() == expected.tobytes() for r in results)
        finally:
            for group in groups:
                group.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_torus_all_reduce_stays_exact_under_loss_duplication_and_reordering(
    tmp_path: Path, seed: int
) -> None:
    """Seeded receive faults in every NIC (10% loss, 5% duplicates, 5% reordered): every step
    of the torus recovers (RTO, RESUME, repair), and the result is the reference's bits. The
    watchdog is 10 s, not 2.5: a row's all-gather waits on members whose column step recovers
    its own losses first, and under a loaded suite (3 workers on 2 cores, traced) one waited
    past 2.5 s while that column still made progress (its members answering BUSY)."""
    faults = FaultSpec(loss=0.1, dup=0.05, reorder=0.05, seed=seed)
    with start_cluster(
        WORLD, memory=4 << 20, faults=faults, cluster_path=tmp_path / "c.toml"
    ) as lossy:
        groups = [
            api.ProcessGroup(lossy.info, r, max_chain=MAX_CHAIN, timeout_s=10.0)
            for r in range(WORLD)
        ]
        try:
            rng = np.random.default_rng(seed)
            for count in (50_000, 7):
                inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(WORLD)]
                results = _all_reduce(groups, inputs)
                expected = reference_torus_allreduce(inputs, WireOp.SUM, MAX_CHAIN)
                assert all(r.tobytes() == expected.tobytes() for r in results)
        finally:
            for group in groups:
                group.close()


@pytest.mark.slow
def test_a_dead_nic_fails_every_survivors_torus_all_reduce_and_the_next_one(tmp_path: Path) -> None:
    """NIC 7 (row 1, column 3) dies mid-call: its row and column fail on the watchdog, rank 3
    never gathers, so row 0 fails too; every survivor raises naming it, and the next all-reduce
    on the same group fails at once (its sub-groups' epochs no longer agree)."""
    with start_cluster(
        WORLD, memory=1 << 26, nics_per_process=1, cluster_path=tmp_path / "c.toml"
    ) as cluster:
        groups = [
            api.ProcessGroup(cluster.info, r, max_chain=MAX_CHAIN, timeout_s=1.0)
            for r in range(WORLD)
        ]
        try:
            bufs = [np.full(2 << 20, r + 1.0, np.float32) for r in range(WORLD)]  # 8 MiB: in flight
            works = [
                api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs, strict=True)
            ]
            dead = cluster.info.nodes[WORLD - 1]
            os.kill(dead.pid, signal.SIGKILL)
            errors = {}
            for rank, work in enumerate(works[: WORLD - 1]):
                assert work is not None
                with pytest.raises(api.CollectiveError) as failed:
                    work.wait()
                errors[rank] = str(failed.value)
            named = f"{dead.address}:{dead.port}"
            assert all(named in text for text in errors.values()), errors
            with pytest.raises(
                api.CollectiveError, match="an earlier all_reduce over these 8 ranks failed"
            ):
                api.all_reduce(np.ones(8, np.float32), group=groups[0])
        finally:
            for group in groups:
                group.close()


def test_the_next_run_of_a_job_moves_its_torus_past_the_nodes_epochs(cluster: LocalCluster) -> None:
    """A job's second run makes the same sub-groups (the same coll_ids) on nodes that ran the
    first: their first steps are answered STALE_EPOCH, move on, and the result is exact."""
    rng = np.random.default_rng(11)
    for run in range(2):
        groups = [
            api.ProcessGroup(cluster.info, r, max_chain=MAX_CHAIN, job="again")
            for r in range(WORLD)
        ]
        try:
            inputs = [rng.standard_normal(3_000).astype(np.float32) for _ in range(WORLD)]
            bufs = [x.copy() for x in inputs]
            works = [
                api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs, strict=True)
            ]
            for work in works:
                assert isinstance(work, api.TorusWork)
                work.wait()
            expected = reference_torus_allreduce(inputs, WireOp.SUM, MAX_CHAIN).tobytes()
            assert all(b.tobytes() == expected for b in bufs)
            if run == 1:  # moved past the first run's epochs (it ran 1 per row step, column step)
                assert all(part.packet.epoch > 1 for w in works for part in w.parts)
        finally:
            for group in groups:
                group.close()
