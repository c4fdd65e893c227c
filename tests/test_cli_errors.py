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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USAGE, RUN_FAILED = 2, 3

# (argv, exit code, a word the message must contain)
CASES: list[tuple[list[str], int, str]] = [
    (["allreduce", "--nodes", "1"], USAGE, "2..64"),
    (["allreduce", "--nodes", "65"], USAGE, "2..64"),
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
    (["up", "--nodes", "100000"], USAGE, "1..64"),
    (["up", "--nodes", "0"], USAGE, "--nodes"),
    (["up", "--base-port", "70000"], USAGE, "65535"),
    (["up", "--base-port", "0"], USAGE, "65535"),
    (["up", "--base-port", "65534", "--nodes", "4"], USAGE, "--base-port"),
    (["up", "--memory", "0"], USAGE, "--memory"),
    (["up", "--memory", "1024GiB", "--nodes", "64"], USAGE, "--memory"),
    (["up", "--mtu", "100"], USAGE, "--mtu"),
    (["up", "--mtu", "180", "--nodes", "8"], USAGE, "at least"),
    (["up", "--mtu", "abc"], USAGE, "MTU"),
    (["up", "--cluster", "/"], USAGE, "directory"),
    (["up", "--shm-dir", "/nonexistent-netdam-dir"], USAGE, "--shm-dir"),
    (["down", "--cluster", "/nonexistent.toml"], USAGE, "no such file"),
    (["stats", "--cluster", "/"], USAGE, "directory"),
    (["stats", "--cluster", "README.md"], USAGE, "TOML"),
    (["ping", "--node", "127.0.0.1:99999"], USAGE, "IP:PORT"),
    (["ping", "--node", "127.0.0.1:7744", "--count", "0"], USAGE, "--count"),
    (["pool", "write", "--cluster", "README.md", "--gaddr", "0", "--file", "/nonexistent"], USAGE, "no such file"),
    (["pool", "write", "--cluster", "README.md", "--gaddr", "0", "--file", "/"], USAGE, "directory"),
    (["pool", "alloc", "--cluster", "/nonexistent.toml", "--size", "4KiB"], USAGE, "no such file"),
    (["pool", "alloc", "--cluster", "CLUSTER2", "--size", "64KiB", "--interleave", "8KiB", "--ways", "5"], USAGE, "1..2"),
    (["pool", "alloc", "--cluster", "CLUSTER2", "--size", "64KiB", "--ways", "2"], USAGE, "--interleave"),
    (["allreduce", "--cluster", "CLUSTER2_MTU150"], USAGE, "netdam up --mtu 172"),
    (["pool", "read", "--cluster", "CLUSTER2", "--gaddr", "0", "--length", "0"], USAGE, "--length"),
    (["soak", "--cluster", "/nonexistent.toml"], USAGE, "no such file"),
    (["soak", "--clients", "0"], USAGE, "--clients"),
    (["decode", "--pcap", "/nonexistent.pcap"], USAGE, "/nonexistent.pcap"),
    (["model", "op", "--count", "0"], USAGE, "--count"),
    (["model", "allreduce", "--nodes", "1", "--size", "1MiB"], USAGE, "2 nodes"),
    (["bench", "datapath", "--mtu", "50"], USAGE, "--mtu"),
    (["flood", "--senders", "9"], USAGE, "--senders"),
    (["nosuchcommand"], USAGE, "nosuchcommand"),
    (["allreduce", "--no-such-flag"], USAGE, "--no-such-flag"),
]


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
    return subprocess.run([sys.executable, "-m", "netdam", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize(("argv", "code", "word"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line(argv: list[str], code: int, word: str, cluster2: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    small = cluster2.with_name("two-mtu150.toml")
    small.write_text(cluster2.read_text().replace("mtu = 9000", "mtu = 150"))
    files = {"CLUSTER2": str(cluster2), "CLUSTER2_MTU150": str(small)}
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


@pytest.mark.parametrize("index", [0, 2, 16])
def test_as_a_real_process(index: int) -> None:
    argv, code, word = CASES[index]
    plain = _run(argv)
    _check(argv, code, word, plain.returncode, plain.stdout, plain.stderr)
    as_json = _run([*argv, "--json"])
    _check_json(code, word, as_json.returncode, as_json.stdout, as_json.stderr)


def test_version() -> None:
    out = _run(["--version"])
    assert out.returncode == 0 and out.stdout.startswith("netdam "), out


def test_timeout_help_states_the_real_default() -> None:
    out = _run(["allreduce", "--help"])
    assert "default 2.5" in " ".join(out.stdout.split())


def test_sigint_exits_130(tmp_path: Path) -> None:
    """Ctrl-C during a run: exit 130, one line, no traceback (`up` in the foreground waits)."""
    import signal
    import time

    cluster = tmp_path / "c.toml"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "netdam", "ping", "--node", "127.0.0.1:9",
                             "--count", "100000", "--timeout", "0.5"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
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
