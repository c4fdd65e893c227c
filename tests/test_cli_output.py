"""Readable output: `pool read --format`, -v/-vv that show netdam's logs and not numba's, one
throughput unit (Gb/s) in every table, plots with a compact legend outside the data.

The pool read tests stand a fake client in for the switch (tests/test_pool.py runs the real one);
the logging test runs a real command in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import netdam.cli.pool as pool_cli
from netdam.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
#: Memory as a node holds it: text, a byte that is no UTF-8, NUL padding, an ESC sequence.
STORED = "héllo\\ wörld\n".encode() + b"\xff\x00\x00\x1b[2J\xc2\x85"


# ---------------------------------------------------------------- pool read --format


class _FakeClient:
    """PoolClient's context manager and read(), returning STORED."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def read(self, gaddr: int, length: int, rkey: int, *, stride: int = 0) -> bytes:
        return STORED[:length]


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The argv prefix of `netdam pool read` against a fake switch."""

    class Ctl:
        switch = type("S", (), {"vip": ("127.0.0.1", 1)})()
        cluster = type("C", (), {"mtu": 9000})()

    monkeypatch.setattr(pool_cli, "_target", lambda args: (Ctl(), 0x1234, 0))
    monkeypatch.setattr(pool_cli, "PoolClient", _FakeClient)
    cluster = tmp_path / "c.toml"
    cluster.write_text("")  # --cluster must name a readable file; _target is faked
    return ["pool", "read", "--cluster", str(cluster), "--gaddr", "0x0", "--length", f"{len(STORED)}B"]


def test_escape_text_is_unambiguous() -> None:
    assert pool_cli.escape_text(STORED) == "héllo\\\\ wörld\n\\xff\\x00\\x00\\x1b[2J\\u0085"
    assert pool_cli.escape_text(b"plain") == "plain"


def test_pool_read_default_is_hex(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(fake_pool) == 0
    assert capsys.readouterr().out == STORED.hex() + "\n"
    assert main([*fake_pool, "--format", "hex"]) == 0
    assert capsys.readouterr().out == STORED.hex() + "\n"


def test_pool_read_text(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*fake_pool, "--format", "text"]) == 0
    assert capsys.readouterr().out == pool_cli.escape_text(STORED) + "\n"


def test_pool_read_raw_is_the_exact_bytes(fake_pool: list[str], capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    assert main([*fake_pool, "--format", "raw", "-q"]) == 0
    assert capfdbinary.readouterr().out == STORED


def test_pool_read_json_keeps_hex(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*fake_pool, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "gaddr": 0, "bytes": len(STORED), "hex": STORED.hex()}
    assert main([*fake_pool, "--json", "--format", "raw"]) == 2
    assert "--format" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit) as usage:
        main([*fake_pool, "--format", "base64"])
    assert usage.value.code == 2


# ---------------------------------------------------------------- -v / -vv


#: After netdam's own set-up (the CLI's or the switch's), compile a fresh numba function: at
#: DEBUG numba logs every bytecode and SSA step of it (megabytes for the node kernels).
_COMPILE_AND_LOG = """
import logging, numba
numba.njit(lambda x: x * 3 + 1)(2)
logging.getLogger("netdam.cluster").debug("netdam debug line")
logging.getLogger("netdam.cluster").info("netdam info line")
print("launcher passes -vv on:", logging.getLogger().isEnabledFor(logging.DEBUG))
"""

_SETUPS = {
    "cli": "from netdam.cli.main import main\nmain(['-vv', 'decode', '0109'])\n",
    "switch": ("import netdam.switch.cli as s\ns.run_switch = lambda args: 0\n"
               "s.main(['--cluster', 'c.toml', '--vip', '127.0.0.1:9', '-vv'])\n"),  # fmt: skip
}


@pytest.mark.parametrize("process", sorted(_SETUPS))
def test_vv_shows_netdam_logs_not_numba(process: str, tmp_path: Path) -> None:
    """-vv of the CLI (and so of node processes, which run `netdam node`) and of the switch:
    netdam's DEBUG lines show, numba's do not, and the root level still tells the launcher to
    pass -vv to the processes it starts."""
    done = subprocess.run([sys.executable, "-c", _SETUPS[process] + _COMPILE_AND_LOG], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "launcher passes -vv on: True" in done.stdout, done.stderr[-2000:]
    assert "netdam.cluster DEBUG netdam debug line" in done.stderr
    assert "netdam.cluster INFO netdam info line" in done.stderr
    assert "numba" not in done.stderr
    assert len(done.stderr) < 4000, done.stderr[:2000]
