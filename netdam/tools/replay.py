"""``netdam model replay``: a recorded trace's collectives, packet for packet, through the cycle
model (fpga_model.replay): what that exact run, with its losses and its start skew, would take
on NetDAM cards, beside its wall clock and the model's clean-run estimate of the same job.

From the ``netdam`` section of a trace file (netdam.core.timeline): every datagram one NIC
received from another, per call (coll_id, epoch), becomes a delivery with the packet shape its
opcode has, and with its cause: the latest datagram its sender had received of the same chunk
(a chain forwarded, a stored chunk multicast, a READ answered; for ACKs, NACKs and DONEs the
latest of the call), or none when the sender originated it (a chain's first hop, a re-send).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdam.fpga_model.collectives import netdam_chain
from netdam.fpga_model.params import NetdamParams
from netdam.fpga_model.replay import Delivery, ReplayResult, replay
from netdam.protocol.constants import (
    HEADER_SIZE,
    SEGMENT_SIZE,
    TAG_SIZE,
    Flags,
    Opcode,
    Status,
    TraceKind,
    TracePhase,
)
from netdam.protocol.trace import TRACE_DTYPE

#: Opcodes that carry a chunk, and what they make their receiver do.
_DATA = {Opcode.ALL_WRITE: "write", Opcode.READ_RESP: "write", Opcode.READ: "read"}
#: The datagrams of a collective a replay takes (control and pool traffic are not the job's).
_TAKEN = frozenset(
    {Opcode.CHAIN_ADD, Opcode.ALL_WRITE, Opcode.READ, Opcode.READ_RESP, Opcode.ACK, Opcode.NACK}
)


#: A datagram between two members: (src, dst, opcode, seq, addr).
_Key = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class CallReplay:
    """One call of the trace: its wall clock in the emulator, its replay with and without the
    recorded start skew, and the model's estimate of the same job run clean (what the losses
    and re-sends cost on the cards is the difference)."""

    coll_id: int
    epoch: int
    nics: int
    nbytes: int
    wall_s: float
    replayed: ReplayResult
    no_skew: ReplayResult
    estimate_s: float

    def as_dict(self) -> dict[str, object]:
        return {
            "coll_id": self.coll_id,
            "epoch": self.epoch,
            "nics": self.nics,
            "bytes": self.nbytes,
            "wall_seconds": self.wall_s,
            "replay_seconds": self.replayed.seconds,
            "replay_seconds_no_skew": self.no_skew.seconds,
            "resends": self.no_skew.retries,
            "skew_seconds": self.replayed.skew_s,
            "deliveries": self.replayed.deliveries,
            "model_clean_seconds": self.estimate_s,
            "replay_no_skew_vs_model": self.no_skew.seconds / self.estimate_s
            if self.estimate_s
            else None,
        }


def records_of(trace: dict[str, Any]) -> list[tuple[int, np.ndarray]]:
    """(endpoint, records) of every NIC in a trace file's ``netdam`` section."""
    section = trace.get("netdam")
    if not isinstance(section, dict) or "nics" not in section:
        raise ValueError("no `netdam` section: not a trace written by netdam (api.trace, --trace)")
    out = []
    for nic in section["nics"]:
        columns = nic["records"]
        records = np.zeros(len(columns["t_ns"]), TRACE_DTYPE)
        for name in TRACE_DTYPE.names or ():
            records[name] = columns[name]
        out.append((int(nic["endpoint"]), np.sort(records, order="t_ns", kind="stable")))
    return out


def _data_bytes(r: np.void) -> int:
    """Payload bytes of a recorded datagram: its length less header, SR list and tag trailer."""
    tag = TAG_SIZE if int(r["flags"]) & Flags.TAGGED else 0
    return int(max(int(r["length"]) - HEADER_SIZE - SEGMENT_SIZE * int(r["seg_count"]) - tag, 0))


def replay_trace(
    trace: dict[str, Any], params: NetdamParams, rto_s: float = 20e-6
) -> list[CallReplay]:
    """Every call of the trace that started and completed on every NIC it names, replayed."""
    nics = records_of(trace)
    index = {endpoint: k for k, (endpoint, _) in enumerate(nics)}
    calls: dict[tuple[int, int], dict[int, dict[int, int]]] = defaultdict(dict)
    for k, (_, records) in enumerate(nics):
        for r in records[records["kind"] == TraceKind.PHASE]:
            key = (int(r["coll_id"]), int(r["epoch"]))
            calls[key].setdefault(k, {})[int(r["status"])] = int(r["t_ns"])
    out = []
    for (coll, epoch), phases in sorted(
        calls.items(), key=lambda kv: min(p.get(TracePhase.START, 0) for p in kv[1].values())
    ):
        if not all(TracePhase.START in p and TracePhase.COMPLETE in p for p in phases.values()):
            continue  # began before the trace, or failed: nothing a replay could compare
        members = sorted(phases)
        out.append(_replay_call(nics, index, coll, epoch, members, phases, params, rto_s))
    return out


def _replay_call(
    nics: list[tuple[int, np.ndarray]],
    index: dict[int, int],
    coll: int,
    epoch: int,
    members: list[int],
    phases: dict[int, dict[int, int]],
    params: NetdamParams,
    rto_s: float,
) -> CallReplay:
    slot = {k: m for m, k in enumerate(members)}
    # Every datagram a member received from another member in this call, in time order.
    got: list[tuple[int, int, int, np.void]] = []  # (t_ns, dst, src, record)
    for k in members:
        for r in _of_call(nics[k][1], TraceKind.RX, coll, epoch):
            src = index.get(int(r["peer"]))
            # A NIC hears its own multicast back on loopback; a switch never sends a group's
            # datagram back out of the port it came in by.
            if src in slot and src != k and int(r["opcode"]) in _TAKEN:
                got.append((int(r["t_ns"]), slot[k], slot[src], r))
    got.sort(key=lambda g: g[0])
    # Every datagram a member sent another in this call, for the attempts that arrived nowhere.
    sent: dict[_Key, list[int]] = defaultdict(list)
    endpoint = {slot[k]: nics[k][0] for k in members}
    by_endpoint = {e: m for m, e in endpoint.items()}
    for k in members:
        for r in _of_call(nics[k][1], TraceKind.TX, coll, epoch):
            dst = by_endpoint.get(int(r["peer"]))
            if dst is not None:
                sent[(slot[k], dst, int(r["opcode"]), int(r["seq"]), int(r["addr"]))].append(
                    int(r["t_ns"])
                )
    # When each member was ready (it held every chunk it needed and its chains were ACKed): it
    # sent its DONEs then, and its RESUME (an ACK of address 0 as well) only before, at start.
    ready_at = {
        slot[k]: max(phases[k].get(TracePhase.CHAINS, 0), phases[k].get(TracePhase.CHUNKS, 0))
        for k in members
    }
    # When each member's DONEs (ACKs of address 0 after it was ready) reached each other member.
    done_rx: dict[tuple[int, int], list[int]] = defaultdict(list)
    for t, dst, src, r in got:
        if _done_or_resume(r) and t >= ready_at[src]:
            done_rx[(src, dst)].append(t)
    deliveries: list[Delivery] = []
    rx_t: list[int] = []  # when each delivery was taken
    rx_seq: list[int] = []  # and its seq
    rx_addr: list[int] = []  # and its address
    # What each member took so far, in time order: all of it, and by (chunk, opcode).
    seen: dict[int, list[tuple[int, int]]] = defaultdict(list)  # dst -> (t, k)
    by_chunk: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    needed: dict[int, list[int]] = defaultdict(list)  # dst -> the chunks and ACKs it waited for
    attempts: dict[_Key, int] = {}  # the last originated attempt of each datagram
    multicast: dict[tuple[int, int | None, int], int] = {}  # (src, cause, seq) -> first copy
    gathered: dict[tuple[int, int, int], int] = {}  # (src, dst, seq) -> the ALL_WRITE taken
    done_from: set[tuple[int, int]] = set()  # (src, dst): a DONE of src reached dst
    busy_nacks: list[tuple[int, int, int, int, int]] = []  # (t left, sent by, to, seq, addr)
    for t, dst, src, r in got:
        op_code, seq, addr = int(r["opcode"]), int(r["seq"]), int(r["addr"])
        key = (src, dst, op_code, seq, addr)
        if op_code == Opcode.NACK and int(r["status"]) == Status.BUSY:
            # When it left the refusing NIC (its TX record; its arrival, which may come
            # milliseconds later on a loaded machine, when that was not recorded).
            left = [s for s in sent[key] if s <= t]
            busy_nacks.append((left[-1] if left else t, src, dst, seq, addr))
        op, data = _shape(r)
        retry_of = None
        lost = 0
        joins: tuple[int, ...] = ()
        resume = False
        repair = op_code == Opcode.READ
        member_message = _done_or_resume(r)
        if member_message and t < ready_at[src]:
            # A RESUME (sent at start, asking again for what this member refused): it exists
            # only because of start skew.
            cause, resume = None, True
        elif member_message:
            # A DONE. The first from src completes dst's wait for it; the others (answers to
            # dst's own DONE, re-sends that crossed it) change nothing. Sent when src was
            # ready: after the last of the chunks and ACKs it waited for.
            if (src, dst) in done_from:
                continue
            done_from.add((src, dst))
            waited = [j for j in needed[src] if rx_t[j] < t]
            cause = waited[-1] if waited else None
            joins = tuple(waited[:-1])
            # Copies sent before this first one arrived that arrived nowhere: those sent less
            # those that arrived at all (a copy merely slower than the engine's re-send, as on a
            # loaded machine, arrives later and cost the cards nothing).
            before = _rounds(s for s in sent[key] if ready_at[src] <= s < t)
            lost = max(before - _rounds(done_rx[(src, dst)]), 0)
        elif repair:
            # A repair READ: asked after a stall, timed from the last datagram its NIC took.
            cause = _last_before(seen[src], t)
        else:
            cause = _cause(seen[src], by_chunk, src, t, seq, op_code, addr)
        if cause is None and not resume and not joins:
            retry_of = attempts.get(key)
            attempts[key] = len(deliveries)
            # The attempts sent since the one before that arrived nowhere (lost on the way).
            since = rx_t[retry_of] if retry_of is not None else -1
            lost = max(sum(1 for s in sent[key] if since < s < t) - 1, 0)
        deliveries.append(
            Delivery(
                src,
                dst,
                op,
                data,
                int(r["seg_count"]),
                cause=cause,
                retry_of=retry_of,
                lost_before=lost,
                after_timeout=repair,
                joins=joins,
                same_send_as=multicast.setdefault((src, cause, seq), len(deliveries))
                if op_code == Opcode.ALL_WRITE and cause is not None
                else None,
                busy_answer=resume or (op_code == Opcode.NACK and int(r["status"]) == Status.BUSY),
            )
        )
        k = len(deliveries) - 1
        rx_t.append(t)
        rx_seq.append(seq)
        rx_addr.append(addr)
        seen[dst].append((t, k))
        by_chunk[(dst, seq, op_code)].append((t, k))
        if op in ("write", "add-store") or (op_code == Opcode.ACK and addr):
            needed[dst].append(k)  # a chunk, or the ACK of a chain dst began
        if op_code == Opcode.ALL_WRITE:
            # The same chunk again from its owner: the member's RESUME asked for it, because
            # the first reached it before it had started and was dropped as early (SPEC.md
            # 4.1). Without skew that first one would have been taken: it did nothing here.
            earlier = gathered.get((src, dst, seq))
            if earlier is not None:
                deliveries[earlier] = dataclasses.replace(deliveries[earlier], busy=True)
            gathered[(src, dst, seq)] = k
    # A NACK BUSY (sent to the chain's first hop) answers the latest datagram of its chunk, same
    # seq and address, the refusing NIC took before the NACK left. A member's DONE or RESUME
    # also carries a seq (its sender's rank, address 0), and on a loaded machine one may reach
    # the refusing NIC between the refusal and the NACK's arrival. That datagram did nothing,
    # nor did the hops of its chain before it (marked too: without skew none of them happens,
    # and the chain's next attempt is its first).
    for t_nack, by, _, seq, addr in busy_nacks:
        taken = sorted(
            tk
            for op in _TAKEN
            for tk in by_chunk.get((by, seq, int(op)), ())
            if rx_addr[tk[1]] == addr
        )
        answered = _last_before(taken, t_nack + 1)
        if answered is None:
            continue
        hop: int | None = answered
        while hop is not None:
            deliveries[hop] = dataclasses.replace(deliveries[hop], busy=True)
            hop = deliveries[hop].cause
    first = min(phases[k][TracePhase.START] for k in members)
    offsets = [(phases[k][TracePhase.START] - first) * 1e-9 for k in members]
    wall = (max(phases[k][TracePhase.COMPLETE] for k in members) - first) * 1e-9
    stored = {rx_seq[k]: d.data_bytes for k, d in enumerate(deliveries) if d.op == "add-store"}
    nbytes = sum(stored.values())
    return CallReplay(
        coll_id=coll,
        epoch=epoch,
        nics=len(members),
        nbytes=nbytes,
        wall_s=wall,
        replayed=replay(params, deliveries, len(members), offsets, rto_s),
        no_skew=replay(params, deliveries, len(members), None, rto_s),
        estimate_s=netdam_chain(params, len(members), nbytes).seconds
        if len(members) > 1 and nbytes
        else 0.0,
    )


#: A DONE sent twice less than this apart went out once (at readiness, with the answer to a
#: DONE that came first); the engine's re-sends are an RTO apart, at least 20 ms
#: (RTO_MIN_S, netdam/kernels/collective.py).
_SAME_ROUND_NS = 1_000_000


def _rounds(times: Iterable[int]) -> int:
    """How many times a message went out, counting sends closer than _SAME_ROUND_NS as one."""
    rounds, last = 0, None
    for t in sorted(times):
        if last is None or t - last >= _SAME_ROUND_NS:
            rounds += 1
        last = t
    return rounds


def _done_or_resume(r: np.void) -> bool:
    """A member's DONE or RESUME: an ACK of address 0, seq its sender's rank (a chain's ACK
    names its chunk's address)."""
    return int(r["opcode"]) == Opcode.ACK and int(r["addr"]) == 0


def _of_call(records: np.ndarray, kind: TraceKind, coll: int, epoch: int) -> np.ndarray:
    """A NIC's records of *kind* in one call."""
    picked: np.ndarray = records[
        (records["kind"] == kind) & (records["coll_id"] == coll) & (records["epoch"] == epoch)
    ]
    return picked


#: What a NIC forwards or answers a chunk's datagram in answer to: the datagram of that chunk it
#: received last (others are originated: a chain's first hop, a repair READ, a re-send).
_CAUSED_BY = {
    Opcode.CHAIN_ADD: Opcode.CHAIN_ADD,  # forwarded down the chain
    Opcode.ALL_WRITE: Opcode.CHAIN_ADD,  # the stored chunk multicast
    Opcode.READ_RESP: Opcode.READ,  # a repair READ answered
}


def _cause(
    received: list[tuple[int, int]],
    by_chunk: dict[tuple[int, int, int], list[tuple[int, int]]],
    nic: int,
    before: int,
    seq: int,
    op: int,
    addr: int,
) -> int | None:
    """The delivery whose processing made *nic* send datagram *op* of chunk *seq*: the one of
    that chunk it received last before *before* (_CAUSED_BY; a chain's ACK, which names the
    chunk's address, answers the chain's last hop); for a NACK, a DONE or a RESUME (an ACK of
    address 0, seq the sender's rank), the last of the call it received; None when it
    originated there."""
    if op == Opcode.ACK and addr:
        return _last_before(by_chunk.get((nic, seq, int(Opcode.CHAIN_ADD)), []), before)
    if op in (Opcode.ACK, Opcode.NACK):
        return _last_before(received, before)
    want = _CAUSED_BY.get(Opcode(op))
    if want is None:
        return None
    return _last_before(by_chunk.get((nic, seq, int(want)), []), before)


def _last_before(taken: list[tuple[int, int]], before: int) -> int | None:
    """The delivery of the last (time, delivery) of *taken* (in time order) before *before*."""
    at = bisect.bisect_left(taken, (before, -1))
    return taken[at - 1][1] if at else None


def _shape(r: np.void) -> tuple[str, int]:
    """The cycle model's op and data bytes of a received datagram."""
    op = int(r["opcode"])
    if op == Opcode.CHAIN_ADD:
        return ("add-store" if int(r["seg_left"]) == 0 else "add"), _data_bytes(r)
    if op in _DATA:
        return _DATA[Opcode(op)], _data_bytes(r)
    return "control", 0
