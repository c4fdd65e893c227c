"""``netdam allreduce``: one all-reduce on real node processes, verified, with counters."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from netdam.cli.cluster import (
    MAX_UP_NODES,
    add_fault_args,
    add_nics_per_process,
    faults_from,
    mtu_arg,
)
from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_seconds,
    cluster_file,
    emit,
    size_arg,
    writable_output,
)
from netdam.cli.private_memory import check_private_memory, largest_fitting
from netdam.cluster.clusterfile import load_cluster
from netdam.core.chunk_plan import min_mtu
from netdam.core.torus import longest_chain, torus_shape
from netdam.protocol.constants import DEFAULT_MTU, ELEMENT_SIZE, MAX_SEGMENTS, DType, ReduceOp
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS
from netdam.units import format_size


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "allreduce",
        help="run an all-reduce on node processes and check it against numpy",
        description="Start N node processes (or use --cluster), all-reduce seeded inputs in the "
        "NICs (chained reduce-scatter + multicast all-gather), read every rank's result back and "
        "compare it bitwise with a numpy reference summed in chain order.",
    )
    parser.add_argument(
        "--nodes",
        type=bounded_int(2, MAX_UP_NODES),
        default=None,
        help=f"emulated NICs, 2..{MAX_UP_NODES} (default 4; with --cluster, the file's: a "
        "different count is refused); past --max-chain, a torus of chains (SPEC.md 4.2)",
    )
    parser.add_argument(
        "--max-chain",
        type=bounded_int(2, MAX_SEGMENTS),
        default=MAX_SEGMENTS,
        help=f"longest chain, 2..{MAX_SEGMENTS} (default {MAX_SEGMENTS}, what one SR list "
        "names): more NICs run as rows and columns of chains; lower it to study the torus "
        "on a few NICs",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--size", type=size_arg, help="bytes per rank (default 4MiB)")
    size.add_argument(
        "--count", type=bounded_int(1, 1 << 40), help="elements per rank instead of bytes"
    )
    parser.add_argument(
        "--dtype", choices=["f32", "f16", "bf16", "i32", "i64", "f64"], default="f32"
    )
    parser.add_argument("--op", choices=["sum", "min", "max"], default="sum")
    parser.add_argument(
        "--algo",
        choices=["chain", "ring-host"],
        default="chain",
        help="chain: in the NICs (NetDAM); ring-host: the RoCE way, NICs move "
        "data and hosts reduce (reports host_copy_bytes)",
    )
    parser.add_argument(
        "--sparse",
        action="store_true",
        help="sparse mode: (index, value) payloads and zero chunks skipped; the same "
        "inputs also run dense, and both wire byte counts are reported",
    )
    parser.add_argument(
        "--density",
        type=float,
        default=None,
        help="fraction of input elements left non-zero, the rest exactly 0 "
        "(default 0.05 with --sparse, else 1)",
    )
    parser.add_argument(
        "--resident",
        action="store_true",
        help="buffers in NIC memory (netdam.empty): no staging copy in or out; "
        "default: plain numpy arrays, staged and timed as netdam.all_reduce(x) does",
    )
    parser.add_argument(
        "--repeat",
        type=bounded_int(1, 10000),
        default=1,
        help="timed repeats, >= 1 (median reported; default 1)",
    )
    parser.add_argument(
        "--timeout",
        type=bounded_seconds(0.01, 86400.0, low_inclusive=True),
        default=None,
        help="watchdog: seconds a collective may go without progress before it "
        "fails naming the dead node (default 2.5)",
    )
    parser.add_argument(
        "--cluster", type=cluster_file, default=None, help="use a running cluster (netdam up)"
    )
    add_nics_per_process(parser)
    parser.add_argument(
        "--trace",
        type=writable_output("--trace"),
        default=None,
        help="write a timeline of the timed calls to this JSON file (Chrome trace format: "
        "open it in Perfetto or speedscope): every NIC hop by hop, every host rank",
    )
    parser.add_argument(
        "--trace-records",
        type=bounded_int(0, 1 << 24),
        default=None,
        help="records of each NIC's trace ring in the private cluster, 48 bytes each (default "
        f"{DEFAULT_TRACE_RECORDS}: 1.5 MiB per NIC); a NIC writes one for each datagram it "
        "takes or sends (an 8 x 64 MiB call: ~23,000), so large jobs need more to be traced "
        "whole (a running cluster's: `netdam up --trace-records`)",
    )
    parser.add_argument(
        "--mtu",
        type=mtu_arg,
        default=None,
        help=f"IP MTU of the private cluster (default {DEFAULT_MTU}); above the wire's, e.g. "
        "65000, an emulation MTU: 60 KiB datagrams on loopback, fewer and larger than a "
        "9000-byte wire carries, while the cycle model stays at its wire MTU (SPEC.md 2.7)",
    )
    parser.add_argument("--json", action="store_true")
    add_fault_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.allreduce import AllReduceConfig, run_allreduce

    dtype = DType[args.dtype.upper()]
    count = (
        args.count if args.count is not None else (args.size or (4 << 20)) // ELEMENT_SIZE[dtype]
    )
    if count < 1:
        raise CommandError(f"--size/--count give {count} elements; need at least 1", ExitCode.USAGE)
    density = args.density if args.density is not None else (0.05 if args.sparse else 1.0)
    if not 0.0 <= density <= 1.0:
        raise CommandError("--density must be between 0 and 1", ExitCode.USAGE)
    if args.resident and args.cluster is not None:
        raise CommandError(
            "--resident needs a private cluster (drop --cluster): other users' "
            "netdam.empty arrays may hold a running cluster's memory",
            ExitCode.USAGE,
        )
    if args.trace_records is not None and args.cluster is not None:
        raise CommandError(
            "--trace-records sizes a private cluster's trace rings; a running cluster's "
            "were set by `netdam up --trace-records` (drop one of the two)",
            ExitCode.USAGE,
        )
    if args.sparse and args.algo != "chain":
        raise CommandError("--sparse needs --algo chain", ExitCode.USAGE)
    nbytes = count * ELEMENT_SIZE[dtype]
    if args.cluster is not None:
        _check_cluster(args, nbytes)
    else:
        _check_torus(args, args.nodes or 4)
        check_private_memory(args.nodes or 4, nbytes)
    config = AllReduceConfig(
        nodes=args.nodes or 4,
        count=count,
        dtype=dtype,
        op=ReduceOp[args.op.upper()],
        faults=faults_from(args),
        timeout_s=args.timeout,
        cluster=Path(args.cluster) if args.cluster else None,
        seed=args.seed,
        repeat=args.repeat,
        algo=args.algo,
        sparse=args.sparse,
        density=density,
        resident=args.resident,
        nics_per_process=args.nics_per_process,
        max_chain=args.max_chain,
        trace=args.trace,
        mtu=args.mtu or DEFAULT_MTU,
        trace_records=(
            args.trace_records if args.trace_records is not None else DEFAULT_TRACE_RECORDS
        ),
    )
    result = run_allreduce(config)
    code = int(result.pop("exit_code", ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED))  # type: ignore[call-overload]  # the result dict holds JSON values (object)
    emit(result, args.json, text=_text(result))
    return int(code)


def _check_cluster(args: argparse.Namespace, nbytes: int) -> None:
    """What a running cluster must offer, checked before the first packet: the node count asked
    for, an MTU that carries a collective over all its nodes, nodes answering where the file
    says, and node memory for the buffer. Otherwise each shows up late and cryptically (a
    watchdog timeout, BAD_SEGMENT, a MemoryError)."""
    # Imported here: it loads numba's compiled kernels (~0.7 s) only when a node is silent.
    from netdam.cli.running import check_not_stale, check_running
    from netdam.tools.allreduce import node_memory_needed

    path = Path(args.cluster)
    try:
        info = load_cluster(path)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    world = len(info.nodes)
    # Refused rather than served by a subset: the collective's segment list, multicast group
    # and keys cover every node of the file, and a silently smaller (or larger) run would
    # report numbers for a cluster the user did not ask for.
    if args.nodes is not None and args.nodes != world:
        raise CommandError(
            f"--nodes {args.nodes} but {path} has {world} nodes: drop --nodes (the file "
            f"decides), or start a cluster of {args.nodes} with `netdam up --nodes {args.nodes}`",
            ExitCode.USAGE,
        )
    if args.mtu is not None and args.mtu != info.mtu:
        raise CommandError(
            f"--mtu {args.mtu} but {path} runs at MTU {info.mtu}: drop --mtu (the file "
            f"decides), or start a cluster with `netdam up --mtu {args.mtu}`",
            ExitCode.USAGE,
        )
    _check_torus(args, world)
    hops = longest_chain(world, args.max_chain) if args.algo == "chain" else world
    if info.mtu < min_mtu(hops):
        raise CommandError(
            f"{path} runs at MTU {info.mtu}, too small for a collective over {world} nodes: "
            f"restart it with `netdam up --mtu {min_mtu(hops)}` or more",
            ExitCode.USAGE,
        )
    check_not_stale(
        path, info
    )  # a file whose nodes are gone says so at once, before any PING waits
    answers = check_running(path, info)
    torus = args.algo == "chain" and world > args.max_chain
    needed = node_memory_needed(nbytes, args.algo, torus)
    for node in info.nodes:
        memory = answers.get(node.rank, {}).get("memory_bytes") or node.memory_bytes
        if memory and memory < needed:
            fits = largest_fitting(
                partial(_fits_node, algo=args.algo, memory=memory, torus=torus), nbytes
            )
            smaller = f", or give --size {format_size(fits)} or less" if fits else ""
            raise CommandError(
                f"{format_size(nbytes)} per rank needs {format_size(_mib(needed))} of node memory "
                f"(the host's arena is half of node memory and stages the buffer in its upper half) but rank {node.rank} "
                f"({node.address}:{node.port}) of {path} has {format_size(memory)}: restart the "
                f"cluster with more (`netdam down --cluster {path}`, then `netdam up --memory "
                f"{format_size(_mib(needed))}`){smaller}",
                ExitCode.USAGE,
            )


def _check_torus(args: argparse.Namespace, world: int) -> None:
    """Past --max-chain NICs the chain runs as a torus of chains (SPEC.md 4.2): the count must
    split into equal rows, and sparse mode, which lives in one chain, is not offered."""
    if args.algo != "chain" or world <= args.max_chain:
        return
    if args.sparse:
        raise CommandError(
            f"--sparse runs in one chain: {world} NICs past --max-chain {args.max_chain} run "
            "as a torus of chains, dense (drop --sparse, or use fewer NICs)",
            ExitCode.USAGE,
        )
    try:
        torus_shape(world, args.max_chain)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


def _fits_node(nbytes: int, *, algo: str, memory: int, torus: bool = False) -> bool:
    # Imported here: netdam.tools loads numba's compiled kernels (~0.7 s), which --help skips.
    from netdam.tools.allreduce import node_memory_needed

    return node_memory_needed(nbytes, algo, torus) <= memory


def _mib(nbytes: int) -> int:
    """*nbytes* rounded up to whole MiB: a --memory to suggest."""
    return -(-nbytes // (1 << 20)) * (1 << 20)


def _mtu_text(r: dict[str, object]) -> str:
    """Says so when the run's MTU is not the one the cycle model prices."""
    if r.get("mtu") is None or r["mtu"] == r["model_mtu"]:
        return ""
    return (
        f" (modelled at the wire's MTU {r['model_mtu']}; this run's MTU {r['mtu']} is an "
        "emulation MTU, loopback's datagrams)"
    )


def _text(r: dict[str, object]) -> str:
    if r.get("seconds") is None:
        return f"allreduce FAILED: {r.get('error')}" + (
            f"\n  waiting for {r['waiting_for']}" if r.get("waiting_for") else ""
        )
    verdict = "OK" if r["ok"] else f"FAILED ({r.get('error')})"
    return (
        f"allreduce {r['algo']} {verdict}: {r['nodes']} nodes x {r['bytes']} B {r['dtype']} {r['op']} in "
        f"{r['seconds']:.4f} s (algbw {float(r['algbw_gbps']):.3f} Gb/s, busbw {float(r['busbw_gbps']):.3f} Gb/s); "  # type: ignore[arg-type]  # the result dict holds JSON values (object)
        f"{r['packets']} packets, {r['retransmits']} retransmits, {r['kernel_drops']} kernel drops; "
        f"model of 100G NetDAM cards: {float(r['model_seconds_100g']) * 1e3:.3f} ms"  # type: ignore[arg-type]  # the result dict holds JSON values (object)
        + _mtu_text(r)
        + (
            f"\n  sparse (density {r['density']}): {r['wire_bytes_sparse']} wire bytes in {r['seconds']:.4f} s; "
            f"dense: {r['wire_bytes_dense']} wire bytes in {float(r['seconds_dense']):.4f} s"  # type: ignore[arg-type]  # the result dict holds JSON values (object)
            if r.get("sparse")
            else ""
        )
        + _phases_text(r)
        + _trace_text(r)
    )


def _trace_text(r: dict[str, object]) -> str:
    traced = r.get("trace")
    if not isinstance(traced, dict):
        return ""
    lost = (
        f"; {traced['lost']} records overwritten before they were read (a larger "
        "`--trace-records` keeps them; `netdam up --trace-records` for a running cluster)"
        if traced["lost"]
        else ""
    )
    return (
        f"\n  trace: {traced['path']} ({traced['records']} NIC records{lost}): open it in "
        "Perfetto (ui.perfetto.dev, the file stays local) or speedscope"
    )


def _phases_text(r: dict[str, object]) -> str:
    phases = r.get("phases")
    if not isinstance(phases, dict):
        return ""
    parts = ", ".join(
        f"{name.replace('_', ' ')} {float(v) * 1e3:.3f} ms" for name, v in phases.items()
    )
    where = "NIC-resident buffers" if r.get("resident") else "numpy buffers staged"
    host = r.get("host_overhead_us")
    overhead = (
        f"\n  host API per call and rank (median, copies excluded): {float(host['issue']):.0f} us "
        f"to issue, {float(host['return']):.0f} us to return"
        if isinstance(host, dict)
        else ""
    )
    return f"\n  phases (median, {where}): {parts}" + overhead
