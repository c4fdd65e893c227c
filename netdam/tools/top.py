"""Live counters of a running cluster (``netdam top``): every NIC's and the switch's rates over
each interval, from two COUNTERS answers (SPEC.md 6.3) and the time between them.

``rates`` is plain arithmetic over two counter arrays; ``samples`` asks the processes (the
admin's COUNTERS, sealed) and yields one sample per interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdam.cluster.clusterfile import ClusterFile, SwitchEntry
from netdam.cluster.control import ControlClient, ControlError
from netdam.protocol import counters as C
from netdam.protocol.packet import Endpoint

#: Bits per byte, for Gb/s from byte counters.
_BITS = 8


@dataclass(frozen=True)
class Process:
    """One process whose counters `top` shows: a NIC by rank, or the switch."""

    name: str
    address: str
    control: Endpoint


def processes(info: ClusterFile, switch: SwitchEntry | None) -> list[Process]:
    """The cluster file's NICs in rank order, then its switch."""
    found = [
        Process(f"rank {n.rank}", f"{n.address}:{n.port}", n.control_endpoint) for n in info.nodes
    ]
    if switch is not None:
        found.append(Process("switch", f"{switch.vip[0]}:{switch.vip[1]}", switch.control_endpoint))
    return found


def rates(before: np.ndarray, after: np.ndarray, seconds: float) -> dict[str, Any]:
    """What happened between two counter arrays of one process, *seconds* apart: packets and
    Gb/s each way, retransmits, drops and NACKs per second, and every counter that moved (the
    names of ``counters_to_dict``: by opcode and by NACK status too)."""
    if seconds <= 0:
        raise ValueError(f"an interval of {seconds} s: samples must be apart in time")
    delta = after.astype(np.uint64) - before.astype(np.uint64)  # wraps as the counters do
    named = C.counters_to_dict(delta)
    nacks = sum(int(n) for n in named["nacks"].values())
    moved = {k: v for k, v in named.items() if v and k not in ("ops", "nacks")}
    return {
        "rx_pps": int(delta[C.RX_PACKETS]) / seconds,
        "tx_pps": int(delta[C.TX_PACKETS]) / seconds,
        "rx_gbps": int(delta[C.RX_BYTES]) * _BITS / seconds / 1e9,
        "tx_gbps": int(delta[C.TX_BYTES]) * _BITS / seconds / 1e9,
        "retransmits_ps": int(delta[C.RETRANSMITS]) / seconds,
        "drops_ps": int(named["drops"]) / seconds,
        "nacks_ps": nacks / seconds,
        "moved": moved,
        "ops": named["ops"],
        "nacks": named["nacks"],
    }


def samples(
    procs: list[Process],
    client: ControlClient,
    interval: float,
    count: int | None = None,
    timeout: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[dict[str, Any]]:
    """Every *interval* seconds (*count* times, or until stopped), one sample: each process's
    rates since the previous answer, or the error of its silence."""
    last: dict[str, tuple[float, np.ndarray]] = {}

    def read(proc: Process) -> tuple[float, np.ndarray] | str:
        try:
            values = client.counters(proc.control, timeout=timeout)
        except (ControlError, OSError) as exc:
            return str(exc)
        return clock(), values

    start = clock()
    for proc in procs:
        got = read(proc)
        if not isinstance(got, str):
            last[proc.name] = got
    taken = 0
    while count is None or taken < count:
        sleep(max(0.0, start + (taken + 1) * interval - clock()))
        rows = []
        for proc in procs:
            got = read(proc)
            row: dict[str, Any] = {"name": proc.name, "address": proc.address}
            if isinstance(got, str):
                row["error"] = got
            elif proc.name in last:
                then, before = last[proc.name]
                row.update(rates(before, got[1], got[0] - then), interval_s=got[0] - then)
            if not isinstance(got, str):
                last[proc.name] = got
            rows.append(row)
        taken += 1
        yield {"sample": taken, "seconds": clock() - start, "processes": rows}


def format_sample(sample: dict[str, Any]) -> str:
    """The table `netdam top` refreshes in place."""
    lines = [
        f"netdam top: sample {sample['sample']}, {sample['seconds']:.1f} s",
        f"{'process':<9}{'address':<22}{'rx pkt/s':>11}{'tx pkt/s':>11}{'rx Gb/s':>9}{'tx Gb/s':>9}"
        f"{'retx/s':>8}{'drops/s':>9}{'nacks/s':>9}",
    ]
    for row in sample["processes"]:
        head = f"{row['name']:<9}{row['address']:<22}"
        if "error" in row:
            lines.append(head + row["error"])
        elif "rx_pps" not in row:
            lines.append(head + "(first answer: rates from the next sample)")
        else:
            lines.append(
                head + f"{row['rx_pps']:>11,.0f}{row['tx_pps']:>11,.0f}{row['rx_gbps']:>9.3f}"
                f"{row['tx_gbps']:>9.3f}{row['retransmits_ps']:>8,.0f}{row['drops_ps']:>9,.0f}"
                f"{row['nacks_ps']:>9,.0f}"
            )
    return "\n".join(lines)
