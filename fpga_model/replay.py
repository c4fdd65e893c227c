"""Replay: one recorded run's packets through the cycle model, for what that run (its losses,
its start skew) would take on NetDAM cards.

The run is a list of deliveries: a datagram that reached NIC ``dst`` from NIC ``src``, of the
packet shape its instruction has (pipeline.netdam_shape), with what made ``src`` send it: the
delivery whose processing produced it (a chain forwarded, a stored chunk multicast, a READ
answered), or nothing (it originated at ``src``: a chain's first hop, a re-send). Lost
datagrams are absent: what they cost is the re-send that came after them.

A discrete-event replay over the cycle model's per-packet stage costs:

- each NIC's pipeline is one server: a delivery starts when it has arrived and the pipeline
  has accepted the one before it by the bottleneck stage's interval (``1 / pipeline_rate``),
  and its output (the forwarded chunk, the answer) leaves ``pipeline_latency_s`` after its
  start, less the receive wire stage, which overlaps the sender's transmit;
- between NICs a hop costs ``propagation_s + switch_latency_s``; a NIC's port sends one
  datagram at a time at line rate, its forwards and the chains it starts alike (a multicast
  once: the switch makes the copies);
- a packet originated at a NIC leaves at that NIC's start (its recorded offset, the run's
  skew; 0 without skew), paced at line rate behind the NIC's earlier originated packets, and a
  repeated attempt (a retransmit, or a chain asked again after BUSY) leaves ``rto_s`` after
  the attempt before it, as the engine's timer would send it, one ``rto_s`` more for each
  attempt lost on the way; a repair READ leaves ``rto_s`` after the last datagram its NIC
  took before it (the stall that made it ask);
- a delivery its receiver answered BUSY did nothing there (it had not started): without skew
  no member starts late, so those deliveries and the BUSY answers are left out, and the
  attempt after them counts as the first.

The per-packet costs are those of ``collectives.netdam_chain`` (both from ``pipeline``): a
clean run, recorded or built by hand, replays at its closed form within 1% (fpga_model/README.md,
"Replay").
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from . import wire
from .analytic import pipeline_latency_s, pipeline_rate
from .params import NetdamParams
from .pipeline import netdam_shape, netdam_stages

_SEND, _ARRIVE = 0, 1

#: Packet shapes a delivery may have: the NetDAM ops, and "control" for header-only
#: messages (ACK, NACK, DONE), costed as a WRITE of no data.
REPLAY_OPS = ("read", "write", "add", "add-store", "control")


@dataclass(frozen=True)
class Delivery:
    """One datagram that reached ``dst`` from ``src`` (indices of the run's NICs)."""

    src: int
    dst: int
    op: str
    data_bytes: int
    segments: int = 0
    #: Index (in the run's list) of the delivery whose processing at src sent this one;
    #: None: it originated at src.
    cause: int | None = None
    #: Index of the earlier attempt this originated delivery repeats (None: the first).
    retry_of: int | None = None
    #: Attempts sent before this one (since the one it repeats, or the start) that arrived
    #: nowhere: each cost the sender a timeout.
    lost_before: int = 0
    #: Sent when a timer ran out after its cause (a repair READ after a stall), not at once.
    after_timeout: bool = False
    #: Other deliveries src must also have processed before it sends this one: it leaves
    #: when the last of them and its cause is done (a DONE waits for every chunk and ACK its
    #: sender needed).
    joins: tuple[int, ...] = ()
    #: Index of another delivery of the same transmission (a multicast's copies: the switch
    #: replicates, the sender's link carries it once).
    same_send_as: int | None = None
    #: dst answered it BUSY (it had not started the collective): it did nothing there.
    busy: bool = False
    #: A BUSY answer (a NACK), which exists only because of start skew.
    busy_answer: bool = False


@dataclass(frozen=True)
class ReplayResult:
    """What the replay found: the run's end on the cards, and the re-sends in it (chains sent
    again, lost attempts, repair READs)."""

    seconds: float
    deliveries: int
    retries: int
    rto_s: float
    skew_s: float
    per_nic_busy_s: tuple[float, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {
            "seconds": self.seconds,
            "deliveries": self.deliveries,
            "retries": self.retries,
            "rto_s": self.rto_s,
            "skew_s": self.skew_s,
        }


@lru_cache(maxsize=256)
def _costs(p: NetdamParams, op: str, data_bytes: int, segments: int) -> tuple[float, float]:
    """(interval, latency after the receive wire) of one packet of this shape at a NIC."""
    shape = netdam_shape("write" if op == "control" else op, data_bytes, segments)
    stages = netdam_stages(p, shape)
    rate, _ = pipeline_rate(stages)
    return 1.0 / rate, pipeline_latency_s(stages) - stages[0].latency_s


def _serialization_s(p: NetdamParams, op: str, data_bytes: int, segments: int) -> float:
    shape = netdam_shape("write" if op == "control" else op, data_bytes, segments)
    return wire.serialization_seconds(wire.wire_bytes(shape.request_frame_bytes), p.link_gbps)


def replay(
    p: NetdamParams,
    deliveries: Sequence[Delivery],
    nics: int,
    start_offsets_s: Sequence[float] | None = None,
    rto_s: float = 20e-6,
) -> ReplayResult:
    """The run's deliveries on cards of *p*: when the last of them is done. *start_offsets_s*:
    when each NIC started, from the first (None or zeros: no skew; then BUSY is left out)."""
    skewed = start_offsets_s is not None and any(t > 0 for t in start_offsets_s)
    offsets = list(start_offsets_s) if start_offsets_s is not None else [0.0] * nics
    if len(offsets) != nics:
        raise ValueError(f"{len(offsets)} start offsets for {nics} NICs")
    for d in deliveries:
        if d.op not in REPLAY_OPS:
            raise ValueError(f"unknown op {d.op!r}; choose one of {', '.join(REPLAY_OPS)}")
    kept = [skewed or not (d.busy or d.busy_answer) for d in deliveries]
    hop = p.propagation_s + p.switch_latency_s
    children: dict[int, list[int]] = {}
    waiting: dict[int, int] = {}  # caused deliveries: how many of their causes are not done
    for k, d in enumerate(deliveries):
        if kept[k] and d.cause is not None:
            causes = {d.cause, *(j for j in d.joins if kept[j])}
            waiting[k] = len(causes)
            for j in causes:
                children.setdefault(j, []).append(k)
    # Events: (time, order, kind, delivery). SEND: ready to leave its sender, which puts it on
    # its link when the link is free (a NIC's forwards and its own chains share one port);
    # ARRIVE: at its receiver's pipeline.
    events: list[tuple[float, int, int, int]] = []
    order = 0
    ready: dict[int, float] = {}
    retries = 0
    for k, d in enumerate(deliveries):
        if not kept[k] or d.cause is not None:
            continue
        first = d.retry_of
        while first is not None and not kept[first]:  # a BUSY-answered attempt: not there
            first = deliveries[first].retry_of
        if first is None:
            at = offsets[d.src] + rto_s * d.lost_before
        else:
            at = ready[first] + rto_s * (1 + d.lost_before)
        retries += d.lost_before + (first is not None)
        ready[k] = at
        events.append((at, order, _SEND, k))
        order += 1
    heapq.heapify(events)
    link_free = [0.0] * nics
    departed: dict[int, float] = {}
    free = [0.0] * nics
    busy = [0.0] * nics
    end = 0.0
    causes_done: dict[int, float] = {}
    while events:
        t, _, kind, k = heapq.heappop(events)
        d = deliveries[k]
        if kind == _SEND:
            twin = d.same_send_as
            if twin is not None and twin in departed:
                leave = departed[twin]  # the same multicast, already on the wire
            else:
                leave = max(t, link_free[d.src]) + _serialization_s(
                    p, d.op, d.data_bytes, d.segments
                )
                link_free[d.src] = leave
            departed[k] = leave
            heapq.heappush(events, (leave + hop, order, _ARRIVE, k))
            order += 1
            continue
        interval, latency = _costs(p, d.op, d.data_bytes, d.segments)
        start = max(t, free[d.dst])
        free[d.dst] = start + interval
        busy[d.dst] += interval
        done = start + latency
        end = max(end, done)
        retries += d.after_timeout
        for child in children.get(k, ()):
            waiting[child] -= 1
            causes_done[child] = max(causes_done.get(child, 0.0), done)
            if waiting[child]:
                continue  # it waits for another of its causes too
            c = deliveries[child]
            last = causes_done[child]
            # Its pipeline latency ends with the child's last bit out: it is ready to go on the
            # link its serialization before that (or a timer later, a repair READ; one more
            # for each attempt of it lost on the way).
            leave_at = last - _serialization_s(p, c.op, c.data_bytes, c.segments)
            at = (last + rto_s if c.after_timeout else leave_at) + rto_s * c.lost_before
            retries += c.lost_before
            heapq.heappush(events, (at, order, _SEND, child))
            order += 1
    return ReplayResult(
        seconds=end,
        deliveries=sum(kept),
        retries=retries,
        rto_s=rto_s,
        skew_s=max(offsets) if skewed else 0.0,
        per_nic_busy_s=tuple(busy),
    )
