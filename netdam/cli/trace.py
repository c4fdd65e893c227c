"""``netdam trace``: a timeline of a running cluster for some seconds (issue: see the fabric)."""

from __future__ import annotations

import argparse
import time

from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_seconds,
    cluster_file,
    emit,
    writable_output,
)
from netdam.cluster.clusterfile import load_cluster
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.tracing import TraceReader, mark, nics_of, write_trace
from netdam.core.timeline import chrome_trace

#: Seconds between two reads of the rings. A NIC relaying at the datapath's ~340,000
#: datagrams/s (docs/PERFORMANCE.md, "Datapath") writes ~680,000 records/s, one in and one out
#: each: the default ring of 32,768 turns over in ~50 ms. Slower traffic loses nothing; what a
#: saturated NIC overwrote before a read is counted in the file and the summary.
POLL_S = 0.05


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "trace",
        help="record a timeline of a running cluster (Chrome trace JSON)",
        description="Read every NIC's trace ring of the cluster file for --seconds and write "
        "what happened as a Chrome trace (JSON; open it in Perfetto or speedscope): "
        "one track per NIC, spans for each collective's phases and each block's chain hop, "
        "flow arrows from hop to hop, instants for retransmits, NACKs, BUSY and drops. The "
        "NICs record all the time; this asks them (the admin's COUNTERS) what they wrote.",
    )
    p.add_argument("--cluster", type=cluster_file, required=True, help="the cluster file")
    p.add_argument(
        "--seconds",
        type=bounded_seconds(0.0, 86400.0, low_inclusive=False),
        default=5.0,
        help="how long to record (default 5)",
    )
    p.add_argument(
        "--out", type=writable_output("--out"), required=True, help="the trace file to write (JSON)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        info = load_cluster(args.cluster)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    nics = nics_of(info)
    try:
        with ControlClient.for_cluster(info) as client:
            reader = TraceReader(client, nics, mark(client, nics))
            end = time.monotonic() + args.seconds
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(POLL_S, left))
                reader.poll()
            traces = reader.traces()
    except ControlError as exc:
        raise CommandError(
            f"{exc}: is the cluster of {args.cluster} running (netdam up)?", ExitCode.RUN_FAILED
        ) from None
    write_trace(args.out, chrome_trace(traces, title=str(args.out)))
    records = sum(len(t.records) for t in traces)
    lost = sum(t.lost for t in traces)
    off = [t.nic.name for t in traces if t.tracing_off]
    summary = {
        "ok": True,
        "path": str(args.out),
        "seconds": args.seconds,
        "nics": len(traces),
        "records": records,
        "lost": lost,
        "tracing_off": off,
    }
    text = f"trace: {args.out}: {records} records of {len(traces)} NICs in {args.seconds:g} s"
    if lost:
        text += f"; {lost} records overwritten before they were read (busy NICs outran the reads)"
    if off:
        text += f"; tracing is off on {', '.join(off)} (started with --trace-records 0)"
    emit(summary, args.json, text=text)
    return int(ExitCode.OK)
