"""Many emulated NICs per node process (netdam.shell.nic_host): each NIC is what it is alone in
its process (own address, memory, keys, counters), the collectives over them are exact, and a
dead process is named with every NIC it took with it (the collectives' watchdog naming them:
test_allreduce.test_dead_node_process_is_named_within_5_seconds_with_every_nic)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from netdam.api import ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.cli.main import main
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import placement, start_cluster
from netdam.protocol import counters as C
from netdam.protocol.constants import Opcode, ReduceOp
from netdam.protocol.packet import Packet, encode_packet
from netdam.shell import nic_host
from netdam.shell.nic_host import NicHost
from netdam.shell.node_process import NodeProcessConfig
from netdam.tools.allreduce import reference_chain_allreduce


def _all_reduce(groups: list[ProcessGroup], inputs: list[np.ndarray]) -> list[np.ndarray]:
    buffers = [x.copy() for x in inputs]
    works = [
        api_all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, groups, strict=True)
    ]
    for work in works:
        work.wait()
    return buffers


def test_placement_spreads_nics_over_one_process_per_core() -> None:
    cores = os.cpu_count() or 1
    assert placement(1) == 1
    assert placement(4 * cores) == 4
    assert placement(4 * cores + 1) == 5
    assert placement(256, 1) == 1
    with pytest.raises(ValueError, match="at least 1"):
        placement(4, 0)


def test_a_process_of_a_few_nics_spins_only_while_a_collective_runs() -> None:
    """A process hosting at most SPIN_MAX_NICS NICs polls SPIN_S without sleeping before it
    waits, and only while a NIC's clock runs, it would wait at all, and the cluster's node
    processes here fit the cores: an idle process never spins, and one of many NICs, or one of
    more processes than cores, leaves the core to the others (docs/PERFORMANCE.md)."""
    spin = nic_host.spin_s
    assert spin(4, clocked=True, wait_ms=1, processes=2, cores=2) == nic_host.SPIN_S > 0
    assert spin(nic_host.SPIN_MAX_NICS, True, 1, 2, 2) == nic_host.SPIN_S
    assert spin(nic_host.SPIN_MAX_NICS + 1, True, 1, 2, 2) == 0.0
    assert spin(2, True, 1, processes=4, cores=2) == 0.0
    assert spin(4, clocked=False, wait_ms=1000, processes=1, cores=2) == 0.0
    assert spin(4, clocked=True, wait_ms=0, processes=1, cores=2) == 0.0
    assert nic_host.SPIN_S < nic_host.CLOCK_WAIT_MS / 1000  # a spin never outlasts the wait


def test_a_process_that_leaves_a_core_to_the_hosts_lingers_after_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For LINGER_S after a collective's clock stopped, a process polls before it sleeps too,
    only while the cluster's node processes here are fewer than the cores (a core is left to
    the hosts, whose next START_COLL then wakes nobody); where they fill the cores, or past
    LINGER_S, it sleeps at once."""
    spin = nic_host.spin_s
    assert spin(2, clocked=False, wait_ms=20, processes=1, cores=2, lingering=True) > 0
    assert spin(2, False, 20, processes=2, cores=2, lingering=True) == 0.0
    assert spin(2, False, 20, processes=1, cores=1, lingering=True) == 0.0
    assert spin(nic_host.SPIN_MAX_NICS + 1, False, 20, 1, 2, lingering=True) == 0.0
    assert spin(2, False, 0, 1, 2, lingering=True) == 0.0

    monkeypatch.setattr(nic_host, "CORES", 2)
    host = NicHost.__new__(NicHost)  # the pass's spin decision only: no sockets
    host.nics = [object(), object()]  # type: ignore[list-item]
    host._clock_seen, host._board_processes = -math.inf, 1
    host._clocked = set()
    assert host._spin_before(20, 100.0) == 0.0  # no collective yet: sleeps at once
    host._clocked = {0}
    assert host._spin_before(1, 100.0) == nic_host.SPIN_S  # its clock runs
    host._clocked = set()
    assert host._spin_before(20, 100.0 + nic_host.LINGER_S / 2) == nic_host.SPIN_S
    assert host._spin_before(20, 100.0 + 2 * nic_host.LINGER_S) == 0.0
    host._board_processes = 2  # the node processes fill the cores
    host._clocked = {1}
    assert host._spin_before(1, 200.0) == nic_host.SPIN_S
    host._clocked = set()
    assert host._spin_before(20, 200.0 + nic_host.LINGER_S / 2) == 0.0


def test_a_nic_the_compiled_sweep_visited_gets_its_control_plane_run(tmp_path: Path) -> None:
    """NIC 0's NACK to a READ sent from NIC 1's socket reaches NIC 1 during the pass that
    serves NIC 0, whose compiled call sweeps again and visits NIC 1 (serve._serve_nics); NIC 1
    was not due when the pass began, and still gets its control plane (the NACK it punted)
    after the call, as a NIC of the pass's order does."""
    host = NicHost(
        [
            NodeProcessConfig(
                memory_bytes=1 << 20, bind=("127.0.0.1", 0), shm_dir=tmp_path, name=f"n{k}"
            )
            for k in range(2)
        ]
    )
    try:
        host.warm_up()
        seen: list[int] = []
        after_visit = host._after_visit

        def recorded(k: int, ready: set[int]) -> None:
            seen.append(k)
            after_visit(k, ready)

        host._after_visit = recorded  # type: ignore[method-assign]
        read = Packet(opcode=Opcode.READ, client_id=1, txn_id=9, rkey=12345, length=8)
        host.nics[1].sock.sendto(encode_packet(read), host.nics[0].endpoint)
        time.sleep(0.05)
        punted = int(host.nics[1].core.counters[C.PUNTED])
        host.serve_once(0)
        assert int(host.nics[1].core.counters[C.PUNTED]) == punted + 1  # taken in the sweep
        assert sorted(seen) == [0, 1]
    finally:
        host.close()


@pytest.mark.parametrize("per", [3, 1])
def test_nics_in_one_process_are_separate_nics(per: int, tmp_path: Path) -> None:
    """Whatever the placement: each NIC answers on its own address with its own rank and memory
    size, keeps its own counters, and the all-reduce over them equals its numpy reference
    bitwise on every rank."""
    with start_cluster(
        3, memory=1 << 20, nics_per_process=per, cluster_path=tmp_path / "c.toml"
    ) as cluster:
        nodes = cluster.info.nodes
        assert len(cluster.processes) == 3 // per
        assert len({n.pid for n in nodes}) == 3 // per
        assert sorted(cluster.ranks_of(nodes[0].pid)) == list(range(per))
        assert len({n.memory_file for n in nodes}) == 3 and all(
            Path(n.memory_file).exists() for n in nodes
        )
        with ControlClient.for_cluster(cluster.info) as client:
            for node in nodes:
                info, _ = client.ping(node.endpoint)
                assert info["rank"] == node.rank and info["memory_bytes"] == 1 << 20
            before = [client.counters(n.control_endpoint) for n in nodes]
            client.ping(nodes[1].endpoint)  # one NIC's traffic shows on that NIC alone
            after = [client.counters(n.control_endpoint) for n in nodes]
        grew = [k for k in range(3) if after[k][C.TX_PACKETS] > before[k][C.TX_PACKETS]]
        assert grew == [1]
        groups = [ProcessGroup(cluster.info, rank) for rank in range(3)]
        rng = np.random.default_rng(27)
        inputs = [rng.standard_normal(50_001).astype(np.float32) for _ in range(3)]
        results = _all_reduce(groups, inputs)
        expected = reference_chain_allreduce(inputs, ReduceOp.SUM)
        for out in results:
            assert out.tobytes() == expected.tobytes()
        for group in groups:
            group.close()


@pytest.mark.slow
def test_up_names_every_nic_of_a_process_that_died(tmp_path: Path) -> None:
    """`netdam up` in the foreground watches its node processes: when one dies it stops the
    cluster and its one error line names every NIC that process hosted."""
    path = tmp_path / "c.toml"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "netdam",
            "up",
            "--nodes",
            "4",
            "--nics-per-process",
            "2",
            "--memory",
            "1MiB",
            "--cluster",
            str(path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None and up.stdout.readline().strip() == str(path)
        from netdam.cluster.clusterfile import load_cluster

        info = load_cluster(path)
        victim = info.nodes[3].pid
        assert [n.rank for n in info.nodes if n.pid == victim] == [2, 3]
        os.kill(victim, signal.SIGKILL)
        _, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode != 0
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"pid {victim}" in line and "2 NICs" in line
    for node in info.nodes[2:]:
        assert f"rank {node.rank} ({node.address}:{node.port})" in line
    assert not path.exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nic", "0@127.0.0.1:1", "--bind", "127.0.0.1:2"], "--bind conflicts with --nic"),
        (["--nic", "0@127.0.0.1:1", "--nic", "0@127.0.0.1:2"], "names a rank twice"),
        (["--nic", "127.0.0.1:1"], "write RANK@IP:PORT"),
    ],
)
def test_node_nic_flag_errors_name_the_fix(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["node", *argv])
    except SystemExit as exc:  # argparse's own errors exit
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_stop_signals_a_shared_process_once(tmp_path: Path) -> None:
    """Stopping a cluster whose NICs share processes leaves nothing behind: no process, no
    memory file."""
    cluster = start_cluster(3, memory=1 << 20, nics_per_process=3, cluster_path=tmp_path / "c.toml")
    [proc] = cluster.processes
    files = [Path(n.memory_file) for n in cluster.info.nodes]
    start = time.monotonic()
    cluster.stop()
    assert proc.poll() is not None and time.monotonic() - start < 5
    assert not any(f.exists() for f in files)


@pytest.mark.slow
def test_a_collective_over_the_most_nics_one_sr_list_names_is_exact(tmp_path: Path) -> None:
    """64 NICs, the longest chain an SR list names (MAX_SEGMENTS): before, the DONE set of 64
    members was computed as (1 << 64) - 1, which LLVM makes 0, and every such collective
    failed on its watchdog after its data had all arrived."""
    from netdam.protocol.constants import MAX_SEGMENTS

    with start_cluster(MAX_SEGMENTS, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(MAX_SEGMENTS)]
        rng = np.random.default_rng(64)
        inputs = [rng.standard_normal(64 * 257).astype(np.float32) for _ in range(MAX_SEGMENTS)]
        results = _all_reduce(groups, inputs)
        expected = reference_chain_allreduce(inputs, ReduceOp.SUM)
        assert all(out.tobytes() == expected.tobytes() for out in results)
        for group in groups:
            group.close()


@pytest.mark.slow
@pytest.mark.alone
def test_128_nics_all_reduce_exact_and_resend_nothing() -> None:
    """Two processes of 64 NICs (a torus of 8 rows of 16): a pass of the host loop takes up to
    ~0.1 s on 2 cores, and before the NICs' timers covered it, chains and READs on their way
    were sent again (81-200 per 3 calls). A clean run re-sends nothing and overflows no
    socket buffer."""
    from netdam.tools.allreduce import AllReduceConfig, run_allreduce

    result = run_allreduce(AllReduceConfig(nodes=128, count=1 << 18, repeat=2))
    assert result["equals_reference"] and result["ranks_identical"]
    assert result["retransmits"] == 0 and result["kernel_drops"] == 0


def _thp_mode() -> str | None:
    """The system's transparent huge page mode ("always", "madvise", "never"), or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _anon_huge_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    _thp_mode() != "madvise",
    reason="huge pages come only where asked for when THP is 'madvise' (here: "
    f"{_thp_mode()}): with 'always' they come anyway, with 'never' not at all",
)
def test_a_nic_process_makes_no_huge_pages_of_its_sparse_tables(tmp_path: Path) -> None:
    """A NIC's large tables (duplicate window, send queue, chunk tables) are touched sparsely;
    numpy asks for 2 MiB pages for arrays of 4 MiB or more, so each first touch made 2 MiB
    resident: 64 NICs of one process had 152 MB of huge pages after one all-reduce of 1 MiB
    and grew ~1.6 MB each per run. A node process allocates them in 4 KiB pages
    (netdam.shell.startup.use_small_pages)."""
    with start_cluster(
        4, memory=4 << 20, nics_per_process=4, cluster_path=tmp_path / "c.toml"
    ) as cluster:
        [pid] = {n.pid for n in cluster.info.nodes}
        # What a forked process shares of its parent's pages counts too: only growth is its own.
        before = _anon_huge_kb(pid)
        groups = [ProcessGroup(cluster.info, rank) for rank in range(4)]
        inputs = [np.full(1 << 18, rank + 1, np.float32) for rank in range(4)]
        for _ in range(3):
            assert all(np.all(out == 10) for out in _all_reduce(groups, inputs))
        assert _anon_huge_kb(pid) <= before
        for group in groups:
            group.close()
