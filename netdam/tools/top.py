"""Live counters of a running cluster (``netdam top``): every NIC's and the switch's rates over
each interval, from two COUNTERS answers (SPEC.md 6.3) and the time between them; and per
link (the fabric's traffic matrix) and the collectives in flight, from the NICs' trace rings
(SPEC.md 6.7).

``rates`` is plain arithmetic over two counter arrays; ``samples`` asks the processes (the
admin's COUNTERS, sealed) and yields one sample per interval; ``Links`` turns what the trace
rings recorded in an interval into rates per link.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from netdam.cluster.clusterfile import ClusterFile, SwitchEntry
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.tracing import TraceReader
from netdam.core.timeline import NicTrace
from netdam.protocol import counters as C
from netdam.protocol.constants import Opcode, TraceKind, TracePhase
from netdam.protocol.packet import Endpoint, Packet, endpoint_to_u64, u64_to_endpoint

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
    links: tuple[TraceReader, Links] | None = None,
    pool: PoolOps | None = None,
) -> Iterator[dict[str, Any]]:
    """Every *interval* seconds (*count* times, or until stopped), one sample: each process's
    rates since the previous answer, or the error of its silence; with *links*, the rates per
    link and the collectives in flight from what the trace rings recorded meanwhile; with
    *pool*, the pool's operations per tenant at the switch."""
    last: dict[str, tuple[float, np.ndarray]] = {}

    def read(proc: Process) -> tuple[float, np.ndarray] | str:
        try:
            values = client.counters(proc.control, timeout=timeout)
        except (ControlError, OSError) as exc:
            return str(exc)
        return clock(), values

    start = clock()
    links_at = start
    if pool is not None:
        pool.sample(client, start)  # the baseline
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
        sample: dict[str, Any] = {"sample": taken, "seconds": clock() - start, "processes": rows}
        if links is not None:
            reader, matrix = links
            try:
                reader.poll()
            except (ControlError, OSError) as exc:
                sample["links_error"] = str(exc)
            now = clock()
            window = max(now - links_at, 1e-9)
            sample.update(matrix.sample(reader.take(), window), links_interval_s=window)
            links_at = now
        if pool is not None:
            sample.update(pool.sample(client, clock()))
        yield sample


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


# ---------------------------------------------------------------- per link, from the trace rings


@dataclass
class Links:
    """The fabric's traffic matrix and the collectives in flight, from what the NICs' trace
    rings recorded (SPEC.md 6.7) between two samples: per link (sender, receiver) the datagrams
    and bytes a NIC sent (a client's, as a NIC received them), and per NIC the collectives that
    started there and have not completed."""

    names: dict[int, str]
    started: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    total: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def name(self, endpoint: int) -> str:
        """A NIC by rank, the switch, a multicast group, or a client by address."""
        if endpoint in self.names:
            return self.names[endpoint]
        ip, port = u64_to_endpoint(endpoint)
        group = 224 <= int(ip.split(".")[0]) <= 239  # IPv4 multicast, RFC 5771
        return f"{'group ' if group else ''}{ip}:{port}"

    def sample(self, traces: list[NicTrace], seconds: float) -> dict[str, Any]:
        """Rates per link over *seconds*, from the records read since the last sample."""
        moved: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        lost = 0
        in_flight: dict[str, int] = {}
        for trace in traces:
            me = trace.nic.name
            short = f"rank {trace.nic.rank}"
            lost += trace.lost
            r = trace.records
            sent = r[r["kind"] == TraceKind.TX]
            taken = r[(r["kind"] == TraceKind.RX) & ~np.isin(r["peer"], list(self.names))]
            for rows, outward in ((sent, True), (taken, False)):
                for peer in np.unique(rows["peer"]):
                    mine = rows[rows["peer"] == peer]
                    key = (
                        (short, self.name(int(peer))) if outward else (self.name(int(peer)), short)
                    )
                    moved[key][0] += len(mine)
                    moved[key][1] += int(mine["length"].sum())
            running = self.started.setdefault(me, set())
            for p in r[r["kind"] == TraceKind.PHASE]:
                call = (int(p["coll_id"]), int(p["epoch"]))
                if p["status"] == TracePhase.START:
                    running.add(call)
                elif p["status"] in (TracePhase.COMPLETE, TracePhase.FAILED):
                    running.discard(call)
            in_flight[short] = len(running)
        for key, (packets, nbytes) in moved.items():
            acc = self.total.setdefault(key, [0, 0])
            acc[0] += packets
            acc[1] += nbytes
        links = [
            {
                "from": src,
                "to": dst,
                "pps": packets / seconds,
                "gbps": nbytes * _BITS / seconds / 1e9,
            }
            for (src, dst), (packets, nbytes) in sorted(moved.items(), key=lambda kv: -kv[1][1])
        ]
        return {"links": links, "collectives_in_flight": in_flight, "trace_records_lost": lost}


def link_names(info: ClusterFile, switch: SwitchEntry | None) -> dict[int, str]:
    """What a link's ends are called: the NICs by rank, the switch's VIP."""
    names = {endpoint_to_u64((n.address, n.port)): f"rank {n.rank}" for n in info.nodes}
    if switch is not None:
        names[endpoint_to_u64(switch.vip)] = "switch"
    return names


def format_links(sample: dict[str, Any], top: int = 12) -> str:
    """The busiest links and the collectives in flight, under the table of processes."""
    if "links" not in sample:
        return ""
    flight = ", ".join(f"{k} {v}" for k, v in sample["collectives_in_flight"].items() if v)
    lines = [f"collectives in flight: {flight or 'none'}", f"{'link':<44}{'pkt/s':>11}{'Gb/s':>9}"]
    for link in sample["links"][:top]:
        lines.append(
            f"{link['from'] + ' -> ' + link['to']:<44}{link['pps']:>11,.0f}{link['gbps']:>9.3f}"
        )
    if len(sample["links"]) > top:
        lines.append(f"({len(sample['links']) - top} quieter links not shown; --json has them)")
    if sample["trace_records_lost"]:
        lines.append(
            f"({sample['trace_records_lost']} trace records were overwritten before they were "
            "read: link rates are lower bounds; a shorter --interval keeps up)"
        )
    return "\n".join(lines)


def plot_traffic(plt: Any, links: Links, path: Any, seconds: float) -> None:
    """The traffic matrix over the whole run as a heat map (Gb/s per link)."""
    ends = sorted({e for key in links.total for e in key}, key=_end_order) or ["(no traffic)"]
    at = {e: k for k, e in enumerate(ends)}
    grid = np.zeros((len(ends), len(ends)))
    for (src, dst), (_, nbytes) in links.total.items():
        grid[at[src], at[dst]] = nbytes * _BITS / max(seconds, 1e-9) / 1e9
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * len(ends), 1.0 + 0.45 * len(ends)))
    image = ax.imshow(grid, cmap="viridis")
    ax.set_xticks(range(len(ends)), ends, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(ends)), ends, fontsize=7)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    fig.colorbar(image, ax=ax, label="Gb/s (mean over the run)")
    ax.set_title("netdam top: traffic matrix", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _end_order(name: str) -> tuple[int, int, str]:
    """NICs by rank, then the switch, multicast groups, clients by address."""
    if name.startswith("rank "):
        return (0, int(name.split()[1]), "")
    return (1 if name == "switch" else 2 if name.startswith("group ") else 3, 0, name)


# ---------------------------------------------------------------- pool ops by tenant, at the switch


@dataclass
class PoolOps:
    """Pool operations per tenant from the switch's per-region counters (SPEC.md 11.7) and its
    state file (which tenant owns which rkey): reads, writes and atomics per second."""

    switch: SwitchEntry
    admin_key: int
    last: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    at: float = 0.0

    def regions(self, client: ControlClient) -> dict[int, tuple[int, int, int]]:
        """rkey -> (reads, writes, atomics) the switch counted so far, every region (paged)."""
        # Imported here: the switch's names of its COUNTERS sections (with its kernels).
        from netdam.switch.core import counters_from_payload

        out: dict[int, tuple[int, int, int]] = {}
        first = 0
        while True:
            reply = client.request(
                self.switch.control_endpoint,
                Packet(Opcode.COUNTERS, rkey=self.admin_key, addr=first),
                timeout=0.5,
            )
            values = counters_from_payload(reply.payload)
            listed = values["regions"]
            assert isinstance(listed, list)
            for r in listed:
                out[int(r["rkey"])] = (int(r["reads"]), int(r["writes"]), int(r["atomics"]))
            first = int(values["first_region"]) + len(listed)  # type: ignore[call-overload]  # JSON-style values
            if not listed or first >= int(values["regions_total"]):  # type: ignore[call-overload]  # JSON-style values
                return out

    def owners(self) -> dict[int, str]:
        """rkey -> the tenant that holds it (its label, else its short digest; "admin")."""
        # Imported here: the pool's state file format (switch room).
        from netdam.switch.state import load_state, short_digest

        if not self.switch.state_file:
            return {}
        state = load_state(Path(self.switch.state_file))
        return {
            r.rkey: (state.tenants.get(r.owner) or short_digest(r.owner)) if r.owner else "admin"
            for r in state.regions
        }

    def sample(self, client: ControlClient, now: float) -> dict[str, Any]:
        """Per tenant, operations per second since the last sample (nothing the first time)."""
        try:
            counts = self.regions(client)
            owners = self.owners()
        except (ControlError, OSError, ValueError) as exc:
            return {"pool_error": str(exc)}
        rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        if self.last:
            seconds = max(now - self.at, 1e-9)
            for rkey, (reads, writes, atomics) in counts.items():
                before = self.last.get(rkey, (0, 0, 0))
                row = rows[owners.get(rkey, f"rkey 0x{rkey:08x}")]
                for k, value in enumerate((reads, writes, atomics)):
                    row[k] += (value - before[k]) / seconds
        self.last, self.at = counts, now
        return {
            "pool_ops": {
                tenant: {"reads_ps": r, "writes_ps": w, "atomics_ps": a}
                for tenant, (r, w, a) in sorted(rows.items())
            }
        }


def format_pool(sample: dict[str, Any]) -> str:
    """Pool operations per tenant, under the links."""
    if "pool_error" in sample:
        return f"pool: {sample['pool_error']}"
    ops = sample.get("pool_ops")
    if not ops:
        return "" if ops is None else "pool: no operations"
    lines = [f"{'pool tenant':<24}{'reads/s':>11}{'writes/s':>11}{'atomics/s':>11}"]
    for tenant, row in ops.items():
        lines.append(
            f"{tenant:<24}{row['reads_ps']:>11,.0f}{row['writes_ps']:>11,.0f}"
            f"{row['atomics_ps']:>11,.0f}"
        )
    return "\n".join(lines)
