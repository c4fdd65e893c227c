"""Collectives on real node processes: the allreduce command, the host API from separate host
processes, and a node killed mid-collective."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import every_rank
from reference import all_reduce_reference

from netdam import api
from netdam.api import CollectiveError, ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.cli.main import main
from netdam.cluster.launch import start_cluster


@pytest.mark.slow
@pytest.mark.alone
def test_allreduce_command_clean_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allreduce", "--nodes", "3", "--count", "100003", "--repeat", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["ranks_identical"] is True and r["equals_reference"] is True
    assert r["bytes"] == 400012 and r["nodes"] == 3
    assert r["retransmits"] == 0 and r["kernel_drops"] == 0  # flow control, not recovery
    assert r["packets"] > 0 and r["wire_bytes"] > 2 * r["bytes"] and r["model_seconds_100g"] > 0
    assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 4 / 3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,op", [("bf16", "max"), ("i64", "min"), ("f64", "sum")])
def test_allreduce_command_dtypes(dtype: str, op: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["allreduce", "--nodes", "2", "--count", "9001", "--dtype", dtype, "--op", op, "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["equals_reference"] is True


@pytest.mark.slow
def test_allreduce_command_under_loss(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "allreduce",
        "--nodes",
        "3",
        "--count",
        # ~100 chunks: 5% loss spares every chain datagram (and so re-sends none) in ~2e-7 of
        # runs; at 50,000 elements (~25 chunks, ~75 chain datagrams) it did in ~2% (one run
        # in a full suite showed 0 retransmits, exact).
        "200000",
        "--loss",
        "0.05",
        "--dup",
        "0.05",
        "--reorder",
        "0.05",
        "--seed",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["retransmits"] > 0


@pytest.mark.slow
def test_allreduce_command_at_an_emulation_mtu(capsys: pytest.CaptureFixture[str]) -> None:
    """SPEC.md 2.7 on real node processes: at --mtu 65000 the same all-reduce is exact in ~7x
    fewer datagrams with nothing re-sent, its model stays at the wire's MTU and says so; under
    loss, reordering and delay (datagrams held aside at their full 60 KiB) it is still exact."""
    base = ["allreduce", "--nodes", "4", "--size", "2MiB", "--repeat", "2"]
    runs = {}
    for mtu in ("9000", "65000"):
        # 8 MiB: 2 MiB blocks, 256 chunks each at 9000 and 35 at 65000, so the datagrams of a
        # call's start and end (~140 here) leave the ratio well above 5. At 2 MiB it was 4.9-5.1.
        argv = ["allreduce", "--nodes", "4", "--size", "8MiB", "--repeat", "2", "--mtu", mtu]
        assert main([*argv, "--json"]) == 0
        runs[mtu] = json.loads(capsys.readouterr().out)
    wire, emulated = runs["9000"], runs["65000"]
    for r in (wire, emulated):
        assert r["ok"] is True and r["equals_reference"] is True, r.get("error")
        assert r["retransmits"] == 0 and r["kernel_drops"] == 0
    assert (wire["mtu"], emulated["mtu"], emulated["model_mtu"]) == (9000, 65000, 9000)
    assert emulated["model_seconds_100g"] == wire["model_seconds_100g"]
    assert emulated["packets"] * 5 < wire["packets"], (emulated["packets"], wire["packets"])
    assert main([*base, "--mtu", "65000"]) == 0
    assert "modelled at the wire's MTU 9000; this run's MTU 65000" in capsys.readouterr().out
    faults = ["--loss", "0.05", "--reorder", "0.1", "--delay", "0.1", "--delay-ms", "2"]
    assert main([*base, "--mtu", "65000", *faults, "--seed", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["equals_reference"] is True and r["retransmits"] > 0


@pytest.mark.slow
def test_every_collective_of_the_host_api_at_an_emulation_mtu() -> None:
    """SPEC.md 2.7 through the host API on real node processes at MTU 65000: all-reduce,
    reduce-scatter, all-gather and broadcast, each against numpy, ranks bitwise identical,
    with blocks of several 60 KiB chunks and one shorter."""
    world, count = 3, 3 * 40_000 + 2  # per rank ~160 KiB of f32: 3 chunks a block, the last short
    rng = np.random.default_rng(65000)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(world)]
    with start_cluster(world, memory=8 << 20, mtu=65000) as cluster:
        assert cluster.info.mtu == 65000
        with every_rank(cluster.info, world) as ranks:
            bufs = [x.copy() for x in inputs]
            works = [api_all_reduce(b, group=g, async_op=True) for g, b in zip(ranks, bufs)]
            for w in works:
                w.wait()
            expected = all_reduce_reference(inputs)
            assert all(b.tobytes() == expected.tobytes() for b in bufs)
            bounds = [r * count // world for r in range(world + 1)]
            outs = [np.empty(bounds[r + 1] - bounds[r], np.float32) for r in range(world)]
            works = [
                api.reduce_scatter_tensor(o, x.copy(), group=g, async_op=True)
                for g, o, x in zip(ranks, outs, inputs)
            ]
            for w in works:
                w.wait()
            for r in range(world):
                assert outs[r].tobytes() == expected[bounds[r] : bounds[r + 1]].tobytes()
            gathered = [np.empty(count, np.float32) for _ in range(world)]
            works = [
                api.all_gather_into_tensor(
                    o, inputs[r][bounds[r] : bounds[r + 1]].copy(), group=g, async_op=True
                )
                for r, (g, o) in enumerate(zip(ranks, gathered))
            ]
            for w in works:
                w.wait()
            whole = np.concatenate([inputs[r][bounds[r] : bounds[r + 1]] for r in range(world)])
            assert all(o.tobytes() == whole.tobytes() for o in gathered)
            copies = [
                inputs[1].copy() if r == 1 else np.zeros(count, np.float32) for r in range(world)
            ]
            works = [api.broadcast(b, src=1, group=g, async_op=True) for g, b in zip(ranks, copies)]
            for w in works:
                w.wait()
            assert all(b.tobytes() == inputs[1].tobytes() for b in copies)


@pytest.mark.slow
def test_allreduce_command_sparse(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "allreduce",
        "--nodes",
        "3",
        "--count",
        "60000",
        "--sparse",
        "--density",
        "0.05",
        "--json",
    ]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["equals_reference"] is True and r["dense_equals_reference"] is True
    assert r["wire_bytes"] == r["wire_bytes_sparse"] > 0
    assert r["wire_bytes_sparse"] < 0.5 * r["wire_bytes_dense"]


HOST = r"""
import sys, json, numpy as np, netdam
cluster, rank = sys.argv[1], int(sys.argv[2])
group = netdam.init(cluster, rank)
world = netdam.get_world_size()
out = {}
x = np.arange(10, dtype=np.float32) + rank
netdam.all_reduce(x)
out["all_reduce"] = x.tolist()
y = netdam.empty(7, np.float64)          # lives in NIC memory: no staging copy
y[:] = rank + 1
netdam.all_reduce(y, op=netdam.ReduceOp.MAX)
out["empty_max"] = y.tolist()
b = np.full(5, rank, np.int32)
netdam.broadcast(b, src=1)
out["broadcast"] = b.tolist()
full = np.zeros(6, np.float32)
netdam.all_gather(full, np.full(6 // world, rank, np.float32))
out["all_gather"] = full.tolist()
part = np.zeros(6 // world, np.float32)
netdam.reduce_scatter(part, np.ones(6, np.float32) * (rank + 1))
out["reduce_scatter"] = part.tolist()
netdam.barrier()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_host_api_from_separate_host_processes(tmp_path: Path) -> None:
    with start_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        hosts = [
            subprocess.Popen(
                [sys.executable, "-c", HOST, str(cluster.path), str(rank)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outs = []
        for host in hosts:
            stdout, stderr = host.communicate(timeout=120)
            assert host.returncode == 0, stderr
            outs.append(json.loads(stdout))
    assert outs[0] == outs[1]
    r = outs[0]
    assert r["all_reduce"] == (2 * np.arange(10) + 1).tolist()
    assert r["empty_max"] == [2.0] * 7
    assert r["broadcast"] == [1] * 5
    assert r["all_gather"] == [0, 0, 0, 1, 1, 1]
    assert r["reduce_scatter"] == [3.0] * 3


@pytest.mark.slow
@pytest.mark.alone
def test_dead_node_process_is_named_within_5_seconds_with_every_nic(tmp_path: Path) -> None:
    """The process hosting ranks 2 and 3 dies: the survivors' collective fails within 5 s and
    names both NICs it took with it (the watchdog lists every silent node)."""
    with start_cluster(
        4, memory=1 << 22, cluster_path=tmp_path / "c.toml", nics_per_process=2
    ) as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(4)]
        warm = [np.ones(4, np.float32) for _ in range(4)]
        for work in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(warm, groups)]:
            work.wait()
        victim = cluster.process_of(2)
        assert cluster.ranks_of(victim.pid) == [2, 3]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        start = time.monotonic()
        works = [
            api_all_reduce(np.ones(200_000, np.float32), group=g, async_op=True) for g in groups[:2]
        ]
        with pytest.raises(CollectiveError) as info:
            for work in works:
                work.wait()
        elapsed = time.monotonic() - start
        assert elapsed < 5.0
        for node in cluster.info.nodes[2:]:
            assert f"rank {node.rank} ({node.address}:{node.port})" in str(info.value)
        assert info.value.waiting_for is not None and "rank 2" in str(
            info.value.waiting_for["node"]
        )
        # The survivors stay usable.
        from netdam.cluster.control import ControlClient

        with ControlClient() as client:
            for node in cluster.info.nodes[:2]:
                client.ping(node.control_endpoint)
        for group in groups[:2]:
            group.close()
        for group in groups[
            2:
        ]:  # their nodes are gone: nothing to give back, no retries to wait for
            group.client.close()


@pytest.mark.slow
def test_ring_host_baseline_matches_chain_bitwise(capsys: pytest.CaptureFixture[str]) -> None:
    """The RoCE way (NICs move data, hosts reduce in the memory the NIC wrote) folds blocks in
    the chain's order, so both algorithms give the same bits; the only host copy besides the
    staging is each owner moving its finished block into its output buffer: the buffer once."""
    assert (
        main(["allreduce", "--nodes", "3", "--count", "30001", "--algo", "ring-host", "--json"])
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["algo"] == "ring-host" and r["equals_reference"] is True
    assert r["host_copy_bytes"] == 30001 * 4
    assert r["host_ignored_datagrams"] == 0  # nobody else sent the hosts anything


@pytest.mark.slow
@pytest.mark.parametrize("nodes,count", [(2, 1), (4, 3), (4, 2_500_001)])
def test_ring_host_pipelined_segments_and_tiny_counts(
    nodes: int, count: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Blocks of several 1 MiB segments (pipelined), and counts below the number of ranks (empty
    blocks): still the chain's bits."""
    assert (
        main(
            [
                "allreduce",
                "--nodes",
                str(nodes),
                "--count",
                str(count),
                "--algo",
                "ring-host",
                "--json",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is True and r["equals_reference"] is True and r["ranks_identical"] is True
