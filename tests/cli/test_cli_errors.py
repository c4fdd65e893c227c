"""Every user error is one line naming problem and fix, with the right exit code (issue 14).

A table of bad command lines, each run through the `netdam` entry point twice: plain (exit
code, exactly one line on stderr, no traceback, nothing on stdout) and with --json (the same
exit code, stdout exactly one JSON object with `error`). They fail before any node starts, so
the table runs in-process in seconds; a few cases also run as real processes, to check what a
shell sees (and Ctrl-C: exit 130).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
USAGE, RUN_FAILED = 2, 3

# (argv, exit code, a word the message must contain)
CASES: list[tuple[list[str], int, str]] = [
    (["allreduce", "--nodes", "1"], USAGE, "2..1024"),
    (["allreduce", "--nodes", "1025"], USAGE, "2..1024"),
    (["allreduce", "--nodes", "67"], USAGE, "use 66 or 68 ranks"),
    (["allreduce", "--nodes", "8", "--max-chain", "3"], USAGE, "does not split"),
    (["allreduce", "--nodes", "128", "--sparse"], USAGE, "--sparse runs in one chain"),
    (["allreduce", "--nodes", "8", "--max-chain", "1"], USAGE, "2..64"),
    (["allreduce", "--cluster", "missing.toml"], USAGE, "missing.toml"),
    (["allreduce", "--repeat", "0"], USAGE, "--repeat"),
    (["allreduce", "--timeout", "-1"], USAGE, "--timeout"),
    (["allreduce", "--timeout", "nan"], USAGE, "--timeout"),
    (["allreduce", "--delay-ms", "-5"], USAGE, "--delay-ms"),
    (["allreduce", "--loss", "2"], USAGE, "probability"),
    (["allreduce", "--loss", "x"], USAGE, "probability"),
    (["allreduce", "--size", "0"], USAGE, "--size"),
    (["allreduce", "--size", "4KB"], USAGE, "KiB"),
    (["allreduce", "--count", "0"], USAGE, "--count"),
    (["allreduce", "--density", "2"], USAGE, "--density"),
    (["allreduce", "--sparse", "--algo", "ring-host"], USAGE, "--sparse"),
    (["demo", "--size", "0"], USAGE, "--size"),
    (["demo", "--nodes", "1"], USAGE, "2..64"),
    (["up", "--nodes", "100000"], USAGE, "1..1024"),
    (["up", "--nodes", "0"], USAGE, "--nodes"),
    (["up", "--base-port", "70000"], USAGE, "65535"),
    (["up", "--base-port", "0"], USAGE, "65535"),
    (["up", "--base-port", "65534", "--nodes", "4"], USAGE, "--base-port"),
    (["up", "--memory", "0"], USAGE, "--memory"),
    (["up", "--memory", "1024GiB", "--nodes", "64"], USAGE, "--memory"),
    (["up", "--mtu", "100"], USAGE, "--mtu"),
    (["up", "--trace-records", "-1"], USAGE, "--trace-records"),
    (["allreduce", "--trace-records", "-1"], USAGE, "--trace-records"),
    (["allreduce", "--cluster", "CLUSTER2", "--trace-records", "64"], USAGE, "netdam up"),
    (["model", "replay", "missing-trace.json"], USAGE, "cannot read missing-trace.json"),
    (["model", "replay", "pyproject.toml"], USAGE, "netdam allreduce --trace"),
    (["model", "replay", "README.md", "--rto-us", "0"], USAGE, "--rto-us"),
    (["trace", "--cluster", "/nonexistent.toml", "--out", "t.json"], USAGE, "no such file"),
    (["trace", "--cluster", "CLUSTER2", "--out", "/nonexistent-dir/t.json"], USAGE, "--out"),
    (["trace", "--cluster", "CLUSTER2", "--out", "/tmp/netdam-t.json"], RUN_FAILED, "running"),
    (["up", "--mtu", "180", "--nodes", "8"], USAGE, "at least"),
    (["up", "--mtu", "abc"], USAGE, "MTU"),
    (["up", "--cluster", "/"], USAGE, "directory"),
    (["up", "--shm-dir", "/nonexistent-netdam-dir"], USAGE, "--shm-dir"),
    (["down", "--cluster", "/nonexistent.toml"], USAGE, "no such file"),
    (["stats", "--cluster", "/"], USAGE, "directory"),
    (["stats", "--cluster", "README.md"], USAGE, "TOML"),
    (["ping", "--node", "127.0.0.1:99999"], USAGE, "IP:PORT"),
    (["ping", "--node", "127.0.0.1:7744", "--count", "0"], USAGE, "--count"),
    (
        ["pool", "write", "--cluster", "README.md", "--gaddr", "0", "--file", "/nonexistent"],
        USAGE,
        "no such file",
    ),
    (
        ["pool", "write", "--cluster", "README.md", "--gaddr", "0", "--file", "/"],
        USAGE,
        "directory",
    ),
    (["pool", "alloc", "--cluster", "/nonexistent.toml", "--size", "4KiB"], USAGE, "no such file"),
    (
        [
            "pool",
            "alloc",
            "--cluster",
            "CLUSTER2",
            "--size",
            "64KiB",
            "--interleave",
            "8KiB",
            "--ways",
            "5",
        ],
        USAGE,
        "1..2",
    ),
    (
        ["pool", "alloc", "--cluster", "CLUSTER2", "--size", "64KiB", "--ways", "2"],
        USAGE,
        "--interleave",
    ),
    (["allreduce", "--cluster", "CLUSTER2_MTU150"], USAGE, "netdam up --mtu 172"),
    (["pool", "read", "--cluster", "CLUSTER2", "--gaddr", "0", "--length", "0"], USAGE, "--length"),
    (["soak", "--cluster", "/nonexistent.toml"], USAGE, "no such file"),
    (["soak", "--clients", "0"], USAGE, "--clients"),
    (["decode", "--pcap", "/nonexistent.pcap"], USAGE, "/nonexistent.pcap"),
    (["model", "op", "--count", "0"], USAGE, "--count"),
    (["model", "allreduce", "--nodes", "1", "--size", "1MiB"], USAGE, "2 nodes"),
    (["bench", "datapath", "--mtu", "50"], USAGE, "--mtu"),
    (["flood", "--senders", "9"], USAGE, "--senders"),
    # Outputs that could not be written: refused before any work (capture used to fail only
    # after capturing, up after starting its nodes).
    (
        ["up", "--detach", "--nodes", "2", "--cluster", "/nonexistent-netdam-dir/c.toml"],
        USAGE,
        "mkdir -p",
    ),
    (["up", "--detach", "--nodes", "2", "--cluster", "README.md/c.toml"], USAGE, "not a directory"),
    (
        ["capture", "--cluster", "CLUSTER2", "-o", "/nonexistent-netdam-dir/x.pcap"],
        USAGE,
        "does not exist",
    ),
    (
        [
            "model",
            "allreduce",
            "--nodes",
            "4",
            "--size",
            "1MiB",
            "--plot",
            "/nonexistent-netdam-dir/p.png",
        ],
        USAGE,
        "--plot",
    ),
    (["model", "sweep", "--plot", "README.md/p.png"], USAGE, "not a directory"),
    (["bench", "allreduce", "--plot", "/nonexistent-netdam-dir/p.png"], USAGE, "does not exist"),
    (["bench", "pool", "--plot", "/nonexistent-netdam-dir/p.png"], USAGE, "does not exist"),
    # More node memory than /dev/shm holds: name --size (allreduce has no --memory), before any node starts.
    (["allreduce", "--size", "1024GiB"], USAGE, "--size"),
    (["bench", "allreduce", "--size", "1024GiB"], USAGE, "--size"),
    # --nodes beside a cluster file of another size: refused, not silently replaced by the file's.
    (["allreduce", "--nodes", "3", "--cluster", "CLUSTER2"], USAGE, "--nodes 3 but"),
    (["allreduce", "--mtu", "65000", "--cluster", "CLUSTER2"], USAGE, "netdam up --mtu 65000"),
    (["allreduce", "--mtu", "70000"], USAGE, "65535"),
    (["bench", "allreduce", "--emulation-mtu", "9000"], USAGE, "not above the wire's MTU"),
    (["soak", "--nodes", "3", "--cluster", "CLUSTER2", "--seconds", "1"], USAGE, "--nodes 3 but"),
    # A stale cluster file (its processes are gone): exit 2 naming `netdam down`, not exit 3.
    (["allreduce", "--cluster", "STALE"], USAGE, "netdam down --cluster"),
    (["ping", "--cluster", "STALE"], USAGE, "netdam down --cluster"),
    (["pool", "list", "--cluster", "STALE"], USAGE, "netdam down --cluster"),
    (["capture", "--cluster", "STALE", "-o", "x.pcap"], USAGE, "netdam down --cluster"),
    (["soak", "--cluster", "STALE", "--seconds", "1"], USAGE, "netdam down --cluster"),
    (["nosuchcommand"], USAGE, "nosuchcommand"),
    (["allreduce", "--no-such-flag"], USAGE, "--no-such-flag"),
]


#: A pid no process has: above Linux's largest pid_max (2^22).
GONE_PID = (1 << 22) + 7


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster file of two nodes that are not running: `pool alloc` checks --ways against it
    before contacting anything."""
    path = tmp_path_factory.mktemp("errors") / "two.toml"
    path.write_text(
        '[cluster]\nname = "netdam-errors"\nadmin_key = 1\nmtu = 9000\n'
        '[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nport = 40001\n'
        '[[nodes]]\nrank = 1\naddress = "127.0.0.1"\nport = 40002\n'
    )
    return path


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of netdam's entry point; an exception escaping it fails the
    test (that would be a traceback)."""
    from netdam.cli.main import main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's exit (usage errors)
        code = int(exc.code or 0)
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return code, out.out, out.err


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "netdam", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _in_process(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """What _run gives, from netdam's entry point in this process: for tests about what a
    command says, not about the process (test_as_a_real_process is), ~1.3 s of start-up less."""
    code, out, err = _main(argv, capsys)
    return subprocess.CompletedProcess(["netdam", *argv], code, out, err)


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "code", "word"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line(
    argv: list[str], code: int, word: str, cluster2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = cluster2.with_name("two-mtu150.toml")
    small.write_text(cluster2.read_text().replace("mtu = 9000", "mtu = 150"))
    stale = cluster2.with_name("stale.toml")
    stale.write_text(
        cluster2.read_text()
        .replace("port = 40001\n", f"port = 40001\npid = {GONE_PID}\n")
        .replace("port = 40002\n", f"port = 40002\npid = {GONE_PID + 1}\n")
    )
    files = {"CLUSTER2": str(cluster2), "CLUSTER2_MTU150": str(small), "STALE": str(stale)}
    argv = [files.get(a, a) for a in argv]
    _check(argv, code, word, *_main(argv, capsys))
    _check_json(code, word, *_main([*argv, "--json"], capsys))


def _check(argv: list[str], code: int, word: str, got: int, out: str, err: str) -> None:
    assert got == code, (argv, got, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), lines[0]
    assert word in lines[0], lines[0]
    assert out == "", out


def _check_json(code: int, word: str, got: int, out: str, err: str) -> None:
    assert got == code, (got, err)
    assert "Traceback" not in err
    obj = json.loads(out)  # exactly one object: trailing text would fail here
    assert isinstance(obj, dict) and obj["ok"] is False and word in obj["error"], obj


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["node", "--nics-per-process", "2"], "--nics-per-process needs a rendezvous"),
        (["node", "--nic", "0@127.0.0.1:0", "--nics-per-process", "2"], "--nic already names"),
    ],
)
def test_node_misuse_of_nics_per_process_is_one_line(
    argv: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`netdam node` serves until stopped and has no --json: its usage errors, plain only."""
    _check(argv, USAGE, word, *_main(argv, capsys))


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 2, 16])
def test_as_a_real_process(index: int) -> None:
    argv, code, word = CASES[index]
    with ThreadPoolExecutor(2) as pool:  # the two processes at once: each mostly waits on imports
        plain, as_json = pool.map(_run, [argv, [*argv, "--json"]])
    _check(argv, code, word, plain.returncode, plain.stdout, plain.stderr)
    _check_json(code, word, as_json.returncode, as_json.stdout, as_json.stderr)


@pytest.mark.slow
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    out = _in_process(["--version"], capsys)
    assert out.returncode == 0 and out.stdout.startswith("netdam "), out


@pytest.mark.slow
def test_timeout_help_states_the_real_default(capsys: pytest.CaptureFixture[str]) -> None:
    out = _in_process(["allreduce", "--help"], capsys)
    assert "default 2.5" in " ".join(out.stdout.split())


@pytest.mark.slow
def test_sigint_exits_130(tmp_path: Path) -> None:
    """Ctrl-C during a run: exit 130, one line, no traceback (`up` in the foreground waits)."""
    import signal
    import time

    cluster = tmp_path / "c.toml"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "netdam",
            "ping",
            "--node",
            "127.0.0.1:9",
            "--count",
            "100000",
            "--timeout",
            "0.5",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Interrupt it inside its loop, once its UDP socket is open (not during imports).
    fds = Path(f"/proc/{proc.pid}/fd")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if any(os.readlink(fd).startswith("socket:") for fd in fds.iterdir()):
                break
        except OSError:
            pass
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not cluster.exists()


# ---------------------------------------------------------------- outputs checked before work


def test_unwritable_or_full_output_directory_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only directory (root ignores modes, so only as another user) and a full one: one
    line naming the directory and the fix, from a real probe write (os.access says yes to root)."""
    import errno

    from netdam.cli import common
    from netdam.cli.common import CommandError, check_writable_output

    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(CommandError) as denied:
            check_writable_output(ro / "c.toml", "--cluster")
        assert denied.value.code == USAGE and "not writable" in str(denied.value)

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common.os, "write", full)
    with pytest.raises(CommandError) as no_room:
        check_writable_output(tmp_path / "c.toml", "--cluster")
    monkeypatch.undo()
    message = str(no_room.value)
    assert no_room.value.code == USAGE and f"{tmp_path} is full" in message and "\n" not in message
    assert not list(tmp_path.iterdir())  # the probe is gone


@pytest.mark.slow
def test_up_leaves_nothing_behind_when_the_cluster_file_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills between the early check and the write: `up --detach` stops the nodes it
    started and removes their memory and log files (nothing else could: `down` needs the file)."""
    import errno

    from netdam.cluster import launch
    from netdam.cluster.launch import node_log

    started: list[tuple[str, list[subprocess.Popen[bytes]]]] = []
    spawn = launch._spawn_nodes

    def recording(
        spec: launch._NodeSpec, nodes: list[tuple[int, tuple[str, int], int]], per: int | None
    ) -> tuple[list[subprocess.Popen[bytes]], dict[int, tuple[int, int]]]:
        procs, started_nics = spawn(spec, nodes, per)
        started.append((spec.name, procs))
        return procs, started_nics

    def no_space(info: object, path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(launch, "_spawn_nodes", recording)
    monkeypatch.setattr(launch, "write_cluster", no_space)
    path = tmp_path / "c.toml"
    code, out, err = _main(["up", "--detach", "--nodes", "2", "--cluster", str(path)], capsys)
    assert code == USAGE, err
    assert len(err.strip().splitlines()) == 1 and "cannot write the cluster file" in err, err
    assert "please report" not in err and "--cluster" in err
    [(name, procs)] = started
    assert all(p.poll() is not None for p in procs)
    assert not list(Path("/dev/shm").glob(f"{name}-*"))
    assert not any(node_log(name, rank).exists() for rank in range(2))
    assert not path.exists()


# ---------------------------------------------------------------- a running cluster, edited


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A detached 2-node cluster with the switch, default memory (64 MiB per node)."""
    from netdam.cluster.launch import start_cluster, stop_cluster_file

    path = tmp_path_factory.mktemp("running") / "c.toml"
    # Detached, as `netdam up --detach` starts it: node processes of their own, whose command
    # lines name their ports (what the port diagnosis reads), not forks of this one.
    start_cluster(2, switch=True, detach=True, cluster_path=path)
    yield path
    stop_cluster_file(path)


def _wrong_port(path: Path) -> Path:
    """The cluster file with rank 1's data port edited by hand to one nothing listens on."""
    from netdam.cluster.clusterfile import load_cluster

    port = load_cluster(path).nodes[1].port
    bad = path.with_name("wrong-port.toml")
    bad.write_text(path.read_text().replace(f"port = {port}\n", f"port = {port + 1000}\n"))
    return bad


@pytest.mark.slow
def test_stats_names_a_rank_whose_port_is_wrong(
    running: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 0, rank 1 listed as healthy (its control port answered)."""
    bad = _wrong_port(running)
    out = _in_process(["stats", "--cluster", str(bad), "--json"], capsys)
    result = json.loads(out.stdout)
    assert out.returncode == USAGE, out.stderr
    assert result["ok"] is False and "rank 1" in result["error"] and "set port =" in result["error"]
    assert "error" in result["nodes"][1] and "error" not in result["nodes"][0]


def test_ping_names_a_rank_whose_port_is_wrong(
    running: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 3, `no answer` for rank 1 and nothing about why."""
    bad = _wrong_port(running)
    out = _in_process(
        ["ping", "--cluster", str(bad), "--count", "1", "--timeout", "0.2", "--json"], capsys
    )
    result = json.loads(out.stdout)
    assert out.returncode == USAGE, out.stderr
    assert result["nodes"][0]["answered"] == 1 and result["nodes"][1]["answered"] == 0
    assert "set port =" in result["nodes"][1]["error"] and "rank 1" in result["nodes"][1]["error"]


@pytest.mark.slow
def test_allreduce_names_a_rank_whose_port_is_wrong(
    running: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 3, `failed on rank 1: BAD_SEGMENT`."""
    bad = _wrong_port(running)
    out = _in_process(["allreduce", "--cluster", str(bad), "--size", "4KiB"], capsys)
    _check(["allreduce"], USAGE, "rank 1 (127.0.0.1:", out.returncode, out.stdout, out.stderr)
    assert "does not match the running nodes" in out.stderr and "netdam up" in out.stderr


def test_allreduce_bigger_than_node_memory_names_the_memory_to_start_with(
    running: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 3, `MemoryError: ... start nodes with more --memory ... please report it`."""
    out = _in_process(["allreduce", "--cluster", str(running), "--size", "64MiB"], capsys)
    _check(
        ["allreduce"], USAGE, "netdam up --memory 256MiB", out.returncode, out.stdout, out.stderr
    )
    assert "--size 16MiB or less" in out.stderr and "please report" not in out.stderr


@pytest.mark.slow
def test_pool_alloc_without_room_says_what_is_free(
    running: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 3, `use --interleave`, which cannot make 100 GiB fit in 128 MiB."""
    out = _in_process(["pool", "alloc", "--cluster", str(running), "--size", "100GiB"], capsys)
    _check(["pool"], USAGE, "free over 2 node(s)", out.returncode, out.stdout, out.stderr)
    assert "--interleave" not in out.stderr and "--memory" in out.stderr
    # 100 MiB does not fit one node's 64 MiB but does fit interleaved: then say so.
    out = _in_process(["pool", "alloc", "--cluster", str(running), "--size", "100MiB"], capsys)
    _check(["pool"], USAGE, "--interleave 8KiB", out.returncode, out.stdout, out.stderr)


# ---------------------------------------------------------------- hints name what really helps


def test_hints_name_what_installs_and_options_the_command_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from netdam.tools.plot import PLOT_HINT

    # netdam is not on the package index: 'netdam[plot]' resolves nothing there.
    assert "pip install matplotlib" in PLOT_HINT and "netdam[" not in PLOT_HINT
    code, _, err = _main(["allreduce", "--size", "1024GiB"], capsys)
    assert code == USAGE and "--memory" not in err and "--size" in err  # allreduce has no --memory
