"""``netdam capture``: write a cluster's traffic on loopback to a pcap file (scapy sniff/wrpcap).

The pcap holds frames as the kernel hands them to a capture: on loopback, a node's UDP-GSO send
is one super-frame of several datagrams, which ``netdam decode --pcap`` and the Wireshark
dissector split again (see netdam.protocol.pcap.split_gso). Needs CAP_NET_RAW (root).
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from netdam import progress
from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_seconds,
    cluster_file,
    emit,
    writable_output,
)
from netdam.cli.decode import cluster_ports
from netdam.protocol.constants import MULTICAST_PREFIX


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "capture",
        help="capture a cluster's NetDAM traffic on loopback into a pcap file",
        description="Capture every UDP frame to or from the cluster's ports (nodes' data and "
        "control ports, the switch's VIP) and its multicast groups (239.77.0.0/16) on --iface, "
        "until --seconds pass, --count frames arrive or Ctrl-C, then write them to -o FILE. Read "
        "it with `netdam decode --pcap FILE --cluster CLUSTER` or Wireshark with "
        "protocol/wireshark/netdam.lua. Needs CAP_NET_RAW (root).",
    )
    parser.add_argument(
        "--cluster", type=cluster_file, required=True, help="the cluster file (netdam up)"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=writable_output("-o"),
        required=True,
        metavar="FILE.pcap",
        help="pcap file to write",
    )
    parser.add_argument(
        "--seconds",
        type=bounded_seconds(0.0, 86400.0, low_inclusive=False),
        default=None,
        help="stop after this long (default: at Ctrl-C or --count)",
    )
    parser.add_argument(
        "--count",
        type=bounded_int(1, 100_000_000),
        default=None,
        help="stop after this many frames",
    )
    parser.add_argument("--iface", default="lo", help="interface (default lo: a local cluster)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    # Imported here: it loads numba's compiled kernels (~0.7 s) only when a pid is gone.
    from netdam.cli.running import check_not_stale
    from netdam.cluster.clusterfile import load_cluster

    try:
        ports = cluster_ports(args.cluster)
        # A stale file's ports carry no traffic: the capture would wait for nothing.
        check_not_stale(args.cluster, load_cluster(args.cluster))
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    frames = capture(args.iface, ports, seconds=args.seconds, count=args.count, on_frame=_counter())
    # Imported here: an optional or heavy dependency (scapy), loaded only by the commands that use it.
    from scapy.utils import wrpcap

    wrpcap(str(args.output), frames)
    result = {
        "ok": True,
        "output": str(args.output),
        "frames": len(frames),
        "iface": args.iface,
        "ports": sorted(ports),
    }
    progress.finish()
    emit(
        result,
        args.json,
        text=f"wrote {len(frames)} frames to {args.output}; decode with "
        f"`netdam decode --pcap {args.output} --cluster {args.cluster}`",
    )
    return ExitCode.OK


def _counter() -> Any:

    seen = [0]

    def on_frame(_: object) -> None:
        seen[0] += 1
        if seen[0] % 16 == 1:
            progress.status(f"{seen[0]} frames")

    return on_frame


def capture(
    iface: str,
    ports: set[int],
    *,
    seconds: float | None = None,
    count: int | None = None,
    on_frame: Any = None,
    started: Any = None,
    stop: Any = None,
) -> list[Any]:
    """Frames on *iface* to or from *ports* or a NetDAM multicast group. *started* (an Event)
    is set once the capture socket is open, so a caller can start traffic after it; once *stop*
    (an Event) is set, the next frame ends the capture."""

    try:
        # Imported here: an optional or heavy dependency (scapy), loaded only by the commands that use it.
        from scapy.layers.inet import IP, UDP
        from scapy.sendrecv import sniff
    except ImportError as exc:  # scapy is a dependency; a broken install still gets one line
        raise CommandError(
            f"scapy is not importable ({exc}): reinstall netdam", ExitCode.RUN_FAILED
        ) from None
    groups = ipaddress.ip_network(MULTICAST_PREFIX)

    def ours(frame: Any) -> bool:
        udp = frame.getlayer(UDP)
        if udp is None:
            return False
        if udp.sport in ports or udp.dport in ports:
            return True
        ip = frame.getlayer(IP)
        return ip is not None and ipaddress.ip_address(ip.dst) in groups

    progress.note(
        f"capturing on {iface}, ports {_ranges(ports)} and group {MULTICAST_PREFIX}"
        + ("" if seconds or count else "; Ctrl-C to stop and write")
    )
    try:
        # L2Socket, not sniff's default listen socket: on loopback a packet socket sees every
        # frame twice (outgoing and incoming) and L2Socket drops the outgoing copy, as libpcap
        # does. A big receive buffer: the capture runs in Python, the nodes do not.
        from scapy.arch.linux import L2Socket
        from scapy.config import conf

        conf.bufsize = max(int(conf.bufsize), 32 << 20)
        sock = L2Socket(iface=iface)
    except PermissionError:
        raise CommandError(
            "capturing needs CAP_NET_RAW: run as root (or grant the interpreter "
            "cap_net_raw with setcap)",
            ExitCode.RUN_FAILED,
        ) from None
    except OSError as exc:
        raise CommandError(
            f"cannot capture on {iface}: {exc}: pick an interface with --iface", ExitCode.RUN_FAILED
        ) from None
    try:
        found = sniff(
            opened_socket=sock,
            lfilter=ours,
            prn=on_frame,
            store=True,
            timeout=seconds,
            count=count or 0,
            started_callback=started.set if started else None,
            stop_filter=(lambda _frame: stop.is_set()) if stop is not None else None,
        )
    finally:
        sock.close()
    return list(found)


def _ranges(ports: set[int]) -> str:
    """``17744-17746,40001``: the form Wireshark's port preferences take."""
    out: list[str] = []
    for port in sorted(ports):
        if out and "-" not in out[-1].split(",")[-1] and int(out[-1]) == port - 1:
            out[-1] = f"{out[-1]}-{port}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == port - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{port}"
        else:
            out.append(str(port))
    return ",".join(out)
