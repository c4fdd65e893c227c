"""``netdam top``: live counters of a running cluster, refreshed in place (issue: see the fabric)."""

from __future__ import annotations

import argparse
import sys
import time

from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_seconds,
    cluster_file,
    dumps_json,
    writable_output,
)
from netdam.cluster.clusterfile import load_cluster, load_switch_entry
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.tracing import TraceReader, mark, nics_of
from netdam.tools import plot as plotting
from netdam.tools.top import (
    Links,
    PoolOps,
    format_links,
    format_pool,
    format_sample,
    link_names,
    plot_traffic,
    processes,
    samples,
)

#: ANSI: cursor home, clear the screen (a terminal redraws the table in place, as top does).
_REDRAW = "\x1b[H\x1b[2J"


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "top",
        help="live rates of every NIC and the switch of a running cluster",
        description="Ask every NIC of the cluster file (and its switch) for its counters every "
        "--interval seconds and show what moved since the last answer: packets and Gb/s each "
        "way, retransmits, drops and NACKs per second; below it the busiest links (sender -> "
        "receiver, from the NICs' trace rings: the fabric's traffic matrix) and the "
        "collectives in flight on each NIC; with a pool switch, its reads, writes and atomics "
        "per second by tenant. The table is redrawn in place on a "
        "terminal; --json prints one JSON object per sample and line, with every counter that "
        "moved (by opcode and NACK status too). Stops after --count samples, or at Ctrl-C.",
    )
    p.add_argument("--cluster", type=cluster_file, required=True, help="the cluster file")
    p.add_argument(
        "--interval",
        type=bounded_seconds(0.0, 3600.0, low_inclusive=False),
        default=1.0,
        help="seconds between samples (default 1)",
    )
    p.add_argument(
        "--count",
        type=bounded_int(1, 10**9),
        default=None,
        help="samples to show, then exit (default: until Ctrl-C)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per sample and line")
    p.add_argument(
        "--plot",
        type=writable_output("--plot"),
        default=None,
        help="when it stops, draw the traffic matrix of the whole run (Gb/s per link, from "
        "the NICs' trace rings) as a heat map in this PNG (needs matplotlib)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        info = load_cluster(args.cluster)
        switch = load_switch_entry(args.cluster)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    plt = plotting.pyplot() if args.plot else None  # a missing matplotlib is usage, at once
    redraw = not args.json and sys.stdout.isatty()
    silent = False
    matrix = Links(link_names(info, switch))
    start = time.monotonic()
    with ControlClient.for_cluster(info) as client:
        nics = nics_of(info)
        try:
            reader: TraceReader | None = TraceReader(client, nics, mark(client, nics))
        except (ControlError, OSError):
            reader = None  # silent NICs: their rows say so, and no link rates
        try:
            for sample in samples(
                processes(info, switch),
                client,
                args.interval,
                args.count,
                timeout=min(0.5, args.interval),
                links=(reader, matrix) if reader is not None else None,
                pool=PoolOps(switch, info.admin_key) if switch is not None else None,
            ):
                silent = all("error" in row for row in sample["processes"])
                if args.json:
                    sys.stdout.write(dumps_json(sample, one_line=True) + "\n")
                else:
                    table = "\n".join(
                        part
                        for part in (
                            format_sample(sample),
                            format_links(sample),
                            format_pool(sample),
                        )
                        if part
                    )
                    sys.stdout.write((_REDRAW if redraw else "") + table + "\n\n")
                sys.stdout.flush()
        finally:
            if plt is not None:
                plot_traffic(plt, matrix, args.plot, time.monotonic() - start)
                print(f"traffic matrix written to {args.plot}", file=sys.stderr)
    if silent:
        print(
            f"error: no process of {args.cluster} answered: is the cluster running (netdam up)?",
            file=sys.stderr,
        )
        return int(ExitCode.RUN_FAILED)
    return int(ExitCode.OK)
