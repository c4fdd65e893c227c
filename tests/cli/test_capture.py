"""`netdam capture` of a live 3-node all-reduce decodes, datagram for datagram, without an error
(issue 14: on loopback a capture holds UDP-GSO super-frames, which decode splits)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from netdam.cluster.launch import start_cluster
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet, encode_packet

ROOT = Path(__file__).resolve().parents[2]


def _can_capture() -> str | None:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    except (PermissionError, AttributeError, OSError) as exc:
        return f"capturing needs CAP_NET_RAW (root) on Linux: {exc}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_can_capture() is not None, reason=str(_can_capture()))
@pytest.mark.alone
def test_capture_of_a_live_allreduce_decodes_cleanly(tmp_path: Path) -> None:
    from scapy.utils import wrpcap

    from netdam.cli.capture import capture
    from netdam.cli.decode import cluster_ports

    with start_cluster(3, memory=8 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        ports = cluster_ports(cluster.path)
        started, stop = threading.Event(), threading.Event()
        frames: list[Any] = []
        # The capture ends at the PING sent after the run, not at whatever frame comes next:
        # under load the sniffer lags behind the traffic, and "the next frame" was one of the
        # pre-run PINGs, which ended the capture before the all-reduce's frames were read.
        poke = encode_packet(Packet(Opcode.PING, client_id=1, txn_id=0xC0FFEE))

        def end_at_poke(frame: Any) -> None:
            if bytes(frame.getlayer("UDP").payload) == poke:
                stop.set()

        sniffer = threading.Thread(
            target=lambda: frames.extend(
                capture("lo", ports, seconds=60.0, on_frame=end_at_poke, started=started, stop=stop)
            )
        )
        sniffer.start()
        assert started.wait(10), "the capture socket did not open"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "netdam",
                "allreduce",
                "--cluster",
                str(cluster.path),
                "--size",
                "256KiB",
                "--json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # The run is over: the poke, a PING to a node, ends the capture when the sniffer
        # reaches it (every frame before it is kept). Sent again each second until it does: a
        # capture socket that overflowed behind the run (its buffer is net.core.rmem_max at
        # most) may drop a poke, and once left a CI run's capture waiting 30 s for it.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(30):
                sock.sendto(poke, cluster.endpoints[0])
                sniffer.join(1.0)
                if not sniffer.is_alive():
                    break
        assert not sniffer.is_alive(), "the capture did not stop"
        assert json.loads(run.stdout)["ok"], run.stderr
    pcap = tmp_path / "x.pcap"
    wrpcap(str(pcap), frames)
    decoded = subprocess.run(
        [
            sys.executable,
            "-m",
            "netdam",
            "decode",
            "--pcap",
            str(pcap),
            "--port",
            ",".join(map(str, sorted(ports))),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(decoded.stdout)
    bad = [p for p in result.get("packets", []) if not p["ok"]]
    assert decoded.returncode == 0 and result["ok"], bad[:3] or result
    opcodes = {p["opcode"] for p in result["packets"]}
    # The all-reduce itself was captured: chained adds and the multicast all-gather.
    assert {"START_COLL", "CHAIN_ADD"} <= opcodes, opcodes

    # Wireshark reads it cleanly too: the dissector splits the same super-frames.
    tshark = shutil.which("tshark")
    if tshark is None:
        return
    from netdam.cli.capture import _ranges

    lua = ROOT / "protocol" / "wireshark" / "netdam.lua"
    env = dict(os.environ, HOME=str(tmp_path), WIRESHARK_CONFIG_DIR=str(tmp_path / "ws"))
    out = subprocess.run(
        [
            tshark,
            "-X",
            f"lua_script:{lua}",
            "-o",
            f"netdam.ports:{_ranges(ports)}",
            "-r",
            str(pcap),
            "-T",
            "fields",
            "-e",
            "netdam.opcode",
            "-e",
            "netdam.error.text",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    if not any(row[0] for row in rows):
        return  # tshark ran no Lua (as root, some distributions' init.lua skip user scripts)
    assert "Lua Error" not in out.stdout
    errors = [row[1] for row in rows if len(row) > 1 and row[1]]
    assert errors == [], errors[:3]
