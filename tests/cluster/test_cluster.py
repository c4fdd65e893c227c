"""Real node processes on loopback: up/down/stats/ping, no orphans, shared memory, examples."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from netdam.cli.main import main
from netdam.cluster.clusterfile import load_cluster
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.cluster.launch import process_alive as alive
from netdam.core.faults import FaultSpec
from netdam.protocol import counters as C
from netdam.protocol.constants import RIGHTS_ALL, Opcode, Status
from netdam.protocol.packet import Packet

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    with start_cluster(2, memory=1 << 20, cluster_path=path) as running:
        yield running


@pytest.mark.slow
def test_cluster_file_and_ping(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    info = load_cluster(cluster.path)
    assert [n.rank for n in info.nodes] == [0, 1] and all(alive(n.pid) for n in info.nodes)
    assert all(Path(n.memory_file).stat().st_size == 1 << 20 for n in info.nodes)
    assert main(["ping", "--cluster", str(cluster.path), "--count", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [n["answered"] for n in result["nodes"]] == [2, 2]
    assert [n["info"]["rank"] for n in result["nodes"]] == [0, 1]


def test_stats_json(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--cluster", str(cluster.path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and len(result["nodes"]) == 2
    node = result["nodes"][0]
    assert node["rcvbuf_bytes"] >= 1 << 20 and node["kernel_drops"] == 0
    assert node["ops"]["COUNTERS"] >= 1


def test_wire_operations_on_a_real_node(cluster: LocalCluster) -> None:
    ep = cluster.endpoints[0]
    with ControlClient.for_cluster(cluster.info) as client:
        rkey = client.register(ep, 4096, 4096, RIGHTS_ALL)
        client.write(ep, rkey, 4096, b"abcdefgh")
        assert client.read(ep, rkey, 4096, 8) == b"abcdefgh"
        with pytest.raises(ControlError, match="OUT_OF_BOUNDS") as info:
            client.read(ep, rkey, 8190, 8)
        assert info.value.status == Status.OUT_OF_BOUNDS
        with pytest.raises(ControlError, match="UNAUTHORIZED"):
            client.request(ep, Packet(Opcode.COUNTERS, rkey=123))
        client.deregister(
            ep, rkey
        )  # one owner per byte: leave the memory to the module's next tests


def test_host_processes_attach_in_turn_and_memory_survives(cluster: LocalCluster) -> None:
    """The CXL/PCIe stand-in: two host processes map the node's memory one after the other."""
    node = cluster.info.nodes[1]
    path = node.memory_file
    writer = f"import numpy as np; from netdam.shell.shm import attach; m = attach({path!r}); m[100:108] = np.arange(1, 9, dtype=np.uint8); m.flush(); print('wrote')"
    reader = (
        f"from netdam.shell.shm import attach; m = attach({path!r}); print(m[100:108].tolist())"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", writer], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "wrote"
    )
    out = subprocess.run(
        [sys.executable, "-c", reader], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[1, 2, 3, 4, 5, 6, 7, 8]"
    # The node itself sees the host's stores (same pages).
    with ControlClient.for_cluster(cluster.info) as client:
        rkey = client.register(node.endpoint, 0, 4096, RIGHTS_ALL)
        assert client.read(node.endpoint, rkey, 100, 8) == bytes(range(1, 9))
        client.write(node.endpoint, rkey, 200, b"\xaa\xbb")
        from netdam.shell.shm import attach

        assert bytes(attach(node.memory_file)[200:202]) == b"\xaa\xbb"
        client.deregister(
            node.endpoint, rkey
        )  # which wipes the region: memory reaches the next owner zeroed
        assert bytes(attach(node.memory_file)[0:4096]) == bytes(4096)


def test_plain_socket_client_example(cluster: LocalCluster) -> None:
    """Runs any number of times against the same node (issue 14: the second run used to find
    its counter at 10), and leaves no region behind."""
    from netdam.shell.shm import attach

    ep = cluster.endpoints[0]
    memory = attach(cluster.info.nodes[0].memory_file)
    low = bytes(memory[:8192])  # where the pool's first region would live
    for _ in range(3):
        result = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "plain_socket_client.py"),
                "--node",
                f"{ep[0]}:{ep[1]}",
                "--cluster",
                str(cluster.path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert "wrote and read back" in result.stdout and result.stdout.strip().endswith("ok")
    assert bytes(memory[:8192]) == low, "the example wrote into memory the pool hands out"


FLOOD = r"""
import sys, time, numpy as np
from netdam.protocol.packet import Packet, encode_packet, endpoint_to_u64
from netdam.protocol.constants import Opcode
from netdam.kernels.udp_io import send_batch_kernel, MAX_MSGS, SEND_SCRATCH_WORDS_PER_MSG, STATE_LEN
from netdam.shell.udp import open_udp_socket
host, port, rkey, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
pkt = encode_packet(Packet(Opcode.WRITE, rkey=rkey, addr=0, length=8192, payload=bytes(8192)))
n = 64
buf = np.frombuffer(pkt * n, np.uint8).copy()
offs = np.arange(n, dtype=np.int64) * len(pkt)
lens = np.full(n, len(pkt), np.int32)
dsts = np.full(n, endpoint_to_u64((host, port)), np.uint64)
scratch = np.zeros(MAX_MSGS * SEND_SCRATCH_WORDS_PER_MSG, np.int64)
state = np.zeros(STATE_LEN, np.int64)
sock = open_udp_socket(("127.0.0.1", 0))
send_batch_kernel(sock.fileno(), buf, offs, lens, dsts, n, scratch, state)
print("flooding", flush=True)
end = time.monotonic() + seconds
sent = 0
while time.monotonic() < end:
    sent += send_batch_kernel(sock.fileno(), buf, offs, lens, dsts, n, scratch, state)
print(sent, flush=True)
"""


@pytest.mark.slow
@pytest.mark.alone
def test_stats_answers_within_100ms_under_full_load(cluster: LocalCluster) -> None:
    ep = cluster.endpoints[1]
    with ControlClient.for_cluster(cluster.info) as client:
        rkey = client.register(ep, 0, 1 << 20, RIGHTS_ALL)
        before = client.counters(ep)
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, ep[0], str(ep[1]), str(rkey), "4"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            time.sleep(0.5)
            latencies = []
            for _ in range(20):
                start = time.perf_counter()
                values = client.counters(cluster.info.nodes[1].control_endpoint, timeout=1.0)
                latencies.append(time.perf_counter() - start)
                time.sleep(0.05)
        finally:
            flood.kill()  # the load only has to outlast the 20 samples (~1.6 s of its 4 s)
            flood.wait(timeout=30)
    handled = int(values[C.OPCODE_BASE + Opcode.WRITE] - before[C.OPCODE_BASE + Opcode.WRITE])
    assert handled > 10_000, "the node was not under load"
    assert max(latencies) < 0.1, latencies


@pytest.mark.slow
def test_faults_injected_on_receive() -> None:
    with start_cluster(1, memory=1 << 16, faults=FaultSpec(loss=0.5, dup=0.2, seed=3)) as running:
        ep = running.endpoints[0]
        with ControlClient.for_cluster(running.info) as client:
            answered = 0
            for _ in range(60):
                try:
                    # 50 ms is hundreds of loopback round trips: a PING lost to the fault
                    # injection, not a slow one (was 0.2 s: 6 s of waiting for nothing).
                    client.request(ep, Packet(Opcode.PING), timeout=0.05, retries=0)
                    answered += 1
                except ControlError:
                    pass
            values = client.request(
                ep, Packet(Opcode.COUNTERS, rkey=running.info.admin_key), timeout=0.2, retries=20
            )
        counts = np.frombuffer(values.payload, "<u8")
        assert 10 < answered < 55 and counts[C.DROP_FAULT] > 10


@pytest.mark.slow
def test_detach_down_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    assert (
        main(
            [
                "up",
                "--nodes",
                "2",
                "--memory",
                "64KiB",
                "--detach",
                "--cluster",
                str(path),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["cluster"] == str(path)
    info = load_cluster(path)
    assert main(["down", "--cluster", str(path)]) == 0
    assert not path.exists()
    assert not any(alive(n.pid) for n in info.nodes)
    assert not any(Path(n.memory_file).exists() for n in info.nodes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", [signal.SIGINT]
)  # SIGTERM and SIGKILL, with a switch too: test_failures.py
def test_foreground_up_leaves_no_orphans(tmp_path: Path, how: signal.Signals) -> None:
    path = tmp_path / "c.toml"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "netdam",
            "up",
            "--nodes",
            "2",
            "--memory",
            "64KiB",
            "--cluster",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert up.stdout is not None and up.stdout.readline().strip() == str(path)
    info = load_cluster(path)
    up.send_signal(how)
    up.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(n.pid) for n in info.nodes):
        time.sleep(0.05)
    assert not any(alive(n.pid) for n in info.nodes)
    assert not any(Path(n.memory_file).exists() for n in info.nodes)


def test_node_refuses_memory_it_cannot_get(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["node", "--bind", "127.0.0.1:0", "--memory", "1024GiB", "--shm-dir", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "lower --memory or pass --shm-dir" in err and str(tmp_path) in err


def test_unknown_cluster_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as usage:  # checked when the command line is parsed
        main(["stats", "--cluster", str(tmp_path / "nope.toml"), "--json"])
    assert usage.value.code == 2
    assert "start a cluster with `netdam up`" in json.loads(capsys.readouterr().out)["error"]


def test_fetch_add_counter_shared_by_processes(cluster: LocalCluster) -> None:
    ep = cluster.endpoints[0]
    with ControlClient.for_cluster(cluster.info) as a, ControlClient() as b:
        rkey = a.register(ep, 8192, 64, RIGHTS_ALL)
        for client in (a, b, a, b):
            client.request(
                ep,
                Packet(
                    Opcode.FETCH_ADD,
                    rkey=rkey,
                    addr=8192,
                    dtype=5,
                    length=8,
                    payload=struct.pack("<Q", 1),
                ),
            )
        reply = a.request(ep, Packet(Opcode.READ, rkey=rkey, addr=8192, length=8))
        assert struct.unpack("<Q", reply.payload)[0] == 4


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="exception notes are Python 3.11's (PEP 678)"
)
def test_an_error_inside_a_cluster_names_each_nodes_health(tmp_path: Path) -> None:
    """An exception raised while a cluster runs leaves with one note per NIC, taken before
    the nodes stop: a killed process's exit code and log, a running one's /proc state and its
    non-zero counters (what a "no answer from ..." in CI needs to be told apart: dead, stuck,
    or dropping)."""
    with pytest.raises(RuntimeError) as caught:
        with start_cluster(
            2, memory=1 << 20, cluster_path=tmp_path / "c.toml", nics_per_process=1
        ) as running:
            victim = running.process_of(0)
            victim.kill()
            victim.wait(timeout=10)
            raise RuntimeError("inside the cluster")
    notes = caught.value.__notes__
    assert len(notes) == 2, notes
    assert notes[0].startswith("rank 0 ") and "exited with code -9" in notes[0], notes
    assert notes[1].startswith("rank 1 ") and "running, state " in notes[1], notes
    # Its only datagram: the note's own COUNTERS.
    assert "rx_packets=1," in notes[1] and "ops={'COUNTERS': 1}" in notes[1], notes


def test_stopping_signals_no_child_of_ours_already_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node a test killed and reaped is not signalled again when its cluster stops: its pid
    may belong to another process by then. A live one is."""
    from netdam.cluster import launch

    sent: list[tuple[int, int]] = []
    real_signal = launch._signal
    monkeypatch.setattr(
        launch, "_signal", lambda pid, sig: (sent.append((pid, sig)), real_signal(pid, sig))
    )
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launch.stop_pids([gone.pid, live.pid], 5.0, processes=[gone, live])
    assert sent == [(live.pid, signal.SIGTERM)]
    assert live.poll() is not None
