"""Two jobs on the same NICs at once (issue 25): each with a name, its own keys, coll_ids and
arena; their collectives run side by side in the NICs' slots (SPEC.md 4.1), each exact; a
small call of one is not held behind a large call of the other; groups under injected loss
stay exact while they run together. Real node processes, all ranks of both jobs in this
process (each rank's call started before any is waited on)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from netdam import api
from netdam.cluster.clusterfile import group_secret
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.protocol.constants import ReduceOp as WireOp
from netdam.protocol.constants import Rights
from netdam.tools.allreduce import reference_chain_allreduce

WORLD = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with start_cluster(WORLD, memory=32 << 20) as running:
        yield running


@pytest.fixture(scope="module")
def jobs(cluster: LocalCluster) -> Iterator[dict[str, list[api.ProcessGroup]]]:
    made = {
        job: [api.ProcessGroup(cluster.info, r, job=job, arena_bytes=8 << 20) for r in range(WORLD)]
        for job in ("a", "b")
    }
    yield made
    for groups in made.values():
        for group in groups:
            group.close()


def test_jobs_have_their_own_keys_coll_ids_and_arenas(
    jobs: dict[str, list[api.ProcessGroup]],
) -> None:
    a, b = jobs["a"][0], jobs["b"][0]
    assert a.coll_id != b.coll_id
    assert api.collective_key(a._secret, a.coll_id, 1) != api.collective_key(
        b._secret, b.coll_id, 1
    )
    assert a._secret != b._secret and group_secret(a.cluster) not in (a._secret, b._secret)
    assert a.arena_rkey != b.arena_rkey
    assert a.arena_end <= b.arena_base or b.arena_end <= a.arena_base  # one byte, one owner


def test_a_small_call_of_one_job_runs_beside_a_large_call_of_another(
    jobs: dict[str, list[api.ProcessGroup]],
) -> None:
    """Job a's 4 MiB all-reduce starts first; job b's 4 KiB one is started on every node while
    a's still runs there (a NIC of one slot answered it BUSY until a's ended) and both are exact."""
    a, b = jobs["a"], jobs["b"]
    rng = np.random.default_rng(2525)
    large = [a[r].empty(1 << 20, np.float32) for r in range(WORLD)]
    inputs = [rng.standard_normal(1 << 20).astype(np.float32) for _ in range(WORLD)]
    small = [rng.standard_normal(1024).astype(np.float32) for _ in range(WORLD)]
    small_in = [x.copy() for x in small]
    for buf, x in zip(large, inputs, strict=True):
        buf[...] = x
    works_a = [api.all_reduce(large[r], group=a[r], async_op=True) for r in range(WORLD)]
    works_b = [api.all_reduce(small[r], group=b[r], async_op=True) for r in range(WORLD)]
    for work in works_b + works_a:
        assert work is not None
        work.wait()
    assert all(w is not None and w.busy_answers == 0 for w in works_b)
    for wa, wb in zip(works_a, works_b, strict=True):
        assert (
            wa is not None
            and wb is not None
            and wb.started_at is not None
            and wa.completed_at is not None
        )
        assert wb.started_at < wa.completed_at  # b ran on the node while a still ran there
    expected_large = reference_chain_allreduce(inputs, WireOp.SUM).tobytes()
    expected_small = reference_chain_allreduce(small_in, WireOp.SUM).tobytes()
    assert all(buf.tobytes() == expected_large for buf in large)
    assert all(buf.tobytes() == expected_small for buf in small)


def test_two_jobs_groups_and_calls_in_flight_all_exact(
    jobs: dict[str, list[api.ProcessGroup]],
) -> None:
    """Both jobs, each with its default group and a group of two, four calls in flight on each:
    16 collectives in flight, as many at once on nodes 1 and 2 as they have slots."""
    rng = np.random.default_rng(2526)
    calls = []
    for job, groups in jobs.items():
        pair = {r: groups[r].new_group([1, 2]) for r in range(WORLD)}
        for members, made in ((list(range(WORLD)), dict(enumerate(groups))), ([1, 2], pair)):
            for _ in range(4):
                inputs = {
                    r: rng.integers(-1 << 20, 1 << 20, 5003).astype(np.int64) for r in members
                }
                bufs = {r: x.copy() for r, x in inputs.items()}
                works = [api.all_reduce(bufs[r], group=made[r], async_op=True) for r in members]
                calls.append((job, members, inputs, bufs, works))
    for *_, works in calls:
        for work in works:
            work.wait()
    for job, members, inputs, bufs, _ in calls:
        expected = sum(inputs[r] for r in members)
        assert all(np.array_equal(bufs[r], expected) for r in members), (job, members)


def test_a_jobs_name_is_checked_and_one_process_per_rank_and_job(
    cluster: LocalCluster, jobs: dict[str, list[api.ProcessGroup]]
) -> None:
    with pytest.raises(ValueError, match="job name"):
        api.ProcessGroup(cluster.info, 0, job="a b")
    code = (
        "import sys; from netdam.api import ArenaInUseError, ProcessGroup; "
        "from netdam.cluster.clusterfile import load_cluster\n"
        "try:\n    ProcessGroup(load_cluster(sys.argv[1]), 0, job='a').close(); print('opened')\n"
        "except ArenaInUseError as exc:\n    print('refused:', exc)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(cluster.path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.startswith("refused: rank 0: another process") and "job 'a'" in run.stdout, (
        run.stdout
    )


@pytest.mark.slow
def test_two_jobs_groups_under_injected_loss_stay_exact() -> None:
    """Both jobs and a group of each at once, under 30% loss (and 10% duplicated and 10%
    reordered), seeded; 10% and 30% are run on the in-memory fabric too (test_slots). The watchdog is 10 s, as on a lossy fabric: it counts
    time without progress, and at 30% loss the last chunk's repair READs (one round per
    2 RTO, each answered with probability ~0.5) outlast the 2.5 s default in about 1 run of 8
    (measured; the call then raises TIMEOUT, never a wrong result)."""
    faults = FaultSpec(loss=0.3, dup=0.1, reorder=0.1, seed=25)
    with start_cluster(WORLD, memory=16 << 20, faults=faults) as running:
        made = {
            job: [
                api.ProcessGroup(running.info, r, job=job, arena_bytes=4 << 20, timeout_s=10.0)
                for r in range(WORLD)
            ]
            for job in ("a", "b")
        }
        try:
            rng = np.random.default_rng(2527)
            calls = []
            for groups in made.values():
                odd = {r: groups[r].new_group([1, 3]) for r in range(WORLD)}
                for members, by_rank in (
                    (list(range(WORLD)), dict(enumerate(groups))),
                    ([1, 3], odd),
                ):
                    inputs = {r: rng.standard_normal(20_001).astype(np.float32) for r in members}
                    bufs = {r: x.copy() for r, x in inputs.items()}
                    works = [
                        api.all_reduce(bufs[r], group=by_rank[r], async_op=True) for r in members
                    ]
                    calls.append((members, inputs, bufs, works))
            for *_, works in calls:
                for work in works:
                    work.wait()
            for members, inputs, bufs, _ in calls:
                expected = reference_chain_allreduce(
                    [inputs[r] for r in members], WireOp.SUM
                ).tobytes()
                assert all(bufs[r].tobytes() == expected for r in members), members
        finally:
            for groups in made.values():
                for group in groups:
                    group.close()


@pytest.mark.slow
def test_bench_allreduce_jobs_reports_each_job_against_solo(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "netdam",
            "bench",
            "allreduce",
            "--jobs",
            "2",
            "--nodes",
            "2",
            "--size",
            "64KiB",
            "--window",
            "0.2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["ok"] and result["jobs"] == 2 and result["solo"]["calls"] > 0
    assert [row["job"] for row in result["together"]] == ["job0", "job1"]
    assert all(row["calls"] > 0 and row["fraction_of_solo"] > 0 for row in result["together"])
    assert result["small_behind_large"]["small"]["calls"] > 0
    assert "of solo" in run.stderr


def test_arenas_placed_apart_fail_with_a_hint_not_a_wrong_result() -> None:
    """The known limit of placing arenas node by node: when one rank's arena lies elsewhere on
    its node than the others' (jobs whose ranks registered in different orders), a collective
    cannot run; every rank's call must fail, one with OUT_OF_BOUNDS saying what likely happened,
    and none return a result. Here another client's region on node 1 moves rank 1's arena up.

    The watchdog is long (the NACKs come in under a second here): in one CI run beside the other
    worker, neither node answered anything, PING included, for the default 3.5 s, and both ranks
    failed on silence before the NACK could come."""
    with start_cluster(2, memory=4 << 20) as cluster:
        client = ControlClient.for_cluster(cluster.info)
        node1 = cluster.info.nodes[1].control_endpoint
        client.register(node1, 0, 1 << 20, Rights.READ | Rights.WRITE, rkey=0x0DDBA11)
        groups = [
            api.ProcessGroup(cluster.info, r, arena_bytes=1 << 20, timeout_s=30.0) for r in range(2)
        ]
        try:
            assert groups[0].arena_base != groups[1].arena_base
            buffers = [np.ones(4096, np.float32) for _ in groups]
            works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, buffers)]
            errors = []
            for work in works:
                assert work is not None
                with pytest.raises(api.CollectiveError) as failed:
                    work.wait()
                errors.append(str(failed.value))
            # The rank whose chains a node refused hears OUT_OF_BOUNDS with the hint; the other
            # may time out instead (a failed collective drops the rest of its datagrams).
            assert any("arenas may lie at different addresses" in e for e in errors), errors
            assert all((b == 1).all() for b in buffers)  # nothing half-reduced came back
        finally:
            for g in groups:
                g.close()
            client.close()
