"""Command line of one switch process: ``netdam switch`` and ``python -m netdam.switch``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from netdam.cli.cluster import endpoint_arg, mtu_arg
from netdam.cli.common import NetdamArgumentParser, configure_logging
from netdam.cluster.clusterfile import load_cluster
from netdam.protocol.constants import DEFAULT_MTU
from netdam.switch.state import state_path_for


def add_switch_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument(
        "--cluster", type=Path, required=True, help="cluster file of the nodes (netdam up)"
    )
    parser.add_argument(
        "--vip",
        type=endpoint_arg,
        required=True,
        help="virtual IP:PORT clients send to; the nodes must list it in --members",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="pool state file (default: CLUSTER with suffix .pool.json)",
    )
    parser.add_argument(
        "--mtu",
        type=mtu_arg,
        default=DEFAULT_MTU,
        help="IP MTU (default 9000; the cluster's, an emulation MTU too: protocol/SPEC.md 2.7)",
    )
    parser.add_argument(
        "--faults",
        default="",
        help="per-link faults, LINK:rx|tx:SPEC;... e.g. "
        "'node0:tx:loss=0.1,dup=0.05;client:rx:kth=FETCH_ADD@3'",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every fault decision")
    parser.add_argument(
        "--die-with-parent", action="store_true", help="exit when the launcher dies"
    )
    parser.add_argument(
        "--no-guard",
        action="store_true",
        help="no lockout of key guessers, no anti-amplification limit for clients "
        "(SPEC.md 12): for fuzzing only",
    )


def run_switch(args: argparse.Namespace) -> int:

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.faults import parse_faults

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.process import SwitchProcessConfig, main

    try:
        nodes = len(load_cluster(args.cluster).nodes)
        faults = parse_faults(args.faults, nodes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = SwitchProcessConfig(
        vip=args.vip,
        cluster_file=args.cluster,
        state_file=args.state or state_path_for(args.cluster),
        mtu=args.mtu,
        faults=faults,
        seed=args.seed,
        die_with_parent=args.die_with_parent,
        guard=not args.no_guard,
    )
    return int(main(config))


def main(argv: Sequence[str] | None = None) -> int:

    parser = NetdamArgumentParser(
        prog="python -m netdam.switch", description="Run one pool switch."
    )
    add_switch_arguments(parser)
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more (to stderr: the log file when `netdam up --switch` starts it)",
    )
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    return run_switch(args)
