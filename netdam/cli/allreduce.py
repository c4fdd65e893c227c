"""``netdam allreduce``: one all-reduce on real node processes, verified, with counters."""

from __future__ import annotations

import argparse
from pathlib import Path

from netdam.cli.cluster import add_fault_args, faults_from
from netdam.cli.common import (
    CommandError,
    ExitCode,
    bounded_int,
    bounded_seconds,
    cluster_file,
    emit,
    size_arg,
)
from netdam.cluster.clusterfile import load_cluster
from netdam.core.chunk_plan import min_mtu
from netdam.protocol.constants import ELEMENT_SIZE, DType, ReduceOp


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "allreduce",
        help="run an all-reduce on node processes and check it against numpy",
        description="Start N node processes (or use --cluster), all-reduce seeded inputs in the "
        "NICs (chained reduce-scatter + multicast all-gather), read every rank's result back and "
        "compare it bitwise with a numpy reference summed in chain order.",
    )
    parser.add_argument("--nodes", type=bounded_int(2, 64), default=4,
                        help="node processes, 2..64 (default 4; with --cluster, the file's)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--size", type=size_arg, help="bytes per rank (default 4MiB)")
    size.add_argument("--count", type=bounded_int(1, 1 << 40), help="elements per rank instead of bytes")
    parser.add_argument("--dtype", choices=["f32", "f16", "i32", "i64", "f64"], default="f32")
    parser.add_argument("--op", choices=["sum", "min", "max"], default="sum")
    parser.add_argument("--algo", choices=["chain", "ring-host"], default="chain",
                        help="chain: in the NICs (NetDAM); ring-host: the RoCE way, NICs move "
                        "data and hosts reduce (reports host_copy_bytes)")  # fmt: skip
    parser.add_argument("--sparse", action="store_true",
                        help="sparse mode: (index, value) payloads and zero chunks skipped; the same "
                        "inputs also run dense, and both wire byte counts are reported")  # fmt: skip
    parser.add_argument("--density", type=float, default=None,
                        help="fraction of input elements left non-zero, the rest exactly 0 "
                        "(default 0.05 with --sparse, else 1)")  # fmt: skip
    parser.add_argument("--resident", action="store_true",
                        help="buffers in NIC memory (netdam.empty): no staging copy in or out; "
                        "default: plain numpy arrays, staged and timed as netdam.all_reduce(x) does")  # fmt: skip
    parser.add_argument("--repeat", type=bounded_int(1, 10000), default=1,
                        help="timed repeats, >= 1 (median reported; default 1)")
    parser.add_argument("--timeout", type=bounded_seconds(0.01, 86400.0, low_inclusive=True), default=None,
                        help="watchdog: seconds a collective may go without progress before it "
                        "fails naming the dead node (default 2.5)")
    parser.add_argument("--cluster", type=cluster_file, default=None, help="use a running cluster (netdam up)")
    parser.add_argument("--json", action="store_true")
    add_fault_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.allreduce import AllReduceConfig, run_allreduce

    dtype = DType[args.dtype.upper()]
    count = args.count if args.count is not None else (args.size or (4 << 20)) // ELEMENT_SIZE[dtype]
    if count < 1:
        raise CommandError(f"--size/--count give {count} elements; need at least 1", ExitCode.USAGE)
    density = args.density if args.density is not None else (0.05 if args.sparse else 1.0)
    if not 0.0 <= density <= 1.0:
        raise CommandError("--density must be between 0 and 1", ExitCode.USAGE)
    if args.resident and args.cluster is not None:
        raise CommandError("--resident needs a private cluster (drop --cluster): other users' "
                           "netdam.empty arrays may hold a running cluster's memory", ExitCode.USAGE)  # fmt: skip
    if args.sparse and args.algo != "chain":
        raise CommandError("--sparse needs --algo chain", ExitCode.USAGE)
    if args.cluster is not None:
        _check_cluster_mtu(args.cluster)
    config = AllReduceConfig(
        nodes=args.nodes, count=count, dtype=dtype, op=ReduceOp[args.op.upper()],
        faults=faults_from(args), timeout_s=args.timeout,
        cluster=Path(args.cluster) if args.cluster else None, seed=args.seed, repeat=args.repeat,
        algo=args.algo, sparse=args.sparse, density=density, resident=args.resident,
    )  # fmt: skip
    result = run_allreduce(config)
    code = int(result.pop("exit_code", ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED))  # type: ignore[call-overload]
    emit(result, args.json, text=_text(result))
    return int(code)


def _check_cluster_mtu(path: object) -> None:
    """A cluster started with a small --mtu cannot carry a collective over all its nodes: say so
    now, not after a watchdog period of silence."""


    try:
        info = load_cluster(Path(str(path)))
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    world = len(info.nodes)
    if info.mtu < min_mtu(world):
        raise CommandError(f"{path} runs at MTU {info.mtu}, too small for a collective over {world} nodes: "
                           f"restart it with `netdam up --mtu {min_mtu(world)}` or more", ExitCode.USAGE)  # fmt: skip


def _text(r: dict[str, object]) -> str:
    if r.get("seconds") is None:
        return f"allreduce FAILED: {r.get('error')}" + (f"\n  waiting for {r['waiting_for']}" if r.get("waiting_for") else "")
    verdict = "OK" if r["ok"] else f"FAILED ({r.get('error')})"
    return (
        f"allreduce {r['algo']} {verdict}: {r['nodes']} nodes x {r['bytes']} B {r['dtype']} {r['op']} in "
        f"{r['seconds']:.4f} s (algbw {float(r['algbw_gbps']):.3f} Gb/s, busbw {float(r['busbw_gbps']):.3f} Gb/s); "  # type: ignore[arg-type]
        f"{r['packets']} packets, {r['retransmits']} retransmits, {r['kernel_drops']} kernel drops; "
        f"model of 100G NetDAM cards: {float(r['model_seconds_100g']) * 1e3:.3f} ms"  # type: ignore[arg-type]
        + (f"\n  sparse (density {r['density']}): {r['wire_bytes_sparse']} wire bytes in {r['seconds']:.4f} s; "
           f"dense: {r['wire_bytes_dense']} wire bytes in {float(r['seconds_dense']):.4f} s"  # type: ignore[arg-type]
           if r.get("sparse") else "")
        + _phases_text(r)
    )


def _phases_text(r: dict[str, object]) -> str:
    phases = r.get("phases")
    if not isinstance(phases, dict):
        return ""
    parts = ", ".join(f"{name.replace('_', ' ')} {float(v) * 1e3:.3f} ms" for name, v in phases.items())
    where = "NIC-resident buffers" if r.get("resident") else "numpy buffers staged"
    return f"\n  phases (median, {where}): {parts}"
