"""``netdam node``, ``up``, ``down``, ``stats``, ``ping``: run and inspect local clusters."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_milliseconds,
    bounded_seconds,
    check_writable_output,
    cluster_file,
    emit,
    new_or_file,
    port_arg,
    size_arg,
)
from netdam.cluster.clusterfile import (
    ClusterFile,
    NodeEntry,
    lists_nodes,
    load_cluster,
    load_switch_entry,
)
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launcher_env import (
    LAUNCHER_HELP,
    LaunchError,
    node_bind,
    resolve_launch,
    wants_rendezvous,
)
from netdam.cluster.rendezvous import RendezvousError, resolve_bind, run_launched_node
from netdam.cluster.secrets_io import KeyFileError, check_private, read_admin_key_file, read_key_fd
from netdam.core.chunk_plan import min_mtu
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DEFAULT_MTU,
    MAX_MTU,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    MIN_MTU,
    largest_payload,
)
from netdam.protocol.packet import Endpoint
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS
from netdam.shell.startup import SCHEDULING
from netdam.units import format_size

if TYPE_CHECKING:
    from netdam.cluster.launch import LocalCluster
    from netdam.core.faults import FaultSpec


def endpoint_arg(text: str) -> Endpoint:
    """argparse type for ``IP:PORT``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"invalid address {text!r}: write IP:PORT, e.g. 127.0.0.1:7744"
        )
    return host, int(port)


def endpoints_arg(text: str) -> tuple[Endpoint, ...]:
    return tuple(endpoint_arg(part) for part in text.split(",") if part)


def nic_arg(text: str) -> tuple[int, Endpoint, int | None]:
    """argparse type for ``RANK@IP:PORT[/SIZE]``: one NIC of a node process hosting several."""
    rank_text, at, rest = text.partition("@")
    address, slash, size_text = rest.partition("/")
    if not at or not rank_text.isdigit() or int(rank_text) > 4095:
        raise argparse.ArgumentTypeError(
            f"invalid NIC {text!r}: write RANK@IP:PORT[/SIZE] with a rank "
            "0..4095, e.g. 0@127.0.0.1:17744 or 1@127.0.0.1:17745/1MiB"
        )
    return int(rank_text), endpoint_arg(address), size_arg(size_text) if slash else None


def mtu_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid MTU {text!r}: give an integer, e.g. 9000"
        ) from None
    if not MIN_MTU <= value <= MAX_MTU:
        raise argparse.ArgumentTypeError(
            f"--mtu {value} out of range: NetDAM needs {MIN_MTU}..{MAX_MTU}"
        )
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid probability {text!r}: give a number 0..1"
        ) from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a probability between 0 and 1")
    return value


def add_fault_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("receive-side fault injection (seeded, replayable)")
    group.add_argument("--loss", type=probability, default=0.0, help="drop probability")
    group.add_argument("--dup", type=probability, default=0.0, help="duplicate probability")
    group.add_argument("--reorder", type=probability, default=0.0, help="reorder probability")
    group.add_argument("--delay", type=probability, default=0.0, help="probability of a delay")
    group.add_argument(
        "--delay-ms",
        type=bounded_milliseconds(0.0, 60000.0, low_inclusive=True),
        default=0.0,
        help="the delay, milliseconds (0..60000)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of every fault decision")


def add_nics_per_process(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nics-per-process",
        type=bounded_int(1, 4096),
        default=None,
        metavar="K",
        help="emulated NICs each node process hosts (default: the NICs spread over one "
        "process per core; 1: a process per NIC)",
    )


def faults_from(args: argparse.Namespace) -> FaultSpec:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.core.faults import FaultSpec

    return FaultSpec(
        loss=args.loss,
        dup=args.dup,
        reorder=args.reorder,
        delay=args.delay,
        delay_s=args.delay_ms / 1000.0,
        seed=args.seed,
    )


def register(subparsers: Subparsers) -> None:
    node = subparsers.add_parser(
        "node",
        help="run one emulated NIC (a node process)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one node: memory in a file under --shm-dir, a UDP "
        "socket on --bind, the compiled datapath. Prints 'ready IP:PORT "
        "MEMORY_FILE admin_key=K' when serving; stops on SIGTERM/SIGINT. "
        "Under torchrun, mpirun or srun it finds its rank and the others "
        "itself (see below).",
        epilog=LAUNCHER_HELP,
    )
    node.add_argument(
        "--bind",
        type=endpoint_arg,
        default=None,
        help="IP:PORT (default 127.0.0.1:7744; under a launcher auto:7744, see below)",
    )
    node.add_argument(
        "--nic",
        type=nic_arg,
        action="append",
        default=[],
        metavar="RANK@IP:PORT[/SIZE]",
        help="host this NIC (repeat: one process serves them all, sharing its loaded "
        "kernels); memory file NAME-RANK.mem, SIZE defaults to --memory; not with "
        "--bind or --rank",
    )
    node.add_argument(
        "--memory", type=size_arg, default=64 << 20, help="node memory (default 64MiB)"
    )
    node.add_argument(
        "--shm-dir", type=Path, default=Path("/dev/shm"), help="where the memory file lives"
    )
    node.add_argument(
        "--name",
        default=None,
        help="memory file is NAME.mem (default netdam-node; under a launcher "
        "netdam-rRANK-PID, or NAME-RANK when given)",
    )
    keys = node.add_mutually_exclusive_group()
    keys.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="file holding the admin key, optionally followed by the admin tag key (32 hex "
        "digits), or the cluster file (*.toml) whose keys to take; mode 0600 (default: a "
        "random key; under a launcher rank 0's)",
    )
    keys.add_argument(
        "--admin-key-fd",
        type=bounded_int(0, 1 << 20),
        default=None,
        help="inherited descriptor to read the key from (a pipe from the launching process)",
    )
    keys.add_argument("--admin-key", default=None, help=argparse.SUPPRESS)
    node.add_argument(
        "--members",
        type=endpoints_arg,
        default=(),
        help="IP:PORT,... of the cluster (given: no rendezvous, launcher variables ignored)",
    )
    node.add_argument(
        "--rank",
        type=bounded_int(0, 4095),
        default=None,
        help="rank (default 0, or the launcher's)",
    )
    node.add_argument(
        "--world-size",
        type=bounded_int(1, 4096),
        default=None,
        help="number of nodes (default 1, or the launcher's)",
    )
    node.add_argument(
        "--master",
        default=None,
        metavar="HOST[:PORT]",
        help="rank 0's rendezvous address (mpirun sets none; see below)",
    )
    node.add_argument(
        "--cluster",
        type=Path,
        default=None,
        help="under a launcher: rank 0 writes the cluster file here (other ranks ignore it)",
    )
    node.add_argument(
        "--rendezvous-timeout",
        type=bounded_seconds(0.0, 86400.0, low_inclusive=False),
        default=300.0,
        help="seconds rank 0 waits for every rank (default 300)",
    )
    node.add_argument(
        "--mtu",
        type=mtu_arg,
        default=DEFAULT_MTU,
        help="IP MTU (default 9000; above 12899 the payloads grow: an emulation MTU for "
        "loopback, protocol/SPEC.md 2.7)",
    )
    node.add_argument(
        "--die-with-parent", action="store_true", help="exit when the launching process dies"
    )
    node.add_argument(
        "--no-guard",
        action="store_true",
        help="no lockout of key guessers, no anti-amplification limit (SPEC.md 12): "
        "for fuzzing that sends wrong keys on purpose, never for a shared network",
    )
    node.add_argument(
        "--nics-per-process",
        type=bounded_int(1, 4096),
        default=1,
        metavar="K",
        help="under a launcher: the emulated NICs this process hosts (ranks RANK x K .. RANK x "
        "K + K - 1 of WORLD_SIZE x K NICs, ports --bind's + LOCAL_RANK x K + k; default 1)",
    )
    add_trace_records(node)
    add_scheduling(node)
    add_fault_args(node)
    node.set_defaults(func=run_node)

    up = subparsers.add_parser(
        "up",
        help="start a local cluster of node processes",
        description="Start N node processes on loopback, write the cluster "
        "file and print its path. Foreground by default: Ctrl-C stops every "
        "node. With --detach, return and leave them running (netdam down). "
        "With --cluster FILE naming an existing file that lists [[nodes]] "
        "(written by hand, maybe for several hosts): start exactly the nodes "
        "whose address is an address of this host, with the file's ranks, "
        "ports, admin key and MTU, and fill in their pid, memory_file and "
        "control_port (other entries stay as written; the file is marked "
        "keep_file, so netdam down clears those fields instead of deleting "
        "it). Run it on every host of the file.",
    )
    up.add_argument(
        "--nodes",
        type=bounded_int(1, MAX_UP_NODES),
        default=None,
        help=f"emulated NICs, 1..{MAX_UP_NODES}; a chain spans at most 64, an all-reduce over more is a torus of chains (default 4; not with an existing --cluster FILE)",
    )
    up.add_argument(
        "--memory",
        type=size_arg,
        default=64 << 20,
        help="memory per node (default 64MiB; a file's memory_bytes wins)",
    )
    up.add_argument(
        "--base-port",
        type=port_arg,
        default=None,
        help="first node's UDP port (default: free ports)",
    )
    up.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    up.add_argument(
        "--mtu",
        type=mtu_arg,
        default=None,
        help="IP MTU (default 9000, or the file's); e.g. 65000 on loopback, an emulation MTU: "
        "payloads up to 61440 bytes (protocol/SPEC.md 2.7)",
    )
    up.add_argument(
        "--cluster",
        type=new_or_file,
        default=None,
        help="cluster file: start this host's nodes from it when it lists [[nodes]], "
        "else write the new cluster's file there",
    )
    up.add_argument("--detach", action="store_true", help="start, print, return")
    add_trace_records(up)
    add_scheduling(up)
    up.add_argument(
        "--switch",
        action="store_true",
        help="also start the pool switch (its VIP goes into the cluster file)",
    )
    add_nics_per_process(up)
    up.add_argument("--json", action="store_true")
    add_fault_args(up)
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", help="stop a cluster started with netdam up")
    down.add_argument("--cluster", type=cluster_file, required=True, help="the cluster file")
    down.add_argument("--json", action="store_true")
    down.set_defaults(func=run_down)

    stats = subparsers.add_parser("stats", help="counters of every node of a cluster")
    stats.add_argument("--cluster", type=cluster_file, required=True)
    stats.add_argument(
        "--timeout",
        type=bounded_seconds(0.0, 600.0, low_inclusive=False),
        default=1.0,
        help="seconds per node (default 1)",
    )
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=run_stats)

    ping = subparsers.add_parser("ping", help="PING nodes: version, memory, rank, round-trip time")
    target = ping.add_mutually_exclusive_group(required=True)
    target.add_argument("--cluster", type=cluster_file)
    target.add_argument("--node", type=endpoint_arg, help="IP:PORT of one node")
    ping.add_argument(
        "--count", type=bounded_int(1, 100000), default=3, help="PINGs per node (default 3)"
    )
    ping.add_argument(
        "--timeout",
        type=bounded_seconds(0.0, 600.0, low_inclusive=False),
        default=1.0,
        help="seconds per PING (default 1)",
    )
    ping.add_argument("--json", action="store_true")
    ping.set_defaults(func=run_ping)


def _admin_keys(args: argparse.Namespace) -> tuple[int, bytes]:
    """The node's admin key and admin tag key from --admin-key-file or --admin-key-fd; (0, b"")
    without (a random key, no control tags)."""
    if args.admin_key is not None:
        raise CommandError(
            "--admin-key would show the key to every local user (ps): write it to a file "
            "with mode 0600 and pass --admin-key-file FILE, or hand it over a pipe with "
            "--admin-key-fd N",
            ExitCode.USAGE,
        )
    try:
        if args.admin_key_file is not None and args.admin_key_file.suffix == ".toml":
            # The cluster file itself (0600): its admin key and the admin tag key of its group key.
            check_private(args.admin_key_file, "cluster")
            try:
                info = load_cluster(args.admin_key_file)
            except ValueError as exc:
                raise KeyFileError(f"--admin-key-file {args.admin_key_file}: {exc}") from None
            return info.admin_key, info.admin_tag_key
        if args.admin_key_file is not None:
            return read_admin_key_file(args.admin_key_file)
        if args.admin_key_fd is not None:
            return read_key_fd(args.admin_key_fd)
    except KeyFileError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    return 0, b""


def add_trace_records(parser: argparse.ArgumentParser) -> None:
    """--trace-records: each NIC's trace ring (SPEC.md 6.7)."""
    parser.add_argument(
        "--trace-records",
        type=bounded_int(0, 1 << 24),
        default=DEFAULT_TRACE_RECORDS,
        help="records of each NIC's trace ring, 48 bytes each, read by `netdam trace` and "
        f"`--trace` (default {DEFAULT_TRACE_RECORDS}: 1.5 MiB per NIC; 0 turns tracing off)",
    )


def add_scheduling(parser: argparse.ArgumentParser) -> None:
    """--scheduling: the node processes' scheduling policy (netdam.shell.startup.SCHEDULING)."""
    parser.add_argument(
        "--scheduling",
        choices=SCHEDULING,
        default="batch",
        help="the node processes' Linux scheduling policy: batch (default; SCHED_BATCH, so a "
        "NIC woken by its host's datagram does not preempt that host on a shared core: 4 nodes "
        "x 4 KiB 1.3 ms instead of 1.5 on 2 cores) or normal (the system default)",
    )


def _guard(args: argparse.Namespace) -> Any:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the
    # light commands need not pay for.
    from netdam.core.guard import GuardConfig

    return GuardConfig() if getattr(args, "no_guard", False) else GuardConfig.on()


def run_node(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.shell.node_process import NodeProcessConfig, main

    args.admin_key, args.admin_tag_key = _admin_keys(args)

    if args.nic:
        if args.nics_per_process != 1:
            raise CommandError(
                "--nics-per-process is for launched nodes; --nic already names each NIC of "
                "this process: drop one of them",
                ExitCode.USAGE,
            )
        return _run_nics(args)
    if wants_rendezvous(os.environ, args.master, bool(args.members)):
        return _run_launched_node(args)
    for flag, value in (
        ("--cluster", args.cluster),
        ("--bind auto", args.bind and args.bind[0] == "auto"),
        ("--nics-per-process", args.nics_per_process != 1),
    ):
        if value:
            raise CommandError(
                f"{flag} needs a rendezvous: run under torchrun, mpirun or srun, or pass "
                "--master HOST:PORT with --rank and --world-size",
                ExitCode.USAGE,
            )
    config = NodeProcessConfig(
        bind=args.bind or ("127.0.0.1", 7744),
        memory_bytes=args.memory,
        shm_dir=args.shm_dir,
        name=args.name or "netdam-node",
        admin_key=args.admin_key,
        admin_tag_key=args.admin_tag_key,
        members=args.members,
        mtu=args.mtu,
        rank=args.rank if args.rank is not None else 0,
        world_size=args.world_size if args.world_size is not None else 1,
        faults=faults_from(args),
        die_with_parent=args.die_with_parent,
        guard=_guard(args),
        trace_records=args.trace_records,
        scheduling=args.scheduling,
    )
    return main(config)


def _run_nics(args: argparse.Namespace) -> int:
    """``netdam node --nic ... --nic ...``: one process hosting several NICs."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.shell.nic_host import main
    from netdam.shell.node_process import NodeProcessConfig

    for flag, given in (("--bind", args.bind is not None), ("--rank", args.rank is not None)):
        if given:
            raise CommandError(
                f"{flag} conflicts with --nic, which gives each NIC's rank and address: "
                f"drop {flag}",
                ExitCode.USAGE,
            )
    ranks = [rank for rank, _, _ in args.nic]
    if len(set(ranks)) != len(ranks):
        raise CommandError(
            f"--nic names a rank twice ({', '.join(map(str, ranks))}): give each NIC its own rank",
            ExitCode.USAGE,
        )
    name, faults, guard = args.name or "netdam-node", faults_from(args), _guard(args)
    admin_key = args.admin_key or secrets.randbits(32) | 1  # one key for the NICs of one process
    configs = [
        NodeProcessConfig(
            bind=bind,
            memory_bytes=size or args.memory,
            shm_dir=args.shm_dir,
            name=f"{name}-{rank}",
            admin_key=admin_key,
            admin_tag_key=args.admin_tag_key,
            members=args.members,
            mtu=args.mtu,
            rank=rank,
            world_size=args.world_size if args.world_size is not None else len(args.nic),
            faults=faults,
            die_with_parent=args.die_with_parent,
            guard=guard,
            trace_records=args.trace_records,
            scheduling=args.scheduling,
        )
        for rank, bind, size in args.nic
    ]
    return main(configs)


def _run_launched_node(args: argparse.Namespace) -> int:
    """A node under a launcher (or --master): rank from the environment, then the rendezvous."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.shell.node_process import NodeProcessConfig

    try:
        spec = resolve_launch(
            os.environ, rank=args.rank, world_size=args.world_size, master=args.master
        )
        per = args.nics_per_process
        binds = [
            resolve_bind(node_bind(args.bind, spec.local_rank * per + k), spec.master)
            for k in range(per)
        ]
    except LaunchError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    except RendezvousError as exc:
        raise CommandError(str(exc), ExitCode(exc.code)) from None
    master = (
        f"{spec.master[0]}:{spec.master[1]} ({spec.master_source})"
        if spec.master
        else "none (world of one)"
    )
    hosting = (
        f", hosting NICs {spec.rank * per}..{spec.rank * per + per - 1} of {spec.world_size * per}"
        if per > 1
        else ""
    )
    print(
        f"netdam node: rank {spec.rank} of {spec.world_size} from {spec.source}, local rank "
        f"{spec.local_rank}{hosting}; rendezvous {master}; binding "
        + ", ".join(f"{ip}:{port}" for ip, port in binds),
        file=sys.stderr,
        flush=True,
    )
    configs = []
    for k, nic_bind in enumerate(binds):
        rank = spec.rank * per + k
        configs.append(
            NodeProcessConfig(
                bind=nic_bind,
                memory_bytes=args.memory,
                shm_dir=args.shm_dir,
                name=f"{args.name}-{rank}" if args.name else f"netdam-r{rank}-{os.getpid()}",
                admin_key=args.admin_key,
                admin_tag_key=args.admin_tag_key,
                mtu=args.mtu,
                rank=rank,
                world_size=spec.world_size * per,
                faults=faults_from(args),
                die_with_parent=args.die_with_parent,
                guard=_guard(args),
                trace_records=args.trace_records,
                scheduling=args.scheduling,
            )
        )
    try:
        return run_launched_node(
            configs,
            spec,
            cluster_path=args.cluster,
            timeout=args.rendezvous_timeout,
            admin_key=args.admin_key,
        )
    except RendezvousError as exc:
        raise CommandError(str(exc), ExitCode(exc.code)) from None


#: Most NICs `netdam up` starts on one machine: processes host many each (netdam.shell.nic_host),
#: ~1 MiB of resident state per NIC beside its memory. A chain spans at most 64 of them (one SR
#: list, protocol/constants.py MAX_SEGMENTS); an all-reduce over more runs as a torus of chains
#: (SPEC.md 4.2), the other collectives need groups of at most 64; a pool uses them all.
MAX_UP_NODES = 1024


def _check_up_flags(args: argparse.Namespace, nodes: int) -> None:
    """What `up` can tell before starting anything: ports fit, memory fits, MTU carries a
    collective over this many nodes."""

    if args.base_port is not None and args.base_port + nodes - 1 > 65535:
        raise CommandError(
            f"--base-port {args.base_port} leaves no room for {nodes} ports (last would be "
            f"{args.base_port + nodes - 1}): give at most {65536 - nodes}",
            ExitCode.USAGE,
        )
    mtu = args.mtu or DEFAULT_MTU
    # The longest chain: every member up to 64, past that a torus of chains of at most 64.
    hops = min(nodes, MAX_SEGMENTS)
    if mtu < min_mtu(hops):
        raise CommandError(
            f"--mtu {mtu} is too small for a collective over {hops} nodes (the start packet "
            f"names every node of a chain): give at least {min_mtu(hops)}",
            ExitCode.USAGE,
        )
    if not args.shm_dir.is_dir():
        raise CommandError(
            f"--shm-dir {args.shm_dir} is not a directory: create it or pass another",
            ExitCode.USAGE,
        )
    try:
        fs = os.statvfs(args.shm_dir)
    except OSError:
        return
    free = fs.f_bavail * fs.f_frsize
    if args.memory * nodes > free:
        raise CommandError(
            f"--memory {args.memory} B x {nodes} nodes needs {args.memory * nodes} B but "
            f"{args.shm_dir} has {free} B free: lower --memory or --nodes, or pass --shm-dir",
            ExitCode.USAGE,
        )


def run_up(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import (
        ClusterFileError,
        ClusterStartError,
        start_cluster,
        start_from_file,
    )

    path = args.cluster or Path.cwd() / f"netdam-cluster-{os.getpid()}.toml"
    # Before any node starts: nodes whose file cannot be written are nodes nobody can stop.
    check_writable_output(
        path, "--cluster" if args.cluster else "cluster file (choose with --cluster)"
    )
    from_file = args.cluster is not None and lists_nodes(args.cluster)
    if not from_file:
        _check_up_flags(args, args.nodes if args.nodes is not None else 4)
    try:
        if from_file:
            _check_file_flags(args)
            cluster = start_from_file(
                args.cluster,
                memory=args.memory,
                shm_dir=args.shm_dir,
                faults=faults_from(args),
                detach=args.detach,
                mtu=args.mtu,
                nics_per_process=args.nics_per_process,
                trace_records=args.trace_records,
                scheduling=args.scheduling,
            )
        else:
            cluster = start_cluster(
                args.nodes if args.nodes is not None else 4,
                memory=args.memory,
                base_port=args.base_port or 0,
                shm_dir=args.shm_dir,
                mtu=args.mtu or DEFAULT_MTU,
                cluster_path=path,
                faults=faults_from(args),
                detach=args.detach,
                switch=args.switch,
                nics_per_process=args.nics_per_process,
                trace_records=args.trace_records,
                scheduling=args.scheduling,
            )
    except (ValueError, ClusterStartError) as exc:
        usage = isinstance(exc, (ValueError, ClusterFileError))
        raise CommandError(str(exc), ExitCode.USAGE if usage else ExitCode.RUN_FAILED) from None
    summary: dict[str, object] = {
        "ok": True,
        "cluster": str(cluster.path),
        "nodes": len(_started(cluster)),
        "processes": len(cluster.processes),
        "startup_seconds": cluster.startup_seconds,
        "detached": args.detach,
    }
    if cluster.owned is not None:
        summary["ranks"] = list(cluster.owned)
        summary["world_size"] = len(cluster.info.nodes)
    if cluster.switch is not None:
        vip = cluster.switch.vip
        summary["vip"] = f"{vip[0]}:{vip[1]}"
    summary["endpoints"] = [f"{n.address}:{n.port}" for n in _started(cluster)]
    emit(summary, args.json, text=_up_table(cluster, args.detach))
    sys.stdout.flush()
    if args.detach:
        return ExitCode.OK
    return _supervise(cluster)


def _started(cluster: LocalCluster) -> list[NodeEntry]:
    return [n for n in cluster.info.nodes if cluster.owned is None or n.rank in cluster.owned]


def _up_table(cluster: LocalCluster, detached: bool) -> str:
    """What `up` prints: the cluster file's path first (scripts read that line), then who runs
    where, the VIP, the logs and how to stop."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import node_log

    path = cluster.path
    lines = [
        str(path),
        "",
        f"{'rank':>4}  {'endpoint':<21} {'control':>7} {'pid':>8}  {'memory':>9}  memory file",
    ]
    for n in _started(cluster):
        lines.append(
            f"{n.rank:>4}  {n.address + ':' + str(n.port):<21} {n.control_port:>7} {n.pid:>8}  "
            f"{format_size(n.memory_bytes):>9}  {n.memory_file}"
        )
    if cluster.switch is not None:
        vip = cluster.switch.vip
        lines.append(
            f"switch: VIP {vip[0]}:{vip[1]} (pid {cluster.switch.process.pid}); pool clients send there"
        )
    logs = node_log(cluster.info.name, 0)
    where = (
        f"logs: {logs.parent}/{cluster.info.name}-RANK.log (RANK: the first NIC each process hosts)"
    )
    if cluster.switch is not None:
        # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
        from netdam.cluster.launch import switch_log

        where += f", switch {switch_log(path)}"
    lines.append(where + " (more with -v)")
    mtu = cluster.info.mtu
    if largest_payload(mtu) > MAX_PAYLOAD_BYTES:
        lines.append(
            f"MTU {mtu}: an emulation MTU, payloads up to {largest_payload(mtu)} bytes where "
            f"{DEFAULT_MTU} carries {MAX_PAYLOAD_BYTES} (protocol/SPEC.md 2.7)"
        )
    lines.append(f"started in {cluster.startup_seconds:.1f} s; cluster file: {path}")
    if detached:
        lines.append(f"stop: netdam down --cluster {path}")
    else:
        lines.append(f"stop: Ctrl-C here, or `netdam down --cluster {path}` from another shell")
    return "\n".join(lines)


def _check_file_flags(args: argparse.Namespace) -> None:
    """Flags that describe a new cluster make no sense when the file describes it."""
    for flag, given in (
        ("--nodes", args.nodes is not None),
        ("--base-port", args.base_port is not None),
        ("--switch", args.switch),
    ):
        if given:
            raise CommandError(
                f"{flag} conflicts with {args.cluster}, which already lists [[nodes]]: drop "
                f"{flag} (the file decides), or give --cluster a new path",
                ExitCode.USAGE,
            )


def _supervise(cluster: LocalCluster) -> int:
    """Foreground: wait until Ctrl-C/SIGTERM or a node dies, then stop everything."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    dead = None
    try:
        while not stopping and dead is None:
            procs = cluster.processes + (
                [cluster.switch.process] if cluster.switch is not None else []
            )
            dead = next((p for p in procs if p.poll() is not None), None)
            time.sleep(0.1)
    finally:
        cluster.stop()
    if dead is not None:
        print(
            f"error: {dead_process_message(cluster, dead.pid, dead.returncode)}; cluster stopped",
            file=sys.stderr,
        )
        return ExitCode.RUN_FAILED
    return ExitCode.OK


def dead_process_message(cluster: LocalCluster, pid: int, code: int | None) -> str:
    """Who went with a process that exited: every NIC it hosted, by rank and address."""
    hosted = [n for n in cluster.info.nodes if n.pid == pid]
    if not hosted:
        return f"switch pid {pid} exited (code {code})"
    nics = ", ".join(f"rank {n.rank} ({n.address}:{n.port})" for n in hosted)
    return f"node process pid {pid} exited (code {code}), taking {len(hosted)} NIC{'s' * (len(hosted) > 1)} with it: {nics}"


def run_down(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import stop_cluster_file

    try:
        switch = load_switch_entry(args.cluster)
        info = stop_cluster_file(args.cluster)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    if switch is not None and not switch.pid:
        switch = None  # listed but not running here
    text = f"stopped {len(info.nodes)} nodes of {info.name}"
    if switch is not None:
        text += f" and its switch (VIP {switch.vip[0]}:{switch.vip[1]})"
    emit(
        {
            "ok": True,
            "stopped": len(info.nodes),
            "ranks": [n.rank for n in info.nodes],
            "switch_stopped": switch is not None,
            "cluster": str(args.cluster),
        },
        args.json,
        text=text,
    )
    return ExitCode.OK


def _load(path: Path) -> ClusterFile:

    try:
        return load_cluster(path)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


def run_stats(args: argparse.Namespace) -> int:

    # Imported here: it loads numba's compiled kernels (~0.7 s) only when a node is silent.
    from netdam.cli.running import diagnose, summarize

    info = _load(args.cluster)
    nodes = []
    errors = []
    # The data port the file names is what every other command uses: a node that answers only
    # on its control port would look healthy here and fail everywhere else.
    _, faults = diagnose(args.cluster, info, timeout=min(args.timeout, 0.5))
    faulty = {f.rank: f for f in faults}
    with ControlClient.for_cluster(info) as client:
        for node in info.nodes:
            if node.rank in faulty:
                nodes.append(
                    {
                        "rank": node.rank,
                        "address": f"{node.address}:{node.port}",
                        "error": faulty[node.rank].message,
                    }
                )
                continue
            start = time.perf_counter()
            try:
                values = client.counters(node.control_endpoint, timeout=args.timeout)
            except (ControlError, OSError) as exc:  # OSError: unreachable from here (another host)
                errors.append(f"rank {node.rank}: {exc}")
                nodes.append(
                    {"rank": node.rank, "address": f"{node.address}:{node.port}", "error": str(exc)}
                )
                continue
            named = C.counters_to_dict(values)
            named.update(
                rank=node.rank,
                address=f"{node.address}:{node.port}",
                answer_seconds=time.perf_counter() - start,
            )
            nodes.append(named)
    result = {"ok": not errors and not faults, "cluster": str(args.cluster), "nodes": nodes}
    code = ExitCode.OK
    if faults:
        message, code = summarize(args.cluster, info, faults)
        errors.insert(0, message)
    elif errors:
        code = ExitCode.RUN_FAILED
    if errors:
        result["error"] = "; ".join(errors)
    emit(result, args.json, text=_stats_table(nodes))
    if errors:
        print(f"error: {errors[0]}", file=sys.stderr)  # the table went to stdout: say why it failed
    return code


def _stats_table(nodes: list[dict[str, object]]) -> str:
    cols = (
        "rx_packets",
        "tx_packets",
        "forwarded",
        "stored",
        "drops",
        "kernel_drops",
        "drop_lockout",
        "rcvbuf_bytes",
    )
    lines = [f"{'rank':>4} {'address':<21} " + " ".join(f"{c:>13}" for c in cols)]
    for node in nodes:
        if "error" in node:
            lines.append(f"{node['rank']:>4} {node['address']:<21} {node['error']}")
            continue
        lines.append(
            f"{node['rank']:>4} {node['address']:<21} " + " ".join(f"{node[c]!s:>13}" for c in cols)
        )
    return "\n".join(lines)


def run_ping(args: argparse.Namespace) -> int:

    targets = [args.node]
    entries = []
    if args.cluster:
        # Imported here: it loads numba's compiled kernels (~0.7 s) only when a pid is gone.
        from netdam.cli.running import check_not_stale, why_silent

        listed = _load(args.cluster)
        check_not_stale(args.cluster, listed)
        targets = [n.endpoint for n in listed.nodes]
        entries = list(listed.nodes)
    results = []
    failed = False
    file_at_fault = []
    with ControlClient() as client:
        for k, ep in enumerate(targets):
            rtts = []
            info: dict[str, int] = {}
            error = None
            for _ in range(args.count):
                try:
                    info, rtt = client.ping(ep, timeout=args.timeout)
                    rtts.append(rtt)
                except (ControlError, OSError) as exc:
                    error = str(exc)
            failed |= not rtts
            if not rtts and entries:  # name why, as stats does: a wrong port, a dead node
                fault = why_silent(args.cluster, entries[k], timeout=args.timeout)
                error = fault.message
                file_at_fault.append(fault.code == ExitCode.USAGE)
            results.append(
                {
                    "address": f"{ep[0]}:{ep[1]}",
                    "answered": len(rtts),
                    "sent": args.count,
                    "rtt_seconds_min": min(rtts) if rtts else None,
                    "info": info,
                    **({"error": error} if not rtts and error else {}),
                }
            )
    text = "\n".join(
        f"{r['address']}: {r['answered']}/{r['sent']} answered"
        + (
            f", rtt min {r['rtt_seconds_min'] * 1e6:.0f} us, rank {r['info'].get('rank')}, "
            f"memory {r['info'].get('memory_bytes')} B"
            if r["answered"]
            else f" ({r.get('error')})"
        )
        for r in results
    )
    emit({"ok": not failed, "nodes": results}, args.json, text=text)
    if failed and file_at_fault and all(file_at_fault):
        return ExitCode.USAGE  # the cluster file names ports its running nodes do not use
    return ExitCode.RUN_FAILED if failed else ExitCode.OK
