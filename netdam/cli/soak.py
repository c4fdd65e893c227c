"""``netdam soak``: concurrent clients verify every byte and one shared counter through the switch."""

from __future__ import annotations

import argparse
from typing import Any

from netdam import progress
from netdam.cli.cluster import probability
from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_milliseconds,
    bounded_seconds,
    cluster_file,
    emit,
)

DESCRIPTION = """\
Start a local cluster with a switch (or use --cluster), give every client process its own pool
region (random size, some interleaved over nodes) and run them concurrently for --seconds: each
WRITEs random bytes to blocks of its region, READs blocks back and checks them by checksum
against the last acknowledged write, and FETCH_ADDs +1 on one shared counter. Afterwards every
block and the counter are read back and checked.

Results (JSON keys): ops (acknowledged operations in the timed phase); lost_writes (acknowledged
writes a later read found replaced by an earlier version); corrupt_reads (reads whose data match
no version written there); errors (operations NACKed or unanswered after every retry: not
acknowledged); counter_error (final - initial - acknowledged increments when no increment is
unconfirmed; otherwise how far final - initial lies outside [acknowledged, acknowledged +
unconfirmed_increments], negative = increments lost, positive = applied twice);
counter_old_value_errors (acknowledged increments whose returned old values repeat or lie
outside [initial, final)). Exit 0 when all of those are 0, 1 otherwise, 3 when the run failed.

Faults are seeded (--seed) and decided per datagram by hash(seed, source, destination, packet
id, attempt) on each hop: the switch's client:rx and node<R>:tx links (requests; or, with
--fault-site nodes, the nodes' receive side) and the clients' receive side (replies, which come
straight from the nodes). With --cluster only the clients' receive side is injected here."""


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "soak",
        help="concurrent clients check every byte and a shared counter through the switch",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--clients", type=bounded_int(1, 64), default=8, help="client processes (default 8)"
    )
    parser.add_argument(
        "--seconds",
        type=bounded_seconds(0.0, 86400.0, low_inclusive=False),
        default=60.0,
        help="length of the timed phase (default 60)",
    )
    parser.add_argument(
        "--nodes",
        type=bounded_int(1, 16),
        default=None,
        help="node processes of the private cluster (default 3; with --cluster the file decides)",
    )
    parser.add_argument(
        "--cluster",
        type=cluster_file,
        default=None,
        help="use a running cluster (netdam up --switch)",
    )
    parser.add_argument(
        "--pipeline",
        type=bounded_int(1, 32),
        default=8,
        help="operations per pipelined batch of a client (default 8)",
    )
    parser.add_argument(
        "--timeout-ms",
        type=bounded_milliseconds(0.0, 10000.0, low_inclusive=False),
        default=50.0,
        help="client retry timeout, milliseconds (default 50)",
    )
    parser.add_argument(
        "--retries",
        type=bounded_int(0, 1000),
        default=40,
        help="retries per request before it counts in errors (default 40: 2 s at 50 ms)",
    )
    faults = parser.add_argument_group(
        "fault injection on every hop (seeded: the same packets meet the same fate)"
    )
    faults.add_argument("--loss", type=probability, default=0.0, help="drop probability per hop")
    faults.add_argument(
        "--dup", type=probability, default=0.0, help="duplicate probability per hop"
    )
    faults.add_argument(
        "--reorder", type=probability, default=0.0, help="reorder probability per hop"
    )
    faults.add_argument(
        "--delay",
        type=bounded_milliseconds(0.0, 1000.0, low_inclusive=True),
        default=0.0,
        metavar="MS",
        help="delay, milliseconds, of a --delay-prob fraction of datagrams per hop",
    )
    faults.add_argument(
        "--delay-prob",
        type=probability,
        default=0.1,
        help="fraction of datagrams delayed when --delay is given (default 0.1)",
    )
    faults.add_argument(
        "--seed", type=int, default=1, help="seed of the workload and of every fault decision"
    )
    faults.add_argument(
        "--fault-site",
        choices=["switch", "nodes"],
        default="switch",
        help="where requests meet the faults in the private cluster: the switch's "
        "client:rx and node<R>:tx links (default), or the nodes' receive side",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.soak.parent import run_soak

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.soak.plan import SoakConfig

    progress.describe(f"{args.seconds:g} s, {args.clients} clients")
    if args.cluster is not None:
        # Imported here: it loads numba's compiled kernels (~0.7 s) only when a pid is gone.
        from netdam.cli.running import check_not_stale
        from netdam.cluster.clusterfile import load_cluster

        try:
            info = load_cluster(args.cluster)
            check_not_stale(args.cluster, info)
        except ValueError as exc:
            raise CommandError(str(exc), ExitCode.USAGE) from None
        # Refused, as allreduce does: the soak runs over every node of the file.
        if args.nodes is not None and args.nodes != len(info.nodes):
            raise CommandError(
                f"--nodes {args.nodes} but {args.cluster} has {len(info.nodes)} nodes: drop --nodes "
                "(the file decides)",
                ExitCode.USAGE,
            )

    try:
        config = SoakConfig(
            clients=args.clients,
            seconds=args.seconds,
            nodes=args.nodes or 3,
            loss=args.loss,
            dup=args.dup,
            reorder=args.reorder,
            delay_ms=args.delay,
            delay_prob=args.delay_prob,
            seed=args.seed,
            pipeline=args.pipeline,
            timeout_ms=args.timeout_ms,
            retries=args.retries,
            cluster=args.cluster,
            fault_site=args.fault_site,
        )
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    result = run_soak(config)
    failed_run = bool(result.pop("run_failed", False))
    emit(result, args.json, text=summary_text(result))
    if failed_run:
        return int(ExitCode.RUN_FAILED)
    return int(ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED)


def summary_text(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"soak FAILED: {r['error']}"
    c = r["counter"]
    verdict = "OK" if r["ok"] else "FAILED"
    lines = [
        f"soak {verdict}: {r['clients']} clients x {r['seconds']:.1f} s through the switch ({r['nodes']} nodes): "
        f"{r['ops']} ops ({r['ops_per_second']}/s: {r['reads']} reads, {r['writes']} writes, {r['fetch_adds']} fetch_adds)",
        f"  lost_writes {r['lost_writes']}, corrupt_reads {r['corrupt_reads']}, errors {r['errors']}, "
        f"counter_error {r['counter_error']} (counter {c['final'] - c['initial']}, acknowledged "
        f"{c['acknowledged_increments']}, unconfirmed {c['unconfirmed_increments']}), "
        f"old-value errors {r['counter_old_value_errors']}",
        f"  final check: {r['verified_blocks']} blocks, {r['verified_bytes']} bytes read back",
        "  latency us (p50/p99/max): "
        + ", ".join(
            f"{op} {v['p50']}/{v['p99']}/{v['max']}"
            for op, v in r["latency_us"].items()
            if v["count"]
        ),
        f"  faults on {', '.join(r['faults']['links']) or 'nothing'}; injected: {r['injected']}",
        f"  at-most-once: {r['retransmits']} client retransmits, {r['node_counters']['dup_replays']} duplicates "
        f"answered from the nodes' windows, {r['node_counters']['stale_nacks']} STALE",
    ]
    lines += [f"  ! {s}" for s in r.get("error_samples", [])]
    return "\n".join(lines)
