"""Discrete-event model: packets through per-stage queues with finite capacity and backpressure.

No closed-form throughput or latency in here: a heap of timed events moves each packet
through each stage (pipeline.Stage), one at a time:

- a packet waits in the stage's input queue (``capacity`` packets) until the stage's server
  is free (``ii_s`` after the previous start) and a slot is free (``max_inflight``);
- it leaves ``latency_s`` (+ sampled jitter) after its start, in start order;
- if the next stage's queue is full it stays, holding its slot: backpressure propagates
  upstream to the source. A *saturating* source is paused by it (flow control, as PFC or
  credits do); a *timed* source cannot be paused (a wire), so packets that find the first
  queue full are dropped.

Several flows may share a tail of stages (incast: N senders into one switch port).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .pipeline import Stage

_TRY, _DONE, _SRC = 0, 1, 2


@dataclass(frozen=True)
class Source:
    """Packets entering one flow.

    ``period_s`` None: saturating (a packet is offered whenever the first queue has room).
    Otherwise packets arrive every ``period_s`` (exponential gaps with ``poisson``) and are
    dropped when the first queue is full.
    """

    packets: int
    period_s: float | None = None
    poisson: bool = False
    start_s: float = 0.0


@dataclass(frozen=True)
class DesResult:
    """What the simulation measured."""

    offered: int
    delivered: int
    dropped: int
    throughput_pps: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    latency_min_s: float
    max_queue: dict[str, int]
    per_flow_pps: tuple[float, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "offered": self.offered,
            "delivered": self.delivered,
            "dropped": self.dropped,
            "mpps": self.throughput_pps / 1e6,
            "latency_mean_s": self.latency_mean_s,
            "latency_p50_s": self.latency_p50_s,
            "latency_p99_s": self.latency_p99_s,
            "latency_max_s": self.latency_max_s,
            "max_queue": self.max_queue,
        }


class _Node:
    """Run-time state of one stage."""

    __slots__ = (
        "spec",
        "queue",
        "busy_until",
        "inflight",
        "order",
        "done",
        "next",
        "waiters",
        "waiting",
        "try_at",
        "max_queue",
        "key",
    )

    def __init__(self, spec: Stage, key: int) -> None:
        self.spec = spec
        self.key = key
        self.queue: deque[int] = deque()
        self.busy_until = 0.0
        self.inflight = 0
        self.order: deque[int] = deque()
        self.done: set[int] = set()
        self.next: _Node | None = None
        self.waiters: deque[int] = deque()  # node keys (>= 0) or sources (-1 - index)
        self.waiting = False
        self.try_at = -1.0
        self.max_queue = 0


class _Sim:
    def __init__(
        self,
        flows: Sequence[Sequence[Stage]],
        tail: Sequence[Stage],
        sources: Sequence[Source],
        seed: int,
    ) -> None:
        if len(flows) != len(sources):
            raise ValueError("one source per flow")
        self.rng = random.Random(seed)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.nodes: list[_Node] = []
        tail_nodes = [self._add(s) for s in tail]
        for a, b in zip(tail_nodes, tail_nodes[1:]):
            a.next = b
        self.heads: list[_Node] = []
        for flow in flows:
            chain = [self._add(s) for s in flow]
            for a, b in zip(chain, chain[1:]):
                a.next = b
            if chain:
                chain[-1].next = tail_nodes[0] if tail_nodes else None
                self.heads.append(chain[0])
            elif tail_nodes:
                self.heads.append(tail_nodes[0])
            else:
                raise ValueError("a flow needs at least one stage")
        self.sources = list(sources)
        self.sent = [0] * len(sources)
        self.enter: dict[int, float] = {}
        self.flow_of: dict[int, int] = {}
        self.exits: list[tuple[float, int]] = []
        self.dropped = 0
        self.next_id = 0

    def _add(self, spec: Stage) -> _Node:
        node = _Node(spec, len(self.nodes))
        self.nodes.append(node)
        return node

    def push(self, t: float, kind: int, key: int, pkt: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, pkt))

    # --- packet movement -------------------------------------------------------------
    def offer(self, node: _Node, pkt: int, now: float) -> bool:
        if len(node.queue) >= node.spec.capacity:
            return False
        node.queue.append(pkt)
        node.max_queue = max(node.max_queue, len(node.queue))
        self.try_start(node, now)
        return True

    def try_start(self, node: _Node, now: float) -> None:
        spec = node.spec
        started = False
        while node.queue and node.inflight < spec.slots:
            if now < node.busy_until:
                if node.try_at != node.busy_until:
                    node.try_at = node.busy_until
                    self.push(node.busy_until, _TRY, node.key, -1)
                break
            pkt = node.queue.popleft()
            started = True
            node.inflight += 1
            node.busy_until = now + spec.ii_s
            node.order.append(pkt)
            self.push(now + self.sample_latency(spec), _DONE, node.key, pkt)
        if started:
            self.wake(node, now)

    def sample_latency(self, spec: Stage) -> float:
        if spec.jitter_s <= 0.0:
            return spec.latency_s
        low = -min(3.0 * spec.jitter_s, 0.5 * spec.latency_s)
        extra = min(max(self.rng.gauss(0.0, spec.jitter_s), low), spec.jitter_max_s)
        return spec.latency_s + extra

    def retire(self, node: _Node, now: float) -> None:
        """Send finished packets on, in start order, as far as the next queue has room."""
        moved = False
        while node.order and node.order[0] in node.done:
            pkt = node.order[0]
            nxt = node.next
            if nxt is None:
                self.exits.append((now, pkt))
            elif not self.offer(nxt, pkt, now):
                if not node.waiting:
                    node.waiting = True
                    nxt.waiters.append(node.key)
                break
            node.order.popleft()
            node.done.discard(pkt)
            node.inflight -= 1
            moved = True
        if moved:
            self.try_start(node, now)

    def wake(self, node: _Node, now: float) -> None:
        """Room appeared in *node*'s queue: let blocked upstream stages or sources move."""
        while node.waiters and len(node.queue) < node.spec.capacity:
            key = node.waiters.popleft()
            if key >= 0:
                up = self.nodes[key]
                up.waiting = False
                self.retire(up, now)
            else:
                self.pump(-1 - key, now)

    def pump(self, flow: int, now: float) -> None:
        """A saturating source offers packets while the first queue takes them."""
        src, head = self.sources[flow], self.heads[flow]
        while self.sent[flow] < src.packets:
            pkt = self.new_packet(flow, now)
            if not self.offer(head, pkt, now):
                self.next_id -= 1
                del self.enter[pkt], self.flow_of[pkt]
                head.waiters.append(-1 - flow)
                return
            self.sent[flow] += 1

    def new_packet(self, flow: int, now: float) -> int:
        pkt = self.next_id
        self.next_id += 1
        self.enter[pkt] = now
        self.flow_of[pkt] = flow
        return pkt

    def arrival(self, flow: int, now: float) -> None:
        src = self.sources[flow]
        pkt = self.new_packet(flow, now)
        self.sent[flow] += 1
        if not self.offer(self.heads[flow], pkt, now):
            self.dropped += 1
        if self.sent[flow] < src.packets and src.period_s is not None:
            gap = self.rng.expovariate(1.0 / src.period_s) if src.poisson else src.period_s
            self.push(now + gap, _SRC, flow, -1)

    def run(self) -> None:
        for i, src in enumerate(self.sources):
            if src.period_s is None:
                self.push(src.start_s, _SRC, i, -2)
            else:
                self.push(src.start_s, _SRC, i, -1)
        while self.heap:
            now, _, kind, key, pkt = heapq.heappop(self.heap)
            if kind == _SRC:
                if pkt == -2:
                    self.pump(key, now)
                else:
                    self.arrival(key, now)
            elif kind == _TRY:
                node = self.nodes[key]
                if now != node.try_at:
                    continue  # superseded: a later retry for this stage is already queued
                node.try_at = -1.0
                self.try_start(node, now)
            else:
                node = self.nodes[key]
                node.done.add(pkt)
                self.retire(node, now)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[idx]


def simulate(
    flows: Sequence[Sequence[Stage]],
    sources: Sequence[Source],
    tail: Sequence[Stage] = (),
    seed: int = 1,
    warmup: float = 0.1,
) -> DesResult:
    """Run packets of each source through its flow's stages, then the shared *tail*.

    Throughput counts delivered packets after the first *warmup* fraction, over the time
    between their departures; latencies cover every delivered packet.
    """
    sim = _Sim(flows, tail, sources, seed)
    sim.run()
    exits = sorted(sim.exits)
    lat = sorted(t - sim.enter[p] for t, p in exits)
    skip = min(int(len(exits) * warmup), max(0, len(exits) - 2))
    window = exits[skip:]
    span = window[-1][0] - window[0][0] if len(window) > 1 else 0.0
    throughput = (len(window) - 1) / span if span > 0 else 0.0
    per_flow: list[float] = []
    for flow in range(len(sources)):
        times = [t for t, p in window if sim.flow_of[p] == flow]
        per_flow.append((len(times) - 1) / span if span > 0 and len(times) > 1 else 0.0)
    return DesResult(
        offered=sum(sim.sent),
        delivered=len(exits),
        dropped=sim.dropped,
        throughput_pps=throughput,
        latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
        latency_p50_s=_percentile(lat, 0.50),
        latency_p99_s=_percentile(lat, 0.99),
        latency_max_s=lat[-1] if lat else 0.0,
        latency_min_s=lat[0] if lat else 0.0,
        max_queue={
            n.spec.name
            if n.spec.name not in {m.spec.name for m in sim.nodes if m is not n}
            else f"{n.spec.name}#{n.key}": n.max_queue
            for n in sim.nodes
        },
        per_flow_pps=tuple(per_flow),
    )


def saturated(stages: Sequence[Stage], packets: int = 400, seed: int = 1) -> DesResult:
    """One flow, a source that always has a packet ready (paused only by backpressure)."""
    return simulate([stages], [Source(packets)], seed=seed)


def unloaded(stages: Sequence[Stage], packets: int = 100, seed: int = 1) -> DesResult:
    """One flow, packets spaced far apart so none ever waits: the latency distribution."""
    gap = 4.0 * sum(s.latency_s + s.ii_s + s.jitter_max_s for s in stages)
    return simulate([stages], [Source(packets, period_s=gap)], seed=seed, warmup=0.0)


def offered_load(
    stages: Sequence[Stage],
    period_s: float,
    packets: int = 2000,
    poisson: bool = False,
    seed: int = 1,
) -> DesResult:
    """One flow at a fixed offered rate; packets that find the first queue full are lost."""
    return simulate([stages], [Source(packets, period_s=period_s, poisson=poisson)], seed=seed)


def incast(
    sender: Sequence[Stage],
    tail: Sequence[Stage],
    senders: int,
    packets_each: int,
    period_s: float | None,
    seed: int = 1,
) -> DesResult:
    """*senders* identical flows converging on one shared *tail* (switch port + receiver)."""
    flows = [list(sender) for _ in range(senders)]
    srcs = [Source(packets_each, period_s=period_s, start_s=i * 1e-12) for i in range(senders)]
    return simulate(flows, srcs, tail=tail, seed=seed)
