"""``netdam demo``: the main job (what exists so far), with a summary or one JSON object."""

from __future__ import annotations

import argparse

from netdam.cli.common import CommandError, ExitCode, Subparsers, bounded_int, emit, size_arg
from netdam.protocol.constants import ELEMENT_SIZE, DType


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the main job: a small cluster doing an all-reduce and pool traffic",
        description="Start N emulated NICs, drive them with wire packets (REGISTER, WRITE, READ, "
        "FETCH_ADD, CHAIN_ADD, ALL_WRITE), run a chained all-reduce with multicast all-gather, "
        "and check every rank against a numpy reference. The NICs are node processes on "
        "loopback UDP; the all-reduce runs in them (START_COLL) with multicast all-gather.",
    )
    parser.add_argument(
        "--nodes", type=bounded_int(2, 64), default=4, help="emulated NICs, 2..64 (default 4)"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--size", type=size_arg, default=None, help="bytes per rank (default 1MiB)")
    size.add_argument(
        "--count",
        type=bounded_int(1, 1 << 40),
        default=None,
        help="elements per rank instead of bytes",
    )
    parser.add_argument("--dtype", choices=["f32", "f16", "i32", "i64", "f64"], default="f32")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random inputs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.demo import DemoConfig, run_demo

    dtype = DType[args.dtype.upper()]
    count = (
        args.count if args.count is not None else (args.size or (1 << 20)) // ELEMENT_SIZE[dtype]
    )
    if count < 1:
        raise CommandError(f"--size/--count give {count} elements; need at least 1", ExitCode.USAGE)
    summary = run_demo(DemoConfig(nodes=args.nodes, count=count, dtype=dtype, seed=args.seed))
    emit(summary, args.json, text=_text(summary))
    return ExitCode.OK if summary["ok"] else ExitCode.CHECK_FAILED


def _text(s: dict[str, object]) -> str:
    pool = s["pool"]
    ar = s["allreduce"]
    assert isinstance(pool, dict) and isinstance(ar, dict)
    verdict = "OK" if s["ok"] else "FAILED"
    return "\n".join(
        [
            f"netdam demo: {verdict}  ({s['transport']})",
            f"  nodes {s['nodes']}, {s['bytes']} bytes of {s['dtype']} per rank",
            f"  node processes up in {s['startup_seconds']:.2f} s",
            f"  pool via VIP {pool['vip']}: {pool['ops']} ops ({pool['ops_per_second']:.0f}/s), "
            f"{pool['mismatches']} mismatches, "
            f"FETCH_ADD counter {pool['fetch_add_counter']} (expected {pool['fetch_add_expected']})",
            f"  all-reduce in the NICs ({ar['elements_per_packet']} elements per packet, "
            f"{ar['retransmits']} retransmits): ranks identical: {ar['ranks_identical']}, "
            f"equals numpy chain-order reference: "
            f"{ar['equals_reference']}, {ar['seconds']:.3f} s emulated "
            f"(model of 100G NetDAM cards: {ar['model_seconds_100g'] * 1e6:.1f} us)",
            f"  counters: {s['counters']}",
        ]
    )
