"""`netdam bench datapath`: a short real run (feeder, relay, sink and a node process over
loopback UDP) reports every key with verified sums; failures are reported, never hang."""

from __future__ import annotations

import argparse
import shlex
import sys

import pytest
from helpers import run_bench_cli as run_cli

from netdam.cli import bench as cli_bench
from netdam.tools.bench.datapath import node_command_available

KEYS = {
    "raw_pps",
    "node_pps",
    "feeder_pps",
    "ratio",
    "py_relay_pps",
    "ratio_vs_py_relay",
    "valid",
    "verified",
    "mismatches",
    "node_counters",
    "kernel_drops",
    "seconds",
    "startup_seconds",
    "payload_bytes",
    "machine",
}




@pytest.mark.skipif(not node_command_available(), reason="`netdam node` is not registered yet")
def test_short_run_reports_every_key_with_verified_sums(capsys) -> None:
    code, res = run_cli(
        ["bench", "datapath", "--seconds", "0.3", "--warmup", "0.2", "--json"], capsys
    )
    assert code == 0, res.get("error")
    assert KEYS <= res.keys()
    assert res["verified"] is True and res["mismatches"] == 0
    assert res["raw_pps"] > 0 and res["node_pps"] > 0 and res["feeder_pps"] > 0
    assert res["ratio"] == pytest.approx(res["node_pps"] / res["raw_pps"])
    # The plain-Python relay forwarded verified datagrams in GRO/GSO runs, not one by one.
    assert res["py_relay_pps"] > 0
    assert res["ratio_vs_py_relay"] == pytest.approx(res["node_pps"] / res["py_relay_pps"])
    py_io = res["py_relay_io"]
    assert py_io["gso_runs"] > 0 and py_io["tx_datagrams"] > py_io["send_calls"]
    assert isinstance(res["valid"], bool)
    assert res["payload_bytes"] == 8192 and res["datagram_bytes"] == 8272
    counters = res["node_counters"]
    assert counters["forwarded"] >= res["verified_datagrams"] > 0  # the node did the adds
    assert counters["ops"]["CHAIN_ADD"] >= counters["forwarded"]
    assert set(res["machine"]) == {"cores", "kernel", "python", "numpy", "numba"}
    assert res["startup_seconds"] > 0


def test_a_node_that_dies_gives_exit_3_and_json(capsys) -> None:
    dead = shlex.join([sys.executable, "-c", "import sys; sys.exit(7)"])
    code, res = run_cli(
        ["bench", "datapath", "--seconds", "0.2", "--warmup", "0", "--node-cmd", dead, "--json"],
        capsys,
    )
    assert code == 3
    assert "node process exited (code 7)" in res["error"]
    assert KEYS <= res.keys()
    assert res["node_pps"] is None and res["ok"] is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--window", "10"], "--window 10 is smaller than one feeder batch"),
        (["--packets", "100"], "--packets must be a positive multiple of 56"),
        (["--seconds", "0"], "out of range"),
        (["--mtu", "100"], "--mtu 100 is too small"),
    ],
)
def test_usage_errors_exit_2(capsys, flags: list[str], message: str) -> None:
    code, res = run_cli(["bench", "datapath", *flags, "--json"], capsys)
    assert code == 2
    assert message in res["error"]


def test_bench_help_lists_datapath() -> None:
    parser = argparse.ArgumentParser(prog="netdam")
    cli_bench.register(parser.add_subparsers(dest="command"))
    text = parser._subparsers._group_actions[0].choices["bench"].format_help()  # type: ignore[union-attr]
    assert "datapath" in text
