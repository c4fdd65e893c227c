"""``netdam top``: live counters of a running cluster, refreshed in place (issue: see the fabric)."""

from __future__ import annotations

import argparse
import sys

from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    bounded_seconds,
    cluster_file,
    dumps_json,
)
from netdam.cluster.clusterfile import load_cluster, load_switch_entry
from netdam.cluster.control import ControlClient
from netdam.tools.top import format_sample, processes, samples

#: ANSI: cursor home, clear the screen (a terminal redraws the table in place, as top does).
_REDRAW = "\x1b[H\x1b[2J"


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "top",
        help="live rates of every NIC and the switch of a running cluster",
        description="Ask every NIC of the cluster file (and its switch) for its counters every "
        "--interval seconds and show what moved since the last answer: packets and Gb/s each "
        "way, retransmits, drops and NACKs per second. The table is redrawn in place on a "
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        info = load_cluster(args.cluster)
        switch = load_switch_entry(args.cluster)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    redraw = not args.json and sys.stdout.isatty()
    silent = False
    with ControlClient.for_cluster(info) as client:
        for sample in samples(
            processes(info, switch),
            client,
            args.interval,
            args.count,
            timeout=min(0.5, args.interval),
        ):
            silent = all("error" in row for row in sample["processes"])
            if args.json:
                sys.stdout.write(dumps_json(sample, one_line=True) + "\n")
            else:
                sys.stdout.write((_REDRAW if redraw else "") + format_sample(sample) + "\n\n")
            sys.stdout.flush()
    if silent:
        print(
            f"error: no process of {args.cluster} answered: is the cluster running (netdam up)?",
            file=sys.stderr,
        )
        return int(ExitCode.RUN_FAILED)
    return int(ExitCode.OK)
