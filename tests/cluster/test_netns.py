"""Several hosts on one machine (issue 9): every node, the switch and a client in their own
network namespace on a bridge, at MTU 9000 and at MTU 1500.

Each site (one per MTU) starts three ``netdam node`` processes (n0, n1, n2), a ``netdam switch``
(sw) whose VIP the nodes trust, and a client host (cl), from a cluster file written by hand.
Every rank's host runs in its node's namespace (netdam.init, all_reduce, all_gather) while a
capture in the bridge's namespace records every frame: results are checked bitwise against
numpy, and the frames show what crossed the bridge and how large each datagram was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from netns_fabric import (
    NETNS_DIR,
    Capture,
    Fabric,
    Frame,
    NetnsCluster,
    cleanup_stale,
    gather_input,
    link_mtus,
    list_netns,
    netns_fabric,
    rank_input,
    start_netns_cluster,
    unavailable_reason,
)

from netdam.core.chunk_plan import block_bounds
from netdam.protocol.constants import (
    HEADER_SIZE,
    IP_UDP_OVERHEAD,
    MAX_PAYLOAD_BYTES,
    SEGMENT_SIZE,
    TAG_SIZE,
    DType,
    Opcode,
    ReduceOp,
    max_elements,
)
from netdam.protocol.payloads import Algo
from netdam.tools.allreduce import reference_chain_allreduce

DRIVER = str(Path(__file__).resolve().parents[1] / "netns_fabric.py")
NODES = ("n0", "n1", "n2")
COUNT = 100_003  # elements per rank: blocks of unequal size
SEED = 9


@dataclass
class RankResult:
    returncode: int
    stderr: str
    all_reduce: np.ndarray | None = None
    all_gather: np.ndarray | None = None
    stats: dict[str, object] | None = None


@dataclass
class Site:
    fabric: Fabric
    cluster: NetnsCluster
    ranks: list[RankResult]
    frames: list[Frame]  # while the ranks ran
    region: dict[str, object]  # allocated on the switch host
    pool: dict[str, dict[str, object]]  # what the client host reported
    pool_frames: list[Frame]  # while the client host ran

    @property
    def mtu(self) -> int:
        return self.fabric.mtu

    def ip(self, host: str) -> str:
        return self.fabric.host(host).ip


def run_ranks(fabric: Fabric, cluster: NetnsCluster, out: Path) -> list[RankResult]:
    """Every rank's host in its node's namespace, all at once (one process per rank, as a
    launcher starts them)."""
    procs = [
        fabric.popen(
            host,
            [
                sys.executable,
                DRIVER,
                "rank",
                "--cluster",
                str(cluster.path),
                "--rank",
                str(rank),
                "--count",
                str(COUNT),
                "--seed",
                str(SEED),
                "--out",
                str(out / f"rank{rank}.npz"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank, host in enumerate(cluster.nodes)
    ]
    results = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        result = RankResult(proc.returncode, err.decode(errors="replace"))
        if proc.returncode == 0:
            with np.load(out / f"rank{rank}.npz") as saved:
                result.all_reduce, result.all_gather = saved["all_reduce"], saved["all_gather"]
                result.stats = json.loads(saved["stats"].tobytes())
        results.append(result)
    return results


@pytest.fixture(scope="module", params=[9000, 1500], ids=lambda mtu: f"mtu{mtu}")
def site(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    mtu = int(request.param)
    work = tmp_path_factory.mktemp(f"netns{mtu}")
    with netns_fabric([*NODES, "sw", "cl"], mtu=mtu) as fabric:
        cluster = start_netns_cluster(fabric, NODES, work / "cluster.toml", switch="sw")
        with Capture(fabric) as capture:
            ranks = run_ranks(fabric, cluster, work)
        region = run_driver(fabric, "sw", ["alloc", "--cluster", str(cluster.path)])
        pool: dict[str, dict[str, object]] = {}
        with Capture(fabric) as pool_capture:
            if "error" not in region:
                # The "fitted" run cuts requests itself (1 KiB at 1500), the "default" run lets
                # PoolClient cut them for the cluster's MTU.
                piece = str(8192 if mtu >= 9000 else 1024)
                pool = run_driver(
                    fabric,
                    "cl",
                    [
                        "client",
                        "--cluster",
                        str(cluster.path),
                        "--bind",
                        fabric.host("cl").ip,
                        "--region",
                        json.dumps(region),
                        "--piece",
                        piece,
                    ],
                )
        yield Site(fabric, cluster, ranks, capture.frames, region, pool, pool_capture.frames)


def ok_ranks(site: Site) -> list[RankResult]:
    failed = [
        f"rank {r}: exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"
        for r, res in enumerate(site.ranks)
        if res.returncode != 0
    ]
    assert not failed, "; ".join(failed + site.cluster.dead_nodes())
    return site.ranks


def node_counters(site: Site) -> list[dict[str, object]]:
    """Every node's counters, as its rank's host read them after the collectives."""
    return [res.stats["counters"] for res in ok_ranks(site) if res.stats]


def counter(counters: dict[str, object], name: str, key: str = "") -> int:
    """A scalar counter, or one entry of ``ops``/``nacks`` (absent: 0)."""
    value = counters.get(name, 0)
    if key:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return value if isinstance(value, int) else 0


def run_driver(
    fabric: Fabric, host: str, args: list[str], timeout: float = 60.0
) -> dict[str, object]:
    """``python tests/netns_fabric.py ARGS`` in *host*'s namespace; its JSON line."""
    done = fabric.run(host, [sys.executable, DRIVER, *args], timeout=timeout)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def frames_from(
    frames: list[Frame], src: str | None = None, opcode: int | None = None
) -> list[Frame]:
    """Frames as they entered the bridge (each datagram once), filtered."""
    return [
        f
        for f in frames
        if not f.outgoing
        and f.port.startswith("ndp")
        and (src is None or f.src == src)
        and (opcode is None or f.opcode == opcode)
    ]


def assert_fits(frames: list[Frame], mtu: int) -> None:
    fragments = [f for f in frames if f.fragment]
    assert not fragments, f"{len(fragments)} IP fragments crossed the bridge, e.g. {fragments[0]}"
    over = [f for f in frames if f.datagram_bytes > mtu]
    assert not over, f"{len(over)} datagrams over MTU {mtu}, e.g. {over[0]}"


# ------------------------------------------------------------------------------ the fabric


def test_skip_reason_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    import netns_fabric

    monkeypatch.setattr(netns_fabric, "_probe_result", [])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in str(unavailable_reason())
    monkeypatch.setattr(netns_fabric, "_probe_result", [])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "iproute2" in str(unavailable_reason())


def test_fabric_leaves_nothing_behind() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sleeper = None
    with pytest.raises(RuntimeError, match="body failed"):
        with netns_fabric(["a", "b"], mtu=1500) as fabric:
            names = fabric.netns_names()
            assert all((NETNS_DIR / name).exists() for name in names)
            a, b = fabric.host("a").ip, fabric.host("b").ip
            sleeper = fabric.popen("a", ["sleep", "60"])
            receiver = fabric.popen(
                "b",
                [
                    sys.executable,
                    "-c",
                    "import socket; s = socket.socket(socket.AF_INET, "
                    f"socket.SOCK_DGRAM); s.bind(('{b}', 9999)); s.settimeout(10); "
                    "print(s.recvfrom(100)[1][0])",
                ],
                stdout=subprocess.PIPE,
            )
            time.sleep(0.3)
            send = fabric.run(
                "a",
                [
                    sys.executable,
                    "-c",
                    "import socket; s = socket.socket(socket.AF_INET, "
                    f"socket.SOCK_DGRAM); s.bind(('{a}', 0)); s.sendto(b'x', ('{b}', 9999))",
                ],
            )
            assert send.returncode == 0, send.stderr
            out, _ = receiver.communicate(timeout=10)
            assert out.decode().strip() == a, (
                "a datagram from host a reaches host b over the bridge"
            )
            raise RuntimeError("body failed")
    assert sleeper is not None and sleeper.poll() is not None
    assert not [n for n in list_netns() if n in names]
    # A namespace left by a test process that died (no such pid) is removed by the next fabric.
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"ndt{gone.pid}-0-x"
    subprocess.run(["ip", "netns", "add", dead], check=True)
    assert dead in cleanup_stale()
    assert dead not in list_netns()


@pytest.mark.slow
def test_links_and_namespaces(site: Site) -> None:
    mtus = link_mtus(site.fabric)
    assert len(mtus) == 1 + 2 * len(site.fabric.hosts)  # bridge, its ports, every host's nd0
    assert set(mtus.values()) == {site.mtu}, mtus
    # Every node process runs in its own host's namespace (same inode as /run/netns/NAME).
    assert not site.cluster.dead_nodes(), site.cluster.dead_nodes()
    for rank, host in enumerate(site.cluster.nodes):
        pid = site.cluster.info.nodes[rank].pid
        assert (
            Path(f"/proc/{pid}/ns/net").stat().st_ino
            == (NETNS_DIR / site.fabric.host(host).netns).stat().st_ino
        )


# ------------------------------------------------------------------------------ collectives


@pytest.mark.slow
def test_all_reduce_is_the_reference_on_every_rank(site: Site) -> None:
    ranks = ok_ranks(site)
    reference = reference_chain_allreduce(
        [rank_input(SEED, r, COUNT) for r in range(len(ranks))], ReduceOp.SUM
    )
    results = [res.all_reduce.tobytes() for res in ranks if res.all_reduce is not None]
    assert len(results) == len(ranks)
    for r, result in enumerate(results):
        assert result == results[0], f"rank {r} differs from rank 0"
        assert result == reference.tobytes(), f"rank {r} differs from the numpy reference"


def test_all_gather_is_exact_on_every_rank(site: Site) -> None:
    ranks = ok_ranks(site)
    world = len(ranks)
    expected = np.concatenate(
        [gather_input(SEED, r, (r + 1) * COUNT // world - r * COUNT // world) for r in range(world)]
    )
    for r, res in enumerate(ranks):
        assert res.all_gather is not None and res.all_gather.tobytes() == expected.tobytes(), (
            f"rank {r}"
        )


def test_chains_cross_the_bridge_in_datagrams_that_fit_the_mtu(site: Site) -> None:
    """Chain packets carry max_elements(MTU) elements: at MTU 1500 they shrink to 1500-byte
    datagrams (and there are ~6x more of them); nothing is fragmented or over the MTU."""
    world = len(site.cluster.nodes)
    frames = frames_from(site.frames)
    assert_fits(frames, site.mtu)
    # The host's collectives are tagged: each datagram ends with its tag (SPEC.md 2.6).
    per_packet = max_elements(site.mtu - TAG_SIZE, DType.F32, segments=world - 1)
    full = IP_UDP_OVERHEAD + HEADER_SIZE + SEGMENT_SIZE * (world - 1) + 4 * per_packet + TAG_SIZE
    chains = [f for f in frames if f.opcode == Opcode.CHAIN_ADD]
    assert chains, "no CHAIN_ADD crossed the bridge"
    assert max(f.datagram_bytes for f in chains) == full <= site.mtu
    # Every node started chains that reached its successor through the bridge.
    for host in site.cluster.nodes:
        assert frames_from(chains, src=site.ip(host)), (
            f"no CHAIN_ADD from {host} crossed the bridge"
        )
    bounds = block_bounds(Algo.ALL_REDUCE, COUNT, world, 0)
    chunks = sum(-(-int(bounds[j + 1] - bounds[j]) // per_packet) for j in range(world))
    counters = node_counters(site)
    received = sum(counter(c, "ops", "CHAIN_ADD") for c in counters)
    # Re-sent chains: RTO retransmits, and re-asks of a hop that answered BUSY (not counted).
    resent = sum(counter(c, "retransmits") + counter(c, "nacks", "BUSY") for c in counters)
    assert chunks * (world - 1) <= received <= (chunks + resent) * (world - 1), (
        chunks,
        received,
        resent,
    )
    assert sum(f.segments for f in chains) >= chunks * (world - 1)
    for c in counters:
        assert (
            counter(c, "drop_oversize")
            == counter(c, "kernel_drops")
            == counter(c, "send_drops")
            == 0
        ), c


def test_multicast_all_write_crosses_the_bridge(site: Site) -> None:
    """Each node's ALL_WRITE to the group leaves through the bridge to every other node (the
    node pins its multicast to its own address, not loopback) and every node takes some in."""
    ok_ranks(site)
    multicast = [
        f for f in site.frames if f.opcode == Opcode.ALL_WRITE and f.dst.startswith("239.")
    ]
    assert_fits(multicast, site.mtu)
    for host in site.cluster.nodes:
        port = site.fabric.host(host).port
        senders = {f.src for f in multicast if f.outgoing and f.port == port}
        others = {site.ip(h) for h in site.cluster.nodes if h != host}
        assert senders == others, (
            f"multicast reaching {host}: from {sorted(senders)}, expected {sorted(others)}"
        )
    for c in node_counters(site):
        assert counter(c, "ops", "ALL_WRITE") > 0, c["ops"]


# ------------------------------------------------------------------------------ the pool


def pool_run(site: Site, mode: str) -> tuple[dict[str, object], list[Frame]]:
    """The client host's report of one run and the frames of its socket (by port)."""
    assert "error" not in site.region, f"alloc on the switch host failed: {site.region}"
    run = site.pool[mode]
    port = run.get("port")
    return run, [f for f in frames_from(site.pool_frames) if port in (f.sport, f.dport)]


def test_pool_from_a_client_host(site: Site) -> None:
    """A region interleaved over every node (allocated on the switch host); WRITE, READ and
    FETCH_ADD from the client host through the VIP: requests cross to the switch, the switch
    sends them on to the nodes, the nodes answer the client directly."""
    assert site.region.get("ways") == len(NODES), site.region
    run, frames = pool_run(site, "fitted")
    assert run.get("ok"), run
    assert_fits(frames, site.mtu)
    writes = frames_from(frames, src=site.ip("cl"), opcode=Opcode.WRITE)
    assert writes and {f.dst for f in writes} == {site.ip("sw")}
    switched = {
        f.dst for f in frames_from(site.pool_frames, src=site.ip("sw"), opcode=Opcode.WRITE)
    }
    assert switched == {site.ip(h) for h in NODES}, "the interleaved region spans every node"
    answers = {
        f.src for f in frames_from(frames, opcode=Opcode.READ_RESP) if f.dst == site.ip("cl")
    }
    assert answers == {site.ip(h) for h in NODES}, "nodes answer the client directly"


def test_pool_alloc_from_a_client_host(site: Site) -> None:
    """The controller on the client host: alloc waits for the switch's COUNTERS, which outgrow a
    1500-byte datagram with a region; they come back through the management port, fragmented."""
    assert site.pool.get("alloc", {}).get("ways") == len(NODES), site.pool.get("alloc")


def test_pool_requests_shrink_to_the_mtu(site: Site) -> None:
    """PoolClient's own splitting (pool.write/read of 20000 bytes), given the cluster file's MTU
    as `netdam pool` does, fits the path MTU: no fragments, no datagram over the MTU."""
    run, frames = pool_run(site, "default")
    assert_fits(frames, site.mtu)
    assert run.get("ok"), run
    # Not just small: the largest WRITE fills a datagram (8 KiB pieces at 9000, 1400 B at 1500),
    # its tag included (the region is tagged, SPEC.md 2.6).
    largest = min(MAX_PAYLOAD_BYTES, site.mtu - IP_UDP_OVERHEAD - HEADER_SIZE - TAG_SIZE)
    writes = frames_from(frames, src=site.ip("cl"), opcode=Opcode.WRITE)
    assert (
        max(f.datagram_bytes for f in writes) == IP_UDP_OVERHEAD + HEADER_SIZE + largest + TAG_SIZE
    )


@pytest.mark.slow
def test_netdam_ping_from_another_host(site: Site) -> None:
    """The CLI's control client reaches nodes on other hosts (it binds the wildcard)."""
    done = site.fabric.run(
        "cl",
        [
            sys.executable,
            "-m",
            "netdam",
            "ping",
            "--cluster",
            str(site.cluster.path),
            "--count",
            "1",
            "--json",
        ],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    answered = json.loads(done.stdout)["nodes"]
    assert [n["info"]["rank"] for n in answered] == list(range(len(NODES)))
    assert all(n["info"]["mtu"] == site.mtu for n in answered)
