"""``netdam flood``: flood a node or the switch and check it stays up, answers and stays flat."""

from __future__ import annotations

import argparse

from netdam import progress
from netdam.cli.common import ExitCode, Subparsers, bounded_int, bounded_seconds, emit


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "flood",
        help="flood a node or the switch; check liveness, stats and flat memory",
        description="Start a local pool cluster (3 nodes and the switch), send a seeded mix of valid "
        "and malformed datagrams at the target as fast as loopback takes them, sample its memory "
        "(RssAnon) and ask it for stats every 0.5 s. Passes when it stays alive, every stats "
        "request is answered, and anonymous memory grows by at most 4 MiB after a 1 s warm-up; "
        "what it could not take is counted (kernel_drops, drop_tx_full).",
    )
    p.add_argument("--target", choices=("node", "switch"), default="node")
    p.add_argument(
        "--seconds",
        type=bounded_seconds(1.0, 86400.0, low_inclusive=False),
        default=60.0,
        help="how long to flood (default 60; more than 1: the warm-up)",
    )
    p.add_argument(
        "--senders", type=bounded_int(1, 8), default=1, help="sending processes (default 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the datagram mix")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the flood loads numba and the kernels (~1 s), which every other command
    # would pay at start-up otherwise.
    from netdam.tools.flood import FloodConfig, run_flood

    progress.describe(f"{args.seconds:g} s at the {args.target}")
    result = run_flood(FloodConfig(args.target, args.seconds, args.senders, args.seed))
    text = (
        f"flood {result['target']} {result['seconds']} s, {result['sent']} datagrams "
        f"({result['sent_per_second']}/s): alive={result['alive']}, stats answered "
        f"{result['stats_answered']} (max {result['stats_latency_ms_max']} ms, failed "
        f"{result['stats_failed']}), RssAnon {result['rss_anon_mib_start']} -> "
        f"{result['rss_anon_mib_end']} MiB (growth {result['rss_anon_growth_mib']} MiB, limit "
        f"{result['flat_limit_mib']}), kernel drops {result['counters']['kernel_drops']}: "
        + ("ok" if result["ok"] else "FAILED")
    )
    emit(result, args.json, text)
    return int(ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED)
