"""``netdam bench``: benchmarks that run real node processes over real UDP sockets.

One parent command with one subcommand per benchmark. Each benchmark adds itself in
``_BENCHMARKS`` with a ``register_<name>(subparsers)`` function that sets ``func`` (the same
convention as the top-level subcommands, netdam/cli/main.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from netdam.cli.common import (
    CommandError,
    ExitCode,
    NetdamArgumentParser,
    bounded_seconds,
    emit,
    size_arg,
)
from netdam.tools.bench.allreduce import register_allreduce_bench
from netdam.tools.bench.datapath import (
    FEED_BATCH,
    DatapathBenchConfig,
    format_text,
    parse_node_cmd,
    run_datapath_bench,
)
from netdam.tools.bench.pool import register_pool_bench


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks against their peers, measured in the same run",
        description="Benchmarks that start real node processes over real UDP sockets and report "
        "our rate next to the peer's, measured in the same run (ratio = ours / peer's). numba "
        "compiles (or loads its cache) before timing; start-up time is reported apart.",
    )
    benches = parser.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", parser_class=NetdamArgumentParser
    )
    benches.required = True
    for add in _BENCHMARKS:
        add(benches)


# ---------------------------------------------------------------- bench datapath


def register_datapath(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    parser = benches.add_parser(
        "datapath",
        help="a node's packet rate against a bare GRO/GSO relay (ratio = node / relay)",
        description="Three phases in one run, each measured for --seconds after --warmup: a "
        "feeder into a null sink (feeder_pps), the feeder through a bare relay that does no "
        "work (raw_pps, GRO in, GSO out) and the feeder through a `netdam node` executing "
        "CHAIN_ADD (node_pps: only datagrams whose sums the sink verified bitwise). The run is "
        "valid when feeder_pps >= 1.2 x max(raw_pps, node_pps). Exit 0 ok, 1 sum mismatches, "
        "3 a process failed or timed out.",
    )
    parser.add_argument(
        "--seconds", type=bounded_seconds(0, 3600, low_inclusive=False), default=3.0, help="measured seconds per phase (3)"
    )
    parser.add_argument(
        "--warmup", type=bounded_seconds(0, 600, low_inclusive=True), default=1.0, help="seconds before timing starts (1)"
    )
    parser.add_argument("--mtu", type=int, default=9000, help="IP MTU (default 9000)")
    parser.add_argument(
        "--packets",
        type=int,
        default=4 * FEED_BATCH,
        help=f"distinct CHAIN_ADD packets the feeder cycles through (multiple of {FEED_BATCH})",
    )
    parser.add_argument(
        "--node-memory", type=size_arg, default=16 << 20, help="node memory (default 16MiB)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=1024,
        help="feeder pacing: datagrams in flight at most (sent, not yet at the sink); 0 = as "
        "fast as the socket takes them, which on loopback means overload and drops (default 1024)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let the scheduler place the processes (default: the relay/node gets a CPU of "
        "its own, the same in both phases)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of payloads and operands")
    parser.add_argument(
        "--node-cmd",
        default=None,
        help="command line that starts one node process (default: this Python's "
        "`-m netdam node`); it gets --bind, --memory, --members, --admin-key-fd, --shm-dir, "
        "--name and --mtu appended",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_datapath)


def run_datapath(args: argparse.Namespace) -> int:

    cfg = DatapathBenchConfig(
        seconds=args.seconds,
        warmup=args.warmup,
        packets=args.packets,
        mtu=args.mtu,
        seed=args.seed,
        node_memory=args.node_memory,
        window=args.window,
        pin={} if args.no_pin else None,
        node_cmd=parse_node_cmd(args.node_cmd) if args.node_cmd else None,
    )
    try:
        result, code = run_datapath_bench(cfg)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    emit(result, args.json, text=format_text(result))
    return code


#: Benchmarks under `netdam bench`, in the order --help lists them.
def register_pool(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    register_pool_bench(benches)


def register_allreduce(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    register_allreduce_bench(benches)


_BENCHMARKS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (  # type: ignore[type-arg]
    register_datapath,
    register_pool,
    register_allreduce,
)
