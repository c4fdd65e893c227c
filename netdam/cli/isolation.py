"""``netdam isolation``: the isolation campaign between two tenants of one pool (SPEC.md 12.1)."""

from __future__ import annotations

import argparse
from typing import Any

from netdam import progress
from netdam.cli.common import CommandError, ExitCode, Subparsers, bounded_int, emit


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "isolation",
        help="two tenants of one pool: every kind of cross-access the attacker tries must fail",
        description="Two tenants of one pool on 3 nodes and the switch (the compiled cores the "
        "processes run, on an in-memory fabric). The attacker tries --attempts datagrams of each "
        "kind: the victim's memory with its own or guessed keys, through the switch and at the "
        "nodes, chains and multicast into it, guessed and sniffed admin keys, a collective's key "
        "and made-up tags, a tagged region's rkey, another tenant's id, replayed control "
        "datagrams, replies aimed at a third party. Passes when none succeeds, no byte outside "
        "the attacker's regions changes, none of the victim's bytes reaches the attacker, "
        "nothing reaches a third party, each kind is counted as SPEC says, and the victim works "
        "as before. Exit 0 when all hold, 1 when one does not.",
    )
    p.add_argument(
        "--attempts",
        type=bounded_int(1, 1_000_000),
        default=None,
        help="datagrams per kind (default: as many as the test suite sends)",
    )
    p.add_argument(
        "--kind",
        action="append",
        default=None,
        metavar="KIND",
        help="one kind, as the text output names it (repeatable; default all)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the campaign loads the compiled cores (numba), which building the parser
    # (every command's --help) need not pay for.
    from netdam.tools.isolation import ATTEMPTS, KINDS, run_campaign

    unknown = [k for k in args.kind or () if k not in KINDS]
    if unknown:
        raise CommandError(
            f"no kind {unknown[0]!r}: give one of {', '.join(KINDS)}", ExitCode.USAGE
        )
    attempts = args.attempts or ATTEMPTS
    progress.describe(f"{attempts:,} attempts per kind")
    try:
        result = run_campaign(attempts, args.kind)
    except RuntimeError as exc:
        raise CommandError(str(exc), ExitCode.RUN_FAILED) from None
    emit(result, args.json, format_text(result))
    return int(ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED)


def format_text(result: dict[str, Any]) -> str:
    """One line per kind: what the attacker got (all zeros when isolation holds) and the
    answers it had instead; then the verdict."""
    lines = [
        f"netdam isolation: {result['attempts_per_kind']:,} attempts per kind",
        f"  {'kind':<32}{'succeeded':>10}{'changed B':>10}{'leaked':>8}{'3rd party':>10}  refused / dropped",
    ]
    for kind, r in result["kinds"].items():
        nacks = ", ".join(f"{name} {n}" for name, n in sorted(r["nacks"].items())) or "-"
        drops = [
            f"{what} {r[key]}"
            for key, what in (("dropped_forged", "forged"), ("dropped_replayed", "replayed"))
            if r[key]
        ]
        lines.append(
            f"  {kind:<32}{r['succeeded']:>10}{r['bytes_changed']:>10}{r['leaked_runs']:>8}"
            f"{r['third_party']:>10}  {nacks}{'; dropped ' + ', '.join(drops) if drops else ''}"
        )
        if kind == "reply to third party":
            lines.append(
                "    (READs of the attacker's own memory: answered, to the attacker alone)"
            )
        lines += [f"    FAILED: {f}" for f in r["failures"]]
    lines += [f"  victim: FAILED: {f}" for f in result["victim_failures"]]
    lines.append("  " + ("ok: nothing got through" if result["ok"] else "FAILED"))
    return "\n".join(lines)
