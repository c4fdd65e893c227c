"""``netdam bench``: benchmarks that run real node processes over real UDP sockets.

One parent command with one subcommand per benchmark. Each benchmark adds itself in
``_BENCHMARKS`` with a ``register_<name>(subparsers)`` function that sets ``func`` (the same
convention as the top-level subcommands, netdam/cli/main.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from netdam.cli.cluster import add_nics_per_process, mtu_arg
from netdam.cli.common import (
    CommandError,
    ExitCode,
    NetdamArgumentParser,
    Subparsers,
    bounded_int,
    bounded_seconds,
    emit,
    size_arg,
    size_range_arg,
    writable_output,
)
from netdam.cli.private_memory import check_private_memory
from netdam.protocol.constants import DEFAULT_MTU
from netdam.tools import plot
from netdam.tools.bench import allreduce as allreduce_bench
from netdam.tools.bench import jobs as jobs_bench


def register(subparsers: Subparsers) -> None:
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


def register_datapath(benches: Subparsers) -> None:

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
        "--seconds",
        type=bounded_seconds(0, 3600, low_inclusive=False),
        default=3.0,
        help="measured seconds per phase (3)",
    )
    parser.add_argument(
        "--warmup",
        type=bounded_seconds(0, 600, low_inclusive=True),
        default=1.0,
        help="seconds before timing starts (1)",
    )
    parser.add_argument(
        "--mtu",
        type=int,
        default=9000,
        help="IP MTU (default 9000; 65000: 60 KiB CHAIN_ADDs, an emulation MTU, SPEC.md 2.7)",
    )
    parser.add_argument(
        "--packets",
        type=int,
        default=None,
        help="distinct CHAIN_ADD packets the feeder cycles through, a multiple of its batch "
        "(default: 4 batches)",
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
    # Imported here: the datapath bench loads numba and its kernels (~1 s), which every other
    # command (even `netdam --version`) would pay at start-up otherwise.
    from netdam.tools.bench.datapath import (
        FEED_BATCH,
        DatapathBenchConfig,
        format_text,
        parse_node_cmd,
        run_datapath_bench,
    )

    cfg = DatapathBenchConfig(
        seconds=args.seconds,
        warmup=args.warmup,
        packets=4 * FEED_BATCH if args.packets is None else args.packets,
        mtu=args.mtu,
        seed=args.seed,
        node_memory=args.node_memory,
        window=args.window,
        pin={} if args.no_pin else None,
        node_cmd=parse_node_cmd(args.node_cmd) if args.node_cmd else None,
    )
    result, code = _measured(run_datapath_bench, cfg)
    emit(result, args.json, text=format_text(result))
    return code


def _measured(
    bench: Callable[[Any], tuple[dict[str, Any], int]], cfg: Any
) -> tuple[dict[str, Any], int]:
    """*bench*'s result and exit code for *cfg*; a configuration it refuses is a usage error."""
    try:
        return bench(cfg)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


# ---------------------------------------------------------------- bench pool


def register_pool(benches: Subparsers) -> None:
    """``netdam bench pool``: netdam/tools/bench/pool.py (and pool_async.py with --async)."""

    parser = benches.add_parser(
        "pool",
        help="pool READ/WRITE through the switch vs memcached GET (ratio = netdam / memcached)",
        description="Pool READ and WRITE at 64 B and 4 KiB through the switch's VIP, memcached GET "
        "64 B over UDP and a null echo server, all driven by the same numba generator processes "
        "with a fixed window in flight. Keys: netdam_ops (READ 64 B), memcached_ops (GET 64 B), "
        "ratio, generator_ops (echo). Exit 0 ok, 1 error replies, 3 a process failed.",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per phase (2)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before timing (0.5)")
    parser.add_argument("--window", type=int, default=32, help="requests in flight in all (32)")
    parser.add_argument("--nodes", type=int, default=2, help="node processes behind the switch (2)")
    parser.add_argument(
        "--interleave", type=size_arg, default=8192, help="stride of the region (8KiB)"
    )
    parser.add_argument(
        "--generators", type=int, default=1, help="generator processes to start with"
    )
    parser.add_argument(
        "--max-generators", type=int, default=4, help="most generator processes (4)"
    )
    parser.add_argument("--memcached", default=None, help="memcached binary (default: from PATH)")
    parser.add_argument(
        "--untagged",
        action="store_true",
        help="an untagged region (SPEC v1): requests and replies go unsealed, to measure "
        "what tags cost (SPEC 2.6)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=writable_output("--plot"),
        help="draw ops/s and latency per phase, netdam beside memcached (needs the "
        "[plot] extra: matplotlib)",
    )
    parser.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="instead: --clients asyncio clients (AsyncPoolClient) in one event loop, "
        "READ/WRITE 64 B and 4 KiB, every READ checked",
    )
    parser.add_argument("--clients", type=int, default=8, help="with --async: clients, 1..256 (8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args: argparse.Namespace) -> int:
        if args.async_mode:
            return run_pool_async(args)
        # Imported here, as in run_datapath: the pool bench loads the kernels too.
        from netdam.tools.bench import pool as pool_bench

        plt = plot.pyplot() if args.plot else None  # before the run: a missing extra is usage
        cfg = pool_bench.PoolBenchConfig(
            seconds=args.seconds,
            warmup=args.warmup,
            window=args.window,
            nodes=args.nodes,
            interleave=args.interleave,
            generators=args.generators,
            max_generators=args.max_generators,
            memcached=args.memcached,
            untagged=args.untagged,
        )
        result, code = _measured(pool_bench.run_pool_bench, cfg)
        text = pool_bench.format_text(result)
        if plt is not None and result["results"]:
            pool_bench.plot_pool(plt, result, args.plot)
            result["plot"] = str(args.plot)
            text += f"\n  plot written to {args.plot}"
        emit(result, args.json, text=text)
        return code

    parser.set_defaults(func=run)


def run_pool_async(args: argparse.Namespace) -> int:
    """``netdam bench pool --async``: netdam/tools/bench/pool_async.py."""
    # Imported here: the asyncio client and asyncio-dgram, which the generator benchmark does not use.
    from netdam.tools.bench.pool_async import (
        AsyncPoolBenchConfig,
        format_async_text,
        run_async_pool_bench,
    )

    if args.plot:
        raise CommandError(
            "--plot draws the generator phases: drop it with --async", ExitCode.USAGE
        )
    cfg = AsyncPoolBenchConfig(
        clients=args.clients,
        seconds=args.seconds,
        warmup=args.warmup,
        nodes=args.nodes,
        interleave=args.interleave,
    )
    result, code = _measured(run_async_pool_bench, cfg)
    emit(result, args.json, text=format_async_text(result))
    return code


# ---------------------------------------------------------------- bench allreduce


def emulation_mtu_arg(text: str) -> int:
    """``--emulation-mtu``: 0 (off) or an MTU above the wire's, up to 65535."""
    if text.strip() == "0":
        return 0
    value = mtu_arg(text)
    if value <= DEFAULT_MTU:
        raise argparse.ArgumentTypeError(
            f"--emulation-mtu {value} is not above the wire's MTU {DEFAULT_MTU}: give e.g. "
            "65000, or 0 for none"
        )
    return value


def register_allreduce(benches: Subparsers) -> None:
    """``netdam bench allreduce``: netdam/tools/bench/allreduce.py."""

    parser = benches.add_parser(
        "allreduce",
        help="chain all-reduce vs ring-host, Gloo and MPI in the same run (ratio_vs_chain)",
        description="All-reduce of float32 tensors on N ranks: chain (always) and the peers of "
        "--vs, each in its own processes as its users run it, warm-up then --repeat timed calls "
        "(peers: barrier before each, slowest rank). Rows carry seconds_median/min/max, "
        "algbw/busbw (Gb/s, busbw = algbw x 2(N-1)/N), ratio_vs_chain (algorithm / chain) and "
        "model_seconds_100g. Missing peers are reported in `skipped`. Exit 0 ok, 1 a chain or "
        "ring-host result was wrong, 2 usage, 3 a run failed.",
    )
    parser.add_argument("--nodes", default="4", help="ranks: N or a list like 2,4,8 (default 4)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--size", type=size_arg, default=None, help="bytes per rank (default 64MiB)")
    sizes.add_argument(
        "--sizes", type=size_range_arg, default=None, help="A..B: powers of two, e.g. 1KiB..256MiB"
    )
    parser.add_argument(
        "--vs",
        default=",".join(allreduce_bench.PEERS),
        help="peers, comma-separated: chain-resident, ring-host, gloo, mpi (TCP), mpi-shm "
        "(shared memory), or none (default all)",
    )
    parser.add_argument(
        "--repeat",
        type=bounded_int(1, 1000),
        default=None,
        help="timed calls per row (default 100 up to 64KiB, 20 up to 4MiB, 5 above)",
    )
    parser.add_argument(
        "--warmup", type=bounded_int(0, 100), default=1, help="untimed calls first (1)"
    )
    parser.add_argument(
        "--rounds",
        type=bounded_int(1, 20),
        default=1,
        help="run every row this many times, the rows taking turns, and pool each row's calls: "
        "a slow spell of the machine then falls on every row alike (1)",
    )
    parser.add_argument(
        "--timeout",
        type=bounded_seconds(0, 86400, low_inclusive=False),
        default=600.0,
        help="wall-clock limit of one gloo/mpi run in seconds (600)",
    )
    parser.add_argument(
        "--plot",
        type=writable_output("--plot"),
        default=None,
        help="write a PNG figure (needs matplotlib)",
    )
    parser.add_argument(
        "--emulation-mtu",
        type=emulation_mtu_arg,
        default=allreduce_bench.DEFAULT_EMULATION_MTU,
        metavar="MTU",
        help="also run chain (and chain-resident) at this loopback MTU, as chain-emu rows, "
        "where a rank's block spans more than one 8 KiB payload (SPEC.md 2.7; default "
        f"{allreduce_bench.DEFAULT_EMULATION_MTU}; 0: only the wire's MTU, {DEFAULT_MTU})",
    )
    add_nics_per_process(parser)
    parser.add_argument(
        "--jobs",
        type=bounded_int(1, 3),
        default=1,
        metavar="J",
        help="J > 1: J jobs' all-reduces on the same NICs at once against one job alone "
        "(each job its own process and keys; --size per rank, default 16MiB; one --nodes "
        "count; --vs is not run)",
    )
    parser.add_argument(
        "--window",
        type=bounded_seconds(0.1, 3600.0, low_inclusive=True),
        default=jobs_bench.WINDOW_S,
        metavar="SEC",
        help=f"with --jobs: seconds each job loops in a timed window ({jobs_bench.WINDOW_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args: argparse.Namespace) -> int:
        if args.jobs > 1:
            return _run_jobs(args)
        try:
            nodes = allreduce_bench.parse_nodes(args.nodes)
            peers = allreduce_bench.parse_peers(args.vs)
            chosen = (
                args.sizes
                if args.sizes is not None
                else [args.size if args.size is not None else 64 << 20]
            )
            size_list = allreduce_bench.check_sizes(chosen)
        except ValueError as exc:
            raise CommandError(str(exc), ExitCode.USAGE) from None
        # Every row starts a cluster of its own, one after another: the largest must fit.
        check_private_memory(max(nodes), max(size_list))
        if args.plot is not None:
            if args.plot.suffix.lower() != ".png":
                raise CommandError(f"--plot {args.plot}: give a .png file name", ExitCode.USAGE)
            missing = allreduce_bench.plot_unavailable()
            if missing is not None:
                raise CommandError(missing, ExitCode.USAGE)
        cfg = allreduce_bench.AllReduceBenchConfig(
            nodes=nodes,
            sizes=size_list,
            peers=peers,
            repeat=args.repeat,
            warmup=args.warmup,
            timeout_s=args.timeout,
            plot=args.plot,
            emulation_mtu=args.emulation_mtu,
            nics_per_process=args.nics_per_process,
            rounds=args.rounds,
        )
        result, code = allreduce_bench.run_allreduce_bench(cfg)
        if args.json:
            sys.stderr.write(allreduce_bench.format_table(result) + "\n")
        emit(result, args.json, text=allreduce_bench.format_table(result))
        return code

    parser.set_defaults(func=run)


def _run_jobs(args: argparse.Namespace) -> int:
    """``netdam bench allreduce --jobs J`` (netdam/tools/bench/jobs.py)."""
    try:
        nodes = allreduce_bench.parse_nodes(args.nodes)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    if len(nodes) != 1 or args.sizes is not None:
        raise CommandError(
            "--jobs runs one node count and one size: give --nodes N and --size B", ExitCode.USAGE
        )
    size = args.size if args.size is not None else 16 << 20
    if size % 4 or size < jobs_bench.SMALL_BYTES:
        raise CommandError(
            f"--size {size}: give a multiple of 4 bytes (int32 elements), at least "
            f"{jobs_bench.SMALL_BYTES}",
            ExitCode.USAGE,
        )
    result, code = jobs_bench.run_jobs_bench(
        nodes[0], size, args.jobs, window_s=args.window, timeout_s=args.timeout
    )
    text = jobs_bench.format_jobs_table(result)
    if args.json:
        sys.stderr.write(text + "\n")
    emit(result, args.json, text=text)
    return code


_BENCHMARKS: tuple[Callable[[Subparsers], None], ...] = (
    register_datapath,
    register_pool,
    register_allreduce,
)
