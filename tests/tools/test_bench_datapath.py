"""`netdam bench datapath`: a short real run (feeder, relay, sink and a node process over
loopback UDP) reports every key with verified sums; failures are reported, never hang."""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
import time

import numpy as np
import pytest
from helpers import run_bench_cli as run_cli

from netdam.cli import bench as cli_bench
from netdam.cli.common import ExitCode
from netdam.kernels import udp_io as U
from netdam.kernels.state import RxBatch, SinkCheck, TimeWindow
from netdam.protocol.constants import HEADER_SIZE, SEGMENT_SIZE
from netdam.shell.udp import SOL_UDP, UDP_SEGMENT, open_udp_socket
from netdam.tools.bench import datapath as D

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


@pytest.mark.slow
def test_short_run_reports_every_key_with_verified_sums(capsys) -> None:
    code, res = run_cli(
        ["bench", "datapath", "--seconds", "0.3", "--warmup", "0.2", "--json"], capsys
    )
    assert code == 0, res.get("error")
    assert KEYS <= res.keys()
    assert res["ok"] is True and res["error"] is None
    assert res["verified"] is True and res["mismatches"] == 0
    assert res["mismatches_by_phase"] == {"raw": 0, "py_relay": 0, "node": 0}
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


@pytest.mark.slow
def test_at_an_emulation_mtu_each_datagram_carries_60_kib_verified(capsys) -> None:
    """SPEC.md 2.7: at --mtu 65000 the node adds 15360 f32 per CHAIN_ADD, every sum verified."""
    argv = ["bench", "datapath", "--seconds", "0.3", "--warmup", "0.2", "--mtu", "65000"]
    code, res = run_cli([*argv, "--json"], capsys)
    assert code == 0, res.get("error")
    assert res["payload_bytes"] == 61440 and res["elements_per_packet"] == 15360
    assert res["verified"] is True and res["mismatches"] == 0 and res["verified_datagrams"] > 0
    assert res["node_counters"]["forwarded"] >= res["verified_datagrams"]


@pytest.mark.slow
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
    text = parser._subparsers._group_actions[0].choices["bench"].format_help()
    assert "datapath" in text


# ---------------------------------------------------------------- the check itself, without load


def _sink_counts(datagrams: list[bytes], table: np.ndarray, tag: int) -> np.ndarray:
    """Send *datagrams* to a sink socket and run the benchmark's sink kernel on them once."""
    rx = open_udp_socket((D.LOOPBACK, 0), rcvbuf=4 << 20)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for data in datagrams:
            tx.sendto(data, rx.getsockname())
        buf = np.zeros(D.RECV_BUFFER_BYTES, np.uint8)
        n = D.RECV_MAX_DATAGRAMS
        counts = np.zeros(U.COUNTS_LEN, np.int64)
        now = time.monotonic_ns()
        size = len(datagrams[0])
        check = SinkCheck(table.view(np.uint64), size, HEADER_SIZE + 2 * SEGMENT_SIZE, True, tag)
        rxb = RxBatch(buf, np.zeros(n, np.int64), np.zeros(n, np.int32), np.zeros(n, np.uint64))
        # Until every datagram is counted, or 10 s on a busy machine.
        deadline = now + 10_000_000_000
        while counts[U.SINK_RX_TOTAL] < len(datagrams) and time.monotonic_ns() < deadline:
            U.sink_run(
                rx.fileno(),
                rxb,
                buf.view(np.uint64),
                n,
                U.new_state(),
                check,
                TimeWindow(now, deadline, time.monotonic_ns() + 50_000_000),
                counts,
                np.zeros(8, np.int64),
            )
        return counts
    finally:
        rx.close()
        tx.close()


def test_the_sink_reports_a_wrong_sum_and_sets_stale_datagrams_apart() -> None:
    w = D._workload(seed=3, packets=4, mtu=9000)
    node, sink = (D.LOOPBACK, 1), (D.LOOPBACK, 2)
    tag = D.PHASE_TAGS["node"]
    # What a node that adds right sends on: the sums themselves as the payload.
    right = D._Workload(w.elements, w.sums, w.operands, w.sums, w.max_payload)
    wrong_sums = w.sums.copy()
    wrong_sums[2, 100] = np.nextafter(wrong_sums[2, 100], np.float32(2))  # one ulp off
    wrong = D._Workload(w.elements, wrong_sums, w.operands, w.sums, w.max_payload)
    datagrams = [
        D._chain_packet(0, right, node, sink, tag),
        D._chain_packet(1, right, node, sink, tag),
        D._chain_packet(2, wrong, node, sink, tag),  # a wrong sum
        D._chain_packet(3, w, node, sink, tag),  # not added at all
        D._chain_packet(1, right, node, sink, tag)[:-8],  # cut short
        D._chain_packet(0, w, node, sink, D.PHASE_TAGS["py_relay"]),  # the previous phase's
    ]
    counts = _sink_counts(datagrams, w.sums, tag)
    assert counts[U.SINK_RX_TOTAL] == 6
    assert counts[U.SINK_VERIFIED_TOTAL] == 2
    assert counts[U.SINK_MISMATCHES] == 3
    assert counts[U.SINK_STALE] == 1
    # A later phase's tag is no excuse: only earlier phases can leave datagrams behind.
    later = D._chain_packet(0, right, node, sink, tag + 1)
    assert _sink_counts([later], w.sums, tag)[U.SINK_MISMATCHES] == 1


def test_mismatches_make_verified_false_with_the_reason_and_exit_1() -> None:
    res = {
        "ok": False,
        "verified": True,
        "error": None,
        "mismatches": 5,
        "mismatches_by_phase": {"raw": 0, "py_relay": 0, "node": 5},
    }
    assert D._verdict(res, ExitCode.OK) == ExitCode.CHECK_FAILED
    assert res["verified"] is False and res["ok"] is False
    assert "5 datagrams failed the sink's bitwise check (node 5)" in res["error"]
    clean = {
        "ok": False,
        "verified": True,
        "error": None,
        "mismatches": 0,
        "mismatches_by_phase": {},
    }
    assert D._verdict(clean, ExitCode.OK) == ExitCode.OK
    assert clean["ok"] is True and clean["verified"] is True and clean["error"] is None
    # A run that failed keeps exit 3 and says both things.
    failed = {**res, "verified": True, "error": "sink process died"}
    assert D._verdict(failed, ExitCode.RUN_FAILED) == ExitCode.RUN_FAILED
    assert failed["error"].startswith("sink process died; 5 datagrams")
    # Nothing verified from the node is no success either.
    empty = {
        "ok": False,
        "verified": False,
        "error": None,
        "mismatches": 0,
        "mismatches_by_phase": {},
    }
    assert D._verdict(empty, ExitCode.OK) == ExitCode.RUN_FAILED
    assert empty["ok"] is False and "verified no datagram" in empty["error"]


def test_the_python_relay_keeps_datagram_boundaries_after_its_socket_dropped() -> None:
    """Once a socket has dropped anything, SO_RXQ_OVFL comes first in every receive's
    ancillary data; the relay must still get UDP_GRO and forward the run as datagrams."""
    relay = open_udp_socket((D.LOOPBACK, 0), rcvbuf=256 << 10)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sink.bind((D.LOOPBACK, 0))
        sink.settimeout(5.0)
        segment = 8272
        run = bytes(range(256)) * (7 * segment // 256) + bytes(7 * segment % 256)
        gso = [(SOL_UDP, UDP_SEGMENT, segment.to_bytes(2, sys.byteorder))]
        for _ in range(64):  # 3.6 MB into a 512 KiB queue: the socket drops
            tx.sendmsg([run], gso, 0, relay.getsockname())
        with pytest.raises(BlockingIOError):
            while True:
                relay.recv(1 << 16)
        tx.sendmsg([run], gso, 0, relay.getsockname())
        state = U.new_state()
        deadline = time.monotonic_ns() + 5_000_000_000
        while state[U.ST_TX_DATAGRAMS] < 7 and time.monotonic_ns() < deadline:
            D.py_relay_run(relay, sink.getsockname(), time.monotonic_ns() + 50_000_000, state)
        assert state[U.ST_KERNEL_DROPS] > 0  # the condition that used to cost UDP_GRO
        assert [len(sink.recv(1 << 16)) for _ in range(7)] == [segment] * 7
        assert state[U.ST_TRUNCATED] == 0
    finally:
        for s in (relay, sink, tx):
            s.close()
