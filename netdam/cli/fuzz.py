"""``netdam fuzz``: structured fuzzing of real node processes (or the pool switch) over UDP.

    netdam fuzz --target node|switch --datagrams N --seed S [--nodes N] [--json]

Starts a private local cluster (nodes, plus the switch for ``--target switch``), registers
regions with known rkeys (through the pool controller for the switch), fills every node's
memory with seeded bytes through its /dev/shm file and snapshots it, then sends the datagrams
``netdam.tools.fuzz.generator.DatagramGenerator`` makes (valid packets, structured mutations of them, random
bytes) in rounds: after each round a PING to every process is a barrier (a process answers it
only after everything sent before it), so at most one round is in flight and no receive queue
overflows. Every reply is decoded with the codec. After each round the memory outside every
authorized write (``netdam.tools.fuzz.generator.Oracle``) is compared with the snapshot. At the end: every
process must be alive and answer PING, every counter must agree with the oracle's expectation
(exactly, up to datagrams the kernel dropped), every expected opcode and NACK status must have
been reached, and nothing may reach the third-party endpoint the fuzzer plants in return
segments and SR lists. Exit 0 when all hold, 1 when a check fails, 3 when the run could not
run (cluster start-up, a setup request refused).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from netdam import progress
from netdam.cli.common import ExitCode, Subparsers, bounded_int, emit
from netdam.tools.fuzz.generator import TARGETS


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "fuzz",
        help="fuzz real node processes (or the switch) with mutated and random datagrams",
        description="Start a private cluster, send seeded valid, mutated and random datagrams, "
        "then check that every process is alive and answers PING, that memory outside every "
        "authorized write is unchanged, that the counters add up, and that every opcode and "
        "NACK status was reached.",
    )
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="node",
        help="fuzz node processes directly, or the switch's VIP (default node)",
    )
    parser.add_argument(
        "--datagrams",
        type=bounded_int(1, 1_000_000_000),
        default=100_000,
        help="datagrams to send (default 100000)",
    )
    parser.add_argument(
        "--seed",
        type=bounded_int(0, 2**63 - 1),
        default=1,
        help="seed of every datagram (a run replays; default 1)",
    )
    parser.add_argument(
        "--nodes", type=bounded_int(1, 8), default=2, help="node processes (default 2)"
    )
    parser.add_argument(
        "--round",
        type=bounded_int(1, 4096),
        default=512,
        dest="round_size",
        metavar="N",
        help="datagrams between barriers (default 512)",
    )
    parser.add_argument(
        "--artifacts",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for the datagrams of a round that crashed a process or "
        "changed memory it must not (default: the temporary directory)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the runner loads numba and the kernels (~1 s), which every other command
    # would pay at start-up otherwise.
    from netdam.tools.fuzz.runner import FuzzConfig, run_fuzz

    config = FuzzConfig(
        target=args.target,
        datagrams=args.datagrams,
        seed=args.seed,
        nodes=args.nodes,
        round_size=args.round_size,
        artifacts=args.artifacts,
    )

    progress.describe(f"{args.datagrams:,} datagrams at the {args.target}")
    result = run_fuzz(config)
    emit(result, args.json, None if args.json else format_result(result))
    return int(ExitCode.OK if result["ok"] else ExitCode.CHECK_FAILED)


def _columns(title: str, cells: list[str], per_row: int) -> list[str]:
    """A small table: *cells* in rows of *per_row*, the column title repeated above each."""
    rows = ["  " + "   ".join([title] * min(per_row, len(cells)))]
    for k in range(0, len(cells), per_row):
        rows.append("  " + "   ".join(cells[k : k + per_row]))
    return rows


def format_result(result: dict[str, Any]) -> str:
    """The human summary: verdict, totals, then opcodes and NACK statuses as short tables."""
    head = (
        f"netdam fuzz --target {result['target']}: {'OK' if result['ok'] else 'FAILED'}"
        f"  ({result['nodes']} node{'s' if result['nodes'] != 1 else ''}, seed {result['seed']})"
    )
    mix = result["mix"]
    lines = [
        head,
        f"  sent {result['sent']} datagrams in {result['seconds']:.1f} s ({result['datagrams_per_second'] or 0:,.0f}/s): "
        f"{mix['valid']} valid, {mix['mutated']} mutated, {mix['repeated']} repeated, {mix['random']} random",
        f"  accepted {result['accepted']}, nacks {result['nacks']}, drops {result['drops']}; replies {result['replies']}",
        f"  crashes {result['crashes']}, memory violations {result['memory_violations']} bytes, misdirected {result['misdirected']}, "
        f"bad replies {result['bad_replies']}, read mismatches {result['read_mismatches']}, counters add up: {result['counters_add_up']} ({result['counter_checks']} checks)",
        f"  kernel drops: processes {result['kernel_drops']['processes']}, fuzzer {result['kernel_drops']['fuzzer']}",
    ]
    cells = [
        f"{name:<11}{row['sent']:>8}{row['reached']:>9}"
        for name, row in result["by_opcode"].items()
    ]
    lines += _columns("opcode        sent  reached", cells, 3)
    lines += _columns(
        "NACK status    replies",
        [f"{name:<14}{n:>8}" for name, n in result["by_status"].items()],
        3,
    )
    if result.get("error"):
        lines.append(f"  error: {result['error']}")
    for check in result["counter_checks_failed"][:10]:
        lines.append(
            f"  counter check failed: {check['name']}: counted {check['counted']}, expected {check['expected']}"
        )
    if result.get("repro_file"):
        lines.append(f"  datagrams of the failing round: {result['repro_file']}")
    return "\n".join(lines)
