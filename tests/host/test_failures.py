"""Failure drills on real processes: a node killed in the middle of an all-reduce, the switch
killed and restarted under pool traffic, and `netdam up --switch` stopped by Ctrl-C, SIGTERM or
the death of its parent, leaving no process and no /dev/shm file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import load_example

from netdam.api import CollectiveError, ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.clients.pool import PoolClient, PoolError, tag_keys_of
from netdam.cluster.clusterfile import load_cluster, load_switch_entry
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import node_log, start_cluster, start_pool_cluster, start_switch
from netdam.cluster.launch import process_alive as alive
from netdam.protocol.constants import RIGHTS_ALL
from netdam.switch.controller import PoolController

KiB = 1024


def wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.slow
@pytest.mark.alone
def test_node_killed_mid_allreduce_at_8_nics_every_survivor_hears_and_shrinks(
    tmp_path: Path,
) -> None:
    """The same kill at 8 NICs (the 4-NIC run is below): all 7 survivors raise within 2 s of
    the kill, naming the dead rank, and their shrunk group's next all-reduce is exact."""
    example = load_example("groups_and_shrink")
    world = 8
    with start_cluster(
        world, memory=1 << 26, cluster_path=tmp_path / "c.toml", nics_per_process=1
    ) as cluster:
        groups = [ProcessGroup(cluster.info, rank, timeout_s=1.0) for rank in range(world)]
        dead = cluster.info.nodes[world - 1]
        heard = example.kill_mid_collective(groups, dead.pid)
        assert sorted(heard) == list(range(world - 1)), heard
        assert max(v["seconds"] for v in heard.values()) < 2.0, heard
        assert all(
            f"rank {world - 1} ({dead.address}:{dead.port})" in v["error"] for v in heard.values()
        ), heard
        assert example.shrink_and_go_on(groups) == {
            "members": list(range(world - 1)),
            "exact": True,
        }
        for group in groups:
            group.close()


@pytest.mark.slow
def test_node_killed_mid_allreduce_is_named_and_survivors_serve(tmp_path: Path) -> None:
    example = load_example("groups_and_shrink")  # the steps examples/groups_and_shrink.py shows
    # A process per NIC: the kill takes the last rank alone (test_nic_host kills a process of several).
    world = example.WORLD
    with start_cluster(
        world, memory=1 << 26, cluster_path=tmp_path / "c.toml", nics_per_process=1
    ) as cluster:
        # A 1 s watchdog (the default is 2.5 s): the issue asks for the error within 2 s.
        groups = [ProcessGroup(cluster.info, rank, timeout_s=1.0) for rank in range(world)]
        assert example.two_groups_at_once(groups) == {"evens_exact": True, "odds_exact": True}
        dead = cluster.info.nodes[world - 1]
        # Every survivor's call raised, each within 2 s of the kill, naming the dead node.
        heard = example.kill_mid_collective(groups, dead.pid)
        assert sorted(heard) == list(range(world - 1)), heard
        assert max(v["seconds"] for v in heard.values()) < 2.0, heard
        # ... and what this host sees of its process: stopped, then killed (kill_mid_collective).
        named = f"rank {world - 1} ({dead.address}:{dead.port}) [its process {dead.pid} "
        assert all(named in v["error"] and "failed" in v["error"] for v in heard.values()), heard
        # Every survivor shrinks the group to the living; the next collective on it is exact.
        assert example.shrink_and_go_on(groups) == {
            "members": list(range(world - 1)),
            "exact": True,
        }
        # The survivors answer and serve plain memory traffic.
        with ControlClient.for_cluster(cluster.info) as client:
            for node in cluster.info.nodes[: world - 1]:
                client.ping(node.control_endpoint)
                rkey, base = client.register_anywhere(
                    node.endpoint, 4096, RIGHTS_ALL
                )  # beside the arena
                client.write(node.endpoint, rkey, base, b"survivor")
                assert client.read(node.endpoint, rkey, base, 8) == b"survivor"
        for group in groups:
            group.close()
        pids = [n.pid for n in cluster.info.nodes]
        files = [n.memory_file for n in cluster.info.nodes]
    assert wait_gone(pids) == []
    assert not any(Path(f).exists() for f in files)


@pytest.mark.slow
@pytest.mark.alone
def test_switch_killed_and_restarted_under_pool_traffic(tmp_path: Path) -> None:
    cluster, switch = start_pool_cluster(3, memory=1 << 20, cluster_path=tmp_path / "c.toml")
    try:
        controller = PoolController(cluster.path)
        region = controller.alloc(24 * KiB, interleave=8 * KiB)
        counter = controller.alloc(8)
        pattern = bytes(range(256)) * 96
        with PoolClient(
            switch.vip, timeout=0.02, retries=3, tag_keys=tag_keys_of(region, counter)
        ) as client:
            client.write(region.gaddr, pattern, region.rkey, stride=region.stride)
        log: list[tuple[float, str]] = []
        acked = [0]
        stop = threading.Event()

        def traffic() -> None:
            with PoolClient(
                switch.vip, timeout=0.02, retries=3, tag_keys=tag_keys_of(region, counter)
            ) as c:
                while not stop.is_set():
                    try:
                        c.fetch_add(counter.gaddr, 1, counter.rkey)
                        acked[0] += 1
                        assert (
                            c.read(region.gaddr, len(pattern), region.rkey, stride=region.stride)
                            == pattern
                        )
                        log.append((time.monotonic(), "ok"))
                    except PoolError as exc:
                        log.append((time.monotonic(), type(exc).__name__))
                        time.sleep(0.01)

        thread = threading.Thread(target=traffic)
        thread.start()
        time.sleep(0.3)
        # Taken before the signal: an operation in flight when it lands may time out before
        # wait() returns, so the moment after wait() is not "still alive".
        kill_sent = time.monotonic()
        switch.process.kill()  # no clean shutdown: the state file is all that survives
        switch.process.wait(timeout=5)
        killed_at = time.monotonic()
        time.sleep(0.6)
        switch = start_switch(cluster, switch.vip)
        restarted_at = time.monotonic()
        time.sleep(0.5)
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
        during = [k for t, k in log if killed_at + 0.1 < t < killed_at + 0.6]
        after = [k for t, k in log if t > restarted_at + 0.2]
        assert during and set(during) == {"PoolTimeout"}, during[:5]  # timeouts, not hangs
        assert after and set(after) == {"ok"}, after[:5]  # recovered: same VIP, regions, rkeys
        # It served traffic up to the kill: the last answer before the signal is recent (a
        # loaded machine may time out one operation of a live switch; 20 ms is its timeout).
        last_ok = max(t for t, k in log if k == "ok" and t < kill_sent)
        assert kill_sent - last_ok < 0.2, kill_sent - last_ok
        # The restarted switch reloaded the map: the old rkeys still work and nothing was lost.
        with PoolClient(switch.vip, tag_keys=tag_keys_of(region, counter)) as client:
            assert (
                client.read(region.gaddr, len(pattern), region.rkey, stride=region.stride)
                == pattern
            )
            final = client.fetch_add(counter.gaddr, 0, counter.rkey)
        # Every acknowledged increment landed; an unacknowledged one may or may not have.
        timeouts_on_increment = sum(1 for _, k in log if k == "PoolTimeout")
        assert acked[0] <= final <= acked[0] + timeouts_on_increment
        assert load_switch_entry(cluster.path).pid == switch.process.pid
    finally:
        switch.stop()
        cluster.stop()


def _start_up(path: Path) -> subprocess.Popen[str]:
    up = [
        sys.executable,
        "-m",
        "netdam",
        "up",
        "--nodes",
        "2",
        "--memory",
        "64KiB",
        "--switch",
        "--cluster",
        str(path),
    ]
    proc = subprocess.Popen(up, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (path.exists() and load_switch_entry(path) is not None):
        assert proc.poll() is None and time.monotonic() < deadline, "netdam up did not start"
        time.sleep(0.05)
    return proc


# SIGKILL of `netdam up` is the death of the nodes' and the switch's parent: they must notice.
@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])  # SIGINT: test_cluster.py
def test_up_with_switch_leaves_nothing_behind(tmp_path: Path, how: signal.Signals) -> None:
    path = tmp_path / "c.toml"
    proc = _start_up(path)
    info = load_cluster(path)
    switch = load_switch_entry(path)
    assert switch is not None
    pids = [n.pid for n in info.nodes] + [switch.pid]
    files = [n.memory_file for n in info.nodes]
    logs = [node_log(info.name, n.rank) for n in info.nodes]
    assert any(log.exists() for log in logs), "the nodes' logs are not where node_log says"
    proc.send_signal(how)
    proc.wait(timeout=30)
    assert wait_gone(pids) == [], f"left running after {how.name}"
    assert not any(Path(f).exists() for f in files), f"memory files left after {how.name}"
    # Empty: the nodes remove them as they stop (a killed `netdam up` never does).
    assert not any(log.exists() for log in logs), f"logs left after {how.name}"


@pytest.mark.slow
def test_flood_keeps_node_alive_answering_and_flat(capsys: pytest.CaptureFixture[str]) -> None:
    """A short `netdam flood` (the 60 s runs are in the README): the node under a seeded mix of
    valid and malformed datagrams stays alive, answers every stats request, keeps its anonymous
    memory flat after the warm-up, and counts what it NACKed and what the kernel dropped."""
    import json

    from netdam.cli.main import main

    # 3 s: the 1 s warm-up, then 5 memory samples (one per 0.5 s) for the flatness check.
    code = main(["flood", "--target", "node", "--seconds", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert result["alive"] and result["memory_flat"] and result["stats_failed"] == 0
    counters = result["counters"]
    assert counters["rx_packets"] > 10_000
    assert {"BAD_RKEY", "OUT_OF_BOUNDS", "UNAUTHORIZED", "BAD_VERSION"} <= set(counters["nacks"])
    assert counters["drops"] >= counters["kernel_drops"] + counters["drop_truncated"]


@pytest.mark.slow
def test_late_rank_slows_the_others_instead_of_failing_them(tmp_path: Path) -> None:
    """A host that joins half a second late (its group rkey not yet registered on its node):
    the others' chunks get BUSY, not BAD_RKEY, and every rank ends with the right sum."""
    with start_cluster(3, memory=4 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        early = [ProcessGroup(cluster.info, rank) for rank in (1, 2)]
        buffers = {rank: np.full(100_000, rank + 1, np.float32) for rank in range(3)}
        works = {g.rank: api_all_reduce(buffers[g.rank], group=g, async_op=True) for g in early}
        time.sleep(0.5)
        late = ProcessGroup(cluster.info, 0)
        works[0] = api_all_reduce(buffers[0], group=late, async_op=True)
        for work in works.values():
            work.wait()
        for rank in range(3):
            assert np.array_equal(buffers[rank], np.full(100_000, 6, np.float32)), rank
        for group in (*early, late):
            group.close()


@pytest.mark.slow
def test_a_new_group_never_reruns_an_old_epoch(tmp_path: Path) -> None:
    """Two process groups one after the other on one cluster: the second counts from epoch 1
    again, the nodes answer STALE_EPOCH with their epoch, and it moves past it instead of being
    handed the first group's completion (its own input back as the "result")."""
    with start_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        for attempt in range(2):
            groups = [ProcessGroup(cluster.info, rank) for rank in range(2)]
            buffers = [np.full(1000, rank + 1 + 10 * attempt, np.float32) for rank in range(2)]
            works = [api_all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, groups)]
            for work in works:
                work.wait()
            expected = np.full(1000, 3 + 20 * attempt, np.float32)
            assert all(np.array_equal(b, expected) for b in buffers), (attempt, buffers[0][:3])
            assert groups[0].epoch == attempt + 1
            for group in groups:
                group.close()


def test_a_new_group_agrees_on_its_epoch_after_a_call_only_some_nodes_started(
    tmp_path: Path,
) -> None:
    """Ranks 0 and 1 start an all-reduce that ranks 2 and 3 never join: it fails on the
    watchdog, and their nodes have run epoch 1 while 2's and 3's have not. A new set of groups
    (a new job) must still meet in one epoch: each rank asks every member's node for the last
    epoch it settled (COUNTERS_EPOCH, SPEC.md 6.5, "Epochs") and goes on from the highest, so all
    four run epoch 2 and the result is exact. Before, ranks 0 and 1 moved to epoch 2 on their
    nodes' STALE_EPOCH while 2 and 3 ran epoch 1, and every later call timed out."""
    with start_cluster(4, memory=4 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        partial = [ProcessGroup(cluster.info, rank, timeout_s=0.3) for rank in range(4)]
        half = [np.ones(1000, np.float32) for _ in range(2)]
        works = [api_all_reduce(half[r], group=partial[r], async_op=True) for r in range(2)]
        for work in works:
            with pytest.raises(CollectiveError):
                work.wait()
        for group in partial:
            group.close()
        groups = [ProcessGroup(cluster.info, rank, timeout_s=2.0) for rank in range(4)]
        try:
            buffers = [np.full(1000, rank + 1, np.float32) for rank in range(4)]
            works = [api_all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, groups)]
            for work in works:
                work.wait()
            assert all(np.array_equal(b, np.full(1000, 10, np.float32)) for b in buffers)
            assert [g.epoch for g in groups] == [2, 2, 2, 2]
        finally:
            for group in groups:
                group.close()


@pytest.mark.slow
def test_a_10x_straggler_is_slow_not_dead(tmp_path: Path) -> None:
    """A node given a tenth of the time (its process stopped 90 ms of every 100, SIGSTOP and
    SIGCONT) under a 1 s watchdog: the all-reduce completes exact and no rank raises. The
    watchdog is a stall timer (SPEC.md 4.1): a slow member still makes progress."""
    with start_cluster(
        3, memory=1 << 25, cluster_path=tmp_path / "c.toml", nics_per_process=1
    ) as cluster:
        groups = [ProcessGroup(cluster.info, rank, timeout_s=1.0) for rank in range(3)]
        try:
            # The quickest of 3 unslowed calls: on a machine loaded by other tests one call
            # took 0.12 s and the slowed one 0.10 s (3 workers on 2 cores).
            solos = []
            for _ in range(3):
                quick = [np.full(1 << 20, r + 1, np.float32) for r in range(3)]
                started = time.monotonic()
                works = [api_all_reduce(b, group=g, async_op=True) for b, g in zip(quick, groups)]
                for work in works:
                    work.wait()
                solos.append(time.monotonic() - started)
            solo = min(solos)
            stop = threading.Event()
            pid = cluster.info.nodes[1].pid

            def straggle() -> None:
                while not stop.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.09)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(0.01)

            slowed = [np.full(1 << 20, r + 1, np.float32) for r in range(3)]
            thread = threading.Thread(target=straggle)
            thread.start()
            try:
                started = time.monotonic()
                works = [api_all_reduce(b, group=g, async_op=True) for b, g in zip(slowed, groups)]
                for work in works:
                    work.wait()
                slow = time.monotonic() - started
            finally:
                stop.set()
                thread.join()
                os.kill(pid, signal.SIGCONT)
            assert all(b.tolist() == quick[0].tolist() for b in slowed) and quick[0][0] == 6.0
            # It really was slowed: 4-7x in wall time here (it catches up in batches while it
            # runs, so 10% of the time is not 10x the duration), and it waited through at least
            # one 90 ms stop (2.8x once in a full suite on a slower machine, where the solo call
            # was 37 ms and the slowed one 103 ms).
            assert slow > max(2 * solo, 0.08), (slow, solo)
        finally:
            for group in groups:
                group.close()
