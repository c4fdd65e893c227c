"""A timeline of the fabric: the NICs' trace records (SPEC.md 6.7) and the host's calls, as a
trace in the Chrome trace event format (Perfetto and speedscope open it). Pure logic:
netdam.cluster.tracing reads the rings, the API and the CLI write the file.

``chrome_trace`` makes:

- one process per NIC (rank order) and one per host rank;
- on a NIC, a track per collective: a span per call (START_COLL taken to completion sent) with
  its phases nested inside (start, chain reduce, multicast gather, DONE, completion), from the
  engine's PHASE records;
- a track per block of each collective: the span in which the block's chain passed this NIC,
  and a flow arrow from each hop's span to the next hop's (the chain's order);
- a track of instants: retransmits, NACKs sent (BUSY by name), drops by the counter that
  counted them;
- on a host rank, a span per call with its issue, in-the-NICs and return phases.

The raw records travel along under the key ``netdam`` (viewers ignore it) for
``netdam model replay``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from netdam.protocol import counters as C
from netdam.protocol.constants import Opcode, Status, TraceKind, TracePhase
from netdam.protocol.packet import Endpoint, endpoint_to_u64
from netdam.protocol.trace import TRACE_DTYPE

#: The version of the ``netdam`` section of a trace file (its raw records), for replay.
TRACE_FILE_VERSION = 1
#: The names of a collective's phases at a NIC, from the PHASE that ends each.
_PHASE_NAMES = {
    TracePhase.START: "start",
    TracePhase.CHAINS: "chain reduce",
    TracePhase.CHUNKS: "multicast gather",
    TracePhase.DONE: "DONE",
    TracePhase.COMPLETE: "completion",
}
_COUNTER_NAMES = C.counter_names()


@dataclass(frozen=True)
class TracedNic:
    """A NIC whose ring a trace reads: its rank, data address and management endpoint."""

    rank: int
    address: Endpoint
    control: Endpoint

    @property
    def name(self) -> str:
        return f"NIC rank {self.rank} {self.address[0]}:{self.address[1]}"


@dataclass
class NicTrace:
    """The records one NIC wrote since its mark, and how many of them its ring had overwritten
    before they were read (a ring too small for what happened: SPEC.md 6.7)."""

    nic: TracedNic
    records: np.ndarray  # TRACE_DTYPE
    lost: int = 0
    tracing_off: bool = False


@dataclass(frozen=True)
class HostCall:
    """One collective call of a host rank, in CLOCK_MONOTONIC seconds (api.Work's times)."""

    rank: int
    name: str
    coll_id: int
    epoch: int
    called_at: float
    sent_at: float | None
    completed_at: float | None
    finished_at: float | None
    ok: bool = True


# ---------------------------------------------------------------- to trace events


@dataclass
class _Tracks:
    """Process and thread ids of the trace, and their names (metadata events)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    _tids: dict[tuple[int, str], int] = field(default_factory=dict)
    _made: dict[int, int] = field(default_factory=dict)  # tracks made per process

    def process(self, pid: int, name: str) -> None:
        self.events.append(_meta("process_name", pid, 0, {"name": name}))
        self.events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))

    def tid(self, pid: int, name: str) -> int:
        key = (pid, name)
        if key not in self._tids:
            tid = self._made[pid] = self._made.get(pid, 0) + 1
            self._tids[key] = tid
            self.events.append(_meta("thread_name", pid, tid, {"name": name}))
            self.events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        return self._tids[key]


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


class _Clock:
    """Nanoseconds of CLOCK_MONOTONIC to the trace's microseconds from its first event."""

    def __init__(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    def us(self, t_ns: float) -> float:
        return round((t_ns - self.t0_ns) / 1000.0, 3)


class _Spans:
    """Complete events ("X") of one track, each starting no earlier than the last one ended, so
    that a track's spans never overlap (a next epoch's datagram may arrive before its start)."""

    def __init__(self, out: list[dict[str, Any]], pid: int, tid: int) -> None:
        self.out, self.pid, self.tid = out, pid, tid
        self.last_end = -np.inf

    def add(self, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        start = max(start, self.last_end)
        end = max(end, start)
        self.out.append(
            {
                "ph": "X",
                "name": name,
                "pid": self.pid,
                "tid": self.tid,
                "ts": start,
                "dur": round(end - start, 3),
                "args": args or {},
            }
        )
        self.last_end = end


def _status_name(value: int) -> str:
    try:
        return str(Status(value).name)
    except ValueError:
        return str(value)


def chrome_trace(
    nic_traces: Sequence[NicTrace], host_calls: Iterable[HostCall] = (), title: str = ""
) -> dict[str, Any]:
    """The trace as a Chrome trace event file (its JSON object form)."""
    calls = list(host_calls)
    firsts = [int(t.records["t_ns"].min()) for t in nic_traces if len(t.records)]
    firsts += [int(c.called_at * 1e9) for c in calls]
    clock = _Clock(min(firsts) if firsts else 0)
    tracks = _Tracks()
    events: list[dict[str, Any]] = []
    pid_of = {endpoint_to_u64(t.nic.address): k + 1 for k, t in enumerate(nic_traces)}
    chains = _Chains()
    ordered = [np.sort(t.records, order="t_ns", kind="stable") for t in nic_traces]
    for k, (trace, records) in enumerate(zip(nic_traces, ordered, strict=True)):
        pid = k + 1
        tracks.process(pid, trace.nic.name)
        _nic_events(records, pid, tracks, clock, events, chains)
    _chain_flows(ordered, pid_of, chains, clock, events)
    for rank in sorted({c.rank for c in calls}):
        pid = 1000 + rank
        tracks.process(pid, f"host rank {rank}")
        spans = _Spans(events, pid, tracks.tid(pid, "calls"))
        for call in sorted((c for c in calls if c.rank == rank), key=lambda c: c.called_at):
            _host_call(call, spans, clock)
    return {
        "traceEvents": tracks.events + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "title": title or "netdam trace",
            "clock": "CLOCK_MONOTONIC",
            "t0_ns": clock.t0_ns,
            "lost_records": {t.nic.name: t.lost for t in nic_traces if t.lost},
        },
        "netdam": {
            "version": TRACE_FILE_VERSION,
            "nics": [
                {
                    "rank": t.nic.rank,
                    "address": f"{t.nic.address[0]}:{t.nic.address[1]}",
                    "endpoint": endpoint_to_u64(t.nic.address),
                    "lost": t.lost,
                    "records": {name: t.records[name].tolist() for name in TRACE_DTYPE.names or ()},
                }
                for t in nic_traces
            ],
            "hosts": [asdict(c) for c in calls],
        },
    }


@dataclass
class _Chains:
    """What the flows between hops need of every NIC: each collective's block plan there
    (first chunk of each block, in block order) and the track of each block's span."""

    plans: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    tids: dict[tuple[int, int, int, int], int] = field(default_factory=dict)

    def block(self, pid: int, coll: int, epoch: int, seq: int) -> int | None:
        """The block of chunk *seq* of a collective's call at NIC *pid*, by its plan there."""
        firsts = self.plans.get((pid, coll, epoch))
        if firsts is None or not len(firsts) or seq < firsts[0]:
            return None
        return int(np.searchsorted(firsts, seq, side="right")) - 1


def _nic_events(
    records: np.ndarray,
    pid: int,
    tracks: _Tracks,
    clock: _Clock,
    events: list[dict[str, Any]],
    chains: _Chains,
) -> None:
    """One NIC's spans and instants; its block plans and block tracks go into *chains*."""
    kind = records["kind"]
    # Collectives: the START_COLL that began each call, its phases, its block plan.
    starts: dict[tuple[int, int], int] = {}
    phases: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    plans: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    failures: dict[tuple[int, int], int] = {}
    for r in records[(kind == TraceKind.RX) & (records["opcode"] == Opcode.START_COLL)]:
        starts.setdefault((int(r["coll_id"]), int(r["epoch"])), int(r["t_ns"]))
    for r in records[kind == TraceKind.PHASE]:
        key = (int(r["coll_id"]), int(r["epoch"]))
        phases[key].setdefault(int(r["status"]), int(r["t_ns"]))
        if r["status"] == TracePhase.FAILED:
            failures[key] = int(r["addr"])
    for r in records[kind == TraceKind.BLOCK]:
        key = (int(r["coll_id"]), int(r["epoch"]))
        plans[key].append((int(r["seq"]), int(r["addr"]), int(r["length"])))
    coll_spans: dict[int, _Spans] = {}
    for key in sorted(set(phases) | set(starts), key=lambda k: starts.get(k, phases[k].get(1, 0))):
        coll, epoch = key
        marks = phases.get(key, {})
        if TracePhase.START not in marks:
            continue  # the trace began after this call started here
        spans = coll_spans.setdefault(coll, _Spans(events, pid, tracks.tid(pid, f"coll {coll}")))
        begin = starts.get(key, marks[TracePhase.START])
        ends = [marks.get(p) for p in (TracePhase.COMPLETE, TracePhase.FAILED)]
        end = max((e for e in ends if e is not None), default=None)
        if end is None:
            end = max(marks.values())
        name = f"collective {coll} epoch {epoch}"
        args: dict[str, Any] = {"coll_id": coll, "epoch": epoch}
        if key in failures:
            args["failed"] = _status_name(failures[key])
        spans.add(name, clock.us(begin), clock.us(end), args)
        # The phases, nested inside: each from the end of the one before it.
        inner = _Spans(events, pid, spans.tid)
        inner.last_end = clock.us(begin)
        t = begin
        for phase, label in _PHASE_NAMES.items():
            if phase in marks:
                until = min(max(marks[phase], t), end)
                inner.add(label, clock.us(t), clock.us(until), {"coll_id": coll, "epoch": epoch})
                t = until
    _block_spans(records, pid, plans, tracks, clock, events, chains)
    _instants(records, pid, tracks, clock, events)


def _block_spans(
    records: np.ndarray,
    pid: int,
    plans: dict[tuple[int, int], list[tuple[int, int, int]]],
    tracks: _Tracks,
    clock: _Clock,
    events: list[dict[str, Any]],
    chains: _Chains,
) -> None:
    """Per block of each collective, the span its chain's chunks passed this NIC in."""
    chain = records[
        ((records["kind"] == TraceKind.RX) | (records["kind"] == TraceKind.TX))
        & (records["opcode"] == Opcode.CHAIN_ADD)
    ]
    by_track: dict[str, _Spans] = {}
    for key, plan in sorted(plans.items(), key=lambda kv: kv[0]):
        coll, epoch = key
        mine = chain[(chain["coll_id"] == coll) & (chain["epoch"] == epoch)]
        plan.sort()
        firsts = np.array([p[1] for p in plan], np.int64)
        chains.plans[(pid, coll, epoch)] = firsts
        if not len(mine):
            continue
        which = np.searchsorted(firsts, mine["seq"].astype(np.int64), side="right") - 1
        for b, first, count in plan:
            seen = mine[(which == b) & (mine["seq"] < first + count)]
            if not len(seen) or count == 0:
                continue
            track = f"coll {coll} block {b}"
            spans = by_track.setdefault(track, _Spans(events, pid, tracks.tid(pid, track)))
            start, end = int(seen["t_ns"].min()), int(seen["t_ns"].max())
            spans.add(
                f"block {b} chain",
                clock.us(start),
                clock.us(end),
                {"coll_id": coll, "epoch": epoch, "block": b, "chunks": count},
            )
            chains.tids[(pid, coll, epoch, b)] = spans.tid


def _chain_flows(
    ordered: Sequence[np.ndarray],
    pid_of: dict[int, int],
    chains: _Chains,
    clock: _Clock,
    events: list[dict[str, Any]],
) -> None:
    """A flow arrow per block and hop: from the first chunk a NIC sent on to the next hop, to
    that hop's first receipt of the block from it (*ordered*: each NIC's records by time)."""
    first_rx: dict[tuple[int, int, int, int, int], int] = {}  # (pid, src, coll, epoch, block)
    sends: list[tuple[int, int, int, int, int, int]] = []  # (pid, dst, coll, epoch, block, t)
    for k, r in enumerate(ordered):
        pid = k + 1
        moved = (r["kind"] == TraceKind.RX) | (r["kind"] == TraceKind.TX)
        for rec in r[moved & (r["opcode"] == Opcode.CHAIN_ADD)]:
            coll, epoch, seq = int(rec["coll_id"]), int(rec["epoch"]), int(rec["seq"])
            block = chains.block(pid, coll, epoch, seq)
            if block is None:
                continue
            peer = pid_of.get(int(rec["peer"]))
            if peer is None:
                continue
            if rec["kind"] == TraceKind.RX:
                first_rx.setdefault((pid, peer, coll, epoch, block), int(rec["t_ns"]))
            else:
                sends.append((pid, peer, coll, epoch, block, int(rec["t_ns"])))
    flow_id = 0
    done: set[tuple[int, int, int, int, int]] = set()
    for pid, peer, coll, epoch, block, t in sends:
        hop = (pid, peer, coll, epoch, block)
        if hop in done or (peer, pid, coll, epoch, block) not in first_rx:
            continue
        tid_from = chains.tids.get((pid, coll, epoch, block))
        tid_to = chains.tids.get((peer, coll, epoch, block))
        if tid_from is None or tid_to is None:
            continue
        done.add(hop)
        flow_id += 1
        t_rx = first_rx[(peer, pid, coll, epoch, block)]
        common = {"name": f"block {block}", "cat": "chain hop", "id": flow_id}
        events.append({**common, "ph": "s", "pid": pid, "tid": tid_from, "ts": clock.us(t)})
        events.append(
            {**common, "ph": "f", "bp": "e", "pid": peer, "tid": tid_to, "ts": clock.us(t_rx)}
        )


def _instants(
    records: np.ndarray, pid: int, tracks: _Tracks, clock: _Clock, events: list[dict[str, Any]]
) -> None:
    """Retransmits, NACKs this NIC sent (BUSY by name), and drops, as instants."""
    tid = 0
    kind = records["kind"]
    picked = records[
        (kind == TraceKind.RETRANSMIT)
        | (kind == TraceKind.DROP)
        | ((kind == TraceKind.TX) & (records["opcode"] == Opcode.NACK))
    ]
    for r in picked:
        if tid == 0:
            tid = tracks.tid(pid, "events")
        args: dict[str, Any] = {"coll_id": int(r["coll_id"]), "epoch": int(r["epoch"])}
        if r["kind"] == TraceKind.RETRANSMIT:
            name = "retransmit" if r["opcode"] == Opcode.CHAIN_ADD else "repair READ"
            args["chunk"] = int(r["seq"])
        elif r["kind"] == TraceKind.DROP:
            name = f"drop {_COUNTER_NAMES[int(r['status'])]}"
            args = {"datagrams": int(r["length"])}
        else:
            status = _status_name(int(r["status"]))
            name = "BUSY" if r["status"] == Status.BUSY else f"NACK {status}"
            args.update(status=status, seq=int(r["seq"]), to=int(r["peer"]))
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": clock.us(int(r["t_ns"])),
                "args": args,
            }
        )


def _host_call(call: HostCall, spans: _Spans, clock: _Clock) -> None:
    """A host rank's call: the whole call, then its issue, in-the-NICs and return phases."""
    start = clock.us(call.called_at * 1e9)
    marks = [call.sent_at, call.completed_at, call.finished_at]
    end = clock.us(max((m for m in marks if m is not None), default=call.called_at) * 1e9)
    args = {"coll_id": call.coll_id, "epoch": call.epoch, "ok": call.ok}
    spans.add(call.name, start, end, args)
    inner = _Spans(spans.out, spans.pid, spans.tid)
    inner.last_end = start
    t = call.called_at
    for label, until in (
        ("issue", call.sent_at),
        ("in the NICs", call.completed_at),
        ("return", call.finished_at),
    ):
        if until is not None:
            inner.add(label, clock.us(t * 1e9), min(clock.us(until * 1e9), end), args)
            t = until
